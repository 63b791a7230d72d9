"""An output folder and what it holds: whether a run is there, its checkpoints and whether each can be loaded, and
the files a run writes. Facts only, read cheaply with nothing loaded; train_2048.py decides what to do with them.

transformers 5.17 writes checkpoint-N in place (no temporary folder, no rename), trainer_state.json last, and its own
get_last_checkpoint takes the highest-numbered folder even when it is half-written: here a checkpoint counts only
when everything a resume reads is whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

RUN_FILES = ("metrics.jsonl", "checkpoint-*", "final", "final-*", "strategies")  # a folder holding any holds a run
# What --overwrite_output_dir deletes: everything a run writes into its output_dir (no other file there).
WRITTEN_BY_A_RUN = (*RUN_FILES, "training.log", "runs", "sft", "tiny-model*", ".strategies-*", "final.*")


def holds_a_run(output_dir: Path) -> bool:
    return output_dir.is_dir() and any(any(output_dir.glob(pattern)) for pattern in RUN_FILES)


def clear_run(output_dir: Path) -> None:
    """--overwrite_output_dir: the earlier run's files go, so nothing of it mixes with the new one's."""
    for pattern in WRITTEN_BY_A_RUN:
        for path in output_dir.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


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
    if not path.is_dir():
        return f"{path} is not a folder"
    try:
        state = json.loads((path / "trainer_state.json").read_text())
        step = state["global_step"]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return f"its trainer_state.json cannot be read ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})"
    match = re.fullmatch(r"checkpoint-(\d+)", path.name)
    if match and step != int(match.group(1)):
        return f"its trainer_state.json is of step {step}, not {match.group(1)}"
    if (path / "adapter_config.json").is_file() and not any(path.glob("adapter_model.*")):
        return "its adapters' weights (adapter_model.safetensors) are missing"
    for file in sorted(path.glob("*.safetensors")):
        problem = safetensors_damage(file)
        if problem:
            return f"{file.name} is damaged ({problem})"
    for file in sorted([*path.glob("*.pt"), *path.glob("*.pth"), *path.glob("*.bin")]):
        try:
            with zipfile.ZipFile(file) as saved:
                bad = saved.testzip()
        except (OSError, zipfile.BadZipFile, EOFError, ValueError):
            return f"{file.name} is damaged (not a whole torch file: cut short, or overwritten)"
        if bad is not None:
            return f"{file.name} is damaged (its part {bad} fails its checksum)"
    return None


def safetensors_damage(file: Path) -> str | None:
    """What is wrong with a safetensors file's framing: a header that does not parse, or data it does not hold."""
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size)) if 0 < size < 100_000_000 else None
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return "its header does not parse"
    expected = 8 + size + max(ends, default=0)
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
    step = json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]
    if not metrics.is_file():
        return
    kept = []
    for line in metrics.read_text().splitlines(keepends=True):
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except ValueError:
            continue
    tmp = metrics.with_name(metrics.name + ".tmp")
    tmp.write_text("".join(kept))
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
