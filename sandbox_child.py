"""The untrusted side of a game: the child process that holds one strategy, and the walls it is put behind.

The referee (sandbox_server.py) forks the child before it knows its job. In order, the child takes a session of its
own, keeps only its two pipes, sets its rlimits and the OOM killer's first place, leaves root when we are root, and
installs the seccomp allowlist. Then it receives the code and loads it: parse and judge it (policy.py), compile it
(here, under the load deadline and the memory limit: never in the trainer, where a pathological pattern match takes
seconds and gigabytes), install the audit hook, and run the module with the allowed builtins and module copies. From
then on it answers one key per board until the referee kills it.

The audit hook is the runtime half of policy.py's contract. CPython raises an audit event for every way back to real
eval, exec and compile, to imports, files, sockets and processes, to frames and code objects; the hook reports the
first one the strategy causes as a violation (a "V" reply: scored as cheating) and ends the process, so a route out of
Python that the static judge missed scores like the judge's own refusal. It cannot be removed from Python, and it
looks up nothing at run time that the strategy could replace. The code generators a strategy may use (dataclasses,
namedtuple) compile too; the hook lets them when the text they compile can only hold names it has checked.
"""

from __future__ import annotations

import ast
import builtins
import collections
import ctypes
import dataclasses
import enum
import errno
import fcntl
import functools
import importlib
import inspect
import json
import keyword
import os
import resource
import signal
import struct
import sys
import tempfile
import time
import types
import typing

import policy

MAX_KEY_CHARS = 64  # a longer return value is "invalid" before it crosses the pipe
MAX_REPLY_BYTES = 1024  # the referee reads no more than this per reply
READ_FD, WRITE_FD = 3, 4  # the pipes from and to the referee, where child_main puts them

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG, _PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS = 1, 22, 38
_SECCOMP_MODE_FILTER = 2


def prctl(option: int, value: int) -> None:
    if _libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


# Test-only (_unrestricted): modules the attack tests need, imported before seccomp forbids opening files.
_UNRESTRICTED_PREIMPORTS = (
    "ctypes", "fcntl", "gc", "os", "pathlib", "resource", "signal", "socket", "subprocess", "threading",
)  # fmt: skip


