"""Play untrusted 2048 strategies: the game stays on the trusted side, the strategy runs behind OS-level walls.

Threat model: the strategy's code may do anything a process can do. Python-level checks (policy.py) fail
fast on the usual tricks, but they are not the boundary; the walls are the kernel's: seccomp, process
sessions, rlimits, an unprivileged user when we are root, and deadlines kept by another process.

Process tree, and why each level exists:

    trainer (your process)  ──  holds the jobs; talks to referees directly, reads their JSON results
      └─ server   a fresh `python` with an empty environment, in a session of its own, so it never holds the
         │        trainer's memory, secrets, threads or CUDA state, and no signal of a child can reach the
         │        trainer's process group; it only forks referees (a few ahead, as spares), never sees a job
         └─ referee  (one per game, trusted) forks its child *before* it reads the job, then builds
            │        the GameBoard and plays the game, one pipe round trip per move, under deadlines
            └─ child  (untrusted) holds only the strategy: a session of its own, rlimits, no fds but its two
                      pipes (and /dev/null as stdout), empty environment, another user when we are root,
                      then a seccomp allowlist: memory, clocks and sleep, random bytes, read on its
                      pipe, write on its pipe and stdout, exit. Every other system call fails.

The child never sees the seed (only `strategy_seed(seed)`), the game, its RNG or any other job.
Replies are small length-prefixed frames with a byte cap, decoded into a plain `str`; nothing from
the child is ever unpickled or eval'ed. Limits are enforced from outside: the referee SIGKILLs the
child's process group on a wall-clock deadline, kills every descendant it adopted (it is a
child-subreaper) and removes the temp dir; a game counts as done once its referee has exited, so
no process of it survives its result. See docs/SECURITY.md.
"""

from __future__ import annotations

import ast
import atexit
import builtins
import ctypes
import dataclasses
import errno
import fcntl
import gc
import importlib
import json
import math
import operator
import os
import resource
import select
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from collections import deque

import game2048
import policy

STATUSES = ("success", "failed", "capped", "timeout", "error", "invalid", "crash")
MAX_CODE_BYTES = 1 << 20
MAX_KEY_CHARS = 64  # a longer return value is "invalid" before it crosses the pipe
MAX_REPLY_BYTES = 1024  # the referee reads no more than this per reply
MAX_ERROR_CHARS = 300
MAX_SPARES = 8  # referees the server keeps forked ahead (each with its child), at most


class SandboxError(RuntimeError):
    """The sandbox itself cannot run (no server, strict mode without seccomp): not a strategy's fault."""


class SandboxViolation(Exception):
    """Code reached for something a strategy may not use (policy.py)."""


