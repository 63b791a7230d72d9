"""Files judged for what they hold, and the one resolver of the base (issue 53, items 4 and 5).

A run folder moved or renamed still evaluates and merges, its base found by trained_base.resolve_base (the option, the
recorded path, the same name in the run folder, the hub name), and a wrong base is still refused by its fingerprint.
Every file a user hands is read as hostile: a chat template that never ends, pickles that flood memory or hold what no
run writes, adapters far wider than their model, a base record of the wrong types, a preset's YAML integers of 100,000
digits, duplicate keys, keys no preset may hold; option combinations that cannot work; names over the system's limit;
a full disk; a base cut in half. Each ends in one line and exit status 2 (nothing half-written left behind), never a
hang, a flood of memory or a traceback.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest

import evaluate_2048
import merge_2048
import models
import sandbox

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "configs" / "cpu-demo.yaml")
BASE_FILE = "train_2048_base.json"  # trained_base.BASE_FILE, spelled out so that this file runs against older code too
QUICK = ["--samples", "2", "--max_new_tokens", "16", "--batch_size", "2", "--games", "1", "--no-baselines",
         "--config", DEMO]  # fmt: skip


def teardown_module():
    sandbox.shutdown()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    """A CPU-demo run of 2 steps, a checkpoint at each, final/ and its tiny-model/ (as `make demo` leaves them)."""
    import subprocess

    out = tmp_path_factory.mktemp("hostile") / "run"
    command = [sys.executable, str(REPO / "train_2048.py"), "--config", DEMO, "--max_steps", "2", "--save_steps", "1",
               "--sample_steps", "2", "--eval_strategy", "no", "--sft_epochs", "2", "--output_dir", str(out)]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return out


def reseeded(model: Path, to: Path, seed: int = 7) -> Path:
    """The same model (its config, its tokenizer) with weights drawn from another seed: every shape the same, so only
    the fingerprint tells them apart."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(model, to, dirs_exist_ok=True)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).save_pretrained(to)
    return to


def copy_run(demo_run: Path, to: Path) -> Path:
    shutil.copytree(demo_run, to, symlinks=True)
    return to


def refused(capsys, command, argv: list, *words: str) -> str:
    """command.main(argv) stops at a user's mistake: exit 2, one line on stderr holding each of `words` (after the bar of
    a model's load, for a check that needs the loaded model); that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        command.main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("Loading weights")]  # a bar
    assert stop.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def leftovers(folder: Path) -> list[str]:
    """Our temporary names in a folder: a merge or a save that stopped half-way must leave none."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".train_2048-") and p.is_dir())


# --- item 4: one resolver of the base -----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_moved_run_folder_evaluates_and_merges(demo_run, tmp_path, capsys):
    """The run folder renamed and moved, its tiny-model/ with it: the recorded absolute path is gone, and the same name
    in the run folder (train_2048_base.json's in_run) is found, for evaluate_2048 and merge_2048 alike."""
    moved = copy_run(demo_run, tmp_path / "elsewhere" / "renamed")
    shutil.move(demo_run, tmp_path / "gone")  # the recorded path no longer holds it
    try:
        assert evaluate_2048.main(["--adapter", str(moved / "final"), *QUICK, "--output_dir", str(tmp_path / "ev")]) == 0
        assert merge_2048.main(["--adapter", str(moved / "checkpoint-1"), "--output_dir", str(tmp_path / "merged")]) == 0
        assert f"into {moved / 'tiny-model'}" in capsys.readouterr().out
    finally:
        shutil.move(tmp_path / "gone", demo_run)
    record = json.loads((demo_run / "final" / BASE_FILE).read_text())
    assert record["in_run"] == "tiny-model" and record["path"] == str(demo_run / "tiny-model")


