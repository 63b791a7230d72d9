"""What a cut-off completion teaches, on the CPU demo: the share of board-reading answers the trained model writes.

The demo's tiny model is warm-started on example answers (demo_data.py) and trained with GRPO. With a completion
budget below the board-reading answer's length (the corner player: 20 tokens of the demo's tokenizer) but above the
board-blind ones' (random 10, cycle 12), every board-reading answer is cut off. How the run treats those cut-off
answers decides what it learns:

    score    the rewards score them as written (no code block: -3): today's default, it teaches brevity
    mask     TRL's mask_truncated_completions: no loss on them, but their -3 still pulls their group's baseline down
    penalty  DAPO's soft overlong punishment (--overlong_penalty) on top of the scores
    skip     --truncated skip: no reward and no gradient (out of the group's baseline too) and the loss mask
    warm     the warm start alone (learning rate 0): the share before GRPO, for reference

After each run, 32 answers are sampled from the trained adapter with a budget that holds every example answer, and
each is classified as corner (reads the board), cycle, random or other. Seeds are the training seed and game salt.

    python bench/bench_truncation.py                                    # the tight and the sufficient budget, 5 seeds
    python bench/bench_truncation.py --budgets 16 --handlings score skip --seeds 2 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HANDLINGS = {
    "score": [],
    "mask": ["--mask_truncated_completions", "true"],
    "penalty": ["--overlong_penalty", "4"],
    "skip": ["--truncated", "skip"],
    "warm": ["--learning_rate", "0", "--max_steps", "1"],
}
SAMPLES, SAMPLE_TOKENS = 32, 96


def run(handling: str, budget: int, seed: int, work: Path) -> dict:
    from trl import ModelConfig

    import demo_data
    import evaluation
    import models
    import rewards

    out = work / f"{handling}-{budget}-{seed}"
    command = [sys.executable, str(ROOT / "train_2048.py"), "--config", str(ROOT / "configs" / "cpu-demo.yaml"),
               "--output_dir", str(out), "--max_completion_length", str(budget), "--seed", str(seed),
               "--game_salt", f"truncation-{seed}", "--eval_strategy", "no", "--verify_save", "false",
               *HANDLINGS[handling]]  # fmt: skip
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "reward" in m]
    model, tokenizer = models.load_model(str(out / "tiny-model"), ModelConfig(), adapter=str(out / "final"))
    model.eval()
    inputs = evaluation.prompt_inputs(tokenizer, rewards.RewardSettings(size=3, target=128), {})
    config = evaluation.generation_config(evaluation.sampling_options(temperature=1.0), tokenizer, SAMPLE_TOKENS)
    ids = evaluation.sample_batch(model, tokenizer, inputs, index=0, size=SAMPLES, seed=1000 + seed, config=config)
    kinds = collections.Counter(demo_data.answer_kind(t) for t in evaluation.decode(tokenizer, ids))
    return {
        "handling": handling, "budget": budget, "seed": seed, "kinds": dict(kinds),
        "board_reading": kinds["corner"] / SAMPLES,
        "unfinished": sum(tokenizer.eos_token_id not in row for row in ids) / SAMPLES,  # no end within 96 tokens
        "clipped_last10": statistics.fmean(m.get("completions/clipped_ratio", 0.0) for m in steps[-10:]),
        "seconds": time.monotonic() - started,
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = ["| budget | handling | board-reading share (mean over seeds) | per seed | answers that never end | "
             "clipped, last 10 steps |", "|---:|---|---:|---|---:|---:|"]  # fmt: skip
    groups = collections.defaultdict(list)
    for row in rows:
        groups[row["budget"], row["handling"]].append(row)
    for (budget, handling), group in groups.items():
        shares = [r["board_reading"] for r in group]
        lines.append(
            f"| {budget} | {handling} | {statistics.fmean(shares):.0%} | {' '.join(f'{s:.0%}' for s in shares)} "
            f"| {statistics.fmean(r.get('unfinished', float('nan')) for r in group):.0%} "
            f"| {statistics.fmean(r['clipped_last10'] for r in group):.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 96], help="max_completion_length values")
    parser.add_argument("--handlings", nargs="+", choices=list(HANDLINGS), help="default: all at the first budget, "
                        "score and skip at the others")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--json", help="also write every run to this file")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="truncation-") as tmp:
        for i, budget in enumerate(args.budgets):
            handlings = args.handlings or (list(HANDLINGS) if i == 0 else ["score", "skip"])
            for handling in handlings:
                for seed in range(args.seeds):
                    rows.append(run(handling, budget, seed, Path(tmp)))
                    r = rows[-1]
                    print(f"budget {budget} {handling} seed {seed}: {r['kinds']} ({r['seconds']:.0f} s)", flush=True)
                    if args.json:
                        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
