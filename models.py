"""The model: loaded to train or to evaluate by one function, and the CPU demo's tiny model, built locally.

train_2048.py loads the policy with fresh LoRA adapters (Unsloth on one CUDA GPU, transformers + PEFT
elsewhere); evaluate_2048.py loads a base model with saved adapters, or a merged model. Both go through
`load_model`, so a checkpoint is read the way it was trained.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("train_2048.models")

TINY = "tiny"  # model_name_or_path that builds the CPU demo's model in <output_dir>/tiny-model
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)  # other variables (gpt-oss's reasoning_effort) are accepted and unused
GPT_OSS_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # fused tensors, not Linear layers
# GPT-OSS's experts come in two layouts. transformers fuses each layer's experts into tensors: mlp.experts.gate_up_proj
# (experts, hidden, 2*inner), down_proj (experts, inner, hidden), their biases, and the router as mlp.router.weight/bias.
# Unsloth's 4-bit checkpoint, the default's (unsloth/gpt-oss-20b-unsloth-bnb-4bit), splits them into one Linear per
# expert so that bitsandbytes can quantize each (unsloth_zoo's GptOssExpertsBnb4bit): mlp.experts.gate_up_projs.<e>
# (weight (2*inner, hidden), bias), down_projs.<e> (weight (hidden, inner), bias), the router as mlp.router.linear.
# Unsloth puts a default run's expert LoRA on those Linears (target_modules gate_up_projs.<e>, down_projs.<e>).
GPT_OSS_FUSED = ("gate_up_proj", "down_proj")
SPLIT_EXPERT = re.compile(r"(?P<experts>.*\.experts)\.(?P<kind>gate_up_projs|down_projs)\.(?P<index>\d+)$")
SPLIT_TARGET = re.compile(r"(gate_up_projs|down_projs)\.\d+")  # Unsloth's target_modules entry for one expert
# Unsloth's split 4-bit checkpoints, and the same weights in transformers' fused layout (which evaluation can load)
FUSED_CHECKPOINT = {
    "unsloth/gpt-oss-20b-unsloth-bnb-4bit": "unsloth/gpt-oss-20b-BF16",
    "unsloth/gpt-oss-120b-unsloth-bnb-4bit": "unsloth/gpt-oss-120b-BF16",
}
# The 16-bit checkpoint a merge reads, for hub checkpoints that are not one: Unsloth's split 4-bit ones (above) and the
# MXFP4 originals (the default preset's unsloth/gpt-oss-20b) hold the same weights as these BF16 copies.
SIXTEEN_BIT_ORIGINAL = {
    **FUSED_CHECKPOINT,
    "unsloth/gpt-oss-20b": "unsloth/gpt-oss-20b-BF16",
    "unsloth/gpt-oss-120b": "unsloth/gpt-oss-120b-BF16",
}
# A correct merge whose 16-bit weights keep less than this share of the adapters' change is reported with the advice to
# serve the adapters instead (16-bit rounding erases a LoRA change below half a weight's last digit: docs/PERF.md).
MERGED_KEPT = 0.95


def quiet_library_imports() -> None:
    """Library noise at import never comes before our own one-line errors, on any CPU kind or GPU machine. Called by
    each command before it imports trl (which imports peft, which imports bitsandbytes).

    - The GPU set's libraries (torchao) compile with SyntaxWarnings: never the user's to act on.
    - bitsandbytes (0.50), on a CPU with AVX512-BF16 (many Xeon and EPYC hosts, H100 machines included), looks for a
      CPU kernel on the Hugging Face Hub at import (the `kernels` package) and logs a warning when it cannot. The
      lookup is never made (bitsandbytes falls back to its own kernel, as on every other CPU) and the warning is
      dropped; any other warning of that module still shows.
    """
    import importlib.util

    warnings.filterwarnings("ignore", category=SyntaxWarning)
    bnb_cpu_log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(getattr(f, "__name__", "") == "_no_hub_kernel_warning" for f in bnb_cpu_log.filters):
        bnb_cpu_log.addFilter(_no_hub_kernel_warning)
    if "bitsandbytes" in sys.modules or importlib.util.find_spec("bitsandbytes") is None:
        return
    kernels = sys.modules.get("kernels", _MISSING)
    sys.modules["kernels"] = None  # `from kernels import ...` raises ImportError: no Hub lookup at import
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # a broken install is reported where it is used, in the library's own words
        log.debug(f"bitsandbytes does not import: {exc}")
    finally:
        if kernels is _MISSING:
            sys.modules.pop("kernels", None)
        else:
            sys.modules["kernels"] = kernels


_MISSING = object()


def _no_hub_kernel_warning(record: logging.LogRecord) -> bool:
    return "gemm_4bit_forward from kernels-community" not in record.getMessage()


MARK = ".train_2048-wrote-this"  # in every folder publish() puts in place: {"by": the command that wrote it}


class NotOurs(ValueError):
    """A folder in the way that this project did not write: never replaced, never deleted."""


def fresh(path: Path) -> Path:
    """A new empty folder beside `path` to write into, named as no user names a folder (mkdtemp's .train_2048-XXXX):
    never `<path>.tmp`, which may be the user's. publish() moves it into place when it is complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=path.parent, prefix=".train_2048-"))


def written_by(path: Path) -> str | None:
    """Which of our commands wrote the folder `path` (its MARK file), or None: a user's folder, or not a folder."""
    import user_files

    if path.is_symlink() or not path.is_dir():
        return None
    try:
        mark = user_files.read_json(path / MARK, 4096, "mark")
    except user_files.FileRefused:
        return None
    return mark.get("by") if isinstance(mark, dict) and isinstance(mark.get("by"), str) else None


def publish(tmp: Path, path: Path, by: str) -> None:
    """Mark the fully written folder `tmp` as `by`'s and swap it in for `path`, so `path` is never half-written. An
    existing `path` is replaced only when `by` wrote it (its MARK): NotOurs otherwise, with nothing touched. The old
    folder goes through a mkdtemp folder of our own before it is deleted, never through a name a user may hold."""
    import user_files

    user_files.write_new(tmp / MARK, json.dumps({"by": by}) + "\n")
    if not (path.exists() or path.is_symlink()):
        os.rename(tmp, path)
        return
    if written_by(path) != by:
        raise NotOurs(f"{path} exists and {by} did not write it (no {MARK} of its own there): it is left as it is")
    old = Path(tempfile.mkdtemp(dir=path.parent, prefix=".train_2048-old-"))
    os.rename(path, old / path.name)
    os.rename(tmp, path)
    shutil.rmtree(old)


def build_tiny_model(path: Path, corpus: list[str], seed: int) -> Path:
    """The CPU demo's model: a 2-layer, 128-wide Llama and a 600-token BPE trained on the demo's prompt and
    answers, saved like a hub checkpoint so it loads through the same from_pretrained call as a real one.

    Pre-tokens are whole lines, so merges span spaces and an answer is a few dozen tokens. Built once per
    output directory (a resume reuses it), in a temporary folder renamed at the end.
    """
    if (path / "config.json").exists():
        return path.resolve()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(corpus)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    tmp = fresh(path)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        publish(tmp, path, "train_2048")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path.resolve()  # absolute: adapter_config.json and train_2048_base.json name it from any working folder


def build_tokenizer(corpus: list[str], vocab_size: int = 600):
    """A byte-level BPE trained on `corpus`, with the demo's chat template: no download, a few seconds."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n|[^\n]+"), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<|pad|>", eos_token="<|end|>", chat_template=CHAT_TEMPLATE
    )


def load_model(
    path: str,
    model_args,
    *,
    backend: str = "transformers",
    adapter: str | None = None,
    trainable: bool = False,
    max_seq_length: int = 768,
    offload_embedding: bool = False,
    seed: int = 0,
    gradient_checkpointing: bool = False,
    device_map=None,
    local_files_only: bool = False,
    trust_remote_code: bool = False,
):
    """(model, tokenizer). `model_args` is TRL's ModelConfig (dtype, attention, 4-bit, LoRA options).

    trainable: with fresh LoRA adapters when `model_args.use_peft` (or in full for fine-tuning); else for
    inference, with the adapters saved in `adapter` on top when given (transformers backend), the tokenizer
    then coming from the adapter's folder if it has one. The generation config's `max_length` is left unset:
    callers always pass `max_new_tokens`, and a checkpoint's own `max_length` only made transformers warn at
    every generation.
    """
    if backend == "unsloth":
        model, tokenizer = _load_unsloth(path, model_args, trainable, max_seq_length, offload_embedding, seed,
                                         gradient_checkpointing)  # fmt: skip
    else:
        model, tokenizer = _load_transformers(path, model_args, adapter, trainable, device_map, local_files_only,
                                              trust_remote_code)  # fmt: skip
    model.generation_config.max_length = None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def not_a_model(path: str) -> str | None:
    """Why a local folder is no model to load, read from its file names (None: it may be one, or it is a hub name):
    asked before a load, so a folder of something else costs one line, not a traceback from deep in transformers."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return None if not folder.exists() else "a file, not a model folder"
    if (folder / "config.json").is_file():
        return None
    if (folder / "adapter_config.json").is_file():
        import user_files

        try:
            base = user_files.read_json(folder / "adapter_config.json", what="adapter_config.json").get(
                "base_model_name_or_path")
        except (ValueError, AttributeError):
            base = None
        return f"it holds LoRA adapters, not a model (their base model: {base or 'not named'})"
    return "no config.json there, so not a model folder (one holds config.json, the weights and the tokenizer)"


def _load_unsloth(path, model_args, trainable, max_seq_length, offload_embedding, seed, gradient_checkpointing):
    from unsloth import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=path,
        max_seq_length=max_seq_length,
        load_in_4bit=model_args.load_in_4bit,
        offload_embedding=offload_embedding,
        full_finetuning=trainable and not model_args.use_peft,
    )
    if trainable and model_args.use_peft:
        model = FastLanguageModel.get_peft_model(
            model,
            r=model_args.lora_r,
            lora_alpha=model_args.lora_alpha,
            lora_dropout=lora_dropout(model, model_args.lora_target_modules, model_args.lora_dropout),
            target_modules=model_args.lora_target_modules,  # Unsloth maps gate/up/down_proj onto GPT-OSS's experts
            use_gradient_checkpointing="unsloth" if gradient_checkpointing else False,
            random_state=seed,
        )
    return model, tokenizer


