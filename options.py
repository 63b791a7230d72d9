"""The options of train_2048.py and evaluate_2048.py: the command line and a YAML preset read as one.

argparse converts and checks strings only, and a preset's values handed to it as defaults (TRL's way) skip every
check: a list, a float or `null` for an integer went through and failed an hour later. Here each key of the file
becomes the words of its flag (a list the option's repeated values, true/false, a mapping its JSON, null the option's
default), so a value in a file gets exactly the checks a flag gets, and the command line's flags, read after the
file's words, win. Every mistake is an OptionError: one line that names the option, the value and what is accepted.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import typing


class OptionError(Exception):
    """A mistake in the options, in one line (the command prints it after its name and exits with status 2)."""


def split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the --config file, the other words): `--config FILE` or `--config=FILE`, at most once."""
    path, rest, words = None, [], iter(argv)
    for word in words:
        if word != "--config" and not word.startswith("--config="):
            rest.append(word)
            continue
        if path is not None:
            raise OptionError("--config is given twice: one preset per run (flags after it change what it sets)")
        path = word.split("=", 1)[1] if "=" in word else next(words, None)
        if not path or path.startswith("--"):
            raise OptionError("--config needs a YAML file")
    return path, rest


def read_config(path: str) -> dict:
    """The preset as a mapping of option: value: a regular file of at most user_files.PRESET_BYTES, YAML without
    aliases and nested at most user_files.MAX_DEPTH deep (user_files.py). Read once per process and path: the early
    parse (what to import) and the full one see the same mapping."""
    import os

    import user_files

    try:
        seen = os.stat(path)
        key = (path, seen.st_ino, seen.st_mtime_ns, seen.st_size)
    except OSError:
        key = (path,)
    if key not in _READ:
        try:
            config = user_files.read_yaml(path, user_files.PRESET_BYTES, "config")
        except user_files.FileRefused as exc:
            raise OptionError(str(exc)) from None
        if config is None:
            config = {}
        if not isinstance(config, dict):
            raise OptionError(f"config {path} must be a YAML mapping of option: value")
        _READ[key] = config
    return dict(_READ[key])


_READ: dict[tuple, dict] = {}


# The environment variables a preset may set (its `env:` mapping): settings of the libraries' memory and threads,
# read after the options are checked. None names a program, a library or a path, so a preset never changes what runs
# (TRAIN2048_SANDBOX_WRAP, LD_PRELOAD, PYTHONPATH, PATH ... are refused); the user's own environment sets those.
PRESET_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "TOKENIZERS_PARALLELISM", "TRANSFORMERS_VERBOSITY", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
ENV_VALUE = re.compile(r"[A-Za-z0-9_.:,=+-]{0,200}")


def preset_env(config: dict, source: str) -> dict[str, str]:
    """The preset's `env:` mapping, checked (and removed from `config`); applied by the caller only once every option
    has been checked."""
    env = config.pop("env", None) or {}
    if not isinstance(env, dict):
        raise OptionError(f"{source}: env: a mapping of NAME: value (environment variables)")
    checked = {}
    for name, value in env.items():
        if str(name) not in PRESET_ENV:
            raise OptionError(f"{source}: env: {name}: a preset may set only {', '.join(PRESET_ENV)} (a variable that "
                              "names a program, a library or a path is yours to set in your own environment)")  # fmt: skip
        if isinstance(value, bool):
            value = "true" if value else "false"
        if isinstance(value, dict | list) or value is None or not ENV_VALUE.fullmatch(str(value)):
            raise OptionError(f"{source}: env: {name}: {json.dumps(value)[:60]} is not a plain setting (letters, "
                              "digits and _.:,=+- only)")  # fmt: skip
        checked[str(name)] = str(value)
    return checked


# --- ranges: every number a run relies on, checked under the option's own name before anything is written ---------


def _at_least(n):
    return (lambda v: v >= n), f"at least {n}"


def _above(n):
    return (lambda v: v > n), f"above {n}"


