"""Honest code never trips the sandbox's detection. The seccomp allowlist kills a child on any system call outside it
and the referee scores that as cheating, so nothing that keeps the prompt's rules may make one, however CPython and the
C library work underneath (the server warms up what they do lazily: sandbox_child.prepare_runtime). The proof: every
strategy this project holds that is not written to cheat plays without a violation (the baselines, the compact players,
the demo's answers, the honest rows of the tests, the bench's batch), and so does a tour of the allowed modules'
public functions.

Beyond "no violation": played in the sandbox and as plain Python (a fresh interpreter, every builtin, no walls), honest
code ends the same way: the same game, the same error, the same crash. Plain Python is the oracle: what it raises is
an honest error, and a fatal error of CPython's is a crash, never cheating."""

import importlib
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import test_contract
import test_rewards

import demo_data
import policy
import rewards
import sandbox
import sandbox_server
import strategies

REPO = Path(__file__).resolve().parent.parent
GAME = sandbox.Game(size=3, target=64, move_time_limit=2.0, game_time_limit=4.0)


@pytest.fixture(scope="module", autouse=True)
def server():
    sandbox.start()
    assert sandbox.walls()["seccomp"], "detection needs the seccomp allowlist (libseccomp and pyseccomp)"
    yield
    sandbox.shutdown()