def _load_transformers(path, model_args, adapter, trainable, device_map, local_files_only, trust_remote_code):
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import get_peft_config, get_quantization_config

    quantization = get_quantization_config(model_args)
    if quantization is not None and device_map is None:
        device_map = {"": int(os.environ.get("LOCAL_RANK", 0))}  # bitsandbytes: this process's GPU
    model = AutoModelForCausalLM.from_pretrained(
        path,
        revision=model_args.model_revision,
        dtype=model_args.dtype or "auto",
        attn_implementation=model_args.attn_implementation,
        quantization_config=quantization,
        device_map=device_map,
        local_files_only=local_files_only,
        trust_remote_code=trust_remote_code,
    )
    has_tokenizer = adapter is not None and (Path(adapter) / "tokenizer_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(
        adapter if has_tokenizer else path,
        revision=None if has_tokenizer else model_args.model_revision,
        local_files_only=local_files_only,
        trust_remote_code=trust_remote_code,
    )
    if adapter is not None and split_expert_lora(adapter):
        return attach_split_expert_lora(model, Path(adapter)), tokenizer
    if adapter is not None:
        return PeftModel.from_pretrained(model, adapter, local_files_only=local_files_only), tokenizer
    if not (trainable and model_args.use_peft):
        return model, tokenizer
    peft_config = get_peft_config(model_args)
    fused = {"gate_proj", "up_proj", "down_proj"}
    if (
        model.config.model_type == "gpt_oss"
        and not peft_config.target_parameters
        and fused & set(peft_config.target_modules or ())
    ):
        # transformers fuses each layer's experts into two tensors, not Linear layers: LoRA reaches them by name
        peft_config.lora_dropout = lora_dropout(model, peft_config.target_modules, peft_config.lora_dropout)
        peft_config.target_modules = set(peft_config.target_modules) - fused
        peft_config.target_parameters = GPT_OSS_EXPERTS
    return get_peft_model(model, peft_config), tokenizer


def lora_dropout(model, targets, dropout: float) -> float:
    """The LoRA dropout both backends use: PEFT cannot apply dropout to a LoRA on a tensor (GPT-OSS's fused experts,
    reached as target parameters), so there it is 0, with one warning; Unsloth's split experts are Linear layers and
    keep it."""
    experts = {"gate_proj", "up_proj", "down_proj", "gate_up_proj"}
    if dropout and experts_layout(model) == "fused" and experts & set(targets or ()):
        log.warning("LoRA on GPT-OSS's fused experts cannot use dropout: lora_dropout set to 0")
        return 0.0
    return dropout


def experts_layout(model) -> str | None:
    """"fused" (transformers' expert tensors), "split" (Unsloth's Linear per expert), or None (no experts we know)."""
    import torch

    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            while hasattr(module, "parameter_name") and hasattr(module, "base_layer"):  # PEFT's LoRA on a tensor
                module = module.base_layer
            if hasattr(module, "gate_up_projs"):
                return "split"
            if isinstance(getattr(module, "gate_up_proj", None), torch.Tensor):
                return "fused"
    return None


def describe_experts(model) -> str:
    """One line for training.log: the expert layout loaded and how many expert weights carry a LoRA, so that a run
    (and the GPU check) says which path it trains."""
    layout = experts_layout(model)
    if layout == "split":
        lora = sum(1 for name, m in model.named_modules() if SPLIT_EXPERT.match(name) and hasattr(m, "lora_A"))
        return f"GPT-OSS experts split, a Linear per expert (Unsloth's 4-bit layout); LoRA on {lora} of them"
    if layout == "fused":
        lora = sum(1 for _, m in model.named_modules() if getattr(m, "parameter_name", None) in GPT_OSS_FUSED)
        return f"GPT-OSS experts fused into tensors (transformers' layout); LoRA on {lora} expert tensors"
    return "no GPT-OSS experts"


# --- GPT-OSS's split experts (Unsloth's 4-bit layout) and transformers' fused ones ----------------------------------


def split_experts(state_dict: dict) -> dict:
    """A fused GPT-OSS state dict in the layout of Unsloth's 4-bit checkpoint (a Linear per expert, the router as
    router.linear): what the GPU check builds so that it times the model `python train_2048.py` loads."""
    split = {}
    for name, tensor in state_dict.items():
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".experts") and leaf in GPT_OSS_FUSED:
            split.update({f"{owner}.{leaf}s.{e}.weight": w.t().contiguous() for e, w in enumerate(tensor)})
        elif owner.endswith(".experts") and leaf.removesuffix("_bias") in GPT_OSS_FUSED:
            split.update({f"{owner}.{leaf.removesuffix('_bias')}s.{e}.bias": b.clone() for e, b in enumerate(tensor)})
        elif owner.endswith(".router") and leaf in ("weight", "bias"):
            split[f"{owner}.linear.{leaf}"] = tensor
        else:
            split[name] = tensor
    return split


def split_expert_lora(adapter) -> bool:
    """True for an adapter trained on Unsloth's split experts (a default run's): LoRA on gate_up_projs.<e> and
    down_projs.<e>, which transformers' fused experts do not have."""
    import user_files

    config = user_files.read_json(Path(adapter) / "adapter_config.json", what="adapter_config.json")
    targets = (config.get("target_modules") if isinstance(config, dict) else None) or []
    if isinstance(targets, str):
        return "gate_up_projs" in targets or "down_projs" in targets
    return any(SPLIT_TARGET.fullmatch(t) for t in targets)


