"""The CPU demo's spread: `train_2048.py --config configs/cpu-demo.yaml` run N times, one at a time, each with a fresh
secret game salt (as `make demo` runs it), and each judged as tests/test_train_runs.py judges its fixed-salt run: the
mean reward of the first and of the last 10 steps, which of the demo's example answers 32 samples of the trained model
are (demo_data.answer_kind), and which the strategy archive ranks best. A run learned the corner player when it meets
that test's bar: the last 10 steps' reward at least 4 above the first 10's, 16 or more of the 32 samples the corner
player and more than 4 times the cycle's, and the archive's best the corner player.

    python bench/bench_demo.py --runs 20 --json demo.json
    ATEN_CPU_CAPABILITY=default python bench/bench_demo.py --runs 20   # torch's kernels without AVX2/AVX512
    python bench/bench_demo.py --runs 5 -- --learning_rate 1e-3       # flags after -- go to every run

The wall time is the whole train_2048.py process (start-up, warm start, GRPO, evaluations, the verified save). Each
run's salt is printed, so a run can be repeated exactly (on the same CPU kind) with --game_salt.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run(index: int, work: Path, extra: list[str]) -> dict:
    import demo_data
    import evaluation
    import trainer

    out = work / f"run-{index}"
    command = [sys.executable, str(ROOT / "train_2048.py"), "--config", str(ROOT / "configs" / "cpu-demo.yaml"),
               "--output_dir", str(out), *extra]  # fmt: skip
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    steps = [m["reward"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward" in m]
    first, last = statistics.fmean(steps[:10]), statistics.fmean(steps[-10:])
    kinds = collections.Counter(demo_data.answer_kind(text) for text in demo_data.sample_answers(out))
    best = "none"  # a run too short for the archive to rank a strategy
    if (out / "strategies" / "best.py").exists():
        code = evaluation.file_source(str(out / "strategies" / "best.py")).samples[0].code  # the model's, as data
        best = demo_data.answer_kind(f"```python\n{code}```")
    checkpoint = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    salt = trainer.saved_salt(checkpoint)
    shutil.rmtree(out)
    return {"run": index, "salt": salt, "first10": first, "last10": last,
            "kinds": dict(kinds), "best": best, "learned": demo_data.learned(first, last, kinds) and best == "corner", "seconds": seconds,
            "load": os.getloadavg()[0]}  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = ["| run | salt | first 10 steps | last 10 steps | corner of 32 | other answers of 32 | archive's best | "
             "learned | wall | load |", "|---:|---|---:|---:|---:|---|---|---|---:|---:|"]  # fmt: skip
    for r in rows:
        others = ", ".join(f"{k} {n}" for k, n in sorted(r["kinds"].items()) if k != "corner") or "-"
        lines.append(f"| {r['run']} | {r['salt'][:8]}… | {r['first10']:.2f} | {r['last10']:.2f} | "
                     f"{r['kinds'].get('corner', 0)} | {others} | {r['best']} | {'yes' if r['learned'] else 'NO'} | "
                     f"{r['seconds']:.0f} s | {r['load']:.1f} |")  # fmt: skip
    seconds = [r["seconds"] for r in rows]
    lines.append(f"\nlearned the corner player: {sum(r['learned'] for r in rows)} of {len(rows)} runs; wall time median "
                 f"{statistics.median(seconds):.0f} s, longest {max(seconds):.0f} s (load: the 1-minute load average "
                 "of the machine as the run ended)")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", help="also write every run to this file")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    import models

    models.quiet_library_imports()  # before trl (trainer.py imports it), as the commands do
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as tmp:
        for index in range(1, args.runs + 1):
            rows.append(run(index, Path(tmp), extra))
            r = rows[-1]
            print(f"run {index}: {r['first10']:.2f} -> {r['last10']:.2f}, {r['kinds']}, best {r['best']}, "
                  f"{r['seconds']:.0f} s, salt {r['salt']}", flush=True)  # fmt: skip
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
