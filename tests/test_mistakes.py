"""The mistakes a user makes, and the one line each gets: exit status 2, no traceback, and nothing of a run touched.

The table below is every kind of mistake with several of its members (users make others of the same kinds than the
ones reported): option values of the wrong type, from a flag or from a YAML preset; presets that cannot be read;
values out of range; options that contradict each other; paths that are not what they must be; an output folder that
holds a run; checkpoints that cannot be loaded or do not fit the options. Each runs in this process through the
command's own main(), as `python train_2048.py ARGS` runs up to where it stops, so the whole table costs seconds;
tests/test_train.py starts the few whose behaviour is the process's (the environment at import, the exit status).
README's Troubleshooting shows the most common rows.
"""

import json
import os
import re
from pathlib import Path

import pytest

import checkpoint_state
import evaluate_2048
import options
import run_folder
import saving
import train_2048
import trainer

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "configs" / "cpu-demo.yaml")


def checkpoint(folder: Path, step: int, r: int = 16) -> Path:
    """A checkpoint as transformers and PEFT write one (small tensors, the same files)."""
    import torch
    from safetensors.torch import save_file

    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    save_file({"base_model.model.lm_head.weight": torch.zeros(4, 2)}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": 2 * r, "peft_type": "LORA"}))
    for name, state in training_state().items():
        torch.save(state, path / name)
    torch.save({"step": step}, path / "training_args.bin")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    return path


def training_state() -> dict:
    """What a checkpoint's torch files hold, as transformers saves them: an AdamW state after a step, a constant
    schedule's LambdaLR state, the random states (checkpoint_state checks each is of its kind)."""
    import random

    import numpy as np
    import torch

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight])
    weight.grad = torch.ones(3)
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    return {"optimizer.pt": optimizer.state_dict(), "scheduler.pt": scheduler.state_dict(), "rng_state.pth": rng}


def finished_run(folder: Path, recorded: bool = True) -> Path:
    """An output folder as a finished CPU-demo run leaves it (the files that matter here)."""
    checkpoint(folder, 2)
    checkpoint(folder, 4)
    tmp = folder / ".final-being-written"
    tmp.mkdir()
    (tmp / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "tiny"}))
    saving.publish(tmp, folder / "final", "train_2048")  # with its mark, as a run's save publishes it
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward": 1.0}) + "\n" for s in (1, 2, 3, 4)))
    (folder / "training.log").write_text("the earlier run\n")
    if recorded:  # the record a run of this train_2048 keeps of what it wrote (run_folder.Held.start)
        claims = [*run_folder.RUN_NAMES, "checkpoint-2", "checkpoint-4"]
        record(folder, claims)
    return folder


def record(folder: Path, claims: list[str], adopted: list[str] = ()) -> None:
    """A run's record, as run_folder writes it."""
    text = json.dumps({"train_2048_run": 1, "claims": sorted(claims), "adopted": sorted(adopted)})
    (folder / run_folder.MANIFEST).write_text(text)


def demo_with(text: str) -> str:
    """The demo preset with the keys of `text` in place of its own (a preset that gives a key twice is refused)."""
    keys = {line.split(":")[0] for line in text.splitlines() if line and not line.startswith((" ", "#"))}
    kept = [line for line in Path(DEMO).read_text().splitlines() if line.split(":")[0] not in keys]
    return "\n".join(kept) + "\n" + text + "\n"


