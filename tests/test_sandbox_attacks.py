"""Hostile strategies against the sandbox: every attack class of GUIDE.md section 3, each contained.

Plain forms die at the Python layer (the judge, the module and builtins allowlist). So that each OS
layer is proven on its own, attacks run with `_unrestricted=True` (full builtins, any import, no hook):
then only seccomp, rlimits, the process jail and the group kill stand between the code and us, and every
step outside the process must end the game as a `violation` (the kernel kills the child, the referee
reports it), scored like the forbidden import. A few run on a server started without seccomp, to prove
the process-tree clean-up, the rlimits and the change of user on their own.

Every test checks: the status (never success by cheating), the time (limit + 1 s), that we are
alive, that no file appeared or changed outside the sandbox, that no connection reached our
listener, and that no process is left (our children, and any process carrying an attack marker).
"""

import ctypes
import mmap
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
import sandbox_child
import sandbox_server
import strategies

MARK = "train2048-attack-marker"
SECRET = "s3cr3t-train2048-fake-token"
SEED = 918273645  # distinctive, so a search of the child's objects cannot find it by accident
# How many times slower this machine runs than those the tests' limits were set on: bench/aarch64_check.py sets it under
# emulation. It scales the limits of these tests' own games; the product's limits never read it.
TIME_SCALE = float(os.environ.get("TRAIN2048_TEST_TIME_SCALE", "1"))
LIMITS = dict(move_time_limit=0.5 * TIME_SCALE, game_time_limit=1.0 * TIME_SCALE)


def strategy(body: str, prelude: str = "") -> str:
    """Source of `def strategy(board)` with `body` inside (dedented, re-indented)."""
    return textwrap.dedent(prelude) + "def strategy(board):\n" + textwrap.indent(textwrap.dedent(body), "    ")


# --- the watchers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def server():
    sandbox.start()
    yield
    sandbox.shutdown()


def server_with(seccomp: bool = True, drop_root: bool = True) -> None:
    """The sandbox's server with these walls, restarted only when it runs with others: a start takes seconds under
    emulation (bench/aarch64_check.py)."""
    if sandbox._test_switches != {"seccomp": seccomp, "drop_root": drop_root}:
        sandbox.shutdown()
    sandbox.start(_disable_seccomp=not seccomp, _keep_root=not drop_root)


@pytest.fixture(autouse=True)
def every_wall_unless_asked(request):
    """Each test meets the default server (every wall on) unless it asks for fewer walls (the fixtures below)."""
    if not {"walls", "uid_wall_alone", "os_layers_off"} & set(request.fixturenames):
        server_with()


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
# The calls the attacks below make through libc's syscall(), by architecture: x86_64's own table, and aarch64's, the
# generic one (include/uapi/asm-generic/unistd.h); test_the_call_numbers_are_the_kernels checks both against libseccomp.
SYSCALLS_BY_ARCH = {
    "x86_64": dict(tgkill=234, ioprio_set=251, ioprio_get=252, mq_open=240, pidfd_open=434, pidfd_send_signal=424,
                   futex=202, clock_nanosleep=230, socket=41),
    "aarch64": dict(tgkill=131, ioprio_set=30, ioprio_get=31, mq_open=180, pidfd_open=434, pidfd_send_signal=424,
                    futex=98, clock_nanosleep=115, socket=198),
}  # fmt: skip
SYSCALLS = SYSCALLS_BY_ARCH.get(platform.machine(), {})


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
    assert elapsed <= args["game_time_limit"] + 1.0 * TIME_SCALE, (elapsed, result)
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
    assert f"{LIMITS['move_time_limit']:g} s" in r.error


def test_loop_in_finally(world):
    attack(strategy("try:\n    return 'W'\nfinally:\n    while True:\n        pass\n"), "timeout")


def test_the_game_limit_stops_a_strategy_that_is_slow_on_every_move(world):
    r = attack(strategy("import time\ntime.sleep(0.3)\nreturn 'W'"), "timeout")
    assert r.error == f"the game took longer than {LIMITS['game_time_limit']:g} s" and r.max_tile >= 2


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
    r = attack(strategy("import sys\nreturn sys.modules['os']"), "violation")
    assert r.error == "sys.modules, which the contract leaves out"
    r = attack(strategy("import sys\ns = sys\nreturn s.modules['os']"), "error")  # past the judge: not in the copy
    assert r.error == "AttributeError: module 'sys' has no attribute 'modules'"
    attack(strategy("import sys\nreturn 'W' if sys.maxsize > 0 else 'A'"), "failed")