def child_main(rfd: int, wfd: int, *, devnull: int, drop_root: bool, seccomp) -> None:
    """Jail this process, load the code, then answer one key per board until killed. Never returns."""
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
    load = json.loads(_read())  # a spare waits here
    os.chdir(load["workdir"])
    mem = load["memory_limit_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (load["cpu_seconds"], load["cpu_seconds"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))  # no pinned memory, whatever `--ulimit memlock` allowed
    _first_for_the_oom_killer()
    if load["unrestricted"]:
        for name in _UNRESTRICTED_PREIMPORTS:
            importlib.import_module(name)
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
    """A function that reports a violation of policy.py's contract and ends the process: never an exception the
    strategy could catch, and bound to what it uses, so rewriting this module's names does not disarm it."""
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


# The child's only system calls once it is jailed (seccomp allowlist; anything else fails with EPERM). What a
# running CPython needs to compute: memory, clocks and sleep, random bytes, and its pipes. Measured by tracing
# children through every sandbox test; names missing on an architecture (aarch64 has no `time`) are skipped.
# Not here, so refused: every file, socket, IPC, process, signal, scheduling, fcntl/ioctl and prctl call.
_ALLOWED_SYSCALLS = (
    # memory (the allocator); protections of its own pages only. mmap and madvise: argument checks below
    "brk", "munmap", "mremap", "mprotect",
    # yielding the CPU; futex and the clock calls: argument checks below
    "sched_yield", "gettimeofday", "time", "nanosleep",
    # random bytes for random.Random()
    "getrandom",
    # its own identity and signal mask, returning from a signal, ending
    "getpid", "gettid", "rt_sigprocmask", "rt_sigreturn", "restart_syscall", "exit", "exit_group",
    # closing its own descriptors (it holds only its two pipes and /dev/null)
    "close",
)  # fmt: skip
_FUTEX_PRIVATE_FLAG, _PRIVATE_FUTEX_OPS = 128, (0, 1, 9, 10)  # WAIT, WAKE, WAIT_BITSET, WAKE_BITSET
_MAP_HUGETLB, _MAP_LOCKED = 0x40000, 0x2000
_MADVICE = (0, 1, 2, 3, 4, 8, 14, 15)  # NORMAL, RANDOM, SEQUENTIAL, WILLNEED, DONTNEED, FREE, (NO)HUGEPAGE


def build_seccomp():
    """The child's filter, built once in the server: (filter, "") or (None, why not)."""
    try:
        import pyseccomp as sc
    except Exception as exc:  # no pyseccomp, or no libseccomp.so (pyseccomp raises RuntimeError)
        return None, f"{type(exc).__name__}: {exc}"
    try:
        filt = sc.SyscallFilter(sc.ERRNO(errno.EPERM))  # deny by default
        filt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)  # i386 `int 0x80` and x32 calls: no way round

        def allow(name, *args):
            number = sc.resolve_syscall(sc.Arch.NATIVE, name)
            if number >= 0:  # not every call exists on every architecture
                filt.add_rule(sc.ALLOW, number, *args)

        for name in _ALLOWED_SYSCALLS:
            allow(name)
        allow("read", sc.Arg(0, sc.EQ, READ_FD))
        for fd in (1, 2, WRITE_FD):  # print() goes to stdout, which is /dev/null
            allow("write", sc.Arg(0, sc.EQ, fd))
        # Clocks 0-15 only (realtime, monotonic, its own CPU time, ...): a negative id is another process's CPU clock,
        # readable and waitable without any permission check, a way to find pids and to signal between games.
        for name in ("clock_gettime", "clock_getres", "clock_nanosleep"):
            allow(name, sc.Arg(0, sc.MASKED_EQ, 0xFFFFFFF0, 0))
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
    except Exception as exc:
        return None, f"seccomp filter could not be built: {type(exc).__name__}: {exc}"
    return SeccompProgram(program), ""


