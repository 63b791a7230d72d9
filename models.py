"""The model: loaded to train or to evaluate by one function, and the CPU demo's tiny model, built locally.

train_2048.py loads the policy with fresh LoRA adapters (Unsloth on one CUDA GPU, transformers + PEFT
elsewhere); evaluate_2048.py loads a base model with saved adapters, or a merged model. Both go through
`load_model`, so a checkpoint is read the way it was trained.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("train_2048.models")

TINY = "tiny"  # model_name_or_path that builds the CPU demo's model in <output_dir>/tiny-model
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)  # other variables (gpt-oss's reasoning_effort) are accepted and unused
GPT_OSS_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # fused tensors, not Linear layers


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
            lora_dropout=model_args.lora_dropout,
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
        peft_config.target_modules = set(peft_config.target_modules) - fused
        peft_config.target_parameters = GPT_OSS_EXPERTS
        if peft_config.lora_dropout:
            log.warning("LoRA on GPT-OSS's fused experts cannot use dropout: lora_dropout set to 0")
            peft_config.lora_dropout = 0.0
    return get_peft_model(model, peft_config), tokenizer


# --- saving, and proving the save ------------------------------------------------------------------------------


def save_and_verify(trainer, tokenizer, *, save_method: str, verify: bool, use_peft: bool, backend: str,
                    prompt_inputs, seed: int, output_dir: Path) -> bool:  # fmt: skip
    """LoRA adapters (and the tokenizer) to <output_dir>/final always; a merged model to final-<save_method> on
    request. With `verify`, each save is checked against the trained model without a second copy of the base:

    - final/: its tensors must equal the trained adapters exactly, and, loaded beside them as a second adapter of
      the same model, it must sample the same seeded tokens;
    - final-merged_16bit/ on transformers: every saved tensor must equal the merged model's in memory, read shard
      by shard;
    - final-<method>/ on Unsloth (merged by Unsloth straight to disk): seeded samples of the trained model are taken
      first, the trained model is released, the merged checkpoint is loaded alone and must sample the same (4-bit and
      16-bit kernels can differ in low bits, so there a mismatch is a warning to look at).

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
        expected = _samples(model, tokenizer, prompt_inputs, seed) if verify else None
        model.save_pretrained_merged(str(tmp), tokenizer, save_method=save_method)
        publish(tmp, merged_dir)
        log.info(f"saved the merged model ({save_method}) to {merged_dir}")
        if verify:
            del model
            release(trainer)
            ok &= verify_by_reload(merged_dir, tokenizer, prompt_inputs, seed, expected)
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


def verify_by_reload(folder: Path, tokenizer, prompt_inputs, seed: int, expected: list[list[int]]) -> bool:
    """Load a merged checkpoint alone (transformers) and compare its seeded samples with the trained model's."""
    import torch
    from trl import ModelConfig

    try:
        model, _ = load_model(str(folder), ModelConfig(model_name_or_path=str(folder), dtype="auto"),
                              device_map={"": 0} if torch.cuda.is_available() else None)  # fmt: skip
    except Exception as exc:
        log.warning(f"{folder}: could not be loaded back to check it ({type(exc).__name__}: {exc})")
        return True
    got = _samples(model, tokenizer, prompt_inputs, seed)
    del model
    _empty_cuda_cache()
    if got == expected:
        log.info(f"verified {folder}: reloaded alone, it samples the same {len(got)} seeded completions")
    else:
        log.warning(f"{folder}: reloaded alone, {sum(a != b for a, b in zip(expected, got))} of {len(got)} seeded "
                    "completions differ from the trained model's (4-bit and 16-bit weights differ in low bits; "
                    "spot-check its answers with evaluate_2048.py --model)")  # fmt: skip
    return True
