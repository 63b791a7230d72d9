"""Wall time to score one 16-completion batch with the default reward profile: the real reward function
(deduplicated, every game of the batch at once through sandbox.play_many) against the same games played
one after another (sandbox.play in a loop). Same seeds, interleaved repeats, medians.

    .venv/bin/python bench/bench_rewards.py [--repeats 5]
    .venv/bin/python bench/bench_rewards.py --baselines 10   # each baseline's mean reward, 10 steps
    .venv/bin/python bench/bench_rewards.py --stalling 8     # a batch of 8 answers that stall every game
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rewards  # noqa: E402
import sandbox  # noqa: E402
import strategies  # noqa: E402


def batch() -> list[str]:
    """A GRPO-like batch: mostly distinct strategies, a few duplicates, some broken and hostile ones."""
    fence = "```python\n{}```".format
    loop = "def strategy(board):\n    while True:\n        pass\n"
    crash = "def strategy(board):\n    return board[9][9]\n"
    cheat = "def strategy(board):\n    import os\n    return 'W'\n"
    names = ["random", "greedy", "corner", "expectimax"]
    good = [fence(strategies.source(n)) for n in names]
    return good + good[:3] + [fence(loop), fence(crash), fence(cheat), "no code", fence(loop)] + good


def serial(completions, settings, step):
    """The same games, one at a time: what a reward function without parallelism or dedup does."""
    seeds = rewards.game_seeds(settings, settings.game_salt, step, 0)
    scores = []
    for completion in completions:
        a = rewards.analyse(completion)
        if not a.playable:
            scores.append(0.0)
            continue
        results = [sandbox.play(a.code, seed=seed, **settings.rules()) for seed in seeds]
        scores.append(sum(rewards.graded_game_score(r, settings.target) for r in results) / len(results))
    return scores


def baseline_rewards(steps: int) -> None:
    """Each baseline's and each board-blind player's mean total reward (the three rewards summed) under the
    default settings, through the real reward functions and sandbox."""
    settings = rewards.RewardSettings()
    funcs = rewards.reward_functions(settings)
    names = [*strategies.BOARD_BLIND, *(n for n in strategies.BASELINES if n not in strategies.BOARD_BLIND)]
    completions = ["```python\n" + strategies.source(n) + "```" for n in names]
    totals = dict.fromkeys(names, 0.0)
    for step in range(steps):
        state = SimpleNamespace(global_step=step)
        per_func = [f(completions, trainer_state=state) for f in funcs]
        for i, name in enumerate(names):
            totals[name] += sum(scores[i] for scores in per_func)
    games = steps * settings.games
    print(f"default profile: {settings.profile}, {settings.size}x{settings.size}/{settings.target}, {games} games each")
    print("| player | mean total reward | of which strategy_succeeds |")
    print("|---|---:|---:|")
    for name in names:
        print(f"| {name} | {totals[name] / steps:.2f} | {totals[name] / steps - 2:.2f} |")


def stalling(answers: int, repeats: int, limit: float) -> None:
    """The worst batch for scoring time: every answer stalls until each game's limit. The rewards' judge (an answer
    that times out is not played on) against every game played to its limit, interleaved repeats, medians."""
    settings = rewards.RewardSettings(game_salt="bench", move_time_limit=limit, game_time_limit=limit)
    codes = [f"def strategy(board):\n    n = {i}\n    while True:\n        n += 1\n" for i in range(answers)]
    completions = ["```python\n" + code + "```" for code in codes]
    seeds = rewards.game_seeds(settings, "bench", 0, 0)
    judged, every = [], []
    for r in range(repeats):
        t = time.perf_counter()
        rewards.make_judge(settings)(completions, SimpleNamespace(global_step=r))
        judged.append(time.perf_counter() - t)
        t = time.perf_counter()
        sandbox.play_many([(code, seed, settings) for seed in seeds for code in codes])
        every.append(time.perf_counter() - t)
    j, e = statistics.median(judged), statistics.median(every)
    cores = len(os.sched_getaffinity(0))
    print(f"{answers} stalling answers x {settings.games} games, limit {limit:g} s a move and a game, {cores} cores")
    print(f"every game to its limit: median {e:.2f} s; the judge (stop at an answer's first timeout): {j:.2f} s")
    print(f"ratio {e / j:.2f}x; at the default 10 s a game that is {e * 10 / limit:.0f} s against {j * 10 / limit:.0f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baselines", type=int, metavar="STEPS", help="report baseline rewards instead")
    parser.add_argument("--stalling", type=int, metavar="ANSWERS", help="time a batch of answers that all stall")
    parser.add_argument("--limit", type=float, default=1.0, help="--stalling: seconds a move and a game may take")
    args = parser.parse_args()
    sandbox.start()
    if args.baselines:
        return baseline_rewards(args.baselines)
    if args.stalling:
        return stalling(args.stalling, args.repeats, args.limit)
    settings = rewards.RewardSettings(game_salt="bench")
    completions = batch()
    assert len(completions) == 16
    fast, slow, differ = [], [], 0
    for r in range(args.repeats):
        state = SimpleNamespace(global_step=r)
        succeeds = rewards.reward_functions(settings)[2]
        t = time.perf_counter()
        got = succeeds(completions, trainer_state=state)
        fast.append(time.perf_counter() - t)
        t = time.perf_counter()
        want = serial(completions, settings, r)
        slow.append(time.perf_counter() - t)
        # Same seeds, so the same scores but where a game near its time limit timed out on one side only.
        differ += sum(g != w for g, w in zip(got, want, strict=True))
    f, s = statistics.median(fast), statistics.median(slow)
    cores = len(os.sched_getaffinity(0))
    print(
        f"board {settings.size}x{settings.size}/{settings.target}, {settings.games} games per completion, {cores} cores"
    )
    print(f"reward function (parallel, deduplicated): median {f:.2f} s over {args.repeats} repeats")
    print(f"serial, one game after another:          median {s:.2f} s")
    print(f"speed-up: {s / f:.2f}x")
    print(f"completions scored differently (a game near its time limit): {differ} of {16 * args.repeats}")


if __name__ == "__main__":
    main()