def attach_split_expert_lora(model, folder: Path):
    """A split-expert adapter on a model with fused experts, as the same function: the attention LoRA as saved, and
    each expert's LoRA (A_e: r x in, B_e: out x r, on the Linear W_e = fused[e].T) written into PEFT's LoRA on the fused
    tensor, which keeps a rank-r pair per expert (lora_A rows e*r..e*r+r-1, lora_B columns r_i*experts + e).

    The modules come from the saved tensors' names, not adapter_config.json's target_modules: Unsloth's get_peft_model
    saves those as one regex (unsloth/models/vision.py joins the list into a pattern and appends the per-expert one),
    which names no module of the fused layout; the tensors name each module that was trained."""
    import torch
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    import user_files

    config = user_files.read_json(folder / "adapter_config.json", what="adapter_config.json")
    saved = load_file(str(folder / "adapter_model.safetensors"))
    trained = sorted({key.rpartition(".lora_A")[0].removeprefix("base_model.model.") for key in saved if ".lora_A" in key})
    kinds = sorted({match["kind"] for match in map(SPLIT_EXPERT.match, trained) if match})
    fused = LoraConfig(
        r=config["r"], lora_alpha=config["lora_alpha"], use_rslora=config.get("use_rslora", False),
        target_modules=[name for name in trained if not SPLIT_EXPERT.match(name)],  # whole names: exactly these
        target_parameters=[f"mlp.experts.{kind.removesuffix('s')}" for kind in kinds],
        lora_dropout=0.0, bias=config.get("bias", "none"), task_type=config.get("task_type"),
    )  # fmt: skip
    peft_model = get_peft_model(model, fused)
    experts = {k: v for k, v in saved.items() if SPLIT_EXPERT.match(k.removesuffix(".weight").rpartition(".lora_")[0])}
    loaded = set_peft_model_state_dict(peft_model, {k: v for k, v in saved.items() if k not in experts})
    if loaded.unexpected_keys:
        raise ValueError(f"{folder}: {len(loaded.unexpected_keys)} saved tensors fit no module: {loaded.unexpected_keys[:3]}")
    used = set()
    with torch.no_grad():
        for name, module in peft_model.named_modules():
            if getattr(module, "parameter_name", None) not in GPT_OSS_FUSED:
                continue
            owner = re.sub(r"(\.base_layer)+$", "", name)  # ParamWrappers nest: experts.base_layer...
            count = module.num_experts
            lora_a = module.lora_A["default"].weight.view(count, -1, module.in_features)  # (experts, r, in)
            lora_b = module.lora_B["default"].weight.view(module.out_features, -1, count)  # (out, r, experts)
            for e in range(count):
                key = f"{owner}.{module.parameter_name}s.{e}.lora_"
                lora_a[e].copy_(experts[key + "A.weight"])
                lora_b[:, :, e].copy_(experts[key + "B.weight"])
                used |= {key + "A.weight", key + "B.weight"}
    if unused := sorted(experts.keys() - used):
        raise ValueError(f"{folder}: {len(unused)} expert LoRA tensors fit no fused expert tensor: {unused[:3]}")
    log.info(f"{folder}: the LoRA of {len(used) // 2} split experts mapped onto the fused expert tensors")
    return peft_model


# --- which base an adapter was trained on -----------------------------------------------------------------------
# Every adapter folder a run saves holds BASE_FILE: the base's name as given, its absolute path (a local folder) or hub
# revision (the cached snapshot's commit), how it is quantized, and a fingerprint: a few values at fixed positions of
# the tensors stored unquantized in a 4-bit checkpoint and in its 16-bit original alike (the embedding, the final
# norm), read from the safetensors files. A merge or an evaluation on other weights is refused by it; 4-bit and 16-bit
# copies of the same model agree.
BASE_FILE = "train_2048_base.json"
FINGERPRINTED = {"embed_tokens": re.compile(r"(?:.*\.)?embed_tokens\.weight"),
                 "norm": re.compile(r"(?:.*\.)?(?<!layers\.)(?:model|language_model)\.norm\.weight")}  # fmt: skip
FINGERPRINT_VALUES = 8


def checkpoint_files(name: str, revision: str | None = None) -> tuple[Path | None, str | None]:
    """(the folder holding `name`'s files here, the hub revision they are) with nothing downloaded: a local folder
    (absolute), or the snapshot of the hub's cache that holds its config.json (its commit); (None, None) if neither."""
    local = Path(name).expanduser()
    if local.is_dir():
        return local.resolve(), None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 - not a hub name either
        return None, None
    if not isinstance(found, str):
        return None, None
    return Path(found).parent, Path(found).parent.name  # .../snapshots/<commit>/config.json


