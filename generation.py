"""Fast sampling for GRPO: a drop-in for the `model.generate(...)` call TRL makes, built for GPT-OSS with LoRA.

Why (issue 14): on an H100, a decode step of GPT-OSS-20B takes 46.5 ms at batch 8 and batch 32 costs only twice
that: the GPU mostly waits for Python. In transformers 5.17, per decode step and layer,
  - the default ("eager") experts loop in Python over the experts hit, with a host sync (`nonzero`) per layer
    (models/gpt_oss/modeling_gpt_oss.py:90-112);
  - PEFT LoRA on the fused experts (`target_parameters`) registers a parametrization at every forward and
    materialises W + scale * A @ B for all 32 experts, for both tensors (peft/tuners/lora/layer.py:2571-2601,
    `ParamWrapper._activate_lora`; `_LoraFactorsProxy`, 2305-2323): the whole expert stack is rewritten per token;
  - nothing is compiled: TRL passes `disable_compile=True` (trl/trainer/grpo_trainer.py:1120), honoured first by
    `_valid_auto_compile_criteria` (transformers/generation/utils.py:2256-2258).
transformers does have a switch, `@use_experts_implementation` (integrations/moe.py:526-585, dispatched per call on
`config._experts_implementation`, 572; "batched_mm", "grouped_mm" at 487-492), and `grouped_mm_experts_forward`
(377-481) has no host sync ("histc instead of bincount to avoid cuda graph issues", 398-399). But the experts it
dispatches to still read the weight through PEFT's parametrization, a module mutation inside the forward that
neither a full graph nor a CUDA graph can hold; and generate swaps grouped_mm for batched_mm during decode
(generation/utils.py:2313-2335), which gathers a full weight matrix per (token, expert) pair (~33 MB each at 20B).

So the decode step is ours, and only the decode step (`_decode_step`). It calls the model's own submodules (norms,
q/k/v/o projections with their PEFT LoRA wrappers, rotary embedding, router, lm_head) and does two things itself:
  - attention over a static KV cache of our own (fixed shapes, written with index_copy_ at a column given as a
    tensor), with GPT-OSS's sinks and sliding windows as `eager_attention_forward` (modeling_gpt_oss.py:235-263)
    and the mask rule `kv > q - window` (masking_utils.py:93-102) have them;
  - the experts from the fused tensors, LoRA as two thin matmuls per (token, expert) pair from PEFT's own factors
    (`get_delta_factors`), nothing merged: "grouped" (pairs sorted by expert, one `grouped_mm` per projection, each
    hit expert read once: the recipe of grouped_mm_experts_forward) for bf16 on CUDA, else "dense" (every expert on
    every row, one bmm; any dtype). torch compiles `_grouped_mm` for bf16 only (integrations/moe.py:276).
No data-dependent Python, no host sync: on CUDA the step is compiled with `fullgraph=True`, mode "reduce-overhead"
(CUDA graphs): transformers' own recipe for StaticCache generation, whose cache tensors are `mark_static_address`ed
so that graphs may write them (cache_utils.py:445-453); ours are too, and kept between calls (grow-only, rounded
up) so that graphs are neither recompiled nor re-recorded. If compiling fails, the same step runs uncompiled.

Everything else is transformers' own, so tokens match `model.generate`: the prefill is the model's forward with a
DynamicCache, copied into ours (sliding layers keep their last window-1 tokens, cache_utils.py:253-256); the config
is merged with the model's defaults by `_prepare_generation_config`; the logits processors (temperature -> top_k ->
top_p -> min_p; repetition penalty) come from `_get_logits_processor` (generation/utils.py:1252-1480); then softmax
and torch.multinomial, or argmax, as `_sample` does (generation/utils.py:3024-3086). Same logits and seed: same
tokens. Anything else (beams, other processors, stop strings, outputs beyond ids, other architectures) goes to
`model.generate`, with one warning per process; so does any failure of the fast path.

Before first use, a self-check compares one decode step with the model's own forward: a forward patched in a way
this step does not reproduce (Unsloth's, say: untested here) leaves the model to `model.generate`.

Switches: FAST_GENERATE=0 turns the fast path off; FAST_GENERATE_COMPILE=auto|none|reduce-overhead|default|
cudagraphs|eager|aot_eager (auto: reduce-overhead on CUDA, none elsewhere); FAST_GENERATE_EXPERTS=auto|grouped|dense.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import weakref
from dataclasses import dataclass, field

import torch

log = logging.getLogger("train_2048.generation")

FAMILIES = ("gpt_oss", "llama")  # architectures whose decoder layer `_decode_step` reproduces (tested)
STOP_CHECK_EVERY = 4  # decode steps between two host syncs asking "has every row finished?"
CACHE_ROUNDING = 256  # cache length granularity: fewer shapes, fewer recompiles and graph recordings
# transformers model -> its _Plan, or the reason it has none (weak keys: a released model is not kept alive)
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WARNED: set[str] = set()
_LAST_PATH = ""  # last_path()
_LAST_COMPILED = False  # last_step_compiled()


@dataclass
class _Layer:
    """One decoder layer, as the decode step needs it."""

    input_norm: torch.nn.Module
    attn: torch.nn.Module
    post_norm: torch.nn.Module
    mlp: torch.nn.Module
    rotary_fn: object  # the architecture's apply_rotary_pos_emb
    window: int | None  # sliding window, None for full attention
    sinks: bool  # GPT-OSS attention sinks
    router: torch.nn.Module | None = None  # set when the experts are fused tensors we compute ourselves
    experts: torch.nn.Module | None = None  # the base experts module (under any PEFT ParamWrappers)
    experts_lora: list = field(default_factory=list)  # the PEFT ParamWrappers around it


@dataclass
class _Cache:
    """Our static KV cache: keys/values (batch, kv_heads, capacity, head_dim) per layer, and which columns are real."""

    keys: list
    values: list
    valid: torch.Tensor  # (batch, capacity) bool: prompt columns from the attention mask, generated ones True


@dataclass
class _Plan:
    base: weakref.ref  # the transformers model (under PEFT, the LoRA-injected one); weak: _PLANS must not pin it
    layers: list
    embed: torch.nn.Module
    rotary: torch.nn.Module
    norm: torch.nn.Module
    lm_head: torch.nn.Module
    device: torch.device
    experts_kernel: str  # "grouped" or "dense" (ours, on fused experts), or "module" (the model's own MLP: split experts)
    compile_mode: str
    dropouts: list
    checkpointing: list  # modules with a gradient_checkpointing switch (the decoder and its layers)
    accepts_position_ids: bool
    logits_to_keep: bool
    modules: tuple = ()  # the module tree it was built from: PEFT injecting adapters later makes it stale
    checked: bool = False
    compiled: object = None
    compile_failed: bool = False
    traced: list = field(default_factory=lambda: [False])  # set from inside the step while Dynamo runs it
    cache: _Cache | None = None


# --- public ----------------------------------------------------------------------------------------------------


def generate(model, input_ids, attention_mask=None, generation_config=None) -> torch.LongTensor:
    """`model.generate(input_ids=..., attention_mask=..., generation_config=...)`, faster: same shape, same tokens.

    Prompts are left-padded; rows that finish are padded with pad_token_id after their EOS, and generation stops
    once every row has finished. Falls back to `model.generate` (one warning per process) for whatever the fast
    path does not do, and if it fails.
    """

    def fallback():
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config)

    global _LAST_PATH, _LAST_COMPILED
    _LAST_PATH, _LAST_COMPILED = "model.generate", False
    if os.environ.get("FAST_GENERATE", "1") == "0":
        return fallback()
    try:
        plan = _ready_plan(model)
        settings = _settings(plan, input_ids, attention_mask, generation_config)
    except Exception as error:  # noqa: BLE001 - anything the fast path cannot do is model.generate's job
        _warn_once("fallback", f"fast generation unavailable ({_reason(error)}); using model.generate")
        return fallback()
    try:
        with torch.no_grad():
            out = _sample(plan, input_ids, attention_mask, settings)
    except Exception as error:  # noqa: BLE001
        _PLANS[plan.base()] = f"failed: {_reason(error)}"  # do not retry a failing path at every step
        plan.cache = None
        _warn_once("fallback", f"fast generation failed ({_reason(error)}); using model.generate from now on")
        log.debug("fast generation failed", exc_info=True)
        return fallback()
    _LAST_PATH, _LAST_COMPILED = "fast", plan.compiled is not None and plan.traced[0]
    return out


def last_path() -> str:
    """Which path served this process's latest `generate` call: "fast", or "model.generate" (a fallback)."""
    return _LAST_PATH


