"""One contract, kept both ways (policy.py): what the prompt allows, the judge scores as clean and the sandbox plays;
whatever reaches past it, in the code or at run time, scores like the plain forbidden import or worse; nothing a model
writes is compiled in the trainer's process; an answer that stalls is not played to the limit in every game."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

import policy
import rewards
import sandbox
import strategies
from rewards import RewardSettings, reward_functions

REPO = Path(__file__).resolve().parent.parent
FAST = dict(size=3, target=64, games=2, game_time_limit=3.0, move_time_limit=1.0, game_salt="contract")


def fenced(code: str, fence: str = "```") -> str:
    return f"Here it is:\n{fence}python\n{textwrap.dedent(code).strip()}\n{fence}\n"


def scored(completions: list[str], **settings) -> list[dict]:
    """The three rewards of each completion, called as TRL calls them (same list, same step), and its verdict."""
    funcs = reward_functions(RewardSettings(**{**FAST, **settings}))
    state = SimpleNamespace(global_step=0)
    columns = [f(completions, trainer_state=state, log_metric=lambda *_: None) for f in funcs]
    return [dict(zip(("works", "clean", "game"), row, strict=True)) for row in zip(*columns, strict=True)]


# --- honest code is clean, and plays ------------------------------------------------------------------------------

HONEST = {
    "self.__class__.__name__": """
        class Board:
            def __init__(self, rows):
                self.rows = rows
            def name(self):
                return self.__class__.__name__
        def strategy(board):
            return "A" if Board(board).name() == "Board" else "W"
    """,
    "operator and protocol methods, private names": """
        class Vec:
            def __init__(self, x, y):
                self.x, self.y = x, y
            def __add__(self, other):
                return Vec(self.x + other.x, self.y + other.y)
            def __sub__(self, other):
                return Vec(self.x - other.x, self.y - other.y)
            def __mul__(self, k):
                return Vec(self.x * k, self.y * k)
            def __eq__(self, other):
                return (self.x, self.y) == (other.x, other.y)
            def __hash__(self):
                return hash((self.x, self.y))
        class Empties:
            def __init__(self):
                self.__memo = {}
            def __call__(self, board):
                key = tuple(map(tuple, board))
                if key not in self.__memo:
                    self.__memo[key] = sum(v == 0 for row in board for v in row)
                return self.__memo[key]
            def __enter__(self):
                return self
            def __exit__(self, *exc):
                return False
        def strategy(board):
            with Empties() as empties:
                v = Vec(1, 2) + Vec(3, 4) - Vec(1, 1) * 2
                return "AS"[(empties(board) + v.x) % 2]
    """,
    "getattr with a computed name": """
        class Mover:
            def move_left(self):
                return "A"
            def move_down(self):
                return "S"
        def strategy(board):
            name = "left" if board[0][0] else "down"
            return getattr(Mover(), "move_" + name)()
    """,
    "a main guard and a constant": """
        import random
        KEYS = "AS"
        def strategy(board):
            return random.choice(KEYS)
        if __name__ == "__main__":
            print(strategy([[0, 0, 0], [0, 2, 0], [0, 0, 0]]))
    """,
    "a positional pattern on its own dataclass": """
        from dataclasses import dataclass
        @dataclass(frozen=True)
        class Point:
            x: int
            y: int
        def strategy(board):
            match Point(len(board), sum(map(sum, board)) % 2):
                case Point(3, 0):
                    return "A"
                case Point(x, y):
                    return "S"
    """,
    "sys.maxsize and contextlib.suppress": """
        import sys
        import contextlib
        def strategy(board):
            best = -sys.maxsize
            with contextlib.suppress(ValueError):
                best = max(best, int("x"))
            return "S" if best < 0 else "A"
    """,
    "typing, NamedTuple and namedtuple": """
        from typing import List, NamedTuple, Optional, TypeVar
        from collections import namedtuple
        T = TypeVar("T")
        Cell = namedtuple("Cell", "row col")
        Board = List[List[int]]
        class Move(NamedTuple):
            key: str
            score: "int" = 0
        def strategy(board: "Board") -> str:
            moves: List[Optional[Move]] = [Move("A", 1), Move("S", 2)]
            empty = [Cell(r, c) for r, row in enumerate(board) for c, v in enumerate(row) if not v]
            return max(moves, key=lambda m: m.score).key if empty else "A"
    """,
    "typing.overload and private names of its own": """
        from typing import Union, overload
        class Memo:
            def __init__(self):
                self._seen = {}
                self.__hits = 0
            def get(self, key):
                self.__hits += 1
                return self._seen.get(key)
        @overload
        def first(x: int) -> int: ...
        @overload
        def first(x: str) -> str: ...
        def first(x: Union[int, str]):
            return x
        _CACHE = Memo()
        def strategy(board):
            return "A" if first(1) and _CACHE.get("k") is None else "S"
    """,
    "decorators, cached properties, metaclasses and type()": """
        import functools
        def counted(func):
            @functools.wraps(func)
            def inner(*args):
                inner.calls += 1
                return func(*args)
            inner.calls = 0
            return inner
        class Registry(type):
            seen = []
            def __new__(mcs, name, bases, namespace):
                cls = super().__new__(mcs, name, bases, namespace)
                mcs.seen.append(name)
                return cls
        @functools.total_ordering
        class Board(metaclass=Registry):
            def __init__(self, rows):
                self.rows = rows
            @functools.cached_property
            def empty(self):
                return sum(v == 0 for row in self.rows for v in row)
            def __eq__(self, other):
                return self.empty == other.empty
            def __lt__(self, other):
                return self.empty < other.empty
        Point = type("Point", (), {"x": 0, "norm": lambda self: abs(self.x)})
        @counted
        def strategy(board):
            b = Board(board)
            ok = isinstance(Board, type) and type(b) is Board and Registry.seen == ["Board"] and Point().norm() == 0
            return "A" if ok and b.empty >= 0 and b <= b else "S"
    """,
    "dataclasses, enum, abc, functools, time": """
        import abc, copy, dataclasses, enum, functools, statistics, time
        class Key(enum.Enum):
            LEFT = "A"
            DOWN = "S"
        class Player(abc.ABC):
            @abc.abstractmethod
            def key(self, board): ...
        @dataclasses.dataclass(order=True)
        class State:
            score: int
            rows: list = dataclasses.field(default_factory=list, compare=False)
            def __post_init__(self):
                object.__setattr__(self, "score", self.score + 0)
        class Corner(Player):
            @functools.lru_cache(maxsize=None)
            def weight(self, n):
                return n * 2
            def key(self, board):
                s = State(self.weight(1), copy.deepcopy(board))
                t = dataclasses.replace(s, score=statistics.mean([3, 5]))
                return Key.DOWN.value if t > s and time.strptime("2026", "%Y").tm_year else Key.LEFT.value
        def strategy(board):
            return Corner().key(board)
    """,
}


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_code_is_judged_clean_and_plays(name):
    code = textwrap.dedent(HONEST[name]).strip() + "\n"
    analysis = rewards.analyse_code(code)
    assert analysis.playable, analysis
    (score,) = scored([fenced(code)])
    assert score["works"] == 1.0 and score["clean"] == 1.0 and score["game"] > 0, score
    result = sandbox.play(code, seed=1, size=3, target=64)
    assert result.status in ("success", "failed"), result


def test_a_tilde_fence_is_a_code_block():
    code = "def strategy(board):\n    return 'A'\n"
    assert rewards.extract_function(fenced(code, "~~~")) == code
    assert rewards.extract_function("~~~~python\n" + code + "~~~~\n") == code


def test_a_name_the_sandbox_leaves_out_is_judged_not_loadable_and_is_an_error_there():
    """functools.singledispatch evaluates annotations: it is not in the sandbox's copy of functools, the judge says so
    (not played, not cheating), and the loader fails on it the same way."""
    code = "import functools\ndef strategy(board):\n    return functools.singledispatch(len) and 'A'\n"
    analysis = rewards.analyse_code(code)
    assert not analysis.cheats and analysis.why_not_played == (
        "uses functools.singledispatch, which the sandbox does not provide"
    )
    (score,) = scored([fenced(code)])
    assert score == {"works": -0.5, "clean": 1.0, "game": 0.0}
    result = sandbox.play(code, seed=0, size=3, target=64)
    assert (result.status, result.error) == ("error", "AttributeError: module 'functools' has no attribute 'singledispatch'")


# --- the prompt, the judge and the loader say the same ------------------------------------------------------------


def test_the_prompt_states_the_contract():
    prompt = rewards.build_prompt()
    assert policy.prompt_rules() in prompt
    for module in policy.MODULES:
        if module not in ("__future__", "collections.abc"):
            assert f" {module}," in prompt or f" {module} " in prompt, module
    for rule in ("eval", "exec", "open", "__import__", "frames", "dunders", "__main__", "Top level"):
        assert rule in prompt


@pytest.mark.parametrize("module", sorted(policy.MODULES))
def test_every_name_the_contract_lists_is_in_the_sandbox(module):
    """The loader serves each listed name that this Python's module has (a `from m import n` of each plays)."""
    import importlib

    real = importlib.import_module(module)
    listed = policy.MODULES[module]
    names = sorted(n for n in dir(real) if not n.startswith("_")) if listed is policy.EVERYTHING else sorted(listed)
    present = [n for n in names if hasattr(real, n)]
    imports = "".join(f"from {module} import {n}\n" for n in present)
    code = imports + "def strategy(board):\n    return 'A'\n"
    if module == "__future__":
        code = "from __future__ import annotations\n" + "def strategy(board):\n    return 'A'\n"
    assert rewards.analyse_code(code).playable, rewards.analyse_code(code)
    result = sandbox.play(code, seed=0, size=3, target=64, move_time_limit=5.0)
    assert result.status == "failed", result


