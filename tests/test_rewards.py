"""Rewards: extraction from gpt-oss output, every reward case, both profiles, ranking, batches."""

import logging
import time
from types import SimpleNamespace

import pytest

import rewards
import sandbox
import strategies
from rewards import (
    RewardSettings,
    analyse,
    build_dataset,
    build_prompt,
    extract_function,
    function_works,
    graded_game_score,
    notebook_game_score,
    reward_functions,
)
from sandbox import GameResult

GOOD = 'def strategy(board):\n    import random\n    return random.choice("WASD")\n'
NO_CHEATING = rewards.make_no_cheating(RewardSettings())


def fenced(code, lang="python"):
    return f"```{lang}\n{code}```"


# --- extraction -------------------------------------------------------------------------------------


def test_extract_raw_harmony_prefers_final_channel():
    text = (
        "<|channel|>analysis<|message|>Let me draft.\n"
        + fenced("def strategy(board):\n    return 'W'\n")
        + "<|end|><|start|>assistant<|channel|>final<|message|>Here it is:\n"
        + fenced(GOOD)
        + "<|return|>"
    )
    assert extract_function(text) == GOOD


def test_extract_decoded_harmony_prefers_final_channel():
    text = (
        "analysisWe need a strategy. Maybe ```python\ndef strategy(board):\n    return 'S'\n```"
        "assistantfinalSure.\n\n" + fenced(GOOD) + "\nThis picks randomly."
    )
    assert extract_function(text) == GOOD


def test_extract_final_channel_without_code_is_none_even_if_analysis_has_code():
    text = "analysis" + fenced(GOOD) + "assistantfinalI cannot answer that."
    assert extract_function(text) is None


def test_extract_fence_without_language_tag_and_prose_around():
    assert extract_function("Sure!\n```\n" + GOOD + "```\nGood luck.") == GOOD


def test_extract_takes_last_fence_that_defines_strategy():
    other = "def strategy(board):\n    return 'A'\n"
    text = fenced(other) + "\nBetter:\n" + fenced(GOOD) + "\nUsage:\n" + fenced("print(strategy(b))\n")
    assert extract_function(text) == GOOD


def test_extract_truncated_completion_with_unclosed_fence_is_none():
    assert extract_function("assistantfinal```python\ndef strategy(board):\n    return random.ch") is None


def test_extract_truncated_fence_after_a_complete_one_takes_the_complete_one():
    text = fenced(GOOD) + "\nOr:\n```python\ndef strategy(board):\n    retu"
    assert extract_function(text) == GOOD


def test_extract_conversational_messages():
    assert extract_function([{"role": "assistant", "content": fenced(GOOD)}]) == GOOD


@pytest.mark.parametrize("text", ["", "no code here", fenced("print('hi')\n"), None, 42, [{"role": "user"}]])
def test_extract_nothing(text):
    assert extract_function(text) is None


def test_extract_dedents_an_indented_block():
    block = "  def strategy(board):\n      return 'W'\n"
    assert extract_function(fenced(block)) == "def strategy(board):\n    return 'W'\n"


@pytest.mark.parametrize(
    "text",
    [
        "Here:\r\n```python\r\n" + GOOD.replace("\n", "\r\n") + "```\r\n",  # Windows line endings
        "```python title=strategy.py\n" + GOOD + "```",  # an info string after the language
        "```py\n" + GOOD + "```",
        "  ```python\n" + GOOD + "  ```\n",  # an indented fence
        "````python\n" + GOOD + "````\n",  # a longer fence
        "```python\n" + GOOD.rstrip("\n") + "```\nDone.",  # closed at the end of the last line of code
    ],
)
def test_extract_common_fence_spellings(text):
    assert extract_function(text) == GOOD


def test_a_longer_fence_keeps_a_shorter_one_inside():
    code = 'def strategy(board):\n    doc = """\n```\n"""\n    return "W"\n'
    assert extract_function("````python\n" + code + "````") == code


