"""The Unsloth tier: the default command's path (`python train_2048.py`, the Unsloth backend) checked on the CPU with
Unsloth's own code, its loader included, in a pytest process of its own (`make test` runs it after the main suite).

Unsloth (pinned unsloth / unsloth_zoo 2026.10.9) and bitsandbytes (0.50.2, which quantizes NF4 on the CPU) are
installed by setup.sh without their dependencies. Unsloth imports without a GPU under its own switch for CPU-only CI,
UNSLOTH_ALLOW_CPU=1, under which it also skips its rewrite of TRL's trainers: `rewrite_trl` runs it as a GPU run's
`import unsloth` does, so the UnslothGRPOTrainer and UnslothGRPOConfig that train_2048.py subclasses and parses are the
generated ones, for the installed TRL.

Every test loads through models._load_unsloth and models.attach_lora as train_2048 does: Unsloth's
FastLanguageModel.from_pretrained and get_peft_model themselves. The default preset loads `<tiny>-split-4bit`, a tiny GPT-OSS in Unsloth's pre-quantized split
layout (NF4 Linear4bit per expert and in attention), built on the CPU by bench/gpu_check.py's own code; the BF16
preset loads the fused `<tiny>`; offload_embedding is what each preset sets.

What the CPU tier stubs (`stand_in_for_a_gpu`, the one place; README and docs/GPU_CHECK.md say the same), none of it
on the path a test checks:
1. torch.cuda.get_device_properties / get_device_capability / get_device_name answer as an H100 would. Unsloth reads
   the card for its banner (unsloth/device_type.py:611, get_device_stats, from from_pretrained), for its FP8 check
   (unsloth/models/_utils.py:9417, verify_fp8_support_if_applicable) and, when merging, whether it is a T4
   (unsloth_zoo/saving_utils.py:5520). torch.cuda.is_available() stays False: nothing is put on a device.
2. unsloth.kernels.large_head_attention is a module whose patch_large_head_attention returns False. from_pretrained
   imports it last (unsloth/models/vision.py:4902); it imports Triton, which a CPU torch lacks, and acts only on
   head_dim > 256 (GPT-OSS has 64), where it returns False as well.
3. ALLOW_BITSANDBYTES and ALLOW_PREQUANTIZED_MODELS are True in Unsloth's modules. Unsloth clears them at import when
   bitsandbytes has no CUDA kernels (unsloth/device_type.py:181, native_kernels_ready), and then loads a pre-quantized
   split checkpoint as the fused layout (unsloth/models/loader.py:2319 and 2443): random experts.
4. unsloth.models._utils.SUPPORTS_BFLOAT16 is True. Without a device Unsloth says False (unsloth/models/_utils.py:4329)
   and loads 16-bit weights as float16 (unsloth/models/loader.py:2292-2294), where a GPU run has BF16.
torch.compile is off (TORCHDYNAMO_DISABLE=1, read at each torch.compile call): Unsloth compiles its modules with
Inductor, which takes minutes per step on 2 cores (a generation of the tiny model: 478 s, against 8 s). The test of
our compiled decode step lifts it around that step alone.
What stays for a GPU (bench/gpu_matrix's first call, through bench/gpu_check.py on this same path): bnb's CUDA kernels,
flex attention with sinks (Unsloth's patch_GptOssModel needs a CUDA device: on the CPU it is skipped, with a warning,
and transformers' eager attention runs), CUDA graphs over 4-bit experts, memory and time.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

os.environ["UNSLOTH_ALLOW_CPU"] = "1"  # Unsloth's switch for CPU-only CI (unsloth/device_type.py), before its import
os.environ.setdefault("UNSLOTH_DISABLE_PINNED_MEMORY", "1")  # pinned host memory needs a CUDA allocator
os.environ["TORCHDYNAMO_DISABLE"] = "1"  # see the docstring: Inductor on 2 cores

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # merge_faults.py, shared with the main suite

try:
    import unsloth  # noqa: E402, F401  (before trl, transformers and peft, as train_2048.py imports it)
except ImportError as error:
    pytest.exit(f"the Unsloth tier needs unsloth and unsloth_zoo ({error}): bash setup.sh --cpu installs them", 2)
try:
    import bitsandbytes  # noqa: E402, F401
except ImportError as error:
    pytest.exit(f"the Unsloth tier needs bitsandbytes ({error}): bash setup.sh --cpu installs it", 2)

H100 = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * 2**30,
                             multi_processor_count=132, gcnArchName="")  # fmt: skip


def stand_in_for_a_gpu() -> None:
    """The tier's four stubs (the module docstring says why each, and the Unsloth line it answers)."""
    import torch

    torch.cuda.get_device_properties = lambda *args, **kwargs: H100  # 1.
    torch.cuda.get_device_capability = lambda *args, **kwargs: (H100.major, H100.minor)
    torch.cuda.get_device_name = lambda *args, **kwargs: H100.name
    large_head = types.ModuleType("unsloth.kernels.large_head_attention")  # 2.
    large_head.patch_large_head_attention = lambda model=None: False
    sys.modules[large_head.__name__] = large_head
    for name, module in list(sys.modules.items()):  # 3.
        if name.startswith("unsloth") and module is not None:
            for flag in ("ALLOW_BITSANDBYTES", "ALLOW_PREQUANTIZED_MODELS"):
                if hasattr(module, flag):
                    setattr(module, flag, True)
    import unsloth.models._utils

    unsloth.models._utils.SUPPORTS_BFLOAT16 = True  # 4.


