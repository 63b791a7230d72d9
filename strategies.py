"""Baseline 2048 players, written the way a model must answer: one self-contained function each.

Every player keeps its imports and helpers inside its own body and uses only `random`, `math`,
`itertools` and `functools`, because `source(name)` ships it as a string into a sandbox that allows
nothing else. The baselines put the reward in context: on 6x6 even random play reaches 2048.
`BOARD_BLIND` holds players that never look at the board, the floor an honest reward must keep low. `COMPACT` holds
short players, greedy and a depth-2 expectimax, sized like an answer that fits a completion budget.
"""

from __future__ import annotations

import inspect
import re
import statistics
import textwrap
import types
from collections import Counter

import game2048


def random_strategy(board):
    """Uniform random key. Uses the module-level `random` so a seeded game replays in a sandbox child."""
    import random

    return random.choice("WASD")


def greedy_strategy(board):
    """One ply: the changing move that leaves the most empty cells, then the most points."""

    def slide(line):
        tiles = [v for v in line if v]
        out, gained, i = [], 0, 0
        while i < len(tiles):
            if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
                out.append(tiles[i] * 2)
                gained += tiles[i] * 2
                i += 2
            else:
                out.append(tiles[i])
                i += 1
        return out + [0] * (len(line) - len(out)), gained

    def move(rows, key):
        if key in "WS":
            rows = [list(c) for c in zip(*rows)]
        if key in "DS":
            rows = [r[::-1] for r in rows]
        slid = [slide(r) for r in rows]
        new, gained = [r for r, _ in slid], sum(g for _, g in slid)
        if key in "DS":
            new = [r[::-1] for r in new]
        if key in "WS":
            new = [list(c) for c in zip(*new)]
        return new, gained

    rows = [list(r) for r in board]
    best, best_value = None, None
    for key in "ASDW":
        new, gained = move(rows, key)
        if new == rows:
            continue
        value = (sum(r.count(0) for r in new), gained)
        if best_value is None or value > best_value:
            best, best_value = key, value
    return best or "A"


def corner_strategy(board):
    """Keep the largest tile in the bottom-left corner: prefer left and down, then right, up last.

    Among left/down it takes the move that keeps the corner, then leaves the most empty cells; right
    and up are played only when neither left nor down changes the board.
    """

    def slide(line):
        tiles = [v for v in line if v]
        out, i = [], 0
        while i < len(tiles):
            if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
                out.append(tiles[i] * 2)
                i += 2
            else:
                out.append(tiles[i])
                i += 1
        return out + [0] * (len(line) - len(out))

    def move(rows, key):
        if key in "WS":
            rows = [list(c) for c in zip(*rows)]
        if key in "DS":
            rows = [r[::-1] for r in rows]
        new = [slide(r) for r in rows]
        if key in "DS":
            new = [r[::-1] for r in new]
        if key in "WS":
            new = [list(c) for c in zip(*new)]
        return new

    rows = [list(r) for r in board]
    best, best_value = None, None
    for key in "AS":
        new = move(rows, key)
        if new == rows:
            continue
        top = max(max(r) for r in new)
        value = (new[-1][0] == top, sum(r.count(0) for r in new), key == "A")
        if best_value is None or value > best_value:
            best, best_value = key, value
    if best:
        return best
    for key in "DW":
        if move(rows, key) != rows:
            return key
    return "A"