@pytest.mark.slow
def test_the_base_whose_fingerprint_agrees_is_taken_and_a_wrong_base_is_refused(demo_run, tmp_path, capsys):
    """The recorded path now holds another model (a new demo run, another seed) and the moved run holds its own: the
    merge takes the one whose fingerprint agrees. A wrong base named with --base, or no right one anywhere: one line."""
    moved = copy_run(demo_run, tmp_path / "moved")
    other = reseeded(demo_run / "tiny-model", tmp_path / "other-model")
    record = json.loads((moved / "final" / BASE_FILE).read_text())
    config = json.loads((moved / "final" / "adapter_config.json").read_text())
    record["path"] = record["name"] = config["base_model_name_or_path"] = str(other)  # the original run started over
    (moved / "final" / BASE_FILE).write_text(json.dumps(record))
    (moved / "final" / "adapter_config.json").write_text(json.dumps(config))
    assert merge_2048.main(["--adapter", str(moved / "final"), "--output_dir", str(tmp_path / "merged")]) == 0
    assert f"into {moved / 'tiny-model'}" in capsys.readouterr().out
    refused(capsys, merge_2048, ["--adapter", moved / "final", "--base", other, "--output_dir", tmp_path / "m"],
            f"{other} is not the model {moved / 'final'} was trained on", "--base")
    shutil.rmtree(moved / "tiny-model")
    refused(capsys, evaluate_2048, ["--adapter", moved / "final", *QUICK, "--output_dir", tmp_path / "ev"],
            f"{other} is not the model", "--model names the model it was trained on")
    assert not (tmp_path / "m").exists() and not (tmp_path / "ev").exists()


@pytest.mark.slow
def test_a_resume_onto_another_base_is_refused(demo_run, tmp_path, capsys):
    """--resume puts the checkpoint's adapters on the model the options name (the demo's: <output_dir>/tiny-model),
    found by the same rule: another model there (the same shapes, another seed's weights) is refused in one line by
    its fingerprint, not trained on."""
    run = copy_run(demo_run, tmp_path / "run")
    reseeded(demo_run / "tiny-model", run / "tiny-model")
    train_refused(capsys, resume(run), f"--resume: {run / 'tiny-model'} is not the model {run / 'checkpoint-2'} was "
                  "trained on", "--model_name_or_path names the model it was trained on")  # fmt: skip


# --- item 5: train_2048_base.json, every field type-checked ----------------------------------------------------------
RECORDS = {
    "fingerprint-a-list": ("fingerprint", [1, 2, 3], "its fingerprint is [1, 2, 3], not a mapping"),
    "fingerprint-text": ("fingerprint", "abc", 'its fingerprint is "abc", not a mapping'),
    "quantized-a-number": ("quantized", 4, "its quantized is 4, not a text or null"),
    "name-a-number": ("name", 5, "its name is 5, not a text"),
    "in-run-outside": ("in_run", "../../etc", 'its in_run "../../etc" is not a path inside the run folder'),
    "values-a-flood": ("fingerprint", {"norm": {"shape": [128], "values": [1.0] * 10_000}}, "fingerprint's \"norm\""),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", RECORDS)
def test_a_base_record_of_the_wrong_types_is_one_line(demo_run, tmp_path, capsys, case):
    """train_2048_base.json whose fingerprint is a list or text, "quantized": 4, ...: merge_2048 and evaluate_2048 say so
    in one line, exit 2, before anything is loaded or written (no merged model left in a hidden .train_2048-XXXX/)."""
    key, value, said = RECORDS[case]
    run = copy_run(demo_run, tmp_path / "run")
    record = json.loads((run / "final" / BASE_FILE).read_text())
    (run / "final" / BASE_FILE).write_text(json.dumps({**record, key: value}))
    refused(capsys, merge_2048, ["--adapter", run / "final"], said, str(run / "final"))
    refused(capsys, merge_2048, ["--adapter", run / "final", "--base", run / "tiny-model"], said)
    refused(capsys, evaluate_2048, ["--adapter", run / "final", *QUICK, "--output_dir", tmp_path / "ev"], said)
    assert leftovers(run) == [] and not (run / "final-merged_16bit").exists() and not (tmp_path / "ev").exists()


# --- item 5: chat templates from a folder the user hands ---------------------------------------------------------------
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"  # 10^10 iterations
FLOOD = "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"  # 100 MB of prompt


def template_in_tokenizer_config(folder: Path, template: str) -> None:
    """`template` as the folder's chat template, in tokenizer_config.json (the saved chat_template.jinja removed)."""
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))