class SeccompProgram:
    """A compiled filter, installed with two prctl calls (so children never run libseccomp)."""

    class _Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    def __init__(self, program: bytes):
        self.buffer = ctypes.create_string_buffer(program, len(program))
        self.fprog = self._Fprog(len(program) // 8, ctypes.addressof(self.buffer))

    def load(self) -> None:
        prctl(_PR_SET_NO_NEW_PRIVS, 1)
        if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(self.fprog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "seccomp filter could not be installed")


# --- what the strategy gets: builtins and module copies, with run-time checks ---------------------------------------
#
# A run-time check reports a violation and ends the process (never an exception the strategy could catch), and looks
# nothing up in a module the strategy could reach and rewrite: `_checks` binds what they use once, in the server.


def _checks(report, attribute_allowed, attribute_hooks, is_private, library_private, field_name_allowed):
    """The checked builtins and library replacements, bound to the predicates they need (closure cells)."""
    exact, split, is_str, is_type, own = str.__str__, str.split, str, type, [frozenset()]
    real_getattr, real_setattr, real_hasattr, real_delattr = getattr, setattr, hasattr, delattr
    default_assigned, default_updated = tuple(functools.WRAPPER_ASSIGNMENTS), tuple(functools.WRAPPER_UPDATES)
    # What a class statement itself puts in the namespace a metaclass passes on to type.__new__.
    class_statement_keys = frozenset({"__module__", "__qualname__", "__classcell__", "__annotations__",
                                      "__orig_bases__", "__static_attributes__", "__firstlineno__", "__type_params__"})

    def checked_name(name, obj=None):
        if not isinstance(name, is_str):
            return name  # the builtin raises its own TypeError
        name = exact(name)  # an exact str: a subclass cannot lie to the check
        if not attribute_allowed(name):
            report(f"attribute {name!r} (a computed name)")
        if is_private(name) and name not in own[0] and name not in library_private:
            report(f"private attribute {name!r} of a library object (a computed name)")
        return name

    def safe_getattr(obj, name, *default):
        return real_getattr(obj, checked_name(name), *default)

    def safe_hasattr(obj, name):
        return real_hasattr(obj, checked_name(name))

    def safe_setattr(obj, name, value):
        real_setattr(obj, checked_name(name), value)

    def safe_delattr(obj, name):
        real_delattr(obj, checked_name(name))

    def safe_attrgetter(*names):
        """operator.attrgetter with every dotted part checked; a plain function, so its type leads nowhere."""
        paths = []
        for name in names:
            if not isinstance(name, is_str):
                raise TypeError("attribute name must be a string")
            paths.append([checked_name(part) for part in split(exact(name), ".")])

        def get(obj):
            values = []
            for path in paths:
                value = obj
                for part in path:
                    value = real_getattr(value, part)
                values.append(value)
            return values[0] if len(values) == 1 else tuple(values)

        return get

    def safe_methodcaller(name, /, *args, **kwargs):
        name = checked_name(name)

        def call(obj):
            return real_getattr(obj, name)(*args, **kwargs)

        return call

    def safe_update_wrapper(wrapper, wrapped, assigned=default_assigned, updated=default_updated):
        """functools.update_wrapper copies the attributes it is told to: only the standard ones here."""
        if tuple(assigned) != default_assigned or tuple(updated) != default_updated:
            report("functools.update_wrapper or wraps with attribute names of its own")
        return functools.update_wrapper(wrapper, wrapped)

    def safe_wraps(wrapped, assigned=default_assigned, updated=default_updated):
        return functools.partial(safe_update_wrapper, wrapped=wrapped, assigned=assigned, updated=updated)

    class safe_cached_property(functools.cached_property):
        """functools.cached_property reads `instance.__dict__[attrname]`: of an instance, under a checked name."""

        def __get__(self, instance, owner=None):
            if instance is None:
                return self
            if isinstance(instance, is_type):
                report("cached_property read through a class")
            checked_name(self.attrname)
            return functools.cached_property.__get__(self, instance, owner)

    def safe_dataclass(cls=None, /, **kwargs):
        """dataclasses.dataclass writes its methods as source text from field names: they are checked first (and
        again, at run time, by the audit hook)."""

        def wrap(cls):
            annotations = is_type.__dict__["__dict__"].__get__(cls).get("__annotations__", {})
            if not isinstance(annotations, dict) or not all(field_name_allowed(n) for n in annotations):
                report("a dataclass field name that is not a plain identifier")
            return dataclasses.dataclass(**kwargs)(cls)

        return wrap if cls is None else wrap(cls)

    def overload(func):
        """typing.overload without reading the function's code (as 3.11's does): the registry is not served."""
        return typing._overload_dummy

    class checked_type(type, metaclass=_TypeOfType):
        """`type`: one argument is the real type(x); three make a class, whose namespace keys are checked as a class
        statement's are (a dict key is a string the judge cannot see: `__reduce_ex__`, `__match_args__`, ...)."""

        def __new__(mcs, *args, **kwargs):
            if len(args) == 1 and not kwargs and mcs is checked_type:
                return is_type(args[0])
            if len(args) == 3 and isinstance(args[2], dict):
                for key in args[2]:
                    if is_type(key) is not is_str or not (
                        attribute_allowed(key) or key in attribute_hooks or key in class_statement_keys
                    ):
                        report("type() with a namespace key that is not a plain allowed name")
            if mcs is checked_type:
                return is_type(*args, **kwargs)  # an ordinary class, as type() makes
            return is_type.__new__(mcs, *args, **kwargs)

    def set_own_private_names(names):
        own[0] = names

    return {
        "getattr": safe_getattr, "hasattr": safe_hasattr, "setattr": safe_setattr, "delattr": safe_delattr,
        "type": checked_type, "attrgetter": safe_attrgetter, "methodcaller": safe_methodcaller,
        "update_wrapper": safe_update_wrapper, "wraps": safe_wraps, "cached_property": safe_cached_property,
        "dataclass": safe_dataclass, "overload": overload, "set_own_private_names": set_own_private_names,
    }  # fmt: skip


class _TypeOfType(type):
    """The checked `type` answers isinstance(x, type) and issubclass(c, type) as the real one does."""

    def __instancecheck__(cls, obj):
        return isinstance(obj, type)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, type)


