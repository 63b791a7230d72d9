"""The strategy archive on its own: strategies told apart by their syntax tree, their rewards the rewards' own, hostile
ones kept out of every file and re-scored behind the sandbox's walls, re-scoring within its budget, files written whole
with headers nothing can break out of, and the state a checkpoint carries. The archive is fed as in a run: the rewards'
judge, watched by the archive, called as TRL calls the reward functions. (tests/test_train_runs.py checks it inside
real runs: the demo's best, TensorBoard, the console, kill -9 and --resume.)"""

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import evaluation
import game2048
import rewards
import run_folder
import sandbox
import strategy_archive
from strategy_archive import PlayedGame, StrategyArchive

SETTINGS = rewards.RewardSettings(size=3, target=64, games=2, game_salt="archive-tests")
SEEDS = [0, 1, 2, 3]
CORNER = """
def strategy(board):
    def moves(b):
        return any(x == y != 0 or x == 0 != y for r in b for x, y in zip(r, r[1:]))
    t = [list(c) for c in zip(*board)]
    for k, b in (("A", board), ("S", [c[::-1] for c in t]), ("D", [r[::-1] for r in board]), ("W", t)):
        if moves(b):
            return k
    return "A"
"""
# The same function, formatted otherwise and commented: one strategy.
CORNER_REFORMATTED = """
def strategy( board ):   # the corner player
    def moves(b):
        # can this row slide left?
        return any(x == y != 0 or x == 0 != y
                   for r in b for x, y in zip(r, r[1:]))

    t = [list(c) for c in zip(*board)]
    for k, b in (('A', board), ('S', [c[::-1] for c in t]), ('D', [r[::-1] for r in board]), ('W', t)):
        if moves(b):
            return k
    return 'A'
"""
CYCLE = 'def strategy(board):\n    n = getattr(strategy, "n", 0)\n    strategy.n = n + 1\n    return "WASD"[n % 4]\n'