def last_step_compiled() -> bool:
    """Whether the latest `generate` call's decode steps ran as compiled code: Dynamo traced them, which a
    torch.compile under TORCHDYNAMO_DISABLE=1 or a force_eager stance never does (it runs the step as written)."""
    return _LAST_COMPILED


def prepare(model) -> bool:
    """Inspect (once) and self-check `model` for the fast path; True when `generate` will use it."""
    try:
        _ready_plan(model)
        return True
    except Exception as error:  # noqa: BLE001
        _warn_once("fallback", f"fast generation unavailable ({_reason(error)}); using model.generate")
        return False


def describe(model) -> str:
    """One line for logs and benchmarks: which path `generate` takes for this model, and why."""
    plan = _PLANS.get(_transformers_model(model))
    if plan is None:
        return "not prepared"
    if isinstance(plan, str):
        return f"model.generate ({plan})"
    compiled = "compiled" if plan.compiled is not None and plan.traced[0] else "eager"
    return f"fast ({plan.experts_kernel} experts, compile={plan.compile_mode}, step {compiled})"


def release(model) -> None:
    """Forget `model`: its KV cache, kept between calls, and its plan (compiled step included; torch.compile's own
    cache may still hold the layers until torch._dynamo.reset()). The next generate starts afresh."""
    plan = _PLANS.pop(_transformers_model(model), None)
    if isinstance(plan, _Plan):
        plan.cache = plan.compiled = None


