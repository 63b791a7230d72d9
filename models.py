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
from pathlib import Path

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
# A merged checkpoint is the trained model when (1) its next-token distributions are within MERGED_KL_TOLERANCE (mean KL,
# nats per token) of the trained model's, and (2) it keeps the adapters' own effect, however small: of how far the
# adapters move each distribution from the base's, the share the merge reproduces (the merged model's log-probability
# shift from the base, projected on the adapters' shift, weighted by the trained probabilities) must be within
# MERGED_KEPT, its 2-sigma interval included. A merge that lost the LoRA keeps ~0 of it, one that lost the experts'
# LoRA (unsloth-zoo issue 885) a part; 16-bit rounding of a true merge scatters around 1 and averages out over the
# vocabulary and positions (docs/PERF.md gives the tiny model's figures; 4-bit to 16-bit is measured on a GPU).
MERGED_KL_TOLERANCE = 0.01
MERGED_KEPT = (0.8, 1.2)


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


def fresh(path: Path) -> Path:
    """An empty temporary sibling of `path` to write into; publish() moves it into place when complete."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def publish(tmp: Path, path: Path) -> None:
    """Swap a fully written folder in for `path`, so `path` is never half-written."""
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def build_tiny_model(path: Path, corpus: list[str], seed: int) -> Path:
    """The CPU demo's model: a 2-layer, 128-wide Llama and a 600-token BPE trained on the demo's prompt and
    answers, saved like a hub checkpoint so it loads through the same from_pretrained call as a real one.

    Pre-tokens are whole lines, so merges span spaces and an answer is a few dozen tokens. Built once per
    output directory (a resume reuses it), in a temporary folder renamed at the end.
    """
    if (path / "config.json").exists():
        return path
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
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    publish(tmp, path)
    return path


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
        try:
            base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError):
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
    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    targets = config.get("target_modules") or []
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

    config = json.loads((folder / "adapter_config.json").read_text())
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


# --- saving, and proving the save ------------------------------------------------------------------------------


def save_and_verify(trainer, tokenizer, *, save_method: str, verify: bool, use_peft: bool, backend: str,
                    prompt_inputs, seed: int, output_dir: Path) -> bool:  # fmt: skip
    """LoRA adapters (and the tokenizer) to <output_dir>/final always; a merged 16-bit model to final-merged_16bit on
    request. With `verify`, each save is checked against the trained model without a second copy of the base:

    - final/: its tensors must equal the trained adapters exactly, and, loaded beside them as a second adapter of
      the same model, it must sample the same seeded tokens;
    - final-merged_16bit/ on transformers (merged in memory): every saved tensor must equal the merged model's, read
      shard by shard;
    - final-merged_16bit/ on Unsloth (merged by Unsloth straight to disk, from 4-bit or 16-bit weights): the trained
      model's next-token distributions on its own seeded samples are taken first, the trained model is released, and
      a fresh process loads the checkpoint with transformers' own classes (Unsloth swaps GPT-OSS's expert classes
      process-wide): every tensor must load, its distributions must be within MERGED_KL_TOLERANCE, and it must
      keep the adapters' effect (MERGED_KEPT).

    Returns False when a check fails. Every process calls this (sharded models save together); the main writes.
    """
    final = output_dir / "final"
    main = trainer.accelerator.is_main_process
    tmp = fresh(final) if main else final.with_name("final.tmp")
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(tmp))
    if not main:
        return True
    publish(tmp, final)
    log.info(f"saved the LoRA adapters and the tokenizer to {final}")
    model, ok = trainer.model, True
    trainer.optimizer = trainer.lr_scheduler = None  # room for the checks
    _empty_cuda_cache()
    if backend == "unsloth":
        from unsloth import FastLanguageModel

        FastLanguageModel.for_inference(model)
    if verify and use_peft:
        ok &= verify_adapter(model, tokenizer, final, prompt_inputs, seed)
    if save_method == "lora":
        return ok
    merged_dir = output_dir / f"final-{save_method}"
    tmp = fresh(merged_dir)
    if backend == "unsloth":
        reference = reference_logprobs(model, tokenizer, prompt_inputs, seed) if verify else None
        try:
            model.save_pretrained_merged(str(tmp), tokenizer, save_method=save_method)
        except Exception as error:  # noqa: BLE001 - train_2048 checks the merge's source at startup; anything else
            log.error(f"{merged_dir}: Unsloth's {save_method} save failed ({type(error).__name__}: "
                      f"{' '.join(str(error).split())[:400]}); final/ holds the adapters")  # fmt: skip
            log.debug("the merged save failed", exc_info=True)
            return False
        publish(tmp, merged_dir)
        log.info(f"saved the merged model ({save_method}) to {merged_dir}")
        if verify:
            del model
            release(trainer)
            ok &= verify_merged(merged_dir, reference)
        return ok
    import torch

    merged = model.merge_and_unload() if use_peft else model  # in place: no second copy
    if merged.dtype == torch.float32:
        merged = merged.to(torch.bfloat16)  # merged_16bit: 16-bit weights, also from a float32 CPU run
    merged.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    publish(tmp, merged_dir)
    log.info(f"saved the merged model ({save_method}) to {merged_dir}")
    return ok & verify_tensors(merged, merged_dir) if verify else ok


def unsloth_merge_source(model_name: str, load_in_4bit: bool) -> str:
    """The 16-bit weights Unsloth's merged_16bit save merges the LoRA into, found as it finds them at save time
    (unsloth_zoo/saving_utils.py, merge_and_overwrite_lora and determine_base_model_source), or ValueError with why
    the save would fail after training.

    The loaded checkpoint's name maps to its 16-bit original (get_model_name: the default's
    unsloth/gpt-oss-20b-unsloth-bnb-4bit to unsloth/gpt-oss-20b). A local folder is used as it is, and Unsloth
    refuses one stored in 4-bit (nf4/fp4: "base model should be a 16bit or mxfp4 base model"). A hub name is looked
    up on the hub at save time, and its weights read from there (or the cache): Unsloth's own lookup, asked now."""
    from unsloth.models.loader_utils import get_model_name
    from unsloth_zoo.saving_utils import (
        check_hf_model_exists,
        check_local_model_exists,
        check_model_quantization_status,
    )

    local = Path(model_name).expanduser()
    if not local.is_dir():
        original = get_model_name(get_model_name(model_name, load_in_4bit=load_in_4bit), load_in_4bit=False)
        local = Path(check_local_model_exists(original) or original)  # a folder of that name here comes first
    if local.is_dir():
        try:
            _, quantization = check_model_quantization_status(str(local))
        except RuntimeError as error:  # an unreadable config.json
            raise ValueError(" ".join(str(error).split())[:300]) from error
        if quantization in ("nf4", "fp4"):
            raise ValueError(f"{model_name} is stored in 4-bit ({quantization}), and Unsloth merges LoRA into 16-bit "
                             "(or mxfp4) weights only")  # fmt: skip
        return f"{local}'s own weights (a local 16-bit checkpoint)"
    try:
        found = check_hf_model_exists(original)
    except RuntimeError as error:  # unreachable: offline (HF_HUB_OFFLINE) or no network
        raise ValueError(f"Unsloth merges into {original}'s 16-bit weights, looked up on the Hugging Face hub at save "
                         f"time, and the hub cannot be reached from here ({' '.join(str(error).split())[:200]})") from error
    if not found:
        raise ValueError(f"Unsloth merges into {original}'s 16-bit weights, and the hub has no safetensors for it")
    return f"{original}'s 16-bit weights on the Hugging Face hub (downloaded at save time unless cached)"


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _samples(model, tokenizer, prompt_inputs, seed: int) -> list[list[int]]:
    """Four seeded sampled completions (48 tokens at most), the way the evaluation samples."""
    import evaluation

    model.eval()
    return evaluation.sample_batch(model, tokenizer, prompt_inputs, index=0, size=4, seed=seed, temperature=1.0,
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


def verify_tensors(model, folder: Path) -> bool:
    """Every tensor saved in `folder` equals the model's own, read one at a time from the memory-mapped shards."""
    import torch
    from safetensors import safe_open

    expected = model.state_dict()
    checked, differ, unknown = 0, [], []
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                if name not in expected:
                    unknown.append(name)
                    continue
                checked += 1
                if not torch.equal(f.get_tensor(name), expected[name].detach().to("cpu")):
                    differ.append(name)
    if differ or not checked:
        log.error(f"{folder}: {len(differ)} of {checked} saved tensors differ from the merged model ({differ[:3]})")
        return False
    note = f" ({len(unknown)} saved under names the model does not use)" if unknown else ""
    log.info(f"verified {folder}: its {checked} tensors equal the merged model's, exactly{note}")
    return True


def release(trainer) -> None:
    """Let go of the trained model, its optimizer and the accelerator's references, so a saved copy can be loaded
    alone (a 20B model does not fit twice on one GPU)."""
    import gc

    trainer.accelerator.free_memory()
    trainer.model = trainer.model_wrapped = trainer.callback_handler.model = None
    gc.collect()
    _empty_cuda_cache()


# --- a merged checkpoint, checked in a fresh process ---------------------------------------------------------------


def reference_logprobs(model, tokenizer, prompt_inputs, seed: int, rows: int = 2) -> dict:
    """What a merged checkpoint is checked against: the trained model's log-probabilities at every position of its own
    seeded completions, and the same with the adapters switched off (how far the LoRA moves them), on the CPU."""
    import torch

    prompt = prompt_inputs["input_ids"][0].tolist()
    sequences = [prompt + completion for completion in _samples(model, tokenizer, prompt_inputs, seed)[:rows]]
    trained = _logprobs(model, sequences, len(prompt))
    with model.disable_adapter() if hasattr(model, "disable_adapter") else torch.no_grad():
        base = _logprobs(model, sequences, len(prompt))
    return {"sequences": sequences, "start": len(prompt), "trained": trained, "base": base}


def _logprobs(model, sequences: list[list[int]], start: int) -> list:
    """Log-softmax of the next-token logits at positions start-1 .. end-2 of each sequence (float32, on the CPU)."""
    import torch

    device = next(p for p in model.parameters() if p.device.type != "meta").device
    out = []
    with torch.no_grad():
        for ids in sequences:
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, start - 1 : len(ids) - 1]
            out.append(torch.log_softmax(logits.float(), dim=-1).cpu())
    return out


