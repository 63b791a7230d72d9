"""Hostile strategies against the sandbox: every attack class of GUIDE.md section 3, each contained.

Most attacks die at the Python layer (import/builtins allowlist, attribute checks). So that each OS
layer is proven on its own, many run again with `_unrestricted=True` (full builtins, any import):
then only seccomp, rlimits, the process jail and the group kill stand between the code and us. A few
run on a server started without seccomp, to prove the process-tree clean-up on its own.

Every test checks: the status (never success by cheating), the time (limit + 1 s), that we are
alive, that no file appeared or changed outside the sandbox, that no connection reached our
listener, and that no process is left (our children, and any process carrying an attack marker).
"""

import os
import platform
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import game2048
import sandbox

MARK = "train2048-attack-marker"
SECRET = "s3cr3t-train2048-fake-token"
SEED = 918273645  # distinctive, so a search of the child's objects cannot find it by accident
LIMITS = dict(move_time_limit=0.5, game_time_limit=1.0)


def strategy(body: str, prelude: str = "") -> str:
    """Source of `def strategy(board)` with `body` inside (dedented, re-indented)."""
    return textwrap.dedent(prelude) + "def strategy(board):\n" + textwrap.indent(textwrap.dedent(body), "    ")


# --- the watchers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def server():
    sandbox.start()
    yield
    sandbox.shutdown()


class Listener:
    """A localhost TCP server (127.0.0.1 only) counting accepted connections, stopped after the test."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self):
        self.stop = True
        self.thread.join(2)
        self.sock.close()


@pytest.fixture
def world(tmp_path, monkeypatch):
    """What an attack may try to reach: a home, a checkpoint, a secret in the environment, a listener."""
    home = tmp_path / "home"
    checkpoint = tmp_path / "outputs" / "checkpoint-100"
    checkpoint.mkdir(parents=True)
    home.mkdir()
    (home / ".netrc").write_text(f"machine example.com password {SECRET}\n")
    (checkpoint / "adapter_model.safetensors").write_bytes(b"weights")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TRAIN2048_FAKE_SECRET", SECRET)
    listener = Listener()
    before = snapshot(tmp_path)
    w = type("World", (), dict(tmp=tmp_path, home=home, checkpoint=checkpoint, port=listener.port))
    yield w
    listener.close()
    assert listener.accepted == 0, "a strategy reached our localhost listener"
    assert snapshot(tmp_path) == before, "a file appeared, changed or vanished outside the sandbox"
    assert not os.path.exists(f"/tmp/{MARK}"), "a strategy wrote to /tmp"
    assert leftovers() == []


def snapshot(root):
    return {str(p): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def leftovers() -> list:
    """Processes an attack left: our descendants but the server and its idle spares, and any process
    carrying a marker (the attack's own, or the server's temp root, which every fork of it carries)."""
    server = sandbox._server
    server_pid, spares = sandbox._idle_pids()
    found = {p.pid: p for p in psutil.Process().children(recursive=True) if not idle(p, server_pid, spares)}
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or ())
        except psutil.Error:
            continue
        marked = MARK in cmd or (server and server.root in cmd)
        if marked and p.pid != os.getpid() and not idle(p, server_pid, spares):
            found[p.pid] = p
    out = []
    for p in found.values():
        try:
            out.append((p.pid, p.status(), p.cmdline()[:4]))
        except psutil.Error:
            pass  # gone while we looked
    return out


def idle(process, server, spares) -> bool:
    """The server, a spare referee, or a spare's own child."""
    try:
        return process.pid == server or process.pid in spares or process.ppid() in spares
    except psutil.NoSuchProcess:
        return True  # gone while we looked


def attack(code: str, expect, *, unrestricted=False, **kwargs) -> sandbox.GameResult:
    """Play the attack and check what every attack must satisfy."""
    args = dict(LIMITS, seed=SEED, size=4, **kwargs)
    t = time.monotonic()
    result = sandbox.play(code, _unrestricted=unrestricted, **args)
    elapsed = time.monotonic() - t
    expect = (expect,) if isinstance(expect, str) else expect
    assert result.status in expect, result
    assert result.status != "success", result
    assert elapsed <= args["game_time_limit"] + 1.0, (elapsed, result)
    assert SECRET not in result.error
    assert psutil.pid_exists(os.getpid())
    return result


# --- loops the notebook's SIGALRM could not stop -----------------------------------------------------


