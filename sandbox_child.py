"""The untrusted side of a game: the child process that holds one strategy, and the walls it is put behind.

The referee (sandbox_server.py) forks the child before it knows its job. While it waits as a spare, the child takes a
session of its own, keeps only its two pipes, sets the rlimits that do not depend on the game and the OOM killer's
first place. With the job come its working directory and its memory and CPU limits; then it leaves root when we are
root, installs the seccomp allowlist, compiles the code (here, under the load deadline and the memory limit: never in
the trainer), installs the audit hook and runs the module with the allowed builtins and module copies. From then on it
answers one key per board until the referee kills it.

Seen by the kernel. A system call outside the allowlist kills the process (SECCOMP_RET_KILL_PROCESS), and the referee,
which the strategy cannot touch, scores a child dead of SIGSYS as a violation: cheating, exactly like the plain
forbidden import. Refusing such a call with an error would let code that got out of Python catch it and play on.
Honest code must then never make one: the server does beforehand what CPython and the C library would otherwise do
lazily (import helper modules, read the time zone) and the child never prints warnings or unraisable exceptions (the
traceback printer opens source files). CPython's own lazy imports are never a violation, whatever the module: C code's
pass through the strategy's __import__ with a list as fromlist (_restricted_import), and the child's import system
reads no file (_no_imports_from_disk). A compile error's report opens no file, whoever compiles (_audit_hook), and a
fatal error's abort() signals the process itself (allowed: a crash, as in plain Python). tests/test_detection.py plays
every honest answer of the tests through it, and honest code in the sandbox and as plain Python: the same end.

Seen in Python. The audit hook reports what the strategy's own code reaches for in its process (eval, exec, imports,
open, frames, code objects, ...) as a violation with the event named; events that the allowed modules raise in their
own code (dataclasses and namedtuple compile methods, typing evaluates string annotations) are theirs. The hook is a
detector, not a wall: a way round it stays inside a process that holds nothing of the game, and the kernel sees any
step out.
"""

from __future__ import annotations

import builtins
import ctypes
import encodings
import errno
import fcntl
import importlib
import importlib.machinery
import inspect
import json
import os
import pkgutil
import resource
import signal
import struct
import sys
import tempfile
import time
import types
import warnings

import policy

MAX_KEY_CHARS = 64  # a longer return value is "invalid" before it crosses the pipe
MAX_REPLY_BYTES = 1024  # the referee reads no more than this per reply
READ_FD, WRITE_FD = 3, 4  # the pipes from and to the referee, where child_main puts them
TIME_ZONE = "UTC"  # the children's TZ, read once by the server: with TZ unset, glibc stats /etc/localtime on mktime()

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
_SECCOMP_MODE_FILTER = 2


