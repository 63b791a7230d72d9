"""The 2048 game: exact original rules, seeded, fast.

Rows are slid through a memo keyed by the row's tuple: a 6x6 game revisits the same few thousand rows
millions of times, so after warm-up a move costs N dict look-ups instead of N Python merge loops.
Everything here is trusted code: the sandbox keeps untrusted strategies on the other side of a pipe.
"""

from __future__ import annotations

import hashlib
import random

DIRECTIONS = ("up", "left", "down", "right")  # the order a `keys` alphabet is written in
DEFAULT_KEYS = "WASD"


def _slide_row_left(row: tuple) -> tuple[tuple, int]:
    """Original-game slide of one row toward index 0: each tile merges once, the wall-side pair first."""
    tiles = [v for v in row if v]
    out, gained, i = [], 0, 0
    while i < len(tiles):
        if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
            merged = tiles[i] * 2
            out.append(merged)
            gained += merged
            i += 2
        else:
            out.append(tiles[i])
            i += 1
    out.extend([0] * (len(row) - len(out)))
    return tuple(out), gained


_LEFT: dict[tuple, tuple[tuple, int]] = {}  # row -> (slid row, gained); bounded by the rows a game visits
_RIGHT: dict[tuple, tuple[tuple, int]] = {}
_MEMO_LIMIT = 1 << 20


def _left(row: tuple) -> tuple[tuple, int]:
    hit = _LEFT.get(row)
    if hit is None:
        hit = _slide_row_left(row)
        if len(_LEFT) < _MEMO_LIMIT:
            _LEFT[row] = hit
    return hit


def _right(row: tuple) -> tuple[tuple, int]:
    hit = _RIGHT.get(row)
    if hit is None:
        slid, gained = _slide_row_left(row[::-1])
        hit = (slid[::-1], gained)
        if len(_RIGHT) < _MEMO_LIMIT:
            _RIGHT[row] = hit
    return hit


def _move_rows(rows: list[tuple], direction: str) -> tuple[list[tuple], int]:
    """Slide a board held as a list of row tuples; returns the new rows and the points gained."""
    if direction == "left" or direction == "right":
        slide = _left if direction == "left" else _right
        results = [slide(r) for r in rows]
        return [r for r, _ in results], sum(g for _, g in results)
    slide = _left if direction == "up" else _right
    results = [slide(c) for c in zip(*rows)]
    return list(zip(*[c for c, _ in results])), sum(g for _, g in results)


def key_map(keys: str = DEFAULT_KEYS) -> dict[str, str]:
    """Case-folded key -> direction, for an alphabet written up, left, down, right."""
    if not isinstance(keys, str) or len(keys) != 4 or len({k.casefold() for k in keys}) != 4:
        raise ValueError(f"keys must be four distinct characters (up, left, down, right), got {keys!r}")
    return {k.casefold(): d for k, d in zip(keys, DIRECTIONS)}


def parse_key(key, mapping: dict[str, str]) -> str | None:
    """The direction a key names, or None. Uses str's own methods so a str subclass cannot lie."""
    if not isinstance(key, str):
        return None
    return mapping.get(str.casefold(str.strip(key)))


def apply_move(board, key, keys: str = DEFAULT_KEYS) -> tuple[list[list[int]], int, bool]:
    """Pure move without a spawn: (new board, points gained, whether anything moved)."""
    direction = parse_key(key, key_map(keys))
    if direction is None:
        raise ValueError(f"key must be one of {keys!r} (any case), got {key!r}")
    rows = [tuple(r) for r in board]
    if not rows or any(len(r) != len(rows) for r in rows):
        raise ValueError("board must be a non-empty square list of lists")
    new_rows, gained = _move_rows(rows, direction)
    return [list(r) for r in new_rows], gained, new_rows != rows


def can_move(rows) -> bool:
    """True while some move changes the board: an empty cell or two equal neighbours."""
    for r in rows:
        if 0 in r:
            return True
        for a, b in zip(r, r[1:]):
            if a == b:
                return True
    for upper, lower in zip(rows, rows[1:]):
        for a, b in zip(upper, lower):
            if a == b:
                return True
    return False