@pytest.mark.parametrize(
    "text",
    [
        "```python\n" + "\n" * 100_000 + "```",  # 14 s with the regular expressions this judge replaced
        "```" + " \t" * 50_000,  # 14 s before
        "```python\n" + " \n" * 50_000 + "```",  # 7 s before
        "```" * 33_000,
        "```python\n" + "\n" * 100_000,  # an unclosed block of newlines
        "\n" * 50_000 + "def strategy(" + " " * 50_000,
        "```python\ndef strategy(board):\n    return " + "(" * 100_000 + "\n```",
        "```python\ndef strategy(board):\n    return " + "1+" * 50_000 + "1\n```",
        "assistantfinal" * 7_000,
        "<|channel|>final<|message|>" * 4_000 + "<|end|>" * 4_000,
    ],
    ids=[
        "block-of-newlines",
        "tabs-after-a-fence",
        "block-of-blank-lines",
        "fences",
        "unclosed",
        "spaces",
        "brackets",
        "long-expression",
        "channels",
        "harmony",
    ],  # fmt: skip
)
def test_judging_a_pathological_answer_takes_well_under_a_second(text):
    assert len(text) >= 90_000
    rewards._analyse_text.cache_clear()
    start = time.perf_counter()
    for completion in (text, text + " "):  # twice: once cached would prove nothing
        a = analyse(completion)
        function_works([completion]), NO_CHEATING([completion])
    assert time.perf_counter() - start < 1.0
    assert not a.playable


# --- function_works ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, expected",
    [
        (GOOD, 1.0),
        ("import math\n\ndef strategy(board):\n    return 'W'\n", 1.0),  # a top-level import is fine
        ('"""doc"""\ndef strategy(b):\n    return "W"\n', 1.0),
        ("def helper():\n    pass\n\ndef strategy(board):\n    return 'W'\n", 1.0),  # a helper beside it
        ("K = 'WASD'\nclass C:\n    pass\ndef strategy(board):\n    return K[0]\n", 1.0),  # a constant, a class
        ("def strategy(board):\n    return 'W'\nif __name__ == '__main__':\n    print(strategy([[0]]))\n", 1.0),
        ("def strategy(board):\n    return 'W'\nprint(strategy([[0]]))\n", -0.5),  # top-level code
        ("def strategy():\n    return 'W'\n", -0.5),  # takes no board
        ("def helper(board):\n    return 'W'\n", -2.0),  # no block defines strategy: nothing extracted
        ("class strategy:\n    pass\ndef strategy(board): pass\n", -0.5),
        # a method called strategy is its class's own
        ("class P:\n    def strategy(self, b):\n        return 'W'\ndef strategy(board):\n    return P().strategy(board)\n", 1.0),
        ("import functools\ndef strategy(board):\n    functools.singledispatch\n    return 'W'\n", 1.0),
        ("from typing import get_type_hints\ndef strategy(board):\n    return 'W'\n", 1.0),
        ("import sys\ndef strategy(board):\n    return sys._getframe(1) and 'W'\n", 1.0),  # loadable: it cheats
        ("def strategy(board):\n    return 'W'\n  oops\n", -2.0),  # syntax error
        # The compiler's own errors (`return` outside a function) are the sandbox's to find: the judge only parses.
        ("def strategy(board):\n    return 'W'\nreturn 1\n", -0.5),
    ],
)
def test_function_works(code, expected):
    assert function_works(["Here:\n" + fenced(code)]) == [expected]


def test_function_works_nothing_extracted():
    assert function_works(["I refuse.", ""]) == [-2.0, -2.0]


# --- no_cheating ------------------------------------------------------------------------------------