def prctl(option: int, value: int) -> None:
    if _libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def child_main(rfd: int, wfd: int, *, devnull: int, drop_root: bool, seccomp) -> None:
    """Wall this process in, load the code of the job, then answer one key per board until killed. Never returns."""
    os.setsid()  # own session and process group: the referee kills the group
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # fds: stdin closed, stdout/stderr to /dev/null, our two pipes at 3 and 4, nothing else.
    hi_r, hi_w = fcntl.fcntl(rfd, fcntl.F_DUPFD, 100), fcntl.fcntl(wfd, fcntl.F_DUPFD, 100)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.dup2(hi_r, READ_FD)
    os.dup2(hi_w, WRITE_FD)
    os.close(0)
    os.closerange(WRITE_FD + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    os.environ.clear()
    os.environ["TZ"] = TIME_ZONE  # the zone the server read: tzset() and mktime() then need no file
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))  # no pinned memory, whatever `--ulimit memlock` allowed
    _first_for_the_oom_killer()
    prctl(_PR_SET_DUMPABLE, 0)  # no core dump helper started for each child the kernel kills, no ptrace by our user
    sys.unraisablehook = _ignore  # stderr is /dev/null; printing a traceback opens source files
    warnings.simplefilter("ignore")  # the same for warnings (a SyntaxWarning from compile, say)
    _no_imports_from_disk()
    load = json.loads(_read())  # a spare waits here; its game's directory and limits come with the job
    os.chdir(load["workdir"])
    mem = load["memory_limit_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (load["cpu_seconds"], load["cpu_seconds"] + 1))
    if drop_root:
        try:
            drop_to_own_user()
        except OSError:
            os._exit(73)  # never run the code as root (the server checked at start that this works)
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # a change of user clears it
    if seccomp is not None:
        seccomp.load()
    code, seed, unrestricted = load["code"], load["strategy_seed"], load["unrestricted"]
    del load
    try:
        strategy = _load_strategy(code, unrestricted)
        del code
        import random

        random.seed(seed)  # what play_game does before the first move, with the same one-way seed
    except Exception as exc:
        _reply(b"E", _describe(exc))
        _idle()
    except BaseException as exc:
        _reply(b"X", "raised " + _describe(exc))
        _idle()
    _reply(b"R", "")
    while True:
        msg = _read()
        board = [[int(v) for v in row.split(b",")] for row in msg.split(b";")]
        try:
            key = strategy(board)
        except Exception as exc:
            _reply(b"E", _describe(exc))
            _idle()
        except BaseException as exc:  # SystemExit, KeyboardInterrupt...: the process "exits"
            _reply(b"X", "raised " + _describe(exc))
            _idle()
        try:
            if not isinstance(key, str):
                kind, text = b"I", f"returned {_type_name(key)}, not a str"
            elif str.__len__(key) > MAX_KEY_CHARS:
                kind, text = b"I", f"returned a str of {str.__len__(key)} characters"
            else:
                kind, text = b"K", str.__str__(key)  # an exact copy of a str subclass's characters
        except BaseException:
            kind, text = b"I", "returned an unusable value"
        _reply(kind, text)


def _ignore(*args) -> None:
    pass


def _no_imports_from_disk() -> None:
    """An import of a module the server did not load finds no file to read: a module built into the interpreter still
    loads, any other is a ModuleNotFoundError (a codec this Python lacks, a LookupError), never a system call. The
    library imports on first use (encodings' codec search, 3.13's random.seed), and the path finder's stat() and open()
    would kill the child for it."""
    sys.meta_path[:] = [f for f in sys.meta_path if f is not importlib.machinery.PathFinder]
    sys.path.clear()
    sys.path_hooks.clear()
    sys.path_importer_cache.clear()


def _first_for_the_oom_killer() -> None:
    """oom_score_adj 1000: if the machine runs out of memory, a child goes first, never the trainer. RLIMIT_AS does
    not count page tables, so a child can hold about twice its limit (docs/SECURITY.md). Raising one's own score
    needs no privilege."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


# --- the pipes -------------------------------------------------------------------------------------------------

_inbox = bytearray()


def _read() -> bytes:
    """The next frame from the referee (it sends one, then waits for our reply)."""
    while len(_inbox) < 4 or len(_inbox) < 4 + struct.unpack("!I", _inbox[:4])[0]:
        chunk = os.read(READ_FD, 1 << 16)
        if not chunk:
            os._exit(0)  # the referee is gone
        _inbox.extend(chunk)
    n = 4 + struct.unpack("!I", _inbox[:4])[0]
    frame = bytes(_inbox[4:n])
    del _inbox[:n]
    return frame


def reply_frame(kind: bytes, text: str) -> bytes:
    """One reply: a 2-byte length, a kind byte (R ready, K key, E error, I invalid, X exit, V violation), UTF-8 text."""
    payload = kind + str.encode(text, "utf-8", "replace")[: MAX_REPLY_BYTES - 1]
    return struct.pack("!H", len(payload)) + payload


def _reply(kind: bytes, text: str) -> None:
    data = reply_frame(kind, text)
    while data:
        data = data[os.write(WRITE_FD, data) :]


def _idle() -> None:
    """The game is over for this child: wait for the referee to kill it."""
    while True:
        _read()


def _reporter():
    """A function that reports a violation and ends the process: never an exception the strategy could catch, and
    bound to what it uses, so rewriting this module's names does not disarm it."""
    pack, write, exit_now, encode, cap, length = struct.pack, os.write, os._exit, str.encode, MAX_REPLY_BYTES - 1, len

    def violation(what: str):
        payload = b"V" + encode(what, "utf-8", "replace")[:cap]
        write(WRITE_FD, pack("!H", length(payload)) + payload)
        exit_now(0)

    return violation


_violation = _reporter()


def _type_name(value) -> str:
    try:
        return type(value).__name__ if type(type(value).__name__) is str else "an object"
    except BaseException:
        return "an object"


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
        text = text if type(text) is str else ""
    except BaseException:
        text = ""
    name = _type_name(exc)
    return f"{name}: {text}" if text else name


# --- the user and the seccomp allowlist ------------------------------------------------------------------------

# Users for children when we are root: far above any account or subordinate-id range a machine hands out, one
# per child (by pid), so no child shares a user with anything, not even with another game.
_CHILD_UID_BASE, _CHILD_UID_SPAN = 0x7FF00000, 1 << 20
_NOBODY = 65534  # the fallback where only a small id range exists (a rootless container's user namespace)


def drop_to_own_user() -> None:
    """Become an unprivileged user of our own, no groups: every capability goes with root."""
    for uid in (_CHILD_UID_BASE + os.getpid() % _CHILD_UID_SPAN, _NOBODY):
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            return
        except OSError:
            continue
    raise OSError(errno.EPERM, "cannot switch to an unprivileged user")


# The child's only system calls once it is walled in (seccomp allowlist; anything else kills it). What a running
# CPython needs to compute: memory, clocks and sleep, random bytes, its pipes, and its own end: a fatal error of
# CPython's or the C library's reports on stderr and calls abort(), which signals the process itself with SIGABRT (a
# crash, as in plain Python). Measured by tracing children through every sandbox test on x86_64; on aarch64 (a DGX
# Spark) the same list holds, each name by that architecture's number: bench/aarch64_check.py plays the tests' honest
# answers and the kernel-wall steps on an aarch64 kernel, and no call was missing. Names missing on an architecture
# (aarch64 has no `time`: its C library reads the clock with clock_gettime) are skipped. Not here, so fatal: every
# file, socket, IPC, process, scheduling, fcntl/ioctl and prctl call, and every signal but abort()'s to itself.
_ALLOWED_SYSCALLS = (
    # memory (the allocator); protections of its own pages only. mmap and madvise: argument checks below
    "brk", "munmap", "mremap", "mprotect",
    # yielding the CPU; futex and the clock calls: argument checks below
    "sched_yield", "gettimeofday", "time", "nanosleep",
    # random bytes for random.Random() and random.SystemRandom
    "getrandom",
    # its own identity and signal mask, returning from a signal, ending
    "getpid", "gettid", "rt_sigprocmask", "rt_sigreturn", "restart_syscall", "exit", "exit_group",
    # closing its own descriptors (it holds only its two pipes and /dev/null)
    "close",
)  # fmt: skip
_FUTEX_PRIVATE_FLAG, _PRIVATE_FUTEX_OPS = 128, (0, 1, 9, 10)  # WAIT, WAKE, WAIT_BITSET, WAKE_BITSET
_OWN_PID = 0x7EADBEEF  # stands for the child's own pid in the filter: SeccompProgram.load writes it in
_MAP_HUGETLB, _MAP_LOCKED = 0x40000, 0x2000  # these and the values below: Linux's generic ones, x86_64's and aarch64's
_MADVICE = (0, 1, 2, 3, 4, 8, 14, 15)  # NORMAL, RANDOM, SEQUENTIAL, WILLNEED, DONTNEED, FREE, (NO)HUGEPAGE


def build_seccomp(default_action: str = "KILL_PROCESS"):
    """The child's filter, built once in the server: (filter, "") or (None, why not). `default_action` is what a call
    outside the allowlist gets (bench/bench_sandbox.py measures the others pyseccomp offers)."""
    try:
        import pyseccomp as sc
    except Exception as exc:  # no pyseccomp, or no libseccomp.so (pyseccomp raises RuntimeError)
        return None, f"{type(exc).__name__}: {exc}"
    try:
        default = sc.ERRNO(errno.EPERM) if default_action == "ERRNO" else getattr(sc, default_action)
        filt = sc.SyscallFilter(default)
        filt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)  # i386 `int 0x80` and x32 calls: no way round

        def allow(name, *args):
            number = sc.resolve_syscall(sc.Arch.NATIVE, name)
            if number >= 0:  # not every call exists on every architecture
                filt.add_rule(sc.ALLOW, number, *args)

        for name in _ALLOWED_SYSCALLS:
            allow(name)
        allow("read", sc.Arg(0, sc.EQ, READ_FD))
        for fd in (1, 2, WRITE_FD):  # print() goes to stdout, the C library's fatal-error report (writev) to stderr
            for name in ("write", "writev"):
                allow(name, sc.Arg(0, sc.EQ, fd))
        # abort()'s signal to the process itself (tgkill(getpid(), gettid(), SIGABRT)): CPython's Py_FatalError and the
        # C library's fatal errors end so, a crash. Any other signal, to anyone, kills the child with SIGSYS.
        allow("tgkill", sc.Arg(0, sc.EQ, _OWN_PID), sc.Arg(2, sc.EQ, signal.SIGABRT))
        # Clocks by what they reach. An id >= 0 names a clock of the machine (realtime, monotonic, its own CPU time,
        # a newer kernel's auxiliary clocks, ...) or nothing (EINVAL, as in plain Python); -8..-1 name the process
        # itself (pid 0). Any other negative id is another process's or thread's CPU clock, readable and waitable
        # without a permission check (a pid oracle, a watch on the trainer, a channel between games): cheating.
        for name in ("clock_gettime", "clock_getres", "clock_nanosleep"):
            allow(name, sc.Arg(0, sc.MASKED_EQ, 0x80000000, 0))
            allow(name, sc.Arg(0, sc.MASKED_EQ, 0xFFFFFFF8, 0xFFFFFFF8))
        # Futexes private to its own memory only: a shared futex (keyed by a file's page) reaches other processes.
        for op in _PRIVATE_FUTEX_OPS:
            allow("futex", sc.Arg(1, sc.MASKED_EQ, 0xFF, op | _FUTEX_PRIVATE_FLAG))
        allow("mmap", sc.Arg(3, sc.MASKED_EQ, _MAP_HUGETLB | _MAP_LOCKED, 0))  # no huge-page pool, no pinned pages
        for advice in _MADVICE:  # what allocators use; not MADV_MERGEABLE (KSM: a side channel between processes)
            allow("madvise", sc.Arg(2, sc.EQ, advice))
        with tempfile.TemporaryFile() as f:  # compiled to BPF once here, not by libseccomp in every child
            filt.export_bpf(f)
            f.seek(0)
            program = f.read()
        if not program or len(program) % 8:
            raise ValueError(f"unexpected BPF program of {len(program)} bytes")
        # Where the filter compares with _OWN_PID: the constant (k) of exactly one instruction (code, jt, jf, k).
        pid_at = [i + 4 for i in range(0, len(program), 8) if struct.unpack_from("=I", program, i + 4)[0] == _OWN_PID]
        if len(pid_at) != 1:
            raise ValueError(f"the own-pid placeholder is in {len(pid_at)} instructions, not 1")
    except Exception as exc:
        return None, f"seccomp filter could not be built: {type(exc).__name__}: {exc}"
    return SeccompProgram(program, pid_at[0]), ""


