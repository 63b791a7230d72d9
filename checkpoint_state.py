"""A run's checkpoints: which a folder holds, which of them load, what their training state may hold, and whether a
resume with the options given can continue one (ResumeRefused, one line, when it cannot).

transformers reads a checkpoint's optimizer.pt, scheduler.pt and rng_state.pth with torch.load(weights_only=True), which
runs no code but builds whatever objects the pickle describes: 22 MB of empty dicts become 2.2 GB, and a state of the
wrong shape (a deep list, another scheduler's state, RNG states of the wrong types) is a traceback from deep in torch or
numpy when it is used. trainer_state.json becomes TrainerState(**record), and its stateful_callbacks are the keyword
arguments of the callbacks' constructors. So each file is judged first: the pickle's size and the number of objects it
builds counted from its opcodes alone (nothing built), then, loaded weights-only, every object of the type and shape a
training run writes; the JSON's keys and types likewise. checkpoint_damage asks problem() of each file.
"""

from __future__ import annotations

import json
import os
import pickletools
import re
import zipfile
from pathlib import Path

# A torch file's pickle (data.pkl) holds the state of each trained tensor: AdamW's takes ~75 bytes and ~8 objects a
# tensor (the CPU demo's: 6.7 kB, 759 objects for 90 tensors), an 8-bit AdamW's ~6 tensors of state per trained one.
# Its bounds: these per tensor of the checkpoint's weights, on top of a floor for the RNG state and the scheduler.
PICKLE_BYTES = (1 << 20, 2048)  # (floor, per trained tensor): a 20B default run's ~6,500 tensors: 14 MB (~1.5 MB used)
PICKLE_OBJECTS = (20_000, 128)  # (floor, per trained tensor): 850,000 for it (~170,000 used)
BUILDS = {"EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "EMPTY_SET", "DICT", "LIST", "TUPLE", "TUPLE1", "TUPLE2",
          "TUPLE3", "FROZENSET", "BINPERSID", "PERSID", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "BUILD"}  # fmt: skip
NUMBER = (int, float)


def problem(file: Path, tensors: int = 0) -> str | None:
    """Why the checkpoint's file must not be handed to transformers (None: it may): trainer_state.json's record, or a
    torch file's pickle (bounded for a checkpoint of `tensors` trained tensors, then its objects checked by the file's
    name: optimizer.pt, scheduler.pt, rng_state*.pth). One short phrase, for run_folder's line."""
    if file.name == "trainer_state.json":
        return trainer_state_problem(file)
    return pickle_problem(file, tensors) or objects_problem(file)


def tensor_count(checkpoint: Path) -> int:
    """How many tensors the checkpoint's safetensors files hold (their headers, which run_folder has checked)."""
    from safetensors import safe_open

    count = 0
    for file in checkpoint.glob("*.safetensors"):
        try:
            with safe_open(str(file), framework="np") as f:
                count += len(list(f.keys()))  # noqa: SIM118 (safe_open has keys(), no iteration)
        except Exception:  # noqa: BLE001 - a damaged header is run_folder's to name
            continue
    return count


def pickle_problem(file: Path, tensors: int = 0) -> str | None:
    """A torch file's pickle too large, or building too many objects, for a checkpoint of `tensors` trained tensors:
    counted from its opcodes with nothing built."""
    most_bytes = PICKLE_BYTES[0] + PICKLE_BYTES[1] * tensors
    most_objects = PICKLE_OBJECTS[0] + PICKLE_OBJECTS[1] * tensors
    try:
        with zipfile.ZipFile(file) as saved:
            (name,) = [n for n in saved.namelist() if n.endswith("/data.pkl") or n == "data.pkl"] or [None]
            if name is None:
                return "holds no pickle (not a torch file)"
            size = saved.getinfo(name).file_size
            if size > most_bytes:
                return (f"holds a pickle of {size / (1 << 20):.1f} MB, above the {most_bytes / (1 << 20):.1f} MB the "
                        f"state of {tensors} trained tensors takes")  # fmt: skip
            data = saved.read(name)
    except (OSError, zipfile.BadZipFile, ValueError) as error:
        return f"is not a torch file ({type(error).__name__})"
    built = 0
    try:
        for opcode, _, _ in pickletools.genops(data):
            built += opcode.name in BUILDS
            if built > most_objects:
                return (f"holds a pickle that builds more than {most_objects:,} objects, more than the state of "
                        f"{tensors} trained tensors")  # fmt: skip
    except (ValueError, EOFError) as error:
        return f"holds a pickle that does not parse ({error})"
    return None


