"""The README's figure: a run's rewards and game score per step, from its metrics.jsonl.

    .venv/bin/python bench/demo_figure.py outputs/cpu-demo                 # writes docs/demo.png
    .venv/bin/python bench/demo_figure.py outputs --out my-run.png         # any run

Left: the total reward and the three rewards (mean over each step's completions). Right: the mean game score (points)
of the training games and, where the run evaluated, of the held-out games (eval/mean_score).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REWARDS = ("function_works", "no_cheating", "strategy_succeeds")


def read_metrics(run: Path) -> tuple[list[dict], list[dict]]:
    """(training logs, evaluation logs), one dict per logged step."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "reward" in r], [r for r in rows if "eval_mean_score" in r]


def draw(train: list[dict], evals: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in train]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4), constrained_layout=True)
    left.plot(steps, [r["reward"] for r in train], color="black", linewidth=1.6, label="reward (sum)")
    for name in REWARDS:
        left.plot(steps, [r[f"rewards/{name}/mean"] for r in train], linewidth=1, label=name)
    left.set(xlabel="step", ylabel="mean over the step's answers", title="rewards")
    left.legend(fontsize=8, loc="upper left")
    right.plot(steps, [r["game/points"] for r in train], linewidth=1, label="training games")
    if evals:
        right.plot([r["step"] for r in evals], [r["eval_mean_score"] for r in evals], "o-", label="held-out games (eval)")
    right.set(xlabel="step", ylabel="points (sum of merged tiles)", title="game score")
    right.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a run's output_dir (it holds metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "demo.png")
    parser.add_argument("--title", default="The CPU demo: `make demo` (a tiny model, 2 CPU cores)")
    args = parser.parse_args(argv)
    try:
        train, evals = read_metrics(args.run)
    except (OSError, ValueError) as exc:
        print(f"demo_figure: cannot read {args.run / 'metrics.jsonl'}: {exc}", file=sys.stderr)
        return 2
    if not train:
        print(f"demo_figure: {args.run / 'metrics.jsonl'} holds no training step", file=sys.stderr)
        return 2
    draw(train, evals, args.out, args.title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
