"""The suite is two pytest runs (`make test`): the main one, and tests/unsloth under TRAIN2048_UNSLOTH_TIER=1.

Unsloth patches transformers, PEFT and TRL process-wide as it is imported, so its tier never shares a process with the
rest: each run collects only its own tests.
"""

import logging
import os

import pytest

# The main run ignores the tier's folder itself, not only its files: pytest loads a folder's conftest.py while it
# collects there, and the tier's imports Unsloth (and sets TORCHDYNAMO_DISABLE) at its top.
if os.environ.get("TRAIN2048_UNSLOTH_TIER") == "1":
    collect_ignore_glob = ["test_*.py"]
else:
    collect_ignore = ["unsloth"]


@pytest.fixture(autouse=True)
def _train_2048_logger_restored():
    """A test that calls train_2048.main() directly leaves the command's logger writing to that test's captured
    output (and log errors silenced, as a run wants them): put both back for the next test."""
    log = logging.getLogger("train_2048")
    handlers, level, propagate, raise_exceptions = list(log.handlers), log.level, log.propagate, logging.raiseExceptions
    yield
    log.handlers, log.level, log.propagate = handlers, level, propagate
    logging.raiseExceptions = raise_exceptions