def clean(code: str) -> str:
    return textwrap.dedent(code).strip() + "\n"


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{clean(code)}```\n"


def hostile(marker: Path) -> str:
    """Clean to the static judge (its payload is a string), it makes a file the moment it runs outside the sandbox;
    in the sandbox the child's walls see `os` and the game is a violation."""
    return (
        "import typing\n\ndef strategy(board):\n"
        f"    def f(x: \"__import__('os').open({str(marker)!r}, 64)\"):\n        pass\n"
        '    return typing.get_type_hints(f) and "W"\n'
    )


@pytest.fixture(scope="module", autouse=True)
def server():
    sandbox.start()
    yield
    sandbox.shutdown()


def new_archive(tmp_path, settings=SETTINGS, **options) -> StrategyArchive:
    return StrategyArchive(settings, output_dir=tmp_path, **{"size": 5, "seeds": SEEDS, "budget": 1.0, **options})


def wired(archive, settings=SETTINGS) -> list:
    """no_cheating and strategy_succeeds as train_2048.py wires them: one judge, watched by the archive."""
    return rewards.reward_functions(settings, archive.watch(rewards.make_judge(settings)))[1:]


def train_step(archive, completions, step: int, seconds: float = 1.0) -> list[list[float]]:
    """One step as a run has it: TRL calls the rewards on the batch (the same list, the same state), then the step
    ends. Returns what each reward paid."""
    state = SimpleNamespace(global_step=step - 1)
    paid = [reward(completions, trainer_state=state, log_metric=lambda *_: None) for reward in archive.rewards]
    archive.end_step(seconds)
    return paid


def entry(archive, code):
    return archive.entries[strategy_archive.strategy_id(clean(code))]


@pytest.fixture
def archive(tmp_path):
    archive = new_archive(tmp_path)
    archive.rewards = wired(archive)
    return archive


def test_formatting_and_comments_do_not_make_another_strategy(archive):
    train_step(archive, [fenced(CORNER), fenced(CYCLE), fenced(CORNER_REFORMATTED)], step=1)
    train_step(archive, [fenced(CORNER_REFORMATTED), fenced(CORNER)], step=2)
    assert len(archive.entries) == 2 and archive.distinct_last_step == 1 and archive.answers == 5
    corner = entry(archive, CORNER)
    assert corner is entry(archive, CORNER_REFORMATTED)
    assert (corner.first_step, corner.times, corner.train_games) == (1, 4, 4 * SETTINGS.games)
    assert corner.code == clean(CORNER)  # as first written
    other = CORNER.replace('    return "A"\n', '    return "S"\n')  # one key changed: another strategy
    assert strategy_archive.strategy_id(clean(other)) != corner.id


def test_its_training_rewards_are_what_the_reward_paid(archive):
    (_, game) = train_step(archive, [fenced(CORNER), fenced(CYCLE)], step=1)
    for code, paid in zip((CORNER, CYCLE), game, strict=True):
        e = entry(archive, code)
        assert e.train_games == SETTINGS.games and e.train_reward / e.train_games == pytest.approx(paid)


def test_held_out_scores_are_what_evaluate_2048_measures(archive):
    train_step(archive, [fenced(CORNER), fenced(CYCLE)], step=1)
    source = evaluation.Source("file", "file", [evaluation.Sample(clean(CORNER), rewards.analyse_code(clean(CORNER)))])
    games = evaluation.play_sources([source], SEEDS, SETTINGS)[0, 0]
    measured = evaluation.game_stats(games)
    held_out = entry(archive, CORNER).held_out
    assert held_out["games"] == len(SEEDS) and held_out["score"] == pytest.approx(measured["mean_score"])
    assert held_out["win_rate"] == measured["win_rate"] and held_out["max_tile"] == max(g.max_tile for g in games)
    assert held_out["reward"] == pytest.approx(sum(rewards.game_score(g, SETTINGS) for g in games) / len(games))
    assert [e.id for e in archive.ranked()] == [entry(archive, CORNER).id, entry(archive, CYCLE).id]  # corner first


BIASED_RANDOM = 'import random\n\ndef strategy(board):\n    return random.choice("AAASSD")\n'


def ranked_on(archive, code: str, rewards_per_game: list[float], first_step: int = 1):
    """A strategy ranked on held-out games with these rewards (its other numbers alike)."""
    archive.merge([(first_step, code, [PlayedGame(5.0, 50, False, 16, 0.01)] * 2, False)])
    e = archive.entries[strategy_archive.strategy_id(code)]
    rows = [PlayedGame(r, int(10 * r), False, 16, 0.01) for r in rewards_per_game]
    e.status, e.held_out = "ranked", strategy_archive.held_out_stats(rows)
    return e


def test_a_lucky_mean_on_few_games_does_not_outrank_a_steadier_better_player(tmp_path):
    """A biased random player that won one of its 4 held-out games (mean 5.4: one lucky game) against a player that
    earns 4.5 every game: the old ranking by the mean alone put the lucky one first. Ranked by the lower bound, the
    steady player leads, and the lucky one's neighbours are not told apart, so they are offered more games."""
    archive = new_archive(tmp_path)
    lucky = ranked_on(archive, clean(BIASED_RANDOM), [20.0, 0.5, 0.6, 0.5])
    steady = ranked_on(archive, clean(CORNER), [4.4, 4.6, 4.5, 4.5])
    assert lucky.held_out["reward"] > steady.held_out["reward"]  # what the mean said
    assert archive.ranked() == [steady, lucky]
    assert sorted(e.id for e in archive.near_ties()) == sorted([steady.id, lucky.id])
    assert archive.next_seeds(lucky) == [SEEDS[-1] + 1 + i for i in range(len(SEEDS))]  # the next round, not replayed


def test_strategies_that_play_the_same_games_are_a_tie_not_a_near_tie(tmp_path):
    """Two strategies whose held-out games pay the same (the same play: a variant with a comment changed nothing)
    are told apart as equals and never replayed: their order is the earlier one first."""
    archive = new_archive(tmp_path)
    games = [4.0, 9.5, 1.0, 6.0]
    first = ranked_on(archive, clean(CORNER), games)
    again = ranked_on(archive, clean(CORNER.replace('return "A"\n', 'return "A"  # the fallback\n  \n') + "X = 1\n"),
                      games, first_step=2)  # fmt: skip
    assert archive.ranked() == [first, again] and archive.near_ties() == []


def lucky_start(n: int) -> int:
    """The first seed of n consecutive held-out games on which the biased random player's mean reward beats the
    corner player's (it earns less over many games): found by playing them here, as the sandbox plays them."""
    def rewards_on(code, seeds):
        namespace = {}
        exec(code, namespace)  # our own two players, in this process
        played = [game2048.play_game(namespace["strategy"], seed=seed, size=SETTINGS.size, target=SETTINGS.target)
                  for seed in seeds]  # fmt: skip
        return [rewards.game_score(SimpleNamespace(status=g.state(), score=g.score()), SETTINGS) for g in played]

    for start in range(0, 10_000, n):
        seeds = list(range(start, start + n))
        if sum(rewards_on(clean(BIASED_RANDOM), seeds)) > sum(rewards_on(clean(CORNER), seeds)) + 0.5 * n:
            return start
    raise AssertionError("no lucky games found")


def test_a_biased_random_player_lucky_on_the_first_held_out_games_ends_below_the_corner_player(tmp_path):
    """Re-scored through the sandbox on 4 held-out games where the biased random player happens to beat the corner
    player by half a reward a game: the old ranking put it first for good. Now the pair is a near-tie, both play more
    rounds of held-out games within the budget, and the corner player ends first."""
    start = lucky_start(len(SEEDS))
    archive = new_archive(tmp_path, seeds=list(range(start, start + len(SEEDS))))
    claim = [PlayedGame(5.0, 50, False, 16, 0.002)] * 2
    archive.merge([(1, clean(BIASED_RANDOM), claim, False), (1, clean(CORNER), claim, False)])
    for _ in range(strategy_archive.MAX_ROUNDS + 1):
        archive.end_step(1.0)
    lucky, corner = entry(archive, BIASED_RANDOM), entry(archive, CORNER)
    print(f"start {start}: corner {corner.held_out}; biased random {lucky.held_out}")
    assert lucky.status == "ranked" and archive.ranked() == [corner, lucky]
    assert corner.held_out["games"] > len(SEEDS)  # the near-tie was played on


def test_a_hostile_strategy_is_in_no_file_and_its_rescoring_meets_the_walls(archive, tmp_path, monkeypatch):
    marker = tmp_path / "escaped"
    played, play_answers = [], rewards.play_answers  # the rewards' play: the one way both go to the sandbox

    def watched_play(codes, *args, **kwargs):
        played.append(codes)
        return play_answers(codes, *args, **kwargs)

    monkeypatch.setattr(rewards, "play_answers", watched_play)
    # Written during training: the sandbox sees it at once, and the archive keeps it as cheating, without its code.
    train_step(archive, [fenced(CORNER), fenced(hostile(marker))], step=1)
    assert entry(archive, hostile(marker)).status == "cheats" and entry(archive, hostile(marker)).code is None
    # Another that played honestly in training (so it is the top candidate) turns on the held-out games: re-scored
    # through the rewards' play, in the sandbox, it is seen there too, and never ranked.
    sly = hostile(marker).replace('"W"', '"A"')
    archive.merge([(2, sly, [PlayedGame(20.0, 900, True, 64, 0.01)] * 8, False)])
    assert archive.candidates()[0].code == sly
    archive.end_step(1.0)
    assert entry(archive, sly).status == "cheats" and entry(archive, sly).code is None
    assert not marker.exists()  # it never ran outside the sandbox
    assert clean(hostile(marker)) in played[0] and played[-1] == [sly]  # for its reward, then for the archive
    assert [e.id for e in archive.ranked()] == [entry(archive, CORNER).id]
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    strategy_archive.save_state(archive, checkpoint)
    strategy_archive.write_files(archive, 2)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.name for p in written} >= {"best.py", "index.json", strategy_archive.STATE_FILE}
    for path in written:
        assert "get_type_hints" not in path.read_text() and "escaped" not in path.read_text(), path


def slow(i: int) -> str:
    """A player that sleeps on every move: its games run into the game's time limit."""
    return f"import time\n\ndef strategy(board):\n    time.sleep({0.05 + i / 1000})\n" + CYCLE.split("\n", 1)[1]


def test_rescoring_stays_within_its_budget_with_slow_strategies(tmp_path):
    """Six slow players whose training games claimed to be fast (the budget cannot see it coming) and six that were
    slow in training too: re-scoring keeps to 5% of the steps' time, but for one overrun of at most a game's limit,
    which the next steps pay back."""
    settings = rewards.RewardSettings(size=3, target=64, games=2, move_time_limit=0.5, game_time_limit=1.0)
    archive = new_archive(tmp_path, settings, budget=0.05)
    fast_claim, slow_claim = [PlayedGame(15.0, 500, False, 64, 0.001)] * 8, [PlayedGame(15.0, 500, False, 64, 1.0)] * 8
    archive.merge([(1, slow(i), fast_claim if i < 6 else slow_claim, False) for i in range(12)])
    step_seconds, took = 0.5, []
    for _ in range(20):
        started = time.monotonic()
        archive.end_step(step_seconds)
        took.append(time.monotonic() - started)
    budget = 0.05 * step_seconds * len(took)
    print(f"re-scoring: {sum(took):.2f} s over 20 steps of {step_seconds} s, budget {budget:.2f} s, steps {took}")
    assert sum(took) <= budget + settings.game_time_limit + 0.5, took
    assert max(took) <= archive.carry() + settings.game_time_limit + 0.5, took
    statuses = [archive.entries[strategy_archive.strategy_id(slow(i))].status for i in range(12)]
    assert statuses[6:] == ["too_slow"] * 6  # slow in training too: never played for the archive
    assert "ranked" not in statuses
    assert archive.spent_seconds == pytest.approx(sum(took), abs=0.1)


def sleepy(i: int) -> str:
    """A key cycle whose first move of every game takes half a second: slow on any game, whatever its training said."""
    return ("import time\n\ndef strategy(board):\n    n = getattr(strategy, 'n', 0)\n    strategy.n = n + 1\n"
            f"    if n == 0:\n        time.sleep({0.5 + i / 1000})\n    return 'WASD'[n % 4]\n")  # fmt: skip


@pytest.mark.slow
def test_each_rescoring_ends_within_its_credit_and_one_games_limit(tmp_path):
    """Ten strategies that claimed fast training games and are slow on the held-out ones: no re-scoring call takes
    more than its credit and one game's time limit (before, each answer had the whole credit to itself, so one call
    spent many times its credit). One the call's end cut short is not too slow: its cost is now known, and it is
    ranked once enough credit is saved up for it."""
    settings = rewards.RewardSettings(size=3, target=64, games=2, move_time_limit=1.5, game_time_limit=2.0)
    archive = new_archive(tmp_path, settings, budget=0.5)
    archive.merge([(1, sleepy(i), [PlayedGame(15.0, 500, False, 64, 0.001)] * 8, False) for i in range(10)])
    calls = []
    for _ in range(12):
        credit = min(archive.credit + 0.5, strategy_archive.CARRY_STEPS * 0.5)  # what end_step(1.0) makes it
        started = time.monotonic()
        archive.end_step(1.0)
        calls.append((round(credit, 2), round(time.monotonic() - started, 2)))
    print(f"re-scoring calls (credit, seconds): {calls}")
    assert all(took <= max(credit, 0.0) + settings.game_time_limit + 0.5 for credit, took in calls), calls
    entries = [archive.entries[strategy_archive.strategy_id(sleepy(i))] for i in range(10)]
    assert "too_slow" not in {e.status for e in entries} and "ranked" in {e.status for e in entries}
    assert all(e.rescored_games > 0 for e in entries if e.status == "seen" and e.rescored_seconds), entries
    for e in entries:
        if e.rescored_games:
            assert e.seconds_per_game() >= 0.5, e  # what its held-out games took, not its training's claim


def test_no_strategy_can_recognise_the_held_out_games():
    """The held-out games are secret per run (drawn from the game salt that a checkpoint keeps), so a strategy that
    knows public games by its own `random`'s first draw, and plays them well, plays the run's held-out games as it
    plays any other: with its bad fallback. On the public seeds it would have ranked with the corner player."""
    import random

    public = [0, 1, 2, 3]
    firsts = []
    for seed in public:
        random.seed(game2048.strategy_seed(seed))  # what the sandbox's child seeds its `random` with
        firsts.append(random.random())
    corner = clean(CORNER).replace("def strategy(board):", "def corner(board):")
    recogniser = (f"import random\nKNOWN = {firsts!r}\n{corner}\ndef strategy(board):\n"
                  "    if not hasattr(strategy, 'known'):\n        strategy.known = random.random() in KNOWN\n"
                  "    return corner(board) if strategy.known else 'W'\n")  # fmt: skip
    assert rewards.analyse_code(recogniser).playable
    held_out = rewards.held_out_seeds("a run's secret salt", 4)
    assert held_out == rewards.held_out_seeds("a run's secret salt", 4) != rewards.held_out_seeds("another", 4)
    assert held_out == list(range(held_out[0], held_out[0] + 4)) and held_out[0] > 2**32  # evaluate_2048's --seed

    def points(code: str, seeds: list[int]) -> list[int]:
        return [g.score for g in rewards.play_answers([code], seeds, SETTINGS)[code]]

    assert points(recogniser, public) == points(clean(CORNER), public)  # it does recognise the public games
    assert points(recogniser, held_out) == points("def strategy(board):\n    return 'W'\n", held_out)
    assert points(recogniser, held_out) != points(clean(CORNER), held_out)


def test_files_are_swapped_in_whole_and_say_how_to_play_them(archive, tmp_path):
    train_step(archive, [fenced(CORNER), fenced(CYCLE)], step=1)
    first = strategy_archive.write_files(archive, 1)
    link = tmp_path / strategy_archive.FOLDER
    assert link.is_symlink() and link.resolve() == first.resolve()
    train_step(archive, [fenced(CORNER)], step=2)
    second = strategy_archive.write_files(archive, 2)
    assert link.resolve() == second.resolve() and not first.exists()  # one rename swapped it; the old copy is gone
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [second.name]
    index = json.loads((link / "index.json").read_text())
    assert index["step"] == 2 and index["held_out_seeds"] == SEEDS and index["distinct"] == 2
    best = index["strategies"][0]
    assert best["rank"] == 1 and best["times_written"] == 2 and best["first_step"] == 1
    assert (link / "best.py").read_text() == (link / best["file"]).read_text()
    text = (link / "best.py").read_text()
    assert text.startswith("# train_2048 strategy archive, rank 1 at step 2")
    assert evaluation.file_source(str(link / "best.py")).samples[0].code == clean(CORNER)
    assert "held-out games: 4 (seeds 0-3, 3x3 board to 64): mean reward " in text
    assert "#   python evaluate_2048.py --strategy <this file> --games 4 --seed 0\n" in text
    game = {"size": "3", "target": "64", "probability_fours": "0.1", "keys": "WASD", "max_moves": "0"}
    assert evaluation.file_game(text) == game  # the whole game, whatever evaluate_2048's default board is
    assert f"mean score {best['held_out']['score']:.1f}, win rate {best['held_out']['win_rate']:.0%}" in text
    assert clean(CORNER).splitlines()[0] not in index_text(link)  # index.json holds numbers, no code


def index_text(folder: Path) -> str:
    return (folder / "index.json").read_text()


def test_nothing_in_a_header_ends_its_comment(tmp_path):
    """The header is ours, numbers and words, and every character that could end a line is escaped: even a key
    alphabet with a line break in it (a run's option) stays in its comment; the option itself is a literal."""
    settings = rewards.RewardSettings(size=3, target=64, games=2, keys="\nASD", game_salt="archive-tests")
    archive = new_archive(tmp_path, settings)
    code = clean(CYCLE.replace("WASD", "\\nASD"))
    archive.merge([(1, code, [PlayedGame(1.0, 10, False, 8, 0.01)] * 2, False)])
    archive.end_step(1.0)
    best = strategy_archive.write_files(archive, 1) / "best.py"
    text = best.read_text()
    header = text[: text.index(f"\n{evaluation.ARCHIVED_CODE} = (")]
    assert "'--keys=\\nASD'" in header and all(line.startswith("# ") for line in header.splitlines())
    assert layout(text)["GAME"] == ["--size=3", "--target=64", "--probability_fours=0.1", "--keys=\nASD", "--max_moves=0"]
    assert evaluation.file_source(str(best)).samples[0].code == code


# --- a written file: the model's code is data, run only in the sandbox ---------------------------------------------

# What a model may write around a strategy: each keeps the contract (it plays in the sandbox and is ranked), and each
# runs PAYLOAD as plain Python. In the sandbox `random` holds no `_os`, so the payload is a no-op there; run as a
# user runs a file, it reaches the real os and makes a file. (The old layout put a guard after the line where a
# docstring or a future import ends, and this code sat beside it.)
PAYLOAD = "_os = getattr(random, '_' + 'os', None); _made = _os and _os.open(MARKER, 65)"
PLAIN = CYCLE
LAYOUTS = {
    "a docstring, then ; on its line": '"""A player."""; import random; ' + PAYLOAD + "\n" + PLAIN,
    "a future import, then ; on its line": "from __future__ import annotations; import random; " + PAYLOAD + "\n"
                                           + PLAIN,
    "a docstring, then a backslash on its line": '"""A player."""; import random; _o = \\\n'
                                                  "    getattr(random, '_' + 'os', None)\n" + PAYLOAD + "\n" + PLAIN,
    "a future import, then a bracket on its line": "from __future__ import annotations; import random; _o = (\n"
                                                   "    getattr(random, '_' + 'os', None))\n" + PAYLOAD + "\n" + PLAIN,
    "a docstring, then __name__ rebound on its line": '"""A player."""; __name__ = "__main__"\nimport random\n'
                                                      + PAYLOAD + "\n" + PLAIN,
    "__name__ rebound, then a main test": 'import random\n__name__ = "__main__"\nif __name__ == "__main__":\n    '
                                         + PAYLOAD + "\n" + PLAIN,
    "a backslash continuation": "import random\n_o = \\\n    getattr(random, '_' + 'os', None)\n"
                                "_m = _o and \\\n  _o.open(MARKER, 65)\n" + PLAIN,
    "brackets across lines": "import random\n_m = (\n    (lambda o: o and o.open(MARKER, 65))(\n"
                             "        getattr(random, '_' + 'os', None))\n)\n" + PLAIN,
    "an encoding declaration": "# -*- coding: latin-1 -*-\nimport random\nNAME = 'café'\n"
                               + PAYLOAD.replace("; ", "\n") + "\n" + PLAIN,
    "a class body": "import random\nclass Cells:\n    " + PAYLOAD.replace("; ", "\n    ") + "\n" + PLAIN,
    "a decorator": "import random\n_os = getattr(random, '_' + 'os', None)\n"
                   "@(lambda f: (_os and _os.open(MARKER, 65), f)[1])\n" + PLAIN,
    "a default argument": "import random\n_os = getattr(random, '_' + 'os', None)\n"
                          + CYCLE.replace("(board)", "(board, _m=_os and _os.open(MARKER, 65))"),
    "strategy defined twice, once under a main test": PLAIN + 'if __name__ == "__main__":\n    import random\n    '
                                                      + PAYLOAD + "\n    def strategy(board):\n        return 'W'\n",
    "quotes, backslashes and line separators in strings": "import random\nS = '\\'\\'\\'\"\"\"\\\\ \u2028 \x0b \x85'\n"
                                                           + PAYLOAD + "\n" + PLAIN,
    "Windows line endings, a form feed, no final newline": ("import random\n\x0c" + PAYLOAD + "\n" + PLAIN).replace(
        "\n", "\r\n").rstrip(),
    "our own constant's name": f"import random\n{evaluation.ARCHIVED_CODE} = 'def strategy(board): return 1'\n"
                               + PAYLOAD + "\n" + PLAIN,
}  # fmt: skip


def layout(text: str) -> dict:
    """A written file's syntax tree, checked to be ours whatever the model wrote: a string constant, the Python and
    the train_2048 that wrote it, the game's options, and our main block; returns the constants by name."""
    tree = ast.parse(text)
    *assignments, main = tree.body
    assert [ast.unparse(target) for node in assignments for target in node.targets] == [
        evaluation.ARCHIVED_CODE, "(PYTHON, TRAIN_2048)", "GAME"]  # fmt: skip
    assert all(isinstance(node, ast.Assign) for node in assignments)
    constants = {ast.unparse(node.targets[0]): ast.literal_eval(node.value) for node in assignments}
    assert isinstance(constants[evaluation.ARCHIVED_CODE], str)
    assert constants["(PYTHON, TRAIN_2048)"] == (sys.executable, str(Path(strategy_archive.__file__).parent))
    ours = strategy_archive.strategy_code("def strategy(board):\n    return 'A'\n", constants["GAME"])
    assert ast.dump(main) == ast.dump(ast.parse(ours).body[-1])  # the main block, whatever the code
    return constants


def written(tmp_path, codes: list[str]) -> list[Path]:
    """The codes as a run writes them: recorded, re-scored on the held-out games in the sandbox, ranked, written."""
    tmp_path.mkdir()
    archive = new_archive(tmp_path, size=len(codes))
    archive.merge([(1, code, [PlayedGame(10.0, 100, False, 32, 0.01)] * 2, False) for code in codes])
    archive.end_step(100.0)
    assert [e.status for e in archive.entries.values()] == ["ranked"] * len(codes)
    folder = strategy_archive.write_files(archive, 1)
    by_id = {row["id"]: folder / row["file"] for row in json.loads(index_text(folder))["strategies"]}
    return [by_id[strategy_archive.strategy_id(code)] for code in codes]


def test_whatever_the_model_wrote_a_written_file_runs_none_of_it_and_plays_the_same(tmp_path):
    """Every layout: the file is our syntax tree with the code as a string; run as a script (`python FILE`, its
    hand-over to evaluate_2048.py stopped) and imported (`import FILE`), none of the model's code runs; read back, it
    is the code the rewards played, byte for byte (so the same syntax-tree digest), and plays the same game."""
    marker = tmp_path / "escaped"
    codes = [LAYOUTS[name].replace("MARKER", repr(str(marker))) for name in sorted(LAYOUTS)]
    for name, code in zip(sorted(LAYOUTS), codes):
        assert rewards.analyse_code(code).playable, (name, rewards.analyse_code(code))
    files = written(tmp_path / "run", codes)
    for name, code, path in zip(sorted(LAYOUTS), codes, files):
        assert layout(path.read_text())[evaluation.ARCHIVED_CODE] == code, name
        assert evaluation.file_source(str(path)).samples[0].code == code, name
    runs = (
        "import os, runpy, sys\n"
        "os.execv = lambda path, argv: print('hands over:', *argv[2:4])\n"
        "for path in sys.argv[1:]:\n"
        "    runpy.run_path(path, run_name='__main__')\n"
        "    sys.path.insert(0, os.path.dirname(path))\n"
        "    __import__(os.path.basename(path)[:-3].replace('-', '_'))\n"
    )
    importable = []
    for path in files:  # `import 01-<id>` is not Python: import each under a name it can have
        importable.append(path.with_name(path.name.replace("-", "_")))
        importable[-1].write_text(path.read_text())
    ran = subprocess.run([sys.executable, "-c", runs, *map(str, importable)], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [f"hands over: --watch {path}" for path in importable]
    assert not marker.exists()
    # In the sandbox the file's code is the code, so the same game: and the payload is a no-op there.
    direct = rewards.play_answers(codes, [5], SETTINGS)
    kept = rewards.play_answers([evaluation.file_source(str(p)).samples[0].code for p in files], [5], SETTINGS)
    same = [(g.status, g.moves, g.score, g.max_tile, g.error) for c in codes for g in direct[c]]
    assert same == [(g.status, g.moves, g.score, g.max_tile, g.error) for c in codes for g in kept[c]]
    assert all(games[0].status in ("failed", "success") and games[0].moves > 0 for games in direct.values()), direct
    assert not marker.exists()


@given(st.text(st.characters(exclude_categories=["Cs"])))
@settings(max_examples=300, deadline=None)
def test_any_text_is_kept_as_the_same_text(text):
    """The code literal reads back as the text, whatever the text: quotes, backslashes, every line break Python or an
    editor knows, NUL, a byte-order mark; and the rest of the file stays ours."""
    assert layout(strategy_archive.strategy_code(text, ["--keys=\u2028\"'\\"]))[evaluation.ARCHIVED_CODE] == text


def test_an_edited_file_is_read_as_evaluate_2048_reads_any_file(tmp_path):
    """A file that defines `strategy` is a strategy file, played as it is; one that does not plays its one string
    constant; anything else is one line (evaluate_2048.py: exit 2)."""
    (best,) = written(tmp_path / "run", [clean(CORNER)])
    text = best.read_text()
    constant = f"{evaluation.ARCHIVED_CODE} = (\n"

    def read(new_text: str) -> str:
        best.write_text(new_text)
        return evaluation.file_source(str(best)).samples[0].code

    assert read(text + "def strategy(board):\n    return 'W'\n").endswith("return 'W'\n")  # the user's own now
    for edited_text, problem in [
        (text.replace(constant, constant + "    'def strategy(:'\n"), f"its {evaluation.ARCHIVED_CODE} does not parse"),
        (text.replace("'def strategy(board):", "'def play(board):"), "STRATEGY defines no top-level function"),
        (text + f"{evaluation.ARCHIVED_CODE} = 'def strategy(board): return 1'\n", "defines no top-level function"),
        (text.replace(constant, f"{evaluation.ARCHIVED_CODE} = 7 or (\n"), "defines no top-level function"),
    ]:
        with pytest.raises(ValueError, match=re.escape(problem)):
            read(edited_text)


@pytest.mark.slow
def test_python_runs_a_written_file_in_the_sandbox_only(tmp_path):
    """`python best.py` hands the code to evaluate_2048.py --watch, which plays it in the sandbox (the payload is a
    no-op there); a file whose Python is gone says so in one line, exit 2."""
    marker = tmp_path / "escaped"
    code = LAYOUTS["a docstring, then ; on its line"].replace("MARKER", repr(str(marker)))
    (best,) = written(tmp_path / "run", [code])
    ran = subprocess.run([sys.executable, str(best), "--speed", "0"], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and f"{best}: " in ran.stdout and " after " in ran.stdout, ran.stdout + ran.stderr
    assert not marker.exists()
    moved = best.with_name("moved.py")
    moved.write_text(best.read_text().replace(repr(sys.executable), repr(str(tmp_path / "no-python"))))
    ran = subprocess.run([sys.executable, str(moved)], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 2 and ran.stderr.count("\n") == 1 and "cannot start" in ran.stderr, ran.stderr
    assert not marker.exists()


def test_a_checkpoint_carries_the_archive(archive, tmp_path, caplog):
    train_step(archive, [fenced(CORNER), fenced(CYCLE)], step=1)
    strategy_archive.save_state(archive, tmp_path)
    again = new_archive(tmp_path)
    strategy_archive.load_state(again, tmp_path)
    assert strategy_archive.state_json(again) == strategy_archive.state_json(archive)
    other_games = new_archive(tmp_path, seeds=[0, 1])  # held-out scores on other games are dropped
    strategy_archive.load_state(other_games, tmp_path)
    assert {e.status for e in other_games.entries.values()} == {"seen"} and len(other_games.entries) == 2
    other_board = new_archive(tmp_path, rewards.RewardSettings(size=4, target=64))
    strategy_archive.load_state(other_board, tmp_path)
    assert other_board.entries == {} and "another board" in caplog.text
    os.remove(tmp_path / strategy_archive.STATE_FILE)
    none = new_archive(tmp_path)
    strategy_archive.load_state(none, tmp_path)
    assert none.entries == {} and "holds no strategy archive" in caplog.text


# --- a checkpoint's archive, damaged or edited: one line, a fresh archive, no file lost ------------------------------


@pytest.fixture(scope="module")
def saved_state(tmp_path_factory):
    """The state a checkpoint holds after a step with a ranked strategy, another one and one caught cheating."""
    folder = tmp_path_factory.mktemp("saved")
    archive = new_archive(folder)
    archive.rewards = wired(archive)
    train_step(archive, [fenced(CORNER), fenced(CYCLE), fenced(hostile(folder / "escaped"))], step=1)
    assert {e.status for e in archive.entries.values()} == {"ranked", "cheats"}
    return strategy_archive.state_json(archive)


def edited(change):
    def edit(state: dict) -> str:
        state = json.loads(json.dumps(state))
        change(state, next(e for e in state["entries"] if e["status"] == "ranked"))
        return json.dumps(state)

    return edit


DAMAGES = {
    "cut short": lambda state: json.dumps(state)[:200],
    "not text": lambda state: "\udcff",  # written with surrogateescape: an undecodable byte
    "nested too deep": lambda state: "[" * 100_000,
    "a list": lambda state: "[]",
    "an unknown field": edited(lambda s, e: s.update(note="mine")),
    "a missing field": edited(lambda s, e: s.pop("credit")),
    "a count as a string": edited(lambda s, e: s.update(steps="1")),
    "entries as an object": edited(lambda s, e: s.update(entries={})),
    "seeds as strings": edited(lambda s, e: s.update(seeds=["0"])),
    "a newer format": edited(lambda s, e: s.update(format=strategy_archive.STATE_FORMAT + 1)),
    "an unknown field of a strategy": edited(lambda s, e: e.update(note="mine")),
    "a strategy without its code field": edited(lambda s, e: e.pop("code")),
    "a negative count": edited(lambda s, e: e.update(times=-1)),
    "a bool for a count": edited(lambda s, e: e.update(train_games=True)),
    "NaN seconds": edited(lambda s, e: e.update(train_seconds=float("nan"))),
    "code that does not parse": edited(lambda s, e: e.update(code="def strategy(board:\n")),
    "code edited under its id": edited(lambda s, e: e.update(code=e["code"].replace('"A"', '"W"'))),
    "code of a strategy seen cheating": edited(lambda s, e: e.update(status="cheats")),
    "an unknown status": edited(lambda s, e: e.update(status="best")),
    "ranked without its scores": edited(lambda s, e: e.update(held_out=None)),
    "held-out scores of a wrong type": edited(lambda s, e: e["held_out"].update(score="high")),
    "a game's reward that is no number": edited(lambda s, e: e["held_out"]["rewards"].__setitem__(0, "20")),
    "fewer game rewards than games": edited(lambda s, e: e["held_out"]["rewards"].pop()),
    "one strategy twice": edited(lambda s, e: s["entries"].append(dict(e))),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_checkpoint_archive_is_one_line_and_a_fresh_archive(damage, saved_state, tmp_path, caplog):
    (tmp_path / strategy_archive.STATE_FILE).write_text(DAMAGES[damage](saved_state), errors="surrogateescape")
    fresh = new_archive(tmp_path)
    strategy_archive.load_state(fresh, tmp_path)
    lines = [r.getMessage() for r in caplog.records]
    assert fresh.entries == {} and fresh.steps == 0 and fresh.credit == 0.0
    assert len(lines) == 1 and "is damaged (" in lines[0] and "\n" not in lines[0], lines
    print(damage, "->", lines[0])


@pytest.mark.parametrize("fmt", [1, 2])
def test_a_checkpoint_of_an_older_format_still_loads(fmt, saved_state, tmp_path, caplog):
    """An older checkpoint kept no reward per held-out game, which the ranking's bound needs: its strategies load, and
    the ranked ones are re-scored."""
    old = json.loads(json.dumps(saved_state)) | {"format": fmt}
    for entry in old["entries"]:
        if entry["held_out"]:
            del entry["held_out"]["rewards"]
        if fmt == 1:
            del entry["rescored_games"], entry["rescored_seconds"]
    (tmp_path / strategy_archive.STATE_FILE).write_text(json.dumps(old))
    again = new_archive(tmp_path)
    strategy_archive.load_state(again, tmp_path)
    assert again.entries.keys() == {e["id"] for e in saved_state["entries"]}
    assert {e.status for e in again.entries.values()} == {"seen", "cheats"} and "re-scored again" in caplog.text


def test_files_are_replaced_only_by_an_archive_that_holds_what_they_show(tmp_path, caplog):
    """Resumed from the checkpoint that wrote them, the archive replaces its files; resumed from an older checkpoint
    (the newer one half-written) or from a damaged one, it knows less than they show: that copy is kept, renamed to
    a visible folder, and the new one is written beside it. The run holds the folder: its record lists the copies, so
    a resumed archive deletes what an earlier process wrote, and nothing else."""
    run = run_folder.take(tmp_path)
    run.start()
    (tmp_path / ".strategies-1-mine").mkdir()  # a name like a copy's, the user's
    archive = new_archive(tmp_path)
    archive.rewards = wired(archive)
    train_step(archive, [fenced(CORNER), fenced(CYCLE)], step=1)
    older = tmp_path / "checkpoint-1"
    older.mkdir()
    strategy_archive.save_state(archive, older)
    train_step(archive, [fenced(CORNER.replace('return "A"', 'return "S"'))], step=2)
    newer = tmp_path / "checkpoint-2"
    newer.mkdir()
    strategy_archive.save_state(archive, newer)
    shown = strategy_archive.write_files(archive, 2)
    link = tmp_path / strategy_archive.FOLDER

    def resumed(checkpoint: Path, step: int) -> Path:
        again = new_archive(tmp_path)
        strategy_archive.load_state(again, checkpoint)
        return strategy_archive.write_files(again, step)

    replaced = resumed(newer, 2)
    assert not shown.exists() and link.resolve() == replaced.resolve()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(strategy_archive.FOLDER + "-")] == []

    def kept_when_resumed(checkpoint: Path, step: int) -> Path:
        before, best = link.resolve(), (link / "best.py").read_text() if (link / "best.py").exists() else None
        now = resumed(checkpoint, step)
        kept = tmp_path / before.name.lstrip(".")
        assert link.resolve() == now.resolve() and not before.exists() and kept.is_dir()
        assert f"that copy is kept as {kept}" in caplog.text
        assert best is None or (kept / "best.py").read_text() == best
        return kept

    assert json.loads(index_text(kept_when_resumed(older, 3)))["step"] == 2  # it showed step 2's new strategy
    (newer / strategy_archive.STATE_FILE).write_text("{")
    assert json.loads(index_text(kept_when_resumed(newer, 4)))["step"] == 3  # a fresh archive knows none of them
    (link / "index.json").unlink()
    kept_when_resumed(older, 5)  # an index that cannot be read: nothing to vouch for the copy
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(strategy_archive.FOLDER + "-")]) == 3
    assert (tmp_path / ".strategies-1-mine").is_dir()
    run.release()


def test_ranked_files_survive_a_resume_whose_archive_state_cannot_be_read(tmp_path, caplog, monkeypatch):
    """The newest checkpoint's strategy_archive.json unreadable: the resumed archive starts empty, and meets the same
    strategies again before it has re-scored them; the files that ranked them are kept (visible, said in a line),
    not replaced by a copy that ranks nothing yet. (The run holds its folder, so its record lists the copies.)"""
    run = run_folder.take(tmp_path)
    run.start()
    archive = new_archive(tmp_path)
    archive.rewards = wired(archive)
    train_step(archive, [fenced(CORNER), fenced(CYCLE)], step=1)
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    strategy_archive.save_state(archive, checkpoint)
    shown = strategy_archive.write_files(archive, 1)
    ranked = json.loads(index_text(shown))["strategies"]
    assert len(ranked) == 2
    (checkpoint / strategy_archive.STATE_FILE).write_text("{")  # cut short
    again = new_archive(tmp_path)
    again.rewards = wired(again)
    monkeypatch.setattr(again, "rescore", lambda: 0.0)  # its re-scoring has not come to them yet
    strategy_archive.load_state(again, checkpoint)
    train_step(again, [fenced(CORNER), fenced(CYCLE)], step=2)
    assert {e.status for e in again.entries.values()} == {"seen"}
    strategy_archive.write_files(again, 2)
    kept = [p for p in tmp_path.iterdir() if p.is_dir() and (p / "index.json").is_file() and
            json.loads(index_text(p))["strategies"] == ranked]  # fmt: skip
    assert kept and all((kept[0] / row["file"]).is_file() for row in ranked) and (kept[0] / "best.py").is_file()
    assert f"that copy is kept as {kept[0]}" in caplog.text
    run.release()


def test_its_tensorboard_panel_comes_at_every_log_with_current_counts(archive, tmp_path):
    """The text panel at every log, not only when the top changes: while the top holds still, its "written" counts
    keep up (read back from the event file, as TensorBoard reads it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    archive.writer = SummaryWriter(str(tmp_path / "runs"))
    for step in (1, 2, 3):
        train_step(archive, [fenced(CORNER), fenced(CORNER)], step=step)
        archive.report(step)
    archive.writer.close()
    events = EventAccumulator(str(tmp_path / "runs"), size_guidance={"tensors": 0})
    events.Reload()
    panels = events.Tensors("archive/text_summary")
    assert [p.step for p in panels] == [1, 2, 3]
    corner = entry(archive, CORNER)
    assert corner.times == 6 and f"| 1 | {corner.id} | 1 | 6 |" in panels[-1].tensor_proto.string_val[0].decode()