def fingerprint(folder: Path) -> dict:
    """{embed_tokens / norm: {shape, values at fixed positions}} read from the checkpoint's safetensors headers and a
    few bytes of data each, nothing loaded; {} when neither tensor is stored there (or the files do not read)."""
    import math

    from safetensors import safe_open

    try:
        files = tensor_files(folder)
    except Exception:  # noqa: BLE001 - no weights here, or damaged ones: nothing to compare
        return {}
    found = {}
    for key, pattern in FINGERPRINTED.items():
        name = min((n for n in files if pattern.fullmatch(n)), key=len, default=None)
        if name is None:
            continue
        try:
            with safe_open(str(files[name]), framework="pt") as f:
                part = f.get_slice(name)
                shape = list(part.get_shape())
                count = math.prod(shape)
                values = []
                for i in range(min(FINGERPRINT_VALUES, count)):
                    flat = round(i * (count - 1) / max(1, FINGERPRINT_VALUES - 1))
                    index = [slice(flat // math.prod(shape[d + 1:]) % shape[d], None) for d in range(len(shape))]
                    index = tuple(slice(s.start, s.start + 1) for s in index)
                    values.append(float(part[index].float().reshape(-1)[0]))
        except Exception:  # noqa: BLE001 - a damaged shard: nothing to compare
            continue
        found[key] = {"shape": shape, "values": values}
    return found


def base_identity(name: str, revision: str | None = None, model=None) -> dict:
    """What train_2048 records of the base it trains on (BASE_FILE), from its files; `model` the loaded model, whose
    config names the checkpoint actually read (Unsloth loads unsloth/gpt-oss-20b in 4-bit from its -unsloth-bnb-4bit
    copy) and how its weights were quantized for training. Never raises."""
    import user_files

    config = getattr(model, "config", None)
    loaded = getattr(config, "_name_or_path", None) or name
    folder, commit = checkpoint_files(loaded, revision)
    if folder is None and loaded != name:
        folder, commit = checkpoint_files(name, revision)
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict() if hasattr(quantization, "to_dict") else {"quant_method": "quantized"}
    if quantization is None and folder is not None:
        try:
            stored = user_files.read_json(folder / "config.json", what="the base's config.json")
            quantization = stored.get("quantization_config") if isinstance(stored, dict) else None
        except user_files.FileRefused:
            pass
    quantized = None
    if isinstance(quantization, dict):
        quantized = (quantization.get("bnb_4bit_quant_type") or "4-bit") if quantization.get("load_in_4bit") else (
            quantization.get("quant_method") or "quantized")  # fmt: skip
    local = Path(loaded).expanduser().is_dir()
    return {"name": name, "loaded": loaded, "path": str(folder) if local else None, "revision": None if local else commit,
            "quantized": str(quantized) if quantized else None,
            "fingerprint": fingerprint(folder) if folder is not None else {}}  # fmt: skip


def trained_quantized(adapter: Path, trained_on: str | None) -> str | None:
    """How the weights the adapter was trained on were quantized ("nf4"), from its BASE_FILE; for an adapter without
    one, from the checkpoint it names: Unsloth's 4-bit checkpoints on the hub (FUSED_CHECKPOINT)."""
    try:
        identity = read_base_identity(adapter)
    except ValueError:
        identity = None
    if identity is not None:
        return identity.get("quantized") or None
    if trained_on in FUSED_CHECKPOINT:  # Unsloth's NF4 checkpoints (the MXFP4 originals may have been trained in 16 bits)
        return "nf4"
    return None


def write_base_identity(folder: Path, identity: dict) -> None:
    """BASE_FILE into an adapter folder this run writes (replaced when the folder is saved again)."""
    import user_files

    path = Path(folder) / BASE_FILE
    if path.is_file() and not path.is_symlink():
        path.unlink()
    user_files.write_new(path, json.dumps(identity, indent=1) + "\n")


def read_base_identity(adapter: Path) -> dict | None:
    """The adapter's BASE_FILE, or None (an adapter saved before it existed, or elsewhere). ValueError when damaged."""
    import user_files

    path = Path(adapter) / BASE_FILE
    if not path.exists():
        return None
    try:
        identity = user_files.read_json(path, 1 << 20, "the adapter's base record")
    except user_files.FileRefused as error:
        raise ValueError(str(error)) from None
    if not isinstance(identity, dict) or not isinstance(identity.get("name"), str):
        raise ValueError(f"{path}: not a record of a base model (no name)")
    return identity


def trained_base(adapter: Path, name: str) -> str:
    """The base an adapter names, as a path that works from here: a relative path written by an older run (the CPU
    demo's outputs/cpu-demo/tiny-model) is looked for against the adapter's parents, then as <run folder>/<its last
    part>; otherwise `name` as it is (a hub name, an absolute path)."""
    given = Path(name).expanduser()
    if given.is_absolute() or given.is_dir() or not name:
        return name
    run = Path(adapter).resolve().parent
    for candidate in [*(p / given for p in run.parents), run / given, run / given.name]:
        if (candidate / "config.json").is_file():
            return str(candidate)
    return name


def same_fingerprint(a: list, b: list) -> bool:
    """Equal values rounded to bf16 (a 16-bit original stored in float32 agrees with its bf16 copy); NaN equals NaN."""
    import torch

    x, y = torch.tensor(a, dtype=torch.float64).bfloat16(), torch.tensor(b, dtype=torch.float64).bfloat16()
    return x.shape == y.shape and bool(((x == y) | (x.isnan() & y.isnan())).all())


def compare_base(adapter: Path, folder: Path | None, label: str) -> tuple[str | None, str | None]:
    """(why the base in `folder` is not the one the adapter was trained on, None), or (None, a note when it cannot be
    told), or (None, None) when the fingerprints agree. `label` names the base as the user gave it."""
    try:
        identity = read_base_identity(adapter)
    except ValueError as error:
        return None, f"the base cannot be checked ({error})"
    if identity is None:
        return None, f"{adapter} holds no {BASE_FILE} (saved before it was written): its base cannot be checked"
    trained = identity["name"] + (f" (revision {identity['revision']})" if identity.get("revision") else "")
    recorded = identity.get("fingerprint") or {}
    here = fingerprint(folder) if folder is not None else {}
    common = sorted(recorded.keys() & here.keys())
    if not common:
        where = "the trained base's record" if not recorded else f"{label}'s files"
        return None, (f"the base cannot be checked: no embedding or final norm in {where} to compare ({trained} "
                      f"against {label})")  # fmt: skip
    for key in common:
        ours, theirs = recorded[key], here[key]
        if list(ours.get("shape", [])) != theirs["shape"]:
            return (f"{label} is not the model {adapter} was trained on ({trained}): its {key} is "
                    f"{tuple(theirs['shape'])}, the trained base's {tuple(ours.get('shape', []))}"), None
        if not same_fingerprint(ours.get("values", []), theirs["values"]):
            differ = sum(not same_fingerprint([x], [y]) for x, y in zip(ours.get("values", []), theirs["values"]))
            return (f"{label} is not the model {adapter} was trained on ({trained}): {differ} of "
                    f"{len(theirs['values'])} {key} values at fixed positions differ"), None
    return None, None


# --- an adapter's files, checked before they are used --------------------------------------------------------------
MAX_UNBOUNDED = 4  # repeats along one path of a target_modules pattern: Unsloth's GPT-OSS pattern has 4


def safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file's header, checked before a tensor is read: a regular file, then
    run_folder.safetensors_damage (every tensor's dtype known, its shape filling its bytes, the ranges tiling the data
    the file holds)."""
    import stat

    import run_folder

    try:
        info = os.stat(file)
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    return run_folder.safetensors_damage(file)


def target_modules_problem(targets) -> str | None:
    """Why PEFT must not be handed an adapter's target_modules (None: it may). A list is matched by name; a string is a
    regular expression PEFT runs with re.fullmatch against every module name, where a nested repeat such as (.|.)*Z
    backtracks for ever. Accepted: a plain name, "all-linear", or a pattern of the kind Unsloth writes (its
    get_peft_regex and the per-expert widening): repeats of single characters only, at most MAX_UNBOUNDED along any
    one path, no back-references."""
    if targets is None or (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        return None
    if not isinstance(targets, str):
        return f"target_modules is {type(targets).__name__}, neither a list of module names nor a pattern"
    if targets == "all-linear" or re.fullmatch(r"[\w.\-]+", targets):
        return None
    if len(targets) > 8192:
        return f"target_modules is a pattern of {len(targets)} characters, longer than any training writes"
    from re import _constants as c
    from re import _parser

    try:
        parsed = _parser.parse(targets)
    except re.error as error:
        return f"target_modules {targets[:60]!r} is not a regular expression ({error})"
    single = {c.LITERAL, c.NOT_LITERAL, c.ANY, c.IN, c.CATEGORY}
    repeats = {c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", c.MAX_REPEAT)}

    def depth(items) -> int:  # unbounded repeats along the costliest path; -1: refused
        total = 0
        for op, av in items:
            if op in repeats:
                low, high, body = av
                if len(body) != 1 or body[0][0] not in single:
                    return -1
                total += high > 1
            elif op is c.BRANCH:
                parts = [depth(b) for b in av[1]]
                if min(parts) < 0:
                    return -1
                total += max(parts)
            elif op is c.SUBPATTERN or op in (c.ASSERT, c.ASSERT_NOT):
                inner = depth(av[-1])
                if inner < 0:
                    return -1
                total += inner
            elif op in single or op is c.AT:
                continue
            else:  # back-references, conditionals, atomic groups: not what training writes
                return -1
        return total

    found = depth(parsed)
    if found < 0 or found > MAX_UNBOUNDED:
        return (f"target_modules is the pattern {targets[:60]!r}{'...' if len(targets) > 60 else ''}, not one training "
                "writes (a repeat of a group, or too many repeats: re.fullmatch on it may never end)")  # fmt: skip
    return None


def adapter_config_problem(folder: Path) -> tuple[dict | None, str | None]:
    """(adapter_config.json, None) when it can be handed to PEFT, else (None, why): read as a user's file, a LoRA rank
    and a finite alpha, a target_modules PEFT can match, and adapter_model.safetensors' header whole."""
    import math

    import user_files

    try:
        config = user_files.read_json(Path(folder) / "adapter_config.json", what="adapter_config.json")
    except user_files.FileRefused as error:
        return None, f"its adapter_config.json does not read ({str(error).rpartition(': ')[2] or error})"
    if not isinstance(config, dict):
        return None, "its adapter_config.json is not a record"
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if config.get("peft_type", "LORA") == "LORA":
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            return None, f"its adapter_config.json gives LoRA rank r = {rank!r}, not a positive whole number"
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
            return None, f"its adapter_config.json gives lora_alpha = {alpha!r}, not a finite number"
    problem = target_modules_problem(config.get("target_modules"))
    if problem:
        return None, f"its adapter_config.json: {problem}"
    weights = Path(folder) / "adapter_model.safetensors"
    if weights.exists():
        problem = safetensors_problem(weights)
        if problem:
            return None, f"{weights.name} is damaged ({problem})"
    return config, None


def adapter_weights_problem(folder: Path) -> str | None:
    """NaN or inf in adapter_model.safetensors (a run that diverged, a damaged file), read one tensor at a time after
    adapter_config_problem has checked its header; None when every value is finite."""
    from safetensors import safe_open

    weights = Path(folder) / "adapter_model.safetensors"
    try:
        with safe_open(str(weights), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                problem = non_finite_tensors({name: f.get_tensor(name)})
                if problem:
                    return f"{weights.name} holds {problem}: a run that diverged, or a damaged file"
    except Exception as error:  # noqa: BLE001 - a file that does not read: the user's to fix, in one line
        return f"{weights.name} does not read ({one_line(error, 200)})"
    return None


def non_finite_tensors(tensors: dict) -> str | None:
    """Which saved tensors hold NaN or inf, in a few words (None: every value is finite)."""
    import torch

    bad = {k: int((~torch.isfinite(t)).sum()) for k, t in tensors.items() if t.is_floating_point()}
    bad = {k: n for k, n in bad.items() if n}
    if not bad:
        return None
    first = sorted(bad)[0]
    return f"{sum(bad.values())} values NaN or infinite in {len(bad)} tensors ({first}: {bad[first]})"


# --- saving, and proving the save ------------------------------------------------------------------------------


def save_and_verify(trainer, tokenizer, *, save_method: str, verify: bool, use_peft: bool, backend: str,
                    prompt_inputs, seed: int, output_dir: Path, merge_base: str | None = None) -> bool:  # fmt: skip
    """LoRA adapters (and the tokenizer) to <output_dir>/final always. With `verify`, its tensors must equal the trained
    adapters exactly, and, loaded beside them as a second adapter of the same model, it must sample the same seeded
    tokens (verify_adapter: only the adapters held twice).

    merged_16bit: the trained model is released, and merge_2048.py merges final/ into `merge_base` (the 16-bit weights
    train_2048 found before training) in a process of its own, as it merges any saved adapter later: into
    final-merged_16bit, judged as merge_adapters says. mxfp4: Unsloth's own export (unsloth_mxfp4).

    Returns False when a check fails. Every process calls this (sharded models save together); the main writes.
    """
    from accelerate.utils import broadcast_object_list

    final = output_dir / "final"
    main = trainer.accelerator.is_main_process
    name = [fresh(final).name if main else None]
    broadcast_object_list(name)  # every process saves its part into the folder the main one made
    tmp = output_dir / name[0]
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(tmp))  # with train_2048_base.json (trainer.py's save_model)
    if not main:
        return True
    if written_by(final) is None and (final / "adapter_config.json").is_file() and not final.is_symlink():
        import user_files

        user_files.write_new(final / MARK, json.dumps({"by": "train_2048"}) + "\n")  # an older version's save
    try:
        publish(tmp, final, "train_2048")
    except NotOurs as error:
        log.error(f"{error}; the adapters are in {tmp}")
        return False
    log.info(f"saved the LoRA adapters and the tokenizer to {final}")
    model, ok = trainer.model, True
    trainer.optimizer = trainer.lr_scheduler = None  # room for the checks
    _empty_cuda_cache()
    if backend == "unsloth":
        from unsloth import FastLanguageModel

        FastLanguageModel.for_inference(model)
    if verify and use_peft:
        ok &= verify_adapter(model, tokenizer, final, prompt_inputs, seed)
    if save_method == "mxfp4":
        return ok & unsloth_mxfp4(model, tokenizer, output_dir / "final-mxfp4")
    if save_method == "merged_16bit":
        del model
        release(trainer)  # the merge loads the 16-bit base: a 20B model does not fit twice on one GPU
        return ok & merge_in_fresh_process(final, merge_base, output_dir / "final-merged_16bit")
    return ok


def unsloth_mxfp4(model, tokenizer, folder: Path) -> bool:
    """Unsloth's MXFP4 export (train_2048 refuses it at startup where Unsloth's llm-compressor cannot run). A quantized
    checkpoint is not base + adapters to the bit, so it is not judged here: evaluate_2048.py --model plays it."""
    tmp = fresh(folder)
    try:
        model.save_pretrained_merged(str(tmp), tokenizer, save_method="mxfp4")
        publish(tmp, folder, "train_2048")
    except Exception as error:  # noqa: BLE001 - after training, one line: final/ holds the adapters
        shutil.rmtree(tmp, ignore_errors=True)
        log.error(f"{folder}: Unsloth's mxfp4 save failed ({type(error).__name__}: "
                  f"{one_line(error, 400)}); final/ holds the adapters")  # fmt: skip
        log.debug("the mxfp4 save failed", exc_info=True)
        return False
    log.warning(f"saved {folder} (Unsloth's mxfp4 export, not checked: evaluate_2048.py --model {folder} plays it)")
    return True


def merge_in_fresh_process(adapter: Path, base: str, folder: Path) -> bool:
    """merge_2048.py on `adapter`, in a process of its own (transformers' own classes: Unsloth swaps GPT-OSS's expert
    classes process-wide), its lines on this console and in training.log. True for a correct merge."""
    logger = logging.getLogger("train_2048")
    logfile = next((h.baseFilename for h in logger.handlers if isinstance(h, logging.FileHandler)), None)
    for handler in logger.handlers:
        handler.flush()
    command = [sys.executable, str(Path(__file__).with_name("merge_2048.py")), "--adapter", str(adapter), "--base",
               str(base), "--output_dir", str(folder), "--overwrite_output_dir"]  # fmt: skip
    command += ["--log_file", logfile] if logfile else []
    result = subprocess.run(command, stderr=subprocess.PIPE, text=True)
    if result.returncode == 0 or (result.returncode == 1 and "Traceback" not in result.stderr):
        return result.returncode == 0  # its own line said how the merge went
    said = [line for line in result.stderr.splitlines() if line.strip()] or [f"exit status {result.returncode}"]
    log.error(f"{folder}: the merge failed ({said[-1][:400]}); final/ holds the adapters, and `python merge_2048.py "
              f"--adapter {adapter}` merges them later")  # fmt: skip
    return False


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _samples(model, tokenizer, prompt_inputs, seed: int, size: int = 4) -> list[list[int]]:
    """`size` seeded sampled completions (48 tokens at most), the way the evaluation samples."""
    import evaluation

    model.eval()
    return evaluation.sample_batch(model, tokenizer, prompt_inputs, index=0, size=size, seed=seed, temperature=1.0,
                                   max_new_tokens=48)  # fmt: skip


def verify_adapter(model, tokenizer, folder: Path, prompt_inputs, seed: int) -> bool:
    """The saved adapters are the trained ones: the same tensors, and loaded as a second adapter of the same model,
    the same seeded samples. Catches a save that drops or renames tensors (unsloth-zoo issue 885 dropped GPT-OSS's
    per-expert LoRA once), with only the adapters held twice."""
    import copy

    import torch
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(folder / "adapter_model.safetensors"))
    trained = {k: v.detach().to("cpu") for k, v in get_peft_model_state_dict(model).items()}
    if saved.keys() != trained.keys():
        lost, extra = sorted(trained.keys() - saved.keys()), sorted(saved.keys() - trained.keys())
        log.error(f"{folder}: the save lacks {len(lost)} trained tensors ({lost[:3]}) and has {len(extra)} others")
        return False
    differ = [k for k in trained if not torch.equal(trained[k], saved[k])]
    if differ:
        log.error(
            f"{folder}: {len(differ)} of {len(trained)} saved tensors differ from the trained ones ({differ[:3]})"
        )
        return False
    active = model.active_adapter
    expected = _samples(model, tokenizer, prompt_inputs, seed)
    try:
        model.add_adapter("saved", copy.deepcopy(model.peft_config[active]))
        loaded = set_peft_model_state_dict(model, saved, adapter_name="saved")
        model.set_adapter("saved")
        got = _samples(model, tokenizer, prompt_inputs, seed)
    except Exception as exc:  # a backend whose adapters cannot be doubled (untested on Unsloth's fused experts)
        log.warning(f"{folder}: its {len(saved)} tensors equal the trained ones, but it could not be loaded beside "
                    f"them to sample ({type(exc).__name__}: {exc})")  # fmt: skip
        return True
    finally:
        if "saved" in model.peft_config:
            model.set_adapter(active)
            model.delete_adapter("saved")
    if loaded.unexpected_keys or got != expected:
        log.error(f"{folder}: loaded as an adapter, it samples {sum(a != b for a, b in zip(expected, got))} of "
                  f"{len(got)} seeded completions differently ({len(loaded.unexpected_keys)} unexpected keys)")  # fmt: skip
        return False
    log.info(f"verified {folder}: its {len(saved)} tensors equal the trained adapters, and reloaded it samples the "
             f"same {len(got)} seeded completions")  # fmt: skip
    return True


def release(trainer) -> None:
    """Let go of the trained model, its optimizer and the accelerator's references, so that another model can be
    loaded alone (a 20B model does not fit twice on one GPU)."""
    import gc

    trainer.accelerator.free_memory()
    trainer.model = trainer.model_wrapped = trainer.callback_handler.model = None
    gc.collect()
    _empty_cuda_cache()


# --- merging adapters into their 16-bit base, and proving the merge ------------------------------------------------
# A merge writes round16(W + scale * B @ A). 16-bit weights cannot hold a LoRA change below half a weight's last digit
# (bf16 keeps 8 significant bits), so a real run's small adapters are partly rounded away by a correct merge: that is
# measured and reported, never failed. What fails is a merge that is not base + adapters: each merged weight is judged
# against the base weight the merge read plus the adapters' product computed here from the adapter's own files (not
# from the model PEFT built from them), so a LoRA that the loading or the merge lost, a wrong scale or a dropped module
# shows wherever its change crosses a rounding boundary, which some weights' changes do at any adapter size (the
# smallest weights have the finest 16-bit digits).
MERGED_SHARD = "5GB"  # the merged checkpoint's shards: transformers' default is 50GB, more than many uploads take
MERGE_SLACK = 2.0**-7  # of |scale| |B| |A|: PEFT rounds the product to 16 bits before adding it (fused experts)
SUM_SLACK = 2.0**-20  # of |W|: the float32 arithmetic of the sum



@dataclass
class Product:
    """One LoRA pair of an adapter, on one tensor of the merged model: scale * B @ A on a Linear's weight (out, in);
    on one expert's slice of a fused GPT-OSS expert tensor (Unsloth's split experts: a Linear per expert, whose weight
    is the transpose of its slice); or on every slice (PEFT's LoRA on the fused tensor, as attach_split_expert_lora
    lays it out: A (experts * r, in), B (out, r * experts))."""

    a: Any
    b: Any
    scale: float
    expert: int | None = None  # a split expert: the one slice it changes
    experts: int = 0  # a fused tensor: how many slices, each with its own rank-r pair

    def pair(self, expert: int | None, transposed: bool):
        """(A, B, whether the slice holds (B @ A).T) on a 2-D tensor (expert None) or on slice `expert` of a 3-D one;
        None where this pair changes nothing. `transposed`: the fused tensor is (experts, in, out), as GPT-OSS's."""
        if self.experts:
            rank = self.a.shape[0] // self.experts
            a = self.a.view(self.experts, rank, -1)[expert]
            return a, self.b.view(self.b.shape[0], rank, self.experts)[:, :, expert], transposed
        if self.expert is not None:
            return (self.a, self.b, True) if expert == self.expert else None
        return self.a, self.b, False


def merge_base(name: str) -> str:
    """The 16-bit checkpoint that adapters trained on `name` merge into, asked of its config.json (a local folder's, else
    the hub's, from the cache first): `name` itself when it is stored unquantized, its BF16 copy for the hub checkpoints
    of SIXTEEN_BIT_ORIGINAL; ValueError saying why there is none."""
    base = SIXTEEN_BIT_ORIGINAL.get(name, name)
    quantization = read_config(base).get("quantization_config") or {}
    if quantization.get("load_in_4bit"):
        raise ValueError(f"{base} is stored in 4-bit ({quantization.get('bnb_4bit_quant_type', 'bitsandbytes')}), and a "
                         "merge needs the 16-bit weights it was made from")  # fmt: skip
    if quantization:
        raise ValueError(f"{base} is stored quantized ({quantization.get('quant_method', 'unknown')}), and a merge needs "
                         "the 16-bit weights of the same model")  # fmt: skip
    return base


def read_config(name: str) -> dict:
    """A checkpoint's config.json: a local folder's, or the hub's (its cache first); ValueError when there is none."""
    local = Path(name).expanduser()
    if local.is_dir() or name.startswith((".", "/", "~")):
        path = local / "config.json"
    else:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            path = Path(hf_hub_download(name, "config.json"))
        except RepositoryNotFoundError as error:
            raise ValueError(f"{name}: no such model on the Hugging Face hub, and no such folder here") from error
        except Exception as error:  # offline (HF_HUB_OFFLINE) or no network, and not in the cache
            raise ValueError(f"{name} cannot be reached on the Hugging Face hub from here, and is not in its cache "
                             f"({one_line(error, 200)})") from error  # fmt: skip
    import user_files

    try:
        config = user_files.read_json(path, what="config.json")
    except user_files.FileRefused as error:
        raise ValueError(f"{name} is not a model folder (no readable config.json: {error})") from error
    if not isinstance(config, dict):
        raise ValueError(f"{name} is not a model folder (its config.json is not a record)")
    return config


def checkpoint_folder(name: str) -> Path:
    """A checkpoint's files here: a local folder as it is; a hub checkpoint's configuration, tokenizer and safetensors
    (top level only: the hub's GPT-OSS repos keep other formats in subfolders), downloaded unless cached."""
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"],
                                  ignore_patterns=["*/*"]))  # fmt: skip