CHEATS = {
    "import os": "def strategy(board):\n    import os\n    return 'W'\n",
    "import numpy": "import numpy as np\ndef strategy(board):\n    return 'W'\n",
    "from subprocess": "def strategy(board):\n    from subprocess import run\n    return 'W'\n",
    "relative import": "def strategy(board):\n    from . import x\n    return 'W'\n",
    "__import__": "def strategy(board):\n    __import__('os')\n    return 'W'\n",
    "eval": "def strategy(board):\n    return eval('\"W\"')\n",
    "exec": "def strategy(board):\n    exec('x=1')\n    return 'W'\n",
    "compile": "def strategy(board):\n    compile('1', 'f', 'eval')\n    return 'W'\n",
    "open": "def strategy(board):\n    open('/etc/passwd').read()\n    return 'W'\n",
    "globals": "def strategy(board):\n    globals()\n    return 'W'\n",
    "vars": "def strategy(board):\n    vars()\n    return 'W'\n",
    "getattr dunder": "def strategy(board):\n    getattr(board, '__dict__')\n    return 'W'\n",
    "input builtin": "def strategy(board):\n    return input()\n",
    "setattr dunder": "def strategy(board):\n    setattr(board, '__dict__', 1)\n    return 'W'\n",
    "__subclasses__": "def strategy(board):\n    ().__class__.__base__.__subclasses__()\n    return 'W'\n",
    "__globals__": "def strategy(board):\n    strategy.__globals__\n    return 'W'\n",
    "__builtins__": "def strategy(board):\n    __builtins__['open']\n    return 'W'\n",
    "__code__": "def strategy(board):\n    strategy.__code__\n    return 'W'\n",
    "frame": "def strategy(board):\n    import random\n    random.x.f_back.f_locals\n    return 'W'\n",
    "traceback": "def strategy(board):\n    try:\n        1/0\n    except Exception as e:\n        e.__traceback__.tb_frame\n    return 'W'\n",
    "gc": "def strategy(board):\n    import gc\n    return 'W'\n",
    "inspect": "def strategy(board):\n    import inspect\n    return 'W'\n",
    "ctypes": "def strategy(board):\n    import ctypes\n    return 'W'\n",
    "signal": "def strategy(board):\n    import signal\n    return 'W'\n",
    "threading": "def strategy(board):\n    import threading\n    return 'W'\n",
    "socket": "def strategy(board):\n    import socket\n    return 'W'\n",
    "importlib": "def strategy(board):\n    import importlib\n    return 'W'\n",
    # names of allowed modules that the contract leaves out: cheating, not a mistake of structure
    "sys._getframe": "import sys\ndef strategy(board):\n    return sys._getframe(1) and 'W'\n",
    "sys.modules": "import sys\ndef strategy(board):\n    return sys.modules and 'W'\n",
    "from sys import modules": "from sys import modules\ndef strategy(board):\n    return 'W'\n",
    "random._inst": "import random\ndef strategy(board):\n    return random._inst.choice('WASD')\n",
    "a module outside the list through an allowed one": "import contextlib\ndef strategy(board):\n"
    "    return contextlib.os and 'W'\n",
}


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_no_cheating_flags_each_forbidden_construct(name):
    assert NO_CHEATING([fenced(CHEATS[name])]) == [-20.0], analyse(fenced(CHEATS[name]))


@pytest.mark.parametrize(
    "code",
    [
        GOOD,
        "def strategy(board):\n    import math, itertools, collections, heapq, functools\n    return 'W'\n",
        "def strategy(board):\n    from collections import Counter\n    return 'W'\n",
        "def strategy(board):\n    n = getattr(board, 'count')\n    return 'W' if hasattr(board, 'index') else 'A'\n",
        "def strategy(board):\n    return max('WASD', key=lambda k: len(str(board)))\n",
        "def strategy(board):\n    class P(list):\n        def __init__(self, b):\n            super().__init__(b)\n"
        "        def __len__(self):\n            return 4\n    return 'W' if len(P(board)) else 'A'\n",
    ],
)
def test_no_cheating_clean(code):
    assert NO_CHEATING([fenced(code)]) == [1.0]


# Honest code the old name-based judge scored as cheating: names in use are judged, not every identifier.
HONEST = {
    "local names": "def strategy(board):\n    code, types, signal, resource, site, input = 1, 2, 3, 4, 5, 6\n"
    "    return 'WASD'[(code + types + signal + resource + site + input) % 4]\n",
    "a memo on the function": "def strategy(board):\n    memo = getattr(strategy, '_memo', None)\n"
    "    if memo is None:\n        memo = strategy._memo = {}\n    memo[len(memo)] = 1\n    return 'W'\n",
    "dunder-like strings": "def strategy(board):\n    sep = '__'\n    name = '__main__' + sep + '__x__'\n"
    "    return 'W' if name else 'A'\n",
    "a module name as a parameter": "def strategy(board, os=None, sys=None):\n    return 'W'\n",
    "print": "def strategy(board):\n    print(board)\n    return 'S'\n",
    "a builtin class pattern": "def strategy(board):\n    match board[0][0]:\n        case int(v) if v:\n"
    "            return 'A'\n    return 'S'\n",
    "a computed attribute name": "def strategy(board):\n    return getattr('ws', 'up' + 'per')()[0]\n",
    "an odd annotation": "def strategy(board):\n    def helper(x: (y := 1)):\n        return x\n    return 'W'\n",
    # what only an escape within the process could misuse, and the kernel sees any step out of it
    "super(...) with arguments": "def strategy(board):\n    class P:\n        def f(self):\n"
    "            super(P, self).__setattr__('x', 1)\n    P().f()\n    return 'W'\n",
    "a positional pattern on a class with a metaclass": "import abc\nclass P(abc.ABC):\n    __match_args__ = ('v',)\n"
    "    def __init__(self, v):\n        self.v = v\ndef strategy(board):\n    match P(board[0][0]):\n"
    "        case P(0):\n            return 'A'\n    return 'W'\n",
    "a metaclass with __instancecheck__": "class M(type):\n    def __instancecheck__(cls, obj):\n        return True\n"
    "class Any(metaclass=M):\n    pass\ndef strategy(board):\n    return 'W' if isinstance(board, Any) else 'A'\n",
}


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_code_is_honest(name):
    assert NO_CHEATING([fenced(HONEST[name])]) == [1.0], analyse(fenced(HONEST[name]))


