"""An output folder, and its one owner: who holds it, what it holds, what a run, a save, a merge or an evaluation may do
there, and the checkpoints a resume can load.

take() locks the folder before it reads a byte of it (flock on the folder's own descriptor: the kernel releases it
when the process ends, kill -9 included), reads what the folder holds once (survey: one of STATES), and decides what
was asked (decide: a new run, --resume, --overwrite_output_dir), in one line when it refuses, whose advice works. What
a run writes it records first (MANIFEST, the run's claims); what it removes is what its record claims, through the
folder's descriptor, never through a link. A folder a command publishes (final/, a merge) carries MARK: the files it
wrote, each with its size and modification time, so a copied mark proves nothing. docs/TRAINING.md, *Outputs*, has the
table of what each state and each command give.

transformers 5.17 writes checkpoint-N in place (no temporary folder, no rename), trainer_state.json last, and its own
get_last_checkpoint takes the highest-numbered folder even when it is half-written: here a checkpoint counts only
when everything a resume reads is whole.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

import checkpoint_state

MANIFEST = ".train_2048-run.json"  # the run's record: what it claimed (made, or will make) and adopted there
LOCK = ".train_2048-run.lock"  # who holds the folder (pid, host, since); the lock itself is on the folder
MARK = ".train_2048-wrote-this"  # in a folder a command published: {"by": the command, "files": what it wrote}
# The fixed names a run writes in its output_dir; checkpoint-N, runs/<its own>, its temporary folders and the
# archive's copies are claimed as they are made. best: the adapters of the run's best evaluation (trainer.py),
# claimed when first written (a run recorded before it).
RUN_NAMES = ("training.log", "metrics.jsonl", "runs", "strategies", "final", "final-merged_16bit", "final-mxfp4",
             "tiny-model", "best")  # fmt: skip
CHECKPOINT = re.compile(r"checkpoint-\d+")
TEMPORARY = re.compile(r"\.(train_2048|strategies-\d+)-[0-9a-f]{8}")  # user_files.make_folder's names, ours only
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

# What an output folder holds, read once under its lock (survey), and what each state lets a run do (decide).
EMPTY = "empty"  # nothing there (or no folder yet): every run starts
USERS = "the user's files only"  # no record, no checkpoint: a run starts where none of its names is taken
UNTRAINED = "a run that never trained a step"  # a record, no checkpoint, final/ or metrics: started again, unasked
RUN = "a run"  # a record and a trained step: --resume auto continues it, --overwrite_output_dir deletes its claims
OLDER = "an older train_2048's run"  # checkpoints and no record: --resume auto adopts it; nothing of it is deleted
STATES = (EMPTY, USERS, UNTRAINED, RUN, OLDER)


class FolderRefused(Exception):
    """The output folder cannot be used as asked, in one line (the command exits with status 2)."""


class Finished(Exception):
    """A resume of a run that has reached its --max_steps: nothing to do, said in one line (exit status 0)."""


# --- what a folder holds -----------------------------------------------------------------------------------------


@dataclass
class Survey:
    """What output_dir held when its lock was taken."""

    path: Path
    fd: int  # the folder's descriptor, locked
    names: set[str]  # its entries, our lock's file apart
    record: dict | None  # the run's record ({"claims", "adopted"}), or None
    checkpoint: Path | None  # the newest checkpoint that can be loaded
    skipped: list[str]  # a line for each newer one that cannot
    state: str


def survey(path: Path, fd: int) -> Survey:
    """What the folder (`fd`, locked) holds, and so its state; FolderRefused when its record cannot be read."""
    names = set(os.listdir(fd)) - {LOCK}
    record = read_manifest(path, fd) if MANIFEST in names else None
    checkpoint, skipped = None, []
    for found in checkpoint_state.checkpoints(path):
        problem = checkpoint_state.checkpoint_damage(found)
        if problem is None:
            checkpoint = found
            break
        skipped.append(f"{found.name} is skipped: {problem}")
    has_checkpoints = any(CHECKPOINT.fullmatch(n) and kind(fd, n) == "folder" for n in names)
    if record is not None:
        state = RUN if has_checkpoints or names & {"final", "metrics.jsonl"} else UNTRAINED
    else:
        state = OLDER if has_checkpoints else USERS if names else EMPTY
    return Survey(path, fd, names, record, checkpoint, skipped, state)


def kind(fd: int, name: str) -> str | None:
    """What `name` is in the folder `fd` (never following a link): "file", "folder", "link", "other", None (absent)."""
    try:
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return None
    return ("link" if stat.S_ISLNK(mode) else "folder" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode)
            else "other")  # fmt: skip


def read_json_at(fd: int, name: str, limit: int, what: str):
    """The JSON file `name` of the folder `fd`, opened without following a link, read with user_files' limits."""
    import user_files

    try:
        file = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    except OSError as exc:
        why = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise user_files.FileRefused(f"cannot read {what} {name}: {why}") from None
    try:
        return user_files.read_json(f"/proc/self/fd/{file}", limit, what)  # the file opened, as user_files reads
    finally:
        os.close(file)