def tensor_files(folder: Path) -> dict[str, Path]:
    """Each tensor of a safetensors checkpoint, and the shard that holds it."""
    from safetensors import safe_open

    import user_files

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = user_files.read_json(index, what="model.safetensors.index.json").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and "/" not in v for v in weight_map.values()):
            raise ValueError(f"{index}: its weight_map does not name shards of this folder")
        return {name: folder / shard for name, shard in weight_map.items()}
    files = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), shard))  # noqa: SIM118 (safe_open has keys(), no iteration)
    return files


def missing_weights(folder: Path, name: str) -> str | None:
    """Why the checkpoint `name` in `folder` has no weights here (None: every shard its index names is there): a hub
    snapshot cached in part (config.json alone, after a config look-up) is a folder without them."""
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            needed = sorted({p.name for p in tensor_files(folder).values()})
        except ValueError as error:
            return str(error)
        absent = [shard for shard in needed if not (folder / shard).is_file()]
        if absent:
            return (f"{name}: {len(absent)} of the {len(needed)} weight files its index names are not in {folder} "
                    f"({', '.join(absent[:3])}): download them, or run where the hub can be reached")  # fmt: skip
        return None
    if not shards:
        held = ", ".join(sorted(p.name for p in folder.iterdir())[:4]) or "nothing"
        return (f"{name}: its weights (*.safetensors) are not in {folder} (it holds {held}): a hub checkpoint cached in "
                "part; download it, or run where the hub can be reached")  # fmt: skip
    return None


