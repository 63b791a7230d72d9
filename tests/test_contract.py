"""One contract, kept both ways (policy.py): what the prompt allows, the judge scores as clean and the sandbox plays,
and honest code never trips a wall; whatever reaches past it scores exactly like the plain forbidden import: in the code
(the judge), in Python (the audit hook) or outside the process (the kernel, tests/test_sandbox_attacks.py); what an
escape does inside its own process gains it nothing; nothing a model writes is compiled in the trainer's process; an
answer that stalls is not played to the limit in every game."""

import builtins
import importlib
import json
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

import policy
import rewards
import sandbox
import sandbox_server
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
    # Rows an earlier, stricter Python layer punished (issue 25): they play as plain Python does.
    "a positional pattern on a namedtuple": """
        import collections
        Cell = collections.namedtuple("Cell", "row col")
        def strategy(board):
            match Cell(0, len(board)):
                case Cell(0, n) if n:
                    return "A"
            return "S"
    """,
    "a positional pattern on a frozen dataclass with an abc.ABC base": """
        import abc, dataclasses
        class Shape(abc.ABC):
            @abc.abstractmethod
            def area(self): ...
        @dataclasses.dataclass(frozen=True)
        class Rect(Shape):
            w: int
            h: int
            def area(self):
                return self.w * self.h
        def strategy(board):
            match Rect(len(board), 2):
                case Rect(w, 2) if w * 2 == Rect(w, 2).area():
                    return "A"
            return "S"
    """,
    "type(obj) with a metaclass registry and class keywords": """
        class Registry(type):
            kinds = {}
            def __new__(mcs, name, bases, namespace, kind="plain", **kwargs):
                cls = super().__new__(mcs, name, bases, namespace, **kwargs)
                mcs.kinds[name] = kind
                return cls
            def __init__(cls, name, bases, namespace, kind="plain", **kwargs):
                super().__init__(name, bases, namespace, **kwargs)
        class Base(metaclass=Registry):
            def __init_subclass__(cls, tag="", **kwargs):
                super().__init_subclass__(**kwargs)
                cls.tag = tag
        class Corner(Base, kind="corner", tag="c"):
            pass
        def strategy(board):
            c = Corner()
            ok = type(c) is Corner and type(Corner) is Registry and Registry.kinds["Corner"] == "corner"
            return "A" if ok and c.tag == "c" else "S"
    """,
    "typing.runtime_checkable": """
        from typing import Protocol, runtime_checkable
        @runtime_checkable
        class Sized(Protocol):
            def __len__(self) -> int: ...
        def strategy(board):
            return "A" if isinstance(board, Sized) else "S"
    """,
    "random.SystemRandom": """
        import random
        RNG = random.SystemRandom()
        def strategy(board):
            return RNG.choice("AS")
    """,
    "identifiers in Greek letters": """
        def strategy(board):
            α, β = 0.5, len(board)
            γ = "AS"[int(α * β) % 2]
            return γ
    """,
    # Legal Python the prompt never forbids, which the judge refused once.
    "memoryview, locals(), and a frozen dataclass that sets a private field of its own": """
        import dataclasses
        @dataclasses.dataclass(frozen=True)
        class Cells:
            rows: tuple
            def __post_init__(self):
                object.__setattr__(self, "_flat", tuple(v for row in self.rows for v in row))
            def empty(self):
                return self._flat.count(0)
        def strategy(board):
            view = memoryview(bytes(9))
            cells = Cells(tuple(map(tuple, board)))
            text = "{view.nbytes} bytes, {board}".format(**locals())
            return "A" if text.startswith("9 bytes") and cells.empty() >= 0 else "S"
    """,
    "__subclasshook__ on an abstract base class": """
        import abc
        class Player(abc.ABC):
            @classmethod
            def __subclasshook__(cls, other):
                return callable(getattr(other, "key", None)) or NotImplemented
        class Corner:
            def key(self, board):
                return "A"
        def strategy(board):
            return Corner().key(board) if issubclass(Corner, Player) else "S"
    """,
    # What CPython or the C library does lazily, done by the server beforehand (else a system call would kill them).
    "the time functions": """
        import time
        def strategy(board):
            t = time.mktime(time.localtime())
            time.tzset()
            s = time.strftime("%Y %Z", time.gmtime(t)) + time.ctime(0) + time.asctime()
            p = time.strptime("2026-01-02", "%Y-%m-%d")
            return "A" if s and p.tm_year == 2026 and time.process_time() >= 0 else "S"
    """,
    "other encodings and named escapes": """
        def strategy(board):
            data = "é\\N{GREEK SMALL LETTER ALPHA}".encode("utf-16") + "x".encode("cp1252") + "y".encode("idna")
            return "A" if data.decode("utf-16", "ignore") else "S"
    """,
    "a warning at compile time": """
        def strategy(board):
            n = len(board)
            return "A" if n is 3 else "S"
    """,
    "an exception in __del__": """
        class Noisy:
            def __del__(self):
                raise ValueError("ignored, as Python does")
        def strategy(board):
            Noisy()
            return "A"
    """,
    # CPython's C code imports a helper on first use through the running frame's __import__, the strategy's (its
    # import statements' function): such an import is served or a ModuleNotFoundError, never a violation; a module that
    # library code imports reads no file (the child has no path finder).
    "a character's name: the namereplace error handler and a decoded \\N escape": """
        def strategy(board):
            named = "\u00e9".encode("ascii", "namereplace") + "\u2022".encode("ascii", "namereplace")
            bullet = b"\\\\N{BULLET}".decode("unicode_escape")
            return "A" if named == b"\\\\N{LATIN SMALL LETTER E WITH ACUTE}\\\\N{BULLET}" and bullet == "\u2022" else "S"
    """,
    "a coroutine never awaited": """
        async def score(board):
            return len(board)
        def strategy(board):
            score(board)
            return "A"
    """,
    "a codec this Python lacks, caught": """
        def strategy(board):
            missing = 0
            for codec in ("utf-99", "mbcs", "oem", "no-such-codec"):
                try:
                    "x".encode(codec)
                except LookupError:
                    missing += 1
            return "A" if missing == 4 else "S"
    """,
    "huge ints, a Decimal format and a seeded Random (3.12 and 3.13 import their helpers on first use)": """
        import decimal, random
        def strategy(board):
            q, r = divmod(1 << 100000, (1 << 20000) + 1)
            text = format(decimal.Decimal("-0.001"), "z.2f")
            rng = random.Random("board")
            return "AS"[(q + r) % 2] if text == "0.00" and rng.random() < 1 else "W"
    """,
    "string annotations evaluated by typing and singledispatch": """
        from __future__ import annotations
        import functools, typing
        @functools.singledispatch
        def weight(x) -> int:
            return 0
        @weight.register
        def _(x: int) -> int:
            return x
        def strategy(board: list[list[int]]) -> str:
            hints = typing.get_type_hints(strategy)
            return "A" if hints["return"] is str and weight(2) == 2 else "S"
    """,
    "recursion and memory errors, caught": """
        def depth(n):
            return depth(n + 1)
        def strategy(board):
            try:
                depth(0)
            except RecursionError:
                pass
            try:
                board = [0] * 10**10
            except MemoryError:
                return "A"
            return "S"
    """,
}