def test_signal_module_is_not_importable(world):
    r = attack(strategy("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True: pass"), "violation")
    assert r.error == "import of 'signal'"


# --- memory, processes, threads ----------------------------------------------------------------------


def test_memory_bomb_hits_the_address_space_limit(world):
    r = attack(strategy("x = [0] * 10**10\nreturn 'W'"), "error")
    assert r.error.startswith("MemoryError")


def test_memory_limit_alone(world):
    code = strategy("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))")
    r = attack(code, "error", unrestricted=True, memory_limit_mb=128)
    assert r.error.startswith("MemoryError")


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


def test_a_bystander_is_out_of_reach(world):
    canary = subprocess.Popen(["sleep", "30"])
    try:
        r = attack(escaped(f"os.kill({canary.pid}, signal.SIGKILL)", world), "violation", unrestricted=True)
        assert r.error == sandbox_server.SECCOMP_KILL and canary.poll() is None
    finally:
        canary.kill()
        canary.wait()


def test_ctypes_segfault_is_a_crash(world):
    r = attack(strategy("import ctypes\nctypes.string_at(0)"), "crash", unrestricted=True)
    assert "SIGSEGV" in r.error


@pytest.mark.parametrize("fatal", ["os.abort()", "LIBC.free(ctypes.c_void_p(P))\nLIBC.free(ctypes.c_void_p(P))"])
def test_a_fatal_error_is_a_crash(world, fatal):
    """abort(), as CPython's Py_FatalError and the C library's fatal errors (a double free, reported on stderr first)
    end a process, signals the process itself with SIGABRT: a crash, as in plain Python, never the kernel's SIGSYS."""
    prelude = ESCAPED + "LIBC.malloc.restype = ctypes.c_void_p\nP = LIBC.malloc(64)\n"
    r = attack(strategy(fatal, prelude=prelude), "crash", unrestricted=True)
    assert r.error == "killed by signal SIGABRT", r


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
    limits = dict(move_time_limit=3.0 * TIME_SCALE, game_time_limit=3.0 * TIME_SCALE)
    r = attack(code, ("crash", "error"), unrestricted=True, **limits)
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


def test_environment_holds_only_the_time_zone(world):
    r = attack(strategy("import os\nraise ValueError(repr(dict(os.environ)))"), "error", unrestricted=True)
    assert r.error == "ValueError: {'TZ': 'UTC'}"


def test_socket_import_is_refused(world):
    attack(strategy(f"import socket\nsocket.create_connection(('127.0.0.1', {world.port}))\nreturn 'W'"), "violation")


def test_huge_stdout_goes_nowhere(world, capfd):
    code = strategy("while True:\n    print('x' * 10**6)")
    attack(code, "timeout")
    out, err = capfd.readouterr()
    assert len(out) + len(err) < 10_000


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fd_limit_alone(world, os_layers_off):
    code = strategy("import os\nwhile True:\n    os.pipe()")
    r = attack(code, "error", unrestricted=True)
    assert "Too many open files" in r.error


# --- code that is already out of Python: the kernel sees every step outside ---------------------------------------


@pytest.fixture(params=["all layers", "seccomp alone"])
def walls(request):
    """The default server, then one whose children keep our user (root here, where tests run as root): each
    attack below must be caught in both, so seccomp holds on its own."""
    server_with(drop_root=request.param == "all layers")
    return request.param