def tensor_shapes(folder: Path) -> dict[str, tuple]:
    """Each tensor's shape, read from the shards' headers (nothing loaded)."""
    from safetensors import safe_open

    shapes, by_shard = {}, {}
    for name, shard in tensor_files(folder).items():
        by_shard.setdefault(shard, []).append(name)
    for shard, names in by_shard.items():
        with safe_open(str(shard), framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in names})
    return shapes


def adapter_products(folder: Path, shapes: dict[str, tuple]) -> tuple[dict[str, list[Product]], dict]:
    """What the adapter in `folder` adds to each tensor of a base with these tensor shapes, read from the adapter's own
    files: ({tensor: [Product]}, {tensor: its whole trained value} for modules trained in full, modules_to_save).
    ValueError for an adapter that does not fit the base, or that holds what merge_2048 does not merge."""
    import math

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config, problem = adapter_config_problem(folder)
    if problem:
        raise ValueError(f"{folder}: {problem}")
    try:
        saved = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError, SafetensorError) as error:  # a damaged or half-copied folder
        raise ValueError(f"{folder} does not read as an adapter ({one_line(error, 200)})") from error
    if not isinstance(config.get("r"), int) or "lora_alpha" not in config:
        raise ValueError(f"{folder}: adapter_config.json names no LoRA rank and alpha")
    problem = non_finite_tensors(saved)
    if problem:
        raise ValueError(f"{folder}: adapter_model.safetensors holds {problem}: a run that diverged, or a damaged file")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{folder} holds a {config.get('peft_type')} adapter, not LoRA")
    unsupported = {"use_dora": "DoRA", "rank_pattern": "ranks per module", "alpha_pattern": "alphas per module",
                   "lora_bias": "LoRA biases", "fan_in_fan_out": "Conv1D layers", "trainable_token_indices": "token rows"}  # fmt: skip
    for key, what in unsupported.items():
        if config.get(key):
            raise ValueError(f"{folder} uses {what} ({key}), which merge_2048 does not merge")
    layout = config.get("unsloth_fused_expert_lora", {}).get("lora_B_layout", config.get("lora_B_layout", "rank_major"))
    if layout != "rank_major":  # Unsloth's marker; PEFT (and this check) read B's columns rank-major only
        raise ValueError(f"{folder}: its fused experts' LoRA B is laid out {layout!r} (an older Unsloth's), which PEFT "
                         "reads as another adapter; merge it with that Unsloth's own save_pretrained_merged")  # fmt: skip
    if config.get("bias", "none") != "none":
        raise ValueError(f"{folder} trains biases (bias: {config['bias']}), which merge_2048 does not merge")
    rank = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    pairs, whole = {}, {}
    for key, tensor in saved.items():
        name = key.removeprefix("base_model.model.")
        found = re.fullmatch(r"(.*)\.lora_([AB])\.weight", name)
        if found:
            pairs.setdefault(found[1], {})[found[2]] = tensor.double()
        elif ".lora_" in name:
            raise ValueError(f"{folder}: {key} is a kind of LoRA tensor merge_2048 does not merge")
        elif shapes.get(name) != tuple(tensor.shape):
            raise ValueError(f"{folder}: {key} ({tuple(tensor.shape)}) fits no tensor of the base")
        else:
            whole[name] = tensor
    products = {}
    for module, pair in sorted(pairs.items()):
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.shape[0] != b.shape[1] or a.shape[0] % rank:
            raise ValueError(f"{folder}: the LoRA of {module} is not a pair of rank {rank}")
        split = SPLIT_EXPERT.match(module)
        if split:  # Unsloth's Linear per expert: its weight (out, in) is the fused slice (in, out) transposed
            name, index = f"{split['experts']}.{split['kind'][:-1]}", int(split["index"])
            fits = len(shapes.get(name, ())) == 3 and index < shapes[name][0] and shapes[name][1:] == (a.shape[1], b.shape[0])
            found = [Product(a, b, scale, expert=index)] if fits else []
            names = [name]
        elif a.shape[0] == rank:  # a Linear
            names = [f"{module}.weight"]
            found = [Product(a, b, scale)] if shapes.get(names[0]) == (b.shape[0], a.shape[1]) else []
        else:  # PEFT's LoRA on a fused expert tensor, named after its module (nested: experts.base_layer...)
            owner = re.sub(r"(\.base_layer)+$", "", module)
            names = [n for n, s in shapes.items() if n.rpartition(".")[0] == owner and len(s) == 3
                     and s[0] * rank == a.shape[0] and sorted(s[1:]) == sorted((a.shape[1], b.shape[0]))]  # fmt: skip
            found = [Product(a, b, scale, experts=shapes[names[0]][0])] if len(names) == 1 else []
        if not found:
            raise ValueError(f"{folder}: the LoRA of {module} fits no tensor of the base ({names[:2] or 'none named so'})")
        products.setdefault(names[0], []).extend(found)
    return products, whole