def _restricted_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level:
        _violation("a relative import")
    name = str.__str__(name) if isinstance(name, str) else name
    if name in _LAZY_IMPORTS and not fromlist:  # an allowed function importing its helper (the code cannot: policy.py)
        return sys.modules[name]
    if name not in _PROXIES:
        _violation(f"import of {name!r}")
    return _PROXIES[name] if fromlist else _PROXIES[name.partition(".")[0]]


_PROXIES: dict[str, types.ModuleType] = {}
_SAFE_BUILTINS: dict = {}
_CHECKS: dict = {}
# Library names served as checked versions (_checks): each hands out an unchecked getattr or setattr, or code.
_REPLACED = {
    ("operator", "attrgetter"), ("operator", "methodcaller"), ("functools", "update_wrapper"), ("functools", "wraps"),
    ("functools", "cached_property"), ("dataclasses", "dataclass"), ("typing", "overload"),
}  # fmt: skip
# Imported lazily by allowed functions (time.strptime): imported now, in the server, so no import happens in a child.
_LAZY_IMPORTS = ("_strptime",)


def prepare_runtime() -> None:
    """Import the allowed modules and build what children start from, once, in the server: a copy of each allowed
    module holding only the names policy.MODULES lists, and the allowed builtins with getattr & co. checked."""
    for name in sorted(policy.MODULES) + list(_LAZY_IMPORTS):
        importlib.import_module(name)
    time.localtime()  # the C library reads the time zone now, before children lose the right to open it
    # Enum's private helper that reads any module's namespace and writes members back into it: no strategy needs it.
    for helper in ("_convert_",):
        if helper in vars(enum.EnumType):
            delattr(enum.EnumType, helper)
    _CHECKS.update(_checks(_violation, policy.attribute_allowed, policy.ATTRIBUTE_HOOKS, policy.is_private,
                           policy.LIBRARY_PRIVATE_NAMES, policy.field_name_allowed))  # fmt: skip
    for name, names in policy.MODULES.items():
        real = sys.modules[name]
        proxy = types.ModuleType(name, getattr(real, "__doc__", None))
        wanted = [n for n in dir(real) if not n.startswith("_")] if names is policy.EVERYTHING else sorted(names)
        for attr in wanted:
            if not hasattr(real, attr):
                continue  # not in this Python's version of the module
            value = _CHECKS[attr] if (name, attr) in _REPLACED else getattr(real, attr)
            if not isinstance(value, types.ModuleType):  # a module attribute is a way out (random._os)
                setattr(proxy, attr, value)
        _PROXIES[name] = proxy
    _PROXIES["collections"].abc = _PROXIES["collections.abc"]
    _SAFE_BUILTINS.update({n: getattr(builtins, n) for n in policy.ALLOWED_BUILTINS})
    _SAFE_BUILTINS.update({n: _CHECKS[n] for n in ("getattr", "hasattr", "setattr", "delattr", "type")})
    _SAFE_BUILTINS.update(
        __import__=_restricted_import,  # what `import` statements call; not a name the code may use
        __build_class__=builtins.__build_class__,  # what `class` statements call
    )