@pytest.mark.slow
@pytest.mark.parametrize(("template", "said"), [(LOOPS, "renders the prompt for more than 1 s"),
                                                (FLOOD, "renders the prompt as 100,0")])  # fmt: skip
def test_a_chat_template_from_a_users_folder_is_rendered_with_a_bound_on_time_and_length(demo_run, tmp_path, capsys,
                                                                                        monkeypatch, template, said):  # fmt: skip
    """Nested range(100000) loops in an adapter's tokenizer_config.json (a template runs at every prompt: this one never
    ends), or one that writes 100 MB: evaluate_2048 and merge_2048 render it once before any sampling, stopped at
    models.TEMPLATE_SECONDS (1 s here) or refused for its length, in one line; so is a model folder's own (--model)."""
    import time

    monkeypatch.setattr(models, "TEMPLATE_SECONDS", 1)
    run = copy_run(demo_run, tmp_path / "run")
    template_in_tokenizer_config(run / "final", template)
    started = time.monotonic()
    refused(capsys, evaluate_2048, ["--adapter", run / "final", *QUICK, "--output_dir", tmp_path / "ev"],
            f"the chat template of {run / 'final'} {said}")
    refused(capsys, merge_2048, ["--adapter", run / "final", "--output_dir", tmp_path / "merged"],
            f"the chat template of {run / 'final'} {said}")
    template_in_tokenizer_config(run / "tiny-model", template)
    refused(capsys, evaluate_2048, ["--model", run / "tiny-model", *QUICK, "--output_dir", tmp_path / "ev2"],
            f"the chat template of {run / 'tiny-model'} {said}")
    assert time.monotonic() - started < 300 and not (tmp_path / "merged").exists() and leftovers(tmp_path) == []


# --- item 5: a checkpoint's pickles and trainer_state.json, judged before --resume loads them ---------------------------


def train_refused(capsys, argv: list, *words: str) -> str:
    import train_2048

    return refused(capsys, train_2048, argv, *words)


def resume(run: Path, checkpoint: str = "checkpoint-2") -> list:
    return ["--config", DEMO, "--output_dir", run, "--resume", run / checkpoint, "--max_steps", "3"]


def deep_list(depth: int) -> list:
    value = []
    for _ in range(depth):
        value = [value]
    return value


def pickles() -> dict:
    """name: (file in the checkpoint, what it holds, words of the line)."""
    import torch

    step_lr = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1), 5)
    return {
        "empty dicts, 22 MB": ("optimizer.pt", [{} for _ in range(3_700_000)], "holds a pickle of 2"),
        "empty dicts, 0.6 MB": ("optimizer.pt", [{} for _ in range(100_000)], "builds more than 23,840 objects"),
        "a deep list": ("optimizer.pt", deep_list(3000), "is not an optimizer's state (a list of 1"),
        "rng of wrong types": ("rng_state.pth", {"python": "abc", "numpy": 1, "cpu": [1, 2]}, "holds a python state"),
        "another scheduler": ("scheduler.pt", step_lr.state_dict(), "holds another scheduler's state than"),
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", ["empty dicts, 22 MB", "empty dicts, 0.6 MB", "a deep list", "rng of wrong types",
                                  "another scheduler"])  # fmt: skip
def test_a_checkpoint_pickle_of_the_wrong_size_or_shape_is_one_line(demo_run, tmp_path, capsys, case):
    """22 MB of empty dicts (weights-only loading builds 2.2 GB of them), a deep list, RNG states of the wrong types,
    another scheduler's state: --resume refuses the checkpoint in one line before transformers loads a byte of it;
    --resume auto skips it and names why."""
    import torch

    name, state, said = pickles()[case]
    run = copy_run(demo_run, tmp_path / "run")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # pickling a deep list recurses
    try:
        torch.save(state, run / "checkpoint-2" / name)
    finally:
        sys.setrecursionlimit(limit)
    before = sorted(p.name for p in run.iterdir())
    train_refused(capsys, resume(run), said)
    assert sorted(p.name for p in run.iterdir()) == before