def merge_adapters(adapter: Path, base: Path, out: Path, products: dict, whole: dict, seed: int = 0) -> dict:
    """Merge the adapter in `adapter` into the 16-bit checkpoint in `base` and write the merged model to `out`, with the
    libraries' own code: transformers loads the base with its own classes, PEFT puts the adapters on it (a default
    run's split-expert LoRA through attach_split_expert_lora) and merges them (merge_and_unload). Then the merge is
    judged, and what 16 bits keep of the adapters is measured:

    - judge_weights: every tensor of the checkpoint against the base tensor read + the adapters' products
      (adapter_products), shard by shard, slice by slice. A wrong merge stops here;
    - distributions: the base with the adapters applied unmerged samples two seeded completions of the training
      prompt, and on them the merged checkpoint, reloaded with transformers' own classes (every tensor must load), is
      compared with it (KL, and kept_effect: the share of the adapters' effect it keeps) and the base with it (the
      adapters' own effect). In float32 arithmetic: in 16-bit arithmetic the unmerged and merged models round their
      activations differently, by more than a real run's adapters move them. Never against a model quantized
      otherwise (the 4-bit model a default run trained).

    Returns the report (merge_report.json): "wrong" lists why the checkpoint is not base + adapters (empty when the
    merge is correct). ValueError when the base does not load as a model of transformers' classes. On a GPU the
    float32 models may not fit: accelerate then keeps part of them in CPU memory."""
    import torch
    from transformers import AutoTokenizer

    source = adapter if (adapter / "tokenizer_config.json").is_file() else base
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as error:  # noqa: BLE001 - no tokenizer, or a damaged one: the user's to fix, in one line
        raise ValueError(f"{source} holds no tokenizer that loads ({type(error).__name__}: {one_line(error)})") from error
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model, dtype, transposed = _with_adapters(base, adapter, dtype="auto", gpu=torch.cuda.is_available())
    merged = model.merge_and_unload()
    dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16  # merged_16bit: 16 bits
    if merged.dtype != dtype:  # a float32 base (the CPU demo's)
        merged = merged.to(dtype)
    merged.save_pretrained(out, max_shard_size=MERGED_SHARD)
    tokenizer.save_pretrained(out)
    del model, merged
    _collect()
    weights = judge_weights(out, base, products, whole, transposed, dtype)
    report = {"adapter": str(adapter), "base": str(base), "dtype": str(dtype).removeprefix("torch."), **weights,
              "adapters_kl": None, "kl_to_unmerged": None, "kept_effect": None, "kept_effect_error": None}  # fmt: skip
    if report["wrong"]:
        return report
    room = _float32_room(base)
    if room is None:
        report["distributions"] = "not compared: the models do not fit in memory in float32"
        return report
    report["distributions"] = f"compared in float32 arithmetic, on the {room}"
    unmerged, _, _ = _with_adapters(base, adapter, dtype=torch.float32, gpu=room == "GPU")
    inputs = evaluation_prompt(tokenizer)
    start = inputs["input_ids"].shape[1]
    sequences = [inputs["input_ids"][0].tolist() + completion for completion in _samples(unmerged, tokenizer, inputs, seed, size=2)]
    trained = _logprobs(unmerged, sequences, start)
    with unmerged.disable_adapter():
        plain = _logprobs(unmerged, sequences, start)
    del unmerged
    _collect()
    reloaded, info = _load(out, torch.float32, gpu=room == "GPU")
    if any(info.values()):
        report["wrong"].append(f"it does not load as the base's model: {loading_problems(info)}")
        return report
    got = _logprobs(reloaded.eval(), sequences, start)
    del reloaded
    _collect()
    kept = kept_effect({"trained": trained, "base": plain}, got)
    report.update(adapters_kl=mean_kl(trained, plain), kl_to_unmerged=mean_kl(trained, got),
                  kept_effect=kept[0] if kept else None, kept_effect_error=kept[1] if kept else None,
                  positions=sum(len(s) - start for s in sequences))  # fmt: skip
    return report


