"""What a checkpoint's training state may hold, checked before transformers loads it on --resume.

transformers reads a checkpoint's optimizer.pt, scheduler.pt and rng_state.pth with torch.load(weights_only=True), which
runs no code but builds whatever objects the pickle describes: 22 MB of empty dicts become 2.2 GB, and a state of the
wrong shape (a deep list, another scheduler's state, RNG states of the wrong types) is a traceback from deep in torch or
numpy when it is used. trainer_state.json becomes TrainerState(**record), and its stateful_callbacks are the keyword
arguments of the callbacks' constructors. So each file is judged first: the pickle's size and the number of objects it
builds counted from its opcodes alone (nothing built), then, loaded weights-only, every object of the type and shape a
training run writes; the JSON's keys and types likewise. run_folder.checkpoint_damage asks problem() of each file.
"""

from __future__ import annotations

import pickletools
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
    (LambdaLR's lr_lambdas). Which scheduler's it is, options.check_resume_state compares with the run's."""
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