def rewrite_trl() -> None:
    """Unsloth's rewrite of TRL as `import unsloth` does it on a GPU (unsloth/_gpu_init.py; unsloth/models/llama.py's
    PatchFastRL), with the CPU switch lifted for the call: trl.GRPOTrainer and trl.GRPOConfig become the generated
    UnslothGRPOTrainer and UnslothGRPOConfig."""
    from unsloth._gpu_init import _patch_trl_trainer
    from unsloth.context_parallel import patch_sft_trainer
    from unsloth.models.llama import FastLlamaModel
    from unsloth.models.rl import PatchFastRL

    os.environ["UNSLOTH_ALLOW_CPU"] = "0"
    try:
        _patch_trl_trainer()
        patch_sft_trainer()
        PatchFastRL(FastLanguageModel=FastLlamaModel)
    finally:
        os.environ["UNSLOTH_ALLOW_CPU"] = "1"


stand_in_for_a_gpu()
rewrite_trl()

import demo_data  # noqa: E402
import models  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
import gpu_check  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # the presets' LoRA targets


def tiny_gpt_oss(folder: Path, layers: int = 2) -> Path:
    """A tiny GPT-OSS (sliding and full attention, 4 experts top-2, sinks and biases non-zero) with the CPU demo's
    tokenizer, saved in bf16 in transformers' fused layout (what the BF16 preset loads, and the 16-bit original a merge
    goes into), and beside it, built by the GPU check's own code: `<folder>-split-16bit` (gpu_check.write_split_checkpoint:
    the same weights, a Linear per expert) and `<folder>-split-4bit` (gpu_check.quantize_split on the CPU: NF4, what the
    default preset loads: quantized from the original, as the hub's 4-bit checkpoint was)."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    import rewards

    if (split_4bit(folder) / "config.json").exists():
        return folder
    tokenizer = demo_data.build_tokenizer([rewards.build_prompt(rewards.RewardSettings())])
    config = GptOssConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2), sliding_window=8,
        max_position_embeddings=4096, router_aux_loss_coef=0.0, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GptOssForCausalLM(config)
    with torch.no_grad():  # non-zero, so that getting them wrong shows
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1)
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.1)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.1)
            layer.mlp.router.bias.normal_(0, 0.1)
    model.to(torch.bfloat16).save_pretrained(folder)  # a 16-bit original, as the hub's
    tokenizer.save_pretrained(folder)
    gpu_check.write_split_checkpoint(folder, split_16bit(folder))
    gpu_check.quantize_split(split_16bit(folder), split_4bit(folder), device="cpu")
    return folder


def split_16bit(folder: Path) -> Path:
    return folder.with_name(folder.name + "-split-16bit")


def split_4bit(folder: Path) -> Path:
    return folder.with_name(folder.name + "-split-4bit")


def use_split_experts(split: bool) -> None:
    """Install (or take back) Unsloth's split expert classes in transformers' GPT-OSS module, as Unsloth's loader
    does process-wide for a 4-bit load (unsloth_zoo temporary_patches/gpt_oss.py)."""
    from unsloth_zoo.temporary_patches.gpt_oss import patch_gpt_oss_bnb4bit, restore_gpt_oss_original

    if split:
        patch_gpt_oss_bnb4bit()
    else:
        restore_gpt_oss_original()


def load_with_unsloth(tiny: Path, split: bool, *, dropout: float = 0.0, seed: int = 0):
    """(model, tokenizer) from models.load_model on the Unsloth backend, as train_2048 loads a preset's model: the
    4-bit default's split checkpoint with offload_embedding, or the BF16 preset's fused one."""
    from trl import ModelConfig

    path = str(split_4bit(tiny) if split else tiny)
    args = ModelConfig(model_name_or_path=path, use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=dropout,
                       load_in_4bit=split, lora_target_modules=TARGETS)  # fmt: skip
    return models.load_model(path, args, backend="unsloth", trainable=True, max_seq_length=1024,
                             offload_embedding=split, seed=seed, gradient_checkpointing=True)  # fmt: skip


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """The tiny GPT-OSS: the fused folder; split_16bit(tiny) and split_4bit(tiny) beside it."""
    return tiny_gpt_oss(tmp_path_factory.mktemp("models") / "tiny-gpt-oss")


@pytest.fixture(autouse=True)
def transformers_classes_after():
    """Unsloth's 4-bit loads swap GPT-OSS's expert classes process-wide: transformers' own are back after each test."""
    yield
    use_split_experts(False)
