"""bench/gpu_check.py, the GPU check that ships with the project: its plumbing, on the CPU (the GPU numbers need a GPU)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECK = [sys.executable, str(REPO / "bench" / "gpu_check.py")]
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def test_without_a_gpu_it_says_so_in_one_line():
    r = subprocess.run([*CHECK, "--steps", "2"], capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("gpu_check: no CUDA GPU here")


# gpu_check --cpu through the real CLI (a GPT-OSS model built locally, GPT-OSS's tokenizer, the step split, the save
# checks): tests/test_gpu_matrix.py's CPU run of call 1 runs it, and reads its record.
