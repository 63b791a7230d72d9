"""The sandbox plays ordinary strategies exactly like the engine, in parallel, and cleans up after itself.

Hostile strategies are in test_sandbox_attacks.py.
"""

import dataclasses
import os
import resource
import shutil
import signal
import subprocess
import time

import psutil
import pytest

import game2048
import policy
import sandbox
import sandbox_child
import strategies

QUICK = dict(move_time_limit=0.5, game_time_limit=2.0)
TO_BEPO = 'KEYS = {"W": "é", "A": "a", "S": "u", "D": "i"}\n'


@pytest.fixture(scope="module", autouse=True)
def server():
    sandbox.start()
    yield
    sandbox.shutdown()


def our_processes():
    """Our descendants other than the server and its idle spares (after a result there must be none)."""
    server, spares = sandbox._idle_pids()
    return [p for p in psutil.Process().children(recursive=True) if not idle(p, server, spares)]


def idle(process, server, spares) -> bool:
    """The server, a spare referee, or a spare's own child."""
    try:
        return process.pid == server or process.pid in spares or process.ppid() in spares
    except psutil.NoSuchProcess:
        return True  # gone while we looked


def engine_result(strategy, **kwargs):
    game = game2048.play_game(strategy, **kwargs)
    state = game.state()
    return (state, game.moves, game.score(), game.max_tile())


def summary(result):
    return (result.status, result.moves, result.score, result.max_tile)


def bepo(name):
    """A baseline answering in the BÉPO alphabet (é up, a left, u down, i right), as source and as a function."""
    code = TO_BEPO + strategies.source(name).replace("def strategy(", "def base(", 1)
    code += "\n\ndef strategy(board):\n    return KEYS[base(board)]\n"
    base = strategies.BASELINES[name]
    keys = {"W": "é", "A": "a", "S": "u", "D": "i"}
    return code, lambda board: keys[base(board)]


# --- ordinary strategies: exactly the engine's game ---------------------------------------------------

BOARDS = [
    pytest.param(dict(seed=0, size=6, target=2048), marks=pytest.mark.slow),
    dict(seed=1, size=4, target=256),
    dict(seed=2, size=5, target=512, probability_fours=0.3),
]


@pytest.mark.parametrize("board", BOARDS, ids=["6x6", "4x4", "5x5-p4"])
@pytest.mark.parametrize("name", list(strategies.BASELINES))
def test_baselines_play_exactly_the_engines_game(name, board):
    expected = engine_result(strategies.BASELINES[name], **board)
    result = sandbox.play(strategies.source(name), move_time_limit=30, game_time_limit=60, **board)
    assert summary(result) == expected
    assert result.error == ""
    assert our_processes() == []


@pytest.mark.parametrize("name", list(strategies.BASELINES))
def test_baselines_in_the_bepo_alphabet(name):
    code, function = bepo(name)
    board = dict(seed=5, size=4, target=128, keys="éaui")
    expected = engine_result(function, **board)
    assert summary(sandbox.play(code, move_time_limit=30, game_time_limit=60, **board)) == expected


def test_a_stuck_strategy_fails_as_idle_like_the_engine():
    expected = engine_result(lambda board: "W", seed=3, size=4)
    r = sandbox.play("def strategy(board):\n    return 'W'\n", seed=3, size=4, **QUICK)
    assert summary(r) == expected and expected[0] == "failed"
    assert "idle" in r.error


def test_upper_case_and_padded_keys_are_keys():
    code = "def strategy(board):\n    import random\n    return ' ' + random.choice('ÉAUI') + '\\n'\n"
    r = sandbox.play(code, seed=4, size=4, target=64, keys="éaui", **QUICK)
    assert r.status in ("success", "failed") and r.moves > 0


def test_same_seed_same_game_and_unseeded_games_run():
    code = strategies.source("random")
    a, b = (sandbox.play(code, seed=11, size=4, **QUICK) for _ in range(2))
    assert a == dataclasses.replace(b, seconds=a.seconds)
    assert sandbox.play(code, seed=None, size=4, **QUICK).status in ("success", "failed")