def test_public_names_the_contract_leaves_out_are_judged_missing_and_missing_in_the_sandbox():
    for module, name in [("typing", "get_type_hints"), ("dataclasses", "make_dataclass"), ("string", "Formatter"),
                         ("random", "SystemRandom"), ("contextlib", "redirect_stdout"), ("sys", "modules")]:  # fmt: skip
        code = f"import {module}\ndef strategy(board):\n    return {module}.{name} and 'A'\n"
        analysis = rewards.analyse_code(code)
        assert not analysis.loadable and f"{module}.{name}" in analysis.structure, analysis
        result = sandbox.play(code, seed=0, size=3, target=64)
        assert result.status == "error" and "has no attribute" in result.error, result


# --- a way past the contract scores like the forbidden import, or worse -----------------------------------------

FORBIDDEN_IMPORT = "import os\ndef strategy(board):\n    return 'A'\n"
ESCAPES = {
    "a dunder through getattr with a computed name": """
        def strategy(board):
            g = getattr(strategy, "__glo" + "bals__")
            return g["__builtins__"]["eval"]("'A'")
    """,
    "a dunder through operator.attrgetter": """
        import operator
        def strategy(board):
            return operator.attrgetter("__glob" + "als__")(strategy)["__builtins__"] and "A"
    """,
    "a field name that renders as code, through dataclass": """
        import dataclasses
        class Name(str):
            def isidentifier(self):
                return True
            def __format__(self, spec):
                return "x=__import__('os').system('true')#"
        def strategy(board):
            key = "__annot" + "ations__"
            cls = type("X", (), {key: {Name("x"): int}})
            dataclasses.dataclass(cls)
            return "A"
    """,
    "the class behind a wrapped factory, to build a function": """
        import operator
        def strategy(board):
            function = type(operator.attrgetter("real"))
            code = getattr(strategy, "__co" + "de__")
            return function(code, {})(board)
    """,
    "any attribute through functools.update_wrapper": """
        import functools
        class Grab:
            def __init__(self):
                object.__setattr__(self, "got", {})
            def __setattr__(self, name, value):
                self.got[name] = value
        def strategy(board):
            g = Grab()
            functools.update_wrapper(g, functools.update_wrapper, assigned=("__globals__",), updated=())
            return g.got["__globals__"]["__builtins__"]["eval"]("'A'")
    """,
    "a type's descriptors through functools.cached_property": """
        import collections, functools
        def strategy(board):
            cp = functools.cached_property(len)
            cp.attrname = "__globals__"
            globals_of = cp.__get__(type(strategy))
            return globals_of.__get__(collections.namedtuple)["__builtins__"]["eval"]("'A'")
    """,
    "another module's namespace through Enum._convert_": """
        import enum
        def strategy(board):
            leak = enum.Enum._convert_("Leak", "builtins", lambda name: name == "getattr")
            return leak.getattr.value(strategy, "__globals__") and "A"
    """,
    "a dunder bound by a capture pattern in a class body": """
        class Base:
            match ("__traceback__",):
                case __match_args__:
                    pass
        class Oops(Base, Exception):
            pass
        def strategy(board):
            try:
                raise Oops()
            except Oops as e:
                match e:
                    case Base(tb):
                        return "A" if tb else "S"
    """,
    "super() redirected by nonlocal __class__": """
        import abc
        def strategy(board):
            __class__ = None
            def poke():
                nonlocal __class__
                __class__ = abc.ABCMeta
            poke()
            return "A"
    """,
    "dunder keys in a class made by type()": """
        import copy
        def strategy(board):
            X = type("X", (), {"__reduce_" + "ex__": lambda self, protocol: (list, ())})
            return "A" if copy.copy(X()) == [] else "S"
    """,
    "a metaclass that rewrites __match_args__ for a class pattern": """
        import abc
        class Meta(abc.ABCMeta):
            def poke(cls, name, value):
                super().__setattr__(name, value)
        class P(metaclass=Meta):
            pass
        def strategy(board):
            P.poke("__match" + "_args__", ("__globals__",))
            P.register(type(strategy))
            match strategy:
                case P(g):
                    return g["__builtins__"]["eval"]("'A'")
            return "A"
    """,
}


