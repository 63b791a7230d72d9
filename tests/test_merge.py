"""merge_2048.py: merging a saved adapter into its 16-bit base, judged exactly, re-runnable; its errors (one line, exit
2); and train_2048's check, before training, of the base --save_method merged_16bit will merge into.

The tiny GPT-OSS here carries LoRA as the transformers backend trains it (the fused experts as target parameters).
Unsloth's layouts, both presets and the three adapter sizes are the Unsloth tier's (tests/unsloth)."""

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest

import checkpoint_state
import demo_data
import merge_2048
import merging
import models
import options
import rewards
import saving
import trained_base

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import gpu_check  # noqa: E402
from merge_faults import FAULTS, HOLES, NAMED, break_merge, break_save  # noqa: E402


@pytest.fixture(autouse=True)
def train_2048_logger_restored():
    """merge_2048.main sets the console handler of the "train_2048" logger, as a command does: each test gets it back."""
    logger = logging.getLogger("train_2048")
    saved = logger.handlers[:], logger.propagate, logger.level
    yield
    logger.handlers, logger.propagate, logger.level = saved


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny GPT-OSS stored in bf16 in several shards (as the hub's 16-bit originals are), and beside it a LoRA on
    attention and the fused experts, each changing its weights by 0.2% of a weight (a 300-step run's size)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GptOssConfig, GptOssForCausalLM

    root = tmp_path_factory.mktemp("merge")
    tokenizer = demo_data.build_tokenizer([rewards.build_prompt(rewards.RewardSettings())])
    config = GptOssConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], router_aux_loss_coef=0.0, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    for seed, name in ((0, "base"), (1, "other-seed")):  # the same model built with another seed: other weights
        torch.manual_seed(seed)
        GptOssForCausalLM(config).to(torch.bfloat16).save_pretrained(root / name, max_shard_size="100KB")
        tokenizer.save_pretrained(root / name)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=models.GPT_OSS_EXPERTS)  # fmt: skip
    model = get_peft_model(GptOssForCausalLM.from_pretrained(root / "base"), lora)
    gpu_check.move_adapters(model, share=0.002)
    model.save_pretrained(root / "final")
    tokenizer.save_pretrained(root / "final")
    trained_base.write_base_identity(root / "final", trained_base.base_identity(str(root / "base")))  # as a run's save writes it
    return root


def merge(*args) -> int:
    return merge_2048.main([str(a) for a in args])


def one_line_error(capsys, stop, *words):
    """Exit 2, and our one line on stderr, naming what is wrong."""
    assert stop.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("merge_2048: "), lines
    for word in words:
        assert word in lines[0], lines[0]


# --- a merge, judged ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_real_size_merge_is_correct_says_what_16_bits_keep_and_is_never_overwritten_unasked(tiny, capsys):
    """0.2% of a weight: a correct merge (exit 0) whose 16-bit weights keep part of the adapters' change, said in one
    line and in merge_report.json with the advice to serve the adapters. The same command again refuses to replace
    it; with --overwrite_output_dir it merges again, the same bytes."""
    out = tiny / "final-merged_16bit"
    assert merge("--adapter", tiny / "final") == 0  # the default output folder: beside the adapter
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("verified ")]
    assert len(said) == 1 and f"verified {out}: a correct merge" in said[0] and "16-bit keeps 0." in said[0]
    report = json.loads((out / "merge_report.json").read_text())
    assert report["wrong"] == [] and report["dtype"] == "bfloat16" and report["adapted_tensors"] == 12
    assert 0.5 < report["kept"] < merging.MERGED_KEPT and 0 < report["rounded_away"] < report["changed_weights"]
    assert report["distributions"] == "compared in float32 arithmetic, on the CPU" and report["kept_effect"] is not None
    assert "serve them on the base" in report["advice"] and report["base"] == str(tiny / "base")
    assert sorted(p.name for p in tiny.iterdir()) == ["base", "final", "final-merged_16bit", "other-seed"]  # nothing else
    first = (out / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit) as stop:
        merge("--adapter", tiny / "final")
    one_line_error(capsys, stop, str(out), "exists", "--overwrite_output_dir")
    assert (out / "model.safetensors").read_bytes() == first
    assert merge("--adapter", tiny / "final", "--overwrite_output_dir") == 0
    assert (out / "model.safetensors").read_bytes() == first


