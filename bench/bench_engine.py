"""Random-play speed of game2048 against the engine a competent person writes first.

The reference below is plain list-of-lists code: filter and merge each row, rotate by transposing,
scan the grid for the state, scan for empty cells to spawn. Both engines draw spawns from
random.Random(seed) in the same order, so with the same seeds they play the very same games (checked),
and the runs alternate so that a noisy shared CPU slows both alike. Moves/s counts key presses,
no-ops included, in two loops: the engine alone (state(), do_action()) and the referee's loop, which
also copies the board for the strategy each move, as play_game does.

    .venv/bin/python bench/bench_engine.py [--games 20] [--repeats 7] [--sizes 6 4]
"""

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import game2048  # noqa: E402

KEYS = "WASD"


def reference_new_game(size, seed, target=2048, probability_fours=0.10):
    game = {"grid": [[0] * size for _ in range(size)], "score": 0, "state": "ongoing"}
    game.update(size=size, target=target, probability_fours=probability_fours, rng=random.Random(seed))
    reference_spawn(game)
    reference_spawn(game)
    game["state"] = reference_scan_state(game)
    return game


def reference_spawn(game):
    grid, rng = game["grid"], game["rng"]
    empties = [(i, j) for i, row in enumerate(grid) for j, v in enumerate(row) if v == 0]
    if empties:
        i, j = empties[rng.randrange(len(empties))]
        grid[i][j] = 4 if rng.random() < game["probability_fours"] else 2


def reference_merge_left(row):
    tiles = [v for v in row if v != 0]
    merged, gained, i = [], 0, 0
    while i < len(tiles):
        if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
            merged.append(tiles[i] * 2)
            gained += tiles[i] * 2
            i += 2
        else:
            merged.append(tiles[i])
            i += 1
    return merged + [0] * (len(row) - len(merged)), gained


def reference_transpose(grid):
    return [list(column) for column in zip(*grid)]


def reference_do_action(game, key):
    if game["state"] != "ongoing":
        return False
    key = key.strip().lower() if isinstance(key, str) else None
    if key not in ("w", "a", "s", "d"):
        game["state"] = "failed"
        return False
    grid = game["grid"]
    if key in ("w", "s"):
        grid = reference_transpose(grid)
    if key in ("d", "s"):
        grid = [row[::-1] for row in grid]
    results = [reference_merge_left(row) for row in grid]
    grid = [row for row, _ in results]
    if key in ("d", "s"):
        grid = [row[::-1] for row in grid]
    if key in ("w", "s"):
        grid = reference_transpose(grid)
    if grid == game["grid"]:
        return False
    game["grid"] = grid
    game["score"] += sum(gained for _, gained in results)
    reference_spawn(game)
    game["state"] = reference_scan_state(game)
    return True


def reference_scan_state(game):
    """Once per changed board: the target reached, else an empty cell or equal neighbours to go on."""
    grid, size = game["grid"], game["size"]
    if any(v >= game["target"] for row in grid for v in row):
        return "success"
    for i in range(size):
        for j in range(size):
            if grid[i][j] == 0:
                return "ongoing"
            if j + 1 < size and grid[i][j] == grid[i][j + 1]:
                return "ongoing"
            if i + 1 < size and grid[i][j] == grid[i + 1][j]:
                return "ongoing"
    return "failed"


def play_reference(seed, size, copy_board):
    game, rng, presses = reference_new_game(size, seed), random.Random(-seed - 1), 0
    while game["state"] == "ongoing":
        if copy_board:
            [row[:] for row in game["grid"]]
        reference_do_action(game, rng.choice(KEYS))
        presses += 1
    return presses, game["score"]


def play_ours(seed, size, copy_board):
    game, rng, presses = game2048.GameBoard(size=size, seed=seed), random.Random(-seed - 1), 0
    while game.state() == "ongoing":
        if copy_board:
            game.board()
        game.do_action(rng.choice(KEYS))
        presses += 1
    return presses, game.score()


def timed(play, seeds, size, copy_board):
    start = time.perf_counter()
    results = [play(seed, size, copy_board) for seed in seeds]
    return sum(p for p, _ in results) / (time.perf_counter() - start), results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", type=int, default=20, help="games per timed run")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per engine, interleaved")
    parser.add_argument("--sizes", type=int, nargs="+", default=[6, 4])
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, {args.games} games x {args.repeats} repeats")
    print("| board | loop | reference moves/s | game2048 moves/s | ratio of medians | per-repeat ratios |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        seeds = range(args.games)
        _, expected = timed(play_reference, seeds, size, False)  # warm-up, and the games both must play
        _, ours = timed(play_ours, seeds, size, False)
        assert ours == expected, f"{size}x{size}: the engines played different games"
        for copy_board, loop in ((False, "engine"), (True, "referee")):
            rates = {play_reference: [], play_ours: []}
            for repeat in range(args.repeats):
                order = [play_reference, play_ours] if repeat % 2 == 0 else [play_ours, play_reference]
                for play in order:
                    rates[play].append(timed(play, seeds, size, copy_board)[0])
            ref, fast = statistics.median(rates[play_reference]), statistics.median(rates[play_ours])
            ratios = sorted(o / r for o, r in zip(rates[play_ours], rates[play_reference]))
            print(
                f"| {size}x{size} | {loop} | {ref:,.0f} | {fast:,.0f} | {fast / ref:.2f}x "
                f"| {ratios[0]:.2f}-{ratios[-1]:.2f}x |"
            )


if __name__ == "__main__":
    main()