# What escaped code uses below: modules already loaded in the child (the server imports them for these tests) and
# libc through ctypes, for calls Python has no function for. Setting this up makes no system call.
ESCAPED = """import ctypes, fcntl, os, random, signal, socket, subprocess, threading, time
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
WORD, TS = ctypes.c_int(0), (ctypes.c_long * 2)(0, 1)
"""
# One step outside its own process each, as escaped code would take it: it catches the error and plays on. The
# kernel must kill the child at the step, whatever the step returns; {me} is the trainer, {group} its process group,
# {server} the sandbox's server, {home} and {checkpoint} the world fixture's, {futex} and the like the call's number
# on this machine (SYSCALLS).
OUTSIDE = {
    # signals, to anyone, itself included
    "kill the referee": "os.kill(os.getppid(), signal.SIGURG)",
    "kill the trainer": "os.kill({me}, signal.SIGURG)",
    "kill the server": "os.kill({server}, signal.SIGURG)",
    "kill everyone in its group": "os.kill(0, signal.SIGURG)",
    "killpg the trainer's group": "os.killpg({group}, signal.SIGURG)",
    "kill itself": "os.kill(os.getpid(), signal.SIGKILL)",
    "pthread_kill itself": "signal.pthread_kill(threading.main_thread().ident, signal.SIGURG)",
    "abort()'s signal to the trainer (tgkill)": "LIBC.syscall({tgkill}, {me}, {me}, signal.SIGABRT)",
    "abort()'s signal to the referee (kill)": "os.kill(os.getppid(), signal.SIGABRT)",
    "pidfd_open of the trainer": "LIBC.syscall({pidfd_open}, {me}, 0)",
    "a signal handler": "signal.signal(signal.SIGTERM, signal.SIG_IGN)",
    "an interval timer": "signal.setitimer(signal.ITIMER_REAL, 0)",
    # signals the kernel would send on its behalf, its scheduling and others'
    "fcntl F_SETOWN to the trainer's group": "fcntl.fcntl(4, fcntl.F_SETOWN, -{group})",
    "fcntl F_SETSIG": "fcntl.fcntl(4, 10, signal.SIGURG)",
    "fcntl O_ASYNC": "fcntl.fcntl(4, fcntl.F_SETFL, os.O_ASYNC | os.O_NONBLOCK)",
    "fcntl F_GETFL": "fcntl.fcntl(4, fcntl.F_GETFL)",
    "sched_setaffinity of the trainer": "os.sched_setaffinity({me}, [0])",
    "sched_setaffinity of itself": "os.sched_setaffinity(0, [0])",
    "sched_setscheduler of the trainer": "os.sched_setscheduler({me}, os.SCHED_IDLE, os.sched_param(0))",
    "setpriority of the trainer": "os.setpriority(os.PRIO_PROCESS, {me}, 19)",
    "setpriority of a group": "os.setpriority(os.PRIO_PGRP, 0, 19)",
    "ioprio_set of the trainer": "LIBC.syscall({ioprio_set}, 1, {me}, 3 << 13)",
    "setsid": "os.setsid()",
    # processes and threads
    "fork": "os.fork()",
    "fork through libc": "LIBC.fork()",
    "a thread": "threading.Thread(target=time.sleep, args=(100,), daemon=True).start()",
    "subprocess": "subprocess.Popen(['sh', '-c', 'sleep 30 # " + MARK + "'])",
    "posix_spawn": "os.posix_spawn('/bin/sleep', ['sleep', '30', '" + MARK + "'], {{}})",
    "exec": "os.execv('/bin/sleep', ['sleep', '30', '" + MARK + "'])",
    # the same call under a number of another ABI (x86_64's x32; aarch64 has one ABI for 64-bit code, so there it is a
    # number in no table), and under one whose upper 32 bits the kernel drops: the filter must see what the kernel runs
    "socket by another ABI's number": "LIBC.syscall(0x40000000 | {socket}, 2, 1, 0)",
    "socket by a number with its upper bits set": "LIBC.syscall(ctypes.c_long((1 << 32) | {socket}), 2, 1, 0)",
    # files, /proc and the environment of others
    "open a secret": "open('{home}/.netrc').read()",
    "write the checkpoint": "os.open('{checkpoint}/adapter_model.safetensors', os.O_WRONLY | os.O_TRUNC)",
    "create a file in /tmp": "os.open('/tmp/" + MARK + "', os.O_WRONLY | os.O_CREAT, 0o644)",
    "unlink the checkpoint": "os.unlink('{checkpoint}/adapter_model.safetensors')",
    "mkdir": "os.mkdir('{home}/d')",
    "symlink": "os.symlink('/', '{home}/l')",
    "read the trainer's environment": "open('/proc/{me}/environ').read()",
    "list /proc": "os.listdir('/proc')",
    "stat /proc of the trainer": "os.stat('/proc/{me}')",
    "readlink /proc of the trainer": "os.readlink('/proc/{me}/cwd')",
    "readlink /proc/self": "os.readlink('/proc/self/cwd')",
    "getcwd": "os.getcwd()",
    # sockets
    "a socket to the trainer's listener": "socket.create_connection(('127.0.0.1', {port}))",
    "a socket through libc": "LIBC.socket(2, 1, 0)",
    "a socketpair": "socket.socketpair()",
    # descriptors other than its two pipes and /dev/null
    "write to another fd": "os.write(0, b'x')",
    "write to its board pipe": "os.write(3, b'x')",
    "read its reply pipe": "os.read(4, 1)",
    "a pipe": "os.pipe()",
    "dup": "os.dup(4)",
    "eventfd": "os.eventfd(0)",
    "memfd": "os.memfd_create('x')",
    # IPC objects that outlive a game
    "SysV shared memory": "LIBC.shmget(0, 768 << 20, 0o1600)",
    "SysV message queue": "LIBC.msgget(0, 0o1600)",
    "SysV semaphore": "LIBC.semget(0, 1, 0o1600)",
    "a POSIX message queue": "LIBC.syscall({mq_open}, b'/" + MARK + "', os.O_CREAT | os.O_RDWR, 0o600, None)",
    # other processes' clocks and shared futexes
    "another process's CPU clock": "time.clock_gettime(((~{me}) << 3) | 2)",
    "another process's clock resolution": "time.clock_getres(((~1) << 3) | 2)",
    "sleep on another process's clock": "LIBC.syscall({clock_nanosleep}, ((~{me}) << 3) | 2, 0, ctypes.byref(TS), None)",
    "a shared futex": "LIBC.syscall({futex}, ctypes.byref(WORD), 1, 1, None, None, 0)",
    "a priority-inheritance futex": "LIBC.syscall({futex}, ctypes.byref(WORD), 6, 0, None, None, 0)",
    # memory that reaches beyond the process
    "pinned pages": "LIBC.mmap(None, 2 << 20, 3, 0x22 | 0x2000, -1, 0)",
    "the huge-page pool": "LIBC.mmap(None, 2 << 20, 3, 0x22 | 0x40000, -1, 0)",
    "KSM merging": "LIBC.madvise(ctypes.c_void_p(LIBC.mmap(None, 1 << 16, 3, 0x22, -1, 0)), 1 << 16, 12)",
    "mlockall": "LIBC.mlockall(3)",
}
# What escaped code may still do: compute, and the calls a running CPython needs (its own clocks, private futexes,
# plain memory, random bytes, sleep). The same prelude plays on: so each step above is what the kernel kills.
INSIDE = [
    "time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID)",
    "time.clock_gettime(((~0) << 3) | 2)",  # its own CPU clock by pid: 0 is the calling process
    "time.clock_getres(100)",  # a clock id that names nothing: EINVAL
    "LIBC.syscall({futex}, ctypes.byref(WORD), 129, 1, None, None, 0)",  # FUTEX_WAKE_PRIVATE
    "LIBC.mmap(None, 1 << 16, 3, 0x22, -1, 0)",
    "os.urandom(16)",
    "time.sleep(0.001)",
    "print('to /dev/null')",
]


