"""What the strategy archive costs a run, in the parts a per-step figure does not show: re-scoring one candidate on the
held-out games of the default board (3x3 to 512, 4 games: the evaluation's), for each baseline, and the bookkeeping
of an archive the size of a default run's (1000 steps x 8 answers): merging a step's records, and the files and the
checkpoint state written at each save. Medians of repeats.

With --trials N, whether its ranking holds: the corner player and the 24 biased random players (`random.choice` over
three keys weighted 3:2:1, every order: each earns less than the corner player over many games) are each written once
with 8 training games, then re-scored by the archive as a run's steps go (--archive_games, --archive_budget, a step of
--step_seconds), on a fresh secret start of held-out games each trial; counted: biased random players the archive
ranks above the corner player, and what the old ranking (the mean of the first 4, or 16, held-out games) would have
ranked above it on the same games. --local plays our own trusted players in this process (fast, for many trials)
instead of the sandbox.

    .venv/bin/python bench/bench_archive.py [--repeats 5] [--entries 8000]
    .venv/bin/python bench/bench_archive.py --trials 10                    # the GPT-OSS presets' settings, sandboxed
    .venv/bin/python bench/bench_archive.py --trials 200 --local           # the ranking rule alone, many trials
    .venv/bin/python bench/bench_archive.py --trials 200 --local --target 128 --player demo   # the CPU demo's board
"""

import argparse
import itertools
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import demo_data  # noqa: E402
import game2048  # noqa: E402
import rewards  # noqa: E402
import sandbox  # noqa: E402
import strategies  # noqa: E402
import strategy_archive  # noqa: E402
from strategy_archive import PlayedGame  # noqa: E402


