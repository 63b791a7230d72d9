"""Baseline players: legal answers, sandbox-ready source, reproducible games, and a real skill gap."""

import ast
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import strategies
from game2048 import apply_move, can_move
from strategies import BASELINES, BOARD_BLIND, COMPACT, load, play_games, source

TILES = [0] + [2**k for k in range(1, 12)]
ALLOWED_IMPORTS = {"random", "math", "itertools", "functools"}


@st.composite
def live_boards(draw):
    """Boards of sizes 4-6 on which some move changes something, from near-empty to nearly stuck."""
    size = draw(st.integers(4, 6))
    empty_share = draw(st.sampled_from([0.0, 0.05, 0.3, 0.8]))
    rng = random.Random(draw(st.integers(0, 2**32)))
    board = [[0 if rng.random() < empty_share else rng.choice(TILES[1:8]) for _ in range(size)] for _ in range(size)]
    if not any(map(any, board)):
        board[0][0] = 2
    return board


def changing_keys(board):
    return {k for k in "WASD" if apply_move(board, k)[2]}


@settings(max_examples=60, deadline=None)
@given(live_boards())
@pytest.mark.parametrize("name", BASELINES)
def test_baselines_answer_a_legal_key_that_moves(name, board):
    before = [list(r) for r in board]
    key = BASELINES[name](board)
    assert isinstance(key, str) and key in "WASD" and len(key) == 1
    assert board == before
    if name != "random" and can_move(board):
        assert key in changing_keys(board)


def test_greedy_takes_the_move_that_frees_most_cells():
    wide = [[2, 2, 2, 2], [4, 0, 0, 0], [4, 0, 0, 0], [8, 0, 0, 0]]  # sideways frees 2 cells, vertical 1
    assert changing_keys(wide) == set("WASD")
    assert strategies.greedy_strategy(wide) in {"A", "D"}
    tall = [[2, 4, 0, 0], [2, 4, 0, 0], [8, 16, 0, 0], [32, 64, 0, 0]]  # vertical frees 2, right none
    assert changing_keys(tall) == {"W", "S", "D"}
    assert strategies.greedy_strategy(tall) in {"W", "S"}


def test_corner_keeps_the_largest_tile_bottom_left():
    board = [[0, 0, 0, 0], [0, 0, 0, 0], [0, 2, 0, 0], [512, 0, 4, 2]]
    key = strategies.corner_strategy(board)
    assert key in "AS" and apply_move(board, key)[0][-1][0] == 512
    stuck = [[0, 0, 0, 0], [0, 0, 0, 0], [2, 0, 0, 0], [512, 4, 2, 0]]  # left and down change nothing
    assert strategies.corner_strategy(stuck) == "D"
    only_up = [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [512, 4, 2, 8]]
    assert strategies.corner_strategy(only_up) == "W"


def test_expectimax_keeps_the_big_tile_in_its_corner():
    board = [[0, 0, 0, 2], [0, 0, 2, 4], [4, 8, 16, 32], [1024, 512, 256, 128]]
    assert changing_keys(board) == {"W", "A"}  # up would lift the 1024 out of the corner
    assert strategies.expectimax_strategy(board) == "A"


@settings(max_examples=25, deadline=None)
@given(live_boards())
@pytest.mark.parametrize("name", COMPACT)
def test_compact_players_answer_a_legal_key_that_moves(name, board):
    before = [list(r) for r in board]
    key = COMPACT[name](board)
    assert isinstance(key, str) and len(key) == 1 and board == before
    assert key in changing_keys(board) if can_move(board) else key in "WASD"


@pytest.mark.parametrize("name", COMPACT)
def test_compact_players_play_legal_games_from_their_source(name):
    shipped = load(name)

    def checked(board):
        key = shipped(board)
        assert key in changing_keys(board)  # a game only asks while some move is left
        return key

    for size, target in ((3, 512), (4, 128)):
        games = play_games(checked, 2, seed=1, size=size, target=target)
        assert min(games["moves"]) > 10
        assert games == play_games(COMPACT[name], 2, seed=1, size=size, target=target)


def test_compact_expectimax_beats_both_greedy_players_on_3x3_to_512():
    """The default board: a depth-2 search should make at least twice the points of one ply, on average."""
    board = {"size": 3, "target": 512}
    search = statistics.fmean(play_games(COMPACT["expectimax_compact"], 4, seed=0, **board)["scores"])
    for greedy in (strategies.greedy_strategy, COMPACT["greedy_compact"]):
        assert search >= 2 * statistics.fmean(play_games(greedy, 4, seed=0, **board)["scores"])


