"""An output folder and what it holds: whether a run is there, its checkpoints and whether each can be loaded, and
the files a run writes. Facts only, read cheaply with nothing loaded; train_2048.py decides what to do with them.

transformers 5.17 writes checkpoint-N in place (no temporary folder, no rename), trainer_state.json last, and its own
get_last_checkpoint takes the highest-numbered folder even when it is half-written: here a checkpoint counts only
when everything a resume reads is whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

import checkpoint_state

# A run's record of its folder: the names it claimed (created, or will create) there, written with exclusive creation
# when the run starts. --overwrite_output_dir deletes exactly these, and a folder holding a run's kinds of files
# without it is refused, never guessed at (git's and rsync's habit: delete only what you know you created).
MANIFEST = ".train_2048-run.json"
LOCK = ".train_2048-run.lock"  # flock'ed by the live run: the kernel releases it when the process dies (kill -9 too)
OURS = (".train_2048-", ".strategies-", ".strategies.link-")  # temporary names our commands make; no user picks them
# The fixed names a run writes in its output_dir (checkpoint-N apart: each is claimed as it is saved).
RUN_NAMES = ("training.log", "metrics.jsonl", "runs", "strategies", "final", "final-merged_16bit", "final-mxfp4",
             "tiny-model")  # fmt: skip
CHECKPOINT = re.compile(r"checkpoint-\d+")
# Names that mark a run's results: a folder holding one holds a run (and a fresh run there is refused).
RESULTS = ("metrics.jsonl", "strategies", "final", "final-merged_16bit", "final-mxfp4")


class FolderRefused(Exception):
    """The output folder cannot be used as asked, in one line (the command exits with status 2)."""


def results_held(output_dir: Path) -> list[str]:
    """The names in output_dir that only a run writes (its results and checkpoints)."""
    if not output_dir.is_dir():
        return []
    return sorted(p.name for p in output_dir.iterdir() if p.name in RESULTS or CHECKPOINT.fullmatch(p.name))


def holds_a_run(output_dir: Path) -> bool:
    return (output_dir / MANIFEST).exists() or (output_dir / MANIFEST).is_symlink() or bool(results_held(output_dir))


def read_manifest(output_dir: Path) -> dict:
    """The run's record; FolderRefused when it cannot be read or is not one (a link, a device, hand-edited)."""
    import user_files

    path = output_dir / MANIFEST
    try:
        if path.is_symlink():
            raise user_files.FileRefused(f"{path}: a symbolic link, not the record a run writes")
        record = user_files.read_json(path, 1 << 20, "record")
        claims = record["claims"]
        if not isinstance(claims, list) or not all(isinstance(c, str) and owned_name(c) for c in claims):
            raise ValueError("claims outside the run's names")
    except (user_files.FileRefused, ValueError, TypeError, KeyError) as exc:
        raise FolderRefused(f"output_dir {output_dir}: its record of the run, {MANIFEST}, cannot be read "
                            f"({user_files.shorten(exc, 160)}), so nothing there is deleted or continued: move "
                            "the folder's files yourself, or give another --output_dir") from None  # fmt: skip
    return record


def owned_name(claim: str) -> bool:
    """A claim names one of the run's entries: a run name, checkpoint-N, or runs/<one folder>; never a path out."""
    parts = claim.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return False
    if len(parts) == 2:
        return parts[0] == "runs"
    return len(parts) == 1 and (claim in (*RUN_NAMES, "README.md") or bool(CHECKPOINT.fullmatch(claim)))