def objects_problem(file: Path) -> str | None:
    """The objects of a checkpoint's torch file, loaded weights-only (tensors memory-mapped, not read), against what a
    training run writes there."""
    import torch
    from transformers.trainer_pt_utils import safe_globals  # the numpy types transformers allows in rng_state.pth

    import user_files

    try:
        with safe_globals():
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, RuntimeError, ...: the file is refused, in one line
        return f"cannot be loaded as data ({user_files.shorten(f'{type(exc).__name__}: {exc}', 160)})"
    if file.name == "optimizer.pt":
        return optimizer_problem(state)
    if file.name == "scheduler.pt":
        return scheduler_problem(state)
    if file.name.startswith("rng_state") and file.suffix == ".pth":
        return rng_problem(state)
    return None


def scalar(value) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def optimizer_problem(state) -> str | None:
    """An optimizer's state_dict: {"state": {index: {name: a tensor or a number}}, "param_groups": [{name: a plain value
    or a list of them}, ...]}, every index of state in a group's params."""
    import torch

    if not isinstance(state, dict) or set(state) != {"state", "param_groups"}:
        return f"is not an optimizer's state (a {kind(state)}, not {{state, param_groups}})"
    groups, per_param = state["param_groups"], state["state"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return f"holds param_groups that are a {kind(groups)}, not a list of groups"
    params = set()
    for group in groups:
        for key, value in group.items():
            if not isinstance(key, str) or not (scalar(value) or isinstance(value, list | tuple) and all(
                    scalar(v) for v in value)):  # fmt: skip
                return f"holds a param group whose {key!s:.40} is a {kind(value)}, not a plain value or a list of them"
        if not isinstance(group.get("params"), list) or not all(isinstance(i, int) for i in group["params"]):
            return "holds a param group with no list of parameter indices"
        params.update(group["params"])
    if not isinstance(per_param, dict):
        return f"holds a state that is a {kind(per_param)}, not a mapping of parameter to state"
    for index, entry in per_param.items():
        if index not in params or not isinstance(entry, dict):
            return f"holds a state of parameter {index!s:.40} (a {kind(entry)}) of no parameter group"
        for key, value in entry.items():
            if not isinstance(key, str) or not (isinstance(value, (torch.Tensor, *NUMBER)) and not isinstance(value, bool)):
                return f"holds a state {key!s:.40} of parameter {index} that is a {kind(value)}, not a tensor or a number"
    return None


def scheduler_problem(state) -> str | None:
    """A learning-rate scheduler's state_dict: {name: a plain value, or a list of plain values or of mappings of them}
    (LambdaLR's lr_lambdas). Which scheduler's it is, check_resume_scheduler compares with the run's."""
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        return f"is not a scheduler's state (a {kind(state)}, not a mapping of names)"
    for key, value in state.items():
        items = value if isinstance(value, list) else [value]
        if not all(scalar(v) or isinstance(v, dict) and all(isinstance(k, str) and scalar(x) for k, x in v.items())
                   for v in items):  # fmt: skip
            return f"holds a {key:.40} that is a {kind(value)}, not a plain value or a list of them"
    return None


def rng_problem(state) -> str | None:
    """The random states transformers restores (trainer._load_rng_state): python's (random.getstate()), numpy's
    (np.random.get_state()), torch's CPU and CUDA generators' (uint8 tensors)."""
    import numpy as np
    import torch

    if not isinstance(state, dict) or not {"python", "numpy", "cpu"} <= set(state):
        return f"is not the random states a run saves (a {kind(state)}, not {{python, numpy, cpu, ...}})"
    python = state["python"]
    if not (isinstance(python, tuple) and len(python) == 3 and python[0] == 3 and isinstance(python[1], tuple)
            and len(python[1]) == 625 and all(isinstance(x, int) and 0 <= x < 2**32 for x in python[1])
            and (python[2] is None or isinstance(python[2], float))):  # fmt: skip
        return f"holds a python state that is a {kind(python)}, not random.getstate()'s (version 3, 625 words)"
    numpy = state["numpy"]
    if not (isinstance(numpy, tuple) and len(numpy) == 5 and numpy[0] == "MT19937" and isinstance(numpy[1], np.ndarray)
            and numpy[1].dtype == np.uint32 and numpy[1].shape == (624,) and isinstance(numpy[2], int)
            and 0 <= numpy[2] <= 624 and isinstance(numpy[3], int) and isinstance(numpy[4], float)):  # fmt: skip
        return f"holds a numpy state that is a {kind(numpy)}, not np.random.get_state()'s (MT19937, 624 words)"
    for device in set(state) - {"python", "numpy"}:
        value = state[device]
        tensors = value if isinstance(value, list) else [value]
        if not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in tensors):
            return f"holds a {device:.40} state that is a {kind(value)}, not a generator's (uint8 tensors)"
    return None