def bench_batch() -> list[str]:
    spec = importlib.util.spec_from_file_location("bench_sandbox", REPO / "bench" / "bench_sandbox.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return list(bench.BATCH)


def honest_codes() -> dict[str, str]:
    """Every strategy of the project not written to cheat, by where it comes from."""
    codes = {f"strategies.{n}": strategies.source(n) for n in {**strategies.BASELINES, **strategies.COMPACT}}
    for i, (kind, _, text) in enumerate(demo_data.EXAMPLES):
        code = rewards.extract_function(text)
        if code is not None and kind != "cheats":
            codes[f"demo {i} ({kind})"] = code
    codes |= {f"test_contract {n}": textwrap.dedent(c).strip() + "\n" for n, c in test_contract.HONEST.items()}
    codes |= {f"test_contract mistake {n}": code for n, (code, _) in test_contract.MISTAKES.items()}
    codes |= {f"test_rewards {n}": c for n, c in test_rewards.HONEST.items()} | {"test_rewards GOOD": test_rewards.GOOD}
    codes |= {f"bench {i}": c for i, c in enumerate(bench_batch())}
    codes["a tour of the allowed modules"] = TOUR
    return codes


TOUR = '''
import abc, array, bisect, cmath, collections, contextlib, copy, dataclasses, decimal, enum, fractions, functools
import heapq, itertools, math, numbers, operator, random, re, statistics, string, sys, time, typing
from collections import abc as cabc

def tour():
    out = []
    a = array.array("d", [1.0, 2.0])
    a.append(3.0)
    out += [a.tobytes(), bisect.bisect([1, 2, 3], 2), bisect.insort([1, 3], 2), cmath.sqrt(-1), cmath.phase(1j)]
    out += [collections.Counter("hello").most_common(1), collections.deque([1], maxlen=2), collections.OrderedDict(a=1)]
    out += [collections.ChainMap({}, {1: 2})[1], collections.defaultdict(list)[0], collections.UserDict(a=1)]
    with contextlib.suppress(KeyError), contextlib.ExitStack() as stack, contextlib.redirect_stdout(None):
        stack.callback(print, "called back")
        print("to nowhere")
    out.append(copy.deepcopy({"a": [1, 2]}))
    D = dataclasses.make_dataclass("D", [("x", int, dataclasses.field(default=0))], frozen=True, order=True)
    out += [dataclasses.asdict(D(1)), dataclasses.replace(D(1), x=2), dataclasses.fields(D), D(1) < D(2)]
    with decimal.localcontext() as context:
        context.prec = 10
        out += [decimal.Decimal(1) / decimal.Decimal(7), format(decimal.Decimal("1234.5"), ",.2f")]
    Color, Flags = enum.Enum("Color", "RED GREEN"), enum.IntFlag("Flags", "A B")
    out += [list(Color), Flags.A | Flags.B, enum.unique(enum.Enum("U", "X Y"))]
    out += [fractions.Fraction("3/7") + fractions.Fraction(1.5), fractions.Fraction(1, 3).limit_denominator(10)]
    fib = functools.lru_cache(maxsize=None)(lambda n: n if n < 2 else fib(n - 1) + fib(n - 2))
    out += [fib(60), functools.reduce(operator.add, range(5)), functools.partial(pow, 2)(5), functools.cmp_to_key(len)]
    out += [heapq.nsmallest(2, [3, 1, 2]), list(itertools.islice(itertools.count(), 3)), list(itertools.pairwise("ab"))]
    out += [math.gcd(12, 18), math.isqrt(99), math.log2(8), math.comb(5, 2), math.inf, math.nan]
    out += [isinstance(1, numbers.Integral), operator.itemgetter(1)([1, 2]), operator.attrgetter("real")(1)]
    out += [operator.methodcaller("upper")("a"), isinstance([], cabc.Sequence)]
    rng = random.Random(1)
    random.seed()
    out += [rng.random(), random.SystemRandom().randrange(10), random.randbytes(4), random.sample(range(9), 3)]
    out += [random.gauss(0, 1), random.getrandbits(64), random.shuffle([1, 2, 3])]
    out += [re.sub(r"(\\\\w+)", r"<\\\\1>", "a b"), re.compile("x+", re.I | re.DEBUG).pattern, re.findall("a", "aa")]
    out += [statistics.median([1, 3, 2]), statistics.stdev([1, 2, 3]), statistics.NormalDist(0, 1).cdf(0.5)]
    out += [string.Template("$x").substitute(x=1), string.capwords("a b"), string.Formatter().format("{0}", 1)]
    sys.setrecursionlimit(sys.getrecursionlimit())
    out += [sys.getsizeof([]), sys.maxsize, sys.float_info.epsilon, sys.version_info >= (3,), sys.byteorder]
    time.sleep(0)
    out += [time.time(), time.monotonic_ns(), time.perf_counter(), time.process_time(), time.thread_time()]
    out += [time.strftime("%c %Z %z", time.localtime()), time.mktime(time.gmtime(0)), time.get_clock_info("monotonic")]
    out += [time.clock_gettime(time.CLOCK_MONOTONIC), time.strptime("12:30", "%H:%M"), time.ctime()]
    T = typing.TypeVar("T")
    NT = typing.NamedTuple("NT", [("a", int)])
    TD = typing.TypedDict("TD", {"a": int})
    out += [T, NT(1), TD(a=1), typing.get_args(typing.List[int]), typing.get_origin(typing.Dict[str, int])]
    out += [typing.cast(int, 1), typing.NewType("UserId", int)(5), typing.Optional[int], typing.ForwardRef("int")]
    if sys.version_info >= (3, 12):  # what 3.12 added (the GPU images run 3.12)
        out += [list(itertools.batched("abcde", 2)), math.sumprod([1, 2], [3, 4]), random.binomialvariate(5, 0.5)]
        out += [statistics.correlation([1, 2, 3], [1, 3, 2], method="ranked"), typing.override(lambda: 0)]
    if sys.version_info >= (3, 13):  # and 3.13
        out += [copy.replace(D(1), x=3), statistics.kde([1, 2, 3], h=1)(2), math.fma(2.0, 3.0, 1.0)]

    class Base(abc.ABC):
        @abc.abstractmethod
        def f(self): ...

    Base.register(int)
    out += [isinstance(1, Base), abc.get_cache_token() is not None, str(out)[:0]]
    return out


def strategy(board):
    if not getattr(strategy, "toured", False):
        strategy.toured = len(tour())
    return random.choice("WASD")
'''


def test_every_honest_strategy_plays_without_a_violation():
    codes = honest_codes()
    names = sorted(codes)
    results = sandbox.play_many([(codes[n], 1, GAME) for n in names])
    violations = {n: r.error for n, r in zip(names, results, strict=True) if r.status == "violation"}
    assert violations == {}
    tour = results[names.index("a tour of the allowed modules")]
    assert tour.status in ("success", "failed") and tour.moves > 0, tour
    assert len(names) > 60  # the collection found what it should


# --- the same outcome as plain Python -----------------------------------------------------------------------------

# Plays each job's strategy as plain Python: a fresh interpreter (every builtin, no judge, no walls), each job in a
# fork of its own, play_game's loop. Prints one result per job: the game's end, the error raised, or the signal.
PLAIN_RUNNER = r"""
import json, os, signal, sys, types
sys.path.insert(0, sys.argv[1])
import game2048

def describe(exc):
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

def play(code, seed, rules):
    module = types.ModuleType("strategy")
    sys.modules["strategy"] = module
    try:
        exec(compile(code, "<strategy>", "exec", dont_inherit=True), module.__dict__)
        game = game2048.play_game(module.strategy, seed=seed, **rules)
        return {"status": game.state(), "moves": game.moves, "score": game.score()}
    except Exception as exc:
        return {"status": "error", "error": describe(exc)}
    except BaseException as exc:
        return {"status": "crash", "error": "raised " + describe(exc)}

results = []
for code, seed, rules in json.load(sys.stdin):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what the strategy prints is not our reply
        os.write(w, json.dumps(play(code, seed, rules)).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    status = os.waitpid(pid, 0)[1]
    if os.WIFSIGNALED(status):
        data = json.dumps({"status": "crash", "error": "killed by signal " + signal.Signals(os.WTERMSIG(status)).name})
    results.append(json.loads(data or '{"status": "crash", "error": "no result"}'))
print(json.dumps(results))
"""
PLAYED = ("success", "failed", "capped")


def plain_outcomes(codes: list[str], seed: int = 1) -> list[tuple]:
    """Each code's outcome as plain Python plays it (the oracle): ("played", state, moves, score), ("error", text) or
    ("crash", how)."""
    rules = dict(size=GAME.size, target=GAME.target, probability_fours=GAME.probability_fours, keys=GAME.keys)
    env = {"PYTHONHASHSEED": "0", "TZ": "UTC"}  # as the sandbox's server and children have them
    out = subprocess.run([sys.executable, "-s", "-P", "-W", "ignore", "-c", PLAIN_RUNNER, str(REPO)], cwd="/",
                         input=json.dumps([(c, seed, rules) for c in codes]), capture_output=True, text=True, env=env,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    outcomes = []
    for r in json.loads(out.stdout):
        if r["status"] in PLAYED:
            outcomes.append(("played", r["status"], r["moves"], r["score"]))
        else:  # the error text as the referee reports it: one line, capped
            outcomes.append((r["status"], sandbox_server._one_line(r["error"])))
    return outcomes


def sandbox_outcomes(codes: list[str], seed: int = 1) -> list[tuple]:
    """The same for the sandbox, every wall on; a crash by its signal alone (the referee adds why)."""
    outcomes = []
    for r in sandbox.play_many([(c, seed, GAME) for c in codes]):
        if r.status in PLAYED:
            outcomes.append(("played", r.status, r.moves, r.score))
        elif r.status == "crash":
            outcomes.append(("crash", r.error.split(" (")[0]))
        else:
            outcomes.append((r.status, r.error))
    return outcomes


def assert_same_as_plain(codes: dict[str, str]) -> list[tuple]:
    """Every code ends in the sandbox as in plain Python; returns plain Python's outcomes (in sorted name order)."""
    names = sorted(codes)
    texts = [textwrap.dedent(codes[n]).strip() + "\n" for n in names]
    plain, boxed = plain_outcomes(texts), sandbox_outcomes(texts)
    differ = {n: (p, b) for n, p, b in zip(names, plain, boxed, strict=True) if p != b}
    assert differ == {}, "\n".join(f"{n}: plain {p}, sandbox {b}" for n, (p, b) in differ.items())
    return plain


# Honest code that once met a wall plain Python does not have (issue 31). Each row names the outcome plain Python gives.
SAME_AS_PLAIN = {
    # 1. A compiler-stage error in code the library compiles: CPython opens the file the code names to quote the line.
    "an error: typing compiles a string annotation the compiler refuses": """
        from __future__ import annotations
        import typing
        def weight(cell: typing.Annotated[int, dict(bonus=1, bonus=2)]) -> int:
            return cell
        def strategy(board):
            typing.get_type_hints(weight, include_extras=True)
            return "A"
    """,
    "played: typing.ForwardRef's SyntaxError, caught": """
        import typing
        def strategy(board):
            try:
                typing.ForwardRef("max(key=len, key=len)")
            except SyntaxError:
                return "A"
            return "S"
    """,
    "an error: dataclasses compiles an __init__ with a repeated argument": """
        import dataclasses
        def strategy(board):
            dataclasses.make_dataclass("Cell", ["self", "__dataclass_self__"])
            return "A"
    """,
    # 2. A fatal error of CPython's (3.11-3.13): a C stack overflow while an exception is being made ends in abort().
    "a crash: CPython's fatal error on recursion in an exception's constructor during generator.throw": """
        class Deep(Exception):
            def __init__(self, *args):
                def down(n):
                    return down(n + 1)
                down(0)
        def moves():
            yield "A"
        def strategy(board):
            gen = moves()
            next(gen)
            gen.throw(Deep, None)
            return "A"
    """,
    # 3. Clock ids that name no clock, or a clock only a newer kernel has (16-23 are 6.17's auxiliary clocks): the
    # kernel's own answer, a value or EINVAL; ids -8..-1 name the calling process itself.
    "an error: the clocks each id names, or the kernel's EINVAL": """
        import time
        def strategy(board):
            seen = []
            for clock in (11, 12, 15, 16, 23, 24, 100, 2**31 - 1, -1, -2, -6, -8):
                for call in (time.clock_getres, time.clock_gettime, time.clock_gettime_ns):
                    try:
                        seen.append(type(call(clock)).__name__)
                    except OSError as exc:
                        seen.append(exc.errno)
            raise ValueError(seen)
    """,
    # 4. `import *` binds the module's __all__ (else its public names), never other names of its copy.
    "played: from typing import * after import re keeps re": """
        import re
        from typing import *
        def strategy(board):
            return "A" if re.findall("a", "aa") == ["a", "a"] else "S"
    """,
    "played: from collections import * after import abc keeps abc": """
        import abc
        from collections import *
        class Player(abc.ABC):
            pass
        def strategy(board):
            return "A" if Counter("aab")["a"] == 2 and Player else "S"
    """,
    "played: from enum import * keeps the builtin bin": """
        from enum import *
        def strategy(board):
            return "A" if bin(5) == "0b101" and Enum else "S"
    """,
    # 5. The protocols the allowed modules call on a strategy's objects: copy's and the pickle methods copy uses.
    "played: copy's protocols": """
        import copy
        class Cells:
            def __init__(self, rows):
                self.rows = [list(r) for r in rows]
            def __getstate__(self):
                return {"rows": self.rows, "n": len(self.rows)}
            def __setstate__(self, state):
                self.rows, self.n = state["rows"], state["n"]
            def __deepcopy__(self, memo):
                return Cells(copy.deepcopy(self.rows, memo))
            def __fspath__(self):
                return "cells"
            def __index__(self):
                return len(self.rows)
        class Move:
            def __init__(self, key, score):
                self.key, self.score = key, score
            def __reduce__(self):
                return (Move, (self.key, self.score))
            def __copy__(self):
                return Move(self.key, self.score + 1)
        class Pair(tuple):
            def __new__(cls, a, b):
                return super().__new__(cls, (a, b))
            def __getnewargs__(self):
                return tuple(self)
            def __reduce_ex__(self, protocol):
                return (Pair, tuple(self))
        def strategy(board):
            cells = copy.copy(Cells(board))
            ok = cells.n == len(board) and copy.deepcopy(cells).rows == board and cells.__fspath__() == "cells"
            ok = ok and "AS"[Cells([[0]])] == "S" and copy.copy(Move("A", 1)).score == 2
            return "A" if ok and copy.deepcopy(Pair(1, 2)) == (1, 2) and copy.copy(Move("A", 1)).key else "S"
    """,
}
if sys.version_info >= (3, 13):
    SAME_AS_PLAIN["played: copy.replace's protocol (3.13)"] = """
        import copy
        class Cell:
            def __init__(self, value):
                self.value = value
            def __replace__(self, **changes):
                return Cell(changes.get("value", self.value))
        def strategy(board):
            return "A" if copy.replace(Cell(1), value=2).value == 2 else "S"
    """


def test_honest_code_ends_as_it_does_in_plain_python():
    assert_same_as_plain(SAME_AS_PLAIN)


def star_names(module: str) -> tuple[list[str], list[str]]:
    """What `from module import *` binds in plain Python (its __all__, else its names without a leading underscore),
    split into what the contract serves and what it leaves out (policy.served: sys's non-constants, other modules than
    the allowed ones)."""
    real = importlib.import_module(module)
    names = getattr(real, "__all__", None)
    names = [n for n in vars(real) if not n.startswith("_")] if names is None else names
    return sorted(n for n in names if policy.served(module, n)), sorted(n for n in names if not policy.served(module, n))


@pytest.mark.parametrize("module", sorted(policy.MODULES - {"__future__"}))
def test_import_star_binds_what_plain_python_binds(module):
    """`from m import *` binds exactly what it binds in plain Python, less what the contract leaves out: so it shadows
    no import and no builtin that plain Python keeps."""
    served, left_out = star_names(module)
    code = f"""
        from {module} import *
        BOUND = sorted(n for n in locals() if not n.startswith("_") and n not in {left_out!r})
        EXPECTED = {served!r}
        def strategy(board):
            if BOUND != EXPECTED:
                raise ValueError(("extra", sorted(set(BOUND) - set(EXPECTED)), "missing", sorted(set(EXPECTED) - set(BOUND))))
            return "A"
    """
    assert_same_as_plain({module: code})


# Wrong arguments of every kind: none, an object of no use, a str, a negative int, None, too many, an unknown keyword.
WRONG_ARGUMENTS = (
    '((), {}), ((object(),), {}), (("x",), {}), ((-1,), {}), ((None,), {}), ((None, None), {}), (("x", -1, "y"), {}), '
    '((), {"no_such_keyword": 1})'
)


def public_callables() -> list[tuple[str, str]]:
    """(module, name) for every public callable the sandbox serves of every allowed module, classes included."""
    out = []
    for module in sorted(policy.MODULES - {"__future__"}):
        real = importlib.import_module(module)
        names = policy.SYS_NAMES if module == "sys" else test_contract.public_names(module)
        out += [(module, n) for n in sorted(names) if policy.served(module, n) and callable(getattr(real, n, None))]
    return out


def wrong_arguments_tour(module: str, name: str) -> str:
    """A strategy that calls module.name with each of WRONG_ARGUMENTS and raises what came of each: the error's type and
    a digest of its text (PYTHONHASHSEED is 0 on both sides; addresses left out)."""
    return f"""
        import re
        import {module} as m
        CALLS = ({WRONG_ARGUMENTS})
        def strategy(board):
            seen = []
            for args, kwargs in CALLS:
                try:
                    getattr(m, {name!r})(*args, **kwargs)
                    seen.append("ok")
                except Exception as exc:
                    seen.append(type(exc).__name__ + ":" + str(hash(re.sub("0x[0-9a-f]+", "", str(exc))) % 10000))
            raise ValueError(" ".join(seen))
    """


# Public callables that import, on first use, a module the server does not load: in the child that import is a
# ModuleNotFoundError (it reads no file), an honest error where plain Python goes on.
IMPORTS_WHAT_THE_CHILD_LACKS = {
    ("random", "main"): "3.13's command line: argparse, whose messages would read gettext's catalogs from disk",
}


@pytest.mark.slow
def test_every_public_callable_with_wrong_arguments_fails_as_in_plain_python():
    """The wider honest tour: every public callable of every allowed module, called with wrong arguments, raises in
    the sandbox exactly what it raises in plain Python (or crashes as it does there), and is never a violation."""
    calls = public_callables()
    assert len(calls) > 500, len(calls)  # the collection found what it should
    lacking = [c for c in calls if c in IMPORTS_WHAT_THE_CHILD_LACKS]
    for outcome in sandbox_outcomes([textwrap.dedent(wrong_arguments_tour(*c)).strip() + "\n" for c in lacking]):
        assert outcome[0] == "error" and "ModuleNotFoundError" in outcome[1], outcome
    calls = [c for c in calls if c not in IMPORTS_WHAT_THE_CHILD_LACKS]
    plain = assert_same_as_plain({f"{m}.{n}": wrong_arguments_tour(m, n) for m, n in calls})
    toured = [o for o in plain if o[0] == "error" and o[1].startswith("ValueError: ") and len(o[1].split()) == 9]
    assert len(toured) > len(calls) - 5, [o for o in plain if o not in toured]  # each call made; a few crash
