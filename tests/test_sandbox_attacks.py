"""Hostile strategies against the sandbox: every attack class of GUIDE.md section 3, each contained.

Most attacks die at the Python layer (import/builtins allowlist, attribute checks). So that each OS
layer is proven on its own, many run again with `_unrestricted=True` (full builtins, any import):
then only seccomp, rlimits, the process jail and the group kill stand between the code and us. A few
run on a server started without seccomp, to prove the process-tree clean-up on its own.

Every test checks: the status (never success by cheating), the time (limit + 1 s), that we are
alive, that no file appeared or changed outside the sandbox, that no connection reached our
listener, and that no process is left (our children, and any process carrying an attack marker).
"""

import ctypes
import os
import platform
import signal
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
import strategies

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
    before, trainer, ipc = snapshot(tmp_path), trainer_state(), ipc_objects()
    received = []  # SIGURG is harmless (ignored by default): attacks aim it at us, and we count what arrives
    previous = signal.signal(signal.SIGURG, lambda signum, frame: received.append(signum))
    w = type("World", (), dict(tmp=tmp_path, home=home, checkpoint=checkpoint, port=listener.port))
    try:
        yield w
    finally:
        time.sleep(0.05)  # a signal sent just before the game ended is delivered by now
        signal.signal(signal.SIGURG, previous)
        listener.close()
    assert received == [], "a strategy signalled the trainer"
    assert listener.accepted == 0, "a strategy reached our localhost listener"
    assert snapshot(tmp_path) == before, "a file appeared, changed or vanished outside the sandbox"
    assert not os.path.exists(f"/tmp/{MARK}"), "a strategy wrote to /tmp"
    assert trainer_state() == trainer, "a strategy changed the trainer's scheduling, priority or group"
    assert ipc_objects() == ipc, "an IPC object outlived the game"
    assert leftovers() == []


def snapshot(root):
    return {str(p): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


LIBC = ctypes.CDLL(None, use_errno=True)
SYSCALLS = {  # the calls the attacks below make through libc's syscall(), by architecture
    "x86_64": dict(
        ioprio_set=251,
        ioprio_get=252,
        mq_open=240,
        pidfd_open=434,
        pidfd_send_signal=424,
        futex=202,
        clock_nanosleep=230,
    ),
    "aarch64": dict(
        ioprio_set=30, ioprio_get=31, mq_open=180, pidfd_open=434, pidfd_send_signal=424, futex=98, clock_nanosleep=115
    ),
}.get(platform.machine(), {})


def trainer_state():
    """What an attack on the trainer's scheduling would change: policy, CPUs, nice, I/O priority, group, session."""
    ioprio = LIBC.syscall(SYSCALLS["ioprio_get"], 1, os.getpid()) if SYSCALLS else None  # 1: IOPRIO_WHO_PROCESS
    return (
        os.sched_getscheduler(0), os.sched_getaffinity(0), os.getpriority(os.PRIO_PROCESS, 0), ioprio,
        os.getpgid(0), os.getsid(0),
    )  # fmt: skip


def ipc_objects():
    """SysV shared memory segments, message queues and semaphores, and POSIX message queues, on this machine."""
    found = []
    for kind in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                found += [(kind, line.split()[1]) for line in f.read().splitlines()[1:] if line.strip()]
        except OSError:
            pass
    try:
        found += [("mqueue", name) for name in os.listdir("/dev/mqueue")]
    except OSError:
        pass
    return sorted(found)


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
    "module", ["os", "subprocess", "importlib", "ctypes", "gc", "inspect", "builtins", "pickle", "io", "types"]
)
def test_escape_modules_are_violations_at_load(world, module):
    r = attack(f"import {module}\n" + strategy("return 'W'"), "violation")
    assert r.error == f"import of {module!r}"
    r = attack(f"from {module} import *\n" + strategy("return 'W'"), "violation")
    assert r.error == f"import from {module}"


def test_sys_is_its_constants_alone(world):
    r = attack(strategy("import sys\nreturn sys.modules['os']"), "error")
    assert r.error == "AttributeError: module 'sys' has no attribute 'modules'"
    r = attack(strategy("import sys\nreturn 'W' if sys.maxsize > 0 else 'A'"), ("failed",))