def escaped(step: str, world=None) -> str:
    """A strategy already out of Python that takes `step` on its first move, catches what it raises, and plays on."""
    values = dict(me=os.getpid(), group=os.getpgid(0), server=sandbox._server.pid if sandbox._server else 0, port=0)
    values.update(SYSCALLS)
    if world is not None:
        values.update(home=world.home, checkpoint=world.checkpoint, port=world.port)
    else:
        values.update(home="/nonexistent-home", checkpoint="/nonexistent-checkpoint")
    body = f"try:\n    {step.format(**values)}\nexcept OSError:\n    pass\nreturn random.choice('WASD')"
    return strategy(body, prelude=ESCAPED)


needs_call_numbers = pytest.mark.skipif(not SYSCALLS, reason=f"no system call numbers for {platform.machine()}")


@needs_call_numbers
@pytest.mark.parametrize("step", sorted(OUTSIDE))
def test_every_step_outside_the_process_is_seen_by_the_kernel(world, walls, step):
    r = attack(escaped(OUTSIDE[step], world), "violation", unrestricted=True)
    assert r.error == sandbox_server.SECCOMP_KILL and r.moves == 0


@needs_call_numbers
def test_each_step_outside_scores_exactly_like_the_forbidden_import(monkeypatch):
    """Through the reward functions as TRL calls them, with every Python layer off (the judge sees nothing, the child
    gets every builtin and module and no audit hook): the kernel alone makes each escaped answer score like the plain
    `import os`, however it handled the error."""
    import functools

    from test_contract import FORBIDDEN_IMPORT, FORBIDDEN_SCORE, fenced, scored

    import rewards

    (forbidden,) = scored([fenced(FORBIDDEN_IMPORT)])
    steps = sorted(OUTSIDE)
    monkeypatch.setattr(rewards.policy, "judge", lambda code: ((), None))
    monkeypatch.setattr(rewards.sandbox, "play_many", functools.partial(sandbox.play_many, _unrestricted=True))
    completions = [fenced(escaped(OUTSIDE[step])) for step in steps]
    rewards._analyse_text.cache_clear()
    limits = dict(move_time_limit=1.0 * TIME_SCALE, game_time_limit=3.0 * TIME_SCALE)  # test_contract.FAST's
    try:
        scores = scored(completions, **limits)
        verdicts = rewards.make_judge(rewards.RewardSettings(size=3, target=64, games=1, **limits))(completions)
    finally:
        rewards._analyse_text.cache_clear()
    assert forbidden == FORBIDDEN_SCORE
    for step, score, verdict in zip(steps, scores, verdicts, strict=True):
        assert score == forbidden, (step, score)
        assert not verdict.analysis.cheats and verdict.violation == sandbox_server.SECCOMP_KILL, (step, verdict)  # played, then seen