# Each option a run relies on (ours, TRL's GRPOConfig, transformers' TrainingArguments, TRL's ModelConfig for PEFT),
# with what it accepts. A float must also be finite (NaN passes every `<` and `>` test as false: checked apart).
RANGES = {
    # train_2048's own (ScriptArguments)
    "max_seq_length": _at_least(1), "dataset_size": _at_least(1), "sft_epochs": _above(0),
    "sft_learning_rate": _above(0), "overlong_penalty": _at_least(0), "cpu_threads": _at_least(0),
    "sample_steps": _at_least(1), "num_samples": _at_least(1), "eval_samples": _at_least(1), "eval_games": _at_least(1),
    "archive_size": _at_least(0), "archive_games": _at_least(0),
    "archive_budget": ((lambda v: 0 < v <= 1), "a share of the step's time, above 0 and at most 1"),
    # TRL's GRPOConfig and transformers' TrainingArguments
    "max_steps": ((lambda v: v == -1 or v >= 1), "at least 1 (or -1: --num_train_epochs over --dataset_size)"),
    "num_train_epochs": _above(0), "per_device_train_batch_size": _at_least(1),
    "per_device_eval_batch_size": _at_least(1), "gradient_accumulation_steps": _at_least(1),
    "learning_rate": _above(0), "weight_decay": _at_least(0), "max_grad_norm": _at_least(0),
    "warmup_ratio": ((lambda v: 0 <= v < 1), "a share of the run, at least 0 and below 1"),
    "seed": ((lambda v: 0 <= v < 2**32), "between 0 and 2^32 - 1"),
    "logging_steps": _above(0), "save_steps": _above(0), "eval_steps": _above(0),
    "temperature": _above(0), "top_p": ((lambda v: 0 < v <= 1), "above 0 and at most 1"),
    "max_completion_length": _at_least(1), "max_prompt_length": _at_least(1), "num_iterations": _at_least(1),
    "beta": _at_least(0), "epsilon": _above(0), "steps_per_generation": _at_least(1),
    "generation_batch_size": _at_least(1),
    # TRL's ModelConfig: the LoRA adapters (PEFT)
    "lora_r": _at_least(1), "lora_alpha": _above(0),
    "lora_dropout": ((lambda v: 0 <= v < 1), "a probability, at least 0 and below 1"),
}  # fmt: skip
# Options of our own with no range to check, and why.
NO_RANGE = {
    "backend": "one of its choices (argparse refuses others)",
    "offload_embedding": "true or false",
    "warm_start": "true or false",
    "resume": "auto or a checkpoint: run_folder.resume_point checks the checkpoint",
    "overwrite_output_dir": "true or false",
    "save_method": "one of its choices (argparse refuses others)",
    "verify_save": "true or false",
    "fast_generation": "true or false",
    "truncated": "one of its choices (argparse refuses others)",
    "profile": "one of its choices (RewardSettings refuses others)",
    "games": "RewardSettings refuses fewer than 1",
    "answer_time_limit": "RewardSettings refuses what is not a positive number",
    "game_salt": "any text (a secret)",
    "require_seccomp": "true or false",
    "size": "sandbox.Game builds a board with it (game2048.GameBoard refuses a bad board)",
    "target": "sandbox.Game builds a board with it (game2048.GameBoard refuses a bad board)",
    "probability_fours": "sandbox.Game builds a board with it (game2048.GameBoard refuses a bad board)",
    "keys": "sandbox.Game builds a board with it (game2048.GameBoard refuses a bad board)",
    "max_moves": "sandbox.Game refuses what is not an int >= 0",
    "move_time_limit": "sandbox.Game refuses what is not a positive number",
    "game_time_limit": "sandbox.Game refuses what is not a positive number",
    "memory_limit_mb": "sandbox.Game refuses less than 64",
}


def out_of_range(namespace: argparse.Namespace) -> str | None:
    """The first option whose value is outside RANGES (or a float that is not finite), in one line; None if none."""
    import math

    for name, (accepts, said) in RANGES.items():
        value = getattr(namespace, name, None)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            return f"--{name} {value}: must be a finite number, {said}"
        if not accepts(value):
            return f"--{name} {value:g}: must be {said}"
    return None