def test_every_allowed_module_imports():
    imports = "\n".join(f"import {m}" for m in sorted(policy.MODULES) if m != "__future__")
    code = (
        "from __future__ import annotations\n"
        f"{imports}\n"
        "from collections import Counter, deque\n"
        "from dataclasses import dataclass, field\n"
        "from typing import List\n\n"
        "@dataclass\nclass Memo:\n    seen: dict = field(default_factory=dict)\n\n"
        "def strategy(board: List[List[int]]) -> str:\n"
        "    memo = Memo()\n"
        "    total = statistics.mean(sum(board, [])) + math.log2(2) + float(fractions.Fraction(1, 2))\n"
        "    total += float(decimal.Decimal('1.5')) + heapq.nlargest(1, [1, 2])[0] + bisect.bisect([1, 2], 1)\n"
        "    memo.seen[len(re.findall('a', 'aa'))] = total\n"
        "    return random.choice('WASD') if memo.seen and time.monotonic() > 0 else 'W'\n"
    )
    r = sandbox.play(code, seed=6, size=4, target=64, **QUICK)
    assert r.status in ("success", "failed"), r


def test_the_allowed_modules_are_pure_computation_and_sys_its_constants():
    assert {"math", "random", "itertools", "functools", "collections", "heapq"} <= policy.MODULES
    assert not {"os", "io", "gc", "inspect", "importlib", "ctypes", "pickle", "subprocess"} & policy.MODULES
    assert not {"modules", "_getframe", "settrace", "exit", "stdout", "path", "argv"} & policy.SYS_NAMES
    assert {"maxsize", "float_info", "byteorder", "getsizeof", "setrecursionlimit"} <= policy.SYS_NAMES


def test_a_lazy_import_by_cpython_is_never_a_violation(monkeypatch):
    """CPython's C code imports a helper on first use through the running frame's `__import__`, the strategy's, with a
    list as fromlist (a statement passes None or a tuple), then reads sys.modules itself. Whatever the module, that is
    never a violation: nothing to hand back when the server loaded it, an honest ModuleNotFoundError when not."""

    def violation(what):
        raise AssertionError(f"a violation: {what}")

    monkeypatch.setattr(sandbox_child, "_violation", violation)  # the real one writes to fd 4 and exits
    for loaded in ("warnings", "copyreg", "os"):
        assert sandbox_child._restricted_import(loaded, {}, {}, [], 0) is None
    with pytest.raises(ModuleNotFoundError):
        sandbox_child._restricted_import("no_such_module_anywhere", {}, {}, [], 0)
    with pytest.raises(AssertionError, match="a violation: import of 'os'"):
        sandbox_child._restricted_import("os", {}, {}, None, 0)  # the statement `import os`


def test_an_import_the_server_did_not_load_reads_no_file():
    """The child's import system has no path finder: a module the server did not load is a ModuleNotFoundError, not a
    search of the disk that the kernel would kill (library code imports on first use). Even code out of Python."""
    code = "import wave\ndef strategy(board):\n    return 'W'\n"
    r = sandbox.play(code, seed=0, size=4, _unrestricted=True, **QUICK)
    assert (r.status, r.error) == ("error", "ModuleNotFoundError: No module named 'wave'")