def cut_short(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """The files the mistakes below name: presets with a wrong value each, a finished run, damaged checkpoints, and
    folders that are not models."""
    root = tmp_path_factory.mktemp("mistakes")
    for name, text in PRESETS.items():
        (root / f"{name}.yaml").write_text(text if name.startswith("raw-") else demo_with(text))
    finished_run(root / "run")
    damaged = finished_run(root / "damaged")
    cut_short(damaged / "checkpoint-4" / "trainer_state.json")
    cut_short(damaged / "checkpoint-2" / "optimizer.pt")
    cut_short(checkpoint(root / "loose", 6) / "adapter_model.safetensors")
    (checkpoint(root / "bare", 8) / "adapter_model.safetensors").unlink()
    (root / "empty").mkdir()
    (root / "a-file").write_text("")
    (root / "says-nothing").mkdir()
    (root / "says-nothing" / "config.json").write_text("{}")
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2).save_pretrained(root / "damaged-weights")  # fmt: skip
    (root / "damaged-weights" / "model.safetensors").write_bytes(b"not a tensor")
    (root / "adapter").mkdir()
    (root / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base"}))
    hostile_files(root)
    return root


class Shell:
    """A pickle that runs a shell command when it is loaded (the marker file says whether it ran)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def hostile_files(root: Path) -> None:
    """Files a user may be handed (issue 47): presets that hang, flood, explode or run a command; checkpoints whose
    torch files would run a command, or whose safetensors header claims an enormous tensor; output folders whose
    log is a link out, or a file of the user's."""
    import torch

    os.mkfifo(root / "fifo.yaml")
    (root / "huge.yaml").write_text("# padding\n" * 200_000)
    (root / "aliases.yaml").write_text("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\n"
                                       "c: [*b, *b, *b, *b, *b, *b, *b, *b]\n")  # fmt: skip
    (root / "deep.yaml").write_text("max_steps: " + "[" * 5000 + "]" * 5000 + "\n")
    demo = Path(DEMO).read_text()
    (root / "wrap.yaml").write_text(demo + f"\nenv:\n  TRAIN2048_SANDBOX_WRAP: touch {root / 'wrapped'}\n")
    (root / "preload.yaml").write_text(demo + "\nenv:\n  LD_PRELOAD: /tmp/evil.so\n")
    (root / "env-value.yaml").write_text(demo + "\nenv:\n  PYTORCH_CUDA_ALLOC_CONF: \"$(touch x)\"\n")
    pickled = finished_run(root / "pickled")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.save({"state": Shell(root / "pickle-ran")}, pickled / "checkpoint-4" / name)
    bomb = checkpoint(root / "bomb", 6)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 32]}}).encode()
    (bomb / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(32))
    (root / "log-link").mkdir()
    (root / "log-link" / "training.log").symlink_to(root / "outside.log")
    (root / "user-log").mkdir()
    (root / "user-log" / "training.log").write_text("my own notes\n")
    (root / "user-model").mkdir()
    (root / "user-model" / "tiny-model").mkdir()
    linked = finished_run(root / "linked-final")
    (linked / "final").rename(root / "elsewhere")
    (linked / "final").symlink_to(root / "elsewhere")


# Each preset: the demo's keys, then one key of its own (the last value of a key wins in YAML).
PRESETS = {
    "float-for-int": "max_steps: 1.5",
    "list-for-int": "max_steps: [1, 2]",
    "null-for-int": "max_steps: null",
    "text-for-int": "save_steps: often",
    "bool-for-int": "eval_steps: yes",
    "map-for-list": "lora_target_modules: {q_proj: 1}",
    "map-for-number": "learning_rate: {value: 1.0e-4}",
    "list-in-list": "lora_target_modules: [[q_proj], v_proj]",
    "bad-bool": "use_cpu: maybe",
    "bad-choice": "truncated: drop",
    "bad-enum": "lr_scheduler_type: wobbly",
    "unknown-key": "max_stepz: 3",
    "unknown-key-far": "colour: blue",
    "bad-env": "env: [A, B]",
    "raw-not-a-mapping": "- just\n- a list\n",
    "raw-bad-yaml": "max_steps: [unclosed\n",
}