class GameBoard:
    """One seeded game. Same seed and same keys give the same game, always."""

    def __init__(
        self,
        size: int = 6,
        target: int = 2048,
        probability_fours: float = 0.10,
        seed: int | None = None,
        keys: str = DEFAULT_KEYS,
        max_idle_moves: int | None = None,
    ):
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise ValueError(f"size must be an integer >= 2, got {size!r}")
        if isinstance(target, bool) or not isinstance(target, int) or target < 4 or target & (target - 1):
            raise ValueError(f"target must be a power of two >= 4, got {target!r}")
        if (
            isinstance(probability_fours, bool)
            or not isinstance(probability_fours, (int, float))
            or not (0.0 <= probability_fours <= 1.0)
        ):
            raise ValueError(f"probability_fours must be a number in [0, 1], got {probability_fours!r}")
        self.size, self.target, self.probability_fours = size, target, float(probability_fours)
        self.keys = keys
        self._keys = key_map(keys)
        self._rng = random.Random(seed)
        self._rows = [(0,) * size for _ in range(size)]
        self._score = 0
        self._max_tile = 0
        self._invalid = False
        self.moves = 0  # moves that changed the board
        self.idle_moves = 0  # keys in a row that changed nothing
        self.max_idle_moves = max_idle_moves
        self._spawn()
        self._spawn()

    def _spawn(self) -> None:
        empties = [(i, j) for i, r in enumerate(self._rows) for j, v in enumerate(r) if not v]
        if not empties:
            return
        i, j = empties[self._rng.randrange(len(empties))]
        value = 4 if self._rng.random() < self.probability_fours else 2
        row = list(self._rows[i])
        row[j] = value
        self._rows[i] = tuple(row)
        self._max_tile = max(self._max_tile, value)

    def do_action(self, key) -> bool:
        """Play one key; True if the board changed. A key outside the alphabet ends the game as failed."""
        if self.state() != "ongoing":
            return False
        direction = parse_key(key, self._keys)
        if direction is None:
            self._invalid = True
            return False
        new_rows, gained = _move_rows(self._rows, direction)
        if new_rows == self._rows:
            self.idle_moves += 1
            return False
        self.moves += 1
        self.idle_moves = 0
        self._rows = new_rows
        self._score += gained
        if gained:
            self._max_tile = max(self._max_tile, max(max(r) for r in new_rows))
        self._spawn()
        return True

    def state(self) -> str:
        if self._max_tile >= self.target:
            return "success"
        if self._invalid or not can_move(self._rows):
            return "failed"
        if self.max_idle_moves is not None and self.idle_moves >= self.max_idle_moves:
            return "failed"  # a strategy that repeats a useless key would otherwise play forever
        return "ongoing"

    def board(self) -> list[list[int]]:
        """A fresh copy: mutating it never touches the game."""
        return [list(r) for r in self._rows]

    def score(self) -> int:
        return self._score

    def max_tile(self) -> int:
        return self._max_tile

    def __str__(self) -> str:
        return render_text(self._rows)


MAX_IDLE_MOVES = 100  # play_game's cut-off for strategies stuck on keys that change nothing


def strategy_seed(seed: int | None) -> int | None:
    """Seed for the strategy's own `random` module: fixed per game, but one-way, so a strategy that
    reads its generator learns nothing about the engine's (a plain `seed` would replay the spawns)."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.sha256(f"train_2048/strategy/{seed}".encode()).digest()[:8], "big")


def play_game(strategy, *, seed=None, max_idle_moves: int = MAX_IDLE_MOVES, **board_kwargs) -> GameBoard:
    """Play one game to its end; the strategy sees a fresh copy of the board each move.

    The one game loop for direct play and the sandbox's referee: `strategy(board) -> key`, and any
    exception it raises propagates. Python's global `random` is seeded with strategy_seed(seed) first,
    so a randomised strategy plays the same game in this process and in a sandbox child.
    """
    game = GameBoard(seed=seed, max_idle_moves=max_idle_moves, **board_kwargs)
    random.seed(strategy_seed(seed))
    while game.state() == "ongoing":
        game.do_action(strategy(game.board()))
    return game


def render_text(board) -> str:
    """Aligned plain-text board; empty cells are dots."""
    width = max(len(str(v)) for r in board for v in r)
    return "\n".join(" ".join(str(v or ".").rjust(width) for v in r) for r in board)


_TILE_STYLES = {
    0: "grey50 on grey15",
    2: "black on grey85",
    4: "black on wheat1",
    8: "white on dark_orange",
    16: "white on orange_red1",
    32: "white on red1",
    64: "white on red3",
    128: "black on yellow1",
    256: "black on gold1",
    512: "black on yellow3",
    1024: "white on green3",
    2048: "white on green4",
}


def render_rich(board, title: str | None = None):
    """A colored board for terminals (a rich renderable)."""
    from rich import box
    from rich.table import Table

    width = max(4, max(len(str(v)) for r in board for v in r))
    table = Table(show_header=False, box=box.SQUARE, title=title, padding=(0, 1), show_lines=True)
    for _ in board[0]:
        table.add_column(justify="center", min_width=width)
    for r in board:
        table.add_row(*[f"[{_TILE_STYLES.get(v, 'white on magenta')}] {str(v or '·'):^{width}} [/]" for v in r])
    return table
