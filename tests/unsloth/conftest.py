"""The Unsloth tier: the default command's path (`python train_2048.py`, the Unsloth backend) checked on the CPU with
Unsloth's own code, in a pytest process of its own (`make test` runs it after the main suite).

Unsloth (pinned unsloth / unsloth_zoo 2026.10.9, installed by setup.sh without their dependencies) imports without a
GPU under its own switch for CPU-only CI, UNSLOTH_ALLOW_CPU=1. Under that switch it skips its rewrite of TRL's trainers,
so `rewrite_trl` below runs it as a GPU run's `import unsloth` does: the UnslothGRPOTrainer and UnslothGRPOConfig that
train_2048.py then subclasses and parses are the generated ones, for the installed TRL.

What a CPU cannot run of Unsloth: FastLanguageModel.from_pretrained (it reads the CUDA device's properties first) and
FastLanguageModel.get_peft_model (it needs the training-loop patch from_pretrained installs). `load_like_unsloth`
stands in for those two calls, and for nothing else: the weights are loaded by transformers, in Unsloth's own expert
classes for the 4-bit default (unsloth_zoo's GptOssExpertsBnb4bit: a Linear per expert, not quantized here), LoRA goes
where Unsloth puts it (its own get_moe_target_modules for the split experts; the fused tensors as target parameters for
BF16), and the model gets Unsloth's for_training / for_inference as its loader binds them, with "unsloth"
checkpointing. Everything after loading (the generated trainer, its unwrap, for_inference / for_training around
generation, the loss) is Unsloth's code. The loading itself runs only on a GPU: bench/gpu_matrix.sh checks it first.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

os.environ["UNSLOTH_ALLOW_CPU"] = "1"  # Unsloth's switch for CPU-only CI (unsloth/device_type.py), before its import
os.environ.setdefault("UNSLOTH_DISABLE_PINNED_MEMORY", "1")  # pinned host memory needs a CUDA allocator

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

try:
    import unsloth  # noqa: E402, F401  (before trl, transformers and peft, as train_2048.py imports it)
except ImportError as error:
    pytest.exit(f"the Unsloth tier needs unsloth and unsloth_zoo ({error}): bash setup.sh --cpu installs them", 2)


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


rewrite_trl()

import models  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
import gpu_check  # noqa: E402


def tiny_gpt_oss(folder: Path, layers: int = 2) -> Path:
    """A tiny GPT-OSS (sliding and full attention, 4 experts top-2, sinks and biases non-zero) with the CPU demo's
    tokenizer, saved in transformers' fused layout, and beside it `<folder>-split`: the same weights in the layout of
    Unsloth's 4-bit checkpoint (models.split_experts), which the default preset loads."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    import rewards

    if (folder / "config.json").exists():
        return folder
    tokenizer = models.build_tokenizer([rewards.build_prompt(rewards.RewardSettings())])
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
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    gpu_check.write_split_checkpoint(folder, split_folder(folder))  # what the GPU check builds, before quantizing
    return folder


def split_folder(folder: Path) -> Path:
    return folder.with_name(folder.name + "-split")


def use_split_experts(split: bool) -> None:
    """Install (or take back) Unsloth's split expert classes in transformers' GPT-OSS module, as Unsloth's loader
    does process-wide for a 4-bit load (unsloth_zoo temporary_patches/gpt_oss.py)."""
    from unsloth_zoo.temporary_patches.gpt_oss import patch_gpt_oss_bnb4bit, restore_gpt_oss_original

    if split:
        patch_gpt_oss_bnb4bit()
    else:
        restore_gpt_oss_original()


def bind_unsloth_modes(model, checkpointing) -> None:
    """for_training / for_inference on the model and each inner .model, as FastBaseModel.get_peft_model binds them
    (unsloth/models/vision.py), the checkpointing mode recorded, and the model put in training mode that way."""
    from unsloth.models.vision import FastBaseModel

    module = model
    while True:
        module.for_training = functools.partial(FastBaseModel.for_training, module)
        module.for_inference = functools.partial(FastBaseModel.for_inference, module)
        if not hasattr(module, "model"):
            break
        module = module.model
    model._unsloth_gradient_checkpointing = checkpointing
    FastBaseModel.for_training(model, use_gradient_checkpointing=checkpointing)


def load_like_unsloth(path, model_args, trainable, max_seq_length, offload_embedding, seed, gradient_checkpointing):
    """models._load_unsloth's two calls on a CPU (see the module docstring): the 4-bit default's split experts (Unsloth's
    classes, the weights unquantized) or BF16's fused ones, LoRA where Unsloth puts it, Unsloth's modes bound."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from unsloth.models._utils import add_moe_target_modules, get_moe_target_modules

    split = bool(model_args.load_in_4bit)
    use_split_experts(split)
    model = AutoModelForCausalLM.from_pretrained(split_folder(Path(path)) if split else path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert trainable and model_args.use_peft, "the tier trains LoRA, as the presets do"
    targets = list(model_args.lora_target_modules)
    experts = {"gate_proj", "up_proj", "down_proj"}
    if split:
        targets = add_moe_target_modules(targets, get_moe_target_modules(model, targets))
        parameters = None
    else:  # what Unsloth prints for a fused checkpoint: "Enabling LoRA on MoE parameters: [...]"
        parameters = models.GPT_OSS_EXPERTS if experts & set(targets) else None
        targets = [t for t in targets if t not in experts]
    config = LoraConfig(r=model_args.lora_r, lora_alpha=model_args.lora_alpha, target_modules=targets,
                        target_parameters=parameters, task_type="CAUSAL_LM",
                        lora_dropout=models.lora_dropout(model, model_args.lora_target_modules, model_args.lora_dropout))  # fmt: skip
    torch.manual_seed(seed)
    model = get_peft_model(model, config)
    bind_unsloth_modes(model, "unsloth" if gradient_checkpointing else False)
    import unsloth.save

    unsloth.save.patch_saving_functions(model)  # save_pretrained_merged, as get_peft_model gives it
    return model, tokenizer


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """The tiny GPT-OSS in both layouts (the fused folder; split_folder(tiny) is the split one)."""
    return tiny_gpt_oss(tmp_path_factory.mktemp("models") / "tiny-gpt-oss")


@pytest.fixture
def unsloth_backend(monkeypatch):
    """models._load_unsloth replaced by load_like_unsloth, Unsloth's one GPU query on its merge path (is the card a
    T4?) answered; transformers' own expert classes back afterwards."""
    import torch

    monkeypatch.setattr(models, "_load_unsloth", load_like_unsloth)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args, **kwargs: "CPU")
    yield
    use_split_experts(False)
