"""`python train_2048.py` on the Unsloth backend, as far as a CPU takes it (conftest.py says what it stubs and where
the CPU stops): Unsloth's own loader on the default's pre-quantized split 4-bit layout and on BF16's fused one, our
trainer over Unsloth's generated one, the presets under Unsloth's config, fast generation in Unsloth's state (its
dtypes, its decode flag), GRPO steps through Unsloth's trainer on both layouts, the saves and their checks, and
evaluation of a default run's adapter as Unsloth saves it."""

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
from conftest import REPO, TARGETS, gpu_check, load_with_unsloth, split_4bit, split_16bit, use_split_experts

import generation
import models
import sandbox
import train_2048

PRESETS = sorted((REPO / "configs").glob("*.yaml"))
# Fields Unsloth's GRPOConfig adds or fills for its own machinery: its chunked loss, context parallelism, and the
# kwargs of HF checkpointing, which train_2048 turns off on the Unsloth backend (Unsloth checkpoints by itself).
UNSLOTH_ONLY = {"unsloth_num_chunks", "context_parallel_size", "context_parallel_backend",
                "gradient_checkpointing_kwargs"}  # fmt: skip
# The presets on the tiny model, on the CPU: BF16 as on a GPU, offload_embedding as each preset sets it, torch's AdamW
# (bitsandbytes' 8-bit one has no CPU kernel), short completions, no evaluation.
ON_CPU = ["--use_cpu", "true", "--bf16", "true", "--optim", "adamw_torch",
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


# --- Unsloth's loader -------------------------------------------------------------------------------------------


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


IDS = torch.tensor([[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49]])


def test_unsloths_loader_takes_the_gpu_checks_split_4bit_checkpoint_in_its_own_classes(tiny):
    """The default preset's load: the checkpoint bench/gpu_check.py quantizes (here on the CPU) loads in Unsloth's split
    4-bit classes, an NF4 Linear per expert with a LoRA each, the embedding offloaded as the preset asks, and computes
    the fused model's function to 4-bit precision. An unquantized split checkpoint (the tier's before) loads as the
    fused layout instead, its experts random: far from it."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    model, _ = load_with_unsloth(tiny, split=True)
    base = model.get_base_model()
    experts = base.model.layers[0].mlp.experts
    assert models.experts_layout(model) == "split"
    assert isinstance(experts.gate_up_projs[0].base_layer, bnb.nn.Linear4bit)
    assert experts.gate_up_projs[0].base_layer.weight.quant_state.quant_type == "nf4"
    assert isinstance(base.model.layers[0].self_attn.q_proj.base_layer, bnb.nn.Linear4bit)
    assert models.describe_experts(model).endswith("LoRA on 16 of them")  # 2 layers x 4 experts x 2 projections
    assert getattr(base.get_input_embeddings(), "_unsloth_offload_hooks_installed", False)  # offload_embedding: true
    with model.disable_adapter():
        quantized = logits_of(model, IDS)
    use_split_experts(False)
    fused = logits_of(AutoModelForCausalLM.from_pretrained(tiny), IDS)
    error = float((quantized - fused).abs().max() / fused.abs().max())
    assert error < 0.1, error  # NF4 rounding; random experts or a wrong layout are off by ~1


def test_the_gpu_checks_split_16bit_checkpoint_is_the_same_model_in_unsloths_classes(tiny):
    """bench/gpu_check.py's split layout before quantizing: in Unsloth's split classes every tensor is in place, and
    it computes what the fused checkpoint computes (what quantize_split then rounds)."""
    from transformers import AutoModelForCausalLM

    fused = logits_of(AutoModelForCausalLM.from_pretrained(tiny).eval(), IDS)
    use_split_experts(True)
    model, info = AutoModelForCausalLM.from_pretrained(split_16bit(tiny), output_loading_info=True)
    assert models.experts_layout(model) == "split"
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    assert torch.allclose(logits_of(model.eval(), IDS), fused, atol=1e-5)


def test_the_bf16_preset_loads_fused_with_unsloths_dtypes(tiny):
    """What the fast path must serve: BF16 weights, the expert biases upcast to float32 by Unsloth, float32 LoRA."""
    model, _ = load_with_unsloth(tiny, split=False)
    experts = model.get_base_model().model.layers[0].mlp.experts
    while hasattr(experts, "base_layer"):
        experts = experts.base_layer
    assert models.experts_layout(model) == "fused"
    assert (experts.gate_up_proj.dtype, experts.gate_up_proj_bias.dtype) == (torch.bfloat16, torch.float32)
    assert not getattr(model.get_base_model().get_input_embeddings(), "_unsloth_offload_hooks_installed", False)


def test_lora_dropout_is_handled_alike_on_both_backends(tiny, caplog):
    """PEFT cannot apply dropout to a LoRA on a tensor: on fused experts both loaders set it to 0 with a warning
    (Unsloth's BF16 path raised in PEFT); Unsloth's split experts are Linear layers and keep it."""
    from trl import ModelConfig

    fused, _ = load_with_unsloth(tiny, split=False, dropout=0.1)
    assert fused.peft_config["default"].lora_dropout == 0.0 and "cannot use dropout" in caplog.text
    split, _ = load_with_unsloth(tiny, split=True, dropout=0.1)
    assert split.peft_config["default"].lora_dropout == 0.1
    use_split_experts(False)
    args = ModelConfig(model_name_or_path=str(tiny), use_peft=True, lora_dropout=0.1, lora_target_modules=TARGETS)
    plain, _ = models.load_model(str(tiny), args, backend="transformers", trainable=True)
    assert plain.peft_config["default"].lora_dropout == 0.0


# --- fast generation in Unsloth's state ---------------------------------------------------------------------------


def unsloth_model(tiny, split: bool, share: float = 0.3):
    """Unsloth's model with adapters that move it (bench/gpu_check.py's move_adapters)."""
    model, tokenizer = load_with_unsloth(tiny, split)
    gpu_check.move_adapters(model, seed=1, share=share)
    return model, tokenizer


def prompts(vocab: int):
    ids = torch.randint(5, vocab, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :6] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("split", [True, False], ids=["4-bit default", "bf16 preset"])
def test_fast_generation_stays_fast_in_unsloths_state(tiny, split):
    """Training mode with checkpointing on as Unsloth's loader leaves it (flags True, its own checkpoint function),
    then inside Unsloth's own unwrap (its for_inference, then for_training on leaving): no fallback, the tokens of
    model.generate with the same seed. On the BF16 preset, with Unsloth's float32 expert biases beside BF16 weights."""
    import trl.trainer.grpo_trainer as trl_grpo
    from accelerate import Accelerator
    from transformers import GenerationConfig

    model, tokenizer = unsloth_model(tiny, split)
    flags = [m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    assert model.training and flags and all(flags)
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


COMPILED_STEP = """
import json, os, sys, torch
sys.path.insert(0, sys.argv[1])
import conftest, generation
from pathlib import Path
from torch._dynamo.utils import counters
from transformers import GenerationConfig
model, tokenizer = conftest.load_with_unsloth(Path(sys.argv[2]), split=True)
conftest.gpu_check.move_adapters(model, seed=1, share=0.3)
model.for_inference()
ids = torch.randint(5, len(tokenizer), (3, 10), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)
mask[1, :3] = 0
ids = ids.masked_fill(mask == 0, 0)
config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
os.environ["FAST_GENERATE_COMPILE"] = "eager"
del os.environ["TORCHDYNAMO_DISABLE"]
warned = []
generation.log.warning = warned.append
ours = generation.generate(model, ids, mask, config)
graphs = counters["stats"]["unique_graphs"]
os.environ["TORCHDYNAMO_DISABLE"] = "1"
theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
print(json.dumps({"warned": warned, "graphs": graphs, "compiled": generation.last_step_compiled(),
                  "describe": generation.describe(model), "same": torch.equal(ours, theirs)}))
"""


def test_the_4bit_defaults_decode_step_compiles_under_unsloths_decode_flag(tiny):
    """Unsloth wraps GPT-OSS's MLP in torch_compiler_disable_unless_decode: a full graph of our step traces through
    it only with Unsloth's decode flag up, which the fast path raises around its step. In a process of its own, one
    load as in training (a later Unsloth load in the same process drops its compiled module from sys.modules, which
    Dynamo then cannot import). Dynamo is lifted for our step alone (Unsloth's compiled regions were made under
    TORCHDYNAMO_DISABLE=1, so they stay eager: conftest.py), with the "eager" backend (a trace, no Inductor). The step
    runs as compiled code, says so, and gives generate's greedy tokens."""
    result = subprocess.run([sys.executable, "-c", COMPILED_STEP, str(REPO / "tests" / "unsloth"), str(tiny)],
                            cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    said = json.loads(result.stdout.strip().splitlines()[-1])
    assert said["warned"] == [] and said["graphs"] > 0, said
    assert said["compiled"] and "step compiled" in said["describe"] and said["same"], said


def test_a_step_torch_compile_leaves_eager_is_not_called_compiled(tiny):
    """Under TORCHDYNAMO_DISABLE=1 torch.compile hands the step back as written: describe() and the
    generation/compiled scalar's source must not call it compiled."""
    import os

    from transformers import GenerationConfig

    model, tokenizer = unsloth_model(tiny, split=True)
    model.for_inference()
    ids, mask = prompts(len(tokenizer))
    config = GenerationConfig(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    os.environ["FAST_GENERATE_COMPILE"] = "eager"
    try:
        generation.generate(model, ids, mask, config)
    finally:
        del os.environ["FAST_GENERATE_COMPILE"]
    assert generation.last_path() == "fast" and not generation.last_step_compiled()
    assert "step eager" in generation.describe(model)
    generation.release(model)


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


def run_default_path(model: Path, out: Path, *args: str, preset: str = "gpt-oss-20b.yaml") -> int:
    """train_2048's train() on the Unsloth backend, as main() runs it, with the preset on the tiny model."""
    argv = ["--config", str(REPO / "configs" / preset), "--model_name_or_path", str(model), "--output_dir", str(out),
            *ON_CPU, *args]  # fmt: skip
    sandbox.start()
    try:
        return train_2048.train(argv, "unsloth", cuda=False)
    finally:
        sandbox.shutdown()


def training_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.fixture(scope="module")
def default_runs(tiny, tmp_path_factory):
    """One GRPO step of the default preset (the split 4-bit checkpoint) with fast generation, and the same step
    without it."""
    runs = {}
    for fast in ("true", "false"):
        out = tmp_path_factory.mktemp(f"default-fast-{fast}") / "out"
        assert run_default_path(split_4bit(tiny), out, "--max_steps", "1", "--fast_generation", fast) == 0
        use_split_experts(False)
        runs[fast] = out
    return runs


def test_a_grpo_step_of_the_default_runs_through_unsloths_loader_and_trainer(default_runs):
    log = (default_runs["true"] / "training.log").read_text()
    assert "on the unsloth backend" in log
    assert "experts split, a Linear per expert (Unsloth's 4-bit layout); LoRA on 16 of them" in log  # 2 x 4 x 2
    assert "generation: fast (" in log and "fast generation" not in log  # no fallback line
    (fast,), (plain,) = training_lines(default_runs["true"]), training_lines(default_runs["false"])
    assert fast["generation/fast_path"] == 1.0 and plain["generation/fast_path"] == 0.0
    assert fast["generation/compiled"] == 0.0  # compile=none on the CPU, and the scalar says so
    for key in ("reward", "completions/mean_length", "loss", "rewards/function_works/mean"):
        assert fast[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key  # the same tokens, seed for seed


def test_the_default_runs_adapter_is_unsloths_a_lora_per_expert_named_by_a_pattern(default_runs):
    final = default_runs["true"] / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert isinstance(config["target_modules"], str) and "gate_up_projs" in config["target_modules"]  # Unsloth's regex
    assert models.split_expert_lora(final)
    assert "verified" in (default_runs["true"] / "training.log").read_text()  # final/ checked tensor by tensor


def test_a_grpo_step_of_the_bf16_preset_runs_its_fast_path_and_unsloths_merge(tiny, tmp_path, capsys):
    """The BF16 preset with Unsloth's dtypes: generation/fast_path 1 (no fallback line); then save_and_verify's Unsloth
    branch: Unsloth's merge of the local 16-bit checkpoint, said before training, the trained model released, and
    the fresh-process check, which with adapters that move the model (bench/gpu_check.py's) can judge: it is the
    trained model, keeping its adapters' effect."""
    out = tmp_path / "out"
    with gpu_check.adapters_moved():
        assert run_default_path(tiny, out, "--max_steps", "1", "--fast_generation", "true", "--save_method",
                                "merged_16bit", preset="gpt-oss-20b-bf16.yaml") == 0  # fmt: skip
    log = (out / "training.log").read_text()
    assert f"Unsloth will merge the LoRA into {tiny}'s own weights" in log
    assert "experts fused into tensors (transformers' layout); LoRA on 4 expert tensors" in log  # 2 layers x 2
    assert training_lines(out)[0]["generation/fast_path"] == 1.0 and "fast generation" not in log
    verified = [line for line in log.splitlines() if "final-merged_16bit: every tensor loads" in line]
    assert len(verified) == 1 and "it is the trained model" in verified[0] and " ERROR " not in log


def test_merged_16bit_on_the_4bit_default_is_refused_at_startup(tiny, tmp_path, capsys):
    """Unsloth merges only into 16-bit weights and refuses a local 4-bit checkpoint after training ("base model should
    be a 16bit or mxfp4 base model"): train_2048 asks where the merge would read before it starts, one line, exit 2,
    nothing written."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        run_default_path(split_4bit(tiny), out, "--max_steps", "1", "--save_method", "merged_16bit")
    assert stop.value.code == 2 and not out.exists()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("train_2048: --save_method merged_16bit:") and "4-bit (nf4)" in line and "save lora" in line


def test_merged_16bit_from_the_hub_is_asked_of_the_hub_before_training(tmp_path, monkeypatch, capsys):
    """The hub's 4-bit default merges into unsloth/gpt-oss-20b, which Unsloth looks up on the hub at save time: offline,
    the run is refused before it starts; online, one line says which weights the merge will download."""
    import unsloth_zoo.saving_utils

    argv = ["--config", str(REPO / "configs" / "gpt-oss-20b.yaml"), "--output_dir", str(tmp_path), "--save_method",
            "merged_16bit", "--require_seccomp", "false", "--use_cpu", "true", "--bf16", "false"]  # fmt: skip
    script_args, _, _, model_args = train_2048.parse_args(argv)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit) as stop:
        train_2048.check_merge_source(script_args, model_args, "unsloth")
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and "unsloth/gpt-oss-20b's 16-bit weights" in line and "cannot be reached" in line
    asked = []
    monkeypatch.setattr(unsloth_zoo.saving_utils, "check_hf_model_exists", lambda name, token=None: asked.append(name) or True)
    source = train_2048.check_merge_source(script_args, model_args, "unsloth")
    assert asked == ["unsloth/gpt-oss-20b"] and source.startswith("unsloth/gpt-oss-20b's 16-bit weights on the Hugging")


def test_a_merge_unsloth_refuses_after_training_is_one_error_line_and_status_1(tiny, tmp_path, monkeypatch):
    """Past the startup check (bypassed here), Unsloth's own refusal of the 4-bit merge: one ERROR line in
    training.log, exit status 1, final/ kept: never a traceback after training."""
    monkeypatch.setattr(train_2048, "check_merge_source", lambda *args: None)
    out = tmp_path / "out"
    assert run_default_path(split_4bit(tiny), out, "--max_steps", "1", "--save_method", "merged_16bit") == 1
    errors = [line for line in (out / "training.log").read_text().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "Unsloth's merged_16bit save failed" in errors[0] and "nf4" in errors[0]
    assert (out / "final" / "adapter_model.safetensors").exists()


def test_a_fallback_while_training_is_one_warning_line_and_the_scalar_says_so(tiny, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no cache today")

    monkeypatch.setattr(generation, "_prefill", broken)
    monkeypatch.setattr(generation, "_WARNED", set())
    out = tmp_path / "out"
    assert run_default_path(split_4bit(tiny), out, "--max_steps", "2", "--fast_generation", "true") == 0
    lines = (out / "training.log").read_text().splitlines()
    warned = [line for line in lines if "fast generation" in line and " DEBUG " not in line]  # the rest: DEBUG
    assert len(warned) == 1 and " WARNING " in warned[0] and "RuntimeError: no cache today" in warned[0]
    assert [line["generation/fast_path"] for line in training_lines(out)] == [0.0, 0.0]


# --- the saves and their checks -----------------------------------------------------------------------------------


def trained_model(tiny, split: bool, share: float = 0.3, attention: bool = True):
    """A model in Unsloth's state whose LoRA moves its outputs, `share` setting how much (move_adapters); without
    `attention`, only the experts' LoRA does."""
    model, tokenizer = unsloth_model(tiny, split, share)
    if not attention:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name and "self_attn" in name:
                    parameter.zero_()
    model.for_inference()
    return model, tokenizer


def dense(layer):
    """A Linear's weight in 16 or 32 bits (bitsandbytes' NF4 dequantized)."""
    import bitsandbytes as bnb

    weight = layer.weight
    if isinstance(layer, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
    return weight.detach()


def merged_checkpoint(model, tokenizer, folder: Path, drop: str = "") -> Path:
    """What a merged_16bit save writes, built here independently of Unsloth: the fused layout, 16-bit, the LoRA merged
    into the (dequantized) base; drop="experts" leaves out the experts' LoRA (unsloth-zoo issue 885's bug), "all"
    every LoRA."""
    import bitsandbytes as bnb
    from safetensors.torch import save_file

    state = {k.removeprefix("base_model.model."): v for k, v in model.state_dict().items()
             if "lora_" not in k and not re.search(r"\.weight\.", k)}  # fmt: skip  (no LoRA, no NF4 statistics)
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state[f"{name.removeprefix('base_model.model.')}.weight"] = dense(module)
    for name, module in model.named_modules():
        if not (hasattr(module, "get_delta_weight") and hasattr(module, "base_layer") and "default" in module.lora_A):
            continue
        expert = models.SPLIT_EXPERT.match(name) or hasattr(module, "parameter_name")
        if drop == "all" or (drop == "experts" and expert):
            continue
        key = name.removeprefix("base_model.model.")
        if hasattr(module, "parameter_name"):
            key = f"{key.removesuffix('.base_layer')}.{module.parameter_name}"
            state[re.sub(r"(\.base_layer)+\.", ".", key)] = module.get_param().detach() + module.get_delta_weight("default")
        else:
            state[f"{key}.weight"] = dense(module.base_layer) + module.get_delta_weight("default")
    state = {re.sub(r"(\.base_layer)+\.", ".", k): v for k, v in state.items()}
    if models.experts_layout(model) == "split":  # merged checkpoints are in the fused layout (unsloth_zoo saving_utils)
        state = fuse(state)
    folder.mkdir(parents=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    config = model.get_base_model().config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
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
        elif ".experts." not in name:  # Unsloth's split classes keep empty fused buffers beside the Linears
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


@pytest.mark.parametrize("split", [True, False], ids=["4-bit default", "bf16 preset"])
def test_the_merged_check_passes_a_true_merge_and_fails_one_without_the_experts_lora(tiny, tmp_path, split, caplog):
    """The experts' LoRA carries the adapters' effect here; a merge that drops it (unsloth-zoo issue 885) keeps
    none of it. On the 4-bit default the trained model computes through NF4 kernels and the merge holds the
    dequantized weights: adapters that move it more (share 1) stand clear of that difference."""
    model, tokenizer = trained_model(tiny, split, share=1.0 if split else 0.3, attention=False)
    expected = reference(model, tokenizer)
    good = merged_checkpoint(model, tokenizer, tmp_path / "good")
    bad = merged_checkpoint(model, tokenizer, tmp_path / "bad", drop="experts")
    use_split_experts(False)
    with caplog.at_level(logging.INFO, logger="train_2048.models"):
        assert models.verify_merged(good, expected), caplog.text
        assert not models.verify_merged(bad, expected)
    assert "is the trained model" in caplog.text and "it lost part of the adapters' effect" in caplog.text


@pytest.mark.parametrize("share", [0.1, 0.01], ids=["effect ~3e-4", "effect ~6e-7"])
def test_the_merged_check_fails_a_merge_that_lost_adapters_however_little_they_move_the_model(tiny, tmp_path, share,
                                                                                            caplog):  # fmt: skip
    """Adapters that move the model by far less than the KL tolerance (a healthy GRPO run's band, and far below): a
    merge that lost every LoRA fails. The true merge passes while the adapters' change stands above a 16-bit
    weight's last digit; below it (share 0.01: LoRA changes of ~1% of a weight, rounded to 16 bits), rounding the
    merged weights moves the model ~100 times more than the adapters do, and the check refuses to vouch for it
    rather than call it the trained model."""
    model, tokenizer = trained_model(tiny, split=False, share=share)
    expected = reference(model, tokenizer)
    effect = models.mean_kl(expected["trained"], expected["base"])
    assert 0 < effect < models.MERGED_KL_TOLERANCE / 10
    good = merged_checkpoint(model, tokenizer, tmp_path / "good")
    lost = merged_checkpoint(model, tokenizer, tmp_path / "lost", drop="all")
    with caplog.at_level(logging.INFO, logger="train_2048.models"):
        assert not models.verify_merged(lost, expected)
        assert "it lost part of the adapters' effect" in caplog.text
        assert models.verify_merged(good, expected) is (share == 0.1), caplog.text
    said = caplog.text.splitlines()[-1]
    assert "it is the trained model" in said if share == 0.1 else "too uncertain to vouch for" in said


def test_the_merged_check_fails_a_checkpoint_transformers_cannot_load(tiny, caplog):
    """A split-layout checkpoint (what Unsloth's own split classes load, and transformers' not) is refused."""
    model, tokenizer = trained_model(tiny, split=False)
    expected = reference(model, tokenizer)
    assert not models.verify_merged(split_16bit(tiny), expected)
    assert "does not load as the trained model" in caplog.text and "missing keys" in caplog.text


def test_unsloths_own_merged_save_goes_through_the_check(tiny, tmp_path, caplog):
    """Unsloth's save_pretrained_merged itself from the BF16 preset's load (the local 16-bit checkpoint), then the
    check in a fresh process: it is the trained model."""
    model, tokenizer = trained_model(tiny, split=False)
    expected = reference(model, tokenizer)
    model.save_pretrained_merged(str(tmp_path / "merged"), tokenizer, save_method="merged_16bit")
    with caplog.at_level(logging.INFO, logger="train_2048.models"):
        assert models.verify_merged(tmp_path / "merged", expected)
    assert "it is the trained model" in caplog.text


def test_unsloth_refuses_to_merge_the_local_4bit_checkpoint(tiny, tmp_path):
    """Why train_2048 refuses merged_16bit on a local 4-bit checkpoint at startup: Unsloth's own merge raises."""
    model, tokenizer = trained_model(tiny, split=True)
    with pytest.raises(RuntimeError, match="16bit or mxfp4 base model"):
        model.save_pretrained_merged(str(tmp_path / "merged"), tokenizer, save_method="merged_16bit")
    with pytest.raises(ValueError, match=r"4-bit \(nf4\)"):
        models.unsloth_merge_source(str(split_4bit(tiny)), True)
    assert models.unsloth_merge_source(str(tiny), True) == f"{tiny}'s own weights (a local 16-bit checkpoint)"


# --- the default's adapter, evaluated -----------------------------------------------------------------------------


@pytest.fixture
def moved_default_adapter(default_runs, tmp_path):
    """The default run's final/ (as Unsloth saved it) with every LoRA B drawn (one step leaves it near a no-op)."""
    import shutil

    from safetensors.torch import load_file, save_file

    final = tmp_path / "final"
    shutil.copytree(default_runs["true"] / "final", final)
    tensors = load_file(str(final / "adapter_model.safetensors"))
    generator = torch.Generator().manual_seed(3)
    tensors = {k: torch.randn(v.shape, generator=generator) * 0.3 if "lora_B" in k else v for k, v in tensors.items()}
    save_file(tensors, str(final / "adapter_model.safetensors"), metadata={"format": "pt"})
    return final


def test_a_default_run_adapter_maps_onto_fused_experts_as_the_same_function(tiny, moved_default_adapter):
    """Every expert's LoRA of the adapter as Unsloth saved it (target_modules a pattern) applied on transformers'
    fused experts: the same logits as on the split model it trained on (16-bit here), and not the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    use_split_experts(True)
    split = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(split_16bit(tiny)), moved_default_adapter)
    expected = logits_of(split.eval(), IDS)
    assert sum(1 for name, _ in split.named_modules() if models.SPLIT_EXPERT.match(name.removesuffix(".base_layer"))
               and name.endswith("base_layer")) == 16  # fmt: skip  (PEFT found every expert through the pattern)
    use_split_experts(False)
    fused = models.attach_split_expert_lora(AutoModelForCausalLM.from_pretrained(tiny), moved_default_adapter).eval()
    got = logits_of(fused, IDS)
    with fused.disable_adapter():
        base = logits_of(fused, IDS)
    assert torch.allclose(got, expected, atol=1e-4) and not torch.allclose(base, expected, atol=1e-2)


def test_evaluate_runs_a_default_run_adapter_in_a_fresh_process(tiny, moved_default_adapter, tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "evaluate_2048.py"), "--adapter", str(moved_default_adapter), "--model", str(tiny),
         "--samples", "2", "--games", "1", "--max_new_tokens", "8", "--no-baselines", "--output_dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "mapped onto the fused expert tensors" in result.stdout