@dataclasses.dataclass(frozen=True)
class Game:
    """One game's rules and limits: everything the referee needs, carried to it as is (rewards.RewardSettings
    is one of these). The move cap ends a game that is still going after `max_moves` board-changing moves
    ("capped"); 0 means none."""

    size: int = dataclasses.field(default=3, metadata={"help": "Board size (size x size)."})
    target: int = dataclasses.field(default=512, metadata={"help": "Tile that wins a game."})
    probability_fours: float = dataclasses.field(default=0.10, metadata={"help": "Chance that a new tile is a 4."})
    keys: str = dataclasses.field(default="WASD", metadata={"help": "The four move keys: up, left, down, right."})
    max_moves: int = dataclasses.field(
        default=0, metadata={"help": "End a game after this many board-changing moves (0: no cap)."}
    )
    move_time_limit: float = dataclasses.field(default=1.0, metadata={"help": "Seconds for one move."})
    game_time_limit: float = dataclasses.field(default=10.0, metadata={"help": "Seconds for a whole game."})
    memory_limit_mb: int = dataclasses.field(default=512, metadata={"help": "Address space of a strategy (MiB)."})

    def __post_init__(self):
        game2048.GameBoard(
            seed=0, size=self.size, target=self.target, probability_fours=self.probability_fours, keys=self.keys
        )  # fmt: skip  (raises ValueError on a bad board)
        for name in ("move_time_limit", "game_time_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value < math.inf):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if isinstance(self.max_moves, bool) or not isinstance(self.max_moves, int) or self.max_moves < 0:
            raise ValueError(f"max_moves must be an int >= 0 (0: no cap), got {self.max_moves!r}")
        mem = self.memory_limit_mb
        if isinstance(mem, bool) or not isinstance(mem, int) or mem < 64:
            raise ValueError(f"memory_limit_mb must be an int >= 64, got {mem!r}")

    def rules(self) -> dict:
        """This game's own fields (also of a subclass such as RewardSettings), as the referee receives them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Game)}


@dataclasses.dataclass(frozen=True)
class GameResult:
    """One game. Moves, score and max_tile are of the game as far as it went, also on timeout/error."""

    status: str  # success | failed | capped | timeout | error | invalid | crash
    moves: int = 0  # moves that changed the board
    score: int = 0
    max_tile: int = 0
    seconds: float = 0.0
    error: str = ""  # one line: exception type and text, or which limit was hit; "" when none
    played_keys: str | None = None  # with record_keys=True: the keys played, one alphabet character each


# ---------------------------------------------------------------------------------------------------
# Public API (trainer side)
# ---------------------------------------------------------------------------------------------------

_lock = threading.RLock()
_server = None  # the running _Server, or None
_live_referees: set[int] = set()  # referee pids of games in flight, in any thread
_warned_no_seccomp = False
_test_switches: dict = {}  # the layers a test turned off; a restart after a crash keeps them


def start(*, _disable_seccomp: bool = False, _keep_root: bool = False) -> None:
    """Start the fork server now (otherwise the first play starts it). Cheap to call again.

    The server is a fresh interpreter, so it is clean whenever it starts; calling this early only
    moves its ~0.1 s start-up out of the first reward call. The switches are for tests that prove
    one layer alone: no seccomp filter, and children that keep the trainer's user when it is root.
    """
    global _test_switches
    with _lock:
        if _server is None or not _server.alive():
            _test_switches = {"seccomp": not _disable_seccomp, "drop_root": not _keep_root}
            _start_locked()


def shutdown() -> None:
    """Stop the server and everything under it, and remove its temp directory."""
    global _server, _test_switches
    with _lock:
        server, _server = _server, None
        _test_switches = {}
        if server is not None:
            server.stop()


def walls() -> dict:
    """The OS walls the children get here, starting the server if needed: {"seccomp": bool, "reason": why not,
    "drops_root": whether they change to a user of their own (only when this process is root)}. Callers that
    require seccomp check this once at start, so a missing libseccomp is one clear line, not a failed batch."""
    with _lock:
        if _server is None or not _server.alive():
            _start_locked()
        return {"seccomp": _server.seccomp, "reason": _server.seccomp_reason, "drops_root": _server.drops_root}


def play(
    code: str,
    *,
    seed: int | None,
    strict: bool = False,
    record_keys: bool = False,
    _unrestricted: bool = False,
    **rules,
) -> GameResult:
    """Play one game of the function named `strategy` defined in `code`; `rules` are Game's fields.

    Same game as `game2048.play_game(strategy, seed=seed, ...)`. Loading the code counts as a move
    (move_time_limit) and as part of the game (game_time_limit). `strict` refuses to run without
    seccomp. `record_keys` returns the keys the game played in GameResult.played_keys (each as the
    alphabet writes it), so trusted code can replay the game board by board with the engine, never
    running the strategy itself. `_unrestricted` drops the Python-level checks and gives the code every
    builtin and module, so tests can prove the OS layers alone.
    """
    options = dict(strict=strict, record_keys=record_keys, _unrestricted=_unrestricted)
    return play_many([(code, seed, Game(**rules))], workers=1, **options)[0]


def play_many(
    jobs, *, workers: int | None = None, strict: bool = False, record_keys: bool = False, _unrestricted: bool = False
) -> list[GameResult]:
    """Play `(code, seed, game)` jobs at once (`game` a Game); results in job order.

    Up to `workers` games run at a time (default: the cores this process may use).
    """
    specs = [_job(code, seed, game, record_keys, _unrestricted) for code, seed, game in jobs]  # raises now
    if not specs:
        return []
    if workers is None:
        workers = len(os.sched_getaffinity(0))
    workers = max(1, int(workers))
    with _lock:
        if _server is None or not _server.alive():
            _start_locked()
        server = _server
    if not server.seccomp:
        if strict:
            raise SandboxError(f"strict sandbox refused to run: seccomp is unavailable ({server.seccomp_reason})")
        _warn_no_seccomp(server.seccomp_reason)

    results: list[GameResult | None] = [None] * len(specs)
    queue = deque(range(len(specs)))
    active: dict[int, _Game] = {}  # socket fd -> game, until its referee has exited
    try:
        while queue or active:
            # A game frees its slot when its result arrives; its referee's clean-up overlaps the next game.
            while queue and sum(g.result is None for g in active.values()) < workers:
                i = queue.popleft()
                if isinstance(specs[i], GameResult):  # decided without a process (code too long)
                    results[i] = specs[i]
                    continue
                game = _Game(i, specs[i], spares=workers)
                active[game.sock.fileno()] = game
            if not active:
                continue
            timeout = max(0.0, min(g.deadline for g in active.values()) - time.monotonic())
            for fd, _ in _poll(active, timeout):  # poll, not select: a trainer may hold fds above 1023
                active[fd].feed()
            now = time.monotonic()
            for fd, game in list(active.items()):
                if not game.gone and now >= game.deadline:
                    game.abort("sandbox referee did not answer in time")
                if game.gone:  # no process of this game is left
                    del active[fd]
                    game.close()
                    results[game.index] = game.result
    finally:
        for game in active.values():  # an exception (KeyboardInterrupt) while games run: kill them
            game.abort("interrupted")
            game.close()
    return results


atexit.register(shutdown)


def _idle_pids() -> tuple[int, set[int]]:
    """The processes that stay between games, for tests: the server's pid and its spare referees'.

    Each spare has one child of its own, idle too. Nothing else may be left after a result."""
    with _lock:
        if _server is None or not _server.alive():
            return -1, set()
        return _server.pid, set(_server.spares())


def _job(code, seed, game, record_keys: bool, unrestricted: bool) -> dict | GameResult:
    """One job as the referee receives it, checked in the caller (a bad argument is the caller's bug: it raises)."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    if not isinstance(game, Game):
        raise TypeError(f"game must be a sandbox.Game, got {type(game).__name__}")
    if unrestricted and "pytest" not in sys.modules:
        raise SandboxError("_unrestricted is a test-only switch")
    if len(code.encode("utf-8", "surrogatepass")) > MAX_CODE_BYTES:
        return GameResult("error", error=f"code is longer than {MAX_CODE_BYTES} bytes")
    return {"code": code, "seed": seed, "game": game.rules(), "record_keys": record_keys, "unrestricted": unrestricted}


def _warn_no_seccomp(reason: str) -> None:
    global _warned_no_seccomp
    if not _warned_no_seccomp:
        _warned_no_seccomp = True
        warnings.warn(
            f"sandbox: seccomp is unavailable ({reason}); strategies run with process isolation, rlimits and "
            "the Python checks only. Install libseccomp and pyseccomp, or pass strict=True to refuse.",
            RuntimeWarning,
            stacklevel=3,
        )


# ---------------------------------------------------------------------------------------------------
# Trainer side: the server handle and one game in flight
# ---------------------------------------------------------------------------------------------------


class _Server:
    """Handle on the fork server: its process, control socket and temp root (also its marker)."""

    def __init__(self, proc, ctl, root, hello):
        self.proc, self.ctl, self.root = proc, ctl, root
        self.pid = proc.pid
        self.owner = os.getpid()  # a forked copy of the trainer must not drive or stop our server
        self.seccomp = bool(hello["seccomp"])
        self.seccomp_reason = hello.get("reason") or ""
        self.drops_root = bool(hello["drops_root"])  # children run as another user (we are root)

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def fork_referee(self, spares: int) -> tuple[socket.socket, int]:
        """Ask for a fresh referee, and for `spares` more to be kept ready; returns its socket and pid."""
        self.ctl.sendall(b"F" + bytes([max(0, min(spares, MAX_SPARES))]))
        msg, fds, _, _ = socket.recv_fds(self.ctl, 4, 1, socket.MSG_CMSG_CLOEXEC)
        if len(msg) != 4 or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise SandboxError("sandbox server did not hand over a referee")
        return socket.socket(fileno=fds[0]), struct.unpack("!i", msg)[0]

    def spares(self) -> list[int]:
        """Pids of the idle spare referees (each has one idle child): for tests."""
        self.ctl.sendall(b"P")
        return json.loads(_recv_frame(self.ctl))

    def sweep(self, live: set[int]) -> None:
        """Have the server kill every child of its own that is not a live referee (adopted orphans)."""
        body = json.dumps(sorted(live)).encode()
        self.ctl.sendall(b"S" + struct.pack("!I", len(body)) + body)
        if self.ctl.recv(1) != b"k":
            raise SandboxError("sandbox server did not answer a sweep")

    def stop(self) -> None:
        if self.owner != os.getpid():
            return
        try:
            self.ctl.close()  # the server sees EOF, kills its referees (their children die with them)
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            _kill_marked(self.root)
            shutil.rmtree(self.root, ignore_errors=True)


_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); import sandbox; sandbox._server_main(sys.argv[2:])"


def _start_locked() -> None:
    """Start a server (after clearing a dead one's leftovers); the caller holds _lock."""
    global _server
    old = _server
    _server = None
    if old is not None:  # it died: clear whatever it left
        old.stop()
    if not sys.executable:
        raise SandboxError("sandbox needs sys.executable to start its server")
    root = tempfile.mkdtemp(prefix="train2048-sandbox-")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    here = os.path.dirname(os.path.abspath(__file__))
    switches = _test_switches or {"seccomp": True, "drop_root": True}
    argv = [sys.executable, "-s", "-P", "-c", _BOOT, here, str(theirs.fileno()), root, json.dumps(switches)]
    # Optional outer jail for the whole server (e.g. bubblewrap with namespaces): see docs/SECURITY.md.
    argv = shlex.split(os.environ.get("TRAIN2048_SANDBOX_WRAP", "")) + argv
    try:
        proc = subprocess.Popen(
            argv,
            pass_fds=[theirs.fileno()],
            env={"PYTHONHASHSEED": "0"},  # nothing of ours; fixed string hashing keeps games reproducible
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            cwd=root,
            start_new_session=True,  # no signal sent to a group or session of ours can come back to the trainer
        )
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    finally:
        theirs.close()
    try:
        ours.settimeout(60)
        hello = json.loads(_recv_frame(ours))
        ours.settimeout(30)
    except BaseException as exc:
        proc.kill()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)
        raise SandboxError(f"sandbox server failed to start: {exc}") from exc
    server = _Server(proc, ours, root, hello)
    if hello["root"] and not hello["drops_root"] and switches["drop_root"]:
        server.stop()
        raise SandboxError(
            "sandbox refused to run: this process is root and its children cannot switch to an unprivileged "
            "user (setresuid failed); run as an ordinary user, or in a container that allows setuid"
        )
    _server = server


