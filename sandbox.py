"""Play untrusted 2048 strategies: the game stays on the trusted side, the strategy runs behind OS-level walls.

Threat model: the strategy's code may do anything a process can do. The walls are the kernel's: seccomp, process
sessions, rlimits, an unprivileged user when we are root, and deadlines kept by another process. The seccomp allowlist
also reports: a system call outside it kills the child, and the referee scores that as a violation (cheating), so no
step outside the process goes unseen. Python-level checks (policy.py's judge, here before any process exists, and an
audit hook in the child) tell an honest model what it may not use and score the plain forms as cheating.

Process tree, a file for each (this one is the trainer's side):

    trainer (your process)  ──  holds the jobs; talks to referees directly, reads their JSON results
      └─ server   sandbox_server.py: a fresh `python` with an empty environment, in a session of its own, so it
         │        never holds the trainer's memory, secrets, threads or CUDA state, and no signal of a child can reach
         │        the trainer's process group; it only forks referees (a few ahead, as spares), never sees a job
         └─ referee  sandbox_server.py (one per game, trusted): forks its child *before* it reads the job, then
            │        builds the GameBoard and plays the game, one pipe round trip per move, under deadlines
            └─ child  sandbox_child.py (untrusted): holds only the strategy: a session of its own, rlimits, no fds but
                      its two pipes (and /dev/null as stdout), empty environment, another user when we are root, then a
                      seccomp allowlist: memory, clocks and sleep, random bytes, read on its pipe, write on its pipe
                      and stdout, exit. Any other system call kills it, and its referee scores that as cheating.

The child never sees the seed (only `strategy_seed(seed)`), the game, its RNG or any other job.
Replies are small length-prefixed frames with a byte cap, decoded into a plain `str`; nothing from
the child is ever unpickled or eval'ed. Limits are enforced from outside: the referee SIGKILLs the
child's process group on a wall-clock deadline, kills every descendant it adopted (it is a
child-subreaper) and removes the temp dir; a game counts as done once its referee has exited, so
no process of it survives its result. See docs/SECURITY.md.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
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
import warnings
from collections import deque

import game2048
import policy

STATUSES = ("success", "failed", "capped", "timeout", "error", "invalid", "crash", "violation")
MAX_CODE_BYTES = 1 << 20
MAX_ERROR_CHARS = 300
MAX_SPARES = 8  # referees the server keeps forked ahead (each with its child), at most


class SandboxError(RuntimeError):
    """The sandbox itself cannot run (no server, strict mode without seccomp): not a strategy's fault."""


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

    status: str  # success | failed | capped | timeout | error | invalid | crash | violation
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
    "drops_root": whether they change to a user of their own (only when this process is root), "root": whether this
    process is root, "wrap": the command the server runs under (TRAIN2048_SANDBOX_WRAP), or ""}. Callers that require
    seccomp check this once at start, so a missing libseccomp is one clear line, not a failed batch."""
    with _lock:
        if _server is None or not _server.alive():
            _start_locked()
        return {"seccomp": _server.seccomp, "reason": _server.seccomp_reason, "drops_root": _server.drops_root,
                "root": _server.root_user, "wrap": _server.wrap}  # fmt: skip


def describe_walls(walls: dict) -> str:
    """walls() in one line, for the start of a run: which walls are on here, and why one is not."""
    if walls["seccomp"]:
        seccomp = "seccomp allowlist on (a step outside the process kills the child, scored as cheating)"
    else:
        seccomp = f"seccomp OFF ({walls['reason']}): a step outside the process is neither stopped nor seen"
    if walls["drops_root"]:
        user = "each strategy runs as a user of its own (this process is root)"
    elif walls["root"]:
        user = "strategies keep root (the change of user is switched off)"
    else:
        user = f"no change of user (only root can switch users): strategies run as this user, uid {os.geteuid()}"
    wrap = f"the server runs under `{walls['wrap']}`" if walls["wrap"] else "no outer wrap (TRAIN2048_SANDBOX_WRAP)"
    return f"sandbox walls: {seccomp}; {user}; {wrap}; always: sessions of their own, rlimits, deadlines"


def play(
    code: str,
    *,
    seed: int | None,
    strict: bool = False,
    record_keys: bool = False,
    _unrestricted: bool | str = False,
    **rules,
) -> GameResult:
    """Play one game of the function named `strategy` defined in `code`; `rules` are Game's fields.

    Same game as `game2048.play_game(strategy, seed=seed, ...)`. Loading the code counts as a move
    (move_time_limit) and as part of the game (game_time_limit). `strict` refuses to run without
    seccomp. `record_keys` returns the keys the game played in GameResult.played_keys (each as the
    alphabet writes it), so trusted code can replay the game board by board with the engine, never
    running the strategy itself. Code that policy.judge finds cheating is a "violation" at once, without a process.
    `_unrestricted` (tests only) skips the judge and gives the code every builtin and module: True drops every
    Python-level check, so tests can prove the OS layers alone; "audited" keeps the audit hook, to prove it alone.
    """
    options = dict(strict=strict, record_keys=record_keys, _unrestricted=_unrestricted)
    return play_many([(code, seed, Game(**rules))], workers=1, **options)[0]


def play_many(
    jobs,
    *,
    workers: int | None = None,
    strict: bool = False,
    record_keys: bool = False,
    groups: list | None = None,
    group_seconds: float = math.inf,
    deadline: float = math.inf,
    _unrestricted: bool | str = False,
) -> list[GameResult | None]:
    """Play `(code, seed, game)` jobs at once (`game` a Game); results in job order.

    Up to `workers` games run at a time (default: the cores this process may use), started in job order. `groups` (a
    key per job) bounds the time of related games: once a game of a group has timed out, or its games together have
    taken `group_seconds`, the group's jobs not yet started are not played, and their results are None. The rewards
    group each answer's games so, that an answer that stalls is not played to the limit in all of them. No job starts
    after `deadline` (a time.monotonic() time; its result is None), so the call ends within one game's limit of it.
    """
    specs = [_job(code, seed, game, record_keys, _unrestricted) for code, seed, game in jobs]  # raises now
    if groups is not None and len(groups) != len(specs):
        raise ValueError(f"groups has {len(groups)} keys for {len(specs)} jobs")
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
    spent: dict = {}  # group -> seconds its games took; math.inf once one of them timed out
    try:
        while queue or active:
            # A game frees its slot when its result arrives; its referee's clean-up overlaps the next game.
            while queue and sum(g.result is None for g in active.values()) < workers:
                i = queue.popleft()
                if time.monotonic() >= deadline:
                    queue.clear()  # out of time: none of the rest starts (None)
                    break
                if groups is not None and spent.get(groups[i], 0.0) >= group_seconds:
                    continue  # its group is out of time: not played (None)
                if isinstance(specs[i], GameResult):  # decided without a process (code too long)
                    results[i] = specs[i]
                    continue
                game = _Game(i, specs[i], spares=workers)
                active[game.sock.fileno()] = game
            if not active:
                continue
            timeout = max(0.0, min(g.deadline for g in active.values()) - time.monotonic())
            for fd, _ in _poll(active, timeout):  # poll, not select: a trainer may hold fds above 1023
                game = active[fd]
                game.feed()
                if groups is not None and game.result is not None and not game.counted:
                    game.counted, group = True, groups[game.index]
                    took = math.inf if game.result.status == "timeout" else game.result.seconds
                    spent[group] = spent.get(group, 0.0) + took
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
    verdict = None if unrestricted else policy.judge(code)  # parsed here, compiled only in the child
    if verdict is not None and verdict[0]:
        return GameResult("violation", error=verdict[0][0][:MAX_ERROR_CHARS])
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

    def __init__(self, proc, ctl, root, hello, wrap: str = ""):
        self.proc, self.ctl, self.root = proc, ctl, root
        self.pid = proc.pid
        self.owner = os.getpid()  # a forked copy of the trainer must not drive or stop our server
        self.seccomp = bool(hello["seccomp"])
        self.seccomp_reason = hello.get("reason") or ""
        self.drops_root = bool(hello["drops_root"])  # children run as another user (we are root)
        self.root_user = bool(hello["root"])
        self.wrap = wrap  # the outer command it runs under (TRAIN2048_SANDBOX_WRAP), as a shell line

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
        return json.loads(recv_frame(self.ctl))

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


_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); import sandbox_server; sandbox_server.main(sys.argv[2:])"


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
    wrap = shlex.split(os.environ.get("TRAIN2048_SANDBOX_WRAP", ""))
    argv = wrap + argv
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
        hello = json.loads(recv_frame(ours))
        ours.settimeout(30)
    except BaseException as exc:
        proc.kill()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)
        raise SandboxError(f"sandbox server failed to start: {exc}") from exc
    server = _Server(proc, ours, root, hello, shlex.join(wrap))
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
        self.counted = False  # its time has gone to its group's budget (play_many's groups)
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
            send_frame(self.sock, json.dumps(spec).encode())
        except OSError:
            pass  # a dead referee shows as EOF in feed()

    def feed(self) -> None:
        try:
            data = self.sock.recv(65536)
        except OSError:
            data = b""
        if not data:  # the referee exited (it ends its child, reports, cleans up, then exits)
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
# Framing between trusted processes (trainer, server, referee): a 4-byte length + payload
# ---------------------------------------------------------------------------------------------------


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("!I", len(payload)) + payload)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("peer closed")
        buf += chunk
    return buf


def recv_frame(sock: socket.socket) -> bytes:
    return recv_exact(sock, struct.unpack("!I", recv_exact(sock, 4))[0])