# --- the plan: what the decode step calls, found once per model -------------------------------------------------


def _transformers_model(model):
    """Under PEFT, the LoRA-injected transformers model (its layers carry the adapters); else the model itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _ready_plan(model) -> _Plan:
    base = _transformers_model(model)
    plan = _PLANS.get(base)
    if isinstance(plan, _Plan) and plan.modules != _module_ids(base):
        plan = None
    if plan is None:
        try:
            plan = _build_plan(model, base)
        except NotImplementedError as error:
            plan = str(error)
        _PLANS[base] = plan
    if isinstance(plan, str):
        raise NotImplementedError(plan)
    if any(module.training for module in plan.dropouts) or (
        base.training and getattr(base.config, "attention_dropout", 0.0)
    ):
        raise NotImplementedError("dropout is active (model in training mode)")  # not cached: eval() clears it
    if not plan.checked:
        try:
            with torch.no_grad():
                _self_check(plan)
        except Exception as error:  # noqa: BLE001 - a model we cannot reproduce stays with model.generate
            _PLANS[base] = _reason(error)
            raise NotImplementedError(_reason(error)) from error
        plan.checked = True
    return plan


def _module_ids(base) -> tuple:
    return tuple(map(id, base.modules()))


def _build_plan(model, base) -> _Plan:
    """Everything structural is checked here; NotImplementedError names what does not fit."""
    config = base.config
    if getattr(config, "model_type", None) not in FAMILIES or getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(f"architecture {getattr(config, 'model_type', type(base).__name__)!r}")
    peft_configs = getattr(model, "peft_config", None) or {}
    if any(getattr(c, "is_prompt_learning", False) for c in peft_configs.values()):
        raise NotImplementedError("PEFT prompt learning")
    if len(set(getattr(base, "hf_device_map", {"": 0}).values())) > 1:
        raise NotImplementedError("a model split over several devices")
    if _synced_gpus(base):
        raise NotImplementedError("ZeRO-3/FSDP sharded generation (synced_gpus)")
    decoder = getattr(base, "model", None)
    needed = ("layers", "norm", "rotary_emb")
    if decoder is None or not all(hasattr(decoder, name) for name in needed) or not hasattr(base, "lm_head"):
        raise NotImplementedError(f"unexpected module layout in {type(base).__name__}")
    layers = [_plan_layer(layer, config) for layer in decoder.layers]
    fused = [layer.experts for layer in layers if layer.experts is not None]
    device = next(decoder.layers[0].parameters()).device
    parameters = inspect.signature(base.forward).parameters
    return _Plan(
        base=weakref.ref(base),
        layers=layers,
        embed=base.get_input_embeddings(),
        rotary=decoder.rotary_emb,
        norm=decoder.norm,
        lm_head=base.lm_head,
        device=device,
        experts_kernel=_experts_kernel(fused[0]) if fused else "module",
        compile_mode=_compile_mode(device),
        dropouts=[m for m in base.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0],
        checkpointing=[m for m in base.modules() if hasattr(m, "gradient_checkpointing")],
        accepts_position_ids="position_ids" in parameters,
        logits_to_keep="logits_to_keep" in parameters,
        modules=_module_ids(base),
    )


def _synced_gpus(base) -> bool:
    """generate() would sync ranks at every step (transformers/generation/utils.py:2380); we do not."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    if torch.distributed.get_world_size() < 2:
        return False
    from transformers.distributed.fsdp import is_fsdp_managed_module
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled() or is_fsdp_managed_module(base)