def test_escapes_score_no_better_than_the_forbidden_import():
    completions = [fenced(FORBIDDEN_IMPORT)] + [fenced(code) for code in ESCAPES.values()]
    scores = scored(completions)
    refused = sum(scores[0].values())
    assert scores[0] == {"works": 1.0, "clean": -20.0, "game": 0.0}
    for name, score in zip(ESCAPES, scores[1:], strict=True):
        assert score["clean"] == -20.0 and score["game"] == 0.0, (name, score)
        assert sum(score.values()) <= refused, (name, score)


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_each_escape_is_caught_by_the_judge_or_at_run_time(name):
    code = textwrap.dedent(ESCAPES[name]).strip() + "\n"
    analysis = rewards.analyse_code(code)
    result = sandbox.play(code, seed=0, size=3, target=64)
    assert analysis.cheats or result.status == "violation", (analysis, result)


# --- the audit hook, alone: code already out of Python (every builtin and module) --------------------------------

AUDITED = {
    "eval": "return eval('\"A\"')",
    "exec": "exec('x = 1')\nreturn 'A'",
    "open": "open('/etc/hostname')\nreturn 'A'",
    "a new import": "__import__('wave')\nreturn 'A'",
    "a frame": "import sys\nreturn sys._getframe().f_back and 'A'",
    "gc": "import gc\nreturn gc.get_objects() and 'A'",
    "os.system": "import os\nos.system('true')\nreturn 'A'",
    "ctypes": "import ctypes\nctypes.CDLL(None)\nreturn 'A'",
    "a code object": "return strategy.__code__ and 'A'",
    "a function from code": "return type(strategy)(compile('1', 'x', 'eval'), {})() and 'A'",
    "another audit hook": "import sys\nsys.addaudithook(lambda *a: None)\nreturn 'A'",
    "dataclasses' generator, called directly": "import dataclasses\nreturn dataclasses._create_fn('f', '', ' return 1') and 'A'",
    "a dataclass with no checked fields": "import dataclasses\nX = type('X', (), {'__annotations__': {'x': int}})\n"
    "dataclasses.dataclass(X)\nreturn 'A'",
    "caught": "try:\n    eval('1')\nexcept BaseException:\n    pass\nreturn 'A'",
    # the hook never runs the strategy's code while it looks (a key whose __eq__ would run while it checks a class)
    "code run inside the hook's own look-up": "import sys\nchecked = sys.modules['sandbox_child']._CHECKS['dataclass']\n"
    "class Key:\n    def __hash__(self):\n        return hash('__dataclass_fields__')\n"
    "    def __eq__(self, other):\n        eval('1')\n        return False\n"
    "checked(type('C', (), {'__annotations__': {'x': int}, Key(): 0}))\nreturn 'A'",
    # dataclasses' generator, called with text of our own while the checked wrapper processes a checked class
    "our text through dataclasses' window": "import sys, dataclasses\n"
    "checked = sys.modules['sandbox_child']._CHECKS['dataclass']\n"
    "class Default:\n    def __get__(self, obj, owner=None):\n"
    "        dataclasses._create_fn('f', [], ['return ().__class__.__base__.__subclasses__()'])\n        return 0\n"
    "checked(type('C', (), {'__annotations__': {'x': int}, 'x': Default()}))\nreturn 'A'",
    "a frame through an exempt module's caller": "import sys, collections\ncm = collections.ChainMap()\n"
    "cm.__missing__ = sys._getframe\nreturn cm[0] and 'A'",
    "after replacing what the hook might use": "import builtins, sys\nbuiltins.len = builtins.isinstance = lambda *a: 0\n"
    "child = sys.modules['sandbox_child']\nchild._violation = child.reply_frame = child.policy = None\n"
    "return eval('\"A\"')",
}