def test_signal_module_is_not_importable(world):
    r = attack(strategy("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True: pass"), "violation")
    assert r.error == "import of 'signal'"


def test_signal_tampering_does_not_stop_the_kill(world):
    # Installing handlers and timers is refused (seccomp); blocking signals is not, and changes nothing either.
    code = strategy("""
        import signal, time
        for tamper in [lambda: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGXCPU)] + [
            lambda: signal.setitimer(signal.ITIMER_REAL, 0),
            lambda: signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP}),
        ]:
            try:
                tamper()
            except OSError:
                pass
        while True:
            try:
                time.sleep(100)
            except BaseException:
                pass
    """)
    attack(code, "timeout", unrestricted=True)


def test_long_c_call_with_timers_disabled(world):
    code = strategy("""
        import signal
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        except OSError:
            pass
        return str(sum(range(10**12)))
    """)
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


def test_threads_are_refused(world):
    # clone() is not on the allowlist: no thread bomb, and no thread that could outlive the game.
    code = strategy("""
        import threading, time
        while True:
            threading.Thread(target=time.sleep, args=(100,), daemon=True).start()
    """)
    r = attack(code, "error", unrestricted=True)
    assert "can't start new thread" in r.error


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_daemon_thread_that_would_outlive_the_game(world, os_layers_off):
    # Without seccomp a thread starts; it tries to write a file once the game is over. The whole process
    # (its threads included) is killed first.
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
    # Python 3.11 overflows the C stack (SIGSEGV); 3.12 counts C recursion and raises RecursionError: either way the
    # child ends and nothing else is touched.
    r = attack(code, ("crash", "error"), unrestricted=True, move_time_limit=3.0, game_time_limit=3.0)
    assert "SIGSEGV" in r.error if r.status == "crash" else r.error.startswith("RecursionError")


def test_python_recursion_is_an_error(world):
    r = attack(strategy("def f(n):\n    return f(n + 1)\nreturn f(0)"), "error")
    assert r.error.startswith("RecursionError")


# --- exits ---------------------------------------------------------------------------------------------


def test_exit_builtin_is_absent(world):
    r = attack(strategy("exit(0)"), "violation")
    assert r.error == "builtin 'exit'"


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
    r = attack(strategy(f"open({str(world.home / 'x')!r}, 'w')\nreturn 'W'"), "violation")
    assert r.error == "builtin 'open'"
    r = attack(strategy(f"o = dir.__self__.open\no({str(world.home / 'x')!r}, 'w')\nreturn 'W'"), "violation")
    assert r.error == "attribute '__self__'"


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


def test_environment_is_empty_and_the_directory_unknown(world):
    code = strategy("""
        import os
        try:
            where = os.getcwd()
        except PermissionError:
            where = "refused"
        raise ValueError(repr(dict(os.environ)) + " " + where)
    """)
    r = attack(code, "error", unrestricted=True)
    assert r.error == "ValueError: {} refused"


def test_socket_import_is_refused(world):
    attack(strategy(f"import socket\nsocket.create_connection(('127.0.0.1', {world.port}))\nreturn 'W'"), "violation")