def check_folder(output_dir: Path, *, fresh: bool, overwrite: bool, resume: bool) -> None:
    """Whether a run may start in output_dir as asked, read with nothing written: FolderRefused otherwise.

    fresh: a new run (refused where a run is, unless overwrite); resume: continuing the folder's run. Whatever the
    case, no name the run would write may be a symbolic link or a file the run did not write (a fresh run appends
    training.log and loads tiny-model/ when they are there)."""
    if output_dir.is_symlink() and not output_dir.exists():
        raise FolderRefused(f"output_dir {output_dir} is a symbolic link to nothing")
    if not output_dir.is_dir():
        return
    holder = lock_holder(output_dir)
    if holder:
        raise FolderRefused(f"output_dir {output_dir} is in use by a running train_2048 ({holder}): wait for it to "
                            "end (or stop it), or give another --output_dir")  # fmt: skip
    recorded = (output_dir / MANIFEST).exists() or (output_dir / MANIFEST).is_symlink()
    claims = set(read_manifest(output_dir)["claims"]) if recorded else set()
    held = results_held(output_dir)
    if fresh and (recorded or held) and not overwrite:
        raise FolderRefused(f"output_dir {output_dir} holds a run: continue it with --resume auto, start over with "
                            "--overwrite_output_dir true (only the files that run wrote are deleted), or give another "
                            "--output_dir")  # fmt: skip
    if overwrite and held and not recorded:
        raise FolderRefused(f"output_dir {output_dir} holds a run's files ({', '.join(held[:4])}) but no record of "
                            f"what a run wrote there ({MANIFEST}: a run of an older train_2048, or files of your own), "
                            "so --overwrite_output_dir deletes nothing: move or delete them yourself, or give another "
                            "--output_dir")  # fmt: skip
    starting_over = fresh and overwrite
    for name in held:
        if foreign_link(output_dir / name) and not (starting_over and name in claims):
            raise FolderRefused(f"output_dir {output_dir}: {name} is a symbolic link ({os.readlink(output_dir / name)}): "
                                "train_2048 never writes through a link it did not make; move it")  # fmt: skip
    for name in RUN_NAMES:
        path = output_dir / name
        if not (path.exists() or path.is_symlink()) or name == "runs":
            continue
        ours = name in claims or (resume and not recorded)  # --resume adopts an older train_2048's run
        if starting_over and name in claims:
            continue  # deleted before the new run starts
        if not ours:
            raise FolderRefused(f"output_dir {output_dir} holds {name}, which no run of train_2048 recorded writing: a "
                                "run would write into it: move it, or give another --output_dir")  # fmt: skip
        if foreign_link(path):
            raise FolderRefused(f"output_dir {output_dir}: {name} is a symbolic link ({os.readlink(path)}): "
                                "train_2048 never writes through a link it did not make; move it")  # fmt: skip


def foreign_link(path: Path) -> bool:
    """A symbolic link a run did not make: every link but `strategies`, the archive's link to its latest copy."""
    if not path.is_symlink():
        return False
    return not (path.name == "strategies" and os.readlink(path).startswith(".strategies-") and "/" not in os.readlink(path))


