"""Honest code never trips the sandbox's detection. The seccomp allowlist kills a child on any system call outside it
and the referee scores that as cheating, so nothing that keeps the prompt's rules may make one, however CPython and the
C library work underneath (the server warms up what they do lazily: sandbox_child.prepare_runtime). The proof: every
strategy this project holds that is not written to cheat plays without a violation (the baselines, the compact players,
the demo's answers, the honest rows of the tests, the bench's batch), and so does a tour of the allowed modules'
public functions."""

import importlib.util
import textwrap
from pathlib import Path

import pytest
import test_contract
import test_rewards

import demo_data
import rewards
import sandbox
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
