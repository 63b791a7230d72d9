"""train_2048 end to end on the CPU with the tiny model: outputs, Ctrl-C, kill -9 and resume, saving, evaluation, the
strategy archive, learning."""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "configs" / "cpu-demo.yaml")
# Short runs: 4 steps, a checkpoint every 2, a warm start just long enough for scores to differ.
SHORT = ["--config", DEMO, "--max_steps", "4", "--save_steps", "2", "--sample_steps", "2", "--eval_strategy", "no"]
SHORT += ["--sft_epochs", "20", "--max_completion_length", "32"]
SHORT += ["--archive_games", "0"]  # the evaluation's few games: what 4 short steps' budget can re-score
SALT = ["--game_salt", "tests"]  # the same training games in every run, so runs can be compared
EVAL = ["--eval_strategy", "steps", "--eval_steps", "2", "--eval_samples", "2", "--eval_games", "2"]  # the reference
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}


def train(*args, timeout=600):
    return subprocess.run(
        [sys.executable, str(REPO / "train_2048.py"), *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, env=ENV,
    )  # fmt: skip


def signalled(out: Path, sig: int, at: str, stderr=subprocess.PIPE) -> subprocess.Popen:
    """A short run into out, sent sig as soon as its console prints a line starting with `at`; the rest of its
    output is the caller's to read."""
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train_2048.py"), *SHORT, *SALT, "--output_dir", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True, env=ENV,
    )  # fmt: skip
    for line in proc.stdout:
        if line.startswith(at):
            proc.send_signal(sig)
            break
    return proc