@pytest.mark.parametrize("name", sorted(AUDITED))
def test_the_audit_hook_alone_reports_a_violation(name):
    body = textwrap.indent(AUDITED[name], "    ")
    result = sandbox.play(f"def strategy(board):\n{body}\n", seed=0, size=3, target=64, _unrestricted="audited")
    assert result.status == "violation" and result.error.startswith("run-time event"), result


def test_without_the_hook_the_same_code_runs():
    """The check above proves the hook: with no Python layer at all (the OS walls alone), eval simply works."""
    result = sandbox.play("def strategy(board):\n    return eval('\"A\"')\n", seed=0, size=3, target=64,
                          _unrestricted=True)  # fmt: skip
    assert result.status == "failed", result


# --- model code is never compiled in the trainer -----------------------------------------------------------------


def pathological_match(names: int = 130, alternatives: int = 40) -> str:
    """An or-pattern whose alternatives bind the same names in different orders: ~20k characters that take the
    compiler about a gigabyte (the parser: milliseconds)."""
    import random

    rng, order = random.Random(0), [f"v{i}" for i in range(names)]
    alts = []
    for _ in range(alternatives):
        rng.shuffle(order)
        alts.append("[" + ",".join(order) + "]")
    return f"def strategy(board):\n    match board:\n        case {'|'.join(alts)}:\n            return 'W'\n    return 'A'\n"