# (case, the command line ({root}: the folder `place` made), words the one line must hold). Each case also gets
# --output_dir {root}/out-<case> unless it gives its own; that folder must not exist afterwards.
TRAIN = [
    # option values a flag gives: argparse's check, in our line
    ("text-for-int", ["--max_steps", "many"], ["--max_steps", "invalid int value: 'many'"]),
    ("float-for-int", ["--num_generations", "2.5"], ["--num_generations", "'2.5'"]),
    ("no-value", ["--max_steps"], ["--max_steps", "expected one argument"]),
    ("bad-bool", ["--use_cpu", "maybe"], ["--use_cpu", "maybe"]),
    ("bad-choice", ["--save_method", "zip"], ["--save_method", "'zip'", "lora"]),
    ("bad-enum", ["--eval_strategy", "sometimes"], ["--eval_strategy", "sometimes"]),
    ("bad-profile", ["--profile", "easy"], ["--profile", "easy"]),
    ("unknown-flag", ["--no_such_flag", "1"], ["unknown option --no_such_flag"]),
    ("abbreviated", ["--max-step", "3"], ["unknown option --max-step", "did you mean --max_steps?"]),
    ("typo", ["--learning_rat", "1e-4"], ["unknown option --learning_rat", "did you mean --learning_rate?"]),
    ("stray-value", ["--max_steps", "1", "2"], ["unexpected value '2'"]),
    # option values a preset gives: the same checks, naming the file and the key
    ("yaml-float-for-int", ["--config", "{root}/float-for-int.yaml"], ["float-for-int.yaml: max_steps", "'1.5'"]),
    ("yaml-list-for-int", ["--config", "{root}/list-for-int.yaml"], ["max_steps: a list", "one value"]),
    ("yaml-null-for-int", ["--config", "{root}/null-for-int.yaml"], ["max_steps: no value given"]),
    ("yaml-text-for-int", ["--config", "{root}/text-for-int.yaml"], ["save_steps", "'often'"]),
    ("yaml-bool-for-int", ["--config", "{root}/bool-for-int.yaml"], ["eval_steps", "'true'"]),
    ("yaml-map-for-list", ["--config", "{root}/map-for-list.yaml"], ["lora_target_modules: a mapping"]),
    ("yaml-map-for-number", ["--config", "{root}/map-for-number.yaml"], ["learning_rate: a mapping", "a number"]),
    ("yaml-list-in-list", ["--config", "{root}/list-in-list.yaml"], ["lora_target_modules", "inside a list"]),
    ("yaml-bad-bool", ["--config", "{root}/bad-bool.yaml"], ["bad-bool.yaml: use_cpu", "maybe"]),
    ("yaml-bad-choice", ["--config", "{root}/bad-choice.yaml"], ["truncated", "'drop'", "score"]),
    ("yaml-bad-enum", ["--config", "{root}/bad-enum.yaml"], ["lr_scheduler_type", "wobbly"]),
    ("yaml-unknown-key", ["--config", "{root}/unknown-key.yaml"], ["unknown key max_stepz", "max_steps"]),
    ("yaml-unknown-key-far", ["--config", "{root}/unknown-key-far.yaml"], ["unknown key colour", "--help"]),
    ("yaml-bad-env", ["--config", "{root}/bad-env.yaml"], ["env: a mapping"]),
    # presets that cannot be read
    ("config-missing", ["--config", "{root}/nowhere.yaml"], ["cannot read config", "nowhere.yaml"]),
    ("config-a-folder", ["--config", "{root}/empty"], ["cannot read config", "empty"]),
    ("config-not-a-mapping", ["--config", "{root}/raw-not-a-mapping.yaml"], ["must be a YAML mapping"]),
    ("config-bad-yaml", ["--config", "{root}/raw-bad-yaml.yaml"], ["cannot read config", "raw-bad-yaml.yaml"]),
    ("config-no-file", ["--config"], ["--config needs a YAML file"]),
    ("config-twice", ["--config", DEMO, "--config", DEMO], ["--config is given twice"]),
    # values out of range
    ("no-group", ["--num_generations", "1"], ["--num_generations 1", "at least 2"]),
    ("groups-do-not-fit", ["--num_generations", "3"], ["--num_generations 3", "8 completions", "2, 4, 8"]),
    ("eval-groups", ["--num_generations", "3", "--per_device_train_batch_size", "3"],
     ["--num_generations 3", "--per_device_eval_batch_size 8"]),  # fmt: skip
    ("games", ["--games", "0"], ["games must be >= 1"]),
    ("board", ["--size", "1"], ["size"]),
    ("target", ["--target", "100"], ["target"]),
    ("keys", ["--keys", "WWSD"], ["keys"]),
    ("eval-samples", ["--eval_samples", "0"], ["--eval_samples 0", "at least 1"]),
    ("archive-budget", ["--archive_budget", "1.5"], ["--archive_budget 1.5", "at most 1"]),
    ("overlong", ["--overlong_penalty", "96"], ["--overlong_penalty 96", "--max_completion_length (96)"]),
    ("archive-games", ["--archive_games", "100000000"], ["--archive_games 100000000", "nothing would ever be ranked"]),
    # values at their edges (issue 48): each named as given, before anything is written
    *[(f"range-{flag}-{value}", [f"--{flag}", value], [f"--{flag} {value}: must be", said]) for flag, value, said in (
        ("per_device_train_batch_size", "0", "at least 1"), ("learning_rate", "-1", "above 0"),
        ("seed", "-1", "between 0"), ("temperature", "0", "above 0"), ("max_seq_length", "0", "at least 1"),
        ("dataset_size", "0", "at least 1"), ("max_steps", "0", "at least 1"), ("sft_epochs", "-1", "above 0"),
        ("beta", "-1", "at least 0"), ("num_samples", "-1", "at least 1"), ("save_steps", "0", "above 0"),
        ("eval_steps", "0", "above 0"), ("gradient_accumulation_steps", "0", "at least 1"),
        ("max_completion_length", "0", "at least 1"), ("lora_r", "0", "at least 1"),
        ("lora_dropout", "2", "a probability"), ("learning_rate", "nan", "a finite number"))],  # fmt: skip
    ("output-dir-empty", ["--output_dir", ""], ["--output_dir ''", "must name a folder"]),
    # options that contradict each other
    ("two-resumes", ["--resume", "auto", "--resume_from_checkpoint", "{root}/run/checkpoint-2"],
     ["--resume auto and --resume_from_checkpoint", "give one"]),  # fmt: skip
    ("skip-unmasked", ["--truncated", "skip", "--mask_truncated_completions", "false"],
     ["--truncated skip", "--mask_truncated_completions true"]),  # fmt: skip
    ("overwrite-and-resume", ["--overwrite_output_dir", "true", "--resume", "auto"], ["--overwrite_output_dir", "give one"]),
    ("report-to-missing", ["--report_to", "wandb"], ["--report_to wandb", "not installed"]),
    ("report-to-unknown", ["--report_to", "tensorbord"], ["--report_to tensorbord", "no such integration"]),
    ("report-to-one-of-two", ["--report_to", "tensorboard,comet_ml"], ["--report_to comet_ml", "not installed"]),
    ("mxfp4-on-cpu", ["--save_method", "mxfp4"], ["--save_method mxfp4", "unsloth"]),
    ("best-by-an-unlogged-metric", ["--metric_for_best_model", "eval_loss"],
     ["--metric_for_best_model eval_loss: the evaluation logs", "eval_mean_reward"]),  # fmt: skip
    # paths that are not what they must be
    ("model-missing", ["--model_name_or_path", "{root}/no-model"], ["model path", "does not exist"]),
    ("model-empty-folder", ["--model_name_or_path", "{root}/empty"], ["model path", "no config.json"]),
    ("model-a-file", ["--model_name_or_path", "{root}/a-file"], ["model path", "a file, not a model folder"]),
    ("model-an-adapter", ["--model_name_or_path", "{root}/adapter"], ["holds LoRA adapters", "org/base"]),
    ("model-says-nothing", ["--model_name_or_path", "{root}/says-nothing"], ["cannot load model", "model_type"]),
    ("model-damaged-weights", ["--model_name_or_path", "{root}/damaged-weights"], ["cannot load model", "header"]),
    # LoRA options the loaded model cannot take: named, after the model loaded (issue 48), never "cannot load model"
    ("lora-no-such-module", ["--lora_target_modules", "nosuch_proj"],
     ["--lora_target_modules nosuch_proj: no module of", "q_proj", "down_proj"]),  # fmt: skip
    ("lora-one-of-two-unknown", ["--lora_target_modules", "q_proj", "nosuch_proj"],
     ["--lora_target_modules q_proj nosuch_proj: no module of", "nosuch_proj", "k_proj"]),  # fmt: skip
    ("lora-one-name", ["--lora_target_modules", "q_proj"],
     ["--lora_target_modules q_proj: one value is read as a pattern of whole module names", ".*\\.q_proj"]),  # fmt: skip
    ("output-under-a-file", ["--output_dir", "{root}/a-file/out"], ["output_dir", "not a writable directory"]),
    ("output-in-proc", ["--output_dir", "/proc/train_2048-out"], ["output_dir /proc/train_2048-out", "writable"]),
    ("resume-missing", ["--resume", "{root}/nowhere/checkpoint-3"], ["not a checkpoint that can be loaded"]),
    ("resume-not-a-checkpoint", ["--resume", "{root}/empty"], ["trainer_state.json cannot be read"]),
    ("resume-damaged-weights", ["--resume", "{root}/loose/checkpoint-6"], ["adapter_model.safetensors is damaged"]),
    ("resume-no-weights", ["--resume", "{root}/bare/checkpoint-8"], ["adapter_model.safetensors) are missing"]),
    ("resume-damaged-optimizer", ["--resume", "{root}/damaged/checkpoint-2"], ["optimizer.pt is damaged"]),
    ("resume-damaged-state", ["--resume", "{root}/damaged/checkpoint-4"], ["trainer_state.json cannot be read"]),
    ("resume-into-another-run", ["--resume", "{root}/run/checkpoint-2", "--output_dir", "{root}/damaged"],
     ["holds another run than", "--output_dir"]),  # fmt: skip
    # an output folder that holds a run
    ("second-run", ["--output_dir", "{root}/run"], ["holds a run", "--resume auto", "--overwrite_output_dir true"]),
    ("second-run-other-options", ["--output_dir", "{root}/run", "--max_steps", "3", "--seed", "1"], ["holds a run"]),
    ("resume-nothing-loadable", ["--output_dir", "{root}/damaged", "--resume", "auto"],
     ["no checkpoint that can be loaded", "checkpoint-4 is skipped", "checkpoint-2 is skipped"]),  # fmt: skip
    # files a user hands the project (issue 47): each refused before it is read whole, nothing run
    ("preset-dev-zero", ["--config", "/dev/zero"], ["cannot read config /dev/zero", "a character device"]),
    ("preset-fifo", ["--config", "{root}/fifo.yaml"], ["fifo.yaml", "FIFO"]),
    ("preset-folder", ["--config", "{root}/run"], ["cannot read config", "a folder"]),
    ("preset-huge", ["--config", "{root}/huge.yaml"], ["huge.yaml", "2 MB, above the 1 MB"]),
    ("preset-aliases", ["--config", "{root}/aliases.yaml"], ["aliases.yaml", "line 2", "aliases"]),
    ("preset-deep", ["--config", "{root}/deep.yaml"], ["deep.yaml", "nested deeper than 32"]),
    ("preset-sandbox-wrap", ["--config", "{root}/wrap.yaml"], ["wrap.yaml: env: TRAIN2048_SANDBOX_WRAP", "may set only"]),
    ("preset-preload", ["--config", "{root}/preload.yaml"], ["env: LD_PRELOAD", "may set only"]),
    ("preset-env-value", ["--config", "{root}/env-value.yaml"], ["env: PYTORCH_CUDA_ALLOC_CONF", "not a plain setting"]),
    ("resume-pickle", ["--resume", "{root}/pickled/checkpoint-4"],
     ["optimizer.pt cannot be loaded as data", "UnpicklingError"]),  # fmt: skip
    ("resume-bomb-header", ["--resume", "{root}/bomb/checkpoint-6"],
     ["adapter_model.safetensors is damaged", "does not fill bytes"]),  # fmt: skip
    # output folders: a link, or a file a run would write that is the user's
    ("log-is-a-link", ["--output_dir", "{root}/log-link"], ["training.log is a symbolic link", "move it"]),
    ("log-is-the-users", ["--output_dir", "{root}/user-log"], ["training.log, which no run", "move it"]),
    ("model-folder-is-the-users", ["--output_dir", "{root}/user-model"], ["tiny-model, which no run"]),
    ("final-is-a-link", ["--output_dir", "{root}/linked-final", "--resume", "auto"], ["final is a symbolic link"]),
    # a resume past the run's end
    ("resume-past-the-end", ["--resume", "{root}/run/checkpoint-4", "--output_dir", "{root}/run", "--max_steps", "3"],
     ["--max_steps 3", "at step 4 already", "raise --max_steps above 4"]),  # fmt: skip
    # a checkpoint that does not fit the options
    ("resume-other-rank", ["--output_dir", "{root}/run", "--resume", "auto", "--lora_r", "8"],
     ["--lora_r 8", "trained with --lora_r 16"]),  # fmt: skip
    ("resume-other-alpha", ["--output_dir", "{root}/run", "--resume", "auto", "--lora_alpha", "8"],
     ["--lora_alpha 8", "--lora_alpha 32"]),  # fmt: skip
]


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def one_line(capsys, prog: str) -> str:
    """Our one line on stderr; transformers' bar of a model load that went through (a LoRA mistake comes after it) is
    progress, not a line of the mistake."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not re.match(r"Loading weights: +\d+%\|", line)]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: "), err
    return lines[0]


@pytest.mark.parametrize("case", TRAIN, ids=[case[0] for case in TRAIN])
def test_train_2048_mistake(place, case, capsys):
    name, argv, words, *absent = case
    argv = [word.replace("{root}", str(place)) for word in argv]
    if "--config" not in argv:
        argv = ["--config", DEMO, *argv]
    out = place / f"out-{name}"
    if "--output_dir" not in argv:
        argv += ["--output_dir", str(out)]
    runs = {folder: snapshot(place / folder) for folder in ("run", "damaged")}
    with pytest.raises(SystemExit) as stop:
        train_2048.main(argv)
    assert stop.value.code == 2
    line = one_line(capsys, "train_2048")
    for word in words:
        assert word in line, line
    assert not out.exists()
    assert {folder: snapshot(place / folder) for folder in runs} == runs  # nothing of an earlier run touched
    assert not (place / "wrapped").exists() and not (place / "pickle-ran").exists()  # nothing a file holds ran
    assert not (place / "outside.log").exists()  # nothing written through a link


def test_a_finished_run_resumed_trains_nothing_and_replaces_nothing(place, capsys):
    """--resume auto on a run at its --max_steps: one line, exit status 0, every file as it was. The newest
    checkpoint here holds pickles that would run a command: skipped as damaged, never loaded."""
    before = snapshot(place / "pickled")
    argv = ["--config", DEMO, "--output_dir", str(place / "pickled"), "--resume", "auto", "--max_steps", "2"]
    assert train_2048.main(argv) == 0
    out = capsys.readouterr().out
    assert "finished at step 2 of --max_steps 2" in out and "raise --max_steps above 2" in out, out
    assert snapshot(place / "pickled") == before and not (place / "pickle-ran").exists()


EVALUATE = [
    ("adapter-missing", ["--adapter", "{root}/missing"], ["no adapter_config.json there"]),
    ("adapter-empty", ["--adapter", "{root}/empty"], ["no adapter_config.json there"]),
    ("model-missing", ["--model", "{root}/missing"], ["no such directory"]),
    ("model-empty", ["--model", "{root}/empty"], ["--model", "no config.json"]),
    ("model-an-adapter", ["--model", "{root}/adapter"], ["holds LoRA adapters", "org/base"]),
    ("strategy-no-function", ["--strategy", "{root}/nostrategy.py"], ["defines no top-level function `strategy`"]),
    ("strategy-syntax", ["--strategy", "{root}/syntax.py"], ["does not parse"]),
    ("strategy-missing", ["--strategy", "{root}/missing.py"], ["cannot read it"]),
    ("strategy-binary", ["--strategy", "{root}/binary.py"], ["cannot read it"]),
    ("nothing", ["--no-baselines"], ["nothing to evaluate"]),
    ("base-alone", ["--base"], ["--base needs --adapter"]),
    ("watch-nothing", ["--watch", "nosuch"], ["not a baseline"]),
    ("watch-model-alone", ["--watch", "model"], ["--watch model needs --adapter or --model"]),
    ("board", ["--size", "1"], ["size must be an integer >= 2"]),
    ("target", ["--target", "100"], ["target must be a power of two"]),
    ("games", ["--games", "0"], ["games must be >= 1"]),
    ("keys", ["--keys", "WWSD"], ["keys must be four distinct characters"]),
    ("text-for-int", ["--samples", "some"], ["--samples", "'some'"]),
    ("unknown-flag", ["--no-such-flag"], ["unknown option --no-such-flag"]),
    ("typo", ["--sample", "3"], ["did you mean --samples?"]),
    ("config-missing", ["--config", "{root}/nowhere.yaml"], ["cannot read config", "nowhere.yaml"]),
    ("config-no-file", ["--config"], ["--config needs a YAML file"]),
    ("config-bad-board", ["--config", "{root}/bad-board.yaml"], ["bad-board.yaml: size", "'three'"]),
    ("config-bad-budget", ["--config", "{root}/bad-budget.yaml"], ["bad-budget.yaml: max_completion_length", "'1.5'"]),
    # Each option named alone, with its value; NaN and infinities refused; an accelerate config is no preset (the
    # fourth element: words the line must not hold).
    ("temperature-nan", ["--temperature", "nan"], ["--temperature nan", "finite"]),
    ("temperature-inf", ["--temperature", "inf"], ["--temperature inf", "finite"]),
    ("speed-negative", ["--speed", "-1"], ["--speed -1", "at least 0"], ["--temperature"]),
    ("speed-nan", ["--speed", "nan"], ["--speed nan", "finite"]),
    ("samples-zero", ["--samples", "0"], ["--samples 0", "at least 1"]),
    ("batch-size-zero", ["--batch_size", "0"], ["--batch_size 0", "at least 1"]),
    ("max-new-tokens-zero", ["--max_new_tokens", "0"], ["--max_new_tokens 0", "at least 1"]),
    ("seed-negative", ["--seed", "-1"], ["--seed -1", "between 0 and 2^63 - 1"]),
    ("seed-past-63-bits", ["--seed", str(2**63)], [f"--seed {2**63}", "between 0 and 2^63 - 1"]),
    ("config-accelerate", ["--config", str(REPO / "configs" / "accelerate" / "ddp.yaml")],
     ["--config ", "ddp.yaml: not a train_2048 preset", "unknown key compute_environment"]),  # fmt: skip
    ("config-env", ["--config", "{root}/env.yaml"], ["--config ", "env.yaml: env: LD_PRELOAD"]),
    ("watch-folder", ["--watch", "{root}"], ["--watch ", "cannot read it: a folder"], ["--strategy", "cannot read --"]),
]


@pytest.fixture(scope="module")
def eval_place(place):
    (place / "nostrategy.py").write_text("def play(board):\n    return 'A'\n")
    (place / "syntax.py").write_text("def strategy(board)\n    return 'A'\n")
    (place / "binary.py").write_bytes(b"\xff\xfe\x00bad")
    (place / "bad-board.yaml").write_text("size: three\noutput_dir: somewhere\n")
    (place / "bad-budget.yaml").write_text("max_completion_length: 1.5\n")
    (place / "env.yaml").write_text("size: 3\nenv:\n  LD_PRELOAD: /tmp/x.so\n")
    return place


@pytest.mark.parametrize("case", EVALUATE, ids=[case[0] for case in EVALUATE])
def test_evaluate_2048_mistake(eval_place, case, capsys):
    name, argv, words, *absent = case
    out = eval_place / f"eval-{name}"
    argv = [word.replace("{root}", str(eval_place)) for word in argv] + ["--output_dir", str(out)]
    with pytest.raises(SystemExit) as stop:
        evaluate_2048.main(argv)
    assert stop.value.code == 2
    line = one_line(capsys, "evaluate_2048")
    for word in words:
        assert word in line, line
    for word in absent[0] if absent else []:
        assert word not in line, line
    assert not (out / "results.json").exists() and not out.exists()


def test_a_second_run_is_refused_before_anything_is_written(place, capsys, monkeypatch):
    """The default output folder, run twice: the second run names both ways on, and the first is as it was, in the
    folder a user runs from (the default --output_dir is relative)."""
    monkeypatch.chdir(place)
    finished_run(place / "outputs" / "cpu-demo")
    before = snapshot(place / "outputs")
    with pytest.raises(SystemExit) as stop:
        train_2048.main(["--config", DEMO])
    line = one_line(capsys, "train_2048")
    assert stop.value.code == 2 and "outputs/cpu-demo holds a run" in line and "--resume auto" in line
    assert snapshot(place / "outputs") == before


def held(run: Path, **asked):
    """The folder taken and started as train_2048 does once its checks pass."""
    taken = run_folder.take(run, **asked)
    taken.start()
    return taken


def test_overwrite_deletes_only_what_the_run_recorded(tmp_path):
    """--overwrite_output_dir deletes what the run's record claims, nothing else: the user's files before and after
    it, names like a run's included (the hostile corpus of issue 46, and names that begin as our temporary ones do),
    and never what a link points to."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    mine = {"README.md": "mine", "final-report.md": "r", "checkpoint-notes.txt": "n", "final.pdf": "p",
            "final.bak/a": "b", "sft/a": "s", "runs/other-project/events": "e", "tiny-model-v2/config.json": "{}",
            ".strategies-mine/a": "m", ".train_2048-mine": "m", ".strategies-2-mine/a": "m"}  # fmt: skip
    for name, text in mine.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    first = held(run)  # the run starts: its record claims what it will write
    run_folder.claim(run, "runs/Nov28_host")
    (run / "runs" / "Nov28_host").mkdir()
    run_folder.claim(run, "checkpoint-2")
    checkpoint(run, 2)
    (run / "final").mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "training.log").write_text("log\n")
    copy = run_folder.make_folder(run, ".strategies-2-")
    run_folder.claim(run, copy.name)
    (run / "strategies").symlink_to(copy.name)
    first.release()
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "data").write_text("outside")
    (run / "tiny-model").symlink_to(outside / "keep")  # a claimed name turned into a link: the link goes, not its target
    mine |= {"notes-after.txt": "later", "final-report-2.md": "later"}  # the user's files added beside the run
    (run / "notes-after.txt").write_text("later")
    (run / "final-report-2.md").write_text("later")
    held(run, overwrite=True).release()
    assert {name: (run / name).read_text() for name in mine} == mine
    left = {p.name for p in run.iterdir()} - {n.split("/")[0] for n in mine}
    assert left == {run_folder.MANIFEST, run_folder.LOCK}, left
    assert sorted(p.name for p in (run / "runs").iterdir()) == ["other-project"]
    assert (outside / "keep" / "data").read_text() == "outside"