@pytest.mark.parametrize("name", {**BASELINES, **BOARD_BLIND, **COMPACT})
def test_source_is_one_self_contained_function(name):
    code = source(name)
    tree = ast.parse(code)
    assert len(tree.body) == 1 and isinstance(tree.body[0], ast.FunctionDef)
    func = tree.body[0]
    assert func.name == "strategy" and [a.arg for a in func.args.args] == ["board"]
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= ALLOWED_IMPORTS
    assert "game2048" not in code and "strategies" not in code


@pytest.mark.parametrize("name", BASELINES)
def test_source_round_trip_plays_identically(name):
    namespace = {"__builtins__": __builtins__}
    exec(source(name), namespace)
    shipped = namespace["strategy"]
    rng = random.Random(5)
    for _ in range(30):
        size = rng.randint(4, 6)
        board = [[rng.choice(TILES[:8]) for _ in range(size)] for _ in range(size)]
        random.seed(1)
        expected = BASELINES[name](board)
        random.seed(1)
        assert shipped(board) == expected
    game = {"size": 4, "target": 256}
    assert play_games(shipped, 2, seed=3, **game) == play_games(BASELINES[name], 2, seed=3, **game)


@pytest.mark.parametrize(("name", "keys"), [("cycle", "WASD"), ("corner_spin", "SASD")])
def test_board_blind_cycles_repeat_their_keys_whatever_the_board(name, keys):
    player = load(name)
    rng = random.Random(0)
    answers = [player([[rng.choice(TILES) for _ in range(4)] for _ in range(4)]) for _ in range(9)]
    assert "".join(answers) == (keys * 3)[:9]
    assert load(name)([[0] * 4] * 4) == keys[0]  # a fresh load starts the cycle again


@pytest.mark.parametrize("name", ["cycle", "corner_spin"])
def test_play_games_resets_a_stateful_player_between_games(name):
    player = load(name)
    game = {"size": 4, "target": 2048}
    together = play_games(player, 3, seed=7, **game)
    alone = [play_games(load(name), 1, seed=7 + i, **game) for i in range(3)]
    assert together["moves"] == [g["moves"][0] for g in alone]
    assert together["max_tiles"] == [g["max_tiles"][0] for g in alone]
    assert together == play_games(player, 3, seed=7, **game)  # a second run starts from scratch too


def test_source_rejects_unknown_names():
    with pytest.raises(KeyError):
        source("nobody")


def test_play_games_is_deterministic_and_consistent():
    first = play_games(strategies.random_strategy, 6, seed=10, size=4)
    assert first == play_games(strategies.random_strategy, 6, seed=10, size=4)
    assert first["scores"] != play_games(strategies.random_strategy, 6, seed=11, size=4)["scores"]
    assert first["games"] == 6 == len(first["scores"]) == len(first["moves"]) == len(first["max_tiles"])
    assert sum(first["max_tile_counts"].values()) == 6
    assert first["median_moves"] == statistics.median(first["moves"])
    assert first["median_score"] == statistics.median(first["scores"])
    assert first["win_rate"] == 0.0


def test_play_games_passes_board_arguments():
    small = play_games(strategies.greedy_strategy, 4, seed=0, size=4, target=16, probability_fours=0.0)
    assert small["win_rate"] == 1.0 and set(small["max_tiles"]) == {16}
    foreign = play_games(strategies.greedy_strategy, 2, seed=0, size=4, keys="ijkl")
    assert foreign["moves"] == [0, 0] and foreign["win_rate"] == 0.0  # baselines speak WASD only


def test_expectimax_beats_random_to_512_on_4x4():
    smart = play_games(strategies.expectimax_strategy, 4, seed=0, size=4, target=512)
    dumb = play_games(strategies.random_strategy, 20, seed=0, size=4, target=512)
    assert smart["win_rate"] == 1.0
    assert dumb["win_rate"] <= 0.1


@pytest.mark.slow
def test_expectimax_reaches_2048_on_4x4_where_random_stalls():
    smart = play_games(strategies.expectimax_strategy, 2, seed=0, size=4)
    dumb = play_games(strategies.random_strategy, 20, seed=0, size=4)
    assert min(smart["max_tiles"]) >= 1024 and smart["win_rate"] >= 0.5
    assert statistics.median(dumb["max_tiles"]) <= 256 and dumb["win_rate"] == 0.0