# --- statuses and GameResult ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, status, error",
    [
        ("def strategy(board):\n    return 1 / 0\n", "error", "ZeroDivisionError: division by zero"),
        ("def strategy(board):\n    raise ValueError('bad\\nboard')\n", "error", "ValueError: bad board"),
        ("def strategy(board)\n    return 'W'\n", "error", "SyntaxError: expected ':' (<strategy>, line 1)"),
        ("def other(board):\n    return 'W'\n", "error", "NameError: the code defines no callable named `strategy`"),
        ("strategy = 3\n", "error", "NameError: the code defines no callable named `strategy`"),
        ("import numpy\ndef strategy(board):\n    return 'W'\n", "violation", "import of 'numpy'"),
        ("def strategy(board):\n    import os\n    return 'W'\n", "violation", "import of 'os'"),
        ("def strategy(board):\n    return 'Q'\n", "invalid", "returned 'Q', not one of the keys 'WASD'"),
        ("def strategy(board):\n    return None\n", "invalid", "returned NoneType, not a str"),
        ("def strategy(board):\n    return ['W']\n", "invalid", "returned list, not a str"),
        ("def strategy(board):\n    return 'W' * 65\n", "invalid", "returned a str of 65 characters"),
        ("def strategy(board):\n    raise SystemExit(2)\n", "crash", "raised SystemExit: 2"),
        ("def strategy(board):\n    while True:\n        pass\n", "timeout", "a move took longer than 0.5 s"),
        ("while True:\n    pass\n", "timeout", "loading the code took longer than 0.5 s"),
    ],
)
def test_statuses_and_messages(code, status, error):
    r = sandbox.play(code, seed=0, size=4, **QUICK)
    assert (r.status, r.error) == (status, error)
    assert our_processes() == []