@pytest.mark.parametrize("name", sorted(HONEST) + sorted(CHEATS))
def test_the_judge_and_the_sandbox_agree(name):
    """One policy: what the rewards call clean loads and plays in the sandbox; what they call cheating, the sandbox
    refuses to load (its error names the same thing)."""
    code = HONEST.get(name) or CHEATS[name]
    a = analyse(fenced(code))
    r = sandbox.play(code, seed=0, size=4, target=16, move_time_limit=1.0, game_time_limit=3.0)
    if a.cheats:
        assert (r.status, r.error) == ("violation", a.cheats[0]), (a, r)
    else:
        assert r.status in ("success", "failed"), (a, r)


def test_no_cheating_nothing_extracted_and_syntax_error():
    broken = fenced("def strategy(board):\n  return (\n")
    assert NO_CHEATING(["no code", broken]) == [-1.0, -1.0]
    notebook_no_cheating = reward_functions(RewardSettings(**rewards.NOTEBOOK))[1]
    assert notebook_no_cheating(["no code", broken]) == [-1.0, -20.0]


def test_no_cheating_judges_code_that_is_not_loadable_by_its_imports():
    code = "import os\nprint(1)\ndef strategy(board):\n    return 'W'\n"
    assert function_works([fenced(code)]) == [-0.5]
    assert NO_CHEATING([fenced(code)]) == [-20.0]


# --- per-game scores --------------------------------------------------------------------------------


def result(status, max_tile=0, error="", score=100):
    return GameResult(status=status, moves=10, score=score, max_tile=max_tile, seconds=0.1, error=error)


def test_notebook_game_scores_are_the_notebooks():
    assert notebook_game_score(result("success", 2048)) == 20.0
    assert notebook_game_score(result("failed", 512)) == 2.0
    assert notebook_game_score(result("invalid", 512)) == 2.0  # its engine ends the game as failed
    assert notebook_game_score(result("timeout", 512)) == -1.0
    assert notebook_game_score(result("error")) == -3.0
    assert notebook_game_score(result("crash")) == -3.0


def test_graded_game_scores_are_the_games_points():
    assert rewards.target_points(512) == 4096 and rewards.target_points(2048) == 20480  # building it from 2s
    assert graded_game_score(result("success", 512, score=4000), 512) == 20.0
    assert graded_game_score(result("failed", 256, score=2048), 512) == 10.0
    assert graded_game_score(result("failed", 256, score=1024), 512) == 5.0  # same tile, fewer points: less
    assert graded_game_score(result("failed", 256, score=9000), 512) == 20.0  # at most a win
    assert graded_game_score(result("error"), 512) == -3.0
    assert graded_game_score(result("crash"), 512) == -3.0
    assert graded_game_score(result("invalid", 64), 512) == -2.0


def test_a_timeout_or_a_cap_scores_what_the_game_made_so_stopping_early_never_pays():
    for status in ("timeout", "capped"):
        assert graded_game_score(result(status, 128, score=800), 512) == graded_game_score(
            result("failed", 128, score=800), 512
        )
    # the same player, stopping (stuck on a key that does nothing) before its time runs out, makes fewer points
    stopped, timed_out = result("failed", 64, score=300), result("timeout", 128, score=800)
    assert graded_game_score(stopped, 512) < graded_game_score(timed_out, 512)
    assert graded_game_score(result("timeout", 2, score=0), 512) == 0.0 > graded_game_score(result("invalid"), 512)


def test_game_seeds_change_per_step_and_call_and_with_the_salt():
    s = RewardSettings(games=3)
    assert rewards.game_seeds(s, "salt", 5, 0) == rewards.game_seeds(RewardSettings(games=3), "salt", 5, 0)
    assert len(set(rewards.game_seeds(s, "salt", 5, 0))) == 3
    assert rewards.game_seeds(s, "salt", 5, 0) != rewards.game_seeds(s, "salt", 6, 0)
    assert rewards.game_seeds(s, "salt", 5, 0) != rewards.game_seeds(s, "salt", 5, 1)
    assert rewards.game_seeds(s, "other", 5, 0) != rewards.game_seeds(s, "salt", 5, 0)
    assert len(rewards.game_seeds(RewardSettings(**rewards.NOTEBOOK), "salt", 5, 0)) == 1
    assert len({rewards.new_salt() for _ in range(3)}) == 3 and len(rewards.new_salt()) == 32  # 128 secret bits


