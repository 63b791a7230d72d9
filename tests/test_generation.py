"""generation.generate against model.generate on tiny random models (no hub): the same tokens, greedy and seeded
sampling, with and without LoRA (on the fused GPT-OSS experts too), EOS and early stop, the fallbacks, and a decode
step that torch.compile traces whole (fullgraph, a cheap backend: no code generation on the CPU)."""

import contextlib
import logging

import pytest
import torch
from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM

import generation

VOCAB, PAD = 300, 0
LORA_GPT_OSS = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}  # fmt: skip
LORA_LLAMA = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """Each test sees its own one-warning budget and the default switches."""
    monkeypatch.setattr(generation, "_WARNED", set())
    for name in ("FAST_GENERATE", "FAST_GENERATE_COMPILE", "FAST_GENERATE_EXPERTS"):
        monkeypatch.delenv(name, raising=False)


def gpt_oss(seed=0, dtype=torch.float32):
    """Two layers, sliding (window 8, shorter than the prompts) then full, 4 experts top-2, attention sinks."""
    torch.manual_seed(seed)
    config = GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=PAD, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    model = GptOssForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # non-zero sinks and biases, so that getting them wrong shows
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1)
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.1)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.1)
    return model


def llama(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD, eos_token_id=None,
                         bos_token_id=None, attn_implementation="eager")  # fmt: skip
    return LlamaForCausalLM(config).eval()


def with_lora(model, lora_dropout=0.0, **targets):
    """LoRA r=4 with B made non-zero (fresh adapters are a no-op), so the adapters change the tokens."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=lora_dropout, **targets))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    return peft_model.eval()


def prompts(batch=3, length=12, seed=0):
    """Left-padded prompts of different lengths (the longest fills the row)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        mask[row, : (row * 5) % (length - 2)] = 0
    return ids.masked_fill(mask == 0, PAD), mask


@contextlib.contextmanager
def warnings_logged():
    """The WARNING lines generation.py logs inside the block (its fallbacks say why there, once per process)."""
    caught = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: caught.append(record.getMessage())
    generation.log.addHandler(handler)
    try:
        yield caught
    finally:
        generation.log.removeHandler(handler)


def both(model, ids, mask, config):
    """(model.generate's output, ours), each from the same seed; ours must come from the fast path."""
    torch.manual_seed(123)
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    torch.manual_seed(123)
    with warnings_logged() as caught:
        got = generation.generate(model, ids, mask, config)
    assert caught == [] and generation.last_path() == "fast"  # the fast path must not fall back here
    return expected, got


def greedy(new_tokens=20, **options):
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD, **options)


# --- the same tokens as model.generate --------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["dense", "grouped"])
@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_greedy_gpt_oss_matches_generate(monkeypatch, kernel, lora):
    monkeypatch.setenv("FAST_GENERATE_EXPERTS", kernel)
    model = with_lora(gpt_oss(), **LORA_GPT_OSS) if lora else gpt_oss()
    ids, mask = prompts()
    expected, got = both(model, ids, mask, greedy())
    assert got.shape == expected.shape == (3, 32)
    assert torch.equal(got, expected)
    assert generation.describe(model).startswith(f"fast ({kernel} experts")


def test_the_kept_cache_is_reused_grown_and_replaced(monkeypatch):
    """Stale keys from an earlier call must never leak into a later one, whatever the cache does."""
    monkeypatch.setattr(generation, "CACHE_ROUNDING", 16)
    model = with_lora(gpt_oss(), **LORA_GPT_OSS)
    plan_cache = []
    for batch, length, new_tokens in [(3, 12, 20), (3, 5, 9), (3, 12, 30), (2, 9, 6)]:
        assert torch.equal(*both(model, *prompts(batch, length, seed=length), greedy(new_tokens=new_tokens)))
        plan_cache.append(generation._PLANS[model.get_base_model()].cache.valid.shape)
    assert plan_cache == [(3, 32), (3, 32), (3, 48), (2, 16)]  # reused, grown, replaced for another batch size