def _load_strategy(code: str, unrestricted):
    """Judge, compile and run the code under policy.py's rules (the same the rewards judge by); return `strategy`.

    The compile happens here, in the jailed child, under the load deadline and the memory limit. Test switches:
    `unrestricted=True` drops every Python-level check (the OS walls alone), "audited" keeps only the audit hook
    (code that is already out of Python, against the hook alone).
    """
    tree = ast.parse(code, "<strategy>")
    if not unrestricted:
        found, _ = policy.problems(tree)
        if found:
            _violation(found[0])
        _CHECKS["set_own_private_names"](policy.own_private_names(tree))
    compiled = compile(tree, "<strategy>", "exec", dont_inherit=True)  # the judge's flags, not ours
    del tree
    # A real module, as an import would make: dataclasses and friends look their class's module up.
    module = types.ModuleType("strategy")
    module.__builtins__ = builtins if unrestricted else dict(_SAFE_BUILTINS)
    sys.modules["strategy"] = module
    if unrestricted is not True:
        sys.addaudithook(_audit_hook(compiled))
    exec(compiled, module.__dict__)
    strategy = module.__dict__.get("strategy")
    if not callable(strategy):
        raise NameError("the code defines no callable named `strategy`")
    return strategy


# --- the audit hook --------------------------------------------------------------------------------------------

# Events that ordinary strategies cause and that reach nothing: id(), array.array(), time.sleep(), compile (a string
# annotation such as List["Board"] is compiled to check it; running a code object is what is audited: exec,
# function.__new__, code.__new__), and Python 3.12's sys._getframemodulename (namedtuple, TypeVar and Enum ask for
# their caller's module name: a string).
_HARMLESS_EVENTS = frozenset({"builtins.id", "array.__new__", "time.sleep", "compile", "sys._getframemodulename"})
# Events the allowed code generators cause while they build a class, and a frame look-up that typing, collections and
# enum make to learn their caller's module name (TypeVar, namedtuple, Enum's functional API).
_GENERATOR_EVENTS = frozenset({"exec", "object.__setattr__", "object.__getattr__", "sys._getframe"})


