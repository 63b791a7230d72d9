"""Decode speed of GPT-OSS on a GPU: transformers' model.generate (what TRL calls) against generation.generate.

Builds GPT-OSS with random weights straight on the GPU in bf16 (the 20B geometry: 24 layers, hidden 2880, 32
experts top-4, vocab 201088, alternating sliding/full attention; ~42 GB, no download, no CPU copy), optionally with
LoRA r=4 as training has it (q/k/v/o, and the fused experts through PEFT's target_parameters), then times both at
each batch size: left-padded prompts of about --prompt_tokens tokens, --new_tokens greedy tokens, no EOS (every
run decodes the full length), one warm-up (for ours: the torch.compile and the CUDA graph recording, reported as
"first call"), then the median of --repeats runs. Decode ms/step = (run - prefill) / (new_tokens - 1). Also
checks that greedy tokens agree; bf16 kernels may differ in the last bits, so the first divergence (row, step) is
reported rather than failed. Results as a markdown table, and with --json as a file.

With --model, a checkpoint is loaded as `train_2048.py --config configs/<--preset>.yaml` loads it for training
(the preset's backend, 4-bit or not, its LoRA; Unsloth's for_inference around generation, as in its rollouts), its
adapters' B drawn at random so that they count, and the prompt is the training prompt through the model's own chat
template, repeated --batch times: the decode step of the run itself. Options after `--` go to train_2048's parser.
With --turn PATH the timed part waits for its turn (PATH.ask, then PATH.go; PATH.done after): bench/gpu_matrix.py
runs other processes beside this one and stops them while it times. --cpu: the same on the CPU (the plumbing).

    python bench/bench_generation.py --geometry 20b --lora              # the issue-14 setting, H100: minutes
    python bench/bench_generation.py --geometry 20b --lora --batch 8    # shorter
    python bench/bench_generation.py --geometry 20b --layers 4 --lora   # a quick look
    FAST_GENERATE_COMPILE=none python bench/bench_generation.py ...     # our loop without CUDA graphs
    python bench/bench_generation.py --model /dev/shm/w/gpt-oss-20b-4-split-4bit --preset gpt-oss-20b --batch 8

Exit 2 with one line when there is no CUDA GPU (and no --cpu).
"""

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GEOMETRIES = {
    "20b": {"num_hidden_layers": 24, "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
            "vocab_size": 201088, "sliding_window": 128},
    "tiny": {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
             "vocab_size": 4096, "sliding_window": 32},
}  # fmt: skip


def parse_args(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
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
    parser.add_argument("--model", help="a checkpoint, loaded as train_2048.py loads it for --preset")
    parser.add_argument("--preset", default="gpt-oss-20b", help="with --model: the configs/*.yaml it is loaded for")
    parser.add_argument("--turn", help="wait for PATH.go (after writing PATH.ask) before timing; PATH.done after")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (the plumbing: tests use it)")
    args = parser.parse_args(argv)
    args.train_options = passthrough
    if args.model and not (Path(args.model) / "config.json").exists():
        parser.error(f"--model {args.model}: no config.json there")
    if args.model and not (ROOT / "configs" / f"{args.preset}.yaml").exists():
        parser.error(f"--preset {args.preset}: no configs/{args.preset}.yaml")
    return args


def build_model(geometry: str, layers: int | None, lora: bool, seed: int, device: str = "cuda"):
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
        with torch.device(device):
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


def load_for_training(folder: str, preset: str, options: list[str]):
    """(model, tokenizer, backend, training prompt inputs): `folder` loaded by train_2048's own code for `preset`, as a
    run of `python train_2048.py --config configs/<preset>.yaml --model_name_or_path <folder> <options>` loads it."""
    import torch

    import options as checked
    import train_2048

    argv = ["--config", str(ROOT / "configs" / f"{preset}.yaml"), "--model_name_or_path", folder,
            "--output_dir", tempfile.mkdtemp(prefix="bench-generation-"), *options]  # fmt: skip
    backend, cuda = checked.choose_backend(checked.early_options(argv))
    if backend == "unsloth":
        import unsloth  # noqa: F401  (before trl, as train_2048 imports it)
    from accelerate import PartialState

    import evaluation
    import rewards

    script_args, settings, training_args, model_args = checked.parse_args(argv)
    state = PartialState()
    prompt = rewards.build_prompt(settings)
    model, tokenizer = train_2048.load_policy(script_args, training_args, model_args, backend, prompt, state,
                                              Path(training_args.output_dir))  # fmt: skip
    with torch.no_grad():  # fresh adapters are a no-op: make them count, as after some training
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02)
    if backend == "unsloth":
        from unsloth import FastLanguageModel

        FastLanguageModel.for_inference(model)  # what Unsloth's unwrap does around every rollout
    else:
        model.eval()
    inputs = evaluation.prompt_inputs(tokenizer, settings, training_args.chat_template_kwargs or {})
    return model, tokenizer, backend, inputs


