"""Sandbox speed: play_many against the notebook's serial in-process SIGALRM runner, in one run.

1. A batch of 16 mixed completions (good, slow, looping, crashing) on the notebook's board (6x6, 2048,
   5 s per game), scored (a) one after another in this process under signal.setitimer, as the public
   notebook does, and (b) by sandbox.play_many across the cores. Same seeds, interleaved repeats,
   medians; each repeat shuffles the batch (the same order for both), as a GRPO batch comes in any
   order and the order decides how well the long games pack onto the cores. Both sides get the same 5 s game limit and the sandbox's per-move limit is set to 5 s too,
   so the ratio measures parallelism and overhead, not a tighter limit; a line with the sandbox's
   default 1 s per-move limit is printed beside it.
   The looping completions are ones SIGALRM *can* stop (plain Python loops): a loop that catches
   BaseException, or one long C call, would hang the serial runner forever, so none is in the batch.
2. Per-child overhead: 200 trivial one-move games (the strategy answers an invalid key), one at a time
   with play() and all at once with play_many, against the same games in-process.
3. Scaling: a CPU-bound batch with workers=1 and workers=all cores.

    .venv/bin/python bench/bench_sandbox.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import game2048  # noqa: E402
import sandbox  # noqa: E402
import strategies  # noqa: E402

BOARD = dict(size=6, target=2048, probability_fours=0.10)
GAME_LIMIT = 5.0


def strategy(body: str) -> str:
    return "def strategy(board):\n" + "".join(f"    {line}\n" for line in body.strip().splitlines())


GOOD = [strategies.source(n) for n in ("random", "greedy", "corner")]
SLOW = [
    strategies.source("expectimax"),
    strategy(
        "import random\nsum(i * i for i in range(3000))  # needless work every move\nreturn random.choice('WASD')"
    ),
]
LOOPING = [
    strategy("while True:\n    pass"),
    strategy("x = 0\nwhile True:\n    x = [i * i for i in range(100)]"),
    strategy("import random\nif random.random() < 0.02:\n    while True:\n        pass\nreturn random.choice('WASD')"),
    strategy("for _ in iter(int, 1):\n    pass"),
]
CRASHING = [
    strategy("return 1 / 0"),
    strategy("return board[10][10]"),
    strategy("return 'Q'"),
    strategy("return strategy(board)"),
]
BATCH = GOOD * 2 + SLOW + LOOPING + CRASHING  # 6 good, 2 slow, 4 looping, 4 crashing
assert len(BATCH) == 16


# --- the reference: the notebook's way, in this process ---------------------------------------------


class _Alarm(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Alarm()


def notebook_play(code: str, seed: int) -> str:
    """exec the code here with full builtins, then play under a 5 s SIGALRM (the notebook's approach)."""
    namespace: dict = {}
    try:
        exec(code, namespace)
        fn = namespace["strategy"]
    except Exception:
        return "error"
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, GAME_LIMIT)
    try:
        return game2048.play_game(fn, seed=seed, **BOARD).state()
    except _Alarm:
        return "timeout"
    except Exception:
        return "error"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def serial(batch, seed):
    t = time.perf_counter()
    statuses = [notebook_play(code, seed) for code in batch]
    return time.perf_counter() - t, statuses


def parallel(batch, seed, move_limit, workers=None):
    game = sandbox.Game(**BOARD, game_time_limit=GAME_LIMIT, move_time_limit=move_limit)
    jobs = [(code, seed, game) for code in batch]
    t = time.perf_counter()
    results = sandbox.play_many(jobs, workers=workers)
    return time.perf_counter() - t, [r.status for r in results]


def per_child(n: int) -> dict[str, float]:
    """Milliseconds per trivial one-move game: in-process, play() in a loop, play_many at once."""
    code = strategy("return 'Q'")
    out = {}
    t = time.perf_counter()
    for i in range(n):
        namespace: dict = {}
        exec(code, namespace)
        game2048.play_game(namespace["strategy"], seed=i, **BOARD)
    out["in-process"] = (time.perf_counter() - t) / n * 1000
    t = time.perf_counter()
    for i in range(n):
        sandbox.play(code, seed=i, **BOARD)
    out["play() one at a time"] = (time.perf_counter() - t) / n * 1000
    t = time.perf_counter()
    sandbox.play_many([(code, i, sandbox.Game(**BOARD)) for i in range(n)])
    out["play_many, all cores"] = (time.perf_counter() - t) / n * 1000
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--children", type=int, default=200, help="trivial games for the overhead figure")
    args = parser.parse_args()

    sandbox.start()
    cores = len(os.sched_getaffinity(0))
    print(f"cores usable: {cores}; seccomp: {sandbox._server.seccomp}; load average: {os.getloadavg()}")
    times = {"serial": [], "sandbox": [], "sandbox-1s": []}
    for r in range(args.repeats):
        seed = 1000 + r
        batch = list(BATCH)
        random.Random(r).shuffle(batch)
        t_serial, s_serial = serial(batch, seed)
        t_par, s_par = parallel(batch, seed, move_limit=GAME_LIMIT)
        t_def, _ = parallel(batch, seed, move_limit=1.0)
        times["serial"].append(t_serial)
        times["sandbox"].append(t_par)
        times["sandbox-1s"].append(t_def)
        print(f"repeat {r}: serial {t_serial:.2f} s, play_many {t_par:.2f} s, play_many (1 s/move) {t_def:.2f} s")
        if r == 0:
            print(f"  statuses serial : {s_serial}")
            print(f"  statuses sandbox: {s_par}")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nbatch of 16 (median of {args.repeats}): serial in-process SIGALRM {med['serial']:.2f} s")
    print(
        f"  play_many, {cores} workers, same 5 s limits: {med['sandbox']:.2f} s -> {med['serial'] / med['sandbox']:.2f}x"
    )
    print(
        f"  play_many, default 1 s per-move limit    : {med['sandbox-1s']:.2f} s -> {med['serial'] / med['sandbox-1s']:.2f}x"
    )

    overhead = {k: [] for k in ("in-process", "play() one at a time", "play_many, all cores")}
    for _ in range(args.repeats):
        for k, v in per_child(args.children).items():
            overhead[k].append(v)
    print(f"\nper trivial one-move game, {args.children} games (median of {args.repeats}):")
    base = statistics.median(overhead["in-process"])
    for k, v in overhead.items():
        m = statistics.median(v)
        extra = "" if k == "in-process" else f"  (overhead {m - base:.2f} ms per child)"
        print(f"  {k:22s} {m:7.2f} ms{extra}")

    cpu_batch = [strategies.source("greedy")] * (2 * cores) + [strategies.source("corner")] * (2 * cores)
    one, many = [], []
    for r in range(args.repeats):
        one.append(parallel(cpu_batch, 2000 + r, move_limit=GAME_LIMIT, workers=1)[0])
        many.append(parallel(cpu_batch, 2000 + r, move_limit=GAME_LIMIT, workers=cores)[0])
    m1, mn = statistics.median(one), statistics.median(many)
    print(
        f"\nscaling, {len(cpu_batch)} CPU-bound games: 1 worker {m1:.2f} s, {cores} workers {mn:.2f} s -> {m1 / mn:.2f}x"
    )
    sandbox.shutdown()


if __name__ == "__main__":
    main()