if sys.version_info >= (3, 12):  # this syntax is new in 3.12 (a SyntaxError before): type aliases are definitions
    HONEST["3.12's type statement and type parameters"] = """
        type Board = list[list[int]]
        class Box[T]:
            def __init__(self, value: T):
                self.value = value
        def first[T](items: list[T]) -> T:
            return items[0]
        def strategy(board: Board):
            type Row = list[int]
            row: Row = first(board)
            return "WASD"[Box(row[0]).value % 4]
    """
    HONEST["3.12's buffer protocol"] = """
        class Cells:
            def __init__(self, board):
                self.data = bytearray(v.bit_length() for row in board for v in row)
            def __buffer__(self, flags):
                return memoryview(self.data)
            def __release_buffer__(self, view):
                view.release()
        def strategy(board):
            with memoryview(Cells(board)) as view:
                return "A" if view.nbytes == len(board) ** 2 else "S"
    """


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


# Honest mistakes: errors, never violations (CPython quotes a syntax error's line from the file the code names: a
# system call the kernel would kill, so the child refuses that open while it compiles).
MISTAKES = {
    "a syntax error": ("def strategy(board)\n    return 'A'\n", "SyntaxError: expected ':' (<strategy>, line 1)"),
    "the compiler's own error": ("def strategy(board):\n    return 'A'\nreturn 1\n",
                                 "SyntaxError: 'return' outside function (<strategy>, line 3)"),
    "a name this Python's module lacks": ("import math\ndef strategy(board):\n    return math.no_such_name() or 'A'\n",
                                          "AttributeError: module 'math' has no attribute 'no_such_name'"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_an_honest_mistake_is_an_error_not_a_violation(name):
    code, error = MISTAKES[name]
    result = sandbox.play(code, seed=0, size=3, target=64)
    assert (result.status, result.error) == ("error", error)


# --- the prompt, the judge and the sandbox say the same -----------------------------------------------------------


def test_the_prompt_states_the_contract():
    prompt = rewards.build_prompt()
    assert policy.prompt_rules() in prompt
    for module in policy.MODULES:
        if module not in ("__future__", "collections.abc"):
            assert f" {module}," in prompt or f" {module} " in prompt, module
    for rule in ("eval", "exec", "open", "__import__", "frames", "dunders", "__main__", "Top level",
                 "sys for constants, getsizeof, recursion limit", "Nothing outside its process"):  # fmt: skip
        assert rule in prompt, rule


# Builtins the judge refuses that the prompt says in other words: they reach outside the process (the terminal, files,
# the process itself) or make code objects.
REFUSED_IN_OTHER_WORDS = {"compile": "code objects", "breakpoint": "frames"} | {
    name: "Nothing outside its process" for name in ("input", "exit", "quit", "help", "copyright", "credits", "license")
}


def test_every_builtin_the_judge_refuses_is_said_in_the_prompt():
    """Nothing stricter unsaid: a builtin that is not allowed is named in the prompt, or said in other words there."""
    rules = policy.prompt_rules()
    refused = [n for n in dir(builtins) if n not in policy.ALLOWED_BUILTINS and not policy.is_dunder(n)]
    refused = [n for n in refused if n not in ("True", "False", "None")]  # constants: not names the judge reads
    assert {"eval", "open", "globals"} <= set(refused) and not {"memoryview", "locals"} & set(refused)
    for name in refused:
        assert f" {name}," in rules or REFUSED_IN_OTHER_WORDS[name] in rules, name
        assert policy.judge(f"def strategy(board):\n    return {name} and 'A'\n")[0] == (f"builtin {name!r}",)


# The protocols of allowed modules that call a strategy's own methods, as their documentation names them: copy's, and
# the pickle methods copy falls back on ("classes can use the same interfaces to control copying that they use to
# control pickling"); abc's; os.PathLike's (os.fspath).
LIBRARY_PROTOCOLS = {
    "copy": ["__copy__", "__deepcopy__", "__replace__"],
    "pickle, as copy uses it": ["__reduce_ex__", "__reduce__", "__getnewargs_ex__", "__getnewargs__", "__getstate__",
                                "__setstate__"],
    "abc": ["__subclasshook__", "__isabstractmethod__"],
    "os.PathLike": ["__fspath__"],
}  # fmt: skip


def test_every_special_method_is_allowed():
    """"Dunders beyond special methods" are refused, so every special method is allowed: each method the running
    Python's own copy of the language reference documents as `object.__x__(...)` (pydoc_data; only type's
    __subclasses__, which nothing calls implicitly, is introspection), and each method of the allowed modules'
    protocols, defined on a class, read and called."""
    import pydoc_data.topics

    documented = set(re.findall(r"(?:object|type|class)\.(__\w+__)\(", " ".join(pydoc_data.topics.topics.values())))
    assert len(documented) > 90 and {"__init__", "__index__", "__buffer__" if sys.version_info >= (3, 12) else "__len__"} <= documented
    assert documented - policy.SAFE_DUNDERS == {"__subclasses__"}
    for name in sorted(documented - {"__subclasses__"}) + [n for names in LIBRARY_PROTOCOLS.values() for n in names]:
        code = f"class Cell:\n    def {name}(self, *args):\n        return 0\ndef strategy(board):\n"
        code += f"    return 'A' if Cell.{name} and getattr(Cell(), {name!r}) else 'S'\n"
        assert policy.judge(code) == ((), None), name


def public_names(module: str) -> list[str]:
    """Every public name of an allowed module on the running Python, derived here, not from the product: dir() and
    __all__ (3.13's typing makes Match, Pattern, ContextManager on first use: in __all__, in dir() only once made)."""
    real = importlib.import_module(module)
    return sorted(n for n in set(dir(real)) | set(getattr(real, "__all__", ())) if not n.startswith("_"))


def left_out(module: str) -> dict[str, str]:
    """The public names of an allowed module that the sandbox does not serve, with why, as the prompt says it."""
    real = importlib.import_module(module)
    out = {}
    for name in public_names(module):
        if not policy.served(module, name):
            value = getattr(real, name)
            if module == "sys":
                out[name] = "not a constant"  # "sys for constants, getsizeof, recursion limit"
            else:
                assert isinstance(value, types.ModuleType) and value.__name__ not in policy.MODULES, (module, name)
                out[name] = f"the module {value.__name__}"  # "import only ..."
    return out


@pytest.mark.parametrize("module", sorted(policy.MODULES))
def test_every_public_name_is_served_or_left_out_as_the_prompt_says(module):
    """One contract: a public name of an allowed module is either in the sandbox's copy, or another module than the
    allowed ones, or a name of sys that is not a constant; both said in the prompt. Every served name imports and
    plays."""
    left_out(module)  # asserts why each one is left out
    served = [n for n in public_names(module) if policy.served(module, n)]
    imports = "".join(f"from {module} import {n}\n" for n in served) if module != "__future__" else ""
    code = "from __future__ import annotations\n" + imports + "def strategy(board):\n    return 'A'\n"
    assert rewards.analyse_code(code).playable, rewards.analyse_code(code)
    result = sandbox.play(code, seed=0, size=3, target=64, move_time_limit=5.0)
    assert result.status == "failed", result


# Left out on 3.11, 3.12 and 3.13 alike: the builtins module (enum imports it as bltns) and os through allowed modules,
# sys's non-constants, private names. (3.11's dataclasses.builtins is gone in 3.12.)
LEFT_OUT_EVERYWHERE = {"enum": {"bltns": "the module builtins"}, "contextlib": {"os": "the module os"},
                       "sys": {"modules": "not a constant"}}  # fmt: skip
PRIVATE_NAMES = [("sys", "_getframe"), ("random", "_inst"), ("random", "_os")]


def test_what_the_contract_leaves_out_is_missing_in_the_sandbox():
    """Every name the contract leaves out on the running Python, and private names that exist, is missing from the
    sandbox's copy (past the judge, a computed name is an AttributeError) and its plain form is a violation."""
    for module, names in LEFT_OUT_EVERYWHERE.items():
        assert names.items() <= left_out(module).items(), module
    assert "_getframe" not in policy.SYS_NAMES
    cases = [(m, n) for m in sorted(policy.MODULES) for n in left_out(m)] + PRIVATE_NAMES
    codes = [f"import {m} as m\ndef strategy(board):\n    return getattr(m, {n!r} + '') and 'A'\n" for m, n in cases]
    results = sandbox.play_many([(code, 0, sandbox.Game(size=3, target=64)) for code in codes])
    for (module, name), result in zip(cases, results, strict=True):
        assert hasattr(importlib.import_module(module), name), (module, name)  # else this proves nothing
        missing = f"AttributeError: module {module!r} has no attribute {name!r}"
        assert (result.status, result.error) == ("error", missing), (module, name)
        plain = f"import {module} as m\ndef strategy(board):\n    return m.{name} and 'A'\n"
        assert policy.judge(plain)[0] == (f"{module}.{name}, which the contract leaves out",)


def test_a_star_import_binds_in_the_judge_what_it_binds_in_the_sandbox():
    """`from M import *` binds M's filtered `__all__` (or its copy's public names): the judge sees those names, so the
    honest `from re import *` with `compile(...)` is re.compile, clean; and in the sandbox the module's names after
    the import are exactly policy.star_names(M), for every allowed module."""
    honest = "from re import *\ndef strategy(board):\n    return 'A' if compile('a+').match('aa') else 'S'\n"
    (score,) = scored([fenced(honest)])
    assert score == {"works": 1.0, "clean": 1.0, "game": score["game"]} and score["game"] > 0, score
    modules = sorted(policy.MODULES - {"__future__"})  # `from __future__ import *` is a SyntaxError
    codes = [f"from {m} import *\nNAMES = dir()\ndef strategy(board):\n"
             f"    wrong = {{n for n in NAMES if not n.startswith('__')}} ^ set({list(policy.star_names(m))!r})\n"
             "    if wrong:\n        raise ValueError(sorted(wrong)[:3])\n    return 'A'\n"
             for m in modules]  # fmt: skip
    for module, code in zip(modules, codes):
        assert rewards.analyse_code(code).playable, (module, rewards.analyse_code(code))
    results = sandbox.play_many([(code, 0, sandbox.Game(size=3, target=64, move_time_limit=5.0)) for code in codes])
    for module, result in zip(modules, results):
        assert result.status == "failed", (module, result)  # not an error: it found the names it expected
    assert "compile" in policy.star_names("re") and "modules" not in policy.star_names("sys")


# Names a star import does not bind are still what they were: a forbidden builtin, or a name the contract leaves out.
STAR_CHEATS = {
    "from sys import *, then exit()": ("from sys import *\ndef strategy(board):\n    return exit() or 'A'\n",
                                       "builtin 'exit'"),
    "from re import *, then open()": ("from re import *\ndef strategy(board):\n    return open('x') and 'A'\n",
                                      "builtin 'open'"),
    "from os import *": ("from os import *\ndef strategy(board):\n    return 'A'\n", "import from os"),
}  # fmt: skip


def test_a_star_import_that_binds_no_forbidden_name_leaves_it_forbidden():
    names = sorted(STAR_CHEATS)
    scores = scored([fenced(STAR_CHEATS[n][0]) for n in names])
    for name, score in zip(names, scores):
        assert score == FORBIDDEN_SCORE, (name, score)
        assert policy.judge(STAR_CHEATS[name][0])[0] == (STAR_CHEATS[name][1],), name


# --- whatever reaches past the contract scores exactly like the forbidden import --------------------------------

FORBIDDEN_IMPORT = "import os\ndef strategy(board):\n    return 'A'\n"
FORBIDDEN_SCORE = {"works": 1.0, "clean": -20.0, "game": 0.0}
# Names of allowed modules that the contract leaves out, and what the prompt names: cheating, seen in the tree.
FORBIDDEN_NAMES = {
    "sys._getframe(1)": "import sys\ndef strategy(board):\n    return sys._getframe(1).f_locals and 'A'\n",
    "sys.modules": "import sys\ndef strategy(board):\n    return sys.modules and 'A'\n",
    "random._inst": "import random\ndef strategy(board):\n    return random._inst.choice('AS')\n",
    "from sys import modules": "from sys import modules\ndef strategy(board):\n    return 'A'\n",
    "enum.bltns": "import enum\ndef strategy(board):\n    return enum.bltns and 'A'\n",
    "contextlib.os": "import contextlib\ndef strategy(board):\n    return contextlib.os and 'A'\n",
    "__subclasses__": "def strategy(board):\n    return ().__class__.__base__.__subclasses__() and 'A'\n",
    "eval": "def strategy(board):\n    return eval('\"A\"')\n",
    "open": "def strategy(board):\n    return open('/etc/hostname') and 'A'\n",
}


def test_forbidden_names_score_exactly_like_the_forbidden_import():
    names = sorted(FORBIDDEN_NAMES)
    scores = scored([fenced(FORBIDDEN_IMPORT)] + [fenced(FORBIDDEN_NAMES[n]) for n in names])
    assert scores[0] == FORBIDDEN_SCORE
    for name, score in zip(names, scores[1:], strict=True):
        assert score == FORBIDDEN_SCORE, (name, score)


# Ways past the judge (it reads only the plain forms), each going on to act outside its process: to a file, a
# signal, a process. The audit hook or the kernel sees them; which one does not matter to the score.
ROUTE_TO_BUILTINS = """
import functools
class Grab:
    def __init__(self):
        object.__setattr__(self, "got", {})
    def __setattr__(self, name, value):
        self.got[name] = value
def real_builtins():
    g = Grab()
    functools.update_wrapper(g, functools.update_wrapper, assigned=("__globals__",), updated=())
    return g.got["__globals__"]["__builtins__"]  # functools' own module globals: read in functools' code
"""
ESCAPES = {
    "a dunder through getattr with a computed name": """
        import random
        def strategy(board):
            b = getattr(random.choice, "__glo" + "bals__")["__builtins__"]  # random's module: the real builtins
            return b["open"]("/etc/hostname") and "A"
    """,
    "a dunder through operator.attrgetter": """
        import operator, random
        def strategy(board):
            b = operator.attrgetter("__glob" + "als__")(random.choice)["__builtins__"]
            return b["__import__"]("os").getppid() and "A"
    """,
    "a type's descriptor through functools.cached_property": """
        import collections, functools
        def strategy(board):
            cp = functools.cached_property(len)
            cp.attrname = "__globals__"
            g = cp.__get__(type(strategy)).__get__(collections.namedtuple)
            return g["_sys"].modules["os"].kill(0, 0) and "A"
    """,
    "another module's namespace through a computed Enum._convert_": """
        import enum
        def strategy(board):
            convert = getattr(enum.Enum, "_conv" + "ert_")
            leak = convert("Leak", "builtins", lambda name: name == "open")
            return leak.open.value("/etc/hostname") and "A"
    """,
    "a metaclass that rewrites __match_args__ for a class pattern": """
        import abc, random
        class Meta(abc.ABCMeta):
            def poke(cls, name, value):
                super().__setattr__(name, value)
        class P(metaclass=Meta):
            pass
        def strategy(board):
            P.poke("__match_args__", ("__globals__",))
            P.register(type(random.choice))
            match random.choice:
                case P(g):
                    return g["__builtins__"]["open"]("/etc/hostname") and "A"
            return "A"
    """,
    "copy's globals through a __reduce__ that copy calls, then os": """
        import copy
        class Grab:
            def __reduce__(self):
                return (getattr, (copy.deepcopy, "__glo" + "bals__"))  # called in copy's own code
        def strategy(board):
            os = copy.copy(Grab())["__builtins__"]["__import__"]("os")
            os.kill(os.getppid(), 0)
            return "A"
    """,
    "functools' globals through update_wrapper, then os": ROUTE_TO_BUILTINS + textwrap.dedent("""
        def strategy(board):
            os = real_builtins()["__import__"]("os")
            os.kill(os.getppid(), 0)
            return "A"
    """),
    "code made to look like the library's, past the audit hook: only the kernel sees it": ROUTE_TO_BUILTINS
    + textwrap.dedent("""
        def strategy(board):
            b = real_builtins()
            text = "import os\\ntry:\\n    os.kill(os.getppid(), 0)\\nexcept OSError:\\n    pass"
            code = b["compile"](text, getattr(b["__import__"]("dataclasses"), "__fi" + "le__"), "exec")
            functools.singledispatch(b["exec"])(code, {"__builtins__": b})  # exec called in functools' code
            return "A"
    """),
}


def test_escapes_that_act_outside_score_exactly_like_the_forbidden_import():
    names = sorted(ESCAPES)
    codes = [textwrap.dedent(ESCAPES[n]).strip() + "\n" for n in names]
    for name, code in zip(names, codes, strict=True):
        assert rewards.analyse_code(code).playable, (name, rewards.analyse_code(code))  # the judge misses each
    scores = scored([fenced(FORBIDDEN_IMPORT)] + [fenced(c) for c in codes])
    for name, score in zip(names, scores[1:], strict=True):
        assert score == scores[0] == FORBIDDEN_SCORE, (name, score)


# Plain code, no escape, whose call reaches outside its process through a public function of an allowed module: the
# kernel sees it. (Arguments that name nothing outside are the kernel's own error, as in plain Python:
# tests/test_detection.py.)
REACHES_OUTSIDE = {
    "the machine's clock, whatever the value": "time.clock_settime(time.CLOCK_REALTIME, -1.0)",
    "another process's CPU clock (pid 1's)": "time.clock_gettime(((~1) << 3) | 2)",
}


def test_plain_calls_that_reach_outside_score_exactly_like_the_forbidden_import():
    names = sorted(REACHES_OUTSIDE)
    codes = [f"import time\ndef strategy(board):\n    {REACHES_OUTSIDE[n]}\n    return 'A'\n" for n in names]
    scores = scored([fenced(c) for c in codes])
    for name, code, score in zip(names, codes, scores, strict=True):
        assert policy.judge(code) == ((), None), name
        assert score == FORBIDDEN_SCORE, (name, score)
        result = sandbox.play(code, seed=0, size=3, target=64)
        assert (result.status, result.error) == ("violation", sandbox_server.SECCOMP_KILL), (name, result)


def test_the_escape_past_the_audit_hook_is_seen_by_the_kernel():
    name = "code made to look like the library's, past the audit hook: only the kernel sees it"
    result = sandbox.play(textwrap.dedent(ESCAPES[name]), seed=0, size=3, target=64)
    assert (result.status, result.error) == ("violation", sandbox_server.SECCOMP_KILL)


def test_an_escape_that_stays_inside_its_process_gains_nothing():
    """Out of Python but inside its process, an answer reads what it likes there (here every module the child holds)
    and plays: no seed, no game, no engine to reach, so it scores exactly like the same player without the escape."""
    greedy = strategies.source("greedy")
    reads = ROUTE_TO_BUILTINS + "\n_SEEN = sorted(real_builtins()['__import__']('sys').modules)\n\n" + greedy
    assert rewards.analyse_code(reads).playable
    escaped, honest = scored([fenced(reads), fenced(greedy)])
    assert escaped == honest and honest["game"] > 0, (escaped, honest)


# --- the audit hook, alone: code already out of Python (every builtin and module, no judge) ---------------------

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
    "caught": "try:\n    eval('1')\nexcept BaseException:\n    pass\nreturn 'A'",
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


def test_the_judge_alone_refuses_without_a_process():
    """The judge's own wall: a plain forbidden form is a violation in the trainer's side of the sandbox, before any
    process exists (nothing to time, nothing played)."""
    result = sandbox.play(FORBIDDEN_IMPORT, seed=0, size=3, target=64)
    assert result == sandbox.GameResult("violation", error="import of 'os'")


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
