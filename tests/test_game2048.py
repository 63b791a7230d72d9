"""The engine against the original game's rules, its seeding, and its argument checks."""

import copy
import math
import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import game2048
from game2048 import GameBoard, apply_move, can_move, play_game, render_rich, render_text

TILES = [0] + [2**k for k in range(1, 12)]

# GUIDE §3: a row slid left, the result, and the points gained.
LEFT_ROWS = [
    ([2, 2, 2, 2], [4, 4, 0, 0], 8),
    ([2, 2, 2, 0], [4, 2, 0, 0], 4),
    ([4, 4, 8, 0], [8, 8, 0, 0], 8),
    ([2, 0, 2, 4], [4, 4, 0, 0], 4),
    ([8, 4, 4, 0], [8, 8, 0, 0], 8),
    ([0, 0, 0, 2], [2, 0, 0, 0], 0),
    ([4, 4, 4, 4], [8, 8, 0, 0], 16),
    ([2, 4, 8, 16], [2, 4, 8, 16], 0),
]


def transpose(board):
    return [list(c) for c in zip(*board)]


def mirror(board):
    return [r[::-1] for r in board]


def board_with_row(row):
    """A 4x4 board whose first row is `row`, the rest empty."""
    return [list(row)] + [[0] * 4 for _ in range(3)]


@pytest.mark.parametrize("row, slid, gained", LEFT_ROWS)
def test_left_and_right_slide_rows(row, slid, gained):
    assert apply_move(board_with_row(row), "A") == (board_with_row(slid), gained, slid != row)
    assert apply_move(mirror(board_with_row(row)), "D") == (mirror(board_with_row(slid)), gained, slid != row)


@pytest.mark.parametrize("row, slid, gained", LEFT_ROWS)
def test_up_and_down_slide_columns(row, slid, gained):
    column, slid_column = transpose(board_with_row(row)), transpose(board_with_row(slid))
    assert apply_move(column, "W") == (slid_column, gained, slid != row)
    flipped, slid_flipped = column[::-1], slid_column[::-1]
    assert apply_move(flipped, "S") == (slid_flipped, gained, slid != row)


def test_right_merges_the_wall_side_pair_first():
    assert apply_move(board_with_row([2, 2, 2, 0]), "D")[0][0] == [0, 0, 2, 4]
    assert apply_move(board_with_row([2, 2, 2, 2]), "d")[0][0] == [0, 0, 4, 4]