def test_loop_that_catches_base_exception(world):
    code = strategy("""
        while True:
            try:
                while True:
                    pass
            except BaseException:
                pass
    """)
    r = attack(code, "timeout")
    assert "0.5 s" in r.error


def test_loop_in_finally(world):
    attack(strategy("try:\n    return 'W'\nfinally:\n    while True:\n        pass\n"), "timeout")


def test_the_game_limit_stops_a_strategy_that_is_slow_on_every_move(world):
    r = attack(strategy("import time\ntime.sleep(0.3)\nreturn 'W'"), "timeout")
    assert r.error == "the game took longer than 1 s" and r.max_tile >= 2


def test_long_c_call_sum(world):
    attack(strategy("return str(sum(range(10**12)))"), "timeout")


def test_long_c_call_big_power(world):
    attack(strategy("return str(10**10**8)[:1]"), ("timeout", "error"))


@pytest.mark.parametrize(
    "module", ["os", "sys", "subprocess", "importlib", "ctypes", "gc", "inspect", "builtins", "pickle", "io", "types"]
)
def test_escape_modules_fail_at_load(world, module):
    r = attack(f"import {module}\n" + strategy("return 'W'"), "error")
    assert r.error == f"ImportError: import of {module!r} is not allowed in the sandbox"
    r = attack(f"from {module} import *\n" + strategy("return 'W'"), "error")
    assert r.error == f"ImportError: import from {module} is not allowed in the sandbox"


def test_signal_module_is_not_importable(world):
    r = attack(strategy("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True: pass"), "error")
    assert "import of 'signal' is not allowed" in r.error


def test_signal_tampering_does_not_stop_the_kill(world):
    code = strategy("""
        import signal, time
        for s in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGXCPU, signal.SIGVTALRM):
            signal.signal(s, signal.SIG_IGN)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP})
        while True:
            try:
                time.sleep(100)
            except BaseException:
                pass
    """)
    attack(code, "timeout", unrestricted=True)


def test_long_c_call_with_timers_disabled(world):
    code = strategy("import signal\nsignal.setitimer(signal.ITIMER_REAL, 0)\nreturn str(sum(range(10**12)))")
    attack(code, "timeout", unrestricted=True)


# --- memory, processes, threads ----------------------------------------------------------------------


def test_memory_bomb_hits_the_address_space_limit(world):
    r = attack(strategy("x = [0] * 10**10\nreturn 'W'"), "error")
    assert r.error.startswith("MemoryError")


def test_memory_limit_alone(world):
    code = strategy("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))")
    r = attack(code, "error", unrestricted=True, memory_limit_mb=128)
    assert r.error.startswith("MemoryError")


def test_fork_bomb_is_refused_by_seccomp(world):
    code = strategy("import os\nwhile True:\n    os.fork()")
    r = attack(code, "error", unrestricted=True)
    assert r.error.startswith("PermissionError")


def test_fork_and_clone_through_libc_are_refused(world):
    code = strategy("""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.fork() != -1 or libc.vfork() != -1:
            return "W"
        raise OSError(ctypes.get_errno(), "fork refused")
    """)
    r = attack(code, "error", unrestricted=True)
    assert "Errno 1" in r.error


def test_subprocess_and_shell_are_refused(world):
    code = strategy(f"import subprocess\nsubprocess.Popen(['sh', '-c', 'sleep 30 # {MARK}'])\nreturn 'W'")
    attack(code, "error", unrestricted=True)


def test_posix_spawn_is_refused(world):
    code = strategy(f"import os\nos.posix_spawn('/bin/sleep', ['sleep', '30', '{MARK}'], {{}})\nreturn 'W'")
    attack(code, "error", unrestricted=True)


def test_execv_is_refused(world):
    r = attack(strategy(f"import os\nos.execv('/bin/sleep', ['sleep', '30', '{MARK}'])"), "error", unrestricted=True)
    assert r.error.startswith("PermissionError")


def test_thread_bomb(world):
    code = strategy("""
        import threading, time
        while True:
            threading.Thread(target=time.sleep, args=(100,), daemon=True).start()
    """)
    attack(code, ("error", "timeout"), unrestricted=True)