def long_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each option by its name (`--name`, the spelling a YAML key takes), the --no_name switches left out."""
    return {a.dest: a for a in parser._actions if f"--{a.dest}" in a.option_strings}


def field_types(parser) -> dict[str, str]:
    """The declared type of each dataclass field behind the parser's options, as text (HfArgumentParser's)."""
    types = {}
    for cls in getattr(parser, "dataclass_types", []):
        hints = typing.get_type_hints(cls)
        types.update({f.name: str(hints[f.name]) for f in dataclasses.fields(cls)})
    return types


def config_words(config: dict, parser, source: str, names: dict | None = None) -> dict[str, list[str]]:
    """Each key of `config` that names an option of `parser` (`names`: keys that name another option), with the words
    of its flag. A key of no option is left out (the caller says whether that is a mistake); a value no flag can say
    is an OptionError naming the key."""
    flags, types = long_flags(parser), field_types(parser)
    words = {}
    for key, value in config.items():
        name = (names or {}).get(key, str(key).replace("-", "_"))
        action = flags.get(name)
        if action is None:
            continue
        where = f"{source}: {key}"
        if value is None or value == [] or value == {}:
            if action.default not in (None, [], {}):
                raise OptionError(f"{where}: no value given (remove the key for the default, {action.default!r})")
            continue  # the option's default
        many = action.nargs in ("+", "*")
        if isinstance(value, dict):
            if "dict" not in types.get(name, ""):
                raise OptionError(f"{where}: a mapping, but --{name} takes {accepted(action)}")
            words[key] = [f"--{name}={json.dumps(value)}"]
        elif isinstance(value, list) and many:
            words[key] = [f"--{name}", *(scalar(v, where) for v in value)]
        elif isinstance(value, list) and "list" in types.get(name, ""):  # report_to: one word, split after parsing
            words[key] = [f"--{name}={','.join(scalar(v, where) for v in value)}"]
        elif isinstance(value, list):
            raise OptionError(f"{where}: a list, but --{name} takes one value: {accepted(action)}")
        else:
            words[key] = [f"--{name}", scalar(value, where)] if many else [f"--{name}={scalar(value, where)}"]
    return words


def scalar(value, where: str) -> str:
    """One value as a flag's word (a YAML boolean as true/false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None or isinstance(value, list | dict):
        raise OptionError(f"{where}: {json.dumps(value)} inside a list (a list holds plain values)")
    return str(value)


def accepted(action: argparse.Action) -> str:
    """What an option takes, in words."""
    if action.choices:
        return "one of " + ", ".join(map(str, action.choices))
    kind = getattr(action.type, "__name__", "")
    return {"int": "an integer", "float": "a number", "string_to_bool": "true or false"}.get(kind, "a string")


def parse(parser, config: dict, argv: list[str], source: str, names: dict | None = None):
    """(the options, the names of those the file or the command line set): the file's words first, then argv's.
    Keys of the file that name no option of `parser` are ignored here; `names` as config_words takes it."""
    per_key = config_words(config, parser, source, names)
    for key, words in per_key.items():  # one at a time, so that a mistake names the file and its key
        try:
            parser.parse_known_args(words)
        except argparse.ArgumentError as exc:
            raise OptionError(f"{source}: {key}: {exc.message}") from None
    words = [w for ws in per_key.values() for w in ws] + list(argv)
    try:
        namespace, rest = parser.parse_known_args(words)
    except argparse.ArgumentError as exc:
        raise OptionError(f"{(exc.argument_name or '').split('/')[0]}: {exc.message}") from None
    if rest:
        raise OptionError(unknown(parser, rest[0]))
    given = set()
    for word in words:
        action = parser._option_string_actions.get(word.split("=", 1)[0]) if word.startswith("--") else None
        if action is not None:
            given.add(action.dest)
    for name, text in field_types(parser).items():  # `--report_to a,b`: a list option that argparse takes as one word
        value = getattr(namespace, name, None)
        if "list" in text and isinstance(value, str) and "," in value:
            setattr(namespace, name, [part.strip() for part in value.split(",") if part.strip()])
    return namespace, given


def unknown(parser, word: str) -> str:
    """The line for a word no option takes: the closest option's name when there is one."""
    if not word.startswith("-"):
        return f"unexpected value {word!r}: each option takes one value (a list option takes several)"
    name = word.split("=", 1)[0]
    close = difflib.get_close_matches(name, list(parser._option_string_actions), n=1, cutoff=0.75)
    hint = f"did you mean {parser._option_string_actions[close[0]].option_strings[0]}? " if close else ""
    return f"unknown option {name} ({hint}--help lists every option)"


def build(parser, namespace: argparse.Namespace) -> tuple:
    """The parser's dataclasses from the options; a value or combination one of them refuses raises ValueError."""
    values = vars(namespace)
    return tuple(
        cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.init and f.name in values})
        for cls in parser.dataclass_types
    )