@pytest.mark.parametrize("fault", FAULTS)
def test_a_wrong_merge_exits_1_and_publishes_nothing(tiny, tmp_path, fault, monkeypatch, capsys):
    """merge_faults.py's wrong merges, with adapters that change each weight by 0.2% of a weight, which 16-bit rounding
    mostly erases: exit 1, one ERROR line naming the tensors, nothing published, the adapters untouched."""
    break_merge(monkeypatch, fault)
    before = (tiny / "final" / "adapter_model.safetensors").read_bytes()
    assert merge("--adapter", tiny / "final", "--output_dir", tmp_path / "merged") == 1
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "the merge is wrong" in line]
    assert NAMED[fault] in line and "are not base + adapters rounded to bfloat16" in line
    assert list(tmp_path.iterdir()) == [] and (tiny / "final" / "adapter_model.safetensors").read_bytes() == before


def test_a_checkpoint_merges_beside_itself_where_no_resume_or_rotation_takes_it_for_one(tiny, tmp_path):
    """checkpoint-N (what a run saves every save_steps: the same adapter files, with the optimizer's) merges into
    checkpoint-N-merged_16bit, which --resume auto never takes for a checkpoint (nor transformers' rotation, whose
    pattern is checkpoint-<digits>)."""
    from transformers.trainer_utils import _re_checkpoint

    checkpoint = tmp_path / "checkpoint-7"
    shutil.copytree(tiny / "final", checkpoint)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 7}))
    _, base, output, _ = merge_2048.check_inputs(merge_2048.MergeArguments(adapter=str(checkpoint)))
    assert output == checkpoint.resolve().with_name("checkpoint-7-merged_16bit") and base == str(tiny / "base")
    output.mkdir()
    (output / "trainer_state.json").write_text(json.dumps({"global_step": 7}))  # as if it were one
    assert checkpoint_state.last_complete(tmp_path) == checkpoint and not _re_checkpoint.search(output.name)


# --- bad input: one line, exit 2, nothing written -----------------------------------------------------------------