def trainer_state_problem(file: Path) -> str | None:
    """trainer_state.json: transformers builds TrainerState(**record), so every key must be one of its fields, and
    stateful_callbacks (the callbacks rebuilt as Callback(**args), then their attributes set) a mapping of callback
    name to {args: {...}, attributes: {...}} (or a list of those) of plain values. global_step is run_folder's."""
    import dataclasses

    from transformers import TrainerState

    import user_files

    try:
        record = user_files.read_json(file, what="trainer_state.json")
    except user_files.FileRefused as error:
        return str(error).rpartition(": ")[2]
    if not isinstance(record, dict):
        return f"its trainer_state.json is a {kind(record)}, not a record"
    fields = {f.name for f in dataclasses.fields(TrainerState)}
    unknown = sorted(str(k) for k in record if k not in fields)
    if unknown:
        return f"its trainer_state.json holds {user_files.shorten(', '.join(unknown), 60)}, no field of a trainer's state"
    history = record.get("log_history", [])
    if not isinstance(history, list) or not all(isinstance(e, dict) and all(scalar(v) for v in e.values())
                                                for e in history):  # fmt: skip
        return "its trainer_state.json's log_history is not a list of logged values"
    callbacks = record.get("stateful_callbacks") or {}
    if not isinstance(callbacks, dict):
        return f"its trainer_state.json's stateful_callbacks are a {kind(callbacks)}, not a mapping of callback to state"
    for name, saved in callbacks.items():
        for entry in saved if isinstance(saved, list) else [saved]:
            parts = [entry.get("args", {}), entry.get("attributes", {})] if isinstance(entry, dict) else [None]
            if not (isinstance(entry, dict) and set(entry) <= {"args", "attributes"} and all(
                    isinstance(p, dict) and all(isinstance(k, str) and scalar(v) for k, v in p.items()) for p in parts)):
                return (f"its trainer_state.json's stateful_callbacks {name!s:.40} is a {kind(entry)}, not {{args, "
                        "attributes}} of plain values")  # fmt: skip
    return None


def kind(value) -> str:
    """A value's type, in a word or two, for a line about it."""
    if isinstance(value, list | tuple | dict):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


# --- the checkpoints of a run folder, and which of them load ----------------------------------------------------------------------------------------------------

def checkpoint_step(checkpoint: Path) -> int:
    import user_files

    return int(user_files.read_json(checkpoint / "trainer_state.json", what="trainer_state.json")["global_step"])


def checkpoints(output_dir: Path) -> list[Path]:
    """The folder's checkpoint-N folders, newest first."""
    found = [(int(p.name[11:]), p) for p in output_dir.glob("checkpoint-*") if p.name[11:].isdigit() and
             p.is_dir() and not p.is_symlink()]  # fmt: skip
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
    said = problem(path / "trainer_state.json")  # the record transformers builds its state from
    if said:
        return said
    if (path / "adapter_config.json").is_file() and not any(path.glob("adapter_model.*")):
        return "its adapters' weights (adapter_model.safetensors) are missing"
    for file in sorted(path.glob("*.safetensors")):
        said = safetensors_damage(file)
        if said:
            return f"{file.name} is damaged ({said})"
    tensors = tensor_count(path)  # the state's bounds grow with the trained tensors
    for file in sorted([*path.glob("*.pt"), *path.glob("*.pth"), *path.glob("*.bin")]):
        try:
            with zipfile.ZipFile(file) as saved:
                bad = saved.testzip()
        except (OSError, zipfile.BadZipFile, EOFError, ValueError):
            return f"{file.name} is damaged (not a whole torch file: cut short, or overwritten)"
        if bad is not None:
            return f"{file.name} is damaged (its part {bad} fails its checksum)"
        said = problem(file, tensors) if file.name != "training_args.bin" else None  # never loaded
        if said:
            return f"{file.name} {said}"
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