def lock_holder(output_dir: Path) -> str | None:
    """Who holds the folder's lock (pid, host, since when), or None when no live run does."""
    import fcntl

    try:
        fd = os.open(output_dir / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None  # no lock file (or not one of ours): no run of ours is live there
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        said = os.read(fd, 200).decode("utf-8", "replace").strip()
        return said or "a process that has not said who it is yet"
    finally:
        os.close(fd)
    return None


def take(output_dir: Path, *, overwrite: bool, push_to_hub: bool = False) -> int:
    """Start the run's hold on output_dir: the lock, then (a new run) a fresh record claiming the names the run will
    write, or (a resume) the record kept, an older train_2048's run adopted. With overwrite, the earlier run's
    claimed files are deleted first, under the lock. Returns the lock's file descriptor (closing it releases it).
    FolderRefused when another run holds the folder (checked again here: two runs may have passed check_folder)."""
    import fcntl
    import socket
    import time

    output_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(output_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FolderRefused(f"output_dir {output_dir} is in use by a running train_2048 ({lock_holder(output_dir)}): "
                            "wait for it to end (or stop it), or give another --output_dir") from None  # fmt: skip
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
    try:
        recorded = (output_dir / MANIFEST).exists()
        if overwrite and recorded:
            clear_run(output_dir)
            recorded = False
        if recorded:
            return fd
        # Every name the run writes (a fresh run's were checked absent; a resume adopts an older train_2048's run,
        # its checkpoints included); a runs/ already there is shared: the run claims its own folder inside it.
        runs_there = (output_dir / "runs").exists() or (output_dir / "runs").is_symlink()
        claims = [name for name in RUN_NAMES if name != "runs" or not runs_there]
        claims += [name for name in results_held(output_dir) if CHECKPOINT.fullmatch(name)]
        if push_to_hub and not (output_dir / "README.md").exists():
            claims.append("README.md")  # the model card a hub push carries
        write_manifest(output_dir, sorted(set(claims)), create=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_manifest(output_dir: Path, claims: list[str], create: bool = False) -> None:
    """The record, replaced whole (a temporary file of ours, renamed): never written through a link."""
    import user_files

    record = json.dumps({"train_2048_run": 1, "claims": claims}, indent=1) + "\n"
    if create:
        user_files.write_new(output_dir / MANIFEST, record)
        return
    tmp = output_dir / f".train_2048-run.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    user_files.write_new(tmp, record)
    os.replace(tmp, output_dir / MANIFEST)


def claim(output_dir: Path, name: str) -> None:
    """Add `name` (checkpoint-N, runs/<folder>) to the run's record before it is written."""
    path = output_dir / MANIFEST
    if not path.is_file() or path.is_symlink():
        return  # a process that holds no record (another rank): the main process claims
    claims = read_manifest(output_dir)["claims"]
    if name not in claims:
        write_manifest(output_dir, sorted([*claims, name]))


def clear_run(output_dir: Path) -> None:
    """--overwrite_output_dir: exactly what the earlier run recorded writing goes (and our temporary names), never
    through a symbolic link, so nothing of it mixes with the new run's; then its record."""
    claims = read_manifest(output_dir)["claims"]
    for name in sorted(claims, reverse=True):  # runs/<folder> before runs
        path = output_dir / name
        if path.parent != output_dir and path.parent.is_symlink():
            continue  # runs/ replaced by a link since: what it points to is not the run's
        if name == "runs" and path.is_dir() and not path.is_symlink():
            with contextlib.suppress(OSError):
                path.rmdir()  # the run made runs/, but a folder the user put in it since stays, and runs/ with it
            continue
        remove(path)
    for path in output_dir.iterdir():
        if path.name.startswith(OURS) and path.name not in (LOCK, MANIFEST):
            remove(path)
    (output_dir / MANIFEST).unlink()


def remove(path: Path) -> None:
    """Delete a file, a link (itself, not what it points to) or a folder (shutil.rmtree follows no link)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def resume_point(output_dir: Path, resume: str | None, max_steps: int) -> tuple[Path | None, list[str]]:
    """The checkpoint to continue from (None: a fresh start), and a line for each newer one that cannot be loaded.
    FolderRefused for a damaged checkpoint, another run's folder, or a run that reached --max_steps already (a resume
    never trains past the end it was given: Finished when it stands exactly there)."""
    checkpoint, skipped = None, []
    if resume == "auto":
        for path in checkpoints(output_dir):
            problem = checkpoint_damage(path)
            if problem is None:
                checkpoint = path
                break
            skipped.append(f"{path.name} is skipped: {problem}")
        if checkpoint is None and holds_a_run(output_dir):
            damaged = f" ({'; '.join(skipped)})" if skipped else ""
            raise FolderRefused(f"--resume auto: {output_dir} holds a run but no checkpoint that can be loaded{damaged}; "
                                "start over with --overwrite_output_dir true, or give another --output_dir")  # fmt: skip
    elif resume:
        checkpoint = Path(resume)
        problem = checkpoint_damage(checkpoint)
        if problem:
            raise FolderRefused(f"--resume {resume}: not a checkpoint that can be loaded ({problem})")
        if checkpoint.resolve().parent != output_dir.resolve() and holds_a_run(output_dir):
            raise FolderRefused(f"output_dir {output_dir} holds another run than {checkpoint}'s: continue there "
                                f"(--output_dir {checkpoint.parent}) or give an empty --output_dir")  # fmt: skip
    if checkpoint is not None and max_steps > 0:
        step = checkpoint_step(checkpoint)
        if step > max_steps:
            raise FolderRefused(f"--max_steps {max_steps}: {checkpoint} is at step {step} already, so nothing is "
                                f"trained or replaced: raise --max_steps above {step} to go on")  # fmt: skip
        if step == max_steps:
            final = output_dir / "final"
            kept = "final/ holds its adapters" if (final / "adapter_config.json").is_file() or (
                final / "config.json").is_file() else f"{checkpoint.name} holds its adapters"  # fmt: skip
            raise Finished(f"the run in {output_dir} finished at step {step} of --max_steps {max_steps} ({kept}): "
                           f"nothing trained or replaced; raise --max_steps above {step} to go on")  # fmt: skip
    return checkpoint, skipped


class Finished(Exception):
    """A resume of a run that has reached its --max_steps: nothing to do, said in one line (exit status 0)."""


def checkpoint_step(checkpoint: Path) -> int:
    import user_files

    return int(user_files.read_json(checkpoint / "trainer_state.json", what="trainer_state.json")["global_step"])


def checkpoints(output_dir: Path) -> list[Path]:
    """The folder's checkpoint-N folders, newest first."""
    found = [(int(p.name[11:]), p) for p in output_dir.glob("checkpoint-*") if p.name[11:].isdigit()]
    return [p for _, p in sorted(found, reverse=True)]


def last_complete(output_dir: Path) -> Path | None:
    """The newest checkpoint that can be loaded."""
    return next((p for p in checkpoints(output_dir) if checkpoint_damage(p) is None), None)


def checkpoint_damage(path: Path) -> str | None:
    """Why --resume could not load this checkpoint, read cheaply before the model loads (None: it can). What resume
    reads: trainer_state.json, written last (transformers writes checkpoint-N in place, so a save cut short lacks
    it), naming the folder's step; the weights, their safetensors header against the file's size; every torch file
    (optimizer, scheduler, RNG state) whole, by its zip checksums."""
    import user_files

    if not path.is_dir():
        return f"{path} is not a folder"
    try:
        state = user_files.read_json(path / "trainer_state.json", what="trainer_state.json")
        step = state["global_step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"global_step {step!r}")
    except (user_files.FileRefused, ValueError, TypeError, KeyError) as exc:
        return f"its trainer_state.json cannot be read ({user_files.shorten(f'{type(exc).__name__}: {exc}', 120)})"
    match = re.fullmatch(r"checkpoint-(\d+)", path.name)
    if match and step != int(match.group(1)):
        return f"its trainer_state.json is of step {step}, not {match.group(1)}"
    problem = checkpoint_state.problem(path / "trainer_state.json")  # the record transformers builds its state from
    if problem:
        return problem
    if (path / "adapter_config.json").is_file() and not any(path.glob("adapter_model.*")):
        return "its adapters' weights (adapter_model.safetensors) are missing"
    for file in sorted(path.glob("*.safetensors")):
        problem = safetensors_damage(file)
        if problem:
            return f"{file.name} is damaged ({problem})"
    tensors = checkpoint_state.tensor_count(path)  # the state's bounds grow with the trained tensors
    for file in sorted([*path.glob("*.pt"), *path.glob("*.pth"), *path.glob("*.bin")]):
        try:
            with zipfile.ZipFile(file) as saved:
                bad = saved.testzip()
        except (OSError, zipfile.BadZipFile, EOFError, ValueError):
            return f"{file.name} is damaged (not a whole torch file: cut short, or overwritten)"
        if bad is not None:
            return f"{file.name} is damaged (its part {bad} fails its checksum)"
        problem = checkpoint_state.problem(file, tensors) if file.name != "training_args.bin" else None  # never loaded
        if problem:
            return f"{file.name} {problem}"
    return None


DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
               "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip


def safetensors_damage(file: Path) -> str | None:
    """What is wrong with a safetensors file's framing, read from its header alone: a header that does not parse,
    a tensor whose shape and dtype do not fill its byte range (a header claiming a 2^40 x 2^40 tensor), ranges that
    overlap or leave gaps, or data the file does not hold."""
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size)) if 0 < size < 100_000_000 else None
        spans = []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            start, end = entry["data_offsets"]
            count = 1
            for n in entry["shape"]:
                if not isinstance(n, int) or n < 0:
                    return f"{name}: shape {entry['shape']}"
                count *= n
            if entry["dtype"] not in DTYPE_BYTES or not (isinstance(start, int) and isinstance(end, int)):
                return f"{name}: dtype {entry['dtype']}"
            if end - start != count * DTYPE_BYTES[entry["dtype"]]:
                return f"{name}: shape {entry['shape']} of {entry['dtype']} does not fill bytes {start}-{end}"
            spans.append((start, end))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return "its header does not parse"
    spans.sort()
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:])) or (spans and spans[0][0] != 0):
        return "its tensors' byte ranges overlap or leave gaps"
    expected = 8 + size + max((end for _, end in spans), default=0)
    actual = file.stat().st_size
    return None if actual == expected else f"{actual} bytes where its header describes {expected}"