@pytest.mark.slow
def test_stateful_callbacks_of_the_wrong_shape_are_one_line(demo_run, tmp_path, capsys):
    """trainer_state.json's stateful_callbacks a list (transformers rebuilds each callback from them), or a key no
    trainer state has (TrainerState(**record) fails): one line."""
    run = copy_run(demo_run, tmp_path / "run")
    state_file = run / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "stateful_callbacks": [1, 2]}))
    train_refused(capsys, resume(run), "stateful_callbacks are a list of 2, not a mapping")
    state_file.write_text(json.dumps({**state, "stateful_callbacks": {"GameSalt": {"args": {"salt": [1]}}}}))
    train_refused(capsys, resume(run), "stateful_callbacks GameSalt is a dict of 1, not {args, attributes}")
    state_file.write_text(json.dumps({**state, "surprise": 1}))
    train_refused(capsys, resume(run), "holds surprise, no field of a trainer's state")


# --- item 5: adapters far wider than their model, and kinds the project does not train ---------------------------------


def adapter_with(run: Path, **config) -> Path:
    path = run / "final" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return run / "final"


@pytest.mark.slow
def test_an_adapter_wider_than_its_model_or_of_another_kind_is_one_line(demo_run, tmp_path, capsys):
    """r = 2,000,000 (PEFT would build 2.6 GB of adapters before reading a tensor); a rank wider than any layer of the
    base; an alpha whose scale is wider still; a PREFIX_TUNING adapter with 3,000,000 virtual tokens: evaluate_2048 and
    merge_2048 say so in one line."""
    from safetensors.torch import load_file, save_file

    run = copy_run(demo_run, tmp_path / "run")
    final = adapter_with(run, r=2_000_000)
    for command, extra in ((evaluate_2048, [*QUICK, "--output_dir", tmp_path / "ev"]), (merge_2048, [])):
        refused(capsys, command, ["--adapter", final, *extra], "gives rank r = 2000000", "not a LoRA pair of that rank")
    tensors = load_file(str(final / "adapter_model.safetensors"))
    save_file({k: v for k, v in tensors.items() if ".lora_" not in k}, str(final / "adapter_model.safetensors"))
    adapter_with(run, r=300)  # no LoRA pair to measure it by: the base's widths (128, 256) bound it
    for command, extra in ((evaluate_2048, [*QUICK, "--output_dir", tmp_path / "ev"]), (merge_2048, [])):
        refused(capsys, command, ["--adapter", final, *extra], "gives rank r = 300, wider than any layer", "at most 256")
    adapter_with(run, r=16, lora_alpha=1e9)  # a scale of 6e7 on every LoRA: weights far past any width
    for command, extra in ((evaluate_2048, [*QUICK, "--output_dir", tmp_path / "ev"]), (merge_2048, [])):
        refused(capsys, command, ["--adapter", final, *extra], "gives lora_alpha = 1e+09, a scale of 6.25e+07")
    adapter_with(run, peft_type="PREFIX_TUNING", num_virtual_tokens=3_000_000)
    for command, extra in ((evaluate_2048, [*QUICK, "--output_dir", tmp_path / "ev"]), (merge_2048, [])):
        refused(capsys, command, ["--adapter", final, *extra], 'holds a "PREFIX_TUNING" adapter', "LORA adapters only")
    assert not (tmp_path / "ev").exists() and leftovers(run) == []


@pytest.mark.slow
def test_a_lora_rank_wider_than_the_model_is_refused_before_training(tmp_path, capsys):
    """--lora_r 2000000 on the demo's 128-wide model: one line naming the option, nothing trained."""
    train_refused(capsys, ["--config", DEMO, "--output_dir", tmp_path / "out", "--lora_r", "2000000", "--lora_alpha",
                           "16"], "--lora_r 2000000: wider than any layer", "at most 256")  # fmt: skip
    assert not (tmp_path / "out").exists()


