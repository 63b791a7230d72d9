"""The suite is two pytest runs (`make test`): the main one, and tests/unsloth under TRAIN2048_UNSLOTH_TIER=1.

Unsloth patches transformers, PEFT and TRL process-wide as it is imported, so its tier never shares a process with the
rest: each run collects only its own tests.
"""

import os

collect_ignore_glob = ["test_*.py"] if os.environ.get("TRAIN2048_UNSLOTH_TIER") == "1" else ["unsloth/*"]