def test_daemon_thread_that_would_outlive_the_game(world):
    # The thread tries to write a file once the game is over; the whole process is killed first.
    late = world.tmp / "late-write"
    code = strategy(
        f"""
        import threading, time
        def later():
            time.sleep(0.3)
            open({str(late)!r}, "w").write("escaped")
        threading.Thread(target=later, daemon=True).start()
        return "X"
        """
    )
    attack(code, "invalid", unrestricted=True)
    time.sleep(0.5)
    assert not late.exists()


def test_kill_the_referee_is_refused(world):
    r = attack(strategy("import os\nos.kill(os.getppid(), 9)\nreturn 'W'"), "error", unrestricted=True)
    assert r.error.startswith("PermissionError")


def test_kill_up_the_tree_and_a_bystander_is_refused(world):
    canary = subprocess.Popen(["sleep", "30"])
    try:
        code = strategy(f"""
            import os, signal
            refused = 0
            for pid in ({canary.pid}, {os.getpid()}, 0):
                try:
                    os.kill(pid, signal.SIGKILL)
                except PermissionError:
                    refused += 1
            raise PermissionError(f"refused {{refused}}")
        """)
        r = attack(code, "error", unrestricted=True)
        assert r.error == "PermissionError: refused 3"
        assert canary.poll() is None
    finally:
        canary.kill()
        canary.wait()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x32 ABI exists on x86_64 only")
def test_another_syscall_abi_kills_the_process(world):
    # socket() through the x32 ABI (number | 0x40000000) would slip past a filter written for x86_64.
    code = strategy("import ctypes\nctypes.CDLL(None).syscall(0x40000000 | 41, 2, 1, 0)\nreturn 'W'")
    r = attack(code, "crash", unrestricted=True)
    assert "SIGSYS" in r.error


def test_ctypes_segfault_is_a_crash(world):
    r = attack(strategy("import ctypes\nctypes.string_at(0)"), "crash", unrestricted=True)
    assert "SIGSEGV" in r.error


def test_c_recursion_segfault_is_a_crash(world):
    code = strategy("""
        import sys
        sys.setrecursionlimit(10**8)
        a, b = [], []
        for _ in range(4 * 10**5):
            a, b = [a], [b]
        return str(a == b)  # list comparison recurses in C: the C stack overflows
    """)
    r = attack(code, "crash", unrestricted=True, move_time_limit=3.0, game_time_limit=3.0)
    assert "SIGSEGV" in r.error


def test_python_recursion_is_an_error(world):
    r = attack(strategy("def f(n):\n    return f(n + 1)\nreturn f(0)"), "error")
    assert r.error.startswith("RecursionError")


# --- exits ---------------------------------------------------------------------------------------------


def test_exit_builtin_is_absent(world):
    r = attack(strategy("exit(0)"), "error")
    assert r.error.startswith("NameError")


def test_raise_system_exit_is_a_crash(world):
    r = attack(strategy("raise SystemExit(3)"), "crash")
    assert "SystemExit: 3" in r.error


def test_sys_exit_is_a_crash(world):
    r = attack(strategy("import sys\nsys.exit(4)"), "crash", unrestricted=True)
    assert "SystemExit: 4" in r.error


def test_os_exit_is_a_crash(world):
    r = attack(strategy("import os\nos._exit(5)"), "crash", unrestricted=True)
    assert r.error == "exited with status 5"


def test_keyboard_interrupt_at_load_is_a_crash(world):
    attack("raise KeyboardInterrupt\ndef strategy(board):\n    return 'W'\n", "crash")


# --- files, secrets, network -------------------------------------------------------------------------


def test_open_is_not_a_builtin(world):
    r = attack(strategy(f"open({str(world.home / 'x')!r}, 'w')\nreturn 'W'"), "error")
    assert r.error.startswith("NameError")


def test_file_writes_are_refused(world):
    targets = [world.home / "pwned", world.checkpoint / "adapter_model.safetensors", f"/tmp/{MARK}", "pwned-cwd"]
    code = strategy(f"""
        import os
        refused = 0
        for path in {[str(t) for t in targets]!r}:
            for flags in (os.O_WRONLY | os.O_CREAT, os.O_RDWR, os.O_WRONLY | os.O_TRUNC):
                try:
                    os.close(os.open(path, flags, 0o644))
                except PermissionError:
                    refused += 1
        raise PermissionError(f"refused {{refused}}")
    """)
    r = attack(code, "error", unrestricted=True)
    assert r.error == f"PermissionError: refused {3 * len(targets)}"


