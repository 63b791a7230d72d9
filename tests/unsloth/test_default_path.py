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
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trl
from conftest import REPO, TARGETS, gpu_check, load_with_unsloth, split_4bit, split_16bit, use_split_experts
from merge_faults import FAULTS, NAMED, break_merge

import generation
import merging
import models
import options
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
        parser = TrlParser((options.ScriptArguments, rewards.RewardSettings, cls, ModelConfig))
        capsys.readouterr()
        _, _, args, _ = parser.parse_args_and_config(["--config", str(preset), "--use_cpu", "true", "--bf16", "false"])
        assert capsys.readouterr().out == "", f"Unsloth's config overrode something of {preset.name}"
        parsed[cls] = args.to_dict()
    differ = {k for k in parsed[plain].keys() | parsed[trl.GRPOConfig].keys()
              if parsed[plain].get(k) != parsed[trl.GRPOConfig].get(k)}  # fmt: skip
    assert differ <= UNSLOTH_ONLY, {k: (parsed[plain].get(k), parsed[trl.GRPOConfig].get(k)) for k in differ}


def test_mxfp4_is_refused_at_startup_with_unsloths_own_bound(tmp_path, capsys):
    import unsloth.save

    assert options.MXFP4_MAX_TRANSFORMERS == unsloth.save._LLM_COMPRESSOR_MAX_TRANSFORMERS
    argv = ["--config", str(REPO / "configs" / "gpt-oss-20b.yaml"), "--output_dir", str(tmp_path), "--save_method",
            "mxfp4", "--require_seccomp", "false", "--use_cpu", "true", "--bf16", "false"]  # fmt: skip
    with pytest.raises(options.OptionError) as stop:
        options.check_before_loading(*options.parse_args(argv), backend="unsloth")
    line = str(stop.value)
    assert "\n" not in line and "mxfp4" in line and "llm-compressor" in line and "merged_16bit" in line


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

    fused = logits_of(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval(), IDS)
    use_split_experts(True)
    model, info = AutoModelForCausalLM.from_pretrained(split_16bit(tiny), dtype=torch.float32, output_loading_info=True)
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


def test_unsloths_trainer_samples_with_the_runs_one_sampler(tiny, tmp_path):
    """Unsloth's generated GRPOTrainer, built for real on the BF16 preset's model with every sampling option set: the
    GenerationConfig of its rollouts is evaluation.generation_config's field by field (what our trainer's rollouts
    and evaluations, evaluate_2048 and the save check sample with), and ours over it samples with that same config."""
    import evaluation
    import rewards
    import trainer

    sampler = ["--temperature", "0.7", "--top_p", "0.9", "--top_k", "20", "--min_p", "0.05",
               "--repetition_penalty", "1.1", "--generation_kwargs", '{"no_repeat_ngram_size": 4}']  # fmt: skip
    argv = ["--config", str(REPO / "configs" / "gpt-oss-20b-bf16.yaml"), *ON_CPU, *sampler, "--output_dir",
            str(tmp_path), "--model_name_or_path", str(tiny)]  # fmt: skip
    _, settings, args, _ = options.parse_args(argv)
    model, tokenizer = load_with_unsloth(tiny, split=False)
    dataset = rewards.build_dataset(8, settings)
    reward = lambda completions, **kwargs: [0.0] * len(completions)  # noqa: E731
    theirs = trl.GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                             processing_class=tokenizer)  # fmt: skip
    assert type(theirs).__name__ == "UnslothGRPOTrainer"
    ours = evaluation.generation_config(args, tokenizer, args.max_completion_length)
    assert ours.to_dict() == theirs.generation_config.to_dict()
    assert (ours.top_k, ours.min_p, ours.no_repeat_ngram_size) == (20, 0.05, 4)
    game = trainer.GameGRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                                   processing_class=tokenizer, settings=settings, eval_samples=2, eval_seeds=[1, 2],
                                   times=trainer.StepTimes(torch.device("cpu")))  # fmt: skip
    assert game.generation_config.to_dict() == theirs.generation_config.to_dict()


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