def median_seconds(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def variant(code: str, i: int) -> str:
    """A distinct strategy of about the same size: one more constant in its syntax tree."""
    return code + f"\n\nVARIANT = {i}\n"


def biased_players() -> dict[str, str]:
    """The 24 biased random players: three keys weighted 3:2:1 (as the demo's "AAASSD"), in every order."""
    return {f"random {k[0] * 3 + k[1] * 2 + k[2]}": f"import random\n\ndef strategy(board):\n    return random.choice("
            f"{k[0] * 3 + k[1] * 2 + k[2]!r})\n" for k in itertools.permutations("WASD", 3)}  # fmt: skip


def play_here(codes: list[str], seeds: list[int], settings, deadline: float = float("inf")) -> dict:
    """rewards.play_answers for our own trusted players, in this process: the same games, no sandbox."""
    out = {}
    for code in codes:
        namespace = {}
        exec(code, namespace)
        games = []
        for seed in seeds:
            strategies.forget_state(namespace["strategy"])
            started = time.perf_counter()
            g = game2048.play_game(namespace["strategy"], seed=seed, size=settings.size, target=settings.target,
                                   probability_fours=settings.probability_fours)  # fmt: skip
            games.append(sandbox.GameResult(g.state(), g.moves, g.score(), g.max_tile(), time.perf_counter() - started))
        out[code] = games
    return out


def ranking_trial(players: dict[str, str], corner: str, settings, args, play) -> dict:
    """One run's worth of re-scoring on a fresh secret start; how many biased players rank above the corner player,
    now and by the old rule (the mean of the first 4 and 16 held-out games)."""
    start = secrets.randbits(47)
    with tempfile.TemporaryDirectory() as tmp:
        seeds = list(range(start, start + args.archive_games))
        archive = strategy_archive.StrategyArchive(settings, size=20, seeds=seeds, budget=args.archive_budget,
                                                   output_dir=Path(tmp))  # fmt: skip
        training = play([*players.values()], list(range(start + 10**6, start + 10**6 + 8)), settings)
        archive.merge([(1 + i, code, [strategy_archive.game_row(g, settings) for g in training[code]], False)
                       for i, code in enumerate(players.values())])  # fmt: skip
        steps = 0
        while archive.jobs() and steps < args.max_steps:  # steps of step_seconds each (not waited for)
            archive.end_step(args.step_seconds)
            steps += 1
        spent = archive.spent_seconds
        ranked = archive.ranked()
        ids = {strategy_archive.strategy_id(code): name for name, code in players.items()}
        corner_entry = archive.entries[strategy_archive.strategy_id(corner)]
        above = [ids[e.id] for e in ranked[: ranked.index(corner_entry)]] if corner_entry in ranked else ["unranked"]

        def old_rule(n):
            first = {e.id: statistics.fmean(e.held_out_games[:n]) for e in archive.entries.values() if e.held_out_games}
            return sum(v > first[corner_entry.id] for k, v in first.items() if k != corner_entry.id)

        return {"above": above, "old4": old_rule(4), "old16": old_rule(16), "steps": steps, "spent": spent,
                "games": {ids[e.id]: e.held_out["games"] for e in ranked}, "corner_rank": len(above) + 1}  # fmt: skip


def ranking(args) -> None:
    settings = rewards.RewardSettings(size=args.size, target=args.target)
    demo = next(text for kind, _, text in demo_data.EXAMPLES if kind == "corner").split("\n", 1)[1]
    corner = demo.removesuffix(demo_data.FENCE) if args.player == "demo" else strategies.source("corner")
    players = {"corner": corner, **biased_players()}
    play = play_here if args.local else rewards.play_answers
    if args.local:
        rewards.play_answers = play_here  # the archive's re-scoring too
    else:
        sandbox.start()
    print(f"ranking: corner ({args.player}) and {len(players) - 1} biased random players, {settings.size}x"
          f"{settings.size} to {settings.target}, --archive_games {args.archive_games}, --archive_budget "
          f"{args.archive_budget} of {args.step_seconds} s steps, {'in this process' if args.local else 'sandboxed'}, "
          f"{args.trials} trials")  # fmt: skip
    rows = []
    for trial in range(args.trials):
        started = time.monotonic()
        rows.append(ranking_trial(players, corner, settings, args, play))
        r = rows[-1]
        print(f"  trial {trial + 1}: corner rank {r['corner_rank']}, above it {r['above'] or '-'}; old rule: "
              f"{r['old4']} above on 4 games, {r['old16']} on 16; {r['steps']} steps, re-scoring {r['spent']:.1f} s, "
              f"held-out games {min(r['games'].values())}-{max(r['games'].values())}, "
              f"{time.monotonic() - started:.0f} s", flush=True)  # fmt: skip
    if not args.local:
        sandbox.shutdown()
    print(f"biased random players ranked above the corner player: {sum(len(r['above']) for r in rows)} in "
          f"{args.trials} trials (trials with any: {sum(bool(r['above']) for r in rows)}); the old rule, by the mean"
          f" of the first 4 games: {sum(r['old4'] for r in rows)} (trials with any: {sum(bool(r['old4']) for r in rows)}),"
          f" of 16: {sum(r['old16'] for r in rows)} (trials with any: {sum(bool(r['old16']) for r in rows)}); "
          f"steps to settle: median {statistics.median(r['steps'] for r in rows)}, "
          f"most {max(r['steps'] for r in rows)}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--entries", type=int, default=8000)
    parser.add_argument("--trials", type=int, default=0, help="measure the ranking instead (see above)")
    parser.add_argument("--local", action="store_true")
    parser.add_argument("--player", choices=["corner", "demo"], default="corner",
                        help="the corner player: strategies.py's, or the one the demo learns")
    parser.add_argument("--size", type=int, default=3)
    parser.add_argument("--target", type=int, default=512)
    parser.add_argument("--archive_games", type=int, default=16)
    parser.add_argument("--archive_budget", type=float, default=0.05)
    parser.add_argument("--step_seconds", type=float, default=33.0, help="a step's time (the 4-bit preset's: 33 s)")
    parser.add_argument("--max_steps", type=int, default=1000)
    args = parser.parse_args()
    if args.trials:
        return ranking(args)
    settings = rewards.RewardSettings()
    seeds = [0, 1, 2, 3]
    sandbox.start()
    print(f"re-scoring one candidate on {len(seeds)} held-out games, {settings.size}x{settings.size} to "
          f"{settings.target}, median of {args.repeats}:")  # fmt: skip
    for name in ["random", "greedy", "corner", "expectimax", "expectimax_compact"]:
        code = strategies.source(name)
        took = median_seconds(lambda code=code: rewards.play_answers([code], seeds, settings), args.repeats)
        print(f"  {name:20s} {took:6.3f} s")

    with tempfile.TemporaryDirectory() as tmp:
        archive = strategy_archive.StrategyArchive(settings, size=20, seeds=seeds, budget=0.05, output_dir=Path(tmp))
        code = strategies.source("expectimax")  # the longest baseline: ~3 KB
        rows = [PlayedGame(1.0, 100, False, 64, 0.01)] * settings.games
        archive.merge([(1 + i // 8, variant(code, i), rows, False) for i in range(args.entries)])
        for e in list(archive.entries.values())[:40]:
            e.status, e.held_out = "ranked", strategy_archive.held_out_stats(rows)  # with each game's reward
        fresh = iter(range(args.entries, 10**9))  # a step's answers are new ones: their trees are parsed
        merge = median_seconds(
            lambda: archive.merge([(1, variant(code, next(fresh)), rows, False) for _ in range(8)]), args.repeats
        )
        checkpoint = Path(tmp) / "checkpoint"
        checkpoint.mkdir()
        state = median_seconds(lambda: strategy_archive.save_state(archive, checkpoint), args.repeats)
        files = median_seconds(lambda: strategy_archive.write_files(archive, 1), args.repeats)
        size = (checkpoint / strategy_archive.STATE_FILE).stat().st_size
        print(f"an archive of {len(archive.entries)} distinct strategies of {len(code)} characters:")
        print(f"  merging a step's 8 new answers {merge * 1000:8.2f} ms")
        print(f"  the checkpoint's state         {state * 1000:8.2f} ms  ({size / 2**20:.1f} MiB)")
        print(f"  strategies/ (top 20)           {files * 1000:8.2f} ms")
    sandbox.shutdown()


if __name__ == "__main__":
    main()