def test_without_a_salt_every_reward_function_plays_its_own_secret_games():
    batch = [fenced(strategies.source("random"))]
    unsalted = RewardSettings(**{**FAST, "game_salt": None})
    first, second = (reward_functions(unsalted)[2] for _ in range(2))
    pairs = [(first(batch, trainer_state=step(n)), second(batch, trainer_state=step(n))) for n in range(4)]
    assert any(a != b for a, b in pairs)  # same step, different games
    salted = RewardSettings(**{**FAST, "game_salt": "fixed"})
    a, b = reward_functions(salted)[2], reward_functions(salted)[2]
    assert [a(batch, trainer_state=step(n)) for n in range(3)] == [b(batch, trainer_state=step(n)) for n in range(3)]


def test_settings_validation():
    with pytest.raises(ValueError, match="profile"):
        RewardSettings(profile="easy")
    with pytest.raises(ValueError, match="games"):
        RewardSettings(games=0)


# --- prompt and dataset -----------------------------------------------------------------------------


def test_prompt_states_board_target_and_keys():
    prompt = build_prompt(RewardSettings(size=4, target=512, keys="éaui"))
    assert "4x4" in prompt and "512" in prompt
    assert '"é" (up)' in prompt and '"a" (left)' in prompt and '"u" (down)' in prompt and '"i" (right)' in prompt
    assert "def strategy(board):" in prompt and "```python" in prompt


def test_dataset_rows_are_conversational_with_reasoning_effort():
    ds = build_dataset(3, RewardSettings(), reasoning_effort="medium")
    assert len(ds) == 3
    assert ds[0]["prompt"] == [{"role": "user", "content": build_prompt(RewardSettings())}]
    assert ds["reasoning_effort"] == ["medium"] * 3


# --- strategy_succeeds in the sandbox ---------------------------------------------------------------

FAST = dict(size=4, target=256, games=2, game_time_limit=3.0, move_time_limit=0.5, game_salt="tests")


def step(n):
    return SimpleNamespace(global_step=n)


def test_batch_of_mixed_completions_returns_one_float_each_in_order():
    loop = "def strategy(board):\n    while True:\n        try:\n            pass\n        except BaseException:\n            pass\n"
    crash = "def strategy(board):\n    return 1 / 0\n"
    batch = [
        fenced(strategies.source("greedy")),
        fenced(loop),
        "no code at all",
        fenced(crash),
        fenced(CHEATS["import os"]),
        fenced("def strategy(board):\n    return 'Q'\n"),
        fenced(strategies.source("greedy")),
    ]
    logged = {}
    settings = RewardSettings(**dict(FAST, game_time_limit=1.0, move_time_limit=0.3))
    works, clean, succeeds = reward_functions(settings)
    scores = succeeds(batch, trainer_state=step(0), log_metric=lambda k, v: logged.setdefault(k, v))
    assert len(scores) == len(batch) and all(isinstance(s, float) for s in scores)
    assert scores[0] > 5 and scores[0] == scores[6]  # identical code, same seeds
    assert scores[1] == 0.0  # timed out on its first move: no points, no penalty beyond that
    assert scores[2] == 0.0  # not played
    assert scores[3] == rewards.GRADED_ERROR
    assert scores[4] == 0.0  # flagged code is never executed
    assert scores[5] == rewards.GRADED_INVALID
    assert logged["game/cheat_frac"] == pytest.approx(1 / 7)
    assert logged["game/unparseable_frac"] == pytest.approx(1 / 7)
    assert logged["game/timeout_frac"] == pytest.approx(1 / 7)
    assert logged["game/error_frac"] == pytest.approx(2 / 7)
    assert 0 <= logged["game/win_rate"] <= 1 and logged["game/max_tile_log2"] > 1 and logged["game/moves"] > 0
    assert works(batch) == [1.0, 1.0, -2.0, 1.0, 1.0, 1.0, 1.0]
    assert clean(batch) == [1.0, 1.0, -1.0, 1.0, -20.0, 1.0, 1.0]