def adapter_differences(model, checkpoint: Path) -> str | None:
    """How the built model's adapters differ from the checkpoint's, tensor by tensor (names and shapes, from the
    file's header); None when they are the same (or there are none to compare)."""
    from peft import get_peft_model_state_dict
    from safetensors import safe_open

    file = checkpoint / "adapter_model.safetensors"
    if not hasattr(model, "peft_config") or not file.is_file():
        return None
    ours = {name: tuple(t.shape) for name, t in get_peft_model_state_dict(model).items()}
    with safe_open(str(file), framework="pt") as f:
        theirs = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    if ours == theirs:
        return None
    missing, extra = sorted(theirs.keys() - ours.keys()), sorted(ours.keys() - theirs.keys())
    reshaped = sorted(n for n in ours.keys() & theirs.keys() if ours[n] != theirs[n])
    return "; ".join(f"{what}: {len(names)} ({names[0]})" for what, names in
                     (("saved, not in these adapters", missing), ("new here", extra), ("another shape", reshaped))
                     if names)  # fmt: skip


def drop_later_metrics(metrics: Path, checkpoint: Path) -> None:
    """A resume redoes the steps after its checkpoint: their earlier lines go (and a line cut short by a kill), so
    metrics.jsonl stays one run's steps in order."""
    step = checkpoint_step(checkpoint)
    if not metrics.is_file() or metrics.is_symlink():
        return
    kept = []
    for line in metrics.read_text().splitlines(keepends=True):
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except ValueError:
            continue
    import user_files

    tmp = metrics.with_name(f".train_2048-metrics.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    user_files.write_new(tmp, "".join(kept))
    os.replace(tmp, metrics)


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
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".train_2048-"))
    except OSError:
        return False
    return True
