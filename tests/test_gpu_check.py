"""bench/gpu_check.py, the GPU check that ships with the project: its plumbing, on the CPU (the GPU numbers need a GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHECK = [sys.executable, str(REPO / "bench" / "gpu_check.py")]
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def test_without_a_gpu_it_says_so_in_one_line():
    r = subprocess.run([*CHECK, "--steps", "2"], capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("gpu_check: no CUDA GPU here")


@pytest.mark.slow
def test_the_cpu_run_builds_a_gpt_oss_runs_the_cli_and_reports_the_split(tmp_path):
    """A GPT-OSS model with random weights, built locally, through the real CLI with the default preset's options
    (the CPU overrides aside): the step split, the save check, and a zero exit only when both are there."""
    result = tmp_path / "result.json"
    r = subprocess.run([*CHECK, "--cpu", "--steps", "3", "--workdir", str(tmp_path), "--json", str(result)],
                       capture_output=True, text=True, timeout=600, env=ENV)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(result.read_text())
    assert (report["steps"], report["steady_steps"], report["preset"], report["device"]) == (3, 2, "gpt-oss-20b", "cpu")
    parts = [report[f"time/{p}_s"] for p in ("generate", "rewards", "logprobs_and_backward", "optimizer")]
    assert report["time/generate_s"] > 0 and sum(parts) == pytest.approx(report["time/step_s"], rel=0.2)
    assert [c for c in report["save_checks"] if "final:" in c] and report["save_problems"] == []
    assert "| whole step (median, s) |" in r.stdout
    assert (tmp_path / "gpt-oss-tiny-all" / "config.json").exists()
    assert json.loads((tmp_path / "gpt-oss-tiny-all" / "config.json").read_text())["model_type"] == "gpt_oss"