def _load(folder: Path, dtype, gpu: bool):
    """(model, loading info) with transformers' own classes, on the GPUs or on the CPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="auto" if gpu else None,
                                                output_loading_info=True)  # fmt: skip


def _float32_room(base: Path) -> str | None:
    """Where the base fits in float32 (4 bytes a weight, and a tenth more): "GPU" (free memory, less a tenth),
    "CPU" (memory_available), or None. A 20B model takes 84 GB: more than an H100 has, less than its host."""
    import math

    import torch

    need = 4.4 * sum(math.prod(shape) for shape in tensor_shapes(base).values())
    if torch.cuda.is_available():
        free = sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
        if 0.9 * free > need:
            return "GPU"
    available = memory_available()
    return "CPU" if available is None or available > need else None


def memory_available(root: Path = Path("/")) -> int | None:
    """Bytes this process can still take: the least of /proc/meminfo's MemAvailable and its cgroup's room (v2:
    memory.max - memory.current; v1: memory.limit_in_bytes - memory.usage_in_bytes), which a container's limit sets and
    MemAvailable does not show. None when none of them can be read (not Linux)."""
    import user_files

    def number(path: str) -> int | None:
        try:
            text = user_files.read_text(root / path, 1 << 16, "memory figure").strip()
        except user_files.FileRefused:
            return None
        return int(text) if text.isdigit() else None  # "max": no limit

    room = []
    try:
        meminfo = user_files.read_text(root / "proc/meminfo", 1 << 20, "/proc/meminfo")
        fields = dict(line.split(":", 1) for line in meminfo.splitlines() if ":" in line)
        room.append(int(fields["MemAvailable"].split()[0]) * 1024)
    except (user_files.FileRefused, KeyError, ValueError, IndexError):
        pass
    for limit, usage in (("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory.current"),
                         ("sys/fs/cgroup/memory/memory.limit_in_bytes", "sys/fs/cgroup/memory/memory.usage_in_bytes")):  # fmt: skip
        cap, used = number(limit), number(usage)
        if cap is not None and used is not None and cap < 1 << 60:  # v1 writes "no limit" as a huge number
            room.append(max(0, cap - used))
    return min(room) if room else None


def _with_adapters(base: Path, adapter: Path, dtype, gpu: bool):
    """(the base with the adapters on it, the base's dtype, the fused expert modules laid out (experts, in, out)).
    ValueError when the base does not load as a model of transformers' own classes."""
    from peft import PeftModel

    try:
        model, info = _load(base, dtype, gpu)
    except Exception as error:  # noqa: BLE001 - a damaged or foreign checkpoint: the user's to fix, in one line
        raise ValueError(f"{base} does not load ({type(error).__name__}: {one_line(error)})") from error
    if info["missing_keys"] or info["mismatched_keys"]:
        raise ValueError(f"{base} does not load with transformers' own classes: {loading_problems(info)}")
    transposed = {name for name, module in model.named_modules() if getattr(module, "is_transposed", False)}
    base_dtype = model.dtype
    if split_expert_lora(adapter):
        return attach_split_expert_lora(model, adapter), base_dtype, transposed
    return PeftModel.from_pretrained(model, str(adapter)), base_dtype, transposed


def evaluation_prompt(tokenizer):
    """The training prompt, with the default game settings, as model inputs (what the distributions are compared on)."""
    import evaluation
    import rewards

    return evaluation.prompt_inputs(tokenizer, rewards.RewardSettings(), {"reasoning_effort": "low"})


def _collect() -> None:
    import gc

    gc.collect()
    _empty_cuda_cache()


def one_line(error: BaseException, limit: int = 300) -> str:
    return " ".join(str(error).split())[:limit]


def loading_problems(info: dict) -> str:
    """from_pretrained's loading info in a few words: what is missing, unexpected or mismatched."""
    kinds = ("missing_keys", "unexpected_keys", "mismatched_keys")
    return "; ".join(f"{len(info[k])} {k.replace('_', ' ')} ({sorted(map(str, info[k]))[:3]})" for k in kinds if info.get(k))


def judge_weights(merged: Path, base: Path, products: dict, whole: dict, transposed: set[str], dtype=None) -> dict:
    """Every tensor of the merged checkpoint against the base's, one shard and one slice at a time (a 20B model's
    expert tensors are 16 GB in float64): the base's own where no adapter reaches, else base + the adapters' products
    rounded as a 16-bit merge must round: within the two 16-bit neighbours of the exact sum, give or take the
    arithmetic the merge may do in 16 or 32 bits (MERGE_SLACK, SUM_SLACK). Also measured: how much of the adapters'
    change the 16-bit weights keep (the merged change projected on the adapters' own, over every weight they reach),
    and how many weights they change that stay the base's in 16 bits.

    Every base tensor must be there, of the base's shape, and of the base's dtype, the merge's 16-bit `dtype`, or
    float32 (transformers keeps GPT-OSS's norms in float32, which holds every 16-bit value): a checkpoint missing one
    loads with that tensor random, and is wrong whatever else is compared. A merged weight that is NaN or infinite
    where base + adapters is finite is wrong (every comparison with NaN is false)."""
    import contextlib

    import torch
    from safetensors import safe_open

    device = "cuda" if torch.cuda.is_available() else "cpu"
    base_files, merged_files = tensor_files(base), tensor_files(merged)
    wrong = [f"{name} is missing" for name in sorted((products.keys() | whole.keys() | base_files.keys())
                                                     - merged_files.keys())]  # fmt: skip
    wrong += [f"{name} is not in the base" for name in sorted(merged_files.keys() - base_files.keys())]
    totals = dict.fromkeys(("along", "norm", "changed", "rounded_away"), 0)
    with contextlib.ExitStack() as stack:
        opened = {}

        def tensor(path: Path, name: str):
            if path not in opened:
                opened[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            return opened[path].get_tensor(name)

        for name in sorted(merged_files.keys() & base_files.keys(), key=lambda n: (str(merged_files[n]), n)):
            got, was = tensor(merged_files[name], name), tensor(base_files[name], name)
            if got.shape != was.shape:
                wrong.append(f"{name} is {tuple(got.shape)}, the base's {tuple(was.shape)}")
                continue
            if got.dtype not in {was.dtype, dtype or was.dtype, torch.float32} or (
                    got.is_floating_point() != was.is_floating_point()):  # fmt: skip
                wrong.append(f"{name} is {str(got.dtype).removeprefix('torch.')}, the base's "
                             f"{str(was.dtype).removeprefix('torch.')}")  # fmt: skip
                continue
            if name not in products and name not in whole:
                same = got == was.to(got.dtype)
                if got.is_floating_point():
                    same |= got.isnan() & was.to(got.dtype).isnan()
                differ = int((~same).sum())
                if differ:
                    wrong.append(f"{name}: {differ} of {got.numel()} weights differ from the base's, and no adapter "
                                 "changes it")  # fmt: skip
                continue
            owner = name.rpartition(".")[0]
            bad = 0
            for expert, rows in _slices(got.shape):
                part = _judge_slice(got, was, products.get(name, []), whole.get(name), expert, rows,
                                    owner in transposed, device)  # fmt: skip
                bad += part.pop("bad")
                for key, value in part.items():
                    totals[key] += value
            if bad:
                dtype = str(got.dtype).removeprefix("torch.")
                wrong.append(f"{name}: {bad} of {got.numel()} weights are not base + adapters rounded to {dtype}")
    checked = len(merged_files.keys() & base_files.keys())
    kept = totals["along"] / totals["norm"] if totals["norm"] else None
    return {"wrong": wrong, "tensors": checked, "adapted_tensors": len(products.keys() | whole.keys()), "kept": kept,
            "changed_weights": totals["changed"], "rounded_away": totals["rounded_away"]}  # fmt: skip


def _slices(shape: tuple):
    """(expert or None, rows) pieces of a tensor of up to 2**24 elements: per expert, then per block of rows."""
    experts = shape[0] if len(shape) == 3 else None
    rows = shape[-2] if len(shape) >= 2 else 1
    step = max(1, 2**24 // (shape[-1] if len(shape) >= 2 else max(1, shape[0])))
    for expert in range(experts) if experts is not None else [None]:
        for start in range(0, rows, step):
            yield expert, slice(start, start + step)


def _judge_slice(got, was, products: list[Product], whole, expert, rows, transposed: bool, device) -> dict:
    import torch

    pick = (lambda t: t[expert][rows]) if expert is not None else (lambda t: t[rows] if t.dim() > 1 else t)
    merged, base = pick(got).to(device), pick(was).to(device, torch.float64)
    if whole is not None:  # a module trained in full: its merged value is its own, in 16 bits
        exact = pick(whole).to(device, torch.float64)
        delta, bound = exact - base, torch.zeros_like(base)
    else:
        delta, bound = torch.zeros_like(base), torch.zeros_like(base)
        for product in products:
            pair = product.pair(expert, transposed)
            if pair is None:
                continue
            a, b, flipped = (t.to(device) if torch.is_tensor(t) else t for t in pair)
            if flipped:  # the slice holds (B @ A).T: its rows are A's columns
                delta += product.scale * (a[:, rows].T @ b.T)
                bound += abs(product.scale) * (a[:, rows].abs().T @ b.abs().T)
            else:
                delta += product.scale * (b[rows] @ a)
                bound += abs(product.scale) * (b[rows].abs() @ a.abs())
        exact = base + delta
    slack = MERGE_SLACK * bound + SUM_SLACK * base.abs()
    low, high = (exact - slack).to(merged.dtype), (exact + slack).to(merged.dtype)
    plain = pick(was).to(device, merged.dtype)  # the base in 16 bits
    moved = merged.double() - plain.double()
    changed = delta != 0
    broken = ~torch.isfinite(merged) & torch.isfinite(exact)  # NaN passes both comparisons below
    return {"bad": int(((merged < low) | (merged > high) | broken).sum()), "along": float((moved * delta).sum()),
            "norm": float((delta * delta).sum()), "changed": int(changed.sum()),
            "rounded_away": int((changed & (merged == plain)).sum())}  # fmt: skip


def _logprobs(model, sequences: list[list[int]], start: int) -> list:
    """Log-softmax of the next-token logits at positions start-1 .. end-2 of each sequence, on the CPU, in float64 (the
    KL between models that differ by a real run's adapters is below float32's resolution of a log-probability)."""
    import torch

    device = next(p for p in model.parameters() if p.device.type != "meta").device
    out = []
    with torch.no_grad():
        for ids in sequences:
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, start - 1 : len(ids) - 1]
            out.append(torch.log_softmax(logits.double(), dim=-1).cpu())
    return out


def mean_kl(reference: list, other: list) -> float:
    """Mean KL(reference || other) per position, in nats."""
    total = sum(float((p.exp() * (p - q)).sum()) for p, q in zip(reference, other))
    return total / max(1, sum(p.shape[0] for p in reference))


def kept_effect(reference: dict, saved: list) -> tuple[float, float] | None:
    """(share, its standard error) of the adapters' effect a merged model keeps, or None when the adapters change
    nothing at all. Per position, with the unmerged model's probabilities p as weights: the adapters' shift d =
    trained - base and the merged one m = saved - base (log-probabilities, each centred on its p-mean), share =
    sum <m, d>_p / sum <d, d>_p over positions; the error from how the positions' own ratios scatter around it."""
    import torch

    along, norms = [], []
    for trained, base, merged in zip(reference["trained"], reference["base"], saved):
        p = trained.double().exp()
        d, m = (trained - base).double(), (merged - base).double()
        d = d - (p * d).sum(-1, keepdim=True)
        m = m - (p * m).sum(-1, keepdim=True)
        along.append((p * m * d).sum(-1))
        norms.append((p * d * d).sum(-1))
    along, norms = torch.cat(along), torch.cat(norms)
    total = float(norms.sum())
    if total == 0.0:
        return None
    share = float(along.sum()) / total
    return share, float((along - share * norms).pow(2).sum().sqrt()) / total