class SeccompProgram:
    """A compiled filter, installed with two prctl calls (so children never run libseccomp). Each child writes its own
    pid into its copy before it installs it (the pages are its own after the fork)."""

    class _Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    def __init__(self, program: bytes, pid_at: int):
        self.buffer = ctypes.create_string_buffer(program, len(program))
        self.fprog = self._Fprog(len(program) // 8, ctypes.addressof(self.buffer))
        self.pid_at = pid_at

    def load(self) -> None:
        struct.pack_into("=I", self.buffer, self.pid_at, os.getpid())
        prctl(_PR_SET_NO_NEW_PRIVS, 1)
        if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(self.fprog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "seccomp filter could not be installed")


# --- what the strategy gets: builtins and module copies, built once in the server ----------------------------------

_PROXIES: dict[str, types.ModuleType] = {}
_SAFE_BUILTINS: dict = {}
# Modules that CPython or the allowed modules import on first use, loaded by the server so that honest code finds them:
# _strptime (time.strptime), unicodedata (a non-ASCII name, "\\N{...}", the namereplace error handler), warnings (a
# coroutine never awaited), copyreg (copy of an object), _pylong (3.12+: arithmetic and str() of huge ints),
# _pydecimal (3.13: a Decimal format libmpdec lacks, "z.2f"), _sha2 (3.13: random.seed of a str or bytes). One this
# Python lacks is skipped. Whatever is missing here is a ModuleNotFoundError in the child, never a system call.
_LAZY_IMPORTS = ("_strptime", "unicodedata", "warnings", "copyreg", "_pylong", "_pydecimal", "_sha2")
# Pure-Python helpers that the allowed modules run their work in (dataclasses reads signatures with inspect, str.encode
# searches its codec in encodings): events raised in their code are the library's, like those raised in the allowed
# modules' own files.
_LIBRARY_HELPERS = ("_collections_abc", "_strptime", "copyreg", "inspect", "keyword", "reprlib", "types", "weakref",
                    "_weakrefset", "calendar", "locale", "datetime", "codecs", "encodings", "warnings", "_pylong",
                    "_pydecimal", "contextvars")  # fmt: skip
# Modules imported for tests that run code already out of Python (`_unrestricted`), so that it meets the kernel's
# walls rather than a failing import. In every child's sys.modules, reachable only by a way out of Python, and of
# no use there without system calls outside the allowlist.
_TEST_MODULES = ("ctypes", "fcntl", "gc", "os", "pathlib", "resource", "signal", "socket", "subprocess", "threading")
_library_files: frozenset = frozenset()


def prepare_runtime() -> None:
    """Once, in the server: import what children use and warm up what CPython does lazily, so that honest code never
    makes a system call outside the allowlist; build the module copies and the builtins a strategy gets."""
    global _library_files
    for name in sorted(policy.MODULES) + list(_LAZY_IMPORTS + _LIBRARY_HELPERS + _TEST_MODULES):
        try:
            importlib.import_module(name)
        except ImportError:  # _pylong before 3.12, _sha2 before 3.12
            pass
    for codec in pkgutil.iter_modules(encodings.__path__):  # str.encode("utf-16") imports its codec on first use
        try:
            importlib.import_module(f"encodings.{codec.name}")
        except ImportError:  # mbcs, oem: Windows only
            pass
    b"\\N{BULLET}".decode("unicode_escape")  # unicodedata's name table: C code fetches it once, through an import
    os.environ["TZ"] = TIME_ZONE
    time.tzset()  # reads the zone now, before children lose the right to open files
    time.strptime("2026", "%Y")  # _strptime's first call calls tzset and builds its caches
    library = [m for n, m in list(sys.modules.items()) if n in policy.MODULES or n in _LIBRARY_HELPERS
               or n.partition(".")[0] in ("collections", "re", "encodings")]  # fmt: skip  (packages: submodules too)
    _library_files = frozenset(f for m in library if (f := getattr(m, "__file__", None)) and f.endswith(".py"))
    for name in policy.MODULES:
        _PROXIES[name] = types.ModuleType(name, getattr(sys.modules[name], "__doc__", None))
    for name, proxy in _PROXIES.items():  # every name policy.served says, other allowed modules as their copies
        real = sys.modules[name]
        for attr in policy.SYS_NAMES if name == "sys" else policy.public_names(name):
            if hasattr(real, attr) and policy.served(name, attr):
                value = getattr(real, attr)
                setattr(proxy, attr, _PROXIES[value.__name__] if isinstance(value, types.ModuleType) else value)
        if hasattr(real, "__all__"):  # what `from name import *` binds (policy.star_names), as in plain Python
            proxy.__all__ = list(policy.star_names(name))
    _SAFE_BUILTINS.update({n: getattr(builtins, n) for n in policy.ALLOWED_BUILTINS})
    _SAFE_BUILTINS.update(
        __import__=_restricted_import,  # what `import` statements call; not a name the code may use
        __build_class__=builtins.__build_class__,  # what `class` statements call
    )


def _restricted_import(name, globals=None, locals=None, fromlist=(), level=0, *, _loaded=sys.modules):
    """What the strategy's `import` statements call, and also CPython's own C code when it imports a helper on first
    use while the strategy's code runs (PyImport_Import takes `__import__` from the running frame). The two differ by
    `fromlist`: a statement passes None or a tuple, C code a list, and then reads the module from sys.modules itself.
    So a list is never a violation: None when the server loaded the module, else ModuleNotFoundError (no system call:
    an honest error), and the strategy, calling this with a list, gets nothing."""
    if type(fromlist) is list:
        if name in _loaded:
            return None
        raise ModuleNotFoundError(f"No module named {name!r}")
    if level:
        _violation("a relative import")
    name = str.__str__(name) if isinstance(name, str) else name
    if name not in _PROXIES:
        _violation(f"import of {name!r}")
    return _PROXIES[name] if fromlist else _PROXIES[name.partition(".")[0]]


def _load_strategy(code: str, unrestricted):
    """Compile and run the code with the allowed builtins and module copies; return `strategy`. (The trainer's side of
    the sandbox has judged the code already: sandbox.play_many.)

    The compile happens here, in the walled child, under the load deadline and the memory limit. Test switches:
    `unrestricted=True` gives the code every builtin and module and no audit hook (the kernel's walls alone),
    "audited" keeps the audit hook (code that is already out of Python, against the hook alone).
    """
    hook, watch = _audit_hook(_library_files)
    sys.addaudithook(hook)  # before the compile: a syntax error's report would open the file named <strategy>
    compiled = compile(code, "<strategy>", "exec", dont_inherit=True)
    # A real module, as an import would make: dataclasses and friends look their class's module up.
    module = types.ModuleType("strategy")
    module.__builtins__ = builtins if unrestricted else dict(_SAFE_BUILTINS)
    sys.modules["strategy"] = module
    watch(compiled, unrestricted is not True)
    exec(compiled, module.__dict__)
    strategy = module.__dict__.get("strategy")
    if not callable(strategy):
        raise NameError("the code defines no callable named `strategy`")
    return strategy


# --- the audit hook --------------------------------------------------------------------------------------------

# Events that ordinary strategies cause and that reach nothing: id(), array.array(), time.sleep(), compile (a string
# annotation such as List["Board"] is compiled to check it; running a code object is what is audited), an exception
# raised in __del__ (handed to our sys.unraisablehook, which ignores it) and Python 3.12's sys._getframemodulename.
_HARMLESS_EVENTS = frozenset(
    {"builtins.id", "array.__new__", "time.sleep", "compile", "sys.unraisablehook", "sys._getframemodulename"}
)


def _audit_hook(library_files: frozenset):
    """The hook for one child, installed before the strategy compiles, and `watch(code, on)`, called before its module
    runs: with on=False the hook stays out of the way (the `_unrestricted` test switch).

    Whoever compiles (the child loading the strategy, typing evaluating a string annotation, dataclasses making an
    __init__), a compiler-stage error makes CPython's C code open the file the code claims to come from, to quote the
    line (an `open` event with no flags: Python's own opens always pass some). The hook refuses that open with the
    error of a missing file, in every phase and whatever the frame: the error then comes without its line, as plain
    Python's does for code compiled from a string, where the system call would have killed the child. Once watching,
    every event is a violation but the harmless ones, the one exec of the strategy's own module, setting an allowed
    attribute on a class (CPython audits every attribute set on a type), and events raised in the allowed modules' own
    code (the innermost Python frame is in one of `library_files`). An import of a module not loaded yet is the
    library's in any code of the standard library: there it is a lazy import of CPython's or the library's, and it
    can load no file (_no_imports_from_disk). Everything it uses is bound here, so a strategy that replaced a builtin
    or a module attribute changes nothing.
    """
    harmless, getframe, report, length, str_type, type_of = _HARMLESS_EVENTS, sys._getframe, _violation, len, str, type
    introspection, safe_dunders = policy.INTROSPECTION_ATTRIBUTES, policy.SAFE_DUNDERS
    starts, ends, contains = str.startswith, str.endswith, str.__contains__
    stdlib, packages = (os.path.dirname(inspect.__file__) + os.sep, "<frozen "), "-packages" + os.sep
    state = {"phase": "compiling", "module": None}
    busy = [False]  # the hook's own look at its caller raises events too

    def allowed_name(name) -> bool:  # policy.attribute_allowed, bound
        dunder = length(name) > 4 and starts(name, "__") and ends(name, "__")
        return name not in introspection and (not dunder or name in safe_dunders)

    def hook(event, args):
        if event == "open" and length(args) > 2 and args[2] == 0:  # the compiler's error report: it goes on without
            raise OSError(errno.ENOENT, "no files in the sandbox")
        if state["phase"] != "watching":
            return
        if event in harmless or busy[0]:
            return
        if event == "exec" and args and args[0] is state["module"]:
            state["module"] = None  # once
            return
        setting = event in ("object.__setattr__", "object.__delattr__") and length(args) > 1
        if setting and type_of(args[1]) is str_type and allowed_name(args[1]):
            return
        busy[0] = True
        try:
            file = getframe(1).f_code.co_filename
            library = file in library_files or (
                event == "import" and starts(file, stdlib) and not contains(file, packages)
            )
        except BaseException:
            library = False
        busy[0] = False
        if not library:
            name = args[1] if starts(event, "object.") and length(args) > 1 else ""
            report("run-time event " + event + (" " + name if type_of(name) is str_type and name else ""))

    def watch(module_code, on: bool) -> None:
        state["module"], state["phase"] = module_code, "watching" if on else "off"

    return hook, watch
