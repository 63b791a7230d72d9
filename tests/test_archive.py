"""The strategy archive on its own: strategies told apart by their syntax tree, their rewards the rewards' own, hostile
ones kept out of every file and re-scored behind the sandbox's walls, re-scoring within its budget, files written whole
with headers nothing can break out of, and the state a checkpoint carries. The archive is fed as in a run: the rewards'
judge, watched by the archive, called as TRL calls the reward functions. (tests/test_train_runs.py checks it inside
real runs: the demo's best, TensorBoard, the console, kill -9 and --resume.)"""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import evaluation
import rewards
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
    archive.save_state(checkpoint)
    archive.write_files(2)
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


def test_files_are_swapped_in_whole_and_say_how_to_play_them(archive, tmp_path):
    train_step(archive, [fenced(CORNER), fenced(CYCLE)], step=1)
    first = archive.write_files(1)
    link = tmp_path / strategy_archive.FOLDER
    assert link.is_symlink() and link.resolve() == first.resolve()
    train_step(archive, [fenced(CORNER)], step=2)
    second = archive.write_files(2)
    assert link.resolve() == second.resolve() and not first.exists()  # one rename swapped it; the old copy is gone
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [second.name]
    index = json.loads((link / "index.json").read_text())
    assert index["step"] == 2 and index["held_out_seeds"] == SEEDS and index["distinct"] == 2
    best = index["strategies"][0]
    assert best["rank"] == 1 and best["times_written"] == 2 and best["first_step"] == 1
    assert (link / "best.py").read_text() == (link / best["file"]).read_text()
    text = (link / "best.py").read_text()
    assert text.startswith("# train_2048 strategy archive, rank 1 at step 2") and text.endswith(clean(CORNER))
    assert "held-out games: 4 (seeds 0-3, 3x3 board to 64): mean reward " in text
    assert "--strategy <this file> --target 64 --games 4 --seed 0" in text
    assert f"mean score {best['held_out']['score']:.1f}, win rate {best['held_out']['win_rate']:.0%}" in text


def test_nothing_in_a_header_ends_its_comment(tmp_path):
    """The header is ours, numbers and words, and every character that could end a line is escaped: even a key
    alphabet with a line break in it (a run's option) stays in its comment; the file is our guard and the code."""
    settings = rewards.RewardSettings(size=3, target=64, games=2, keys="\nASD", game_salt="archive-tests")
    archive = new_archive(tmp_path, settings)
    code = clean(CYCLE.replace("WASD", "\\nASD"))
    archive.merge([(1, code, [PlayedGame(1.0, 10, False, 8, 0.01)] * 2, False)])
    archive.end_step(1.0)
    text = (archive.write_files(1) / "best.py").read_text()
    header = text[: text.index(strategy_archive.GUARD)]
    assert "--keys '\\nASD'" in header and all(line.startswith("# ") for line in header.splitlines())
    assert strategy_archive.strategy_id(text) == strategy_archive.strategy_id(strategy_archive.GUARD + code)


def test_running_a_written_file_runs_none_of_the_models_code(tmp_path):
    """`python best.py` stops at our guard, before the model's top level (here a print, and a future import that must
    stay first); in the sandbox the guard never runs and the strategy plays."""
    code = 'from __future__ import annotations\nX = print("model code ran")\n\n' + clean(CORNER)
    archive = new_archive(tmp_path)
    archive.merge([(1, code, [PlayedGame(1.0, 10, False, 8, 0.01)] * 2, False)])
    archive.end_step(1.0)
    best = archive.write_files(1) / "best.py"
    ran = subprocess.run([sys.executable, str(best)], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 1 and "model code ran" not in ran.stdout + ran.stderr
    assert "untrusted code written by a model" in ran.stderr
    played = sandbox.play(best.read_text(), seed=0, **SETTINGS.rules())
    assert played.status in ("failed", "success") and played.moves > 0


def test_a_checkpoint_carries_the_archive(archive, tmp_path, caplog):
    train_step(archive, [fenced(CORNER), fenced(CYCLE)], step=1)
    archive.save_state(tmp_path)
    again = new_archive(tmp_path)
    again.load_state(tmp_path)
    assert again.state() == archive.state()
    other_games = new_archive(tmp_path, seeds=[0, 1])  # held-out scores on other games are dropped
    other_games.load_state(tmp_path)
    assert {e.status for e in other_games.entries.values()} == {"seen"} and len(other_games.entries) == 2
    other_board = new_archive(tmp_path, rewards.RewardSettings(size=4, target=64))
    other_board.load_state(tmp_path)
    assert other_board.entries == {} and "another board" in caplog.text
    os.remove(tmp_path / strategy_archive.STATE_FILE)
    none = new_archive(tmp_path)
    none.load_state(tmp_path)
    assert none.entries == {} and "holds no strategy archive" in caplog.text


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
