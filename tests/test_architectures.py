"""The same games and the same rewards on every architecture: numbers recorded on x86_64 (x86_64_reference.json) and
played again wherever the suite runs; on aarch64 by bench/aarch64_check.py, in a VM or natively on a DGX Spark.

The referee deals the tiles with Python's own generator, the same on every CPU, but the players compute: floats, math
and statistics through the C library, which is another build on aarch64. A player that moved otherwise there shows here
as another game (every key is compared), a reward that differed as another score. After changing a player, the engine
or the rewards, record again on x86_64:

    .venv/bin/python tests/test_architectures.py
"""

import json
import platform
import sys
from pathlib import Path

if __name__ == "__main__":  # recording: the repository's modules, as pytest's pythonpath gives them
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest  # noqa: E402
from test_contract import FORBIDDEN_IMPORT, fenced, scored  # noqa: E402
from test_sandbox_attacks import TIME_SCALE  # noqa: E402

import sandbox  # noqa: E402
import strategies  # noqa: E402

REFERENCE = Path(__file__).with_name("x86_64_reference.json")
PLAYERS = sorted({**strategies.BASELINES, **strategies.BOARD_BLIND, **strategies.COMPACT})
SEEDS = (0, 1, 2)
# Limits far above what the games take (a few seconds under emulation): a game that hit one would not be comparable.
BOARD = dict(size=4, target=128, move_time_limit=10.0 * TIME_SCALE, game_time_limit=60.0 * TIME_SCALE)
# One batch of answers, as a model writes them: every player, and the ends that are not a game.
ANSWERS = {name: fenced(strategies.source(name)) for name in PLAYERS} | {
    "no code": "I would keep the largest tile in a corner.",
    "a crash": fenced("def strategy(board):\n    return board[9][9]\n"),
    "an invalid key": fenced("def strategy(board):\n    return 'Q'\n"),
    "the forbidden import": fenced(FORBIDDEN_IMPORT),
}
REWARD_LIMITS = dict(move_time_limit=10.0 * TIME_SCALE, game_time_limit=60.0 * TIME_SCALE,
                     answer_time_limit=120.0 * TIME_SCALE, game_salt="architectures")  # fmt: skip


def played() -> dict:
    """Every player's game on each seed, in the sandbox, every key it played."""
    jobs = [(strategies.source(name), seed, sandbox.Game(**BOARD)) for name in PLAYERS for seed in SEEDS]
    results = sandbox.play_many(jobs, record_keys=True)
    names = [f"{name}, seed {seed}" for name in PLAYERS for seed in SEEDS]
    return {n: dict(status=r.status, moves=r.moves, score=r.score, max_tile=r.max_tile, keys=r.played_keys)
            for n, r in zip(names, results, strict=True)}  # fmt: skip


def rewarded() -> dict:
    """The batch's three rewards, called as TRL calls them."""
    names = sorted(ANSWERS)
    return dict(zip(names, scored([ANSWERS[n] for n in names], **REWARD_LIMITS), strict=True))


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="module", autouse=True)
def server():
    sandbox.start()
    yield
    sandbox.shutdown()


@pytest.mark.slow
def test_every_player_plays_the_recorded_games(reference):
    assert played() == reference["games"]


def test_a_reward_batch_scores_as_recorded(reference):
    assert rewarded() == reference["rewards"]


if __name__ == "__main__":
    if platform.machine() != "x86_64":
        sys.exit(f"the reference is recorded on x86_64, not {platform.machine()}")
    sandbox.start()
    record = dict(machine=platform.machine(), python=platform.python_version(), games=played(), rewards=rewarded())
    REFERENCE.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {REFERENCE}: {len(record['games'])} games, {len(record['rewards'])} answers")
