"""train_2048 under `accelerate launch` on 2 CPU processes (gloo): what is written once per run is written once,
every rank gets through, and the checkpoint is whole."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "configs" / "cpu-demo.yaml")
TWO_CPUS = str(REPO / "configs" / "accelerate" / "cpu-2proc.yaml")


def gloo_available() -> bool:
    import torch.distributed

    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


@pytest.mark.slow
@pytest.mark.skipif(not gloo_available(), reason="torch.distributed without gloo")
def test_two_cpu_processes_train_and_save_once(tmp_path):
    out = tmp_path / "out"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", TWO_CPUS, "--num_processes", "2"]
    args = ["--config", DEMO, "--output_dir", str(out), "--max_steps", "2", "--save_steps", "2"]
    args += ["--sft_epochs", "2", "--max_completion_length", "32"]  # a short warm start: its data-parallel path too
    args += ["--eval_strategy", "steps", "--eval_steps", "2", "--eval_samples", "3", "--eval_games", "2"]  # all ranks
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*launch, str(REPO / "train_2048.py"), *args],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    report = result.stdout[-3000:] + result.stderr[-5000:]
    assert result.returncode == 0, report
    for rank in (0, 1):
        assert f"train_2048: rank {rank}/2 finished, exit status 0" in result.stderr, report

    # one complete checkpoint-2 (each rank's RNG state in it), one final save, one tiny model, nothing half-written
    names = {p.name for p in out.iterdir()}
    assert [n for n in names if n.startswith("checkpoint-")] == ["checkpoint-2"], names
    assert {"tiny-model", "final", "training.log", "metrics.jsonl", "runs"} <= names
    assert not any(n.endswith((".tmp", ".old")) for n in names), names
    checkpoint = out / "checkpoint-2"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 2
    files = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"} <= files
    archive = json.loads((checkpoint / "strategy_archive.json").read_text())  # the main process gathers every rank's
    assert archive["answers"] == 2 * 2 * 8 and (out / "strategies" / "index.json").exists()  # 2 steps, 2 ranks, 8 each

    # written by the main process alone: one line per step and per evaluation, one start line, one verified save
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "reward" in m] == [1, 2]
    assert [m["step"] for m in lines if "eval_valid_rate" in m] == [2]
    log = (out / "training.log").read_text()
    assert log.count("train_2048: tiny on the transformers backend") == 1 and "2 processes" in log
    assert log.count("warm start: SFT") == 1 and f"verified {out / 'final'}: its " in log
    assert len(list((out / "runs").iterdir())) == 1
    # the evaluation's adapters, saved by every rank into the folder the main one made, published once
    assert log.count("best evaluation so far: eval_mean_reward") == 1 and "best" in names
    assert {"adapter_model.safetensors", "train_2048_best.json", "train_2048_options.json"} <= {
        p.name for p in (out / "best").iterdir()}  # fmt: skip
