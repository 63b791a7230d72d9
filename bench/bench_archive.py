"""What the strategy archive costs a run, in the parts a per-step figure does not show: re-scoring one candidate on the
held-out games of the default board (3x3 to 512, 4 games: the evaluation's), for each baseline, and the bookkeeping
of an archive the size of a default run's (1000 steps x 8 answers): merging a step's records, and the files and the
checkpoint state written at each save. Medians of repeats.

    .venv/bin/python bench/bench_archive.py [--repeats 5] [--entries 8000]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--entries", type=int, default=8000)
    args = parser.parse_args()
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
            e.status, e.held_out = "ranked", {"games": 4, "reward": 1.0, "score": 100.0, "win_rate": 0.0,
                                              "max_tile": 64, "seconds": 0.1}  # fmt: skip
        fresh = iter(range(args.entries, 10**9))  # a step's answers are new ones: their trees are parsed
        merge = median_seconds(
            lambda: archive.merge([(1, variant(code, next(fresh)), rows, False) for _ in range(8)]), args.repeats
        )
        checkpoint = Path(tmp) / "checkpoint"
        checkpoint.mkdir()
        state = median_seconds(lambda: archive.save_state(checkpoint), args.repeats)
        files = median_seconds(lambda: archive.write_files(1), args.repeats)
        size = (checkpoint / strategy_archive.STATE_FILE).stat().st_size
        print(f"an archive of {len(archive.entries)} distinct strategies of {len(code)} characters:")
        print(f"  merging a step's 8 new answers {merge * 1000:8.2f} ms")
        print(f"  the checkpoint's state         {state * 1000:8.2f} ms  ({size / 2**20:.1f} MiB)")
        print(f"  strategies/ (top 20)           {files * 1000:8.2f} ms")
    sandbox.shutdown()


if __name__ == "__main__":
    main()