def metrics(out: Path, kind: str = "reward") -> list[dict]:
    """metrics.jsonl's training lines, or with kind="eval_valid_rate" its --eval_steps lines."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if kind in line]


def tensorboard(out: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = (out / "runs").iterdir()
    events = EventAccumulator(str(run), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    return events


def custom_scalars(events) -> list[list[str]]:
    """The run's Custom Scalars tab (one category): for each chart in order, the run's scalar tags it draws."""
    import re

    from tensorboard.plugins.custom_scalar import layout_pb2

    (config,) = events.Tensors("custom_scalars__config__")
    (category,) = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0]).category
    scalars = events.Tags()["scalars"]
    return [sorted(t for t in scalars if any(re.match(r, t) for r in chart.multiline.tag)) for chart in category.chart]


# The user's own files in the run's folder (issue 46's hostile corpus): no run writes, replaces or deletes them.
USERS_FILES = {"README.md": "# my project\n", "final-report.md": "mine", "checkpoint-notes.txt": "mine",
               "final.bak/adapter_config.json": "{}", "sft/notes": "mine", "tiny-model-v2/config.json": "{}",
               "final.pdf": "%PDF"}  # fmt: skip


def users_files(out: Path) -> dict:
    return {name: (out / name).read_text() for name in USERS_FILES if (out / name).is_file()}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """4 uninterrupted steps, evaluated every 2, saved as LoRA and merged_16bit: the reference for everything below."""
    out = tmp_path_factory.mktemp("full") / "out"
    for name, text in USERS_FILES.items():  # a folder of the user's own, names like a run's included
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    result = train(*SHORT, *SALT, *EVAL, "--output_dir", str(out), "--save_method", "merged_16bit")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result


def test_outputs_layout(full_run):
    out, _ = full_run
    assert users_files(out) == USERS_FILES  # TRL's model card went nowhere near the user's README.md
    claims = set(json.loads((out / ".train_2048-run.json").read_text())["claims"])
    assert {"checkpoint-2", "checkpoint-4", "final", "best", "training.log", "runs", "strategies"} <= claims
    assert not claims & set(USERS_FILES), claims
    names = {p.name for p in out.iterdir()}
    assert {"training.log", "metrics.jsonl", "runs", "checkpoint-2", "checkpoint-4", "final", "tiny-model"} <= names
    assert "strategies" in names and (out / "strategies" / "index.json").exists()
    assert "final-merged_16bit" in names and not any(n.endswith((".tmp", ".old")) for n in names)
    assert (out / "final" / "adapter_model.safetensors").exists() and (out / "final" / "tokenizer.json").exists()
    assert (out / "final-merged_16bit" / "model.safetensors").exists()
    for step in (2, 4):
        checkpoint = out / f"checkpoint-{step}"
        saved = {"adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "strategy_archive.json"}
        assert saved <= {p.name for p in checkpoint.iterdir()}
        assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == step


def test_console_and_log_have_a_short_line_per_step(full_run):
    out, result = full_run
    for step in range(1, 5):
        assert f"step {step}/4  reward " in result.stdout
    log = (out / "training.log").read_text()
    assert "step 4/4  reward " in log and "warm start: SFT" in log
    assert "{'loss'" not in result.stdout  # the Trainer's metric dump is replaced by the short line
    last = result.stdout.strip().splitlines()[-1]  # names a TensorBoard that runs from here: the venv's own
    program = last.split("TensorBoard: ", 1)[1].split(" --logdir ")[0]
    assert os.access(REPO / program, os.X_OK), last
    best = json.loads((out / "best" / "train_2048_best.json").read_text())
    assert last.startswith(f"done after 4 steps: {out / 'final'} holds the last step's adapters, {out / 'best'} the best "
                           f"evaluation's (eval_mean_reward {best['value']:.4g} at step {best['step']}; "), last
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]
    for m in metrics(out):  # the step split: generation, rewards, optimizer, archive, the rest (log-probs, backward)
        parts = [m[f"time/{p}_s"] for p in ("generate", "rewards", "optimizer", "archive", "logprobs_and_backward")]
        assert all(t >= 0 for t in parts) and m["time/generate_s"] > 0 and m["time/rewards_s"] > 0
        assert sum(parts) == pytest.approx(m["time/step_s"], rel=1e-6)


def test_tensorboard_has_trl_game_metrics_and_samples(full_run):
    out, _ = full_run
    events = tensorboard(out)
    scalars = set(events.Tags()["scalars"])
    assert {"train/reward", "train/rewards/strategy_succeeds/mean", "train/completions/clipped_ratio"} <= scalars
    assert {"train/game/win_rate", "train/game/max_tile_log2", "train/game/unparseable_frac"} <= scalars
    samples = events.Tensors("answers/text_summary")
    assert [s.step for s in samples] == [2, 4]
    text = samples[0].tensor_proto.string_val[0].decode()
    assert "**total" in text and "function_works" in text and "strategy_succeeds" in text


def test_tensorboard_opens_on_what_matters(full_run):
    """One TensorBoard run: the warm start's numbers under warm_start/ (not on GRPO's train/ charts); the Custom Scalars
    tab's one screen holds the charts that say whether it learns; the Text tab opens on the answers and the archive
    (it opens its first two groups in name order), not on the Trainer's args; the archive panel comes at every log."""
    out, _ = full_run
    (run,) = (out / "runs").iterdir()
    assert {p.parent for p in out.rglob("events.out.tfevents.*")} == {run}
    events = tensorboard(out)
    scalars = set(events.Tags()["scalars"])
    assert {"warm_start/loss", "warm_start/mean_token_accuracy", "warm_start/entropy"} <= scalars
    assert "train/mean_token_accuracy" not in scalars  # an SFT metric: no warm-start number on a train/ chart
    assert [p.step for p in events.Scalars("train/entropy")] == [1, 2, 3, 4]

    rewards = [f"train/rewards/{name}/mean" for name in ("function_works", "no_cheating", "strategy_succeeds")]
    assert custom_scalars(events) == [
        ["train/reward"], rewards, ["eval/mean_score"], ["archive/best_reward"],
        [],  # train/kl: TRL logs it with --beta > 0 only
        ["train/completions/max_length", "train/completions/mean_length"], ["train/generation/fast_path"],
    ]  # fmt: skip

    groups = sorted({tag.split("/")[0] for tag in events.Tags()["tensors"] if tag.endswith("/text_summary")})
    assert groups[:3] == ["answers", "archive", "args"]

    panels, best = events.Tensors("archive/text_summary"), events.Scalars("archive/best_reward")
    assert [p.step for p in panels] == [p.step for p in best] and panels[-1].step == 4
    top = json.loads((out / "strategies" / "index.json").read_text())["strategies"][0]
    row = f"| 1 | {top['id']} | {top['first_step']} | {top['times_written']} | "
    assert row in panels[-1].tensor_proto.string_val[0].decode()  # its counts as of the last step