def _plan_layer(layer, config) -> _Layer:
    attn = getattr(layer, "self_attn", None)
    parts = ("input_layernorm", "post_attention_layernorm", "mlp")
    if attn is None or not all(hasattr(layer, name) for name in parts):
        raise NotImplementedError(f"unexpected decoder layer {type(layer).__name__}")
    if not all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
        raise NotImplementedError(f"unexpected attention {type(attn).__name__}")
    rotary_fn = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    if rotary_fn is None:
        raise NotImplementedError(f"no apply_rotary_pos_emb beside {type(attn).__name__}")
    planned = _Layer(
        input_norm=layer.input_layernorm,
        attn=attn,
        post_norm=layer.post_attention_layernorm,
        mlp=layer.mlp,
        rotary_fn=rotary_fn,
        window=getattr(attn, "sliding_window", None),
        sinks=isinstance(getattr(attn, "sinks", None), torch.Tensor),
    )
    experts, wrappers = _unwrap_experts(getattr(layer.mlp, "experts", None))
    if _is_fused_gpt_oss_experts(experts, config) and hasattr(layer.mlp, "router"):
        planned.router, planned.experts, planned.experts_lora = layer.mlp.router, experts, wrappers
    return planned


def _unwrap_experts(module):
    """PEFT's ParamWrappers (LoRA on a parameter: `target_parameters`) nest; return the base module and them."""
    wrappers = []
    while module is not None and hasattr(module, "parameter_name") and hasattr(module, "base_layer"):
        if not hasattr(module, "get_delta_factors"):
            return None, []  # a PEFT without the factored form: let the module compute itself
        wrappers.append(module)
        module = module.base_layer
    return module, wrappers


def _is_fused_gpt_oss_experts(experts, config) -> bool:
    """transformers' GptOssExperts layout (transposed, interleaved gate/up, biases); else the MLP runs as-is
    (e.g. MXFP4 kernels, or Unsloth's per-expert 4-bit Linear layers)."""
    if experts is None or not hasattr(experts, "_apply_gate") or config.model_type != "gpt_oss":
        return False
    count, hidden, inner = config.num_local_experts, config.hidden_size, config.intermediate_size
    shapes = {
        "gate_up_proj": (count, hidden, 2 * inner),
        "gate_up_proj_bias": (count, 2 * inner),
        "down_proj": (count, inner, hidden),
        "down_proj_bias": (count, hidden),
    }
    for name, shape in shapes.items():
        value = getattr(experts, name, None)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or tuple(value.shape) != shape:
            return False
    return True


def _experts_kernel(experts) -> str:
    choice = os.environ.get("FAST_GENERATE_EXPERTS", "auto")
    if choice in ("grouped", "dense"):
        return choice
    weight = experts.gate_up_proj
    if weight.device.type != "cuda" or weight.dtype != torch.bfloat16:
        return "dense"  # torch compiles _grouped_mm for bf16 only; on the CPU we do not compile anyway
    try:  # e.g. GPUs before Hopper may lack the kernel in some builds
        x = torch.zeros(16, 16, device=weight.device, dtype=weight.dtype)
        _grouped_mm(x, torch.zeros(2, 16, 16, device=weight.device, dtype=weight.dtype),
                    torch.tensor([8, 16], device=weight.device, dtype=torch.int32))  # fmt: skip
        return "grouped"
    except Exception:  # noqa: BLE001
        return "dense"


def _compile_mode(device: torch.device) -> str:
    mode = os.environ.get("FAST_GENERATE_COMPILE", "auto")
    if mode == "auto":
        return "reduce-overhead" if device.type == "cuda" else "none"
    return mode


def _self_check(plan: _Plan) -> None:
    """One decode step against the model's own forward on a tiny batch (one row left-padded): catches a forward
    patched beyond what `_decode_step` reproduces, before any real generation relies on it."""
    base = plan.base()
    vocab = base.config.vocab_size
    ids = (torch.arange(12, device=plan.device).view(2, 6) * 7 + 3) % vocab
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kwargs = {"position_ids": _positions(mask)} if plan.accepts_position_ids else {}
    reference = base(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs).logits[:, -1].float()
    _, cache = _prefill(plan, ids[:, :-1], mask[:, :-1], new_tokens=1, keep=False)
    column = torch.tensor([5], device=plan.device)
    hidden = _embed(plan, ids[:, -1:])
    ours = _decode_step(plan, hidden, _positions(mask)[:, -1:], column, cache.valid, cache.keys, cache.values).float()
    error = float((ours - reference).abs().max() / reference.abs().max().clamp_min(1e-6))
    tolerance = 1e-3 if hidden.dtype in (torch.float32, torch.float64) else 0.1  # 16-bit: rounding; a bug: ~1
    if not error <= tolerance:
        raise NotImplementedError(f"self-check: the decode step differs from the model's forward by {error:.2g}")


# --- one call: settings, prefill, decode loop -------------------------------------------------------------------