def test_flagged_code_is_never_executed(tmp_path):
    marker = tmp_path / "ran"
    code = f"def strategy(board):\n    import os\n    open({str(marker)!r}, 'w')\n    return 'W'\n"
    succeeds = reward_functions(RewardSettings(**FAST))[2]
    assert succeeds([fenced(code)], trainer_state=step(0)) == [0.0]
    assert not marker.exists()


def test_identical_code_is_played_once(monkeypatch):
    calls = []
    real = rewards.sandbox.play_many

    def counting(jobs, **kw):
        calls.append(len(jobs))
        return real(jobs, **kw)

    monkeypatch.setattr(rewards.sandbox, "play_many", counting)
    succeeds = reward_functions(RewardSettings(**FAST))[2]
    succeeds([fenced(GOOD)] * 4 + [fenced(strategies.source("greedy"))], trainer_state=step(0))
    assert calls == [2 * FAST["games"]]


def test_scores_are_deterministic_for_fixed_seeds_and_change_with_the_step():
    batch = [fenced(strategies.source("random")), fenced(strategies.source("corner"))]
    first = reward_functions(RewardSettings(**FAST))[2]
    second = reward_functions(RewardSettings(**FAST))[2]  # the same salt
    a = first(batch, trainer_state=step(3))
    assert a == second(batch, trainer_state=step(3))
    later = [first(batch, trainer_state=step(n)) for n in (4, 5, 6)]
    assert any(x != a for x in later)


def test_sandbox_failure_is_a_score_a_log_line_and_a_metric(monkeypatch, caplog, capsys):
    def broken(jobs, **kw):
        raise RuntimeError("server gone")

    monkeypatch.setattr(rewards.sandbox, "play_many", broken)
    logged = {}
    succeeds = reward_functions(RewardSettings(**FAST))[2]
    with caplog.at_level(logging.ERROR, logger="train_2048.rewards"):
        assert succeeds([fenced(GOOD)], log_metric=logged.__setitem__) == [0.0]
    assert "RuntimeError: server gone" in caplog.text and capsys.readouterr().out == ""
    assert logged["game/sandbox_failure"] == 1.0
    monkeypatch.undo()
    succeeds([fenced(GOOD)], log_metric=logged.__setitem__)
    assert logged["game/sandbox_failure"] == 0.0


def test_notebook_profile_exact_numbers():
    settings = RewardSettings(**dict(rewards.NOTEBOOK, game_time_limit=1.0, move_time_limit=0.5))
    succeeds = reward_functions(settings)[2]
    crash = fenced("def strategy(board):\n    raise ValueError('no')\n")
    loop = fenced("def strategy(board):\n    while True:\n        pass\n")
    stuck = fenced("def strategy(board):\n    return 'W'\n")
    bad_key = fenced("def strategy(board):\n    return 'X'\n")
    scores = succeeds([crash, loop, stuck, bad_key], trainer_state=step(0))
    assert scores == [-3.0, -1.0, -1.0, 2.0]


@pytest.mark.slow
def test_notebook_profile_rewards_random_play_like_the_notebook():
    """The flaw we fix: on the notebook's board random play reaches 2048 and scores +20 most of the time."""
    succeeds = reward_functions(RewardSettings(**rewards.NOTEBOOK))[2]
    scores = [succeeds([fenced(strategies.source("random"))], trainer_state=step(n))[0] for n in range(6)]
    assert sum(s == 20.0 for s in scores) >= 4


@pytest.mark.slow
def test_on_the_default_settings_board_blind_play_earns_at_most_half_of_search():
    """The reward must rank real play: players that never read the board (uniform random, the WASD cycle, a
    corner-spin cycle) against the heuristics and the expectimax baseline, through the three rewards summed, on the
    default settings (fixed games, so the verdict is the same on every run)."""
    settings = RewardSettings(game_salt="ranking")
    funcs = reward_functions(settings)
    names = ["random", "cycle", "corner_spin", "greedy", "corner", "expectimax"]
    batch = [fenced(strategies.source(n)) for n in names]
    totals = dict.fromkeys(names, 0.0)
    for n in range(3):
        for f in funcs:
            for name, score in zip(names, f(batch, trainer_state=step(n)), strict=True):
                totals[name] += score / 3
    blind = max(totals[n] for n in ("random", "cycle", "corner_spin"))
    assert blind <= 0.5 * totals["expectimax"], totals
    assert blind < max(totals["greedy"], totals["corner"]) < totals["expectimax"], totals
    assert totals["random"] < min(totals["greedy"], totals["corner"]), totals