# --- item 5: presets read as hostile YAML, and options checked with each other ---------------------------------------


def demo_with(text: str) -> str:
    """The demo preset with the keys of `text` in place of its own."""
    keys = {line.split(":")[0] for line in text.splitlines() if line and not line.startswith((" ", "#"))}
    kept = [line for line in Path(DEMO).read_text().splitlines() if line.split(":")[0] not in keys]
    return "\n".join(kept) + "\n" + text + "\n"


PRESETS = {  # name: (the preset's text, words of the line)
    "an integer of 100,000 digits": (demo_with("max_steps: " + "9" * 100_000), "an integer of 100,000 digits"),
    "a key given twice": (Path(DEMO).read_text() + "\nmax_steps: 3\n", "the key max_steps is given twice"),
    "a config: key": (demo_with("config: configs/gpt-oss-20b.yaml"), "config: a preset cannot name another preset"),
    "help: true": (demo_with("help: true"), "help: --help is a command-line flag"),
    "output_dir: null": (demo_with("output_dir: null"), "--output_dir is not given"),
    "a list for reasoning_effort": (demo_with("chat_template_kwargs: {reasoning_effort: [low, high]}"),
                                    'reasoning_effort ["low", "high"]: one of low, medium, high'),
}


@pytest.mark.parametrize("case", PRESETS)
def test_a_hostile_preset_is_one_line(tmp_path, capsys, monkeypatch, case):
    """YAML integers bounded, duplicate keys refused (YAML keeps the last, unsaid), no `config:` or `help:` in a
    preset, `output_dir: null` refused (transformers would write ./trainer_output), a list for reasoning_effort refused:
    one line, exit 2, nothing written."""
    text, said = PRESETS[case]
    preset = tmp_path / "preset.yaml"
    preset.write_text(text)
    monkeypatch.chdir(tmp_path)
    argv = ["--config", preset] + ([] if case == "output_dir: null" else ["--output_dir", tmp_path / "out"])
    train_refused(capsys, argv, said)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preset.yaml"]
    if case in ("an integer of 100,000 digits", "a key given twice", "a config: key", "help: true"):
        refused(capsys, evaluate_2048, ["--config", preset, "--strategy", preset, "--no-baselines"], said)


@pytest.mark.parametrize(("flags", "said"), [
    (["--max_completion_length", "400", "--max_seq_length", "64"], "--max_completion_length 400: must be below "
                                                                    "--max_seq_length 64"),
    (["--max_seq_length", "300"], "--max_seq_length 300: the warm start's example answers take up to"),
])  # fmt: skip
def test_option_combinations_are_checked_with_each_other(tmp_path, capsys, flags, said):
    """A completion budget longer than the whole sequence, or a sequence too short for the warm start's examples (on
    the demo, a ValueError deep in the warm start, exit 1): one line, exit 2, the folder left as it was."""
    train_refused(capsys, ["--config", DEMO, "--output_dir", tmp_path / "out", *flags], said)
    assert not (tmp_path / "out").exists()


# --- item 5: names over the system's limit, a full disk, a base cut in half --------------------------------------------


@pytest.mark.slow
def test_a_name_over_the_systems_limit_is_one_line(demo_run, tmp_path, capsys):
    """An output folder whose name is longer than the file system allows (NAME_MAX, 255 bytes): train_2048,
    evaluate_2048 and merge_2048 (its default <adapter>-merged_16bit too) say so in one line, before anything."""
    long = tmp_path / ("a" * 300)
    said = "is a name of 300 bytes, longer than this file system allows (255)"
    train_refused(capsys, ["--config", DEMO, "--output_dir", long], said)
    refused(capsys, evaluate_2048, ["--output_dir", long, "--strategy", DEMO, "--no-baselines"], said)
    refused(capsys, merge_2048, ["--adapter", demo_run / "final", "--output_dir", long], said)
    adapter = tmp_path / ("b" * 250)
    shutil.copytree(demo_run / "final", adapter)
    refused(capsys, merge_2048, ["--adapter", adapter], "a name of 263 bytes", "name another --output_dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == [adapter.name]


def small_disk(folder: Path, size: str) -> bool:
    """A tmpfs of `size` mounted on `folder` (root with the right to mount): False where it cannot be."""
    import subprocess

    folder.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True).returncode == 0  # fmt: skip


