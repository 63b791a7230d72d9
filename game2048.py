"""The 2048 game: exact original rules, seeded, fast.

Rows are slid through a memo keyed by the row's tuple: a 6x6 game revisits the same few thousand rows
millions of times, so after warm-up a move costs N dict look-ups instead of N Python merge loops. The
state is settled once per move instead of rescanned per call, and a spawn finds its cell from per-row
counts instead of listing every empty cell (bench/bench_engine.py measures the gain).
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


class _SlideMemo(dict):
    """line -> (slid line, points, its largest tile if anything merged else 0, empty cells), on first sight.

    A dict subclass so a move is one C-level `map(memo.__getitem__, lines)`; an unchanged line maps to
    itself, so comparing the boards before and after mostly compares identities.
    """

    def __init__(self, toward_end: bool):
        super().__init__()
        self.toward_end = toward_end

    def __missing__(self, row: tuple) -> tuple[tuple, int, int, int]:
        if self.toward_end:
            slid, gained = _slide_row_left(row[::-1])
            slid = slid[::-1]
        else:
            slid, gained = _slide_row_left(row)
        hit = (row if slid == row else slid, gained, max(slid) if gained else 0, slid.count(0))
        if len(self) < _MEMO_LIMIT:
            self[row] = hit
        return hit


class _EmptyCellsMemo(dict):
    """row -> indices of its empty cells, so a spawn need not scan the board cell by cell."""

    def __missing__(self, row: tuple) -> tuple[int, ...]:
        hit = tuple(j for j, v in enumerate(row) if not v)
        if len(self) < _MEMO_LIMIT:
            self[row] = hit
        return hit


_MEMO_LIMIT = 1 << 20  # entries per memo; bounded by the rows games visit, a few MB at most
_TOWARD_START = _SlideMemo(toward_end=False).__getitem__  # left, or up on columns
_TOWARD_END = _SlideMemo(toward_end=True).__getitem__  # right, or down on columns
_EMPTY_CELLS = _EmptyCellsMemo().__getitem__


# direction -> (line memo, whether the lines are columns)
_SLIDES = {
    "up": (_TOWARD_START, True),
    "left": (_TOWARD_START, False),
    "down": (_TOWARD_END, True),
    "right": (_TOWARD_END, False),
}


def _move_rows(rows: tuple, direction: str) -> tuple[tuple, int]:
    """Slide a board held as a tuple of row tuples; returns the new rows and the points gained."""
    slide, vertical = _SLIDES[direction]
    new, gains, _, _ = zip(*map(slide, tuple(zip(*rows)) if vertical else rows))
    return (tuple(zip(*new)) if vertical else new), sum(gains)


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
    rows = tuple(tuple(r) for r in board)
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


def _spawn(rows: tuple, row_empties, empty_cells: int, rng: random.Random, probability_fours: float) -> tuple:
    """A 2 or a 4 on a uniformly drawn empty cell, counted in row-major order: (new rows, i, j, value).

    `row_empties` (empty cells per row, or None to look them up) saves the look-ups after a sideways move.
    """
    k = rng.randrange(empty_cells)
    for i, empties in enumerate(row_empties or map(len, map(_EMPTY_CELLS, rows))):  # noqa: B007
        if k < empties:
            break
        k -= empties
    row = rows[i]
    j = _EMPTY_CELLS(row)[k]
    value = 4 if rng.random() < probability_fours else 2
    return rows[:i] + (row[:j] + (value,) + row[j + 1 :],) + rows[i + 1 :], i, j, value


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
        self._slides_by_key: dict[str, tuple] = {}  # exact str key -> _SLIDES entry, filled as keys are seen
        self._rng = random.Random(seed)
        self._columns = None  # the rows transposed, kept while vertical moves follow each other
        self._score = 0
        self._state = "ongoing"  # from the board and the keys; idle moves are checked live in state()
        self.moves = 0  # moves that changed the board
        self.idle_moves = 0  # keys in a row that changed nothing
        self.max_idle_moves = max_idle_moves
        rows = ((0,) * size,) * size
        rows = _spawn(rows, None, size * size, self._rng, self.probability_fours)[0]
        self._set_rows(_spawn(rows, None, size * size - 1, self._rng, self.probability_fours)[0])

    def _set_rows(self, board) -> None:
        """Put the game in a position and settle its state (the start, and tests); score and counters stay."""
        rows = tuple(tuple(r) for r in board)
        if len(rows) != self.size or any(len(r) != self.size for r in rows):
            raise ValueError(f"board must be {self.size}x{self.size}")
        self._rows, self._columns = rows, None
        if max(map(max, rows)) >= self.target:
            self._state = "success"
        else:
            self._state = "ongoing" if can_move(rows) else "failed"

    def do_action(self, key) -> bool:
        """Play one key; True if the board changed. A key outside the alphabet ends the game as failed.

        The hot loop of every game, so the spawn and the state update are written out here.
        """
        if self._state != "ongoing" or (self.max_idle_moves is not None and self.idle_moves >= self.max_idle_moves):
            return False
        slide = self._slides_by_key.get(key) if type(key) is str else None  # exact str: no lying __eq__
        if slide is None:
            direction = parse_key(key, self._keys)
            if direction is None:
                self._state = "failed"
                return False
            slide = _SLIDES[direction]
            if type(key) is str and len(self._slides_by_key) < 64:
                self._slides_by_key[key] = slide
        slide, vertical = slide
        if vertical:
            lines = self._columns
            if lines is None:
                lines = self._columns = tuple(zip(*self._rows))
        else:
            lines = self._rows
        new, gains, tops, empties = zip(*map(slide, lines))
        if new == lines:
            self.idle_moves += 1
            return False
        self.moves += 1
        self.idle_moves = 0
        gained = sum(gains)
        if gained:
            self._score += gained
            if max(tops) >= self.target:
                self._state = "success"
        empty_cells = sum(empties)  # at least one: a line that changed without merging had a gap
        if vertical:
            rows, i, j, value = _spawn(tuple(zip(*new)), None, empty_cells, self._rng, self.probability_fours)
        else:
            rows, i, j, value = _spawn(new, empties, empty_cells, self._rng, self.probability_fours)
        self._rows = rows
        if vertical:
            column = new[j]
            self._columns = new[:j] + (column[:i] + (value,) + column[i + 1 :],) + new[j + 1 :]
        else:
            self._columns = None
        if value >= self.target:
            self._state = "success"
        elif empty_cells == 1 and self._state == "ongoing" and not can_move(rows):
            self._state = "failed"
        return True

    def state(self) -> str:
        """The game's state: "ongoing", "success" (a tile reached the target) or "failed" (stuck, bad key, idle)."""
        if self._state == "ongoing" and self.max_idle_moves is not None and self.idle_moves >= self.max_idle_moves:
            return "failed"  # a strategy that repeats a useless key would otherwise play forever
        return self._state

    def board(self) -> list[list[int]]:
        """A fresh copy: mutating it never touches the game."""
        return [list(r) for r in self._rows]

    def score(self) -> int:
        return self._score

    def max_tile(self) -> int:
        return max(map(max, self._rows))  # tiles never shrink, so the board's largest is the game's

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