@pytest.fixture(scope="module")
def bf16_run(tiny, tmp_path_factory):
    """One GRPO step of the BF16 preset saving merged_16bit, with adapters of a real run's size (bench/gpu_check.py's
    adapters_moved): train_2048 runs merge_2048.py on final/ after training, in a process of its own."""
    out = tmp_path_factory.mktemp("bf16-merged") / "out"
    with gpu_check.adapters_moved():
        assert run_default_path(tiny, out, "--max_steps", "1", "--fast_generation", "true", "--save_method",
                                "merged_16bit", preset="gpt-oss-20b-bf16.yaml") == 0  # fmt: skip
    return out


def test_a_grpo_step_of_the_bf16_preset_runs_its_fast_path_and_the_merge(tiny, bf16_run):
    """The BF16 preset with Unsloth's dtypes: generation/fast_path 1 (no fallback line); then the merge, whose base is
    said before training: merge_2048.py's line in training.log, a correct merge, and what 16 bits keep."""
    log = (bf16_run / "training.log").read_text()
    assert f"merge_2048.py will merge the LoRA into {tiny} after training" in log
    assert "experts fused into tensors (transformers' layout); LoRA on 4 expert tensors" in log  # 2 layers x 2
    assert training_lines(bf16_run)[0]["generation/fast_path"] == 1.0 and "fast generation" not in log
    verified = [line for line in log.splitlines() if f"verified {bf16_run / 'final-merged_16bit'}: a correct" in line]
    assert len(verified) == 1 and "16-bit keeps" in verified[0] and " ERROR " not in log
    assert json.loads((bf16_run / "final-merged_16bit" / "merge_report.json").read_text())["wrong"] == []


def test_merged_16bit_on_the_4bit_default_is_refused_at_startup(tiny, tmp_path, capsys):
    """A local 4-bit checkpoint holds no 16-bit weights to merge into: train_2048 says so before it starts, one line,
    exit 2, nothing written, and how to merge final/ later (merge_2048.py --base)."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        run_default_path(split_4bit(tiny), out, "--max_steps", "1", "--save_method", "merged_16bit")
    assert stop.value.code == 2 and not out.exists()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("train_2048: --save_method merged_16bit:") and "4-bit (nf4)" in line and "save lora" in line
    assert "merge_2048.py --adapter" in line and "--base" in line


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


# --- merging a run's adapters: merge_2048.py -----------------------------------------------------------------------

SIZES = {"0.05%": 0.0005, "0.2%": 0.002, "10%": 0.1}  # of a weight: a 50-step run's, a 300-step run's, far more
LAYOUTS = ["4-bit default", "bf16 preset"]


def real_size_adapter(final: Path, folder: Path, share: float) -> Path:
    """A run's final/ as it saved it, with every LoRA B drawn so that each LoRA changes its weights by `share` of a
    weight's RMS (the tiny model's weights have its initializer's, 0.02): gpu_check's move_adapters rule, on the
    files."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(final, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for key in sorted(k for k in tensors if ".lora_B." in k):
        tensors[key] = gpu_check.draw_lora_b(tensors[key.replace(".lora_B.", ".lora_A.")], tensors[key].shape,
                                             config["r"], config["lora_alpha"] / config["r"], share * 0.02, generator)  # fmt: skip
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def real_sizes(default_runs, bf16_run, tmp_path_factory) -> dict:
    """(layout, size): the final/ of a default run (a LoRA per split expert, Unsloth's pattern; its base the split 4-bit
    checkpoint) and of a BF16 run (LoRA on the fused expert tensors), as Unsloth saved them, at each size."""
    root = tmp_path_factory.mktemp("sizes")
    finals = {"4-bit default": default_runs["true"] / "final", "bf16 preset": bf16_run / "final"}
    return {(layout, size): real_size_adapter(finals[layout], root / f"{layout}-{size}", share)
            for layout in LAYOUTS for size, share in SIZES.items()}  # fmt: skip