def test_game_result_fields():
    r = sandbox.play(strategies.source("greedy"), seed=0, size=4, target=64, **QUICK)
    fields = ["status", "moves", "score", "max_tile", "seconds", "error", "played_keys"]
    assert [f.name for f in dataclasses.fields(r)] == fields
    assert r.status == "success" and r.max_tile == 64 and r.moves > 0 and r.score > 0 and r.error == ""
    assert r.played_keys is None  # only on request
    assert isinstance(r.seconds, float) and 0 < r.seconds < QUICK["game_time_limit"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.status = "failed"


@pytest.mark.parametrize("keys", ["WASD", "éaui"])
def test_recorded_keys_replay_the_game(keys):
    """Keys come back as the alphabet writes them (not as returned: " w " is "W"), and replay the same game."""
    code = f"def strategy(board):\n    import random\n    return ' ' + random.choice({keys!r}).lower() + ' '\n"
    board = dict(size=4, target=256, keys=keys)
    r = sandbox.play(code, seed=3, record_keys=True, **board, **QUICK)
    assert r.status in ("success", "failed") and len(r.played_keys) >= r.moves > 0
    assert set(r.played_keys) <= set(keys)
    game = game2048.GameBoard(seed=3, max_idle_moves=game2048.MAX_IDLE_MOVES, **board)
    for key in r.played_keys:
        game.do_action(key)
    assert (game.state(), game.moves, game.score(), game.max_tile()) == (r.status, r.moves, r.score, r.max_tile)


def test_recorded_keys_stop_where_the_game_stopped():
    code = (
        "def strategy(board):\n    import random, time\n"
        "    if sum(map(sum, board)) > 64:\n        time.sleep(5)\n    return random.choice('WASD')\n"
    )
    r = sandbox.play(code, seed=1, size=4, record_keys=True, **QUICK)
    assert r.status == "timeout" and r.played_keys
    game = game2048.GameBoard(seed=1, size=4, max_idle_moves=game2048.MAX_IDLE_MOVES)
    for key in r.played_keys:
        game.do_action(key)
    assert (game.state(), game.moves, game.score()) == ("ongoing", r.moves, r.score)


def test_a_timeout_keeps_the_game_so_far():
    code = (
        "import time\ndef strategy(board):\n    time.sleep(0.05)\n    import random\n    return random.choice('WASD')\n"
    )
    r = sandbox.play(code, seed=0, size=6, move_time_limit=0.5, game_time_limit=0.6)
    assert r.status == "timeout" and r.error == "the game took longer than 0.6 s"
    assert r.moves > 0 and r.score >= 0 and r.max_tile >= 2


def test_bad_arguments_raise_in_the_caller():
    with pytest.raises(TypeError):
        sandbox.play_many([("def strategy(b):\n    return 'W'\n", 0, {"size": 4})])  # not a Game
    with pytest.raises(TypeError):
        sandbox.play_many([("def strategy(b):\n    return 'W'\n", "0", sandbox.Game())])  # not a seed
    with pytest.raises(TypeError):
        sandbox.play("x", seed=0, colour="red")
    with pytest.raises(TypeError):
        sandbox.play(b"def strategy(b): return 'W'", seed=0)
    with pytest.raises(ValueError):
        sandbox.play("x", seed=0, size=1)
    with pytest.raises(ValueError):
        sandbox.play("x", seed=0, keys="WWSD")
    with pytest.raises(ValueError):
        sandbox.play("x", seed=0, game_time_limit=0)
    with pytest.raises(ValueError):
        sandbox.play("x", seed=0, max_moves=-1)
    assert sandbox.play_many([]) == []


def test_oversized_code_is_an_error_without_a_process():
    r = sandbox.play("#" * (sandbox.MAX_CODE_BYTES + 1), seed=0)
    assert r.status == "error" and "longer than" in r.error


# --- play_many ------------------------------------------------------------------------------------------


def test_play_many_keeps_job_order():
    codes = [strategies.source(n) for n in ("random", "greedy", "corner")]
    codes += ["def strategy(board):\n    return 1 / 0\n", "def strategy(board):\n    return 'Q'\n"]
    game = sandbox.Game(size=4, target=128, **QUICK)
    jobs = [(code, seed, game) for code in codes for seed in (0, 1)]
    together = sandbox.play_many(jobs, workers=3)
    alone = [sandbox.play(code, seed=seed, size=4, target=128, **QUICK) for code, seed, _ in jobs]
    assert [summary(r) for r in together] == [summary(r) for r in alone]
    assert [r.status for r in together[-4:]] == ["error", "error", "invalid", "invalid"]
    assert our_processes() == []


def test_play_many_runs_games_at_once():
    # Sleeping strategies need no CPU, so this holds on a loaded machine; the bound is generous.
    code = "import time\ndef strategy(board):\n    time.sleep(0.4)\n    return 'Q'\n"
    jobs = [(code, i, sandbox.Game(size=4, move_time_limit=2.0, game_time_limit=3.0)) for i in range(6)]
    t = time.monotonic()
    results = sandbox.play_many(jobs, workers=6)
    elapsed = time.monotonic() - t
    assert [r.status for r in results] == ["invalid"] * 6
    assert elapsed < 0.5 * 6 * 0.4 + 0.8, elapsed  # serial would take >= 2.4 s


def test_play_many_default_workers_are_the_usable_cores(monkeypatch):
    games, in_flight = [], []
    real = sandbox._Game

    def counting(index, spec, **kwargs):
        in_flight.append(1 + sum(g.result is None for g in games))
        games.append(real(index, spec, **kwargs))
        return games[-1]

    monkeypatch.setattr(sandbox, "_Game", counting)
    code = "import time\ndef strategy(board):\n    time.sleep(0.2)\n    return 'Q'\n"
    sandbox.play_many([(code, i, sandbox.Game(size=4, **QUICK)) for i in range(8)])
    assert max(in_flight) == min(8, len(os.sched_getaffinity(0)))


# --- the server: restart, shutdown, temp dirs, strict mode ---------------------------------------------


def test_no_temp_directory_is_left():
    sandbox.play_many([("def strategy(board):\n    return 1 / 0\n", i, sandbox.Game(**QUICK)) for i in range(4)])
    assert os.listdir(sandbox._server.root) == []


def test_the_server_restarts_after_it_is_killed():
    old = sandbox._server
    os.kill(old.pid, signal.SIGKILL)
    old.proc.wait()
    r = sandbox.play("def strategy(board):\n    return 'Q'\n", seed=0, **QUICK)
    assert r.status == "invalid"
    assert sandbox._server.pid != old.pid and not os.path.exists(old.root)
    assert our_processes() == []


def test_shutdown_leaves_no_process_and_no_directory():
    sandbox.play("def strategy(board):\n    return 'Q'\n", seed=0, **QUICK)
    root = sandbox._server.root
    sandbox.shutdown()
    assert psutil.Process().children(recursive=True) == []
    assert not os.path.exists(root)
    sandbox.shutdown()  # twice is fine
    sandbox.start()
    assert sandbox._server.seccomp


def test_shutdown_during_nothing_and_lazy_start():
    sandbox.shutdown()
    assert sandbox._server is None
    assert sandbox.play("def strategy(board):\n    return 'Q'\n", seed=0, **QUICK).status == "invalid"
    assert sandbox._server is not None


def test_strict_mode_refuses_to_run_without_seccomp():
    sandbox.shutdown()
    try:
        sandbox.start(_disable_seccomp=True)
        assert not sandbox._server.seccomp
        with pytest.raises(sandbox.SandboxError, match="seccomp"):
            sandbox.play("def strategy(board):\n    return 'Q'\n", seed=0, strict=True, **QUICK)
        sandbox._warned_no_seccomp = False
        with pytest.warns(RuntimeWarning, match="seccomp is unavailable"):
            r = sandbox.play("def strategy(board):\n    return 'Q'\n", seed=0, **QUICK)
        assert r.status == "invalid"
    finally:
        sandbox.shutdown()
        sandbox.start()
    assert sandbox._server.seccomp
    assert sandbox.play("def strategy(board):\n    return 'Q'\n", seed=0, strict=True, **QUICK).status == "invalid"


BWRAP = (
    "bwrap --unshare-net --unshare-ipc --unshare-uts --unshare-user-try "
    "--die-with-parent --ro-bind / / --dev /dev --bind /tmp /tmp --"
)  # the recipe in docs/SECURITY.md


def wrapper_works(wrap: str) -> bool:
    if not shutil.which(wrap.split()[0]):
        return False
    return subprocess.run([*wrap.split(), "true"], capture_output=True).returncode == 0


@pytest.mark.parametrize("wrap", [BWRAP, "unshare --net --"], ids=["bwrap", "unshare"])
def test_an_outer_wrapper_jails_the_server(monkeypatch, wrap):
    if not wrapper_works(wrap):
        pytest.skip(f"{wrap.split()[0]} cannot make namespaces here")
    sandbox.shutdown()
    monkeypatch.setenv("TRAIN2048_SANDBOX_WRAP", wrap)
    try:
        sandbox.start()
        server = psutil.Process(sandbox._server.pid)
        jailed = ([server] + server.children(recursive=True))[-1].pid  # the python under the wrapper
        assert os.readlink(f"/proc/{jailed}/ns/net") != os.readlink("/proc/self/ns/net")
        assert sandbox.play(strategies.source("greedy"), seed=0, size=4, target=64, **QUICK).status == "success"
    finally:
        sandbox.shutdown()
        monkeypatch.delenv("TRAIN2048_SANDBOX_WRAP")
        sandbox.start()
    assert our_processes() == []


def test_spares_are_idle_and_bounded():
    # The server keeps referees forked ahead (each with its child set up), so a game starts at once.
    code = "def strategy(board):\n    return 'Q'\n"
    sandbox.play_many([(code, i, sandbox.Game(**QUICK)) for i in range(4)], workers=3)
    server, spares = sandbox._idle_pids()
    assert 1 <= len(spares) <= 3
    for pid in spares:
        spare = psutil.Process(pid)
        assert spare.ppid() == server and len(spare.children()) <= 1
    assert our_processes() == []
    assert os.listdir(sandbox._server.root) == []  # spares make their temp dir only once a job comes


def test_a_trainer_with_many_open_files(tmp_path):
    # select() cannot watch fds above 1023; a trainer (data loaders, logs) may well have that many.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1300:
        pytest.skip("cannot open 1200 files here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1300), hard))
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1200)]
    try:
        results = sandbox.play_many(
            [("def strategy(board):\n    return 'Q'\n", i, sandbox.Game(**QUICK)) for i in range(3)]
        )
        assert [r.status for r in results] == ["invalid"] * 3
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