# --- a resume: the chosen checkpoint against the options --------------------------------------------------------


class ResumeRefused(ValueError):
    """The checkpoint cannot be continued with these options: one line that says why and what to do."""


def check_checkpoint(checkpoint: Path, training_args, model_args, output_dir: Path) -> None:
    """The checkpoint a resume continues from, against the options: its adapters' rank and scale, its base (the
    fingerprint) and its scheduler's kind. Asked under the folder's lock (train_2048.hold_the_folder), once
    run_folder.take has chosen it. ResumeRefused, one line, when it cannot be."""
    check_adapter_shape(checkpoint, model_args)
    check_resume_base(checkpoint, model_args.model_name_or_path, output_dir)
    check_resume_scheduler(checkpoint, training_args)


def check_resume_scheduler(checkpoint: Path, training_args) -> None:
    """A resume loads scheduler.pt into the scheduler --lr_scheduler_type builds, whose load_state_dict takes what it
    finds (LambdaLR's fails on a missing key, with a traceback at the first step): its state must be of that
    scheduler's kind, the same names (checkpoint_state has checked their types)."""
    file = checkpoint / "scheduler.pt"
    if not file.is_file():
        return
    import torch
    from transformers import get_scheduler

    try:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        expected = set(get_scheduler(training_args.lr_scheduler_type, optimizer, num_warmup_steps=1,
                                     num_training_steps=2, scheduler_specific_kwargs=training_args.lr_scheduler_kwargs
                                     or {}).state_dict())  # fmt: skip
    except Exception:  # noqa: BLE001 - a scheduler that needs more to be built: its own load says what is wrong
        return
    saved = set(torch.load(file, map_location="cpu", weights_only=True, mmap=True))  # (checked: a mapping of names)
    if saved != expected:
        differ = sorted(saved ^ expected)
        kind = getattr(training_args.lr_scheduler_type, "value", training_args.lr_scheduler_type)
        raise ResumeRefused(f"--resume: {file} holds another scheduler's state than --lr_scheduler_type {kind} keeps (it "
                          f"differs in {', '.join(differ[:4])}): resume with the run's own --lr_scheduler_type, or "
                          "start a new run in another --output_dir")  # fmt: skip


def check_resume_base(checkpoint: Path, model_name: str, output_dir: Path) -> None:
    """A resume puts the checkpoint's adapters on the model the options name (trained_base.resolve_base: the option wins;
    the CPU demo's is <output_dir>/tiny-model): when its files are here to compare, a model whose fingerprint is not the
    checkpoint's base is refused now, in one line, not trained on."""
    import demo_data
    import models
    import trained_base

    base = str(output_dir / "tiny-model") if model_name == demo_data.TINY else model_name
    try:
        base = trained_base.resolve_base(checkpoint, base, "--model_name_or_path")
        other, _ = trained_base.compare_base(checkpoint, models.checkpoint_files(base)[0], base)
    except ValueError as error:  # its train_2048_base.json is damaged or holds what no run writes
        raise ResumeRefused(f"--resume: {error}") from None
    if other:  # (a base that cannot be compared, its files not here, is loaded as named: nothing to refuse)
        raise ResumeRefused(f"--resume: {other}; --model_name_or_path names the model it was trained on")


def check_adapter_shape(checkpoint: Path, model_args) -> None:
    """A resume loads the checkpoint's LoRA into adapters made from the options: their rank and scale must be the
    checkpoint's (the modules are compared once the model is built: compare_adapters)."""
    config_file = checkpoint / "adapter_config.json"
    if not model_args.use_peft or not config_file.is_file():
        return
    import user_files

    try:
        saved = user_files.read_json(config_file, what="adapter_config.json")
    except user_files.FileRefused as exc:
        raise ResumeRefused(f"--resume: {exc}") from None
    if not isinstance(saved, dict):
        raise ResumeRefused(f"--resume: {config_file} is not a mapping of LoRA settings")
    for option, key in (("lora_r", "r"), ("lora_alpha", "lora_alpha")):
        if key in saved and saved[key] != getattr(model_args, option):
            raise ResumeRefused(f"--{option} {getattr(model_args, option)}: {checkpoint} was trained with --{option} {saved[key]}; "
                f"resume with the run's own (--{option} {saved[key]}), or start a new run in another --output_dir")  # fmt: skip
