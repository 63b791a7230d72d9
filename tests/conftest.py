"""The suite is two pytest runs (`make test`): the main one, and tests/unsloth under TRAIN2048_UNSLOTH_TIER=1.

Unsloth patches transformers, PEFT and TRL process-wide as it is imported, so its tier never shares a process with the
rest: each run collects only its own tests.
"""

import os

# The main run ignores the tier's folder itself, not only its files: pytest loads a folder's conftest.py while it
# collects there, and the tier's imports Unsloth (and sets TORCHDYNAMO_DISABLE) at its top.
if os.environ.get("TRAIN2048_UNSLOTH_TIER") == "1":
    collect_ignore_glob = ["test_*.py"]
else:
    collect_ignore = ["unsloth"]
