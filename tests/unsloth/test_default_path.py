"""`python train_2048.py` on the Unsloth backend, as far as a CPU takes it (conftest.py says where the CPU stops):
our trainer over Unsloth's generated one, the presets under Unsloth's config, fast generation in Unsloth's state,
GRPO steps through Unsloth's trainer on both expert layouts, the saves and their checks, and evaluation of an adapter
in the default's layout."""

from __future__ import annotations

import ast
import inspect
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trl
from conftest import REPO, bind_unsloth_modes, load_like_unsloth, split_folder, use_split_experts

import generation
import models
import sandbox
import train_2048

PRESETS = sorted((REPO / "configs").glob("*.yaml"))
# Fields Unsloth's GRPOConfig adds or fills for its own machinery: its chunked loss, context parallelism, and the
# kwargs of HF checkpointing, which train_2048 turns off on the Unsloth backend (Unsloth checkpoints by itself).
UNSLOTH_ONLY = {"unsloth_num_chunks", "context_parallel_size", "context_parallel_backend",
                "gradient_checkpointing_kwargs"}  # fmt: skip
# The presets on the tiny model, on the CPU: no bitsandbytes optimizer, short completions, no evaluation.
ON_CPU = ["--use_cpu", "true", "--bf16", "false", "--optim", "adamw_torch", "--offload_embedding", "false",
          "--max_completion_length", "12", "--max_seq_length", "1024", "--num_generations", "4",
          "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--logging_steps", "1",
          "--save_steps", "100", "--report_to", "none", "--game_salt", "unsloth-tier", "--require_seccomp", "false",
          "--eval_strategy", "no", "--seed", "0"]  # fmt: skip


# --- the trainer and its configuration ----------------------------------------------------------------------------


def test_our_trainer_subclasses_unsloths_generated_one():
    import trainer

    parent = trainer.GameGRPOTrainer.__mro__[1]
    assert parent is trl.GRPOTrainer and parent.__name__ == "UnslothGRPOTrainer"
    assert any(cls.__name__ == "_UnslothGRPOTrainer" for cls in trainer.GameGRPOTrainer.__mro__)


def test_the_overridden_generation_takes_what_unsloths_trainer_passes():
    """Every call Unsloth's generated trainer makes to _generate_single_turn binds to our override's signature, which
    is the generated one's: a rewrite that changed it would send our fast path other arguments."""
    import trainer

    ours = inspect.signature(trainer.GameGRPOTrainer._generate_single_turn)
    assert ours == inspect.signature(trl.GRPOTrainer._generate_single_turn)
    calls = []
    for cls in trl.GRPOTrainer.__mro__:
        if "Unsloth" not in cls.__name__:
            continue
        tree = ast.parse(inspect.getsource(cls))
        calls += [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and isinstance(node.func, ast.Attribute) and node.func.attr == "_generate_single_turn"]  # fmt: skip
    assert calls, "Unsloth's trainer no longer calls _generate_single_turn: the fast path would never run"
    for call in calls:
        ours.bind(None, *[None] * len(call.args), **{k.arg: None for k in call.keywords})


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_parses_alike_under_unsloths_config(preset, capsys):
    """TrlParser passes every field, and Unsloth's GRPOConfig then fills what it would default (epsilon_high 0.28 for
    the DAPO loss): a preset must say each such value, so that both backends train alike, and print nothing."""
    from trl import ModelConfig, TrlParser

    import rewards

    plain = trl.GRPOConfig.__mro__[1]
    assert "unsloth_num_chunks" in trl.GRPOConfig.__dataclass_fields__  # Unsloth's, under TRL's name
    assert "unsloth_num_chunks" not in plain.__dataclass_fields__
    parsed = {}
    for cls in (plain, trl.GRPOConfig):
        parser = TrlParser((train_2048.ScriptArguments, rewards.RewardSettings, cls, ModelConfig))
        capsys.readouterr()
        _, _, args, _ = parser.parse_args_and_config(["--config", str(preset), "--use_cpu", "true", "--bf16", "false"])
        assert capsys.readouterr().out == "", f"Unsloth's config overrode something of {preset.name}"
        parsed[cls] = args.to_dict()
    differ = {k for k in parsed[plain].keys() | parsed[trl.GRPOConfig].keys()
              if parsed[plain].get(k) != parsed[trl.GRPOConfig].get(k)}  # fmt: skip
    assert differ <= UNSLOTH_ONLY, {k: (parsed[plain].get(k), parsed[trl.GRPOConfig].get(k)) for k in differ}