@pytest.mark.slow
def test_a_pathological_answer_is_refused_in_the_sandbox_and_costs_the_trainer_nothing():
    code = pathological_match()
    script = f"""
import json, resource, sys, time
sys.path.insert(0, {str(REPO)!r})
import rewards
from types import SimpleNamespace
text = {fenced(code)!r}
settings = rewards.RewardSettings(size=3, target=64, games=2, game_salt="x", move_time_limit=1.0)
funcs = rewards.reward_functions(settings)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.monotonic()
scores = [f([text] * 8, trainer_state=SimpleNamespace(global_step=0)) for f in funcs]
print(json.dumps({{"grew_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
                  "seconds": time.monotonic() - start, "scores": [s[0] for s in scores]}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    measured = json.loads(out.stdout.splitlines()[-1])
    assert measured["grew_mb"] < 100, measured  # the compiler alone needs ~1 GB for it
    # it parses and is clean; its load fails in the sandbox: out of memory (-3, an error) or out of time (0 points)
    assert measured["scores"][:2] == [1.0, 1.0] and measured["scores"][2] in (-3.0, 0.0), measured
    result = sandbox.play(code, seed=0, size=3, target=64, move_time_limit=1.0)
    assert result.status in ("timeout", "error") and result.seconds < 2.0, result


# --- an answer that stalls is not played to the limit in every game ----------------------------------------------


def test_an_answer_that_times_out_is_not_played_on_and_is_scored_on_what_it_played():
    stall = "def strategy(board):\n    while True:\n        pass\n"
    slow = "import time\ndef strategy(board):\n    time.sleep(0.2)\n    return 'A'\n"
    good = strategies.source("greedy")
    settings = RewardSettings(**{**FAST, "games": 4, "move_time_limit": 0.3, "answer_time_limit": 0.5})
    judge = rewards.make_judge(settings)
    logged = {}
    verdicts = judge([fenced(stall), fenced(slow), fenced(good)], SimpleNamespace(global_step=0), logged.__setitem__)
    stalled, slowed, played = (v.games for v in verdicts)
    assert [g.status for g in stalled] == ["timeout"]  # its first game timed out: its other three are not started
    assert 1 <= len(slowed) < 4  # its games used its half-second budget
    assert len(played) == 4 and all(g.status in ("success", "failed") for g in played)
    assert logged["game/skipped_frac"] == pytest.approx((3 + 4 - len(slowed)) / 12)


def test_a_batch_is_played_once_for_all_three_rewards(monkeypatch):
    calls = []
    real = sandbox.play_many
    monkeypatch.setattr(rewards.sandbox, "play_many", lambda jobs, **kw: calls.append(len(jobs)) or real(jobs, **kw))
    scored([fenced(strategies.source("greedy")), fenced(strategies.source("random"))])
    assert calls == [2 * FAST["games"]]