def test_a_folder_of_a_run_without_its_record_is_refused_not_guessed_at(tmp_path, capsys):
    """An older train_2048's run (no record): --overwrite_output_dir deletes nothing and says why, and its advice
    works: --resume auto adopts it, and nothing it adopted is ever deleted (--overwrite_output_dir then names them)."""
    run = finished_run(tmp_path / "run", recorded=False)
    before = snapshot(run)
    with pytest.raises(SystemExit) as stop:
        train_2048.main(["--config", DEMO, "--output_dir", str(run), "--overwrite_output_dir", "true"])
    line = one_line(capsys, "train_2048")
    assert stop.value.code == 2 and "a run of an older train_2048" in line and "no record" in line, line
    assert "continue it with --resume auto" in line and snapshot(run) == before
    held(run, resume="auto").release()  # what --resume auto does once its checks pass
    record = run_folder.read_manifest(run)
    assert {"checkpoint-2", "checkpoint-4", "final", "metrics.jsonl", "training.log"} <= set(record["adopted"])
    assert not set(record["adopted"]) & set(record["claims"])
    adopted = snapshot(run)
    with pytest.raises(run_folder.FolderRefused, match="never deletes: move them yourself"):
        run_folder.take(run, overwrite=True)
    assert snapshot(run) == adopted


