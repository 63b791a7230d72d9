"""The trusted side of the sandbox: the server process that forks referees, and the referee that plays one game.

The trainer (sandbox.py) starts the server as a fresh interpreter (`python -c ... sandbox_server.main(...)`) with an
empty environment, in a session of its own, so it never holds the trainer's memory, secrets, threads or CUDA state.
The server prepares once what every game inherits (the seccomp filter, the allowed modules' copies: sandbox_child.py),
then only forks referees, a few ahead as spares, and never sees a job. A referee forks its child before it reads its
job, so the child's memory never held the seed, the game or any other job; then it plays play_game's loop against the
child, one pipe round trip per move, every deadline on its side, and reports one JSON result to the trainer.
"""

from __future__ import annotations

import gc
import json
import math
import os
import resource
import select
import shutil
import signal
import socket
import struct
import time
from collections import deque

import game2048
import sandbox_child
from sandbox import MAX_ERROR_CHARS, Game, recv_exact, recv_frame, send_frame
from sandbox_child import MAX_REPLY_BYTES

_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
SECCOMP_KILL = "a system call outside the sandbox's allowlist: the kernel killed the process"


class _Context:
    """What every referee and child inherit from the server: prepared once, copied by fork."""

    root = ""
    devnull = -1
    seccomp = None  # the compiled filter (sandbox_child.SeccompProgram), or None
    server_pid = 0
    drop_root = False  # we are root: children switch to an unprivileged user of their own before the code runs


_CTX = _Context()