def _fork_referee(spares: int) -> tuple[socket.socket, int]:
    """A referee from a live server, restarting the server once if it has died."""
    with _lock:
        for attempt in (0, 1):
            if _server is None or not _server.alive():
                _start_locked()
            try:
                sock, pid = _server.fork_referee(spares)
                _live_referees.add(pid)
                return sock, pid
            except (OSError, SandboxError):
                if attempt:
                    raise
                _server.proc.kill()
        raise AssertionError("unreachable")


class _Game:
    """One job in flight, seen from the trainer: the referee socket and what came back."""

    def __init__(self, index: int, spec: dict, spares: int = 1):
        self.index = index
        self.result: GameResult | None = None
        self.gone = False  # the referee has exited, so its child and their descendants are dead
        self.buffer = b""
        self.sock, self.referee = _fork_referee(spares)
        try:
            self.pidfd = os.pidfd_open(self.referee)  # readable once the referee has exited
        except OSError:
            self.pidfd = None
        # Backstop only: the referee enforces the limits; this catches a referee that hangs.
        game = spec["game"]
        self.deadline = time.monotonic() + game["game_time_limit"] + game["move_time_limit"] + 10.0
        try:
            _send_frame(self.sock, json.dumps(spec).encode())
        except OSError:
            pass  # a dead referee shows as EOF in feed()

    def feed(self) -> None:
        try:
            data = self.sock.recv(65536)
        except OSError:
            data = b""
        if not data:  # the referee exited (it reports first, then cleans up, then exits)
            if self.result is None:
                self.abort("sandbox referee died")
            else:
                self.wait_gone()
                self.gone = True
            return
        self.buffer += data
        while len(self.buffer) >= 4:
            n = struct.unpack("!I", self.buffer[:4])[0]
            if len(self.buffer) < 4 + n:
                break
            msg, self.buffer = json.loads(self.buffer[4 : 4 + n]), self.buffer[4 + n :]
            self.result = GameResult(**msg)
            self.deadline = time.monotonic() + 10.0  # for its clean-up and exit

    def abort(self, why: str) -> None:
        """Kill the referee (its child dies with it: PR_SET_PDEATHSIG), then have the server kill any orphans.

        Through the referee's pidfd: a pid the server has already reaped may belong to another process by now, and
        we may be root. Only a kernel without pidfds gets the plain kill.
        """
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                os.kill(self.referee, signal.SIGKILL)
        except OSError:
            pass  # already gone
        self.wait_gone()
        global _server
        with _lock:
            _live_referees.discard(self.referee)
            if _server is not None and _server.alive():
                shutil.rmtree(os.path.join(_server.root, str(self.referee)), ignore_errors=True)
                try:
                    _server.sweep(_live_referees)
                except (OSError, SandboxError):
                    pass
            if _server is not None and not _server.alive():  # it died too: clear its tree now, restart later
                _server.stop()
                _server = None
        if self.result is None:
            self.result = GameResult("crash", error=why)
        self.gone = True

    def wait_gone(self) -> None:
        """Return once the referee has exited (the server reaps it at once: SIGCHLD is ignored there)."""
        if self.pidfd is not None:
            _poll([self.pidfd], 5.0)
        else:
            _wait_gone(self.referee)

    def close(self) -> None:
        with _lock:
            _live_referees.discard(self.referee)
        self.sock.close()
        if self.pidfd is not None:
            os.close(self.pidfd)


