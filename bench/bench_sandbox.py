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
4. Set-up per game: for answers of each baseline's size, the referee's time from its job to the child's first reply
   (the code compiled and run, then one board answered with an invalid key, which ends the game), one game at a time:
   what a game waits for, since referees and children are forked ahead as spares. Beside it, the trainer's wall time
   per game of the smallest answer one game at a time (set-up and teardown: a game is done once its referee has
   exited) and through play_many on all cores. `--compare DIR...` runs this part for this checkout
   and for others (say older commits' `git archive`) in alternating fresh processes, and prints them side by side.
5. `--actions`: what a refused system call costs under each seccomp action (ERRNO, KILL_PROCESS, TRAP, NOTIFY), and
   whether a process other than the child sees it (x86_64).

    .venv/bin/python bench/bench_sandbox.py [--repeats 3]
    .venv/bin/python bench/bench_sandbox.py --compare /tmp/before [/tmp/older ...] [--repeats 5] [--games 200]
    .venv/bin/python bench/bench_sandbox.py --actions [--children 200]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
_root = sys.argv[sys.argv.index("--root") + 1] if "--root" in sys.argv else os.path.join(HERE, "..")
sys.path.insert(0, _root)  # the checkout whose sandbox is measured (--root: another one, for --compare)

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


SETUP_ANSWERS = ("trivial", "random", "greedy", "corner", "expectimax")


def setup_answer(name: str) -> str:
    """An answer holding a baseline's code (helpers, classes, constants) whose strategy answers an invalid key."""
    invalid = "def strategy(board):\n    return 'Q'\n"
    if name == "trivial":
        return invalid
    return strategies.source(name).replace("def strategy(", "def _baseline(", 1) + "\n" + invalid


def setup_costs(games: int) -> dict[str, float]:
    """Milliseconds, medians over `games` games: the set-up of each answer (referee side, one game at a time), and the
    trainer's wall time per game of the trivial answer one at a time and through play_many on all cores."""
    sandbox.start()
    out = {}
    for name in SETUP_ANSWERS:
        results = sandbox.play_many([(setup_answer(name), i, sandbox.Game(**BOARD)) for i in range(games)], workers=1)
        assert all(r.status == "invalid" for r in results), results[0]
        out[name] = statistics.median(r.seconds for r in results) * 1000
    for label, workers in (("one at a time", 1), ("play_many", None)):  # set-up, teardown and the trainer's side
        t = time.perf_counter()
        sandbox.play_many([(setup_answer("trivial"), i, sandbox.Game(**BOARD)) for i in range(games)], workers=workers)
        out[f"wall per game, {label}"] = (time.perf_counter() - t) / games * 1000
    sandbox.shutdown()
    return out


def compare(others: list[str], repeats: int, games: int) -> None:
    """The set-up figures of this checkout and of the `others`, measured in alternating fresh processes; medians."""
    sides = {"this checkout": os.path.join(HERE, "..")} | {other: other for other in others}
    runs = {side: [] for side in sides}
    for r in range(repeats):
        for side, root in sides.items():
            cmd = [sys.executable, os.path.abspath(__file__), "--setup-only", "--root", root, "--games", str(games)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[side].append(json.loads(out.stdout.splitlines()[-1]))
        print(f"round {r}: " + "; ".join(f"{side}: {runs[side][-1]['expectimax']:.2f} ms (expectimax)" for side in sides))
    print(f"\nset-up per game, ms (median of {repeats} runs of {games} games each; load average {os.getloadavg()}):")
    print(f"  {'answer':28s}" + "".join(f"{side[-24:]:>26s}" for side in sides))
    for key in runs["this checkout"][0]:
        print(f"  {key:28s}" + "".join(f"{statistics.median(run[key] for run in runs[side]):26.2f}" for side in sides))


def seccomp_actions(children: int) -> dict[str, dict[str, float]]:
    """What a call outside the allowlist costs under each action pyseccomp offers, and whether a process the child
    cannot touch sees it. Forked children install the filter sandbox_child builds (with that default action) and then,
    honest, exit, or, escaped, make one refused call (getppid) and exit if they survive. Milliseconds per child, fork to
    reaped, medians. NOTIFY needs the filter installed with seccomp(NEW_LISTENER) and the listener handed to the parent
    (here pidfd_getfd), which then sees the call and kills the child, as a referee would."""
    import ctypes

    import pyseccomp

    import sandbox_child

    libc = ctypes.CDLL(None, use_errno=True)
    number = functools.partial(pyseccomp.resolve_syscall, pyseccomp.Arch.NATIVE)  # x86_64's and aarch64's differ
    sys_seccomp, sys_pidfd_open, sys_pidfd_getfd = number("seccomp"), number("pidfd_open"), number("pidfd_getfd")
    out = {}
    for action in ("ERRNO", "KILL_PROCESS", "TRAP", "NOTIFY"):
        program, why = sandbox_child.build_seccomp(action)
        assert program is not None, why
        out[action] = {}
        for escaped in (False, True):
            times, seen = [], 0
            for _ in range(children):
                r, w = os.pipe()
                go_r, go_w = os.pipe()
                t = time.perf_counter()
                pid = os.fork()
                if pid == 0:
                    os.dup2(go_r, 3)  # the filter lets the child read fd 3 and write fd 4 only
                    os.dup2(w, 4)
                    if action == "NOTIFY":
                        sandbox_child.prctl(38, 1)  # PR_SET_NO_NEW_PRIVS
                        fd = libc.syscall(sys_seccomp, 1, 8, ctypes.byref(program.fprog))  # SET_MODE_FILTER, listener
                        os.write(4, fd.to_bytes(4, "little"))
                        os.read(3, 1)  # until the parent holds the listener
                    else:
                        program.load()
                    if escaped:
                        os.getppid()
                    os._exit(0)
                os.close(w)
                if action == "NOTIFY":
                    fd = int.from_bytes(os.read(r, 4), "little")
                    pidfd = libc.syscall(sys_pidfd_open, pid, 0)
                    listener = libc.syscall(sys_pidfd_getfd, pidfd, fd, 0)
                    assert listener >= 0, ctypes.get_errno()
                    os.write(go_w, b"g")
                    if escaped and select.select([listener], [], [], 5)[0]:  # a notification is pending
                        seen += 1
                        os.kill(pid, signal.SIGKILL)
                    os.close(listener)
                    os.close(pidfd)
                status = os.waitpid(pid, 0)[1]
                times.append((time.perf_counter() - t) * 1000)
                seen += action != "NOTIFY" and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSYS
                for fd in (r, go_r, go_w):
                    os.close(fd)
            kind = "escaped" if escaped else "honest"
            out[action][kind] = statistics.median(times)
            if escaped:
                out[action]["seen outside the child"] = seen / children
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--children", type=int, default=200, help="trivial games for the overhead figure")
    parser.add_argument("--games", type=int, default=200, help="games per answer for the set-up figures")
    parser.add_argument("--compare", metavar="DIR", nargs="+", help="set-up per game of this checkout and those in DIR")
    parser.add_argument("--actions", action="store_true", help="only the cost of each seccomp action per child")
    parser.add_argument("--setup-only", action="store_true", help=argparse.SUPPRESS)  # one side of --compare, as JSON
    parser.add_argument("--root", help=argparse.SUPPRESS)  # the checkout to measure (read before the imports above)
    args = parser.parse_args()
    if args.setup_only:
        print(json.dumps(setup_costs(args.games)))
        return
    if args.compare:
        compare([os.path.abspath(d) for d in args.compare], args.repeats, args.games)
        return
    if args.actions:
        print(f"per child, ms, medians of {args.children} (load average {os.getloadavg()}):")
        for action, figures in seccomp_actions(args.children).items():
            print(f"  {action:13s} " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))
        return

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
    costs = [setup_costs(args.games) for _ in range(args.repeats)]
    print(f"\nset-up per game, ms (median of {args.repeats} runs of {args.games} games each):")
    for key in costs[0]:
        print(f"  {key:28s} {statistics.median(c[key] for c in costs):7.2f}")


if __name__ == "__main__":
    main()