def test_resume_auto_skips_damaged_checkpoints_and_names_them(tmp_path):
    """--resume auto takes the newest checkpoint that can be loaded; each newer one is named with what is wrong, a
    half-written trainer_state.json included."""
    run = finished_run(tmp_path / "run")
    good = run / "checkpoint-2"
    cut_short(run / "checkpoint-4" / "rng_state.pth")
    checkpoint(run, 6)
    (run / "checkpoint-6" / "trainer_state.json").write_text('{"global_step": 6, "log_hist')
    checkpoint(run, 8)
    (run / "checkpoint-8" / "trainer_state.json").unlink()  # killed before it was written
    checkpoint(run, 10)
    (run / "checkpoint-10" / "trainer_state.json").write_text(json.dumps({"global_step": 2}))  # renamed by hand
    (run / "checkpoint-12.tmp").mkdir()
    record(run, [*run_folder.RUN_NAMES, *(f"checkpoint-{n}" for n in (2, 4, 6, 8, 10))])
    taken = run_folder.take(run, resume="auto")
    taken.release()
    assert taken.checkpoint == good
    notes = taken.notes
    assert [note.split(":")[0] for note in notes] == [f"checkpoint-{s} is skipped" for s in (10, 8, 6, 4)]
    assert "of step 2, not 10" in notes[0] and "trainer_state.json cannot be read" in notes[2]
    assert "rng_state.pth is damaged" in notes[3]