@needs_call_numbers
def test_what_a_running_process_needs_stays_allowed(world):
    for step in INSIDE:
        r = attack(escaped(step, world), ("failed", "success"), unrestricted=True)
        assert r.moves > 0, (step, r)


def test_the_call_numbers_are_the_kernels():
    """The numbers the steps above call by are each architecture's own, as libseccomp (which builds the filter) names
    them: a wrong one would test a call that nobody makes."""
    import pyseccomp

    for arch, numbers in SYSCALLS_BY_ARCH.items():
        arch_id = getattr(pyseccomp.Arch, arch.upper())
        assert {name: pyseccomp.resolve_syscall(arch_id, name) for name in numbers} == numbers, arch


def test_the_filters_argument_values_are_this_machines():
    """The allowlist's argument checks spell Linux's values out (sandbox_child); the C library's own, as this Python was
    built with them, must be the same (as on x86_64 and aarch64; some architectures number them otherwise). The steps
    above prove the mmap flags and futex operations by what the kernel does with them."""
    madvice = ("NORMAL", "RANDOM", "SEQUENTIAL", "WILLNEED", "DONTNEED", "FREE", "HUGEPAGE", "NOHUGEPAGE")
    assert sandbox_child._MADVICE == tuple(getattr(mmap, "MADV_" + name) for name in madvice)
    assert mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS == 0x22  # what the steps' mmap calls pass


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
    with pytest.warns(RuntimeWarning, match="seccomp is unavailable"):
        sandbox._warned_no_seccomp = False
        server_with(seccomp=False)
        sandbox.play("def strategy(board):\n    return 'X'\n", seed=0)


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


def refused_count(attempts: str) -> str:
    """Code that runs each attempt of a list of lambdas and raises with how many were refused with EPERM (without
    seccomp, where a refused call is an error the code sees)."""
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


# The child's last reply, written by escaped code itself: each ends the game (max_moves=1 caps it after the key).
LAST_REPLIES = {
    "an error": 'struct.pack("!H", 8) + b"Egave up"',
    "the key that ends the game": "frame(key)",
    "two replies at once": "frame(key) * 2",
    "an oversized reply": 'struct.pack("!H", 60000) + b"K" * 100',
}