def test_mxfp4_is_refused_at_startup_with_unsloths_own_bound(tmp_path, capsys):
    import unsloth.save

    assert train_2048.MXFP4_MAX_TRANSFORMERS == unsloth.save._LLM_COMPRESSOR_MAX_TRANSFORMERS
    argv = ["--config", str(REPO / "configs" / "gpt-oss-20b.yaml"), "--output_dir", str(tmp_path), "--save_method",
            "mxfp4", "--require_seccomp", "false", "--use_cpu", "true", "--bf16", "false"]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        train_2048.check_before_loading(*train_2048.parse_args(argv), backend="unsloth")
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "mxfp4" in line and "llm-compressor" in line and "merged_16bit" in line


def test_the_gpu_checks_split_checkpoint_is_the_same_model_in_unsloths_classes(tiny):
    """bench/gpu_check.py's split layout (before it quantizes it on the GPU) loads into Unsloth's own split classes
    with every tensor in place, and computes what the fused checkpoint computes."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49]])
    with torch.no_grad():
        fused = AutoModelForCausalLM.from_pretrained(tiny).eval()(input_ids=ids).logits
        use_split_experts(True)
        model, info = AutoModelForCausalLM.from_pretrained(split_folder(tiny), output_loading_info=True)
        split = model.eval()(input_ids=ids).logits
    use_split_experts(False)
    assert models.experts_layout(model) == "split"
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    assert torch.allclose(split, fused, atol=1e-5)


# --- fast generation in Unsloth's state ---------------------------------------------------------------------------


def unsloth_model(tiny, split: bool, dropout: float = 0.0):
    from trl import ModelConfig

    args = ModelConfig(model_name_or_path=str(tiny), use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=dropout,
                       load_in_4bit=split, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"])  # fmt: skip
    model, tokenizer = load_like_unsloth(str(tiny), args, True, 1024, False, 0, True)
    with torch.no_grad():  # fresh LoRA is a no-op: make it count
        torch.manual_seed(1)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    return model, tokenizer


def prompts(vocab: int):
    ids = torch.randint(5, vocab, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :6] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("split", [True, False], ids=["4-bit layout", "bf16 layout"])
def test_fast_generation_stays_fast_in_unsloths_state(tiny, split):
    """Training mode with Unsloth's "unsloth" checkpointing flags, then inside Unsloth's own unwrap (its
    for_inference, then for_training on leaving): no fallback, the tokens of model.generate with the same seed."""
    import trl.trainer.grpo_trainer as trl_grpo
    from accelerate import Accelerator
    from transformers import GenerationConfig

    model, tokenizer = unsloth_model(tiny, split)
    assert model.training and {m.gradient_checkpointing for m in model.modules() if
                                hasattr(m, "gradient_checkpointing")} == {"unsloth"}  # fmt: skip
    ids, mask = prompts(len(tokenizer))
    config = GenerationConfig(max_new_tokens=8, do_sample=True, temperature=1.0, pad_token_id=0, eos_token_id=None)
    generation._WARNED.clear()
    with _warnings() as caught:
        torch.manual_seed(7)
        training = generation.generate(model, ids, mask, config)
        assert generation.last_path() == "fast"
        with trl_grpo.unwrap_model_for_generation(model, Accelerator(cpu=True)) as unwrapped:
            assert not unwrapped.training and not any(getattr(m, "gradient_checkpointing", False)
                                                      for m in unwrapped.modules())  # fmt: skip
            torch.manual_seed(7)
            ours = generation.generate(unwrapped, ids, mask, config)
            assert generation.last_path() == "fast"
            torch.manual_seed(7)
            theirs = unwrapped.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert caught == []
    assert torch.equal(ours, theirs) and torch.equal(training, theirs)
    # back to training with checkpointing on (TRL's inner unwrap re-enables it as True on leaving, after Unsloth's
    # for_training; Unsloth's trainer writes "unsloth" again after each rollout)
    flags = [m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    assert model.training and flags and all(flags)


class _warnings:
    """WARNING lines of generation.py's logger inside the block."""

    def __enter__(self):
        self.caught = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.caught.append(record.getMessage())
        generation.log.addHandler(self.handler)
        return self.caught

    def __exit__(self, *exc):
        generation.log.removeHandler(self.handler)


# --- GRPO steps through Unsloth's trainer -------------------------------------------------------------------------


def run_default_path(tiny, out: Path, *args: str, preset: str = "gpt-oss-20b.yaml") -> int:
    """train_2048's train() on the Unsloth backend, as main() runs it, with the preset on the tiny model."""
    argv = ["--config", str(REPO / "configs" / preset), "--model_name_or_path", str(tiny), "--output_dir", str(out),
            *ON_CPU, *args]  # fmt: skip
    sandbox.start()
    try:
        return train_2048.train(argv, "unsloth", cuda=False)
    finally:
        sandbox.shutdown()
        use_split_experts(False)