def _poll(fds, timeout: float) -> list[tuple[int, int]]:
    """The ready ones among `fds` (readable, closed or in error), waiting at most `timeout` seconds."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return poller.poll(timeout * 1000)


def _wait_gone(pid: int, timeout: float = 2.0) -> None:
    """Wait until a process has left the process table (the server reaps referees at once)."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    time.sleep(0.0005)  # a zombie of a server busy forking: reaped in a moment
                    continue
        except (OSError, IndexError):
            return
        time.sleep(0.0002)


def _kill_marked(root: str) -> None:
    """Kill every process whose command line carries this server's temp root (it and all its forks).

    The cgroup-free backstop for processes that escaped every parent (only possible without seccomp).
    """
    token = root.encode()
    for _ in range(20):
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if token not in f.read():
                        continue
                os.kill(int(name), signal.SIGKILL)
                found = True
            except OSError:
                pass
        if not found:
            return
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------------------
# Framing: 4-byte length + payload between trusted processes; child replies use a 2-byte length
# ---------------------------------------------------------------------------------------------------


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("!I", len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("peer closed")
        buf += chunk
    return buf


def _recv_frame(sock: socket.socket) -> bytes:
    return _recv_exact(sock, struct.unpack("!I", _recv_exact(sock, 4))[0])


# ---------------------------------------------------------------------------------------------------
# Server: a fresh interpreter that forks referees and never sees a job
# ---------------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG, _PR_SET_SECCOMP, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 22, 36, 38
_SECCOMP_MODE_FILTER = 2


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


class _Context:
    """What every referee and child inherit from the server: prepared once, copied by fork."""

    root = ""
    devnull = -1
    seccomp = None  # the compiled filter (_SeccompProgram), or None
    server_pid = 0
    drop_root = False  # we are root: children switch to an unprivileged user of their own before the code runs


_CTX = _Context()


def _server_main(argv: list[str]) -> None:
    ctl_fd, root, switches = int(argv[0]), argv[1], json.loads(argv[2])
    ctl = socket.socket(fileno=ctl_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer, which then shuts us down
    _CTX.root, _CTX.server_pid = root, os.getpid()
    _CTX.devnull = os.open(os.devnull, os.O_RDWR)
    root_user = os.geteuid() == 0
    _CTX.drop_root = root_user and switches["drop_root"]
    drops_root = _CTX.drop_root and _root_can_be_dropped()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # referees (and adopted orphans) are reaped by the kernel
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    reason = "disabled"
    if switches["seccomp"]:
        _CTX.seccomp, reason = _build_seccomp()
    _prepare_child_runtime()
    hello = {"seccomp": _CTX.seccomp is not None, "reason": reason, "root": root_user, "drops_root": drops_root}
    _send_frame(ctl, json.dumps(hello).encode())
    gc.collect()
    gc.freeze()  # forks then share these pages instead of copying them when the collector walks them
    spares: deque[tuple[int, socket.socket]] = deque()  # referees forked ahead, each with its child
    while True:
        try:
            op = ctl.recv(1)
        except OSError:
            op = b""
        if op == b"F":  # a referee, please; then keep `wanted` spares ready for the next requests
            wanted = _recv_exact(ctl, 1)[0]
            _hand_over(ctl, spares)
            while len(spares) < wanted:
                spare = _fork_referee_here()
                if spare is None:
                    break
                spares.append(spare)
        elif op == b"S":  # kill our children but live referees and spares: orphans adopted from games
            live = set(json.loads(_recv_exact(ctl, struct.unpack("!I", _recv_exact(ctl, 4))[0])))
            _kill_children(keep=live | {pid for pid, _ in spares})
            ctl.sendall(b"k")
        elif op == b"P":  # the spares' pids (for tests: they are the only processes we keep idle)
            _send_frame(ctl, json.dumps([pid for pid, _ in spares]).encode())
        else:  # EOF: the trainer shut us down or died
            break
    _kill_children(keep=set(), timeout=3.0)


def _fork_referee_here() -> tuple[int, socket.socket] | None:
    """Fork a referee (which at once forks its child and waits for a job); None if fork fails."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        pid = os.fork()
    except OSError:  # out of processes or memory
        ours.close()
        theirs.close()
        return None
    if pid == 0:
        try:
            ours.close()
            _referee(theirs)
        finally:
            os._exit(70)
    theirs.close()
    return pid, ours


def _hand_over(ctl: socket.socket, spares: deque) -> None:
    """Send the trainer a ready referee's socket: a spare if one is alive, else a fresh fork."""
    while spares:
        pid, sock = spares.popleft()
        if not select.select([sock], [], [], 0)[0]:  # a waiting referee never writes: readable = dead
            break
        sock.close()
    else:
        fresh = _fork_referee_here()
        if fresh is None:  # the trainer gets no fd and raises SandboxError
            ctl.sendall(struct.pack("!i", -1))
            return
        pid, sock = fresh
    try:
        socket.send_fds(ctl, [struct.pack("!i", pid)], [sock.fileno()])
    finally:
        sock.close()


def _close_fds_except(*keep: int) -> None:
    """Close every fd from 3 up but `keep` (close_range under the hood: cheap)."""
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def _children() -> list[int]:
    """Direct children of this (single-threaded) process, adopted orphans included."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:  # kernels without CONFIG_PROC_CHILDREN: scan the table
        me, kids = os.getpid(), []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat", "rb") as f:
                        if int(f.read().rsplit(b")", 1)[1].split()[1]) == me:
                            kids.append(int(name))
                except (OSError, IndexError, ValueError):
                    pass
        return kids


def _kill_children(keep: set[int], timeout: float = 2.0) -> None:
    """SIGKILL every child not in `keep` (and its process group) until none is left; reap them."""
    deadline = time.monotonic() + timeout
    while True:
        kids = [k for k in _children() if k not in keep]
        if not kids:
            return
        for k in kids:
            for kill in (os.killpg, os.kill):
                try:
                    kill(k, signal.SIGKILL)
                except OSError:
                    pass
        while True:  # reap (no-op where SIGCHLD is ignored: the kernel reaps)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if time.monotonic() > deadline:
            return
        time.sleep(0.0005)


# ---------------------------------------------------------------------------------------------------
# Referee: trusted, one per game
# ---------------------------------------------------------------------------------------------------


class _Stop(Exception):
    """Ends a game early with a status: raised by the move round trip."""

    def __init__(self, status: str, error: str):
        super().__init__(error)
        self.status, self.error = status, error


def _referee(sock: socket.socket) -> None:
    """Fork the child before reading the job (so it never holds one), play, report, clean up, exit.

    Until its job comes, a referee is a spare: it and its child wait, set up, in the server's pool.
    """
    _close_fds_except(sock.fileno(), _CTX.devnull)  # the control socket, other spares' sockets
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != _CTX.server_pid:
        os._exit(71)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # we wait for our child ourselves
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # orphans of the child come to us, and we kill them
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _child_main(to_child_r, from_child_w)
        finally:
            os._exit(72)
    os.close(to_child_r)
    os.close(from_child_w)
    os.set_blocking(to_child_w, False)
    referee = _Referee(pid, to_child_w, from_child_r)
    workdir = os.path.join(_CTX.root, str(os.getpid()))
    try:
        try:
            job = json.loads(_recv_frame(sock))
        except EOFError:
            os._exit(0)  # a spare the server let go (shutdown): the finally below kills our child
        os.mkdir(workdir, 0o700)
        job["workdir"] = workdir
        try:
            result = referee.run(job)
        except Exception as exc:
            result = {"status": "crash", "error": _one_line(f"sandbox referee failed: {type(exc).__name__}: {exc}")}
        # Report, then clean up: the trainer counts this game as done only once we have exited.
        _send_frame(sock, json.dumps(result).encode())
    finally:
        referee.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    os._exit(0)


class _Referee:
    """Plays one game against the child over two pipes, with every deadline on this side."""

    def __init__(self, pid: int, wfd: int, rfd: int):
        self.pid, self.wfd, self.rfd = pid, wfd, rfd
        self.wait_status = None  # set once the child is reaped

    def run(self, job: dict) -> dict:
        t0 = time.monotonic()
        rules = Game(**job["game"])
        game_limit, move_limit = rules.game_time_limit, rules.move_time_limit
        game_deadline = t0 + game_limit
        game = None
        played = [] if job.get("record_keys") else None  # canonical keys, so the trusted side can replay the game

        def result(status: str, error: str = "") -> dict:
            return {
                "status": status,
                "moves": game.moves if game else 0,
                "score": game.score() if game else 0,
                "max_tile": game.max_tile() if game else 0,
                "seconds": round(time.monotonic() - t0, 6),
                "error": _one_line(error),
                "played_keys": None if played is None else "".join(played),
            }

        def deadline(what: str) -> tuple[float, str]:
            """The nearer of the move's and the game's deadline, and what to say when it passes."""
            now = time.monotonic()
            if now + move_limit < game_deadline:
                return now + move_limit, f"{what} took longer than {move_limit:g} s"
            return game_deadline, f"the game took longer than {game_limit:g} s"

        load = {
            "workdir": job["workdir"],
            "code": job["code"],
            "strategy_seed": game2048.strategy_seed(job["seed"]),
            "memory_limit_mb": rules.memory_limit_mb,
            "cpu_seconds": int(math.ceil(game_limit)) + 1,
            "unrestricted": job["unrestricted"],
        }
        try:
            until = deadline("loading the code")
            self.send(json.dumps(load).encode(), *until)
            if self.receive(*until) != ("R", ""):
                raise _Stop("invalid", "malformed reply while loading")
            # Only now does the game exist; play_game's loop, with an invalid key ending it as "invalid".
            game = game2048.GameBoard(
                seed=job["seed"],
                max_idle_moves=game2048.MAX_IDLE_MOVES,
                size=rules.size,
                target=rules.target,
                probability_fours=rules.probability_fours,
                keys=rules.keys,
            )
            mapping = game2048.key_map(rules.keys)
            canonical = dict(zip(game2048.DIRECTIONS, rules.keys))  # direction -> its key, as the alphabet writes it
            while game.state() == "ongoing":
                if rules.max_moves and game.moves >= rules.max_moves:
                    return result("capped", f"the move cap: {rules.max_moves} moves")
                until = deadline("a move")
                self.send(";".join(",".join(map(str, row)) for row in game.board()).encode(), *until)
                kind, text = self.receive(*until)
                if kind != "K":
                    raise _Stop("invalid", "malformed reply")
                direction = game2048.parse_key(text, mapping)
                if direction is None:
                    raise _Stop("invalid", f"returned {text[:20]!r}, not one of the keys {rules.keys!r}")
                game.do_action(text)
                if played is not None:
                    played.append(canonical[direction])
        except _Stop as stop:
            return result(stop.status, stop.error)
        state = game.state()
        if state == "failed" and game.idle_moves >= game2048.MAX_IDLE_MOVES:
            return result(state, f"idle: {game2048.MAX_IDLE_MOVES} keys in a row changed nothing")
        return result(state)

    def send(self, payload: bytes, deadline: float, late: str) -> None:
        data = struct.pack("!I", len(payload)) + payload
        while data:
            try:
                data = data[os.write(self.wfd, data) :]
                continue
            except BlockingIOError:  # the child is not reading: wait, but only until the deadline
                pass
            except BrokenPipeError:
                raise self.crashed() from None
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([], [self.wfd], [], remaining)[1]:
                raise self.timeout(late)

    def receive(self, deadline: float, late: str) -> tuple[str, str]:
        """One reply: 2-byte length, a kind byte, text. Capped; anything else is invalid."""
        buf, need = b"", 0
        while not need or len(buf) < need:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.rfd], [], [], remaining)[0]:
                raise self.timeout(late)
            chunk = os.read(self.rfd, 3 + MAX_REPLY_BYTES - len(buf))  # never more than one capped reply + 1
            if not chunk:
                raise self.crashed()
            buf += chunk
            if len(buf) >= 2:
                need = 2 + struct.unpack("!H", buf[:2])[0]
                if need > 2 + MAX_REPLY_BYTES:
                    raise _Stop("invalid", f"reply of {need - 2} bytes is over the {MAX_REPLY_BYTES}-byte cap")
                if need == 2:
                    raise _Stop("invalid", "empty reply")
        if len(buf) > need:
            raise _Stop("invalid", "more than one reply to a board")
        kind, text = chr(buf[2]), buf[3:].decode("utf-8", "replace")  # a plain str, whatever was sent
        if kind == "E":
            raise _Stop("error", text)
        if kind == "I":
            raise _Stop("invalid", text)
        if kind == "X":
            raise _Stop("crash", text)
        return kind, text

    def timeout(self, late: str) -> _Stop:
        self.kill()
        return _Stop("timeout", late)

    def crashed(self) -> _Stop:
        """The child closed its pipe: say how it ended (killing it if it merely closed the pipe)."""
        deadline = time.monotonic() + 0.5
        while self.wait_status is None and time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.wait_status = status
            else:
                time.sleep(0.001)
        if self.wait_status is None:
            self.kill()
            return _Stop("crash", "closed its pipe")
        return _Stop("crash", _describe_exit(self.wait_status))

    def kill(self) -> None:
        """SIGKILL the child's group and every descendant we adopted; reap them all."""
        for kill in (os.killpg, os.kill):
            try:
                kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
        if self.wait_status is None:
            try:
                self.wait_status = os.waitpid(self.pid, 0)[1]
            except ChildProcessError:
                self.wait_status = 0
        _kill_children(keep=set())


def _describe_exit(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        limit = {
            signal.SIGXCPU: " (CPU time limit)",
            signal.SIGSEGV: " (segmentation fault)",
            signal.SIGXFSZ: " (file size limit)",
            signal.SIGSYS: " (a system call through another ABI)",
        }
        return f"killed by signal {name}{limit.get(sig, '')}"
    if os.WIFEXITED(status):
        return f"exited with status {os.WEXITSTATUS(status)}"
    return f"ended with wait status {status}"


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    clean = "".join(c if c.isprintable() else "?" for c in text)
    return clean if len(clean) <= MAX_ERROR_CHARS else clean[: MAX_ERROR_CHARS - 3] + "..."


# Users for children when we are root: far above any account or subordinate-id range a machine hands out, one
# per child (by pid), so no child shares a user with anything, not even with another game.
_CHILD_UID_BASE, _CHILD_UID_SPAN = 0x7FF00000, 1 << 20
_NOBODY = 65534  # the fallback where only a small id range exists (a rootless container's user namespace)


def _drop_root() -> None:
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


def _root_can_be_dropped() -> bool:
    """Whether a child can leave root here, tried once at the server's start in a throwaway fork."""
    pid = os.fork()
    if pid == 0:
        try:
            _drop_root()
            os._exit(0 if os.geteuid() != 0 else 1)
        finally:
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0


# ---------------------------------------------------------------------------------------------------
# Child: untrusted from the moment the code is loaded
# ---------------------------------------------------------------------------------------------------

# Test-only (_unrestricted): modules the attack tests need, imported before seccomp forbids opening files.
_UNRESTRICTED_PREIMPORTS = (
    "ctypes", "fcntl", "gc", "os", "pathlib", "resource", "signal", "socket", "subprocess", "threading",
)  # fmt: skip


def _first_for_the_oom_killer() -> None:
    """oom_score_adj 1000: if the machine runs out of memory, a child goes first, never the trainer. RLIMIT_AS does
    not count page tables, so a child can hold about twice its limit (docs/SECURITY.md). Raising one's own score
    needs no privilege."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def _child_main(rfd: int, wfd: int) -> None:
    """Jail this process, load the code, then answer one key per board until killed. Never returns."""
    os.setsid()  # own session and process group: the referee kills the group
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # fds: stdin closed, stdout/stderr to /dev/null, our two pipes at 3 and 4, nothing else.
    hi_r, hi_w = fcntl.fcntl(rfd, fcntl.F_DUPFD, 100), fcntl.fcntl(wfd, fcntl.F_DUPFD, 100)
    os.dup2(_CTX.devnull, 1)
    os.dup2(_CTX.devnull, 2)
    os.dup2(hi_r, 3)
    os.dup2(hi_w, 4)
    os.close(0)
    _close_fds_except(3, 4)
    os.environ.clear()
    load = json.loads(_child_read(3))  # a spare waits here
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
    if _CTX.drop_root:
        try:
            _drop_root()
        except OSError:
            os._exit(73)  # never run the code as root (the server checked at start that this works)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # a change of user clears it
    if _CTX.seccomp is not None:
        _CTX.seccomp.load()
    code, seed, unrestricted = load["code"], load["strategy_seed"], load["unrestricted"]
    del load
    try:
        strategy = _load_strategy(code, unrestricted)
        del code
        import random

        random.seed(seed)  # what play_game does before the first move, with the same one-way seed
    except Exception as exc:
        _child_reply(b"E", _describe(exc))
        _child_idle()
    except BaseException as exc:
        _child_reply(b"X", "raised " + _describe(exc))
        _child_idle()
    _child_reply(b"R", "")
    while True:
        msg = _child_read(3)
        board = [[int(v) for v in row.split(b",")] for row in msg.split(b";")]
        try:
            key = strategy(board)
        except Exception as exc:
            _child_reply(b"E", _describe(exc))
            _child_idle()
        except BaseException as exc:  # SystemExit, KeyboardInterrupt...: the process "exits"
            _child_reply(b"X", "raised " + _describe(exc))
            _child_idle()
        try:
            if not isinstance(key, str):
                kind, text = b"I", f"returned {_type_name(key)}, not a str"
            elif str.__len__(key) > MAX_KEY_CHARS:
                kind, text = b"I", f"returned a str of {str.__len__(key)} characters"
            else:
                kind, text = b"K", str.__str__(key)  # an exact copy of a str subclass's characters
        except BaseException:
            kind, text = b"I", "returned an unusable value"
        _child_reply(kind, text)


_inbox = bytearray()


def _child_read(fd: int) -> bytes:
    """The next frame from the referee (it sends one, then waits for our reply)."""
    while len(_inbox) < 4 or len(_inbox) < 4 + struct.unpack("!I", _inbox[:4])[0]:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            os._exit(0)  # the referee is gone
        _inbox.extend(chunk)
    n = 4 + struct.unpack("!I", _inbox[:4])[0]
    frame = bytes(_inbox[4:n])
    del _inbox[:n]
    return frame


def _child_reply(kind: bytes, text: str) -> None:
    payload = kind + str.encode(text, "utf-8", "replace")[: MAX_REPLY_BYTES - 1]
    data = struct.pack("!H", len(payload)) + payload
    while data:
        data = data[os.write(4, data) :]


def _child_idle() -> None:
    """The game is over for this child: wait for the referee to kill it."""
    while True:
        _child_read(3)


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


# --- the Python-level checks (fail fast and say why; not the boundary: see docs/SECURITY.md) -----------


def _checked_name(name):
    if not isinstance(name, str):
        return name  # the builtin raises its own TypeError
    name = str.__str__(name)  # an exact str: a subclass cannot lie to the check
    if not policy.attribute_allowed(name):
        raise SandboxViolation(f"attribute {name!r} is not allowed in the sandbox")
    return name


def _safe_getattr(obj, name, *default):
    return getattr(obj, _checked_name(name), *default)


def _safe_hasattr(obj, name):
    return hasattr(obj, _checked_name(name))


def _safe_setattr(obj, name, value):
    setattr(obj, _checked_name(name), value)


def _safe_delattr(obj, name):
    delattr(obj, _checked_name(name))


def _safe_attrgetter(*names):
    for name in names:
        if isinstance(name, str):
            for part in str.split(str.__str__(name), "."):
                _checked_name(part)
    return operator.attrgetter(*names)


def _safe_methodcaller(name, /, *args, **kwargs):
    return operator.methodcaller(_checked_name(name), *args, **kwargs)


def _checked_dataclass_names(cls):
    for name in dict(getattr(cls, "__dict__", {})).get("__annotations__", {}):
        if not isinstance(name, str) or not str.isidentifier(name) or name.startswith("__"):
            raise SandboxViolation(f"dataclass field name {name!r} is not allowed in the sandbox")


def _safe_dataclass(cls=None, /, **kwargs):
    """dataclasses.dataclass writes its methods as source text from field names: check them first."""

    def wrap(c):
        _checked_dataclass_names(c)
        return dataclasses.dataclass(**kwargs)(c)

    return wrap if cls is None else wrap(cls)


def _restricted_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level:
        raise ImportError("relative imports are not allowed in the sandbox")
    name = str.__str__(name) if isinstance(name, str) else name
    if name not in _PROXIES:
        raise ImportError(f"import of {name!r} is not allowed in the sandbox")
    return _PROXIES[name] if fromlist else _PROXIES[name.partition(".")[0]]


# Removed from the module copies a strategy gets: each evaluates strings or fetches arbitrary attributes.
_MODULE_REMOVALS = {
    "typing": ("get_type_hints", "ForwardRef"),
    "functools": ("singledispatch", "singledispatchmethod"),
    "string": ("Formatter",),
}
_PROXIES: dict[str, types.ModuleType] = {}
_SAFE_BUILTINS: dict = {}


def _prepare_child_runtime() -> None:
    """Import the allowed modules and build what children start from, once, in the server."""
    for name in sorted(policy.ALLOWED_MODULES):
        importlib.import_module(name)
    time.localtime()  # the C library reads the time zone now, before children lose the right to open it
    for name in policy.ALLOWED_MODULES:
        real = sys.modules[name]
        proxy = types.ModuleType(name, getattr(real, "__doc__", None))
        for attr in dir(real):
            if attr.startswith("_") or attr in _MODULE_REMOVALS.get(name, ()):
                continue
            value = getattr(real, attr)
            if not isinstance(value, types.ModuleType):  # a module attribute is a way out (random._os)
                setattr(proxy, attr, value)
        _PROXIES[name] = proxy
    _PROXIES["collections"].abc = _PROXIES["collections.abc"]
    _PROXIES["operator"].attrgetter = _safe_attrgetter
    _PROXIES["operator"].methodcaller = _safe_methodcaller
    _PROXIES["dataclasses"].dataclass = _safe_dataclass
    _SAFE_BUILTINS.update({n: getattr(builtins, n) for n in policy.ALLOWED_BUILTINS})
    _SAFE_BUILTINS.update(
        getattr=_safe_getattr,
        hasattr=_safe_hasattr,
        setattr=_safe_setattr,
        delattr=_safe_delattr,
        __import__=_restricted_import,  # what `import` statements call; not a name the code may use
        __build_class__=builtins.__build_class__,  # what `class` statements call
    )


def _load_strategy(code: str, unrestricted: bool):
    """Compile and run the code under policy.py's rules (the same the rewards judge by); return `strategy`."""
    tree = ast.parse(code, "<strategy>")
    if not unrestricted:
        found = policy.violations(tree)
        if found:
            kind = ImportError if found[0].startswith("import ") else SandboxViolation
            raise kind(f"{found[0]} is not allowed in the sandbox")
    # A real module, as an import would make: dataclasses and friends look their class's module up.
    module = types.ModuleType("strategy")
    module.__builtins__ = builtins if unrestricted else dict(_SAFE_BUILTINS)
    sys.modules["strategy"] = module
    exec(compile(tree, "<strategy>", "exec", dont_inherit=True), module.__dict__)  # the judge's flags, not ours
    strategy = module.__dict__.get("strategy")
    if not callable(strategy):
        raise NameError("the code defines no callable named `strategy`")
    return strategy


# --- seccomp --------------------------------------------------------------------------------------

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
_CHILD_READ_FD, _CHILD_WRITE_FD = 3, 4  # the pipes from and to the referee, where _child_main puts them
_FUTEX_PRIVATE_FLAG, _PRIVATE_FUTEX_OPS = 128, (0, 1, 9, 10)  # WAIT, WAKE, WAIT_BITSET, WAKE_BITSET
_MAP_HUGETLB, _MAP_LOCKED = 0x40000, 0x2000
_MADVICE = (0, 1, 2, 3, 4, 8, 14, 15)  # NORMAL, RANDOM, SEQUENTIAL, WILLNEED, DONTNEED, FREE, (NO)HUGEPAGE


def _build_seccomp():
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
        allow("read", sc.Arg(0, sc.EQ, _CHILD_READ_FD))
        for fd in (1, 2, _CHILD_WRITE_FD):  # print() goes to stdout, which is /dev/null
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
    return _SeccompProgram(program), ""


class _SeccompProgram:
    """A compiled filter, installed with two prctl calls (so children never run libseccomp)."""

    class _Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    def __init__(self, program: bytes):
        self.buffer = ctypes.create_string_buffer(program, len(program))
        self.fprog = self._Fprog(len(program) // 8, ctypes.addressof(self.buffer))

    def load(self) -> None:
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
        if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(self.fprog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "seccomp filter could not be installed")