def main(argv: list[str]) -> None:
    """The server's loop: answer the trainer's requests on its control socket until it closes."""
    ctl_fd, root, switches = int(argv[0]), argv[1], json.loads(argv[2])
    ctl = socket.socket(fileno=ctl_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer, which then shuts us down
    _CTX.root, _CTX.server_pid = root, os.getpid()
    _CTX.devnull = os.open(os.devnull, os.O_RDWR)
    root_user = os.geteuid() == 0
    _CTX.drop_root = root_user and switches["drop_root"]
    drops_root = _CTX.drop_root and _root_can_be_dropped()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # referees (and adopted orphans) are reaped by the kernel
    sandbox_child.prctl(_PR_SET_CHILD_SUBREAPER, 1)
    reason = "disabled"
    if switches["seccomp"]:
        _CTX.seccomp, reason = sandbox_child.build_seccomp()
    sandbox_child.prepare_runtime()
    hello = {"seccomp": _CTX.seccomp is not None, "reason": reason, "root": root_user, "drops_root": drops_root}
    send_frame(ctl, json.dumps(hello).encode())
    gc.collect()
    gc.freeze()  # forks then share these pages instead of copying them when the collector walks them
    spares: deque[tuple[int, socket.socket]] = deque()  # referees forked ahead, each with its child
    while True:
        try:
            op = ctl.recv(1)
        except OSError:
            op = b""
        if op == b"F":  # a referee, please; then keep `wanted` spares ready for the next requests
            wanted = recv_exact(ctl, 1)[0]
            _hand_over(ctl, spares)
            while len(spares) < wanted:
                spare = _fork_referee_here()
                if spare is None:
                    break
                spares.append(spare)
        elif op == b"S":  # kill our children but live referees and spares: orphans adopted from games
            live = set(json.loads(recv_exact(ctl, struct.unpack("!I", recv_exact(ctl, 4))[0])))
            _kill_children(keep=live | {pid for pid, _ in spares})
            ctl.sendall(b"k")
        elif op == b"P":  # the spares' pids (for tests: they are the only processes we keep idle)
            send_frame(ctl, json.dumps([pid for pid, _ in spares]).encode())
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
    sandbox_child.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != _CTX.server_pid:
        os._exit(71)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # we wait for our child ourselves
    sandbox_child.prctl(_PR_SET_CHILD_SUBREAPER, 1)  # orphans of the child come to us, and we kill them
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            sandbox_child.child_main(
                to_child_r, from_child_w, devnull=_CTX.devnull, drop_root=_CTX.drop_root, seccomp=_CTX.seccomp
            )
        finally:
            os._exit(72)
    os.close(to_child_r)
    os.close(from_child_w)
    os.set_blocking(to_child_w, False)
    referee = _Referee(pid, to_child_w, from_child_r)
    workdir = os.path.join(_CTX.root, str(os.getpid()))
    try:
        try:
            job = json.loads(recv_frame(sock))
        except EOFError:
            os._exit(0)  # a spare the server let go (shutdown): the finally below kills our child
        os.mkdir(workdir, 0o700)
        job["workdir"] = workdir
        try:
            result = referee.run(job)
        except Exception as exc:
            result = {"status": "crash", "error": _one_line(f"sandbox referee failed: {type(exc).__name__}: {exc}")}
        result = referee.end(result)  # how the child ended decides too, whatever it said last
        # Report, then clean up: the trainer counts this game as done only once we have exited.
        send_frame(sock, json.dumps(result).encode())
    finally:
        referee.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    os._exit(0)


# How long a child has to exit once its game is over and its board pipe closed: an honest one exits at once (0, on
# end of file). Escaped code that wrote its last reply itself and then makes a refused call dies of SIGSYS within it.
EXIT_GRACE = 0.005


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
        if kind == "V":  # the audit hook saw the strategy reach for what policy.py forbids
            raise _Stop("violation", text)
        return kind, text

    def end(self, result: dict) -> dict:
        """At every end of a game: close the board pipe, give the child EXIT_GRACE to exit, kill it, and score a death
        by SIGSYS (the kernel's answer to a call outside the allowlist) as a violation, whatever the child replied
        last: escaped code may write its own final frame (an error, a winning key, a malformed frame) and then step
        outside."""
        if self.wait_status is None:  # else a timeout or a closed pipe ended it already
            os.close(self.wfd)  # an honest child reads end of file and exits 0, closing its reply pipe
            deadline = time.monotonic() + EXIT_GRACE
            while (remaining := deadline - time.monotonic()) > 0 and select.select([self.rfd], [], [], remaining)[0]:
                if not os.read(self.rfd, 1 << 16):  # whatever it still writes is ignored; end of file: it is gone
                    break
        self.kill()
        status = self.wait_status
        if result["status"] != "violation" and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSYS:
            result = dict(result, status="violation", error=SECCOMP_KILL)
        return result

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
        if os.WIFSIGNALED(self.wait_status) and os.WTERMSIG(self.wait_status) == signal.SIGSYS:
            return _Stop("violation", SECCOMP_KILL)  # only the kernel's seccomp sends it: the child may not signal
        return _Stop("crash", _describe_exit(self.wait_status))

    def kill(self) -> None:
        """SIGKILL the child's group and every descendant we adopted; reap them all. (Once the child is reaped its pid
        is free for another process: what is left of its group is adopted, and killed as such.)"""
        if self.wait_status is None:
            for kill in (os.killpg, os.kill):
                try:
                    kill(self.pid, signal.SIGKILL)
                except OSError:
                    pass
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
        }
        return f"killed by signal {name}{limit.get(sig, '')}"
    if os.WIFEXITED(status):
        return f"exited with status {os.WEXITSTATUS(status)}"
    return f"ended with wait status {status}"


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    clean = "".join(c if c.isprintable() else "?" for c in text)
    return clean if len(clean) <= MAX_ERROR_CHARS else clean[: MAX_ERROR_CHARS - 3] + "..."


def _root_can_be_dropped() -> bool:
    """Whether a child can leave root here, tried once at the server's start in a throwaway fork."""
    pid = os.fork()
    if pid == 0:
        try:
            sandbox_child.drop_to_own_user()
            os._exit(0 if os.geteuid() != 0 else 1)
        finally:
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0