def merge_into_the_original(tiny, adapter: Path, out: Path) -> int:
    """merge_2048.py into the tiny model's 16-bit original, which the 4-bit default's checkpoint was quantized from (as
    the hub's was), here in this process with transformers' own classes back in place (a run starts it afresh)."""
    import merge_2048

    use_split_experts(False)
    return merge_2048.main(["--adapter", str(adapter), "--base", str(tiny), "--output_dir", str(out)])


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_real_runs_adapters_merge_correctly_and_the_report_says_what_16_bits_keep(tiny, real_sizes, layout, size,
                                                                                 tmp_path, capsys):  # fmt: skip
    """Exit 0 at every size: a correct merge, however little of the adapters 16-bit weights keep, which the line and
    merge_report.json say, with the advice to serve the adapters where they keep less than MERGED_KEPT. The
    distributions (float32 arithmetic) are reported too: where the weights keep the whole change they keep the whole
    effect; below, what they keep of the effect need not be what the weights keep (routing to the top-2 experts is
    discontinuous: a flip of one token's experts, reproduced by the merge or not, weighs more than the rest)."""
    out = tmp_path / "merged"
    assert merge_into_the_original(tiny, real_sizes[layout, size], out) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("verified ")]
    report = json.loads((out / "merge_report.json").read_text())
    print(f"{layout}, {size}: {json.dumps({k: report[k] for k in KEPT_FIGURES})}")  # docs/PERF.md's figures (-s)
    assert report["wrong"] == [] and report["adapted_tensors"] == 12 and "16-bit keeps" in line  # 2 x (4 + 2)
    holds = report["kept"] >= merging.MERGED_KEPT
    assert holds is (size == "10%") and ("serve them on the base" in report["advice"]) is not holds
    assert report["distributions"] == "compared in float32 arithmetic, on the CPU"
    if size == "10%":  # the median position: a token whose top-2 experts flip between the float32 and the 16-bit model
        # outweighs the rest in the mean (the BF16 run's probe: one position of 96 at 6.3e-3 nats, the others below 1.7e-8)
        assert abs(report["kept_effect"] - 1) < 0.01
        assert report["kl_to_unmerged_median"] < report["adapters_kl_median"] / 100


KEPT_FIGURES = ("kept", "rounded_away", "changed_weights", "kept_effect", "kept_effect_error", "kl_to_unmerged",
                "adapters_kl", "kl_to_unmerged_median", "adapters_kl_median")  # fmt: skip


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_wrong_merge_exits_1_at_every_size(tiny, real_sizes, layout, size, fault, tmp_path, monkeypatch, capsys):
    """tests/merge_faults.py's wrong merges, on both layouts' adapters as Unsloth saved them: exit 1 at every size, one
    ERROR line naming the wrong tensors, nothing published."""
    break_merge(monkeypatch, fault)
    assert merge_into_the_original(tiny, real_sizes[layout, size], tmp_path / "merged") == 1
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "the merge is wrong" in line]
    assert NAMED[fault] in line and not (tmp_path / "merged").exists()


def test_a_checkpoint_in_unsloths_split_layout_is_not_a_merge_of_the_fused_original(tiny):
    """Tensors that transformers' GPT-OSS does not have (Unsloth's split experts) are wrong, and the fused ones they
    replace are missing: the weights' check says so, tensor by tensor, whatever wrote them."""
    judged = merging.judge_weights(split_16bit(tiny), tiny, {}, {}, set())
    assert any("gate_up_projs.0.weight is not in the base" in why for why in judged["wrong"])
    assert judged["tensors"] < len(models.tensor_files(tiny))


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
    split = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(split_16bit(tiny), dtype=torch.float32),
                                      moved_default_adapter)
    expected = logits_of(split.eval(), IDS)
    assert sum(1 for name, _ in split.named_modules() if models.SPLIT_EXPERT.match(name.removesuffix(".base_layer"))
               and name.endswith("base_layer")) == 16  # fmt: skip  (PEFT found every expert through the pattern)
    use_split_experts(False)
    fused = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    fused = models.attach_split_expert_lora(fused, moved_default_adapter).eval()
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