def test_file_deletes_and_renames_are_refused(world):
    weights = world.checkpoint / "adapter_model.safetensors"
    code = strategy(f"""
        import os, shutil
        refused = 0
        for action in (lambda: os.unlink({str(weights)!r}), lambda: os.rename({str(weights)!r}, {str(weights)!r} + ".x"),
                       lambda: os.mkdir({str(world.home / "d")!r}), lambda: os.chmod({str(weights)!r}, 0),
                       lambda: os.truncate({str(weights)!r}, 0), lambda: os.symlink("/", {str(world.home / "l")!r})):
            try:
                action()
            except PermissionError:
                refused += 1
        raise PermissionError(f"refused {{refused}}")
    """)
    r = attack(code, "error", unrestricted=True)
    assert r.error == "PermissionError: refused 6"


def test_file_reads_are_refused(world):
    paths = [
        world.home / ".netrc",
        world.checkpoint / "adapter_model.safetensors",
        f"/proc/{os.getpid()}/environ",
        "/etc/passwd",
    ]
    code = strategy(f"""
        refused, leaked = 0, []
        for path in {[str(p) for p in paths]!r}:
            try:
                with open(path, "rb") as f:
                    leaked.append(f.read())
            except PermissionError:
                refused += 1
        raise ValueError(f"refused {{refused}} {{leaked!r}}")
    """)
    r = attack(code, "error", unrestricted=True)
    assert r.error == f"ValueError: refused {len(paths)} []"


def test_environment_is_empty(world):
    code = strategy("import os\nraise ValueError(repr(dict(os.environ)) + ' ' + os.getcwd())")
    r = attack(code, "error", unrestricted=True)
    assert r.error.startswith(f"ValueError: {{}} {sandbox._server.root}/")


def test_socket_import_is_refused(world):
    attack(strategy(f"import socket\nsocket.create_connection(('127.0.0.1', {world.port}))\nreturn 'W'"), "error")


def test_sockets_are_refused(world):
    code = strategy(f"""
        import socket
        socket.create_connection(("127.0.0.1", {world.port}), timeout=0.2)
        return "W"
    """)
    r = attack(code, "error", unrestricted=True)
    assert r.error.startswith("PermissionError")


def test_raw_socket_syscall_is_refused(world):
    code = strategy("""
        import ctypes, socket
        libc = ctypes.CDLL(None, use_errno=True)
        fds = (ctypes.c_int * 2)()
        if libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0) >= 0 or libc.socketpair(1, 1, 0, fds) >= 0:
            return "W"
        raise OSError(ctypes.get_errno(), "socket refused")
    """)
    r = attack(code, "error", unrestricted=True)
    assert "Errno 1" in r.error


def test_huge_stdout_goes_nowhere(world, capfd):
    code = strategy("while True:\n    print('x' * 10**6)")
    attack(code, "timeout")
    out, err = capfd.readouterr()
    assert len(out) + len(err) < 10_000


def test_fd_exhaustion(world):
    code = strategy("import os\nwhile True:\n    os.pipe()")
    r = attack(code, "error", unrestricted=True)
    assert "Too many open files" in r.error


# --- hostile return values and forged replies ----------------------------------------------------------


def test_str_subclass_with_lying_methods(world):
    code = strategy(
        "return Liar('X')",
        prelude="""
        class Liar(str):
            def __eq__(self, other):
                return True
            def __hash__(self):
                return hash('w')
            def strip(self, *a):
                return 'w'
            def casefold(self):
                return 'w'
            def lower(self):
                return 'w'
            def __str__(self):
                return 'w'
        """,
    )
    r = attack(code, "invalid")
    assert "'X'" in r.error


def test_object_with_reduce_is_never_unpickled(world):
    marker = world.tmp / "unpickled"
    code = strategy(
        "return Boom()",
        prelude=f"""
        import os
        class Boom:
            def __reduce__(self):
                return (os.system, ("touch {marker}",))
        """,
    )
    r = attack(code, "invalid", unrestricted=True)
    assert "Boom" in r.error and not marker.exists()


def test_oversized_return(world):
    r = attack(strategy("return 'W' * 10**6"), "invalid")
    assert "1000000 characters" in r.error


def test_forged_replies_on_the_pipe(world):
    code = strategy("""
        import os, struct
        os.write(4, struct.pack("!H", 60000) + b"K" * 5000)
        while True:
            pass
    """)
    r = attack(code, "invalid", unrestricted=True)
    assert "over the 1024-byte cap" in r.error