def mean_kl(reference: list, other: list) -> float:
    """Mean KL(reference || other) per position, in nats."""
    total = sum(float((p.exp() * (p - q)).sum()) for p, q in zip(reference, other))
    return total / max(1, sum(p.shape[0] for p in reference))


def kept_effect(reference: dict, saved: list) -> tuple[float, float] | None:
    """(share, its standard error) of the adapters' effect a merged model keeps, or None when the adapters change
    nothing at all. Per position, with the trained probabilities p as weights: the adapters' shift d = trained - base
    and the merged one m = saved - base (log-probabilities, each centred on its p-mean), share = sum <m, d>_p / sum
    <d, d>_p over positions; the error from how the positions' own ratios scatter around it."""
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


def verify_merged(folder: Path, reference: dict) -> bool:
    """Load `folder` alone in a fresh process with transformers' own classes (not Unsloth's, which replace GPT-OSS's
    experts process-wide and cannot load a fused checkpoint) and compare its distributions with the trained model's.
    Fails when a tensor is missing or unexpected, when the mean KL exceeds MERGED_KL_TOLERANCE, or when the share of
    the adapters' effect it keeps is not within MERGED_KEPT (or cannot be told to be)."""
    import torch

    with tempfile.TemporaryDirectory(prefix="verify-merged-") as scratch:
        asked, answered = Path(scratch) / "sequences.pt", Path(scratch) / "logprobs.pt"
        torch.save({"sequences": reference["sequences"], "start": reference["start"]}, asked)
        result = subprocess.run([sys.executable, __file__, "merged-logprobs", str(folder), str(asked), str(answered)],
                                capture_output=True, text=True)  # fmt: skip
        if result.returncode != 0:
            why = (result.stdout + result.stderr).strip().splitlines() or [f"exit status {result.returncode}"]
            log.error(f"{folder}: the merged checkpoint does not load as the trained model: {why[-1]}")
            return False
        saved = torch.load(answered)
    kl_saved, kl_base = mean_kl(reference["trained"], saved), mean_kl(reference["trained"], reference["base"])
    kept = kept_effect(reference, saved)
    numbers = (f"KL from the trained model {kl_saved:.2g} nats/token (tolerance {MERGED_KL_TOLERANCE:g}); the "
               f"adapters move the base by {kl_base:.2g}")  # fmt: skip
    if kept is not None:
        numbers += f", and it keeps {kept[0]:.3f} ± {kept[1]:.3f} of that (needed: {MERGED_KEPT[0]:g}-{MERGED_KEPT[1]:g})"
    if kl_saved > MERGED_KL_TOLERANCE:
        log.error(f"{folder}: reloaded alone, it is not the trained model: {numbers}")
        return False
    if kept is None:  # trained == base to the bit: LoRA B still zero (no reward spread, no gradient): nothing to keep
        log.warning(f"{folder}: reloaded alone, it is within tolerance of the trained model ({numbers}), but the "
                    "adapters do not change the model at all, so there is nothing the merge could have lost")  # fmt: skip
        return True
    share, error = kept
    if MERGED_KEPT[0] <= share - 2 * error and share + 2 * error <= MERGED_KEPT[1]:
        log.info(f"verified {folder}: every tensor loads in a fresh process, and it is the trained model: {numbers}")
        return True
    if share + 2 * error < MERGED_KEPT[0]:
        why = ("it lost part of the adapters' effect (a LoRA left out, or LoRA changes below a 16-bit weight's last "
               "digit, which rounding erases)")  # fmt: skip
    elif share - 2 * error > MERGED_KEPT[1]:
        why = "it adds more than the adapters' effect"
    else:
        why = "the share of the adapters' effect it keeps is too uncertain to vouch for"
    log.error(f"{folder}: reloaded alone, it is not shown to be the trained model, {why}: {numbers}; final/ holds the "
              "verified adapters")  # fmt: skip
    return False


def _merged_logprobs_main(folder: str, asked: str, answered: str) -> int:
    """The fresh process of verify_merged: load, refuse a checkpoint with missing or unexpected tensors, answer."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device_map = {"": 0} if torch.cuda.is_available() else None
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype="auto", device_map=device_map,
                                                       output_loading_info=True)  # fmt: skip
    problems = {kind: info.get(kind) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(problems.values()):
        print("; ".join(f"{len(v)} {k.replace('_', ' ')} ({sorted(map(str, v))[:3]})" for k, v in problems.items() if v))
        return 1
    request = torch.load(asked)
    torch.save(_logprobs(model.eval(), request["sequences"], request["start"]), answered)
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["merged-logprobs"]:
    sys.exit(_merged_logprobs_main(*sys.argv[2:5]))