def _audit_hook(strategy_code):
    """The hook for one child, made after the strategy compiled and before its module runs.

    Everything it uses is bound here, as closure cells and constants: no global or builtin is looked up when an event
    arrives, so a strategy that replaced one (a module attribute, a builtin) changes nothing, and it never runs the
    strategy's code (it reads only exact-str keys of the namespaces it inspects). The exec of the strategy's own
    compiled module is allowed once; generated code is allowed from namedtuple (it turns every name into an exact,
    checked str itself) and from dataclasses while our checked `dataclass` processes the class whose fields it checked,
    when every name in the code is one of those fields or dataclasses' own; frames only to the stdlib functions that
    read their caller's module name.
    """
    namedtuple_codes = frozenset(
        f.__code__
        for f in (collections.namedtuple, getattr(typing, "_make_nmtuple", None), typing.NamedTupleMeta.__new__)
        if isinstance(f, types.FunctionType)
    )
    frame_readers = frozenset(
        f.__code__
        for f in (collections.namedtuple, getattr(typing, "_caller", None), vars(enum.EnumType).get("_create_"))
        if isinstance(f, types.FunctionType)
    )
    constants = _CHECKS["dataclass"].__code__.co_consts  # the inner `wrap` is a constant of the wrapper's code
    wrapper_code = next(c for c in constants if isinstance(c, types.CodeType) and c.co_name == "wrap")
    generator_files = frozenset({dataclasses.__file__, inspect.__file__})
    dataclasses_file, field_type, code_type = dataclasses.__file__, dataclasses.Field, types.CodeType
    fields_of = type.__dict__["__dict__"].__get__  # a class's own namespace, whatever its metaclass says
    field_name = dataclasses.Field.__dict__["name"].__get__  # the slot, not a subclass's property
    safe_dunders, introspection = policy.SAFE_DUNDERS, policy.INTROSPECTION_ATTRIBUTES
    hooks = policy.ATTRIBUTE_HOOKS
    forbidden_builtins = frozenset(dir(builtins)) - policy.ALLOWED_BUILTINS
    harmless, generator_events = _HARMLESS_EVENTS, _GENERATOR_EVENTS
    getframe, str_type, type_of, dict_type = sys._getframe, str, type, dict
    is_identifier, is_keyword = str.isidentifier, keyword.iskeyword
    starts, ends = str.startswith, str.endswith
    report, length = _violation, len  # _violation binds what it uses too (_reporter)
    base_exception = BaseException
    module_ran = [False]  # the one exec of the strategy's module
    busy = [False]  # the hook's own frame walk raises events too (sys._getframe, frame.f_code)

    def own_read(event, args) -> bool:
        return event == "object.__getattr__" and length(args) > 1 and args[1] == "f_code"

    def allowed_name(name) -> bool:
        if type_of(name) is not str_type or name in introspection:
            return False
        return not (length(name) > 4 and starts(name, "__") and ends(name, "__")) or name in safe_dunders

    def exact_keys(mapping) -> bool:
        """Every key an exact str: looking one up then runs no __eq__ or __hash__ of the strategy's."""
        for key in mapping:
            if type_of(key) is not str_type:
                return False
        return True

    def checked_fields(cls):
        """The names dataclasses has collected for `cls` (what its generated source is written from), when they are
        Field objects with plain identifier names; else None."""
        namespace = fields_of(cls)
        if not exact_keys(namespace):
            return None
        fields = namespace.get("__dataclass_fields__", {})
        annotations = namespace.get("__annotations__", {})
        if type_of(fields) is not dict_type or type_of(annotations) is not dict_type or not exact_keys(annotations):
            return None
        names = []
        for key in fields:
            f = fields[key]
            name = field_name(f) if type_of(f) is field_type and type_of(key) is str_type else None
            if name is not key or not allowed_name(name) or not is_identifier(name) or is_keyword(name):
                return None
            names.append(name)
        for name in annotations:
            if not allowed_name(name) or not is_identifier(name) or is_keyword(name):
                return None
        return frozenset(names)

    def generated_by_dataclasses(code, fields) -> bool:
        """Every name the code uses is a checked field, dataclasses' own (__dataclass_*, _type_*, ...), or an
        ordinary allowed name; never a builtin the contract refuses."""
        pending = [code]
        while pending:
            c = pending.pop()
            for group in (c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars):
                for name in group:
                    if name in fields or starts(name, "__dataclass_") or name == "__create_fn__":
                        continue
                    if name in forbidden_builtins or not (allowed_name(name) or name in hooks):
                        return False
            for const in c.co_consts:
                if type_of(const) is code_type:
                    pending.append(const)
        return True

    def generated(event, args, caller) -> bool:
        """Whether an event comes from an allowed code generator working on a checked class, or is a frame look-up
        of a stdlib function that reads its caller's module name and hands out no frame."""
        if event == "sys._getframe":
            return caller.f_code in frame_readers
        if caller.f_code in namedtuple_codes:
            return True
        if caller.f_code.co_filename not in generator_files:
            return False
        processing, f = None, caller
        while f is not None:
            code = f.f_code
            if processing is None and code.co_name == "_process_class" and code.co_filename == dataclasses_file:
                processing = f.f_locals.get("cls")
            elif code is wrapper_code:
                if processing is None or f.f_locals.get("cls") is not processing:
                    return False
                fields = checked_fields(processing)
                if fields is None:
                    return False
                if event == "exec":
                    return type_of(args[0]) is code_type and generated_by_dataclasses(args[0], fields)
                return True
            f = f.f_back
        return False

    def hook(event, args):
        if event in harmless or (busy[0] and (event == "sys._getframe" or own_read(event, args))):
            return  # the events of the hook's own frame walk, and only those
        if event == "exec" and args and args[0] is strategy_code and not module_ran[0]:
            module_ran[0] = True
            return
        if event in ("object.__setattr__", "object.__delattr__") and length(args) > 1 and allowed_name(args[1]):
            return
        if event in generator_events:
            was, busy[0] = busy[0], True
            try:
                ok = generated(event, args, getframe(1))
            except base_exception:
                ok = False
            busy[0] = was
            if ok:
                return
        detail = ""
        if starts(event, "object.") and length(args) > 1 and type_of(args[1]) is str_type:
            detail = " " + args[1]
        report("run-time event " + event + detail)

    return hook