def test_closing_the_pipe_is_a_crash(world):
    code = strategy("import os, time\nos.close(4)\nos.close(3)\ntime.sleep(100)")
    attack(code, "crash", unrestricted=True)


# --- reaching the engine: builtins, modules, frames, gc, subclasses ------------------------------------


def test_dunder_escapes_are_refused_before_running(world):
    escapes = [
        "().__class__.__base__.__subclasses__()",
        "print.__self__.__import__('os')",
        "__import__('os')",
        "__builtins__['open']",
        "(lambda: 0).__globals__",
        "getattr((), '__cla' + 'ss__')",
        "[x for x in ()].__class__.__mro__",
    ]
    for escape in escapes:
        r = attack(strategy(f"return {escape}"), "error")
        assert r.error.startswith("SandboxViolation"), (escape, r)


def test_frame_walk_through_a_generator_is_refused(world):
    code = strategy("def g():\n    yield gen.gi_frame.f_back\ngen = g()\nreturn next(gen)")
    r = attack(code, "error")
    assert r.error.startswith("SandboxViolation")


def test_module_internals_are_hidden(world):
    r = attack(strategy("import random\nreturn random._os.system('true')"), "error")
    assert r.error.startswith("AttributeError")
    r = attack(strategy("import typing\nreturn typing.get_type_hints"), "error")
    assert r.error.startswith("AttributeError")


def test_eval_gateways_in_allowed_modules_are_closed(world):
    gateways = {
        # attribute fetchers that take a computed name
        "import operator\nreturn operator.attrgetter('_' * 2 + 'class' + '_' * 2)(())": "SandboxViolation",
        "import operator\nreturn operator.methodcaller('_' * 2 + 'reduce' + '_' * 2)(())": "SandboxViolation",
        "import string\nreturn string.Formatter().get_field('0.x', [1], {})": "AttributeError",
        # string annotations evaluated by typing / singledispatch
        "import functools\nreturn functools.singledispatch": "AttributeError",
        "import typing\nreturn typing.ForwardRef('1')": "AttributeError",
        # dataclass writes its methods as source text from the field names
        "import dataclasses\nd = '_' * 2 + 'annotations' + '_' * 2\n"
        "X = type('X', (), {d: {\"x=print('pwned')#\": int}})\nreturn dataclasses.dataclass(X)": "SandboxViolation",
    }
    for body, error in gateways.items():
        r = attack(strategy(body), "error")
        assert r.error.startswith(error), (body, r)


def test_builtins_and_sys_modules_tampering_stays_in_the_child(world):
    code = strategy(
        """
        builtins.len = lambda x: 0
        sys.modules["game2048"].GameBoard.state = lambda self: "success"
        sys.modules["game2048"].GameBoard.max_tile = lambda self: 2048
        return "W"
        """,
        prelude="import builtins, sys\n",
    )
    r = attack(code, ("failed", "invalid"), unrestricted=True)  # a broken len() breaks the child's own replies
    assert r.max_tile < 2048


def test_frame_and_gc_walks_find_no_game_and_no_seed(world):
    # The child holds strategy_seed(seed) (it seeds its own `random` with it): the search must find that
    # one, which proves it looks in the right places, and must find neither the seed nor a GameBoard.
    seed_text, own_text = str(SEED), str(game2048.strategy_seed(SEED))
    code = strategy(
        f"""
        import gc, sys
        seed = int({seed_text[:4]!r} + {seed_text[4:]!r})
        own = int({own_text[:4]!r} + {own_text[4:]!r})
        seen = []
        frame = sys._getframe().f_back
        while frame is not None:
            seen += list(frame.f_locals.values()) + list(frame.f_globals.values())
            frame = frame.f_back
        for obj in gc.get_objects():
            seen.append(obj)
            if type(obj) is dict:
                seen += list(obj.keys()) + list(obj.values())
            elif type(obj) in (list, tuple, set, frozenset):
                seen += list(obj)
        found = set()
        for obj in seen:
            if type(obj) is int and obj == seed:
                found.add("seed")
            elif type(obj) is int and obj == own:
                found.add("strategy_seed")
            elif type(obj).__name__ == "GameBoard":
                found.add("game")
        raise RuntimeError("found " + " ".join(sorted(found)))
        """
    )
    r = attack(code, "error", unrestricted=True, move_time_limit=5.0, game_time_limit=5.0)
    assert r.error == "RuntimeError: found strategy_seed"