@dataclass
class _Settings:
    new_tokens: int
    do_sample: bool
    processors: object  # transformers LogitsProcessorList
    eos: torch.Tensor | None
    pad: torch.Tensor | None


def _allowed_processors():
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    return (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
    )


def _settings(plan: _Plan, input_ids, attention_mask, generation_config) -> _Settings:
    """The generation config as `generate` resolves it (model defaults merged in), or NotImplementedError."""
    from transformers.generation import LogitsProcessorList
    from transformers.generation.configuration_utils import GenerationMode

    base = plan.base()
    if attention_mask is None:
        raise NotImplementedError("no attention_mask")  # generate would infer one from the pad token
    if not (_same_device(input_ids.device, plan.device) and _same_device(attention_mask.device, plan.device)):
        raise NotImplementedError(f"inputs on {input_ids.device}, model on {plan.device}")
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise NotImplementedError("input_ids and attention_mask must be (batch, length)")
    if bool((attention_mask[:, -1] == 0).any()):
        raise NotImplementedError("right padding")
    config, model_kwargs = base._prepare_generation_config(generation_config)
    if model_kwargs:
        raise NotImplementedError(f"generation options {sorted(model_kwargs)}")
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.SAMPLE, GenerationMode.GREEDY_SEARCH):
        raise NotImplementedError(f"generation mode {mode.value if hasattr(mode, 'value') else mode}")
    unsupported = {
        "num_return_sequences > 1": (config.num_return_sequences or 1) > 1,
        "return_dict_in_generate": bool(config.return_dict_in_generate),
        "output_scores/logits/attentions/hidden_states": any(
            bool(getattr(config, name, False))
            for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
        ),
        "stop_strings": config.stop_strings is not None,
        "max_time": config.max_time is not None,
        "a quantized cache": config.cache_implementation == "quantized",
    }
    if named := [name for name, present in unsupported.items() if present]:
        raise NotImplementedError(", ".join(named))
    base._prepare_special_tokens(config, True, device=plan.device, batch_size=input_ids.shape[0])
    length = input_ids.shape[1]
    new_tokens = config.max_new_tokens if config.max_new_tokens is not None else (config.max_length or 0) - length
    if new_tokens < 1:
        raise NotImplementedError(f"{new_tokens} new tokens")
    config.max_length = length + new_tokens
    processors = base._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=length,
        encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(),
        device=plan.device,
        model_kwargs={"attention_mask": attention_mask, "use_cache": True},
    )
    if unknown := [type(p).__name__ for p in processors if not isinstance(p, _allowed_processors())]:
        raise NotImplementedError(f"logits processors {unknown}")
    return _Settings(
        new_tokens, config.do_sample is True, processors, config._eos_token_tensor, config._pad_token_tensor
    )


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _positions(attention_mask):
    """Position ids of left-padded rows, as generate computes them (generation/utils.py:880-902)."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


def _embed(plan: _Plan, tokens):
    """Outside the compiled step: the embedding may live on the CPU (Unsloth's offload_embedding)."""
    weight = next(plan.embed.parameters())
    return plan.embed(tokens.to(weight.device)).to(plan.device)


def _prefill(plan: _Plan, input_ids, attention_mask, new_tokens: int, keep: bool = True):
    """The model's own forward over the prompts (so the first token is exactly generate's), its cache copied into
    ours. Returns the last position's float32 logits and the cache."""
    from transformers import DynamicCache

    base = plan.base()
    kwargs = {"position_ids": _positions(attention_mask)} if plan.accepts_position_ids else {}
    if plan.logits_to_keep:
        kwargs["logits_to_keep"] = 1
    # Gradient checkpointing in training mode (TRL generates in training mode) drops the cache
    # (utils/generic.py:1029-1033, modeling_layers.py GradientCheckpointingLayer.__call__), and generate then
    # recomputes the whole sequence at every step. Without gradients there is nothing to checkpoint: off for the
    # prefill, so that it fills a cache. Any true value switches it on: Unsloth's for_training writes "unsloth".
    checkpointing = [(module, module.gradient_checkpointing) for module in plan.checkpointing
                     if module.gradient_checkpointing]  # fmt: skip
    try:
        for module, _ in checkpointing:
            module.gradient_checkpointing = False
        outputs = base(input_ids=input_ids, attention_mask=attention_mask, past_key_values=DynamicCache(
            config=base.config), use_cache=True, return_dict=True, **kwargs)  # fmt: skip
    finally:
        for module, value in checkpointing:
            module.gradient_checkpointing = value
    layers = getattr(outputs.past_key_values, "layers", None)
    if layers is None or len(layers) != len(plan.layers) or any(layer.keys is None for layer in layers):
        raise NotImplementedError(f"the prefill filled no usable cache ({type(outputs.past_key_values).__name__})")
    length = input_ids.shape[1]
    cache = _cache_for(plan, layers, input_ids.shape[0], length + new_tokens, keep)
    for layer, keys, values in zip(layers, cache.keys, cache.values):
        kept = layer.keys.shape[2]  # all the prompt, or a sliding layer's last window-1 columns
        keys[:, :, length - kept : length].copy_(layer.keys)
        values[:, :, length - kept : length].copy_(layer.values)
    cache.valid[:, :length].copy_(attention_mask.bool())
    cache.valid[:, length:] = True
    return outputs.logits[:, -1].to(dtype=torch.float32, copy=True), cache


def _cache_for(plan: _Plan, layers, batch: int, needed: int, keep: bool) -> _Cache:
    """The kept cache when it fits, else a bigger one. Shapes only grow, rounded up: compiled graphs see a few
    shapes only, and static addresses stay put between calls."""
    old = plan.cache if keep else None
    shapes = [(batch, layer.keys.shape[1], layer.keys.shape[3]) for layer in layers]
    dtype = layers[0].keys.dtype
    if old is not None and old.valid.shape[0] == batch and old.valid.shape[1] >= needed and old.keys[0].dtype == dtype:
        if [(k.shape[0], k.shape[1], k.shape[3]) for k in old.keys] == shapes:
            return old
    capacity = -(-needed // CACHE_ROUNDING) * CACHE_ROUNDING
    if old is not None and old.valid.shape[0] == batch:
        capacity = max(capacity, old.valid.shape[1])
    if keep:
        plan.cache = old = None  # free the old buffers before allocating

    def buffer(b, heads, dim):
        tensor = torch.zeros(b, heads, capacity, dim, dtype=dtype, device=plan.device)
        torch._dynamo.mark_static_address(tensor)
        return tensor

    cache = _Cache([buffer(*s) for s in shapes], [buffer(*s) for s in shapes],
                   torch.zeros(batch, capacity, dtype=torch.bool, device=plan.device))  # fmt: skip
    torch._dynamo.mark_static_address(cache.valid)
    if keep:
        plan.cache = cache
    return cache


def _sample(plan: _Plan, input_ids, attention_mask, settings: _Settings):
    """generate's `_sample` loop (generation/utils.py:3024-3095) over our decode step."""
    batch, length = input_ids.shape
    steps = settings.new_tokens
    logits, cache = _prefill(plan, input_ids, attention_mask, steps)
    fill = settings.pad if settings.pad is not None else 0
    sequences = torch.cat([input_ids, input_ids.new_zeros(batch, steps) + fill], dim=1)
    positions = _positions(attention_mask)[:, -1:] + 1
    column = torch.full((1,), length, dtype=torch.long, device=plan.device)
    unfinished = torch.ones(batch, dtype=torch.bool, device=plan.device)
    finished_at = torch.full((batch,), steps - 1, dtype=torch.long, device=plan.device)
    for step in range(steps):
        scores = settings.processors(sequences[:, : length + step], logits)
        if settings.do_sample:
            tokens = torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            tokens = torch.argmax(scores, dim=-1)
        if settings.eos is not None:
            tokens = torch.where(unfinished, tokens, settings.pad)
            ended = unfinished & torch.isin(tokens, settings.eos)
            finished_at = torch.where(ended, step, finished_at)
            unfinished = unfinished & ~ended
        sequences[:, length + step] = tokens
        if step + 1 == steps:
            break
        if settings.eos is not None and (step + 1) % STOP_CHECK_EVERY == 0 and not bool(unfinished.any()):
            break
        hidden = _embed(plan, tokens[:, None])
        logits = _run_step(plan, hidden, positions, column, cache).float()
        positions = positions + 1
        column = column + 1
    if settings.eos is None:
        return sequences
    if bool(unfinished.any()):
        return sequences
    return sequences[:, : length + int(finished_at.max()) + 1]  # generate stops at the step the last row ends


def _run_step(plan: _Plan, hidden, positions, column, cache: _Cache):
    """The compiled step when it compiles, else the same step eagerly (one warning)."""
    args = (hidden, positions, column, cache.valid, cache.keys, cache.values)
    if plan.compile_mode != "none" and plan.compiled is None and not plan.compile_failed:
        plan.compiled = _compile(plan, plan.compile_mode)
    if plan.compiled is not None:
        try:
            if plan.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()  # the previous step's logits are consumed
            with _unsloth_decode():
                return plan.compiled(*args)
        except Exception as error:  # noqa: BLE001 - a compile failure must not cost the generation
            plan.compiled = None
            plan.compile_failed = True
            _warn_once("compile", f"fast generation runs uncompiled: torch.compile failed ({_reason(error)})")
            log.debug("torch.compile of the decode step failed", exc_info=True)
    return _decode_step(plan, *args)  # index_copy_ at the same column makes a retry harmless


def _unsloth_decode():
    """Unsloth's decode flag, raised while our step runs (unsloth_zoo/temporary_patches/utils.py,
    unsloth_decode_compile): Unsloth wraps modules of the models it loads, GPT-OSS's MLP among them, in
    torch_compiler_disable_unless_decode, which keeps Dynamo out of them unless that flag is up, so a full graph of
    our step would stop there ("Skip inlining torch.compiler.disable()d function"). Nothing without Unsloth."""
    patches = sys.modules.get("unsloth_zoo.temporary_patches.utils")
    scope = getattr(patches, "unsloth_decode_compile", None)
    return scope() if scope is not None else contextlib.nullcontext()


def _compile(plan: _Plan, mode: str):
    """fullgraph: a graph break would cut the CUDA graph, so it is an error here. dynamic=False: a new batch size
    or cache capacity compiles anew (few: the cache only grows). The step notes, while Dynamo runs it, that it
    was traced: describe() and last_step_compiled() say "compiled" only then."""
    traced = plan.traced

    def step(hidden, positions, column, valid, keys, values):
        if torch.compiler.is_compiling():
            traced[0] = True
        return _decode_step(plan, hidden, positions, column, valid, keys, values)

    if mode in ("cudagraphs", "eager", "aot_eager", "inductor"):
        return torch.compile(step, backend=mode, fullgraph=True, dynamic=False)
    return torch.compile(step, mode=mode, fullgraph=True, dynamic=False)


# --- the decode step -------------------------------------------------------------------------------------------


def _decode_step(plan: _Plan, hidden, positions, column, valid, keys, values):
    """One token per row through the decoder: hidden (batch, 1, hidden_size) embeddings, positions (batch, 1),
    column (1,) the cache column being written, valid (batch, capacity). Returns (batch, vocab) logits.

    Fixed shapes, no host sync, no data-dependent Python: capturable as one CUDA graph."""
    cos, sin = plan.rotary(hidden, positions)
    columns = torch.arange(valid.shape[1], device=valid.device)
    causal = valid & (columns <= column)
    for layer, layer_keys, layer_values in zip(plan.layers, keys, values):
        allowed = causal if layer.window is None else causal & (columns > column - layer.window)
        attended = _attention(layer, layer.input_norm(hidden), cos, sin, column, allowed, layer_keys, layer_values)
        hidden = hidden + attended
        hidden = hidden + _mlp(plan, layer, layer.post_norm(hidden))
    return plan.lm_head(plan.norm(hidden))[:, -1]


def _attention(layer: _Layer, x, cos, sin, column, allowed, layer_keys, layer_values):
    """Eager attention (GPT-OSS: with sinks) of one query per row over the whole static cache, masked."""
    attn = layer.attn
    batch, head_dim = x.shape[0], attn.head_dim
    query = attn.q_proj(x).view(batch, 1, -1, head_dim).transpose(1, 2)
    key = attn.k_proj(x).view(batch, 1, -1, head_dim).transpose(1, 2)
    value = attn.v_proj(x).view(batch, 1, -1, head_dim).transpose(1, 2)
    query, key = layer.rotary_fn(query, key, cos, sin)
    layer_keys.index_copy_(2, column, key)
    layer_values.index_copy_(2, column, value)
    kv_heads = layer_keys.shape[1]
    query = query.reshape(batch, kv_heads, -1, head_dim)  # head h reads kv head h // groups, as repeat_kv
    scores = torch.matmul(query, layer_keys.transpose(2, 3)) * attn.scaling  # (batch, kv_heads, groups, capacity)
    scores = scores.masked_fill(~allowed[:, None, None, :], torch.finfo(scores.dtype).min)
    if layer.sinks:
        sinks = attn.sinks.reshape(1, kv_heads, -1, 1).expand(batch, -1, -1, -1)
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.nn.functional.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    else:
        probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs.to(layer_values.dtype), layer_values)  # (batch, kv_heads, groups, head_dim)
    return attn.o_proj(out.reshape(batch, 1, -1))


def _mlp(plan: _Plan, layer: _Layer, x):
    if layer.experts is None:
        out = layer.mlp(x)
        return out[0] if isinstance(out, tuple) else out  # GptOssMLP returns (hidden, router_scores)
    batch, length, width = x.shape
    flat = x.reshape(-1, width)
    _, weights, chosen = layer.router(flat)
    experts = _experts_grouped if plan.experts_kernel == "grouped" else _experts_dense
    return experts(layer.experts, layer.experts_lora, flat, chosen, weights).reshape(batch, length, width)


def _lora_factors(wrappers, name: str):
    """(lhs, rhs, scale) per active adapter on parameter `name`: delta = scale * lhs @ rhs, per expert."""
    factors = []
    for wrapper in wrappers:
        if wrapper.parameter_name != name or wrapper.disable_adapters or wrapper.merged:
            continue  # merged: the base tensor already holds the delta
        for adapter in wrapper.active_adapters:
            if adapter in wrapper.lora_A:
                factors.append(wrapper.get_delta_factors(adapter))
    return factors


def _lora(rows, lhs, rhs, scale):
    """scale * rows @ lhs @ rhs in the factors' dtype (PEFT keeps LoRA weights in float32 beside 16-bit bases)."""
    return scale * torch.bmm(torch.bmm(rows.to(lhs.dtype), lhs), rhs)


def _experts_dense(experts, wrappers, x, chosen, weights):
    """Every expert on every row (one bmm per projection), then each row's top-k outputs, weighted. Reads all the
    experts' weights, as `grouped` does once a batch hits them all; fixed shapes, any dtype. Each matmul runs in its
    weight's dtype and the sums in the widest of them: Unsloth keeps a BF16 load's expert biases in float32."""
    count = experts.gate_up_proj.shape[0]
    rows = x.unsqueeze(0).expand(count, -1, -1)  # (experts, tokens, hidden)
    gate_up = torch.bmm(rows.to(experts.gate_up_proj.dtype), experts.gate_up_proj) + experts.gate_up_proj_bias.unsqueeze(1)
    for lhs, rhs, scale in _lora_factors(wrappers, "gate_up_proj"):
        gate_up = gate_up + _lora(rows, lhs, rhs, scale)
    gated = experts._apply_gate(gate_up)
    out = torch.bmm(gated.to(experts.down_proj.dtype), experts.down_proj) + experts.down_proj_bias.unsqueeze(1)
    for lhs, rhs, scale in _lora_factors(wrappers, "down_proj"):
        out = out + _lora(gated, lhs, rhs, scale)
    tokens = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
    picked = out[chosen, tokens]  # (tokens, top_k, hidden)
    return (picked * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)


def _grouped_mm(x, weight, offsets):
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return grouped(x.to(weight.dtype), weight, offs=offsets)


def _experts_grouped(experts, wrappers, x, chosen, weights):
    """The (token, expert) pairs sorted by expert, one grouped matmul per projection: each hit expert's weights
    are read once, idle experts not at all; LoRA as two thin bmm per pair. Dtypes as in `_experts_dense`."""
    tokens, top_k = chosen.shape
    count = experts.gate_up_proj.shape[0]
    expert_ids, order = torch.sort(chosen.reshape(-1))
    rows = x[order // top_k]
    counted = expert_ids.float() if x.device.type in ("cpu", "mps") else expert_ids.int()  # histc's dtype rules
    offsets = torch.cumsum(torch.histc(counted, bins=count, min=0, max=count - 1), dim=0, dtype=torch.int32)
    gate_up = _grouped_mm(rows, experts.gate_up_proj, offsets) + experts.gate_up_proj_bias[expert_ids]
    for lhs, rhs, scale in _lora_factors(wrappers, "gate_up_proj"):
        gate_up = gate_up + _lora(rows.unsqueeze(1), lhs[expert_ids], rhs[expert_ids], scale).squeeze(1)
    gated = experts._apply_gate(gate_up).contiguous()
    out = _grouped_mm(gated, experts.down_proj, offsets) + experts.down_proj_bias[expert_ids]
    for lhs, rhs, scale in _lora_factors(wrappers, "down_proj"):
        out = out + _lora(gated.unsqueeze(1), lhs[expert_ids], rhs[expert_ids], scale).squeeze(1)
    out = out * weights.reshape(-1)[order].unsqueeze(-1)
    unsorted = torch.empty_like(out).index_copy_(0, order, out)
    return unsorted.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


# --- warnings --------------------------------------------------------------------------------------------------


def _reason(error: Exception) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return text if isinstance(error, NotImplementedError) else f"{type(error).__name__}: {text}"[:300]


def _warn_once(kind: str, message: str) -> None:
    """One WARNING line per kind ("fallback", "compile") per process (in training.log and on the console under
    train_2048); the rest goes to the debug log."""
    if kind in _WARNED:
        log.debug(message)
        return
    _WARNED.add(kind)
    log.warning(message)