def bad_inputs(tiny: Path, tmp: Path) -> dict:
    """name: (arguments, words the line must say)."""
    (tmp / "empty").mkdir()
    damaged = {"config": tmp / "damaged-config", "tensors": tmp / "damaged-tensors", "dora": tmp / "dora",
               "legacy": tmp / "legacy"}
    for folder in damaged.values():
        shutil.copytree(tiny / "final", folder)
    (damaged["config"] / "adapter_config.json").write_text("{not json")
    (damaged["tensors"] / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    config = json.loads((tiny / "final" / "adapter_config.json").read_text())
    (damaged["dora"] / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (damaged["legacy"] / "adapter_config.json").write_text(json.dumps({**config, "lora_B_layout": "grouped_by_expert"}))
    moved = tmp / "moved-base"
    shutil.copytree(tiny / "final", moved)
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(tmp / "gone")}))
    record = json.loads((moved / trained_base.BASE_FILE).read_text())
    (moved / trained_base.BASE_FILE).write_text(json.dumps({**record, "name": str(tmp / "gone"), "path": str(tmp / "gone")}))
    four_bit = tmp / "four-bit"
    shutil.copytree(tiny / "base", four_bit)
    base_config = json.loads((four_bit / "config.json").read_text())
    nf4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (four_bit / "config.json").write_text(json.dumps({**base_config, "quantization_config": nf4}))
    other = tmp / "other-widths"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**base_config, "hidden_size": 32}))
    import torch
    from safetensors.torch import save_file

    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 32, dtype=torch.bfloat16)},
              str(other / "model.safetensors"))  # fmt: skip
    (tmp / "a-file").write_text("")
    final = tiny / "final"
    return {
        "no such folder": (["--adapter", tmp / "missing"], ["no adapter_config.json there"]),
        "not an adapter": (["--adapter", tmp / "empty"], ["no adapter_config.json there", "final/ or checkpoint-N"]),
        "damaged config": (["--adapter", damaged["config"]], ["adapter_config.json does not read"]),
        "damaged tensors": (["--adapter", damaged["tensors"], "--output_dir", tmp / "o1"],
                            ["adapter_model.safetensors is damaged", "header"]),
        "DoRA": (["--adapter", damaged["dora"], "--output_dir", tmp / "o2"], ["DoRA"]),
        "older Unsloth": (["--adapter", damaged["legacy"], "--output_dir", tmp / "o5"], ["'grouped_by_expert'",
                                                                                       "save_pretrained_merged"]),
        "base gone": (["--adapter", moved], [f"the base {moved} was trained on, {tmp / 'gone'}, is not here", "--base"]),
        "4-bit base": (["--adapter", final, "--base", four_bit], ["--base", "stored in 4-bit (nf4)"]),
        "other widths": (["--adapter", final, "--base", other, "--output_dir", tmp / "o3"], ["fits no tensor of the base"]),
        "into the adapter": (["--adapter", final, "--output_dir", final], ["holds the adapter"]),
        "into the base": (["--adapter", final, "--output_dir", tiny / "base"], ["holds the base"]),
        "unwritable": (["--adapter", final, "--output_dir", tmp / "a-file" / "merged"], ["cannot write there"]),
        "log file": (["--adapter", final, "--output_dir", tmp / "o4", "--log_file", tmp / "a-file" / "log"],
                     ["--log_file", "cannot write to it"]),
    }


@pytest.mark.parametrize("case", ["no such folder", "not an adapter", "damaged config", "damaged tensors", "DoRA", "older Unsloth",
                                  "base gone", "4-bit base", "other widths", "into the adapter", "into the base",
                                  "unwritable", "log file"])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(tiny, tmp_path, case, capsys):
    args, words = bad_inputs(tiny, tmp_path)[case]
    listing = sorted(p.name for p in tiny.iterdir())
    with pytest.raises(SystemExit) as stop:
        merge(*args)
    one_line_error(capsys, stop, *words)
    assert sorted(p.name for p in tiny.iterdir()) == listing  # nothing written beside the adapter or the base
    assert not any(p.name.endswith(".tmp") for p in tmp_path.rglob("*"))


def test_a_hub_base_that_cannot_be_reached_is_one_line(tiny, tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit) as stop:
        merge("--adapter", tiny / "final", "--base", "nobody/no-such-model", "--output_dir", tmp_path / "merged")
    one_line_error(capsys, stop, "nobody/no-such-model cannot be reached on the Hugging Face hub")


# Mistakes argparse finds, each our one line (never argparse's usage block), with nothing read or written.
MISTYPED = {
    "no argument": ([], ["--adapter is required", "--help"]),
    "unknown option": (["--nosuch", "1"], ["unknown option --nosuch", "--help"]),
    "abbreviated": (["--adapte", "x"], ["unknown option --adapte", "did you mean --adapter?"]),
    "bad value": (["--adapter", "x", "--seed", "x"], ["--seed", "invalid int value: 'x'"]),
    "no value": (["--adapter"], ["--adapter", "expected one argument"]),
    "stray value": (["--adapter", "x", "y"], ["unexpected value 'y'"]),
}


@pytest.mark.parametrize("case", MISTYPED)
def test_a_mistyped_command_line_is_one_line_and_exit_2(case, capsys):
    args, words = MISTYPED[case]
    with pytest.raises(SystemExit) as stop:
        merge(*args)
    one_line_error(capsys, stop, *words)