def test_board_mutation_does_not_reach_the_game(world):
    code = strategy("board[0][0] = 2048\nboard[1] = [1024] * len(board)\nreturn 'W'")
    r = attack(code, "failed")
    assert r.max_tile < 2048


def test_random_seed_rigging_does_not_touch_the_spawns(world):
    body = "import random\nrandom.seed(0)\nreturn random.choice('WASD')"
    ns = {}
    exec(strategy(body), ns)
    honest = game2048.play_game(ns["strategy"], seed=SEED, size=4)
    r = attack(strategy(body), "failed", **{**LIMITS, "game_time_limit": 5.0})
    assert (r.moves, r.score, r.max_tile) == (honest.moves, honest.score(), honest.max_tile())


# --- without seccomp: the process-tree clean-up alone ----------------------------------------------------


@pytest.fixture
def no_seccomp():
    sandbox.shutdown()
    with pytest.warns(RuntimeWarning, match="seccomp is unavailable"):
        sandbox._warned_no_seccomp = False
        sandbox.start(_disable_seccomp=True)
        sandbox.play("def strategy(board):\n    return 'X'\n", seed=0)
    yield
    sandbox.shutdown()
    sandbox.start()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_orphaned_setsid_grandchildren_are_killed(world, no_seccomp):
    code = strategy(f"""
        import os, time
        for _ in range(5):
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    os.execv("/bin/sleep", ["sleep", "30", "{MARK}"])
                if os.fork() == 0:
                    time.sleep(30)
                os._exit(0)
        time.sleep(0.2)
        return "X"
    """)
    attack(code, "invalid", unrestricted=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_file_size_limit_alone(world, no_seccomp):
    # Without seccomp a file can be opened (in the sandbox's own temp dir, removed afterwards), but
    # RLIMIT_FSIZE 0 lets not one byte into it.
    code = strategy("f = open('big', 'wb', buffering=0)\nf.write(b'x' * 4096)\nreturn 'W'")
    r = attack(code, "error", unrestricted=True)
    assert "File too large" in r.error


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_bounded_fork_storm_is_killed_on_time(world, no_seccomp):
    code = strategy("""
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for _ in range(10):
            if os.fork() == 0:
                os.setsid()
                while True:
                    pass
        while True:
            pass
    """)
    attack(code, "timeout", unrestricted=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_killing_the_referee_is_a_crash_and_leaves_nothing(world, no_seccomp):
    code = strategy(f"""
        import os, time
        if os.fork() == 0:
            os.setsid()
            os.execv("/bin/sleep", ["sleep", "30", "{MARK}"])
        time.sleep(0.1)
        os.kill(os.getppid(), 9)
        time.sleep(30)
    """)
    r = attack(code, "crash", unrestricted=True)
    assert r.error == "sandbox referee died"
    assert sandbox.play("def strategy(board):\n    return 'X'\n", seed=1).status == "invalid"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_killing_the_server_restarts_it_and_leaves_nothing(world, no_seccomp):
    old = sandbox._server.pid
    code = strategy("""
        import os, time
        with open(f"/proc/{os.getppid()}/stat") as f:
            server = int(f.read().rsplit(")", 1)[1].split()[1])
        if os.fork() == 0:
            os.setsid()  # orphaned past every subreaper once the server dies: the marker sweep finds it
            time.sleep(30)
        time.sleep(0.1)
        os.kill(server, 9)
        time.sleep(30)
    """)
    attack(code, "crash", unrestricted=True)
    assert sandbox.play("def strategy(board):\n    return 'X'\n", seed=1).status == "invalid"
    assert sandbox._server.pid != old


def test_the_test_switch_is_refused_outside_tests(monkeypatch):
    monkeypatch.delitem(sys.modules, "pytest")
    with pytest.raises(sandbox.SandboxError):
        sandbox.play("def strategy(board):\n    return 'W'\n", seed=0, _unrestricted=True)


def test_sigkill_reaches_a_child_that_blocks_every_signal(world):
    # The group kill sends SIGKILL and nothing else: it cannot be blocked, caught or ignored.
    code = strategy("""
        import signal, time
        signal.pthread_sigmask(signal.SIG_BLOCK, range(1, signal.NSIG))
        time.sleep(100)
    """)
    attack(code, "timeout", unrestricted=True)
