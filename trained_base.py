"""Which base model an adapter was trained on: the record a run writes beside every adapter it saves (BASE_FILE), the
fingerprint in it, and the one rule that finds the base again (resolve_base), for resume, evaluate and merge alike.

BASE_FILE holds the base's name as given, its absolute path (a local folder) and, for a base inside the run folder
(the CPU demo's tiny-model/), its path relative to the run folder, or the hub revision (the cached snapshot's commit),
how it is quantized, and a fingerprint: a few values at fixed positions of the tensors stored unquantized in a 4-bit
checkpoint and in its 16-bit original alike (the embedding, the final norm), read from the safetensors files. A merge,
an evaluation or a resume on other weights is refused by it; 4-bit and 16-bit copies of the same model agree. The
record is a user's file like any other: every field is checked before it is used.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import models

BASE_FILE = "train_2048_base.json"
FINGERPRINTED = {"embed_tokens": re.compile(r"(?:.*\.)?embed_tokens\.weight"),
                 "norm": re.compile(r"(?:.*\.)?(?<!layers\.)(?:model|language_model)\.norm\.weight")}  # fmt: skip
FINGERPRINT_VALUES = 8


def fingerprint(folder: Path) -> dict:
    """{embed_tokens / norm: {shape, values at fixed positions}} read from the checkpoint's safetensors headers and a
    few bytes of data each, nothing loaded; {} when neither tensor is stored there (or the files do not read)."""
    import math

    from safetensors import safe_open

    try:
        files = models.tensor_files(folder)
    except Exception:  # noqa: BLE001 - no weights here, or damaged ones: nothing to compare
        return {}
    found = {}
    for key, pattern in FINGERPRINTED.items():
        name = min((n for n in files if pattern.fullmatch(n)), key=len, default=None)
        if name is None:
            continue
        try:
            with safe_open(str(files[name]), framework="pt") as f:
                part = f.get_slice(name)
                shape = list(part.get_shape())
                count = math.prod(shape)
                values = []
                for i in range(min(FINGERPRINT_VALUES, count)):
                    flat = round(i * (count - 1) / max(1, FINGERPRINT_VALUES - 1))
                    index = [slice(flat // math.prod(shape[d + 1:]) % shape[d], None) for d in range(len(shape))]
                    index = tuple(slice(s.start, s.start + 1) for s in index)
                    values.append(float(part[index].float().reshape(-1)[0]))
        except Exception:  # noqa: BLE001 - a damaged shard: nothing to compare
            continue
        found[key] = {"shape": shape, "values": values}
    return found


def base_identity(name: str, revision: str | None = None, model=None) -> dict:
    """What train_2048 records of the base it trains on (BASE_FILE), from its files; `model` the loaded model, whose
    config names the checkpoint actually read (Unsloth loads unsloth/gpt-oss-20b in 4-bit from its -unsloth-bnb-4bit
    copy) and how its weights were quantized for training. Never raises."""
    import user_files

    config = getattr(model, "config", None)
    loaded = getattr(config, "_name_or_path", None) or name
    folder, commit = models.checkpoint_files(loaded, revision)
    if folder is None and loaded != name:
        folder, commit = models.checkpoint_files(name, revision)
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict() if hasattr(quantization, "to_dict") else {"quant_method": "quantized"}
    if quantization is None and folder is not None:
        try:
            stored = user_files.read_json(folder / "config.json", what="the base's config.json")
            quantization = stored.get("quantization_config") if isinstance(stored, dict) else None
        except user_files.FileRefused:
            pass
    quantized = None
    if isinstance(quantization, dict):
        quantized = (quantization.get("bnb_4bit_quant_type") or "4-bit") if quantization.get("load_in_4bit") else (
            quantization.get("quant_method") or "quantized")  # fmt: skip
    local = Path(loaded).expanduser().is_dir()
    return {"name": name, "loaded": loaded, "path": str(folder) if local else None, "revision": None if local else commit,
            "quantized": str(quantized) if quantized else None,
            "fingerprint": fingerprint(folder) if folder is not None else {}}  # fmt: skip


def trained_quantized(adapter: Path, trained_on: str | None) -> str | None:
    """How the weights the adapter was trained on were quantized ("nf4"), from its BASE_FILE (read_base_identity, which
    the caller has checked); for an adapter without one, from the checkpoint it names: Unsloth's 4-bit checkpoints on
    the hub (models.FUSED_CHECKPOINT)."""
    identity = read_base_identity(adapter)
    if identity is not None:
        return identity["quantized"]
    if trained_on in models.FUSED_CHECKPOINT:  # Unsloth's NF4 checkpoints (the MXFP4 originals may have been trained in 16 bits)
        return "nf4"
    return None


def write_base_identity(folder: Path, identity: dict) -> None:
    """BASE_FILE into an adapter folder this run writes (replaced when the folder is saved again). A base inside the
    run folder (the CPU demo's tiny-model/) is also recorded relative to it, `in_run`: a run folder moved or renamed
    with its tiny-model/ still finds its base (resolve_base)."""
    import user_files

    path = Path(folder) / BASE_FILE
    run = Path(folder).resolve().parent  # checkpoint-N/ and final/ (a temporary folder beside it) sit in the run folder
    local = Path(identity["path"]) if identity.get("path") else None
    in_run = str(local.relative_to(run)) if local is not None and local.is_relative_to(run) and local != run else None
    if path.is_file() and not path.is_symlink():
        path.unlink()
    user_files.write_new(path, json.dumps({**identity, "in_run": in_run}, indent=1) + "\n")


TEXT = 4096  # characters of a name or a path in the record


def read_base_identity(adapter: Path) -> dict | None:
    """The adapter's BASE_FILE with every field checked, or None (an adapter saved before it existed, or elsewhere).
    ValueError, one line, when it is damaged or holds what no run writes: name a text; loaded, path, revision and
    quantized a text or null; in_run null or a path inside the run folder; fingerprint a mapping of embed_tokens/norm
    to {shape: a list of sizes, values: a list of at most FINGERPRINT_VALUES numbers}. Fields it lacks (older runs')
    are null."""
    import user_files

    path = Path(adapter) / BASE_FILE
    if not (path.exists() or path.is_symlink()):
        return None
    try:
        identity = user_files.read_json(path, 1 << 20, "the adapter's base record")
    except user_files.FileRefused as error:
        raise ValueError(str(error)) from None
    if not isinstance(identity, dict):
        raise ValueError(f"{path}: not a record of a base model (a {type(identity).__name__}, not a mapping)")

    def text(value) -> bool:
        return isinstance(value, str) and 0 < len(value) <= TEXT

    if not text(identity.get("name")):
        raise ValueError(f"{path}: not a record of a base model (its name is {models.shown(identity.get('name'))}, not a text)")
    for key in ("loaded", "path", "revision", "quantized", "in_run"):
        if identity.get(key) is not None and not text(identity[key]):
            raise ValueError(f"{path}: its {key} is {models.shown(identity[key])}, not a text or null")
    in_run = identity.get("in_run")
    if in_run is not None and (Path(in_run).is_absolute() or ".." in Path(in_run).parts):
        raise ValueError(f"{path}: its in_run {models.shown(in_run)} is not a path inside the run folder")
    prints = identity.get("fingerprint")
    prints = {} if prints is None else prints
    if not isinstance(prints, dict):
        raise ValueError(f"{path}: its fingerprint is {models.shown(prints)}, not a mapping of tensor to values")
    for key, entry in prints.items():
        shape, values = (entry.get("shape"), entry.get("values")) if isinstance(entry, dict) else (None, None)
        number = (int, float)
        if key not in FINGERPRINTED or not isinstance(shape, list) or len(shape) > 8 or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape) or not isinstance(
                values, list) or len(values) > FINGERPRINT_VALUES or not all(
                isinstance(v, number) and not isinstance(v, bool) for v in values):  # fmt: skip
            raise ValueError(f"{path}: its fingerprint's {models.shown(key)} is {models.shown(entry)}, not {{shape: [sizes], values: "
                             f"[at most {FINGERPRINT_VALUES} numbers]}} of {' or '.join(FINGERPRINTED)}")  # fmt: skip
    return {**{key: identity.get(key) for key in ("loaded", "path", "revision", "quantized", "in_run")},
            "name": identity["name"], "fingerprint": prints}  # fmt: skip


class BaseRefused(ValueError):
    """No base model the adapters fit can be found, or the one named is another model: one line."""


def resolve_base(adapter: Path, override: str | None, option: str) -> str:
    """The base model the adapters in `adapter` (a run's final/ or checkpoint-N/) go on: one rule for resume, evaluate
    and merge. `override`, the base the user named (`option`: --base, --model, --model_name_or_path), as it is; else
    the first of these that holds a model, and when the adapter's BASE_FILE has a fingerprint, the first whose
    fingerprint agrees with it:

    1. the recorded path: BASE_FILE's path, adapter_config.json's base_model_name_or_path (an older run's relative
       path is looked for from here and from the adapter's parents);
    2. the same name in the run folder (the adapter's parent): BASE_FILE's in_run, or the recorded folder's last
       part, so that a run folder moved or renamed with its tiny-model/ still evaluates and merges;
    3. the hub name (adapter_config.json's, or BASE_FILE's name), which the caller loads or fetches and compares.

    BaseRefused, one line naming `option`, when the record cannot be read, when models are found and none is the
    trained one, or when nothing is found at all. Callers map the result to the checkpoint they load
    (merging.merge_base: the 16-bit original; models.FUSED_CHECKPOINT: transformers' layout)."""
    import packaged_model
    import user_files

    if override:
        return override
    try:
        identity = read_base_identity(adapter)
    except ValueError as error:
        raise BaseRefused(f"{error}; {option} names the base model") from None
    try:
        config = user_files.read_json(Path(adapter) / "adapter_config.json", what="adapter_config.json")
    except user_files.FileRefused:
        config = {}
    named = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    named = named if isinstance(named, str) and 0 < len(named) <= TEXT else None
    identity = identity or {"name": None, "path": None, "in_run": None, "fingerprint": {}}
    recorded = list(dict.fromkeys(n for n in (identity["path"], named, identity["name"]) if n and looks_local(n)))
    run = Path(adapter).resolve().parent
    candidates = []
    for name in recorded:
        given = Path(name).expanduser()
        candidates += [given] if given.is_absolute() else [given, *(p / given for p in run.parents), run / given]
    if identity["in_run"]:
        candidates.append(run / identity["in_run"])
    candidates += [run / Path(name).name for name in recorded]
    packaged = next((n for n in (identity["name"], named) if n in packaged_model.MODELS), None)
    if packaged and not any((c / "config.json").is_file() for c in candidates):
        try:  # a model a package ships, by its name: its folder, made again from the package if it went
            candidates.append(Path(packaged_model.resolve(packaged)))
        except packaged_model.Refused as error:
            raise BaseRefused(f"{error}; or {option} names the base model") from None
    found, refused = [], None
    for folder in dict.fromkeys(candidates):
        if not (folder / "config.json").is_file():
            continue
        found.append(folder)
        if not identity["fingerprint"]:
            return str(folder)  # an older adapter: nothing to compare, the first model found
        other, _ = compare_base(adapter, folder, str(folder))
        if other is None:
            return str(folder)
        refused = refused or other
    if refused:
        raise BaseRefused(f"{refused}; {option} names the model it was trained on")
    hub = next((n for n in (named, identity["name"]) if n and not looks_local(n)), None)
    if hub:
        return hub
    trained = identity["name"] or named
    if not trained:
        raise BaseRefused(f"{adapter}: neither adapter_config.json nor {BASE_FILE} names its base model; {option} "
                          "names it")  # fmt: skip
    where = " nor ".join(dict.fromkeys(str(c) for c in candidates[:1] + candidates[-1:]))
    raise BaseRefused(f"the base {adapter} was trained on, {trained}, is not here (not at {where}); {option} names "
                      "where it is now")  # fmt: skip


def looks_local(name: str) -> bool:
    """A path rather than a hub id (org/name, or a bare name): absolute, relative with ./ or ~, or deeper than one /."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).expanduser().is_dir()


def same_fingerprint(a: list, b: list) -> bool:
    """Equal values rounded to bf16 (a 16-bit original stored in float32 agrees with its bf16 copy); NaN equals NaN."""
    import torch

    x, y = torch.tensor(a, dtype=torch.float64).bfloat16(), torch.tensor(b, dtype=torch.float64).bfloat16()
    return x.shape == y.shape and bool(((x == y) | (x.isnan() & y.isnan())).all())


def compare_base(adapter: Path, folder: Path | None, label: str) -> tuple[str | None, str | None]:
    """(why the base in `folder` is not the one the adapter was trained on, None), or (None, a note when it cannot be
    told), or (None, None) when the fingerprints agree. `label` names the base as the user gave it. ValueError when the
    adapter's BASE_FILE is damaged (read_base_identity)."""
    identity = read_base_identity(adapter)
    if identity is None:
        return None, f"{adapter} holds no {BASE_FILE} (saved before it was written): its base cannot be checked"
    trained = identity["name"] + (f" (revision {identity['revision']})" if identity.get("revision") else "")
    recorded = identity.get("fingerprint") or {}
    here = fingerprint(folder) if folder is not None else {}
    common = sorted(recorded.keys() & here.keys())
    if not common:
        where = "the trained base's record" if not recorded else f"{label}'s files"
        return None, (f"the base cannot be checked: no embedding or final norm in {where} to compare ({trained} "
                      f"against {label})")  # fmt: skip
    for key in common:
        ours, theirs = recorded[key], here[key]
        if list(ours.get("shape", [])) != theirs["shape"]:
            return (f"{label} is not the model {adapter} was trained on ({trained}): its {key} is "
                    f"{tuple(theirs['shape'])}, the trained base's {tuple(ours.get('shape', []))}"), None
        if not same_fingerprint(ours.get("values", []), theirs["values"]):
            differ = sum(not same_fingerprint([x], [y]) for x, y in zip(ours.get("values", []), theirs["values"]))
            return (f"{label} is not the model {adapter} was trained on ({trained}): {differ} of "
                    f"{len(theirs['values'])} {key} values at fixed positions differ"), None
    return None, None