@pytest.mark.slow
def test_a_full_disk_is_named_as_one(tmp_path):
    """The disk fills up while a checkpoint is written (a 4 MB file system: the tiny model fits, a checkpoint does
    not): "no space left on device", not torch's `[enforce fail at inline_container.cc:672] . unexpected pos`."""
    import subprocess

    disk = tmp_path / "disk"
    if not small_disk(disk, "4m"):
        pytest.skip("no tmpfs can be mounted here (needs root with CAP_SYS_ADMIN)")
    try:
        result = subprocess.run([sys.executable, str(REPO / "train_2048.py"), "--config", DEMO, "--max_steps", "2",
                                 "--save_steps", "1", "--eval_strategy", "no", "--sft_epochs", "1", "--output_dir",
                                 str(disk / "run")], cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert last.startswith(f"train_2048: cannot write {disk / 'run' / 'checkpoint-1'} (no space left on device"), last


def test_a_failed_write_on_a_full_disk_is_said_as_one(tmp_path):
    """user_files.write_failure on torch's own error from a full disk (its zip writer hides ENOSPC)."""
    import gc
    import subprocess

    import torch

    import user_files

    disk = tmp_path / "disk"
    if not small_disk(disk, "200k"):
        pytest.skip("no tmpfs can be mounted here (needs root with CAP_SYS_ADMIN)")
    said = "torch.save did not fail"
    try:
        torch.save({"a": torch.zeros(100_000)}, disk / "x.pt")
    except RuntimeError as error:
        assert "unexpected pos" in str(error)
        said = user_files.write_failure(error, disk)
    finally:
        gc.collect()  # torch's writer, held by the error's frames, keeps the file open: the disk would stay busy
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert said.startswith("no space left on device (") and "free on the disk holding" in said, said


@pytest.mark.slow
def test_a_base_cut_in_half_is_one_line(demo_run, tmp_path, capsys):
    """The tiny model's weights cut to half their length (a copy stopped half-way): evaluate_2048 (--model, and the
    base an adapter finds) and merge_2048 name the file in one line."""
    run = copy_run(demo_run, tmp_path / "run")
    weights = run / "tiny-model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    said = "its model.safetensors is damaged"
    refused(capsys, evaluate_2048, ["--model", run / "tiny-model", *QUICK, "--output_dir", tmp_path / "e1"], said)
    refused(capsys, evaluate_2048, ["--adapter", run / "final", "--model", run / "tiny-model", *QUICK], said)
    refused(capsys, merge_2048, ["--adapter", run / "final", "--base", run / "tiny-model"], said)
    assert leftovers(run) == [] and not (tmp_path / "e1").exists()


# --- item 6: lines cut at a word ------------------------------------------------------------------------------------


def test_a_long_line_is_cut_at_a_word_with_an_ellipsis():
    """user_files.shorten (every one_line helper's): whitespace collapsed, cut at the last word boundary before the
    limit with "...", never in the middle of a word; a single word longer than half the line (a path) is cut."""
    import options
    import user_files

    text = "the checkpoint's trainer_state.json cannot be read because " + "something went wrong " * 20
    cut = user_files.shorten(text, 120)
    assert len(cut) <= 120 and cut.endswith("...") and text.startswith(cut[:-3])
    assert text[len(cut) - 3] == " ", cut  # the word before the ellipsis is whole
    assert user_files.shorten("a  b\n c", 120) == "a b c"
    path = "/" + "x" * 300
    assert user_files.shorten(path, 100) == path[:97] + "..."
    line = options.one_line(ValueError(text), 120)
    assert line.startswith("ValueError: the checkpoint's") and line.endswith("wrong...") and len(line) <= 120
    cut = models.one_line(ValueError(text), 100)
    assert cut.endswith("...") and text.startswith(cut[:-3]) and text[len(cut) - 3] == " ", cut