def test_sockets_are_refused(world):
    code = strategy(f"""
        import socket
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.connect(("127.0.0.1", {world.port}))
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


def test_new_descriptors_are_refused(world):
    code = strategy("import os\nwhile True:\n    os.pipe()")
    r = attack(code, "error", unrestricted=True)
    assert r.error.startswith("PermissionError")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fd_limit_alone(world, os_layers_off):
    code = strategy("import os\nwhile True:\n    os.pipe()")
    r = attack(code, "error", unrestricted=True)
    assert "Too many open files" in r.error


# --- code that is already out of Python: only the OS walls stand (issue: the Python layer is not a wall) ------


@pytest.fixture(params=["all layers", "seccomp alone"])
def walls(request):
    """The default server, then one whose children keep our user (root here, where tests run as root): each
    attack below must fail in both, so seccomp holds on its own."""
    if request.param == "seccomp alone":
        sandbox.shutdown()
        sandbox.start(_keep_root=True)
    yield request.param
    if request.param == "seccomp alone":
        sandbox.shutdown()
        sandbox.start()


# What escaped code uses below to make raw system calls: libc through ctypes, errno raised as OSError.
RAW_CALLS = """import ctypes, os
LIBC = ctypes.CDLL(None, use_errno=True)
def raise_errno():
    raise OSError(ctypes.get_errno(), "")
def raise_eperm():
    raise PermissionError
"""


def refused_count(attempts: str) -> str:
    """Code that runs each attempt of a list of lambdas and raises with how many were refused with EPERM."""
    return f"""
        import os
        refused, done = 0, []
        for i, attempt in enumerate({attempts}):
            try:
                attempt()
                done.append(i)
            except PermissionError:
                refused += 1
            except OSError as e:
                done.append((i, e.errno))
        raise PermissionError(f"refused {{refused}}, not refused {{done}}")
    """


def test_signals_reach_no_one(world, walls):
    # Every way to send a signal, aimed at the referee, the trainer, its group and session, the server, a
    # bystander and everyone. SIGURG is harmless; the world fixture counts any that reaches the trainer.
    canary = subprocess.Popen(["sleep", "30"], start_new_session=True)
    server = sandbox._server.pid
    me, group = os.getpid(), os.getpgid(0)
    try:
        calls = SYSCALLS
        code = strategy(
            refused_count(f"""[lambda pid=pid: os.kill(pid, signal.SIGURG)
                  for pid in (os.getppid(), {me}, {server}, {canary.pid}, 0, -{group}, -{server})] + [
                lambda: os.killpg({group}, signal.SIGURG),
                lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGURG),
                lambda: os.kill(os.getpid(), signal.SIGKILL),
                lambda: LIBC.syscall({calls["pidfd_open"]}, {me}, 0) < 0 and raise_errno(),
                lambda: signal.sigqueue({me}, signal.SIGURG, 1) if hasattr(signal, "sigqueue") else raise_eperm(),
            ]"""),
            prelude=RAW_CALLS + "import signal, threading\n",
        )
        r = attack(code, "error", unrestricted=True)
        assert r.error == "PermissionError: refused 12, not refused []"
        assert canary.poll() is None
    finally:
        canary.kill()
        canary.wait()


def test_fcntl_signal_delivery_is_refused(world, walls):
    # F_SETOWN + F_SETSIG + O_ASYNC on its own pipe would make the kernel signal the trainer's group on its behalf.
    group = os.getpgid(0)
    code = strategy(
        refused_count(f"""[
            lambda: fcntl.fcntl(4, fcntl.F_SETOWN, -{group}),
            lambda: fcntl.fcntl(3, fcntl.F_SETOWN, {os.getpid()}),
            lambda: fcntl.fcntl(4, 10, signal.SIGURG),  # F_SETSIG
            lambda: fcntl.fcntl(4, fcntl.F_SETFL, os.O_ASYNC | os.O_NONBLOCK),
            lambda: fcntl.fcntl(4, fcntl.F_GETFL),
        ]"""),
        prelude="import fcntl, os, signal\n",
    )
    r = attack(code, "error", unrestricted=True)
    assert r.error == "PermissionError: refused 5, not refused []"


def test_scheduling_and_priorities_of_others_are_refused(world, walls):
    me = os.getpid()
    code = strategy(
        refused_count(f"""[
            lambda: os.sched_setaffinity({me}, {{0}}),
            lambda: os.sched_setscheduler({me}, os.SCHED_IDLE, os.sched_param(0)),
            lambda: os.setpriority(os.PRIO_PROCESS, {me}, 19),
            lambda: os.setpriority(os.PRIO_PGRP, 0, 19),
            lambda: LIBC.syscall({SYSCALLS.get("ioprio_set", -1)}, 1, {me}, 3 << 13) < 0 and raise_errno(),
            lambda: os.sched_setaffinity(0, {{0}}),
        ]"""),
        prelude=RAW_CALLS,
    )
    r = attack(code, "error", unrestricted=True)
    assert r.error == "PermissionError: refused 6, not refused []"  # the world fixture: the trainer is unchanged


def test_ipc_objects_are_refused(world, walls):
    # SysV shared memory, queues and semaphores, and POSIX queues, outlive a process: a channel between games.
    code = strategy(
        refused_count(f"""[
            lambda: LIBC.shmget(0, 768 << 20, 0o1600) < 0 and raise_errno(),
            lambda: LIBC.msgget(0, 0o1600) < 0 and raise_errno(),
            lambda: LIBC.semget(0, 1, 0o1600) < 0 and raise_errno(),
            lambda: LIBC.syscall({SYSCALLS.get("mq_open", -1)}, b"train2048-{MARK}", os.O_CREAT | os.O_RDWR, 0o600, None)
                < 0 and raise_errno(),
            lambda: os.memfd_create("x"),
            lambda: os.eventfd(0),
        ]"""),
        prelude=RAW_CALLS,
    )
    r = attack(code, "error", unrestricted=True)
    assert r.error == "PermissionError: refused 6, not refused []"


def test_proc_walks_are_refused(world, walls):
    # Walking /proc finds the other games' children (their cwd is the sandbox's temp root) and the trainer.
    me = os.getpid()
    code = strategy(
        refused_count(f"""[
            lambda: os.listdir("/proc"),
            lambda: os.readlink("/proc/{me}/cwd"),
            lambda: os.readlink("/proc/self/cwd"),
            lambda: os.stat("/proc/{me}"),
            lambda: os.access("/proc/{me}/environ", os.R_OK) or raise_eperm(),
            lambda: open("/proc/self/maps").read(),
            lambda: os.scandir("/tmp"),
        ]"""),
        prelude=RAW_CALLS,
    )
    r = attack(code, "error", unrestricted=True)
    assert r.error == "PermissionError: refused 7, not refused []"


def test_other_processes_clocks_and_shared_futexes_are_refused(world, walls):
    # A negative clock id is another process's CPU clock: readable and waitable without any permission check, so a
    # way to find pids, watch the trainer and pass messages between games. A futex on a file's page is shared with
    # every process that maps the file. Its own clocks and private futexes stay.
    me = os.getpid()
    code = strategy(
        refused_count(f"""[
            lambda: time.clock_gettime(((~{me}) << 3) | 2),
            lambda: time.clock_getres(((~1) << 3) | 2),
            lambda: LIBC.syscall({SYSCALLS.get("clock_nanosleep", -1)}, ((~{me}) << 3) | 2, 0, ctypes.byref(ts), None)
                and raise_errno(),
            lambda: LIBC.syscall({SYSCALLS.get("futex", -1)}, ctypes.byref(word), 1, 1, None, None, 0) < 0
                and raise_errno(),  # FUTEX_WAKE, shared
            lambda: LIBC.syscall({SYSCALLS.get("futex", -1)}, ctypes.byref(word), 6, 0, None, None, 0) < 0
                and raise_errno(),  # FUTEX_LOCK_PI: it names another pid as the owner
            lambda: time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID) >= 0 or raise_errno(),
            lambda: LIBC.syscall({SYSCALLS.get("futex", -1)}, ctypes.byref(word), 129, 1, None, None, 0) < 0
                and raise_errno(),  # FUTEX_WAKE_PRIVATE
        ]"""),
        prelude=RAW_CALLS + "import time\nword, ts = ctypes.c_int(0), (ctypes.c_long * 2)(0, 1)\n",
    )
    r = attack(code, "error", unrestricted=True)
    assert r.error == "PermissionError: refused 5, not refused [5, 6]"


def test_memory_tricks_are_refused(world, walls):
    # Pinned pages (MAP_LOCKED: root, or a container with --ulimit memlock=-1, could pin its whole allowance), the
    # machine's huge-page pool, and KSM merging (a side channel between processes). Plain memory stays.
    code = strategy(
        refused_count("""[
            lambda: mmap(2 << 20, 0x22 | 0x2000),  # MAP_PRIVATE | MAP_ANONYMOUS | MAP_LOCKED
            lambda: mmap(2 << 20, 0x22 | 0x40000),  # MAP_HUGETLB
            lambda: LIBC.madvise(ctypes.c_void_p(mmap(1 << 16, 0x22)), 1 << 16, 12) and raise_errno(),  # MERGEABLE
            lambda: LIBC.mlockall(3) and raise_errno(),
            lambda: mmap(1 << 16, 0x22),
        ]"""),
        prelude=RAW_CALLS
        + textwrap.dedent("""
        LIBC.mmap.restype = ctypes.c_void_p
        LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        def mmap(size, flags):
            address = LIBC.mmap(None, size, 3, flags, -1, 0)
            if address in (None, 2**64 - 1):
                raise_errno()
            return address
        """),
    )
    r = attack(code, "error", unrestricted=True)
    assert r.error == "PermissionError: refused 4, not refused [4]"


def test_an_escaped_strategy_cannot_stop_its_neighbours(world):
    # Under GRPO, hurting the other answers of your group raises your own advantage. The attacker tries to stop
    # every process near its own pid (the trainer's own pids excluded, so a broken wall fails this test rather
    # than hanging it); the honest games of the batch must come out exactly as when played alone.
    spare = {os.getpid(), os.getppid()}
    attacker = strategy(f"""
        import os, signal, time
        me = os.getpid()
        for pid in range(max(2, me - 300), me + 300):
            if pid not in {spare!r} and pid != me:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except OSError:
                    pass
        time.sleep(0.05)
        return "W"
    """)
    honest = strategies.source("greedy")
    jobs = [(attacker, 1, sandbox.Game(size=4, target=128, **LIMITS))] * 2
    jobs += [(honest, seed, sandbox.Game(size=4, target=128, **LIMITS)) for seed in range(6)]
    mixed = sandbox.play_many(jobs, workers=4, _unrestricted=True)
    alone = [sandbox.play(honest, seed=seed, size=4, target=128, **LIMITS) for seed in range(6)]
    assert [(r.status, r.moves, r.score) for r in mixed[2:]] == [(r.status, r.moves, r.score) for r in alone]
    assert all(r.status == "success" for r in alone)
    assert leftovers() == []


def test_the_server_and_each_child_have_sessions_of_their_own():
    sandbox.play("def strategy(board):\n    return 'X'\n", seed=0)  # spares exist now
    server, spares = sandbox._idle_pids()
    assert os.getsid(server) == server != os.getsid(0) and os.getpgid(server) == server
    children = [c for pid in spares for c in psutil.Process(pid).children()]
    assert children
    for child in children:
        assert os.getsid(child.pid) == child.pid and os.getpgid(child.pid) == child.pid


# --- as root, children become a user of their own: that wall alone -----------------------------------------

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="children change user only when the trainer is root")


@pytest.fixture
def uid_wall_alone():
    """A server without seccomp whose children still leave root."""
    sandbox.shutdown()
    with pytest.warns(RuntimeWarning, match="seccomp is unavailable"):
        sandbox._warned_no_seccomp = False
        sandbox.start(_disable_seccomp=True)
        sandbox.play("def strategy(board):\n    return 'X'\n", seed=0)
    yield
    sandbox.shutdown()
    sandbox.start()


@root_only
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_children_of_a_root_trainer_run_as_an_unprivileged_user_of_their_own(world, uid_wall_alone):
    code = strategy("import os\nraise ValueError(f'{os.getresuid()} {os.getresgid()} {os.getgroups()}')")
    ids = {attack(code, "error", unrestricted=True).error for _ in range(3)}
    for error in ids:
        uid = int(error.split("(")[1].split(",")[0])
        assert uid >= 0x7FF00000 or uid == 65534, error
        assert error == f"ValueError: ({uid}, {uid}, {uid}) ({uid}, {uid}, {uid}) []"
    assert len(ids) > 1  # one user per child


@root_only
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_another_user_alone_keeps_the_trainer_and_its_files_out_of_reach(world, uid_wall_alone):
    me, server = os.getpid(), sandbox._server.pid
    code = strategy(
        refused_count(f"""[
            lambda: os.kill({me}, signal.SIGURG),
            lambda: os.kill({server}, signal.SIGURG),
            lambda: os.sched_setaffinity({me}, {{0}}),
            lambda: os.setpriority(os.PRIO_PROCESS, {me}, 19),
            lambda: open("/proc/{me}/environ").read(),
            lambda: os.readlink("/proc/{me}/cwd"),
            lambda: open({str(world.home / ".netrc")!r}).read(),
            lambda: open({str(world.checkpoint / "adapter_model.safetensors")!r}, "wb"),
        ]"""),
        prelude="import os, signal\n",
    )
    r = attack(code, "error", unrestricted=True)
    assert r.error == "PermissionError: refused 8, not refused []"


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
        "getattr((), '__dic' + 't__')",
        "[x for x in ()].__class__.__mro__",
    ]
    for escape in escapes:
        r = attack(strategy(f"return {escape}"), "violation")
        assert r.error, (escape, r)


def test_frame_walk_through_a_generator_is_refused(world):
    code = strategy("def g():\n    yield gen.gi_frame.f_back\ngen = g()\nreturn next(gen)")
    r = attack(code, "violation")
    assert r.error in ("attribute 'gi_frame'", "attribute 'f_back'")  # the judge says the first it meets


def test_module_internals_are_hidden(world):
    r = attack(strategy("import random\nreturn random._os.system('true')"), "error")
    assert r.error.startswith("AttributeError")
    r = attack(strategy("import typing\nreturn typing.get_type_hints"), "error")
    assert r.error.startswith("AttributeError")


def test_eval_gateways_in_allowed_modules_are_closed(world):
    gateways = {
        # attribute fetchers that take a computed name
        "import operator\nreturn operator.attrgetter('_' * 2 + 'dict' + '_' * 2)(())": "violation attribute",
        "import operator\nreturn operator.methodcaller('_' * 2 + 'reduce' + '_' * 2)(())": "violation attribute",
        "import string\nreturn string.Formatter().get_field('0.x', [1], {})": "error AttributeError",
        # string annotations evaluated by typing / singledispatch
        "import functools\nreturn functools.singledispatch": "error AttributeError",
        "import typing\nreturn typing.ForwardRef('1')": "error AttributeError",
        # dataclass writes its methods as source text from the field names
        "import dataclasses\nd = '_' * 2 + 'annotations' + '_' * 2\n"
        "X = type('X', (), {d: {\"x=print('pwned')#\": int}})\nreturn dataclasses.dataclass(X)": "violation a dataclass",
    }
    for body, expected in gateways.items():
        status, error = expected.split(" ", 1)
        r = attack(strategy(body), status)
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


# --- without seccomp and as our own user: the process-tree clean-up and the rlimits alone -----------------


@pytest.fixture
def os_layers_off():
    """A server whose children keep our user and get no seccomp filter: what stands is the process tree
    (sessions, subreapers, group kills, the marker sweep), the rlimits and the deadlines."""
    sandbox.shutdown()
    with pytest.warns(RuntimeWarning, match="seccomp is unavailable"):
        sandbox._warned_no_seccomp = False
        sandbox.start(_disable_seccomp=True, _keep_root=True)
        sandbox.play("def strategy(board):\n    return 'X'\n", seed=0)
    yield
    sandbox.shutdown()
    sandbox.start()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_orphaned_setsid_grandchildren_are_killed(world, os_layers_off):
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
def test_children_are_the_oom_killers_first_choice(world, os_layers_off):
    # RLIMIT_AS does not count page tables, so a child can hold about twice its limit: if memory runs out, the
    # kernel must pick a child, never the trainer.
    r = attack(
        strategy("raise ValueError(open('/proc/self/oom_score_adj').read().strip())"), "error", unrestricted=True
    )
    assert r.error == "ValueError: 1000"
    with open(f"/proc/{os.getpid()}/oom_score_adj") as f:
        assert f.read().strip() != "1000"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_file_size_limit_alone(world, os_layers_off):
    # Without seccomp a file can be opened (in the sandbox's own temp dir, removed afterwards), but
    # RLIMIT_FSIZE 0 lets not one byte into it.
    code = strategy("f = open('big', 'wb', buffering=0)\nf.write(b'x' * 4096)\nreturn 'W'")
    r = attack(code, "error", unrestricted=True)
    assert "File too large" in r.error


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_bounded_fork_storm_is_killed_on_time(world, os_layers_off):
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
def test_killing_the_referee_is_a_crash_and_leaves_nothing(world, os_layers_off):
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
def test_killing_the_server_restarts_it_and_leaves_nothing(world, os_layers_off):
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