def expectimax_strategy(board):
    """Depth-limited expectimax: our moves are max nodes, tile spawns chance nodes (2 at 0.9, 4 at 0.1).

    Depth grows as the board fills (that is where a mistake loses the game) and chance nodes look at
    no more than four evenly spread empty cells, so a move costs a few ms even on 6x6. The leaf
    heuristic scores each row and column (empty cells, mergeable pairs, monotone ranks, minus a
    growing cost per tile so that merging pays) and adds a bonus for the largest tile in a corner.
    """
    import math

    slide_memo = {}
    line_memo = {}

    def slide(line):
        hit = slide_memo.get(line)
        if hit is None:
            tiles = [v for v in line if v]
            out, gained, i = [], 0, 0
            while i < len(tiles):
                if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
                    out.append(tiles[i] * 2)
                    gained += tiles[i] * 2
                    i += 2
                else:
                    out.append(tiles[i])
                    i += 1
            hit = tuple(out + [0] * (len(line) - len(out)))
            slide_memo[line] = hit
        return hit

    def move(rows, key):
        if key == "A":
            return tuple(slide(r) for r in rows)
        if key == "D":
            return tuple(slide(r[::-1])[::-1] for r in rows)
        if key == "W":
            return tuple(zip(*[slide(c) for c in zip(*rows)]))
        return tuple(zip(*[slide(c[::-1])[::-1] for c in zip(*rows)]))

    def line_score(line):
        hit = line_memo.get(line)
        if hit is None:
            ranks = [int(math.log2(v)) if v else 0 for v in line]
            empty = ranks.count(0)
            merges, previous = 0, 0
            for r in ranks:
                if r:
                    if r == previous:
                        merges += 1
                    previous = r
            up = down = 0
            for a, b in zip(ranks, ranks[1:]):
                if a > b:
                    down += a**4 - b**4
                else:
                    up += b**4 - a**4
            mass = sum(r**3.5 for r in ranks)
            hit = 270 * empty + 700 * merges - 47 * min(up, down) - 11 * mass
            line_memo[line] = hit
        return hit

    def evaluate(rows):
        score = sum(line_score(r) for r in rows) + sum(line_score(c) for c in zip(*rows))
        top = max(max(r) for r in rows)
        if top in (rows[0][0], rows[0][-1], rows[-1][0], rows[-1][-1]):
            score += 500 * int(math.log2(top))
        return score

    def best_move(rows, depth):
        best, best_value = None, -math.inf
        for key in "ASDW":
            new = move(rows, key)
            if new == rows:
                continue
            value = chance(new, depth)
            if value > best_value:
                best, best_value = key, value
        return best, best_value

    def chance(rows, depth):
        if depth <= 1:
            return evaluate(rows)
        empties = [(i, j) for i, r in enumerate(rows) for j, v in enumerate(r) if not v]
        if not empties:
            return evaluate(rows)
        step = max(1, len(empties) // cap)
        cells = empties[::step][:cap]
        total = 0.0
        for i, j in cells:
            for tile, p in ((2, 0.9), (4, 0.1)):
                spawned = rows[:i] + (rows[i][:j] + (tile,) + rows[i][j + 1 :],) + rows[i + 1 :]
                _, value = best_move(spawned, depth - 1)
                total += p * (value if value > -math.inf else -1e9)
        return total / len(cells)

    rows = tuple(tuple(r) for r in board)
    free = sum(r.count(0) for r in rows)
    depth, cap = (1, 0) if free > 12 else (2, 4) if free > 4 else (3, 4)
    key, _ = best_move(rows, depth)
    return key or "A"


def cycle_strategy(board):
    """Board-blind: up, left, down, right, over and over. Wins 87% of 5x5 games to 2048 without looking.

    Its place in the cycle lives on the function itself, as a model would write it. The body names the
    function `strategy`, the name `source()` and the sandbox give it, so run it through `load("cycle")`.
    """
    n = getattr(strategy, "n", 0)  # noqa: F821 (defined once loaded as `strategy`)
    strategy.n = n + 1  # noqa: F821
    return "WASD"[n % 4]


def corner_spin_strategy(board):
    """Board-blind: down, left, down, right, over and over, spinning the tiles in the bottom corners.

    The best of the 90 key cycles of length 1-4 on 4x4 (bench/reward_table.py). Like `cycle_strategy`
    it keeps its place on the function, so run it through `load("corner_spin")`.
    """
    n = getattr(strategy, "n", 0)  # noqa: F821 (defined once loaded as `strategy`)
    strategy.n = n + 1  # noqa: F821
    return "SASD"[n % 4]


# The compact players: what a model can afford to write inside a completion budget (bench/bench_budget.py counts the
# tokens). Written as a model would answer, short names and no comments or docstrings, since those are shipped too.
# The greedy one is one ply with one helper; the expectimax one searches two of our moves deep, every spawn between
# them (2 at 0.9, 4 at 0.1), and scores a board by empty cells, rough neighbours and the largest tile in a corner.


def greedy_compact_strategy(board):
    def move(rows, key):
        if key in "WS":
            rows = [list(c) for c in zip(*rows)]
        if key in "DS":
            rows = [r[::-1] for r in rows]
        new, points = [], 0
        for row in rows:
            tiles, out = [v for v in row if v], []
            while tiles:
                if len(tiles) > 1 and tiles[0] == tiles[1]:
                    out.append(tiles[0] * 2)
                    points += tiles[0] * 2
                    tiles = tiles[2:]
                else:
                    out.append(tiles.pop(0))
            new.append(out + [0] * (len(row) - len(out)))
        if key in "DS":
            new = [r[::-1] for r in new]
        if key in "WS":
            new = [list(c) for c in zip(*new)]
        return new, points

    rows = [list(r) for r in board]
    options = []
    for key in "ASDW":
        new, points = move(rows, key)
        options.append((new != rows, sum(r.count(0) for r in new), points, key))
    return max(options)[3]


def expectimax_compact_strategy(board):
    import math

    def move(rows, key):
        if key in "WS":
            rows = list(map(list, zip(*rows)))
        new = []
        for row in rows:
            tiles, out = [v for v in (row[::-1] if key in "DS" else row) if v], []
            while tiles:
                v = tiles.pop(0)
                if tiles and tiles[0] == v:
                    v *= 2
                    tiles.pop(0)
                out.append(v)
            out += [0] * (len(row) - len(out))
            new.append(out[::-1] if key in "DS" else out)
        return list(map(list, zip(*new))) if key in "WS" else new

    def value(rows):
        lines = rows + list(map(list, zip(*rows)))
        rough = sum(abs(math.log2(a) - math.log2(b)) for line in lines for a, b in zip(line, line[1:]) if a and b)
        top = max(map(max, rows))
        corner = top in (rows[0][0], rows[0][-1], rows[-1][0], rows[-1][-1])
        return 3 * sum(r.count(0) for r in rows) - rough + 4 * corner * math.log2(top)

    def expect(rows, depth):
        cells = [(i, j) for i, r in enumerate(rows) for j, v in enumerate(r) if not v]
        if not depth or not cells:
            return value(rows)
        total = 0
        for i, j in cells:
            for tile, p in ((2, 0.9), (4, 0.1)):
                rows[i][j] = tile
                total += p * max([expect(new, depth - 1) for k in "ASDW" if (new := move(rows, k)) != rows] or [-99])
            rows[i][j] = 0
        return total / len(cells)

    rows = [list(r) for r in board]
    return max([(expect(new, 1), k) for k in "ASDW" if (new := move(rows, k)) != rows] or [(0, "A")])[1]


BASELINES = {
    "random": random_strategy,
    "greedy": greedy_strategy,
    "corner": corner_strategy,
    "expectimax": expectimax_strategy,
}

# Players that never read the board: a reward they can earn is one a model gets without learning to play.
BOARD_BLIND = {
    "random": random_strategy,
    "cycle": cycle_strategy,
    "corner_spin": corner_spin_strategy,
}

COMPACT = {
    "greedy_compact": greedy_compact_strategy,
    "expectimax_compact": expectimax_compact_strategy,
}


def source(name: str) -> str:
    """The code a sandbox runs for any player named here: its source, the def line renamed to `strategy`."""
    player = {**BASELINES, **BOARD_BLIND, **COMPACT}[name]
    text = textwrap.dedent(inspect.getsource(player))
    renamed, count = re.subn(r"^def \w+\(board\):", "def strategy(board):", text, count=1, flags=re.M)
    if count != 1:
        raise ValueError(f"baseline {name!r} has no `def ...(board):` line")
    return renamed


def load(name: str):
    """A fresh `strategy` function from `source(name)`, loaded as the sandbox loads it.

    The board-blind cycles refer to themselves as `strategy`, a name that exists only once loaded this way.
    """
    namespace = {"__builtins__": __builtins__}
    exec(source(name), namespace)
    return namespace["strategy"]


def forget_state(strategy) -> None:
    """Delete what a player keeps on itself (`strategy.n = ...`), so its next game starts as a fresh load would.

    In training every game loads the code in a new sandbox child; in one process the same function object
    plays game after game, and a counter left over from the last game would change the next one.
    Dunder attributes (`__wrapped__`, ...) stay: they are how the function was made, not its play.
    """
    if isinstance(strategy, types.FunctionType):
        for name in [a for a in vars(strategy) if not a.startswith("__")]:
            delattr(strategy, name)


def play_games(strategy, n: int, seed: int = 0, **board) -> dict:
    """Play n seeded games (seeds seed..seed+n-1) and summarise them; board kwargs go to GameBoard.

    The player's own attributes are reset before each game (`forget_state`), so a stateful player plays
    game i the same whether it is played alone or after others, as in the sandbox.
    """
    games = []
    for i in range(n):
        forget_state(strategy)
        games.append(game2048.play_game(strategy, seed=seed + i, **board))
    scores = [g.score() for g in games]
    max_tiles = [g.max_tile() for g in games]
    moves = [g.moves for g in games]
    return {
        "games": n,
        "win_rate": sum(g.state() == "success" for g in games) / n if n else 0.0,
        "scores": scores,
        "max_tiles": max_tiles,
        "max_tile_counts": dict(sorted(Counter(max_tiles).items())),
        "moves": moves,
        "median_moves": statistics.median(moves) if moves else 0,
        "median_score": statistics.median(scores) if scores else 0,
    }