def make_prompts(batch: int, length: int, vocab: int, seed: int, device: str = "cuda"):
    """Left-padded: row lengths spread over the last 20 tokens, the longest fills the row."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : (row * 7) % min(20, length)] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def synchronize():
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn):
    synchronize()
    start = time.perf_counter()
    result = fn()
    synchronize()
    return result, time.perf_counter() - start


@contextlib.contextmanager
def turn(path: str | None):
    """The timed part, once bench/gpu_matrix.py says the machine is ours (PATH.go); PATH.done when it is over."""
    if path:
        Path(f"{path}.ask").touch()
        while not Path(f"{path}.go").exists():
            time.sleep(0.02)
    try:
        yield
    finally:
        if path:
            Path(f"{path}.done").touch()


def prefill_seconds(model, ids, mask, repeats: int, config) -> float:
    """The prompt's forward alone (both methods run the model's own forward for it); where a patched forward (Unsloth's)
    refuses these arguments, model.generate of one token: the prefill and one step."""
    import torch
    from transformers import DynamicCache

    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():

        def forward():
            return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         past_key_values=DynamicCache(config=model.config), logits_to_keep=1)  # fmt: skip

        try:
            forward()
        except Exception as error:  # noqa: BLE001 - a figure to report, not a reason to stop
            print(f"# prefill: the forward refused ({type(error).__name__}: {error}); timing a 1-token generate")
            one = config.__class__(**{**config.to_dict(), "max_new_tokens": 1})

            def forward():
                return model.generate(input_ids=ids, attention_mask=mask, generation_config=one)

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


def row_for(name, batch, args, first, runs, prefill):
    """One method's figures: the first call (compile, graph recording), then the median of the timed runs."""
    import torch

    seconds = statistics.median(runs)
    decode_ms = 1000 * max(seconds - prefill, 0.0) / max(args.new_tokens - 1, 1)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_initialized() else None
    return {"method": name, "batch": batch, "first_call_s": round(first, 2), "run_s": round(seconds, 3),
            "prefill_ms": round(1000 * prefill, 1), "decode_ms_per_step": round(decode_ms, 2),
            "tokens_per_s": round(batch * args.new_tokens / seconds, 1),
            "peak_gib": None if peak is None else round(peak, 2)}  # fmt: skip


def table(rows) -> str:
    columns = ["method", "batch", "first_call_s", "run_s", "prefill_ms", "decode_ms_per_step", "tokens_per_s",
               "peak_gib", "same_greedy_tokens"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("bench_generation.py: needs a CUDA GPU (none is visible to torch)", file=sys.stderr)
        return 2
    device = "cpu" if args.cpu else "cuda"
    if args.cpu:
        torch.set_num_threads(1)  # a tiny model is fastest on one thread, and CPUs here are shared
    if args.compile:
        os.environ["FAST_GENERATE_COMPILE"] = args.compile
    if args.experts:
        os.environ["FAST_GENERATE_EXPERTS"] = args.experts
    started = time.perf_counter()
    if args.model:
        model, tokenizer, backend, inputs = load_for_training(args.model, args.preset, args.train_options)
        pad = tokenizer.pad_token_id
    else:
        model = build_model(args.geometry, args.layers, args.lora, args.seed, device)
        backend, inputs, pad = None, None, 0
    import transformers
    from transformers import GenerationConfig

    import generation

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    built = time.perf_counter() - started
    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad, eos_token_id=None)
    environment = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                   "transformers": transformers.__version__, "geometry": "checkpoint" if args.model else args.geometry,
                   "model": args.model, "preset": args.preset if args.model else None, "backend": backend,
                   "layers": base.config.num_hidden_layers, "lora": bool(args.model) or args.lora,
                   "new_tokens": args.new_tokens,
                   "prompt_tokens": inputs["input_ids"].shape[1] if inputs is not None else args.prompt_tokens,
                   "build_s": round(built, 1),
                   "weights_gib": round(torch.cuda.memory_allocated() / 2**30, 2) if device == "cuda" else None}  # fmt: skip
    print(f"# {json.dumps(environment)}", flush=True)
    rows = []
    for batch in args.batch:
        if inputs is not None:  # the training prompt, once per row (one group: every row the same prompt)
            ids = inputs["input_ids"].repeat(batch, 1).to(model.device)
            mask = inputs["attention_mask"].repeat(batch, 1).to(model.device)
        else:
            ids, mask = make_prompts(batch, args.prompt_tokens, base.config.vocab_size, args.seed + batch, device)
        methods = {} if args.no_baseline else {"model.generate": functools.partial(
            model.generate, input_ids=ids, attention_mask=mask, generation_config=config)}  # fmt: skip
        methods["generation.generate"] = functools.partial(generation.generate, model, ids, mask, config)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        firsts = {name: timed(run) for name, run in methods.items()}  # warm-up: compiles, CUDA graphs
        with turn(args.turn):
            prefill = prefill_seconds(model, ids, mask, args.repeats, config)
            runs = {name: [timed(run)[1] for _ in range(args.repeats)] for name, run in methods.items()}
        expected = firsts["model.generate"][0] if "model.generate" in firsts else None
        for name in methods:
            row = row_for(name, batch, args, firsts[name][1], runs[name], prefill)
            if name == "generation.generate":
                row["path"] = generation.describe(model)
                got = firsts[name][0]
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