def test_lora_changes_the_tokens():
    """Otherwise the LoRA tests above would prove nothing."""
    ids, mask = prompts()
    plain = generation.generate(gpt_oss(), ids, mask, greedy())
    adapted = generation.generate(with_lora(gpt_oss(), **LORA_GPT_OSS), ids, mask, greedy())
    assert not torch.equal(plain, adapted)


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_greedy_llama_matches_generate(lora):
    model = with_lora(llama(), **LORA_LLAMA) if lora else llama()
    ids, mask = prompts(batch=4)
    expected, got = both(model, ids, mask, greedy())
    assert torch.equal(got, expected)


def test_the_cpu_demo_model_in_training_mode():
    """train_2048's CPU demo: a Llama with sdpa attention, LoRA, embeddings and lm_head trained in full (PEFT's
    modules_to_save), generating in training mode as TRL does."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, pad_token_id=PAD, eos_token_id=None,
                         bos_token_id=None, tie_word_embeddings=False)  # fmt: skip
    model = with_lora(LlamaForCausalLM(config), modules_to_save=["embed_tokens", "lm_head"], **LORA_LLAMA)
    model.train()
    config = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=1.0, pad_token_id=PAD, eos_token_id=7)
    assert torch.equal(*both(model, *prompts(batch=4), config))


def test_gradient_checkpointing_does_not_cost_the_cache():
    """With checkpointing on, in training mode, transformers drops the KV cache but still feeds generate one token
    per step (its output degenerates); TRL turns checkpointing off around generate (trl/models/utils.py:133-135).
    We turn it off for our prefill: the tokens are those of generate without checkpointing."""
    model = with_lora(gpt_oss(), **LORA_GPT_OSS)
    ids, mask = prompts()
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=greedy())
    model.gradient_checkpointing_enable()
    model.train()
    got = generation.generate(model, ids, mask, greedy())
    assert torch.equal(got, expected) and generation.describe(model).startswith("fast")
    assert all(layer.gradient_checkpointing for layer in model.get_base_model().model.layers)  # restored


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.05},
        {"temperature": 1.3, "top_k": 0, "top_p": 1.0},
        {"repetition_penalty": 1.5, "top_k": 20},
    ],
    ids=["temperature-topk-topp-minp", "plain", "repetition-penalty"],
)
def test_sampling_matches_generate_for_the_same_seed(options):
    """Same logits, same processors (transformers' own, in its order), same torch.multinomial draws."""
    model = with_lora(gpt_oss(), **LORA_GPT_OSS)
    ids, mask = prompts(batch=4)
    config = GenerationConfig(max_new_tokens=24, do_sample=True, pad_token_id=PAD, **options)
    expected, got = both(model, ids, mask, config)
    assert torch.equal(got, expected)
    torch.manual_seed(7)
    assert not torch.equal(generation.generate(model, ids, mask, config), got)  # another seed, other tokens


def test_eos_pads_finished_rows_and_stops_when_all_are_done():
    model = gpt_oss()
    ids, mask = prompts(batch=3)
    free = generation.generate(model, ids, mask, greedy(new_tokens=30))
    completions = free[:, ids.shape[1] :]
    eos = int(completions[0, 2])  # row 0 ends at its third token; the others whenever they produce it, if ever
    config = greedy(new_tokens=30, eos_token_id=eos)
    expected, got = both(model, ids, mask, config)
    assert torch.equal(got, expected)
    rows = got[:, ids.shape[1] :]
    assert (rows[0, :3] == completions[0, :3]).all() and (rows[0, 3:] == PAD).all()
    for row in rows:
        ends = (row == eos).nonzero()
        if len(ends):
            assert (row[int(ends[0]) + 1 :] == PAD).all()
    # every row ending: generate stops at the step the last one ends, and so do we
    everyone = greedy(new_tokens=30, eos_token_id=[int(c) for c in completions[:, 1]])
    expected, got = both(model, ids, mask, everyone)
    assert torch.equal(got, expected) and got.shape[1] < ids.shape[1] + 30


@pytest.mark.parametrize("new_tokens", [1, 2, 5, 7])
def test_max_new_tokens(new_tokens):
    model = gpt_oss()
    ids, mask = prompts()
    expected, got = both(model, ids, mask, greedy(new_tokens=new_tokens, eos_token_id=VOCAB - 1))
    assert got.shape == expected.shape == (3, ids.shape[1] + new_tokens)
    assert torch.equal(got, expected)


def test_generic_mlp_path_for_experts_we_do_not_recognise(monkeypatch):
    """Experts in another layout (MXFP4 kernels, Unsloth's 4-bit per-expert Linears) run through the module itself."""
    monkeypatch.setattr(generation, "_is_fused_gpt_oss_experts", lambda experts, config: False)
    model = with_lora(gpt_oss(), **LORA_GPT_OSS)
    assert torch.equal(*both(model, *prompts(), greedy()))


@pytest.mark.parametrize("kernel", ["dense", "grouped"])
def test_experts_kernels_equal_peft_on_the_fused_experts(kernel):
    """One layer's experts: ours (LoRA as thin matmuls) against PEFT's ParamWrapper (W + scale * A @ B)."""
    model = with_lora(gpt_oss(), **LORA_GPT_OSS)
    layer = model.get_base_model().model.layers[0]
    experts, wrappers = generation._unwrap_experts(layer.mlp.experts)
    assert experts is not None and len(wrappers) == 2
    x = torch.randn(5, 64)
    with torch.no_grad():
        _, weights, chosen = layer.mlp.router(x)
        expected = layer.mlp.experts(x, chosen, weights)
        kernel_fn = generation._experts_grouped if kernel == "grouped" else generation._experts_dense
        got = kernel_fn(experts, wrappers, x, chosen, weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# --- compiling the decode step ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kernel, dtype", [("dense", torch.float32), ("grouped", torch.bfloat16)], ids=["dense-fp32", "grouped-bf16"]
)
def test_decode_step_compiles_to_one_graph(monkeypatch, kernel, dtype):
    """fullgraph=True through AOTAutograd ("aot_eager": what inductor is handed, without its code generation):
    dynamo traces the whole step, PEFT wrappers, LoRA factors and cache writes, as one graph, as CUDA graphs
    need, and a second call with another prompt length reuses it (the cache's shape did not change)."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("FAST_GENERATE_COMPILE", "aot_eager")
    monkeypatch.setenv("FAST_GENERATE_EXPERTS", kernel)
    torch._dynamo.reset()
    counters.clear()
    model = with_lora(gpt_oss(dtype=dtype), **LORA_GPT_OSS)
    ids, mask = prompts()
    with warnings_logged() as caught:
        compiled = generation.generate(model, ids, mask, greedy(new_tokens=6))
    assert caught == [] and generation.last_path() == "fast"
    generation.generate(model, *prompts(length=7, seed=3), greedy(new_tokens=5))
    assert generation.describe(model) == f"fast ({kernel} experts, compile=aot_eager, step compiled)"
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    monkeypatch.setenv("FAST_GENERATE_COMPILE", "none")
    generation.release(model)
    assert torch.equal(generation.generate(model, ids, mask, greedy(new_tokens=6)), compiled)
    assert generation.describe(model).endswith("step eager)")
    torch._dynamo.reset()


def test_unsloth_checkpointing_flags_keep_the_fast_path():
    """Unsloth's for_training writes the string "unsloth" into every gradient_checkpointing flag. In training mode
    (TRL generates in training mode) the prefill must still fill a cache, and the flags come back as they were."""
    model = with_lora(gpt_oss(), **LORA_GPT_OSS)
    model.gradient_checkpointing_enable()  # installs the checkpoint function, as Unsloth's for_training does
    flagged = [module for module in model.modules() if hasattr(module, "gradient_checkpointing")]
    for module in flagged:
        module.gradient_checkpointing = "unsloth"
    ids, mask = prompts()
    model.eval()  # the reference: model.generate with its cache (in training mode checkpointing drops it)
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=greedy(new_tokens=6))
    model.train()
    with warnings_logged() as caught:
        got = generation.generate(model, ids, mask, greedy(new_tokens=6))
    assert caught == [] and generation.last_path() == "fast" and torch.equal(got, expected)
    assert flagged and all(module.gradient_checkpointing == "unsloth" for module in flagged)


# --- falling back to model.generate -----------------------------------------------------------------------------


def fallback_warnings(model, ids, mask, config, calls=2):
    """Outputs of `calls` calls, each checked equal to model.generate's, and the WARNING lines they logged."""
    with warnings_logged() as caught:
        for _ in range(calls):
            expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            assert torch.equal(generation.generate(model, ids, mask, config), expected)
            assert generation.last_path() in ("fast", "model.generate")
    return caught


@pytest.mark.parametrize(
    "options, reason",
    [({"num_beams": 2}, "generation mode"), ({"no_repeat_ngram_size": 2}, "NoRepeatNGramLogitsProcessor")],
)
def test_unsupported_options_fall_back_with_one_warning(options, reason):
    model = gpt_oss()
    caught = fallback_warnings(model, *prompts(), greedy(new_tokens=5, **options))
    assert len(caught) == 1 and reason in caught[0] and "model.generate" in caught[0]
    assert generation.last_path() == "model.generate"


def test_a_failure_inside_the_fast_path_falls_back(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    model = gpt_oss()
    assert generation.prepare(model)
    monkeypatch.setattr(generation, "_prefill", broken)
    caught = fallback_warnings(model, *prompts(), greedy(new_tokens=5))
    assert len(caught) == 1 and "RuntimeError: boom" in caught[0]
    assert generation.describe(model).startswith("model.generate (failed")


def test_a_forward_patched_beyond_our_step_fails_the_self_check():
    """What an unknown patch (Unsloth's, say) looks like to us: the model's forward and our step disagree."""
    model = gpt_oss()
    attention = model.model.layers[1].self_attn
    original = attention.forward
    attention.forward = lambda *args, **kwargs: (original(*args, **kwargs)[0] * 2.0, None)
    caught = fallback_warnings(model, *prompts(), greedy(new_tokens=5))
    assert len(caught) == 1 and "self-check" in caught[0]
    assert not generation.prepare(model)


def test_other_architectures_and_the_off_switch_use_generate(monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, pad_token_id=PAD)).eval()
    caught = fallback_warnings(gpt2, *prompts(), greedy(new_tokens=4))
    assert len(caught) == 1 and "'gpt2'" in caught[0]
    model, (ids, _) = gpt_oss(), prompts()  # no mask: generate infers one from the pad token, we do not
    expected = model.generate(input_ids=ids, generation_config=greedy(new_tokens=4))
    assert torch.equal(generation.generate(model, ids, None, greedy(new_tokens=4)), expected)
    monkeypatch.setattr(generation, "_WARNED", set())
    monkeypatch.setenv("FAST_GENERATE", "0")
    assert fallback_warnings(gpt_oss(), *prompts(), greedy(new_tokens=4)) == []


def test_active_dropout_falls_back_until_eval():
    """LoRA dropout in training mode (TRL generates in training mode) makes generate stochastic: not ours."""
    model = with_lora(llama(), lora_dropout=0.1, **LORA_LLAMA)
    ids, mask = prompts()
    model.train()
    with warnings_logged() as caught:
        generation.generate(model, ids, mask, greedy(new_tokens=4))
    assert any("dropout" in line for line in caught) and generation.last_path() == "model.generate"
    model.eval()
    assert torch.equal(*both(model, ids, mask, greedy(new_tokens=4)))
