"""What the baselines score, measured: win rate, median moves and median max tile per board size.

The reward pays +20 for reaching the target, so this table says what a strategy must beat: on 6x6
random play already wins. Seeds are 0..n-1 in every cell, so a re-run prints the same table.

    .venv/bin/python bench/baseline_table.py [--games 200] [--expectimax-games 50] [--workers 2]
"""

import argparse
import statistics
import sys
import time
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import game2048  # noqa: E402
import strategies  # noqa: E402


def play_one(job):
    """One seeded game in a worker: (baseline, size, seed) -> what the table needs."""
    name, size, seed, board = job
    game = game2048.play_game(strategies.BASELINES[name], seed=seed, size=size, **board)
    return name, size, game.state() == "success", game.moves, game.max_tile()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", type=int, default=200, help="seeded games per cell")
    parser.add_argument("--expectimax-games", type=int, default=50, help="expectimax is ~1000x slower per move")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 5, 6])
    parser.add_argument("--baselines", nargs="+", default=list(strategies.BASELINES), choices=strategies.BASELINES)
    parser.add_argument("--target", type=int, default=2048)
    parser.add_argument("--probability-fours", type=float, default=0.10)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    board = {"target": args.target, "probability_fours": args.probability_fours}
    jobs = [
        (name, size, seed, board)
        for name in args.baselines
        for size in args.sizes
        for seed in range(args.expectimax_games if name == "expectimax" else args.games)
    ]
    jobs.sort(key=lambda job: job[0] != "expectimax")  # the long games first, so both workers end together
    start = time.perf_counter()
    results = {}
    with Pool(args.workers) as pool:
        for name, size, won, moves, max_tile in pool.imap_unordered(play_one, jobs):
            results.setdefault((name, size), []).append((won, moves, max_tile))
    wall = time.perf_counter() - start

    print(f"target {args.target}, p(4)={args.probability_fours}, seeds 0..n-1 per cell, {wall:.0f} s wall")
    print("| board | baseline | games | win rate | median moves | median max tile |")
    print("|---|---|---:|---:|---:|---:|")
    for size in args.sizes:
        for name in args.baselines:
            games = results[(name, size)]
            wins = sum(won for won, _, _ in games)
            moves = statistics.median(m for _, m, _ in games)
            max_tile = statistics.median(t for _, _, t in games)
            print(
                f"| {size}x{size} | {name} | {len(games)} | {100 * wins / len(games):.1f}% | {moves:g} | {max_tile:g} |"
            )


if __name__ == "__main__":
    main()