def training_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.fixture(scope="module")
def default_runs(tiny, tmp_path_factory):
    """One GRPO step of the default preset (4-bit layout) with fast generation, and the same step without it."""
    import pytest as _pytest

    patch = _pytest.MonkeyPatch()
    patch.setattr(models, "_load_unsloth", load_like_unsloth)
    runs = {}
    try:
        for fast in ("true", "false"):
            out = tmp_path_factory.mktemp(f"default-fast-{fast}") / "out"
            assert run_default_path(tiny, out, "--max_steps", "1", "--fast_generation", fast) == 0
            runs[fast] = out
    finally:
        patch.undo()
    return runs


def test_a_grpo_step_of_the_default_runs_through_unsloths_trainer(default_runs):
    log = (default_runs["true"] / "training.log").read_text()
    assert "on the unsloth backend" in log
    assert "experts split, a Linear per expert (Unsloth's 4-bit layout); LoRA on 16 of them" in log  # 2 x 4 x 2
    assert "generation: fast (" in log and "fast generation" not in log  # no fallback line
    (fast,), (plain,) = training_lines(default_runs["true"]), training_lines(default_runs["false"])
    assert fast["generation/fast_path"] == 1.0 and plain["generation/fast_path"] == 0.0
    for key in ("reward", "completions/mean_length", "loss", "rewards/function_works/mean"):
        assert fast[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key  # the same tokens, seed for seed


def test_the_default_runs_adapter_holds_a_lora_per_expert(default_runs):
    final = default_runs["true"] / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert {f"gate_up_projs.{e}" for e in range(4)} | {f"down_projs.{e}" for e in range(4)} <= set(
        config["target_modules"])
    assert models.split_expert_lora(final)
    assert "verified" in (default_runs["true"] / "training.log").read_text()  # final/ checked tensor by tensor


def test_a_grpo_step_of_the_bf16_preset_runs_through_unsloths_trainer_and_its_merge(tiny, tmp_path, unsloth_backend):
    """...and save_and_verify's Unsloth branch: Unsloth's merge, the trained model released, the fresh-process check
    (one step at lr 5e-5 leaves the adapters near a no-op: the check says it cannot vouch for them, and passes)."""
    out = tmp_path / "out"
    assert run_default_path(tiny, out, "--max_steps", "1", "--fast_generation", "true", "--save_method",
                            "merged_16bit", preset="gpt-oss-20b-bf16.yaml") == 0  # fmt: skip
    log = (out / "training.log").read_text()
    assert "experts fused into tensors (transformers' layout); LoRA on 4 expert tensors" in log  # 2 layers x 2
    assert training_lines(out)[0]["generation/fast_path"] == 1.0 and "fast generation" not in log
    assert "final-merged_16bit: reloaded alone, it is within tolerance of the trained model" in log


def test_a_merge_the_check_refuses_ends_the_run_with_status_1(tiny, tmp_path, unsloth_backend):
    """The default preset on the tiny split checkpoint: Unsloth merges back into the split layout, which transformers
    cannot load (test_unsloths_own_merged_save_goes_through_the_check): one ERROR line, exit status 1, final/ kept."""
    out = tmp_path / "out"
    assert run_default_path(tiny, out, "--max_steps", "1", "--save_method", "merged_16bit") == 1
    errors = [line for line in (out / "training.log").read_text().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "final-merged_16bit: the merged checkpoint does not load as the trained model" in errors[0]
    assert (out / "final" / "adapter_model.safetensors").exists()


def test_a_fallback_while_training_is_one_warning_line_and_the_scalar_says_so(tiny, tmp_path, unsloth_backend,
                                                                             monkeypatch):  # fmt: skip
    def broken(*args, **kwargs):
        raise RuntimeError("no cache today")

    monkeypatch.setattr(generation, "_prefill", broken)
    monkeypatch.setattr(generation, "_WARNED", set())
    out = tmp_path / "out"
    assert run_default_path(tiny, out, "--max_steps", "2", "--fast_generation", "true") == 0
    lines = (out / "training.log").read_text().splitlines()
    warned = [line for line in lines if "fast generation" in line and " DEBUG " not in line]  # the rest: DEBUG
    assert len(warned) == 1 and " WARNING " in warned[0] and "RuntimeError: no cache today" in warned[0]
    assert [line["generation/fast_path"] for line in training_lines(out)] == [0.0, 0.0]


# --- the saves and their checks -----------------------------------------------------------------------------------


def trained_model(tiny, split: bool):
    """A model in Unsloth's state whose LoRA moves its outputs well beyond the merge check's tolerance."""
    model, tokenizer = unsloth_model(tiny, split)
    model.for_inference()
    return model, tokenizer


def merged_checkpoint(model, tokenizer, folder: Path, drop_expert_lora: bool = False) -> Path:
    """What Unsloth's merged_16bit save writes: the fused layout, 16-bit, the LoRA merged (optionally without the
    experts' LoRA: unsloth-zoo issue 885's bug)."""
    from safetensors.torch import save_file

    merged = {}
    state = {k.removeprefix("base_model.model."): v for k, v in model.state_dict().items() if "lora_" not in k}
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer") and "default" in module.lora_A:
            expert = models.SPLIT_EXPERT.match(name)
            if drop_expert_lora and (expert or hasattr(module, "parameter_name")):
                continue
            key = name.removeprefix("base_model.model.")
            if hasattr(module, "parameter_name"):
                key = f"{key.removesuffix('.base_layer')}.{module.parameter_name}"
                merged[key] = module.get_param().detach() + module.get_delta_weight("default").detach()
            else:
                merged[f"{key}.weight"] = module.base_layer.weight.detach() + module.get_delta_weight("default")
    state = {re.sub(r"(\.base_layer)+\.", ".", k): v for k, v in state.items()}
    state.update(merged)
    if models.experts_layout(model) == "split":  # Unsloth writes the fused layout (unsloth_zoo saving_utils)
        state = fuse(state)
    folder.mkdir(parents=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    model.get_base_model().config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def fuse(state: dict) -> dict:
    """models.split_experts undone (the test's own inverse, so that the check is not proven by the code it checks)."""
    fused, experts = {}, {}
    for name, tensor in state.items():
        match = models.SPLIT_EXPERT.match(name.rsplit(".", 1)[0])
        if match:
            kind, leaf = match["kind"].removesuffix("s"), name.rsplit(".", 1)[1]
            experts.setdefault((match["experts"], kind, leaf), {})[int(match["index"])] = tensor
        elif name.endswith(".router.linear.weight") or name.endswith(".router.linear.bias"):
            fused[name.replace(".router.linear.", ".router.")] = tensor
        else:
            fused[name] = tensor
    for (owner, kind, leaf), tensors in experts.items():
        stacked = torch.stack([tensors[e] for e in sorted(tensors)])
        fused[f"{owner}.{kind}" if leaf == "weight" else f"{owner}.{kind}_bias"] = (
            stacked.transpose(1, 2) if leaf == "weight" else stacked)
    return fused


def reference(model, tokenizer):
    import evaluation
    import rewards

    inputs = evaluation.prompt_inputs(tokenizer, rewards.RewardSettings(), {})
    return models.reference_logprobs(model, tokenizer, inputs, seed=0)


@pytest.mark.parametrize("split", [True, False], ids=["4-bit layout", "bf16 layout"])
def test_the_merged_check_passes_a_true_merge_and_fails_a_merge_without_the_expert_lora(tiny, tmp_path, split, caplog):
    model, tokenizer = trained_model(tiny, split)
    expected = reference(model, tokenizer)
    good = merged_checkpoint(model, tokenizer, tmp_path / "good")
    bad = merged_checkpoint(model, tokenizer, tmp_path / "bad", drop_expert_lora=True)
    use_split_experts(False)
    with caplog.at_level(logging.INFO, logger="train_2048.models"):
        assert models.verify_merged(good, expected)
        assert not models.verify_merged(bad, expected)
    assert "is the trained model" in caplog.text and "it is not the trained model" in caplog.text


def test_the_merged_check_fails_a_checkpoint_transformers_cannot_load(tiny, tmp_path, caplog):
    """A split-layout checkpoint (what Unsloth's own 4-bit classes would load, and transformers' not) is refused."""
    model, tokenizer = trained_model(tiny, split=False)
    expected = reference(model, tokenizer)
    use_split_experts(False)
    assert not models.verify_merged(split_folder(tiny), expected)
    assert "does not load as the trained model" in caplog.text and "missing keys" in caplog.text


@pytest.mark.parametrize("split", [False, True], ids=["bf16 layout", "4-bit layout"])
def test_unsloths_own_merged_save_goes_through_the_check(tiny, tmp_path, monkeypatch, split, caplog):
    """Unsloth's save_pretrained_merged itself (its one GPU query, whether the card is a T4, answered "CPU"), then
    the check in a fresh process. From the fused BF16 layout it writes the trained model, and the check says so. From a
    local split checkpoint (the tiny one here, unquantized) it writes the split layout back, which transformers cannot
    load: the check refuses it, and train_2048 would exit 1 (from the hub's 4-bit checkpoint Unsloth merges into the
    16-bit original instead: on a GPU, bench/gpu_matrix.sh)."""
    import unsloth.save

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args, **kwargs: "CPU")
    model, tokenizer = trained_model(tiny, split)
    expected = reference(model, tokenizer)
    unsloth.save.patch_saving_functions(model)
    model.save_pretrained_merged(str(tmp_path / "merged"), tokenizer, save_method="merged_16bit")
    use_split_experts(False)
    with caplog.at_level(logging.INFO, logger="train_2048.models"):
        assert models.verify_merged(tmp_path / "merged", expected) is not split
    assert ("does not load as the trained model" if split else "it is the trained model") in caplog.text


# --- the default's adapter, evaluated -----------------------------------------------------------------------------


def test_a_default_run_adapter_maps_onto_fused_experts_as_the_same_function(tiny, default_runs):
    """Every expert's LoRA applied on transformers' fused experts: the same logits as the split model it trained on
    (and not the base's)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = default_runs["true"] / "final"
    with torch.no_grad():  # the trained adapter is nearly a no-op after one step: give every expert's LoRA weight
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(final / "adapter_model.safetensors"))
        torch.manual_seed(3)
        tensors = {k: torch.randn_like(v) * 0.3 if "lora_B" in k else v for k, v in tensors.items()}
        save_file(tensors, str(final / "adapter_model.safetensors"), metadata={"format": "pt"})
    ids = torch.tensor([[5, 9, 13, 17, 21, 25, 29, 33]])
    use_split_experts(True)
    split = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(split_folder(tiny)), final).eval()
    expected = split(input_ids=ids).logits
    use_split_experts(False)
    fused = models.attach_split_expert_lora(AutoModelForCausalLM.from_pretrained(tiny), final).eval()
    got = fused(input_ids=ids).logits
    with fused.disable_adapter():
        base = fused(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5) and not torch.allclose(base, expected, atol=1e-2)


def test_evaluate_runs_a_default_run_adapter_in_a_fresh_process(tiny, default_runs, tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "evaluate_2048.py"), "--adapter", str(default_runs["true"] / "final"), "--model",
         str(tiny), "--samples", "2", "--games", "1", "--max_new_tokens", "8", "--no-baselines", "--output_dir",
         str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "mapped onto the fused expert tensors" in result.stdout


# --- the loader's options ------------------------------------------------------------------------------------------


def test_lora_dropout_is_handled_alike_on_both_backends(tiny, monkeypatch, caplog):
    """PEFT cannot apply dropout to a LoRA on a tensor: on fused experts both loaders set it to 0 with a warning
    (Unsloth's BF16 path raised in PEFT); Unsloth's split experts are Linear layers and keep it."""
    import unsloth
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import ModelConfig

    asked = {}

    def from_pretrained(model_name, **kwargs):
        return AutoModelForCausalLM.from_pretrained(model_name), AutoTokenizer.from_pretrained(model_name)

    def get_peft_model(model, **kwargs):
        asked.update(kwargs)
        return model

    monkeypatch.setattr(unsloth.FastLanguageModel, "from_pretrained", from_pretrained)
    monkeypatch.setattr(unsloth.FastLanguageModel, "get_peft_model", get_peft_model)
    args = ModelConfig(model_name_or_path=str(tiny), use_peft=True, lora_dropout=0.1,
                       lora_target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip
    models.load_model(str(tiny), args, backend="unsloth", trainable=True)
    assert asked["lora_dropout"] == 0.0 and "cannot use dropout" in caplog.text
    fused, _ = models.load_model(str(tiny), args, backend="transformers", trainable=True)
    assert fused.peft_config["default"].lora_dropout == 0.0
    use_split_experts(True)
    split = AutoModelForCausalLM.from_pretrained(split_folder(tiny))
    assert models.lora_dropout(split, args.lora_target_modules, 0.1) == 0.1
    use_split_experts(False)


def test_the_unsloth_modes_are_bound_as_unsloths_loader_binds_them(tiny):
    """The stand-in's one piece of glue, checked against the state Unsloth's trainer reads."""
    model, _ = unsloth_model(tiny, split=False)
    assert model._unsloth_gradient_checkpointing == "unsloth" and callable(model.for_training)
    model.for_inference()
    assert not model.training
    bind_unsloth_modes(model, False)
    assert model.training and not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