def test_merged_tile_does_not_merge_again():
    assert apply_move(board_with_row([4, 2, 2, 0]), "A")[0][0] == [4, 4, 0, 0]
    assert apply_move([[2, 0, 0], [2, 0, 0], [4, 0, 0]], "W")[0] == [[4, 0, 0], [4, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize(
    "board, key",
    [
        ([[2, 0, 0], [4, 0, 0], [8, 0, 0]], "A"),
        ([[2, 4, 8], [0, 0, 0], [0, 0, 0]], "W"),
        ([[0, 0, 2], [0, 0, 4], [0, 2, 8]], "D"),
        ([[0, 0, 0], [0, 0, 0], [2, 4, 8]], "S"),
        ([[2, 4], [4, 2]], "A"),
    ],
)
def test_noop_move_changes_nothing(board, key):
    before = copy.deepcopy(board)
    new, gained, changed = apply_move(board, key)
    assert (new, gained, changed) == (before, 0, False)
    assert board == before


def test_apply_move_leaves_its_input_alone():
    board = board_with_row([2, 2, 0, 0])
    apply_move(board, "A")
    assert board == board_with_row([2, 2, 0, 0])


def test_apply_move_rejects_bad_keys_and_boards():
    with pytest.raises(ValueError, match="key"):
        apply_move(board_with_row([2, 0, 0, 0]), "x")
    with pytest.raises(ValueError, match="key"):
        apply_move(board_with_row([2, 0, 0, 0]), None)
    with pytest.raises(ValueError, match="board"):
        apply_move([[2, 0], [0, 0, 0]], "A")
    with pytest.raises(ValueError, match="board"):
        apply_move([], "A")


@st.composite
def boards(draw, min_size=2, max_size=6):
    size = draw(st.integers(min_size, max_size))
    return [[draw(st.sampled_from(TILES)) for _ in range(size)] for _ in range(size)]


@st.composite
def dead_boards(draw):
    """Full boards with no two equal neighbours, built cell by cell."""
    size = draw(st.integers(2, 6))
    board = [[0] * size for _ in range(size)]
    for i in range(size):
        for j in range(size):
            banned = {board[i - 1][j] if i else 0, board[i][j - 1] if j else 0}
            board[i][j] = draw(st.sampled_from([v for v in TILES[1:] if v not in banned]))
    return board


def tile_weight(board):
    """Sum of v*log2(v): merging two v's into 2v raises it by exactly 2v, the points the merge scores."""
    return sum(v * (v.bit_length() - 1) for r in board for v in r if v)


@given(boards(), st.sampled_from("WASD"))
def test_move_conserves_tile_sum_and_scores_the_merges(board, key):
    new, gained, changed = apply_move(board, key)
    assert sum(map(sum, new)) == sum(map(sum, board))
    assert gained == tile_weight(new) - tile_weight(board)
    assert changed == (new != board)
    merges = sum(v > 0 for r in board for v in r) - sum(v > 0 for r in new for v in r)
    assert (gained > 0) == (merges > 0)


@given(boards())
def test_directions_are_rotations_of_left(board):
    left = lambda b: apply_move(b, "A")[:2]  # noqa: E731
    new, gained = left(transpose(board))
    assert apply_move(board, "W")[:2] == (transpose(new), gained)
    new, gained = left(mirror(board))
    assert apply_move(board, "D")[:2] == (mirror(new), gained)
    new, gained = left(mirror(transpose(board)))
    assert apply_move(board, "S")[:2] == (transpose(mirror(new)), gained)


@given(boards())
def test_can_move_means_some_move_changes_the_board(board):
    assume(any(map(any, board)))  # a game always holds a tile; an empty board can_move but nothing moves
    assert can_move(board) == any(apply_move(board, k)[2] for k in "WASD")


@given(dead_boards())
def test_full_board_without_equal_neighbours_is_failed(board):
    assert not can_move(board)
    game = GameBoard(size=len(board), seed=0, target=4096)
    game._set_rows(board)
    assert game.state() == "failed"
    assert not game.do_action("A")


def play_keys(seed, keys, **kwargs):
    game = GameBoard(seed=seed, **kwargs)
    history = [(game.board(), game.score())]
    for key in keys:
        game.do_action(key)
        history.append((game.board(), game.score()))
    return history


def test_same_seed_and_keys_replay_the_same_game():
    keys = random.Random(1).choices("WASD", k=300)
    assert play_keys(7, keys) == play_keys(7, keys)
    assert play_keys(7, keys, size=4) == play_keys(7, keys, size=4)
    starts = {str(play_keys(seed, [])[0]) for seed in range(20)}
    assert len(starts) > 15


def test_fours_spawn_with_their_probability():
    """40,000 seeded start tiles: expected 4,000 fours, sd 60; the band is ±6 sd and the seeds are fixed."""
    fours = spawns = 0
    for seed in range(20_000):
        tiles = [v for r in GameBoard(size=4, seed=seed).board() for v in r if v]
        assert len(tiles) == 2 and set(tiles) <= {2, 4}
        fours += tiles.count(4)
        spawns += 2
    assert abs(fours / spawns - 0.10) < 0.009
    assert {v for r in GameBoard(size=3, seed=1, probability_fours=0).board() for v in r} == {0, 2}
    assert {v for r in GameBoard(size=3, seed=1, probability_fours=1).board() for v in r} == {0, 4}


def test_spawn_lands_on_an_empty_cell_only_after_a_change():
    rng = random.Random(3)
    game = GameBoard(size=4, seed=3)
    while game.state() == "ongoing":
        before, key = game.board(), rng.choice("WASD")
        moved, gained, changed = apply_move(before, key)
        score = game.score()
        assert game.do_action(key) == changed
        after = game.board()
        if not changed:
            assert after == before and game.score() == score
            continue
        assert game.score() == score + gained
        diff = [(i, j) for i in range(4) for j in range(4) if after[i][j] != moved[i][j]]
        assert len(diff) == 1
        i, j = diff[0]
        assert moved[i][j] == 0 and after[i][j] in (2, 4)


def test_board_returns_an_isolated_copy():
    game = GameBoard(size=4, seed=0)
    board = game.board()
    board[0][0] = 2048
    board.append([1])
    assert game.board() != board
    assert game.max_tile() < 2048 and game.state() == "ongoing"
    assert game.board() is not game.board()
    assert game.board()[0] is not game.board()[0]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"size": 1}, "size"),
        ({"size": 0}, "size"),
        ({"size": 4.0}, "size"),
        ({"size": True}, "size"),
        ({"size": "4"}, "size"),
        ({"target": 2}, "target"),
        ({"target": 6}, "target"),
        ({"target": 2048.0}, "target"),
        ({"target": True}, "target"),
        ({"probability_fours": -0.1}, "probability_fours"),
        ({"probability_fours": 1.5}, "probability_fours"),
        ({"probability_fours": math.nan}, "probability_fours"),
        ({"probability_fours": "0.1"}, "probability_fours"),
        ({"probability_fours": True}, "probability_fours"),
        ({"keys": "WAS"}, "keys"),
        ({"keys": "WASDX"}, "keys"),
        ({"keys": "WAWD"}, "keys"),
        ({"keys": "wWsd"}, "keys"),
        ({"keys": None}, "keys"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        GameBoard(seed=0, **kwargs)


def test_keys_ignore_case_and_surrounding_whitespace():
    board = board_with_row([0, 0, 2, 2])
    for key in ("a", "A", " a", "A\n", "\tA  "):
        assert apply_move(board, key) == apply_move(board, "A")
    game = GameBoard(size=4, seed=0)
    game._set_rows(board)
    assert game.do_action(" a\n")
    assert game.board()[0][0] == 4 and game.state() == "ongoing"


def test_bepo_alphabet():
    """Seed 001's keys: é up, a left, u down, i right."""
    board = [[0, 0, 0, 0], [0, 2, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    for key, wasd in zip("éaui", "WASD"):
        assert apply_move(board, key, keys="éaui") == apply_move(board, wasd)
    assert apply_move(board, "É", keys="éaui") == apply_move(board, "W")
    game = GameBoard(size=4, seed=0, keys="éaui")
    assert game.do_action("w") is False
    assert game.state() == "failed"


@pytest.mark.parametrize("key", ["x", "", "up", "WA", None, 1, b"w", ["w"], 3.5])
def test_invalid_key_fails_the_game(key):
    game = GameBoard(size=4, seed=0)
    board = game.board()
    assert game.do_action(key) is False
    assert game.state() == "failed"
    assert game.board() == board
    assert game.do_action("A") is False and game.do_action("D") is False


def test_str_subclass_cannot_lie_about_its_key():
    class Sly(str):
        def strip(self, *args):
            return "a"

        def casefold(self):
            return "a"

    game = GameBoard(size=4, seed=0)
    game.do_action(Sly("zzz"))
    assert game.state() == "failed"


def test_success_once_a_tile_reaches_the_target():
    assert GameBoard(size=4, target=4, probability_fours=1.0, seed=0).state() == "success"
    game = GameBoard(size=4, target=16, probability_fours=0.0, seed=0)
    rng = random.Random(0)
    while game.state() == "ongoing":
        game.do_action(rng.choice("WASD"))
        assert game.state() == ("success" if game.max_tile() >= 16 else "ongoing")
    assert game.state() == "success" and max(map(max, game.board())) == 16
    assert game.do_action("A") is False and game.do_action("W") is False


def test_max_tile_above_the_target_is_success():
    game = GameBoard(size=4, target=8, seed=0)
    game._set_rows([[16, 0, 0, 0]] + [[0] * 4] * 3)
    assert game.state() == "success"


def test_max_idle_moves_ends_a_stuck_game():
    game = GameBoard(size=4, seed=0, max_idle_moves=3)
    game._set_rows([[2, 0, 0, 0]] + [[0] * 4] * 3)
    assert game.do_action("A") is False and game.do_action("W") is False
    assert game.idle_moves == 2 and game.state() == "ongoing"
    assert game.do_action("D") is True
    assert game.idle_moves == 0 and game.moves == 1
    game._set_rows([[2, 0, 0, 0]] + [[0] * 4] * 3)
    for _ in range(3):
        assert game.do_action("A") is False
    assert game.idle_moves == 3 and game.state() == "failed"
    assert GameBoard(size=4, seed=0).max_idle_moves is None


def test_play_game_stops_a_strategy_that_repeats_a_useless_key():
    game = play_game(lambda board: "W", seed=0, size=4)
    assert game.state() == "failed" and game.idle_moves == game2048.MAX_IDLE_MOVES


def test_play_game_passes_copies_and_seeds_the_strategy():
    seen = []

    def strategy(board):
        board[0][0] = 2048  # must not reach the engine
        seen.append(random.random())
        return random.choice("WASD")

    game = play_game(strategy, seed=11, size=4)
    assert game.max_tile() < 2048
    random.seed(game2048.strategy_seed(11))
    assert seen[0] == random.random()
    assert game2048.strategy_seed(11) != 11 and game2048.strategy_seed(None) is None


def test_render_text_aligns_columns():
    text = render_text([[2, 0, 1024], [0, 16, 0], [4, 0, 2]])
    lines = text.splitlines()
    assert lines == ["   2    . 1024", "   .   16    .", "   4    .    2"]
    assert len({len(line) for line in lines}) == 1
    assert render_text([[2, 0], [0, 4]]) == "2 .\n. 4"
    assert str(GameBoard(size=3, seed=0)) == render_text(GameBoard(size=3, seed=0).board())


def test_render_rich_draws_every_tile():
    from rich.console import Console

    console = Console(record=True, width=80, color_system=None)
    console.print(render_rich([[2, 0, 4096], [0, 16, 0], [4, 0, 2048]], title="game"))
    text = console.export_text()
    assert "game" in text
    for value in ("2", "16", "4096", "2048", "·"):
        assert value in text
    rows = [line for line in text.splitlines() if "16" in line]
    assert len(rows) == 1 and rows[0].count("·") == 2


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 6))
def test_random_play_keeps_the_invariants(seed, size):
    game = GameBoard(size=size, seed=seed, target=2**30)
    rng = random.Random(seed)
    while game.state() == "ongoing" and game.moves < 200:
        total = sum(map(sum, game.board()))
        changed = game.do_action(rng.choice("WASD"))
        new_total = sum(map(sum, game.board()))
        assert new_total - total in ((2, 4) if changed else (0,))
        assert game.max_tile() == max(map(max, game.board()))
    if game.state() == "failed":
        assert not can_move(game.board())