def test_eval_steps_log_the_evaluation_to_tensorboard(full_run):
    out, result = full_run
    events = tensorboard(out)
    names = ("valid_rate", "cheat_rate", "win_rate", "max_tile_log2", "mean_score")
    assert {f"eval/{name}" for name in names} <= set(events.Tags()["scalars"])
    for name in names:
        points = events.Scalars(f"eval/{name}")
        assert [p.step for p in points] == [2, 4], name
        low, high = (0.0, 1.0) if name.endswith("_rate") else (0.0, float("inf"))
        assert all(low <= p.value <= high for p in points), (name, [p.value for p in points])
    assert [m["step"] for m in metrics(out, "eval_valid_rate")] == [2, 4]
    assert "eval at step 2:  valid " in result.stdout and "eval at step 4:  valid " in result.stdout
    assert "eval at step 4:  valid " in (out / "training.log").read_text()


def test_eval_is_evaluate_2048_on_the_checkpoint_and_the_best_adapters(full_run, tmp_path):
    """One implementation: evaluate_2048.py --adapter with the same seeds, and nothing else of the run said (its board,
    token budget and sampler are read from the adapter folder's train_2048_options.json), gets eval/* of the step
    that saved it (on the CPU, like the run: a GPU samples other tokens): checkpoint-2, and best/, the adapters of the
    run's best evaluation by eval_mean_reward (transformers' metric_for_best_model), which merge_2048.py takes too."""
    import rewards

    out, _ = full_run
    evaluations = {m["step"]: m for m in metrics(out, "eval_valid_rate")}
    best = json.loads((out / "best" / "train_2048_best.json").read_text())
    top = max(m["eval_mean_reward"] for m in evaluations.values())
    assert best == {"step": min(s for s, m in evaluations.items() if m["eval_mean_reward"] == top),
                    "metric": "eval_mean_reward", "value": top, "greater_is_better": True}  # fmt: skip
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert (state["best_metric"], state["best_global_step"]) == (top, best["step"])  # transformers' own bookkeeping
    seed = rewards.held_out_seeds("tests", 2)[0]  # the run's held-out games, and its evaluation's sampling seed
    for folder, step in (("checkpoint-2", 2), ("best", best["step"])):
        args = ["--adapter", out / folder, "--samples", 2, "--games", 2, "--seed", seed, "--no-baselines"]
        args += ["--batch_size", 8, "--output_dir", tmp_path / folder]  # the run's per_device_eval_batch_size
        r = subprocess.run([sys.executable, str(REPO / "evaluate_2048.py"), *map(str, args)],
                           cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"board: the run's own options, {out / folder / 'train_2048_options.json'}" in " ".join(r.stdout.split())
        report = json.loads((tmp_path / folder / "results.json").read_text())
        assert (report["settings"]["size"], report["settings"]["target"], report["settings"]["max_new_tokens"]) == (3, 128, 32)
        assert (report["settings"]["top_k"], report["settings"]["top_p"]) == (0, 1.0)  # TRL's sampler, not top_k 50
        (summary,) = report["summary"]
        for name in ("valid_rate", "cheat_rate", "win_rate", "mean_score", "mean_reward"):
            assert summary[name] == pytest.approx(evaluations[step][f"eval_{name}"]), (folder, name)
    merged = subprocess.run([sys.executable, str(REPO / "merge_2048.py"), "--adapter", str(out / "best"), "--output_dir",
                             str(tmp_path / "merged")], cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)  # fmt: skip
    assert merged.returncode == 0 and "a correct merge" in merged.stdout + merged.stderr, merged.stderr[-3000:]


def test_saves_reload_and_sample_like_the_trained_model(full_run):
    out, _ = full_run
    log = (out / "training.log").read_text()
    assert f"verified {out / 'final'}: its " in log and "reloaded it samples the same 4 seeded completions" in log
    merged = [line for line in log.splitlines() if f"verified {out / 'final-merged_16bit'}: a correct merge" in line]
    assert len(merged) == 1 and "16-bit keeps" in merged[0], log[-3000:]  # merge_2048.py's line, in training.log too
    report = json.loads((out / "final-merged_16bit" / "merge_report.json").read_text())
    assert report["wrong"] == [] and report["dtype"] == "bfloat16" and 0 < report["kept"] <= 1.0001


def test_ctrl_c_saves_a_checkpoint_and_resume_continues_exactly(full_run, tmp_path):
    reference, _ = full_run
    out = tmp_path / "out"
    proc = signalled(out, signal.SIGINT, at="step 1/4")  # during step 2
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stdout[-2000:] + stderr[-2000:]
    stopped = metrics(out)[-1]["step"]
    assert stopped < 4 and (out / f"checkpoint-{stopped}" / "trainer_state.json").exists()
    assert "stopped by Ctrl-C" in (out / "training.log").read_text() and not (out / "final").exists()

    saved = json.loads((out / f"checkpoint-{stopped}" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved["GameSalt"]["args"]["salt"] == "tests"
    result = train(*SHORT, "--output_dir", str(out), "--resume", "auto")  # no salt given: the checkpoint's is used
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"resuming from {out / f'checkpoint-{stopped}'}" in result.stdout
    assert "warm start" not in result.stdout  # the checkpoint already holds it
    steps = metrics(out)
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    # Same optimizer, scheduler and RNG state: the resumed steps are the uninterrupted run's steps. The reference
    # also ran --eval_steps 2 and this run did not: the evaluations leave training exactly as it would be.
    for ours, theirs in zip(steps, metrics(reference)):
        for key in ("reward", "completions/mean_length", "entropy", "loss", "learning_rate"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (ours["step"], key)


def archive_entries(checkpoint: Path) -> tuple[int, dict]:
    """The archive a checkpoint holds: the answers it judged, and id -> what a run makes the same (timings and the
    re-scoring, which follows them, left out)."""
    saved = json.loads((checkpoint / "strategy_archive.json").read_text())
    return saved["answers"], {e["id"]: {k: v for k, v in e.items() if k not in ("train_seconds", "held_out", "status")}
                              for e in saved["entries"]}  # fmt: skip


def test_the_archive_is_ranked_seen_in_tensorboard_and_plays_in_the_sandbox(full_run, tmp_path):
    """strategies/: the ranked strategies with their held-out numbers, the same in index.json, in each file's header
    and in what evaluate_2048.py measures when it plays best.py in the sandbox (the run's evaluation seeds: 2 games);
    --watch plays it too. TensorBoard has archive/*, the console a line when the best changed."""
    import rewards

    out, result = full_run
    index = json.loads((out / "strategies" / "index.json").read_text())
    ranked = index["strategies"]
    held_out = rewards.held_out_seeds("tests", 2)  # secret when the salt is (the salt is set here to compare runs)
    assert index["step"] == 4 and index["held_out_seeds"] == held_out and ranked
    log = (out / "training.log").read_text()
    assert f"each on 2 held-out games (seeds {held_out[0]}-{held_out[1]}, " in log  # the evaluation's, the same
    bounds = [r["held_out"]["lower_bound"] for r in ranked]  # the archive ranks by the bound, not the mean
    assert bounds == sorted(bounds, reverse=True)
    best = ranked[0]
    text = (out / "strategies" / "best.py").read_text()
    assert text == (out / "strategies" / best["file"]).read_text() and best["times_written"] >= 1
    assert f"mean score {best['held_out']['score']:.1f}, win rate {best['held_out']['win_rate']:.0%}" in text
    assert "archive at step " in result.stdout and f"new best {best['id']} " in log
    events = tensorboard(out)
    assert {"archive/best_score", "archive/distinct", "archive/distinct_last_step"} <= set(events.Tags()["scalars"])
    assert [p.step for p in events.Scalars("archive/distinct")] == [1, 2, 3, 4]
    assert events.Scalars("archive/distinct")[-1].value == index["distinct"]
    assert events.Scalars("archive/best_score")[-1].value == best["held_out"]["score"]
    assert best["id"] in events.Tensors("archive/text_summary")[-1].tensor_proto.string_val[0].decode()

    evaluate = [sys.executable, str(REPO / "evaluate_2048.py"), "--seed", str(held_out[0]), "--games", "2"]  # its GAME
    played = subprocess.run([*evaluate, "--strategy", str(out / "strategies" / "best.py"), "--no-baselines",
                             "--output_dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env=ENV)  # fmt: skip
    assert played.returncode == 0, played.stderr[-3000:]
    (summary,) = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert summary["mean_score"] == pytest.approx(best["held_out"]["score"])
    assert summary["win_rate"] == best["held_out"]["win_rate"] and summary["cheat_rate"] == 0
    watched = subprocess.run([*evaluate, "--watch", str(out / "strategies" / "best.py")], cwd=REPO,
                             capture_output=True, text=True, timeout=300, env=ENV)  # fmt: skip
    assert watched.returncode == 0 and "best.py: " in watched.stdout and " after " in watched.stdout, watched.stderr


def test_kill_9_then_resume_continues_the_archive(full_run, tmp_path):
    """Killed during step 3 (its records held in memory only), resumed from checkpoint-2: the archive at step 4 is the
    uninterrupted run's, each strategy written as many times, from the same first step, with the same games."""
    reference, _ = full_run
    out = tmp_path / "out"
    proc = signalled(out, signal.SIGKILL, at="step 3/4", stderr=subprocess.DEVNULL)  # checkpoint-2 is the last save
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and not (out / "checkpoint-4").exists()
    assert json.loads((out / "strategies" / "index.json").read_text())["step"] == 2  # the last save's copy, whole

    result = train(*SHORT, "--output_dir", str(out), "--resume", "auto")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    ours, theirs = archive_entries(out / "checkpoint-4"), archive_entries(reference / "checkpoint-4")
    assert ours == theirs and ours[0] == 4 * 8 and sum(e["times"] for e in ours[1].values()) > 0
    assert f"resuming from {out / 'checkpoint-2'}" in result.stdout and "strategy archive: continuing" in result.stdout
    assert json.loads((out / "strategies" / "index.json").read_text())["step"] == 4


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_resuming_with_other_adapters_is_one_line(full_run, tmp_path, capsys):
    """--resume auto with --lora_target_modules the run did not train: the adapters built for these options are
    compared with the checkpoint's, tensor by tensor, before the Trainer loads it (which raised from the optimizer's
    load, or left the adapters it did not find fresh)."""
    import train_2048

    reference, _ = full_run
    out = tmp_path / "out"
    shutil.copytree(reference, out, symlinks=True)
    before = {name: snapshot(out / name) for name in ("checkpoint-2", "checkpoint-4", "final")}
    argv = [*SHORT, "--max_steps", "6", "--output_dir", str(out), "--resume", "auto", "--lora_target_modules",
            "q_proj", "v_proj"]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        train_2048.main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert stop.value.code == 2 and err[-1].startswith(f"train_2048: --resume: {out / 'checkpoint-4'}'s adapters")
    assert "saved, not in these adapters" in err[-1] and "Traceback" not in "".join(err)
    assert {name: snapshot(out / name) for name in before} == before


@pytest.mark.slow
def test_a_finished_run_resumed_further_replaces_only_its_own_files_in_final(full_run, tmp_path):
    """--resume auto with a higher --max_steps saves final/ again: the files the earlier save listed are replaced by
    this save's, and what the user put in final/ (a file, an evaluation's folder) stays; a run or an evaluation into a
    folder inside final/ is refused before it writes anything."""
    import evaluate_2048

    reference, _ = full_run
    out = tmp_path / "out"
    shutil.copytree(reference, out, symlinks=True)  # a copy that keeps the files' times: its marks still hold
    (out / "final" / "my-notes.txt").write_text("mine")
    refused = train(*SHORT, "--output_dir", str(out / "final" / "x"))
    assert refused.returncode == 2 and "is inside" in refused.stderr and not (out / "final" / "x").exists()
    strategy = tmp_path / "up.py"
    strategy.write_text("def strategy(board):\n    return 'W'\n")
    with pytest.raises(SystemExit):
        evaluate_2048.main(["--strategy", str(strategy), "--no-baselines", "--games", "1", "--output_dir",
                            str(out / "final" / "eval")])  # fmt: skip
    (out / "final" / "eval").mkdir()  # an evaluation's folder from before (a user's, or an older train_2048's)
    (out / "final" / "eval" / "results.json").write_text("{}")
    before = (out / "final" / "adapter_model.safetensors").read_bytes()
    result = train(*SHORT, "--max_steps", "6", "--output_dir", str(out), "--resume", "auto")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (out / "final" / "my-notes.txt").read_text() == "mine" and (out / "final" / "eval" / "results.json").is_file()
    assert (out / "final" / "adapter_model.safetensors").read_bytes() != before  # step 6's adapters
    mark = json.loads((out / "final" / ".train_2048-wrote-this").read_text())
    assert "adapter_model.safetensors" in mark["files"] and not {"my-notes.txt", "eval"} & set(mark["files"])


@pytest.mark.slow
def test_a_run_over_a_finished_one_then_a_full_disk_then_resume(full_run, tmp_path):
    """A finished run's folder, started over with --overwrite_output_dir: nothing of the earlier run is left to mix
    with the new one. Then the disk fills up while checkpoint-4 is written (a file-size limit, set from outside once
    step 3 has begun, makes the same writes fail): one line, exit status 2, the half-written checkpoint removed and
    checkpoint-2 whole, from which --resume auto finishes the run (a damaged newer checkpoint skipped and named), its
    metrics one run's steps in order."""
    reference, _ = full_run
    out = tmp_path / "out"
    shutil.copytree(reference, out, symlinks=True)
    (out / "notes-after-the-run.txt").write_text("mine")  # the user's, beside the finished run
    (out / "runs" / "other-project").mkdir()
    (out / "elsewhere").mkdir()
    (out / "elsewhere" / "keep").write_text("mine")
    shutil.rmtree(out / "tiny-model")  # a name the run claimed, now a link to the user's folder: the link goes
    (out / "tiny-model").symlink_to(out / "elsewhere")
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train_2048.py"), *SHORT, *SALT, "--warm_start", "false", "--output_dir", str(out),
         "--overwrite_output_dir", "true"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    for line in proc.stdout:
        if line.startswith("step 3/4"):  # checkpoint-2 is written
            resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (200_000, 200_000))  # the adapters are ~900 kB
            break
    stdout, stderr = proc.communicate(timeout=300)
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert proc.returncode == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert last.startswith(f"train_2048: cannot write {out / 'checkpoint-4'} (") and "checkpoint-2, is intact" in last
    names = {p.name for p in out.iterdir()}
    assert "checkpoint-2" in names and not names & {"checkpoint-4", "final", "final-merged_16bit"}, names
    assert "final-merged_16bit" not in (out / "training.log").read_text()  # the earlier run's log went with it
    assert users_files(out) == USERS_FILES and (out / "notes-after-the-run.txt").read_text() == "mine"
    assert (out / "elsewhere" / "keep").read_text() == "mine" and (out / "runs" / "other-project").is_dir()
    assert metrics(out, "eval_valid_rate") == []  # the earlier run evaluated; this one does not

    # A newer checkpoint that cannot be loaded, beside it (a copy whose optimizer state is cut short): skipped, named.
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-4")
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    (out / "checkpoint-4" / "trainer_state.json").write_text(json.dumps({**state, "global_step": 4}))
    optimizer = out / "checkpoint-4" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:1000])
    result = train(*SHORT, "--warm_start", "false", "--output_dir", str(out), "--resume", "auto")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "checkpoint-4 is skipped: optimizer.pt is damaged" in result.stdout
    assert f"resuming from {out / 'checkpoint-2'}" in result.stdout
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4] and (out / "final").is_dir()


def test_a_second_run_into_a_live_runs_folder_is_refused_and_a_killed_runs_lock_is_not(tmp_path):
    """Two runs into one folder: the second is refused in one line that names the live one, before it writes
    anything; once the first is killed (-9), its lock is gone with it and the folder can be continued."""
    import run_folder

    out = tmp_path / "out"
    first = subprocess.Popen(
        [sys.executable, str(REPO / "train_2048.py"), *SHORT, "--max_steps", "1000", "--output_dir", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV,
    )  # fmt: skip
    try:
        for line in first.stdout:
            if line.startswith("train_2048: "):  # it holds the folder
                break
        before = {p.name for p in out.iterdir()}
        second = train(*SHORT, "--output_dir", str(out), "--overwrite_output_dir", "true", timeout=300)
        last = [line for line in second.stderr.splitlines() if line.strip()][-1]
        assert second.returncode == 2 and f"in use by a running train_2048 (pid {first.pid} on" in last, last
        assert before <= {p.name for p in out.iterdir()}  # nothing of the live run's deleted (it writes on meanwhile)
    finally:
        first.kill()
        first.wait()
    assert run_folder.lock_holder(out) is None
    run_folder.take(out, resume="auto").release()  # --resume auto may go on


def test_warnings_for_no_learning_signal_and_clipped_completions(tmp_path):
    out = tmp_path / "out"
    args = ["--config", DEMO, "--max_steps", "1", "--sft_epochs", "1", "--max_completion_length", "2"]
    result = train(*args, "--output_dir", str(out), "--verify_save", "false")
    assert result.returncode == 0, result.stderr[-2000:]
    log = (out / "training.log").read_text()
    assert "every completion hit max_completion_length" in log and "this step taught nothing" in log


def test_the_demo_bar_fails_runs_that_did_not_learn_the_corner_player():
    """demo_data.learned, the learning test's bar and bench_demo.py's: a run that settled on random.choice (the
    newcomer's run: 24 of 32), a reward that barely rose, or a corner player not well ahead of the cycle, fails."""
    import demo_data

    assert demo_data.learned(1.7, 8.5, {"corner": 29, "random": 1, "other": 2})
    assert not demo_data.learned(0.7, 7.8, {"random": 24, "corner": 8})
    assert not demo_data.learned(1.7, 5.6, {"corner": 32})
    assert not demo_data.learned(1.7, 8.5, {"corner": 16, "cycle": 4, "other": 12})


@pytest.mark.slow
def test_cpu_demo_learns_to_read_the_board(tmp_path):
    """The shipped demo with its games fixed (a run draws a secret salt; bench/bench_demo.py measures the spread over
    fresh ones, docs/PERF.md): the mean total reward of its last 10 steps is clearly above its first 10, and the
    trained policy writes the board-reading answer, not the key cycle. A CPU run with fixed games and seed is
    deterministic on one kind of CPU; torch's AVX512 kernels and its default ones give other numbers (both checked)."""
    import collections

    import demo_data
    import evaluation

    out = tmp_path / "out"
    result = train("--config", DEMO, "--output_dir", str(out), "--game_salt", "demo", timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    steps = [m["reward"] for m in metrics(out)]
    first, last = sum(steps[:10]) / 10, sum(steps[-10:]) / 10
    kinds = collections.Counter(demo_data.answer_kind(t) for t in demo_data.sample_answers(out))
    print(f"cpu demo: first 10 steps {first:.2f}, last 10 steps {last:.2f}; final answers {dict(kinds)}")
    assert demo_data.learned(first, last, kinds), (first, last, dict(kinds))

    # Its archive: the best strategy it wrote is the corner player, with the rewards it measured: 4 games for each time
    # it was written, and on its held-out games what evaluate_2048.py measures when it plays the file.
    index = json.loads((out / "strategies" / "index.json").read_text())
    best = index["strategies"][0]
    code = evaluation.file_source(str(out / "strategies" / "best.py")).samples[0].code
    print(f"cpu demo archive: {index['distinct']} distinct, best {best}")
    assert demo_data.answer_kind(f"```python\n{code}```") == "corner", code
    # Any corner variant may lead: variants that play alike tie, and near-ties play on as the step's time allows.
    assert best["training"]["games"] == 4 * best["times_written"] and best["times_written"] >= 1
    assert index["rescoring"]["seconds"] <= 0.05 * index["rescoring"]["training_seconds"] + 2.0  # + one game's limit
    tmp = tmp_path / "eval"
    seeds = index["held_out_seeds"]
    games = best["held_out"]["games"]  # 16, or more rounds of 16 where a near-tie played on
    assert len(seeds) == 16 and games >= 16 and games % 16 == 0
    args = ["--config", DEMO, "--strategy", out / "strategies" / "best.py", "--games", games, "--seed", seeds[0],
            "--no-baselines"]  # fmt: skip
    r = subprocess.run([sys.executable, str(REPO / "evaluate_2048.py"), *map(str, args), "--output_dir", str(tmp)],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (summary,) = json.loads((tmp / "results.json").read_text())["summary"]
    assert summary["mean_score"] == pytest.approx(best["held_out"]["score"]) and summary["games"] == games


def test_fast_generation_samples_what_model_generate_samples(full_run, tmp_path):
    """--fast_generation (generation.py's decode loop) in the real run: the first step's completions, hence its
    rewards and loss, are the reference run's; later steps may differ (its random state advances differently)."""
    reference, _ = full_run
    out = tmp_path / "out"
    result = train(*SHORT, *SALT, "--max_steps", "1", "--verify_save", "false", "--fast_generation", "true",
                   "--output_dir", str(out))  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "generation: fast (" in (out / "training.log").read_text()
    assert custom_scalars(tensorboard(out))[-1] == ["train/generation/compiled", "train/generation/fast_path"]
    ours, theirs = metrics(out)[0], metrics(reference)[0]
    for key in ("reward", "completions/mean_length", "loss", "rewards/strategy_succeeds/mean"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