def read_manifest(output_dir: Path, fd: int | None = None) -> dict:
    """The run's record; FolderRefused when it cannot be read or is not one (a link, a device, hand-edited)."""
    import user_files

    try:
        opened = fd if fd is not None else os.open(output_dir, FOLDER_FLAGS)
        try:
            record = read_json_at(opened, MANIFEST, 1 << 20, "record")
        finally:
            if fd is None:
                os.close(opened)
        claims, adopted = record["claims"], record.get("adopted", [])
        for names in (claims, adopted):
            if not isinstance(names, list) or not all(isinstance(c, str) and owned_name(c) for c in names):
                raise ValueError("claims outside the run's names")
    except (OSError, user_files.FileRefused, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise FolderRefused(f"output_dir {output_dir}: its record of the run, {MANIFEST}, cannot be read "
                            f"({user_files.shorten(exc, 160)}), so nothing there is deleted or continued: move "
                            "the folder's files yourself, or give another --output_dir") from None  # fmt: skip
    return {"claims": claims, "adopted": adopted}


def owned_name(claim: str) -> bool:
    """A claim names one of the run's entries: a run name, checkpoint-N, a temporary folder of ours, or runs/<one
    folder>; never a path out."""
    parts = claim.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return False
    if len(parts) == 2:
        return parts[0] == "runs"
    return len(parts) == 1 and (claim in (*RUN_NAMES, "README.md") or bool(CHECKPOINT.fullmatch(claim) or
                                                                            TEMPORARY.fullmatch(claim)))  # fmt: skip


def inside_a_run(path: Path) -> str | None:
    """Why `path` may not be an output folder: it is, or is inside, a folder a run claims (its checkpoints are rotated
    and its folders replaced as it goes) or a folder a command published (final/: its next save replaces what it
    wrote there). None when it is not."""
    existing = Path(os.path.abspath(path))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # the part that exists: where the folder would be made
    existing = existing.resolve()  # through links: where it is
    for folder in (existing, *existing.parents):
        by = marked_by(folder)
        if by is not None:
            return f"is inside {folder}, a folder {by} published (its next save replaces what it wrote there)"
        if folder.name in claims_of(folder.parent):
            return f"is inside {folder}, which the run in {folder.parent} wrote (and replaces or deletes as it goes)"
    return None


# --- the lock ----------------------------------------------------------------------------------------------------


def lock(output_dir: Path, fd: int) -> int:
    """Lock the folder `fd` for this process: the descriptor that holds the lock (the folder's own; where the file
    system cannot lock a folder, a lock file proven ours). FolderRefused when a live run holds it."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        raise FolderRefused(f"output_dir {output_dir} is in use by a running train_2048 ({lock_holder(output_dir)}): "
                            "wait for it to end (or stop it), or give another --output_dir") from None  # fmt: skip
    except OSError:  # NFS locks no folder: the lock file, opened without following a link
        pass
    file = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
    info = os.fstat(file)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_uid != os.geteuid():
        os.close(file)
        raise FolderRefused(f"output_dir {output_dir}: {LOCK} is not a lock file of train_2048's (a hard link, or "
                            "another user's file), so it is not written: remove it, or give another --output_dir")  # fmt: skip
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(file)
        raise FolderRefused(f"output_dir {output_dir} is in use by a running train_2048 ({lock_holder(output_dir)}): "
                            "wait for it to end (or stop it), or give another --output_dir") from None  # fmt: skip
    return file


def lock_holder(output_dir: Path) -> str | None:
    """Who holds the folder's lock (pid, host, since when), or None when no live run does."""
    import fcntl

    try:
        fd = os.open(output_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            held = True
        except OSError:  # a file system that locks no folder: the lock file's lock
            held = lock_file_held(fd)
        else:
            held = False
        if not held:
            return None
        try:
            said = os.read(info := os.open(LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd), 200)
            os.close(info)
        except OSError:
            said = b""
        return said.decode("utf-8", "replace").strip() or "a process that has not said who it is yet"
    finally:
        os.close(fd)


def lock_file_held(fd: int) -> bool:
    import fcntl

    try:
        file = os.open(LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return False
    try:
        fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(file)
    return False


# --- what a run may do there -------------------------------------------------------------------------------------


@dataclass
class Held:
    """A folder this process holds for a run, and what was decided: the checkpoint to continue from (None: step 0),
    the names its start removes (`clear`), what it adopts (an older run's files: never deleted), and lines to log."""

    path: Path
    fd: int  # the folder's descriptor: every name below is read, written and removed through it
    lock_fd: int
    state: str
    checkpoint: Path | None = None
    clear: list[str] = field(default_factory=list)
    adopt: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    created: bool = False  # the run made the folder
    before: set[str] = field(default_factory=set)  # what was there once `clear` is done
    record: dict | None = None

    def start(self, push_to_hub: bool = False) -> None:
        """The decision carried out: `clear` removed, the record written (the names the run will write claimed; on a
        resume, the record kept), who holds the folder said in LOCK. Nothing is written before this."""
        for name in self.clear:
            remove_claimed(self.fd, name)
        self.before = set(os.listdir(self.fd)) - {LOCK}
        if self.record is None or self.clear:
            adopted = sorted(self.adopt or (self.record or {}).get("adopted", []))
            runs_there = "runs" in self.before and "runs" not in (self.record or {}).get("claims", [])
            claims = [n for n in RUN_NAMES if n not in adopted and not (n == "runs" and runs_there)]
            if push_to_hub and "README.md" not in self.before:
                claims.append("README.md")  # the model card a hub push carries
            self.record = {"claims": sorted(claims), "adopted": adopted}
            write_record(self.fd, self.record)
        say_who(self.fd, self.lock_fd)
        HOLDING[os.path.abspath(self.path)] = self

    def claim(self, name: str) -> None:
        if self.record is not None and name not in self.record["claims"]:
            self.record["claims"] = sorted([*self.record["claims"], name])
            write_record(self.fd, self.record)

    def unclaim(self, name: str) -> None:
        if self.record is not None and name in self.record["claims"]:
            self.record["claims"] = [n for n in self.record["claims"] if n != name]
            write_record(self.fd, self.record)

    def leave_as_found(self) -> None:
        """A run that stops before it trained: what it made goes (its claims that were not there when it started, its
        record and lock file if it wrote them, the folder if it made it), so the next run starts there unasked. A
        resume leaves everything."""
        if self.checkpoint is not None or self.record is None:
            return
        for name in sorted(self.record["claims"], reverse=True):  # runs/<folder> (this run's) before runs
            if "/" in name or name not in self.before:
                remove_claimed(self.fd, name)
        for name in (MANIFEST, LOCK):
            if name not in self.before:
                with_no_error(os.unlink, name, dir_fd=self.fd)
        if self.created:
            with_no_error(os.rmdir, self.path)

    def release(self) -> None:
        HOLDING.pop(os.path.abspath(self.path), None)
        for fd in {self.lock_fd, self.fd}:
            with_no_error(os.close, fd)


HOLDING: dict[str, Held] = {}  # the folders this process holds, by absolute path (claim and unclaim write there)


def with_no_error(call, *args, **kwargs) -> None:
    try:
        call(*args, **kwargs)
    except OSError:
        pass


def take(output_dir: Path, *, resume: str | None = None, overwrite: bool = False, max_steps: int = -1) -> Held:
    """The folder held for a run (its lock taken before anything in it is read), what it holds, and what was asked of
    it decided: a Held, with nothing written but the folder itself when it was not there (Held.start writes). A
    refusal is FolderRefused (one line, whose advice works) or Finished, and leaves the folder as it was."""
    if os.path.islink(output_dir) and not output_dir.exists():
        raise FolderRefused(f"output_dir {output_dir} is a symbolic link to nothing")
    created = not output_dir.exists()
    output_dir.mkdir(parents=True, exist_ok=True)
    fd = lock_fd = -1
    try:
        fd = os.open(output_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the folder named, a link or not
        lock_fd = lock(output_dir, fd)
        held = decide(survey(output_dir, fd), resume=resume, overwrite=overwrite, max_steps=max_steps)
    except BaseException:
        for opened in {fd, lock_fd} - {-1}:
            os.close(opened)
        if created:
            with_no_error(os.rmdir, output_dir)
        raise
    held.fd, held.lock_fd, held.created = fd, lock_fd, created
    return held


def decide(s: Survey, *, resume: str | None, overwrite: bool, max_steps: int) -> Held:
    """What a run asked of a folder in state `s` gives: the table in docs/TRAINING.md, *Outputs*."""
    where, record = s.path, s.record
    claims, adopted = set(record["claims"]) if record else set(), set(record["adopted"]) if record else set()
    held = Held(where, -1, -1, s.state, record=record)
    present_adopted = sorted(adopted & s.names)
    loadable = "continue it with --resume auto, " if s.checkpoint is not None else ""
    if resume not in (None, "auto"):  # a checkpoint named: its own folder's run, or a new folder
        checkpoint = Path(resume)
        problem = checkpoint_state.checkpoint_damage(checkpoint)
        if problem:
            raise FolderRefused(f"--resume {resume}: not a checkpoint that can be loaded ({problem})")
        if checkpoint.resolve().parent != where.resolve() and s.state in (RUN, OLDER):
            raise FolderRefused(f"output_dir {where} holds another run than {checkpoint}'s: continue there "
                                f"(--output_dir {checkpoint.parent}) or give an empty --output_dir")  # fmt: skip
        held.checkpoint = checkpoint
    elif s.state == RUN and resume == "auto":
        if s.checkpoint is None:
            damaged = f" ({'; '.join(s.skipped)})" if s.skipped else ""
            raise FolderRefused(f"--resume auto: {where} holds a run but no checkpoint that can be loaded{damaged}; "
                                f"{start_over(present_adopted)}, or give another --output_dir")  # fmt: skip
        held.checkpoint = s.checkpoint
    elif s.state == RUN and overwrite:
        if present_adopted:
            raise FolderRefused(f"--overwrite_output_dir: {where} holds files of an older run that this run adopted "
                                f"({', '.join(present_adopted[:4])}), which train_2048 never deletes: move them "
                                "yourself, then run again, or give another --output_dir")  # fmt: skip
        held.clear = sorted(claims, reverse=True)
    elif s.state == RUN:
        at = f" at step {checkpoint_state.checkpoint_step(s.checkpoint)}" if s.checkpoint else ""
        if s.checkpoint is not None and 0 < max_steps <= checkpoint_state.checkpoint_step(s.checkpoint):
            loadable = f"continue it with --resume auto and a --max_steps above {checkpoint_state.checkpoint_step(s.checkpoint)}, "
        raise FolderRefused(f"output_dir {where} holds a run{at}: {loadable}{start_over(present_adopted)}, or give "
                            "another --output_dir")  # fmt: skip
    elif s.state == OLDER and resume == "auto" and s.checkpoint is not None:
        held.checkpoint = s.checkpoint
    elif s.state == OLDER:
        files = sorted(n for n in s.names if n in RUN_NAMES or CHECKPOINT.fullmatch(n))
        none = "no checkpoint that can be loaded and " if resume == "auto" else ""
        raise FolderRefused(f"output_dir {where} holds a run of an older train_2048 ({', '.join(files[:4])}) with "
                            f"{none}no record ({MANIFEST}) of what it wrote, so nothing there is deleted: "
                            f"{loadable}move its files yourself, or give another --output_dir")  # fmt: skip
    elif s.state == UNTRAINED:
        keep = set() if overwrite else {"training.log"}
        held.clear = sorted((claims - keep) & {n.split("/")[0] for n in s.names} | {n for n in claims if "/" in n},
                            reverse=True)  # fmt: skip
        held.notes.append(f"{where} held a run that never trained a step: it starts again (its files removed"
                          f"{'' if overwrite else ', training.log kept'})")  # fmt: skip
    if s.state == OLDER:  # a resume of its checkpoint (every other case was refused above)
        held.adopt = sorted(n for n in s.names if n in RUN_NAMES or CHECKPOINT.fullmatch(n))
    refuse_what_a_run_cannot_write(s, held)
    held.notes += s.skipped if held.checkpoint is not None and resume == "auto" else []
    if held.checkpoint is not None and max_steps > 0:
        finished(where, held.checkpoint, max_steps)
    return held


def start_over(adopted: list[str]) -> str:
    if adopted:
        return (f"start over with --overwrite_output_dir true once you have moved {', '.join(adopted[:4])} (an older "
                "run's files it adopted, which train_2048 never deletes)")  # fmt: skip
    return "start over with --overwrite_output_dir true (only the files that run wrote are deleted)"


def refuse_what_a_run_cannot_write(s: Survey, held: Held) -> None:
    """Every name the run writes, as it is now: a link it did not make, or a file or folder it did not write (its
    record claims none, nor does a checkpoint prove it an older run's), is refused, never written through; final/
    must be a folder whose own files a save can tell (MARK), or empty."""
    claims = set(s.record["claims"]) if s.record else set()
    ours = claims | set(held.adopt) | set(s.record["adopted"] if s.record else [])
    for name in sorted(s.names):
        if name in held.clear or not (name in RUN_NAMES or CHECKPOINT.fullmatch(name)):
            continue
        what = kind(s.fd, name)
        if what == "link" and not (name == "strategies" and archive_link(s.path / name)):
            raise FolderRefused(f"output_dir {s.path}: {name} is a symbolic link ({os.readlink(s.path / name)}): "
                                "train_2048 never writes through a link it did not make; move it")  # fmt: skip
        if name not in ours and name != "runs":
            raise FolderRefused(f"output_dir {s.path} holds {name}, which no run of train_2048 recorded writing: a "
                                "run would write into it: move it, or give another --output_dir")  # fmt: skip
    if "final" in s.names and "final" not in held.clear and kind(s.fd, "final") == "folder":
        foreign = not_published_by(s.path / "final", "train_2048")
        if foreign:
            raise FolderRefused(f"output_dir {s.path}: final holds {', '.join(foreign[:3])}, which no save of "
                                "train_2048 lists writing (a file of yours, a copy made without its times, or an older "
                                f"train_2048's save): this run's save would not replace it: move final aside (mv "
                                f"{s.path / 'final'} {s.path / 'final.old'}), then run again")  # fmt: skip


def archive_link(path: Path) -> bool:
    """`strategies` as the archive makes it: a link to one of its copies beside it."""
    target = os.readlink(path)
    return "/" not in target and bool(TEMPORARY.fullmatch(target)) and target.startswith(".strategies-")


def finished(where: Path, checkpoint: Path, max_steps: int) -> None:
    """A resume never trains past the end it was given: Finished when the checkpoint stands exactly there,
    FolderRefused beyond it."""
    step = checkpoint_state.checkpoint_step(checkpoint)
    if step > max_steps:
        raise FolderRefused(f"--max_steps {max_steps}: {checkpoint} is at step {step} already, so nothing is "
                            f"trained or replaced: raise --max_steps above {step} to go on")  # fmt: skip
    if step == max_steps:
        final = where / "final"
        kept = "final/ holds its adapters" if (final / "adapter_config.json").is_file() or (
            final / "config.json").is_file() else f"{checkpoint.name} holds its adapters"  # fmt: skip
        raise Finished(f"the run in {where} finished at step {step} of --max_steps {max_steps} ({kept}): "
                       f"nothing trained or replaced; raise --max_steps above {step} to go on")  # fmt: skip


# --- writing and removing through the folder's descriptor ----------------------------------------------------------


def write_through(fd: int, name: str, data: str) -> None:
    """`name` in the folder `fd` holds `data`: a new file of ours renamed over it, so a link or a hard link of that
    name is replaced, never written through."""
    tmp = f".train_2048-{name.lstrip('.')}.{os.getpid()}.tmp"
    with_no_error(os.unlink, tmp, dir_fd=fd)
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
    with os.fdopen(out, "w") as f:
        f.write(data)
    os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)


def write_record(fd: int, record: dict) -> None:
    write_through(fd, MANIFEST, json.dumps({"train_2048_run": 1, **record}, indent=1) + "\n")


def say_who(fd: int, lock_fd: int) -> None:
    """Who holds the folder, in LOCK: renamed into place (the lock is on the folder), or written into the lock file
    proven ours (the lock is on it)."""
    import socket
    import time

    said = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    if lock_fd == fd:
        write_through(fd, LOCK, said)
    else:
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, said.encode(), 0)


def remove_claimed(fd: int, name: str) -> None:
    """Remove one claimed name of the folder `fd`: through its descriptor (runs/<x> through runs/'s own, opened
    without following a link), a link itself and never what it points to, a published folder's own files only (MARK:
    what else is there stays), the archive's link and copies, checkpoints and temporary folders whole."""
    parent, _, leaf = name.rpartition("/")
    if parent:
        try:
            sub = os.open(parent, FOLDER_FLAGS, dir_fd=fd)
        except OSError:
            return  # runs/ gone, or replaced by a link since: what that points to is not the run's
        try:
            remove_claimed(sub, leaf)
        finally:
            os.close(sub)
        return
    what = kind(fd, name)
    if what in ("link", "file", "other"):
        with_no_error(os.unlink, name, dir_fd=fd)
    elif what == "folder" and name in ("runs", "strategies"):
        with_no_error(os.rmdir, name, dir_fd=fd)  # the run made it; a folder of yours put inside since keeps it
    elif what == "folder" and name in RUN_NAMES:  # final/, final-*/, tiny-model/: what their MARK lists
        remove_published(fd, name)
    elif what == "folder":  # checkpoint-N, a temporary folder, an archive copy: the run's whole
        shutil.rmtree(name, dir_fd=fd, ignore_errors=True)


# --- published folders: what a MARK proves ------------------------------------------------------------------------


def identity(info: os.stat_result) -> list | None:
    """What a mark keeps of a file it lists: its size and modification time (a copy made without its times, or the
    file changed since, is not the one written); a folder by its kind; None for anything else."""
    if stat.S_ISREG(info.st_mode):
        return [info.st_size, info.st_mtime_ns]
    return ["folder"] if stat.S_ISDIR(info.st_mode) else None


def listing(fd: int) -> dict[str, list]:
    """Each entry of the folder `fd` but its MARK, with its identity."""
    out = {}
    for name in os.listdir(fd):
        if name != MARK:
            out[name] = identity(os.stat(name, dir_fd=fd, follow_symlinks=False))
    return out


def read_mark(fd: int) -> dict | None:
    """The MARK of the folder `fd`: {"by", "files"} ("files" None for an older mark that lists none), or None."""
    import user_files

    try:
        mark = read_json_at(fd, MARK, 1 << 20, "mark")
    except user_files.FileRefused:
        return None
    if not isinstance(mark, dict) or not isinstance(mark.get("by"), str):
        return None
    files = mark.get("files")
    return {"by": mark["by"], "files": files if isinstance(files, dict) else None}


def own_files(fd: int, by: str) -> set[str]:
    """The entries of the folder `fd` that `by` wrote: its MARK lists each as it is now."""
    mark = read_mark(fd)
    if mark is None or mark["by"] != by or mark["files"] is None:
        return set()
    now = listing(fd)
    return {name for name, was in mark["files"].items() if name in now and now[name] == was and was is not None}


def marked_by(folder: Path) -> str | None:
    """Which command published `folder` (its MARK), or None: a user's folder, a link, or not a folder."""
    try:
        fd = os.open(folder, FOLDER_FLAGS)
    except OSError:
        return None
    try:
        mark = read_mark(fd)
    finally:
        os.close(fd)
    return mark["by"] if mark else None


def not_published_by(folder: Path, by: str) -> list[str]:
    """What in `folder` a publish by `by` cannot tell from a user's: everything, unless MARK lists its files; then
    the files it lists that changed since. Empty for an empty folder."""
    fd = os.open(folder, FOLDER_FLAGS)
    try:
        mark, now = read_mark(fd), listing(fd)
        if mark is None or mark["by"] != by or mark["files"] is None:
            return sorted(now)
        return sorted(name for name, was in mark["files"].items() if name in now and now[name] != was)
    finally:
        os.close(fd)


def remove_published(fd: int, name: str) -> None:
    """Remove what a command published as `name` in the folder `fd`: the files its MARK lists, unchanged, then MARK
    and the folder if nothing else is left there (a user's notes, an evaluation's folder)."""
    try:
        sub = os.open(name, FOLDER_FLAGS, dir_fd=fd)
    except OSError:
        return
    try:
        mark = read_mark(sub)
        for own in own_files(sub, mark["by"]) if mark else ():
            if kind(sub, own) == "folder":
                shutil.rmtree(own, dir_fd=sub, ignore_errors=True)
            else:
                os.unlink(own, dir_fd=sub)
        if mark and not set(os.listdir(sub)) - {MARK}:
            os.unlink(MARK, dir_fd=sub)
    finally:
        os.close(sub)
    with_no_error(os.rmdir, name, dir_fd=fd)


# --- claims of the process that holds the folder -----------------------------------------------------------------


def claim(output_dir: Path, name: str) -> None:
    """Add `name` (checkpoint-N, runs/<folder>, a temporary folder) to the record of the run this process holds
    output_dir for, before it is written; a process that holds no record (another rank, a merge) claims nothing."""
    held = HOLDING.get(os.path.abspath(output_dir))
    if held is not None:
        held.claim(name)


def unclaim(output_dir: Path, name: str) -> None:
    """`name` is gone (removed, or renamed into place under a claimed name), or no longer the run's."""
    held = HOLDING.get(os.path.abspath(output_dir))
    if held is not None:
        held.unclaim(name)


def claimed(output_dir: Path) -> list[str]:
    """What the run in output_dir claims: the record this process holds, else the folder's."""
    held = HOLDING.get(os.path.abspath(output_dir))
    if held is not None and held.record is not None:
        return list(held.record["claims"])
    return claims_of(output_dir)


def claims_of(folder: Path) -> list[str]:
    """The claims of the record in `folder`; [] without one that can be read."""
    if not (folder / MANIFEST).is_file():
        return []
    try:
        return read_manifest(folder)["claims"]
    except FolderRefused:
        return []


def writable(path: Path) -> bool:
    """True when `path` is, or can be created as, a writable directory; creates nothing. Where it must be created, a
    folder is made in the nearest existing one and removed: /proc passes a permission check and refuses every file."""
    if path.is_dir():
        return os.access(path, os.W_OK | os.X_OK)  # not probed: the folder of an earlier run stays as it was
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return False
    try:
        os.rmdir(make_folder(existing, ".train_2048-"))
    except OSError:
        return False
    return True


def make_folder(parent: Path, prefix: str) -> Path:
    """A new folder in `parent` named `prefix` and 8 random hex digits (TEMPORARY), with the mode the user's umask
    gives a folder (mkdtemp's is 0700 whatever the umask); never an existing name, never through a link."""
    import secrets

    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            os.mkdir(path, 0o777)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(errno.EEXIST, "no free name", str(parent / prefix))