def test_help_lists_the_options(capsys):
    """As a process, a bad input is one line on stderr after PEFT's imports: tests/test_library_noise.py runs it."""
    with pytest.raises(SystemExit) as stop:
        merge("--help")
    said = capsys.readouterr().out
    assert stop.value.code == 0 and all(f"--{o}" in said for o in ("adapter", "base", "output_dir", "overwrite_output_dir"))
    assert "Exit status: 0 a correct merge" in said


# --- what the merge owns, which base it merges into, what it refuses ----------------------------------------------


def listing(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def test_overwrite_replaces_only_a_merges_folder(tiny, tmp_path, capsys):
    """--overwrite_output_dir on a user's folder (no merge's mark): one line, exit 2, not a byte touched; a merge's own
    folder is replaced."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my work")
    before = listing(tmp_path)
    with pytest.raises(SystemExit) as stop:
        merge("--adapter", tiny / "final", "--output_dir", mine, "--overwrite_output_dir")
    one_line_error(capsys, stop, str(mine), "merge_2048 did not write it", "name another --output_dir")
    assert listing(tmp_path) == before


@pytest.mark.slow
def test_a_users_tmp_and_old_folders_beside_the_output_are_never_touched(tiny, tmp_path):
    """merged.tmp/ and merged.old/ beside the output are the user's names: a merge and a merge over it leave them as
    they are, and nothing of its own behind (its temporary folders are mkdtemp's .train_2048-*)."""
    for name in ("merged.tmp", "merged.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "keep.txt").write_text(name)
    assert merge("--adapter", tiny / "final", "--output_dir", tmp_path / "merged") == 0
    assert merge("--adapter", tiny / "final", "--output_dir", tmp_path / "merged", "--overwrite_output_dir") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "merged.old", "merged.tmp"]
    assert all((tmp_path / n / "keep.txt").read_text() == n for n in ("merged.tmp", "merged.old"))
    assert saving.written_by(tmp_path / "merged") == "merge_2048"


def test_a_base_built_with_another_seed_is_refused_naming_both(tiny, tmp_path, capsys):
    """The same architecture with other weights (another seed): the adapter's train_2048_base.json tells them apart,
    one line, exit 2, nothing written; evaluate_2048.py --model refuses it the same way."""
    import evaluate_2048

    with pytest.raises(SystemExit) as stop:
        merge("--adapter", tiny / "final", "--base", tiny / "other-seed", "--output_dir", tmp_path / "merged")
    one_line_error(capsys, stop, str(tiny / "other-seed"), f"is not the model {tiny / 'final'} was trained on",
                   str(tiny / "base"), "embed_tokens values at fixed positions differ")  # fmt: skip
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit) as stop:
        evaluate_2048.main(["--adapter", str(tiny / "final"), "--model", str(tiny / "other-seed"), "--no-baselines",
                            "--output_dir", str(tmp_path / "eval")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "\n" not in err and "is not the model" in err and str(tiny / "base") in err


@pytest.mark.slow
def test_an_older_runs_relative_base_is_found_from_another_working_folder(tiny, tmp_path, monkeypatch, capsys):
    """An older CPU demo recorded its base as outputs/demo/tiny-model (relative to where it ran) and no
    train_2048_base.json: merged from elsewhere, the base is found beside the run's adapters, with one line saying its
    identity cannot be checked."""
    run = tmp_path / "project" / "outputs" / "demo"
    shutil.copytree(tiny / "base", run / "tiny-model")
    shutil.copytree(tiny / "final", run / "final")
    (run / "final" / trained_base.BASE_FILE).unlink()
    config = json.loads((run / "final" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "outputs/demo/tiny-model"
    (run / "final" / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert merge("--adapter", run / "final", "--output_dir", tmp_path / "merged") == 0
    said = capsys.readouterr().out
    assert "its base cannot be checked" in said and f"into {run / 'tiny-model'}" in said


def split_expert_adapter(tiny: Path, folder: Path, share: float) -> Path:
    """A default run's adapter as Unsloth saves it (a LoRA per split expert, gate_up_projs.<e> and down_projs.<e>, and
    on q/v_proj), each LoRA changing its weights by `share` of a weight's RMS (0.02): its files written directly."""
    import torch
    from safetensors.torch import load_file, save_file

    base = {}
    for shard in sorted((tiny / "base").glob("*.safetensors")):
        base.update(load_file(str(shard)))
    rank, alpha, generator, tensors = 4, 8, torch.Generator().manual_seed(1), {}
    linears = {name.removesuffix(".weight"): w for name, w in base.items() if name.endswith(("q_proj.weight",
                                                                                          "v_proj.weight"))}  # fmt: skip
    for name, fused in base.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            kind = name.rpartition(".")[2] + "s"
            linears.update({f"{name.rpartition('.')[0]}.{kind}.{e}": fused[e].T for e in range(fused.shape[0])})
    for module, weight in linears.items():
        a = torch.randn(rank, weight.shape[1], generator=generator)
        b = torch.randn(weight.shape[0], rank, generator=generator)
        b *= share * 0.02 / ((alpha / rank) * b @ a).pow(2).mean().sqrt()
        tensors[f"base_model.model.{module}.lora_A.weight"], tensors[f"base_model.model.{module}.lora_B.weight"] = a, b
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    targets = ["q_proj", "v_proj", *(f"{kind}.{e}" for kind in ("gate_up_projs", "down_projs") for e in range(4))]
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "bias": "none",
        "base_model_name_or_path": str(tiny / "base"), "task_type": "CAUSAL_LM"}))  # fmt: skip
    return folder


def test_the_split_expert_merge_rounds_each_weight_once(tiny, tmp_path):
    """A default run's split-expert LoRA at 10% of a weight, merged into the fused 16-bit original: every merged weight
    is the correctly rounded bf16 of base + scale * B @ A (computed here in float64), experts and attention alike. PEFT's
    merge of a LoRA on a tensor rounds the product to bf16 before adding it: 9% of the changed expert weights were one
    bf16 step off."""
    import torch
    from safetensors.torch import load_file

    adapter = split_expert_adapter(tiny, tmp_path / "split", share=0.1)
    assert merge("--adapter", adapter, "--base", tiny / "base", "--output_dir", tmp_path / "merged") == 0
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    base = {}
    for shard in sorted((tiny / "base").glob("*.safetensors")):
        base.update(load_file(str(shard)))
    products, _ = merging.adapter_products(adapter, {n: tuple(t.shape) for n, t in base.items()})
    off, changed = {}, 0
    for name, pairs in products.items():
        exact = base[name].double()
        for product in pairs:
            for expert in range(exact.shape[0]) if exact.dim() == 3 else [None]:
                pair = product.pair(expert, transposed=True)
                if pair is not None:
                    a, b, flipped = pair
                    delta = product.scale * (b @ a)
                    if expert is None:
                        exact = exact + delta
                    else:
                        exact[expert] += delta.T if flipped else delta
        moved = exact != base[name].double()
        changed += int(moved.sum())
        off[name] = int((merged[name] != exact.to(torch.bfloat16))[moved].sum())
    assert len(products) == 8 and changed > 100_000  # 2 layers x (q, v, gate_up, down); nearly every weight changed
    assert sum(off.values()) == 0, off


def test_a_relative_base_is_looked_for_beside_a_moved_run(tmp_path, monkeypatch):
    """outputs/cpu-demo/tiny-model recorded by an older run that was since moved (to runs/mine): found as <run
    folder>/tiny-model; a hub name is left to the hub; a path found nowhere is one line naming the option."""
    run = tmp_path / "runs" / "mine"
    (run / "tiny-model").mkdir(parents=True)
    (run / "tiny-model" / "config.json").write_text("{}")

    def adapter(folder: Path, base: str) -> Path:
        folder.mkdir(exist_ok=True)
        (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
        return folder

    monkeypatch.chdir(tmp_path)
    for folder in (run / "final", run / "checkpoint-4"):
        found = trained_base.resolve_base(adapter(folder, "outputs/cpu-demo/tiny-model"), None, "--base")
        assert found == str(run / "tiny-model")
    assert trained_base.resolve_base(adapter(run / "final", "unsloth/gpt-oss-20b"), None, "--base") == "unsloth/gpt-oss-20b"
    with pytest.raises(trained_base.BaseRefused, match="elsewhere/gone/base, is not here .*--base names where it is now"):
        trained_base.resolve_base(adapter(run / "final", "elsewhere/gone/base"), None, "--base")


@pytest.mark.parametrize("hole", list(HOLES))
def test_a_merge_missing_a_tensor_or_holding_nan_is_wrong_without_the_float32_step(tiny, tmp_path, hole, monkeypatch,
                                                                                   capsys):  # fmt: skip
    """With no room for the float32 comparison (a 20B model on a small host), the weights' judge alone fails a merged
    checkpoint that lacks a tensor no adapter touches, or holds a NaN: exit 1, one ERROR line, nothing published."""
    monkeypatch.setattr(merging, "_float32_room", lambda base: None)
    break_save(monkeypatch, hole)
    assert merge("--adapter", tiny / "final", "--output_dir", tmp_path / "merged") == 1
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "the merge is wrong" in line]
    assert HOLES[hole] in line and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", ["NaN alpha", "infinite alpha", "NaN weights"])
def test_non_finite_adapters_are_bad_input_in_one_line(tiny, tmp_path, case, capsys):
    """NaN or inf in lora_alpha (JSON writes NaN and Infinity) or in the adapter's weights: bad input, one line, exit 2,
    in merge_2048.py and evaluate_2048.py --adapter, never a traceback from deep in a library."""
    from safetensors.torch import load_file, save_file

    adapter = tmp_path / "adapter"
    shutil.copytree(tiny / "final", adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    if case == "NaN weights":
        tensors = load_file(str(adapter / "adapter_model.safetensors"))
        first = sorted(tensors)[0]
        tensors[first][0, 0] = float("nan")
        save_file(tensors, str(adapter / "adapter_model.safetensors"))
        words = ["NaN or infinite", first]
    else:
        config["lora_alpha"] = float("nan") if case == "NaN alpha" else float("inf")
        (adapter / "adapter_config.json").write_text(json.dumps(config))  # json writes NaN / Infinity
        words = ["lora_alpha", "not a finite number"]
    with pytest.raises(SystemExit) as stop:
        merge("--adapter", adapter, "--output_dir", tmp_path / "merged")
    one_line_error(capsys, stop, *words)
    assert not (tmp_path / "merged").exists()
    import evaluate_2048

    with pytest.raises(SystemExit) as stop:  # evaluate_2048.py --adapter: the same line, before any model loads
        evaluate_2048.main(["--adapter", str(adapter), "--no-baselines", "--output_dir", str(tmp_path / "eval")])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "\n" not in err and all(word in err for word in words), err


@pytest.mark.slow
def test_a_target_modules_pattern_that_backtracks_is_refused_quickly(tiny, tmp_path, capsys):
    """target_modules "(.|.)*Z": PEFT would run it with re.fullmatch against every module name, which never ends.
    merge_2048.py (in a process of its own, with a time limit: the old code hung) and evaluate_2048.py refuse it in
    one line; Unsloth's own pattern (tests/unsloth) and a plain name pass."""
    import subprocess

    import evaluate_2048

    adapter = tmp_path / "adapter"
    shutil.copytree(tiny / "final", adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "target_modules": "(.|.)*Z"}))
    done = subprocess.run([sys.executable, str(REPO / "merge_2048.py"), "--adapter", str(adapter), "--output_dir",
                           str(tmp_path / "merged")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "not one training writes" in done.stderr
    with pytest.raises(SystemExit) as stop:
        evaluate_2048.main(["--adapter", str(adapter), "--no-baselines", "--output_dir", str(tmp_path / "eval")])
    assert stop.value.code == 2 and "not one training writes" in capsys.readouterr().err
    unsloths = (r"(?:(?:.*?(?:language|text).*?(?:self_attn|attention|attn|mixer|mlp|feed_forward|ffn|dense|mixer).*?\."
                r"(?:q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj))|(?:\bmodel\.layers\.[\d]{1,}(?!.*\.experts"
                r"\.\d)\..*?(?:self_attn|attention|attn|mixer|mlp|feed_forward|ffn|dense|mixer).*?\.(?:(?:q_proj|k_proj|"
                r"v_proj|o_proj|gate_proj|up_proj|down_proj))))|(?:.*\.experts\.(?:down_projs|gate_up_projs)\.\d+)")
    bf16_presets = (r"(?:model\.layers\.\d+\.self_attn\.k_proj|model\.layers\.\d+\.self_attn\.o_proj|"
                    r"model\.layers\.\d+\.self_attn\.q_proj|model\.layers\.\d+\.self_attn\.v_proj)")  # Unsloth's too
    assert models.target_modules_problem(unsloths) is None and models.target_modules_problem("q_proj") is None
    assert models.target_modules_problem(bf16_presets) is None
    assert models.target_modules_problem(r"(a+)+b") and models.target_modules_problem(".*" * 6 + "Z")


def test_a_base_cached_in_part_names_the_missing_weights(tiny, tmp_path, monkeypatch, capsys):
    """A hub base of which only config.json is cached (a config look-up, offline since): one line saying its weights
    are not there, not that the adapters fit no tensor of it."""
    import huggingface_hub.constants

    repo = tmp_path / "hf" / "hub" / "models--someone--tiny-base"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    shutil.copy(tiny / "base" / "config.json", repo / "snapshots" / ("0" * 40) / "config.json")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit) as stop:
        merge("--adapter", tiny / "final", "--base", "someone/tiny-base", "--output_dir", tmp_path / "merged")
    one_line_error(capsys, stop, "someone/tiny-base", "its weights (*.safetensors) are not in", "config.json")


def test_memory_room_counts_the_cgroup_limit(tmp_path):
    """A container's cgroup limit, not the host's MemAvailable, bounds what the float32 comparison may take."""
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 100000000 kB\nMemAvailable: 90000000 kB\n")
    assert merging.memory_available(tmp_path) == 90000000 * 1024
    v2 = tmp_path / "sys" / "fs" / "cgroup"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("8000000000\n")
    (v2 / "memory.current").write_text("3000000000\n")
    assert merging.memory_available(tmp_path) == 5_000_000_000
    (v2 / "memory.max").write_text("max\n")
    assert merging.memory_available(tmp_path) == 90000000 * 1024
    (v2 / "memory").mkdir()
    (v2 / "memory" / "memory.limit_in_bytes").write_text("4000000000\n")
    (v2 / "memory" / "memory.usage_in_bytes").write_text("1000000000\n")
    assert merging.memory_available(tmp_path) == 3_000_000_000


def test_an_adapter_header_that_lies_about_its_tensors_is_refused(tmp_path):
    """Offsets within the file and a file as long as its header says, yet a tensor's shape does not fill its bytes, or
    two tensors share bytes: refused before any tensor is read."""
    import struct

    def write(header: dict, data: bytes) -> Path:
        text = json.dumps(header).encode()
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.safetensors"
        path.write_bytes(struct.pack("<Q", len(text)) + text + data)
        return path

    good = write({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    assert models.safetensors_problem(good) is None
    wrong = write({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))
    assert "does not fill" in models.safetensors_problem(wrong)
    shared = write({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8))  # fmt: skip
    assert "overlap" in models.safetensors_problem(shared)


def test_a_merge_of_adapters_trained_on_nf4_never_says_the_merged_model_is_the_trained_one(tmp_path):
    """The default preset trains on Unsloth's NF4 checkpoint and merges into the 16-bit original: the advice says what
    the merged model is (the original plus the adapters), never "the trained one", whether the adapter's
    train_2048_base.json says NF4 or an older adapter names the hub's 4-bit checkpoint."""
    recorded, older = tmp_path / "recorded", tmp_path / "older"
    recorded.mkdir()
    older.mkdir()
    trained_base.write_base_identity(recorded, {"name": "unsloth/gpt-oss-20b", "quantized": "nf4", "fingerprint": {}})
    assert trained_base.trained_quantized(recorded, "unsloth/gpt-oss-20b") == "nf4"
    assert trained_base.trained_quantized(older, "unsloth/gpt-oss-20b-unsloth-bnb-4bit") == "nf4"
    assert trained_base.trained_quantized(older, "unsloth/gpt-oss-20b-BF16") is None
    for kept in (1.0, 0.5):
        said = merge_2048.advice({"kept": kept}, recorded, "nf4")
        assert "the trained one" not in said and "trained on NF4 weights and are merged into the 16-bit original" in said
    assert merge_2048.advice({"kept": 1.0}, recorded, None).endswith("the merged model is the trained one")


# --- train_2048: the merge after training ---------------------------------------------------------------------------


def parsed(*args):
    script_args, _, _, model_args = options.parse_args(["--config", str(REPO / "configs" / "gpt-oss-20b.yaml"),
                                                           "--use_cpu", "true", "--bf16", "false", *args])  # fmt: skip
    return script_args, model_args


def test_train_asks_before_training_where_merged_16bit_will_merge(tmp_path, monkeypatch, capsys):
    """The default preset's MXFP4 checkpoint merges into its BF16 copy, looked up on the hub (or its cache) before
    training; offline without it, a local 4-bit checkpoint, or no LoRA at all stop the run with one line."""
    import huggingface_hub
    import huggingface_hub.constants

    script_args, model_args = parsed("--save_method", "merged_16bit")
    asked = []

    def config_json(name, filename, **kwargs):
        asked.append(name)
        (tmp_path / "config.json").write_text("{}")
        return str(tmp_path / "config.json")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", config_json)
    assert options.check_merge_source(script_args, model_args, tmp_path) == "unsloth/gpt-oss-20b-BF16"
    assert asked == ["unsloth/gpt-oss-20b-BF16"]
    monkeypatch.undo()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    four_bit = tmp_path / "four-bit"
    four_bit.mkdir()
    (four_bit / "config.json").write_text(json.dumps({"quantization_config": {"load_in_4bit": True,
                                                                              "bnb_4bit_quant_type": "nf4"}}))
    cases = [((), ["unsloth/gpt-oss-20b-BF16 cannot be reached"]),
             (("--model_name_or_path", str(four_bit)), ["stored in 4-bit (nf4)", "python merge_2048.py --adapter"]),
             (("--use_peft", "false"), ["--use_peft false"])]  # fmt: skip
    for args, words in cases:
        script_args, model_args = parsed("--save_method", "merged_16bit", *args)
        with pytest.raises(options.OptionError) as stop:
            options.check_merge_source(script_args, model_args, tmp_path)
        line = str(stop.value)
        assert "\n" not in line and line.startswith("--"), line
        assert all(word in line for word in words), line
    assert options.check_merge_source(*parsed("--save_method", "lora"), tmp_path) is None


@pytest.mark.slow
def test_a_merge_that_cannot_run_after_training_is_one_error_line(tiny, tmp_path, caplog):
    """The base gone between the startup check and the end of training: one ERROR line that says how to merge
    later, and False (train_2048 exits 1); final/ is untouched."""
    with caplog.at_level(logging.ERROR, logger="train_2048"):
        assert not saving.merge_in_fresh_process(tiny / "final", str(tmp_path / "gone"), tmp_path / "final-merged_16bit")
    (line,) = caplog.messages
    assert "the merge failed" in line and "is not a model folder" in line and "python merge_2048.py" in line
    assert not (tmp_path / "final-merged_16bit").exists()
