"""Decode speed of GPT-OSS on a GPU: transformers' model.generate (what TRL calls) against generation.generate.

Builds GPT-OSS with random weights straight on the GPU in bf16 (the 20B geometry: 24 layers, hidden 2880, 32
experts top-4, vocab 201088, alternating sliding/full attention; ~42 GB, no download, no CPU copy), optionally with
LoRA r=4 as training has it (q/k/v/o, and the fused experts through PEFT's target_parameters), then times both at
each batch size: left-padded prompts of about --prompt_tokens tokens, --new_tokens greedy tokens, no EOS (every
run decodes the full length), one warm-up (for ours: the torch.compile and the CUDA graph recording, reported as
"first call"), then the median of --repeats runs. Decode ms/step = (run - prefill) / (new_tokens - 1). Also
checks that greedy tokens agree; bf16 kernels may differ in the last bits, so the first divergence (row, step) is
reported rather than failed. Results as a markdown table, and with --json as a file.

    python bench/bench_generation.py --geometry 20b --lora              # the issue-14 setting, H100: minutes
    python bench/bench_generation.py --geometry 20b --lora --batch 8    # shorter
    python bench/bench_generation.py --geometry 20b --layers 4 --lora   # a quick look
    FAST_GENERATE_COMPILE=none python bench/bench_generation.py ...     # our loop without CUDA graphs

Exit 2 with one line when there is no CUDA GPU.
"""

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GEOMETRIES = {
    "20b": {"num_hidden_layers": 24, "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
            "vocab_size": 201088, "sliding_window": 128},
    "tiny": {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
             "vocab_size": 4096, "sliding_window": 32},
}  # fmt: skip


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="20b")
    parser.add_argument("--layers", type=int, help="override the number of layers (alternating sliding/full)")
    parser.add_argument("--lora", action="store_true", help="LoRA r=4 on q,k,v,o and the experts' fused tensors")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--new_tokens", "--new-tokens", type=int, default=200)
    parser.add_argument("--prompt_tokens", "--prompt-tokens", type=int, default=180)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no_baseline", "--no-baseline", action="store_true", help="time generation.generate only")
    parser.add_argument("--compile", help="FAST_GENERATE_COMPILE for this run (auto: reduce-overhead)")
    parser.add_argument("--experts", help="FAST_GENERATE_EXPERTS for this run (auto: grouped in bf16 on CUDA)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def build_model(geometry: str, layers: int | None, lora: bool, seed: int):
    """Random bf16 weights allocated on the GPU directly: the 20B geometry never touches CPU memory."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    shape = dict(GEOMETRIES[geometry])
    if layers:
        shape["num_hidden_layers"] = layers
    kinds = ["sliding_attention", "full_attention"]
    config = GptOssConfig(**shape, layer_types=[kinds[i % 2] for i in range(shape["num_hidden_layers"])],
                          pad_token_id=0, eos_token_id=None, bos_token_id=None, attn_implementation="eager")  # fmt: skip
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = GptOssForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.generation_config.max_length = None
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))  # fmt: skip
        with torch.no_grad():  # fresh adapters are a no-op: make them count, as after some training
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.02)
    return model.eval()


def make_prompts(batch: int, length: int, vocab: int, seed: int):
    """Left-padded: row lengths spread over the last 20 tokens, the longest fills the row."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : (row * 7) % min(20, length)] = 0
    return ids.masked_fill(mask == 0, 0).cuda(), mask.cuda()


def timed(fn):
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - start


def prefill_seconds(model, ids, mask, repeats: int) -> float:
    """The prompt's forward alone (both methods run the model's own forward for it)."""
    import torch
    from transformers import DynamicCache

    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():

        def forward():
            return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         past_key_values=DynamicCache(config=model.config), logits_to_keep=1)  # fmt: skip

        forward()
        return statistics.median(timed(forward)[1] for _ in range(repeats))


def first_divergence(expected, got, prompt_length: int) -> str:
    if expected.shape == got.shape and bool((expected == got).all()):
        return "yes"
    if expected.shape != got.shape:
        return f"shapes {tuple(expected.shape)} vs {tuple(got.shape)}"
    differ = (expected[:, prompt_length:] != got[:, prompt_length:]).nonzero()
    steps = differ[:, 1]
    first = int(steps.argmin())
    return f"no: first at step {int(steps[first])} (row {int(differ[first, 0])})"


def measure(name, run, batch, args, prefill):
    """Warm-up (reported as the first call), then the median of the repeats."""
    import torch

    torch.cuda.reset_peak_memory_stats()
    output, first = timed(run)
    seconds = statistics.median(timed(run)[1] for _ in range(args.repeats))
    decode_ms = 1000 * max(seconds - prefill, 0.0) / max(args.new_tokens - 1, 1)
    row = {"method": name, "batch": batch, "first_call_s": round(first, 2), "run_s": round(seconds, 3),
           "prefill_ms": round(1000 * prefill, 1), "decode_ms_per_step": round(decode_ms, 2),
           "tokens_per_s": round(batch * args.new_tokens / seconds, 1),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}  # fmt: skip
    return output, row


def table(rows) -> str:
    columns = ["method", "batch", "first_call_s", "run_s", "prefill_ms", "decode_ms_per_step", "tokens_per_s",
               "peak_gib", "same_greedy_tokens"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_generation.py: needs a CUDA GPU (none is visible to torch)", file=sys.stderr)
        return 2
    if args.compile:
        os.environ["FAST_GENERATE_COMPILE"] = args.compile
    if args.experts:
        os.environ["FAST_GENERATE_EXPERTS"] = args.experts
    import transformers
    from transformers import GenerationConfig

    import generation

    started = time.perf_counter()
    model = build_model(args.geometry, args.layers, args.lora, args.seed)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    built = time.perf_counter() - started
    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    environment = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "transformers": transformers.__version__, "geometry": args.geometry,
                   "layers": base.config.num_hidden_layers, "lora": args.lora, "new_tokens": args.new_tokens,
                   "prompt_tokens": args.prompt_tokens, "build_s": round(built, 1),
                   "weights_gib": round(torch.cuda.memory_allocated() / 2**30, 2)}  # fmt: skip
    print(f"# {json.dumps(environment)}", flush=True)
    rows = []
    for batch in args.batch:
        ids, mask = make_prompts(batch, args.prompt_tokens, base.config.vocab_size, args.seed + batch)
        prefill = prefill_seconds(model, ids, mask, args.repeats)
        expected = None
        if not args.no_baseline:
            theirs = functools.partial(model.generate, input_ids=ids, attention_mask=mask, generation_config=config)
            expected, row = measure("model.generate", theirs, batch, args, prefill)
            rows.append(row)
            print(json.dumps(row), flush=True)
        ours = functools.partial(generation.generate, model, ids, mask, config)
        got, row = measure("generation.generate", ours, batch, args, prefill)
        row["path"] = generation.describe(model)
        row["same_greedy_tokens"] = "n/a" if expected is None else first_divergence(expected, got, ids.shape[1])
        if expected is not None:
            row["speedup"] = round(rows[-1]["run_s"] / row["run_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(table(rows))
    print(f"\nfast path: {generation.describe(model)}")
    if args.json:
        args.json.write_text(json.dumps({"environment": environment, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