def test_metrics_of_redone_steps_are_dropped_on_resume(tmp_path):
    run = finished_run(tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rew')  # a line cut short by kill -9
    checkpoint_state.drop_later_metrics(run / "metrics.jsonl", run / "checkpoint-2")
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_the_last_line_names_a_tensorboard_that_runs(tmp_path):
    command = trainer.tensorboard_command(tmp_path / "my run")
    program = command.split(" --logdir ")[0]
    assert os.access(program, os.X_OK) or program == "tensorboard", command
    assert command.endswith(f"--logdir '{tmp_path / 'my run'}'")


def test_archive_games_that_only_slow_steps_can_rescore_are_said_at_start():
    """Re-scoring plays --archive_games games within what the archive saves up (10 steps x --archive_budget of a step):
    beyond what any step allows the run is refused (the table above); beyond a 1-second step, a warning line says which
    steps leave it time, where a run on the CPU would otherwise rank nothing, silently."""
    script, *_ = options.parse_args(["--config", DEMO, "--archive_games", "100000"])
    line = options.check_archive_games(script)
    assert line.startswith("--archive_games 100000: re-scoring one strategy takes at least") and "on faster steps" in line
    for games in ("0", "4"):  # the evaluation's games, and the demo's pace
        assert options.check_archive_games(options.parse_args(["--config", DEMO, "--archive_games", games])[0]) is None


def test_every_option_of_ours_has_a_range_or_a_reason_it_needs_none():
    """options.RANGES or options.NO_RANGE names every field of train_2048's own options and the game's; and each
    range refuses a value outside it (a range that accepts everything is no check)."""
    import dataclasses

    import rewards

    ours = {f.name for cls in (options.ScriptArguments, rewards.RewardSettings) for f in dataclasses.fields(cls)}
    assert ours - set(options.RANGES) - set(options.NO_RANGE) == set()
    assert not set(options.RANGES) & set(options.NO_RANGE)
    for name, (accepts, _said) in options.RANGES.items():
        assert not all(accepts(v) for v in (-(2**40), -1, 0, 0.5, 1, 2, 2**40)), name