@pytest.mark.parametrize("reply", sorted(LAST_REPLIES))
def test_a_step_outside_after_the_last_reply_is_seen(world, reply):
    """The game ends on what the child wrote, but not before the child has ended: the referee closes the board pipe,
    gives it a few milliseconds, kills it, and a death by SIGSYS is a violation whatever it replied."""
    code = strategy(
        f"""
        key = next(k for k in "WASD" if game2048.apply_move(board, k)[2])
        os.write(4, {LAST_REPLIES[reply]})
        try:
            os.kill({os.getpid()}, signal.SIGURG)
        except OSError:
            pass
        time.sleep(10)
        """,
        prelude="import game2048, os, signal, struct, time\n"
        "def frame(key):\n    return struct.pack('!H', 1 + len(key)) + b'K' + key.encode()\n",
    )
    r = attack(code, "violation", unrestricted=True, max_moves=1)
    assert r.error == sandbox_server.SECCOMP_KILL


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
        "getattr((), '__dict__')",
        "[x for x in ()].__class__.__mro__",
    ]
    for escape in escapes:
        r = attack(strategy(f"return {escape}"), "violation")
        assert r.error, (escape, r)


def test_frame_walk_through_a_generator_is_refused(world):
    code = strategy("def g():\n    yield gen.gi_frame.f_back\ngen = g()\nreturn next(gen)")
    r = attack(code, "violation")
    assert r.error in ("attribute 'gi_frame'", "attribute 'f_back'")  # the judge says the first it meets


def test_module_internals_are_not_served(world):
    r = attack(strategy("import random\nreturn random._os.system('true')"), "violation")
    assert r.error == "random._os, which the contract leaves out"
    r = attack(strategy("import enum\nreturn enum.bltns.eval('1')"), "violation")  # enum's name for builtins
    assert r.error == "enum.bltns, which the contract leaves out"
    r = attack(strategy("import enum\ne = enum\nreturn e.bltns.eval('1')"), "error")  # past the judge
    assert r.error == "AttributeError: module 'enum' has no attribute 'bltns'"


def test_text_that_allowed_modules_evaluate_meets_the_same_walls(world):
    """typing evaluates string annotations, dataclasses writes its methods as source text from the field names: text
    the judge never sees runs with the strategy's builtins and module copies, and any step outside is seen. Text that
    does not compile never runs: it is the SyntaxError plain Python raises."""
    annotation = strategy(
        "def f(x: \"__import__('os').getpid()\"):\n    pass\nreturn typing.get_type_hints(f) and 'W'",
        prelude="import typing\n",
    )
    r = attack(annotation, "violation")
    assert r.error == "import of 'os'"
    field = strategy(
        "d = '_' * 2 + 'annotations' + '_' * 2\n"
        "X = type('X', (), {d: {\"x=__import__('os').getpid()#\": int}})\nreturn dataclasses.dataclass(X)",
        prelude="import dataclasses\n",
    )
    r = attack(field, "error")  # CPython's report of it opens no file (sandbox_child._audit_hook)
    assert r.error.startswith("SyntaxError: "), r


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
    r = attack(code, "error", unrestricted=True, move_time_limit=5.0 * TIME_SCALE, game_time_limit=5.0 * TIME_SCALE)
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
    r = attack(strategy(body), "failed", **{**LIMITS, "game_time_limit": 5.0 * TIME_SCALE})
    assert (r.moves, r.score, r.max_tile) == (honest.moves, honest.score(), honest.max_tile())


# --- without seccomp and as our own user: the process-tree clean-up and the rlimits alone -----------------


@pytest.fixture
def os_layers_off():
    """A server whose children keep our user and get no seccomp filter: what stands is the process tree
    (sessions, subreapers, group kills, the marker sweep), the rlimits and the deadlines."""
    with pytest.warns(RuntimeWarning, match="seccomp is unavailable"):
        sandbox._warned_no_seccomp = False
        server_with(seccomp=False, drop_root=False)
        sandbox.play("def strategy(board):\n    return 'X'\n", seed=0)


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
