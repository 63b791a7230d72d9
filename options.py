"""The options of train_2048.py and evaluate_2048.py: the command line and a YAML preset read as one, and for
train_2048.py the whole way from argv to a checked plan (`plan()`): every check that needs no model, before anything
is written or loaded.

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
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import demo_data
import merging
import models
import rewards
import run_folder
import sandbox
import trained_base
import user_files

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "configs" / "gpt-oss-20b.yaml"
REAL_GPT_OSS = re.compile(r"gpt-oss-(20|120)b", re.I)  # checkpoints no CPU can train
# Unsloth (2026.10.9) writes mxfp4 through llm-compressor, which runs with transformers up to this version only
# (unsloth/save.py, _LLM_COMPRESSOR_MAX_TRANSFORMERS; tests/unsloth checks it): above it the save fails after training.
MXFP4_MAX_TRANSFORMERS = "4.57.6"
REASONING_EFFORTS = ("low", "medium", "high")  # what GPT-OSS's chat template takes as reasoning_effort
# No preset's GRPO step comes near an hour: the slowest, the default on a DGX Spark, is ~300-500 s (an estimate from
# a public GB10 run's 85-142 s at 200-300 tokens, 1ou2/gpt-2048: docs/PERF.md, README's preset table).
MAX_STEP_SECONDS = 3600
log = logging.getLogger("train_2048")


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
    "offload_embedding": "true or false, or unset (decided by the GPU)",
    "warm_start": "true or false",
    "resume": "auto or a checkpoint: run_folder.take checks the checkpoint",
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
        if value == [] and getattr(action.type, "clears", False):  # an empty list, as the flag says it
            words[key] = [f"--{name}", CLEAR_WORD] if action.nargs in ("+", "*") else [f"--{name}={CLEAR_WORD}"]
            continue
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
        if value is CLEARED or (isinstance(value, list) and CLEARED in value):
            if isinstance(value, list) and len(value) > 1:
                raise OptionError(f"--{name} {CLEAR_WORD} empties the list: give it alone, not beside other values")
            setattr(namespace, name, None if name in CLEARED_TO_NONE else [])
    return namespace, given


# --- list options: a preset's list cleared from the command line ------------------------------------------------

# `--lora_modules_to_save none` empties a list option as transformers' `--report_to none` does (HfArgumentParser gives
# a list option nargs="+": no flag alone, no empty list), as does an empty word (`--lora_modules_to_save ""`) and a
# preset's `[]`; a cleared list is the empty list, but where its library refuses one and reads None as "none given".
CLEAR_WORD = "none"
CLEARED = type("Cleared", (), {"__repr__": lambda self: CLEAR_WORD})()  # what a clearing word parses to
CLEARED_TO_NONE = {"reward_weights": "every reward weighs 1 (TRL's default)",
                   "optim_target_modules": "no module (transformers' default)"}  # fmt: skip


def clearable(convert):
    """A list option's value type (`convert`) that also reads `none` or an empty word as CLEARED."""

    def convert_or_clear(word: str):
        return CLEARED if word.strip().lower() in (CLEAR_WORD, "") else convert(word)

    convert_or_clear.__name__ = getattr(convert, "__name__", "value")  # argparse's "invalid float value" and accepted()
    convert_or_clear.clears = True
    return convert_or_clear


def clearable_lists(parser) -> None:
    """Every list option of `parser` (a field typed list[...]) takes CLEAR_WORD, and its --help says so."""
    flags = long_flags(parser)
    for name, text in field_types(parser).items():
        action = flags.get(name)
        if action is None or "list" not in text or getattr(action.type, "clears", False):
            continue
        action.type = clearable(action.type or str)
        several = "several values, one after another" if action.nargs in ("+", "*") else "values joined by commas"
        cleared = CLEARED_TO_NONE.get(name, "the empty list")
        action.help = (f"{action.help or ''} A list: {several}. `{CLEAR_WORD}` (or '') clears it, a preset's list "
                       f"too: {cleared}; in YAML, [].")  # fmt: skip


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


# --- train_2048: argv to a checked plan -------------------------------------------------------------------------


@dataclass
class Plan:
    """A run with every option checked and nothing written yet: train_2048.train() carries it out."""

    script_args: ScriptArguments
    settings: rewards.RewardSettings
    training_args: typing.Any  # TRL's GRPOConfig
    model_args: typing.Any  # TRL's ModelConfig
    backend: str
    checkpoint: Path | None  # the checkpoint to continue from; None: a fresh start (set once the folder is held)
    notes: list[str]  # lines to log once logging starts (checkpoints skipped, archive games too many for fast steps)
    merge_source: str | None  # the 16-bit base --save_method merged_16bit merges into

    @property
    def output_dir(self) -> Path:
        return Path(self.training_args.output_dir)


def plan(argv: list[str], backend: str, description: str | None = None) -> Plan:
    """Every option read and checked, with what it names (paths, the output folder, the resume point, the hub, the
    sandbox, the merge source): OptionError, one line, otherwise. Nothing is written or loaded."""
    script_args, settings, training_args, model_args = parse_args(argv, description)
    notes = check_before_loading(script_args, settings, training_args, model_args, backend)
    merge_source = check_merge_source(script_args, model_args, Path(training_args.output_dir))
    return Plan(script_args, settings, training_args, model_args, backend, None, notes, merge_source)


def one_line(exc: BaseException | None, limit: int = 200) -> str:
    """An exception as one line: its type and message, cut at a word (user_files.shorten)."""
    return user_files.shorten(f"{type(exc).__name__}: {exc}", limit)


@dataclass
class ScriptArguments:
    """train_2048's own options (TRL's GRPOConfig and ModelConfig bring the rest)."""

    _argument_group_name = "train_2048"  # a --help section of its own

    backend: Literal["auto", "unsloth", "transformers"] = field(
        default="auto",
        metadata={
            "help": "unsloth: Unsloth's FastLanguageModel (one CUDA GPU). transformers: transformers + PEFT "
            "(CPU, multi-GPU). auto: unsloth when it is installed and one CUDA GPU is used, else transformers."
        },
    )
    max_seq_length: int = field(default=1536, metadata={"help": "Longest prompt + completion (Unsloth)."})
    offload_embedding: bool | None = field(
        default=None,
        metadata={
            "help": "Keep the embedding matrix in CPU memory (Unsloth; saves ~1 GB of GPU memory). Unset: decided by "
            "the GPU (models.decide_offload): off on an integrated GPU (DGX Spark: CPU and GPU share one memory, so it "
            "saves nothing and costs time), else on with 4-bit weights, off with 16-bit ones."
        },
    )
    dataset_size: int = field(default=1000, metadata={"help": "Rows of the prompt dataset (the same prompt)."})
    warm_start: bool = field(
        default=False,
        metadata={"help": "Before GRPO, fine-tune (SFT) on the example answers of demo_data.py. Skipped on resume."},
    )
    sft_epochs: float = field(default=3.0, metadata={"help": "Epochs of the warm start over the example answers."})
    sft_learning_rate: float = field(default=2e-4, metadata={"help": "Learning rate of the warm start."})
    resume: str | None = field(
        default=None,
        metadata={
            "help": "'auto': continue from the latest checkpoint in output_dir that can be loaded (one that cannot is "
            "skipped and named); or a checkpoint's path."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "A new run into an output_dir that holds a run is refused (--resume auto continues it); true: "
            "delete that run's files first (checkpoints, final, strategies, metrics, logs)."
        },
    )
    save_method: Literal["lora", "merged_16bit", "mxfp4"] = field(
        default="lora",
        metadata={
            "help": "At the end, LoRA adapters always go to <output_dir>/final; merged_16bit also merges them into the "
            "16-bit base, <output_dir>/final-merged_16bit (merge_2048.py). mxfp4 is refused while Unsloth needs "
            "transformers <= 4.57.6 for it (docs/TRAINING.md)."
        },
    )
    verify_save: bool = field(
        default=True,
        metadata={"help": "Check each save against the trained model: tensors and seeded samples (docs/TRAINING.md, Options)."},
    )
    fast_generation: bool = field(
        default=False,
        metadata={
            "help": "Generate with generation.py's static-cache decode loop (CUDA graphs on a GPU) instead of "
            "model.generate; falls back to it, with one warning, where the fast path cannot run."
        },
    )
    truncated: Literal["score", "skip"] = field(
        default="score",
        metadata={
            "help": "A completion cut off at max_completion_length. score: the rewards score it as written (a cut-off "
            "answer holds no code: -3), which teaches brevity when the budget is short. skip: no reward and no "
            "gradient (TRL leaves it out of its group's baseline, and mask_truncated_completions out of the loss)."
        },
    )
    overlong_penalty: int = field(
        default=0,
        metadata={
            "help": "DAPO's soft overlong punishment as a fourth reward: 0 to -1 over the last N tokens before "
            "max_completion_length, -1 beyond (0: off)."
        },
    )
    cpu_threads: int = field(
        default=0,
        metadata={
            "help": "torch threads on the CPU (0: torch's default). A tiny model is fastest on 1, and "
            "multi-threaded torch slows down badly on a machine shared with other jobs."
        },
    )
    sample_steps: int = field(
        default=10, metadata={"help": "Every N steps, write sample completions and their rewards to TensorBoard."}
    )
    num_samples: int = field(default=4, metadata={"help": "Completions per TensorBoard sample."})
    eval_samples: int = field(
        default=4,
        metadata={
            "help": "Each evaluation (eval_strategy/eval_steps) samples this many strategies from the current policy "
            "with the training prompt and a fixed seed, and logs eval/valid_rate, eval/cheat_rate, eval/win_rate, "
            "eval/max_tile_log2 and eval/mean_score (evaluate_2048.py's protocol)."
        },
    )
    eval_games: int = field(
        default=4, metadata={"help": "Games each evaluated strategy plays on the training board: the run's held-out "
                             "games, secret like the training games (training.log names their seeds)."}
    )
    archive_size: int = field(
        default=20,
        metadata={
            "help": "The strategy archive: every distinct playable strategy the model writes is kept, and the best N "
            "go to <output_dir>/strategies/ (one .py each, best.py, index.json) at every save and at the end. 0: off."
        },
    )
    archive_games: int = field(
        default=16,
        metadata={
            "help": "Held-out games (the evaluation's first N, or more of them) that a candidate for the archive's top "
            "is re-scored on before it is ranked by a lower confidence bound; neighbours in the top that these games "
            "do not tell apart play further rounds of as many (up to 8). On 4, a biased random player's lucky mean "
            "outranked the corner player (docs/PERF.md). 0: the evaluation's (--eval_games)."
        },
    )
    archive_budget: float = field(
        default=0.05,
        metadata={
            "help": "Share of each step's time that the archive's re-scoring may take (unused time carries over)."
        },
    )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the usage examples as written and shows every default."""


def config_and_flags(argv: list[str]) -> tuple[str, dict, list[str], dict[str, str]]:
    """(the preset's path, its mapping, the command line's other words, its checked `env:` mapping); the default
    preset when none is given. The environment is set only after every option is checked (parse_args)."""
    path, rest = split_config(argv)
    path = path or str(DEFAULT_CONFIG)  # plain `python train_2048.py` is the GPT-OSS-20B run
    config = read_config(path)
    refuse_command_line_keys(config, path)
    env = preset_env(config, path)
    return path, config, rest, env


def early_options(argv: list[str]) -> argparse.Namespace:
    """The few options that decide what to import, read before the full parse: Unsloth must be imported before trl.

    The same words as the full parse (the preset's, then the flags), so both read the same values.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for name in ("backend", "model_name_or_path", "use_cpu", "load_in_4bit"):
        parser.add_argument(f"--{name}", f"--{name.replace('_', '-')}", nargs="?", const="true", default=None)
    parser.add_argument("-h", "--help", action="store_true")
    path, config, rest, _ = config_and_flags(argv)
    words = [w for ws in config_words(config, parser, path).values() for w in ws]
    return parser.parse_known_args(words + rest)[0]


def truthy(value) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes", "y", "t")


def choose_backend(early: argparse.Namespace) -> tuple[str, bool]:
    """(backend, whether CUDA is used), decided before trl is imported."""
    import torch

    backend, model_name = str(early.backend or "auto"), str(early.model_name_or_path or "")
    cuda = not truthy(early.use_cpu) and torch.cuda.is_available()
    if backend == "auto":
        one_process = int(os.environ.get("WORLD_SIZE", "1")) == 1  # Unsloth trains on one GPU
        has_unsloth = importlib.util.find_spec("unsloth") is not None
        backend = "unsloth" if cuda and one_process and has_unsloth and model_name != demo_data.TINY else "transformers"
    if early.help:
        return backend, cuda
    if not cuda and (REAL_GPT_OSS.search(model_name) or truthy(early.load_in_4bit)):
        raise OptionError(
            f"{model_name} needs a CUDA GPU (none is used here); for a run on this machine: "
            "python train_2048.py --config configs/cpu-demo.yaml"
        )
    if backend == "unsloth" and not cuda:
        raise OptionError("the unsloth backend needs a CUDA GPU; for a run on this machine: --config configs/cpu-demo.yaml")
    if backend == "unsloth" and importlib.util.find_spec("unsloth") is None:
        raise OptionError("unsloth is not installed (bash setup.sh installs it on a GPU machine); or use --backend transformers")
    return backend, cuda


def train_parser(description: str | None = None):
    """train_2048.py's parser: every option a preset's key or a flag may name (evaluate_2048 checks presets with it)."""
    from transformers import HfArgumentParser
    from trl import GRPOConfig, ModelConfig

    parser = HfArgumentParser(
        (ScriptArguments, rewards.RewardSettings, GRPOConfig, ModelConfig),
        prog="train_2048.py",
        usage="train_2048.py [--config FILE.yaml] [--option VALUE ...]   (--help lists every option)",
        description=description,
        formatter_class=HelpFormatter,
        allow_abbrev=False,
        exit_on_error=False,
    )
    parser.add_argument("--config", default=str(DEFAULT_CONFIG.relative_to(HERE)), metavar="FILE.yaml",
                        help="The preset: its keys are options, as flags are; flags after it win.")  # fmt: skip
    clearable_lists(parser)
    return parser


# Options of the command line that no preset may set, and why.
NOT_IN_A_PRESET = {
    "config": "a preset cannot name another preset (give one --config; flags after it change what it sets)",
    "help": "--help is a command-line flag (train_2048.py --help), not an option a preset sets",
}


def refuse_command_line_keys(config: dict, source: str) -> None:
    """An OptionError for a key of NOT_IN_A_PRESET (read before any parse: `help: true` would be --help's word)."""
    for key in config:
        if str(key).replace("-", "_") in NOT_IN_A_PRESET:
            raise OptionError(f"{source}: {key}: {NOT_IN_A_PRESET[str(key).replace('-', '_')]}")


def refuse_unknown_keys(config: dict, parser, source: str) -> None:
    """An OptionError for the first key of a preset (its `env:` already taken out: preset_env) that names no option of
    train_2048's `parser` (another tool's YAML, an accelerate config, a typo), with the closest option's name."""
    known = long_flags(parser)
    refuse_command_line_keys(config, source)
    for key in config:
        if str(key).replace("-", "_") not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.75)
            raise OptionError(f"{source}: unknown key {key}" + (f" (did you mean {close[0]}?)" if close else
                              " (train_2048.py --help lists every option)"))  # fmt: skip


def parse_args(argv: list[str], description: str | None = None):
    """(script_args, reward settings, training_args, model_args): every option read and checked, the preset's values
    as its flags are, before anything is written or loaded. A mistake is one line and exit status 2."""
    parser = train_parser(description)
    path, config, rest, env = config_and_flags(argv)
    refuse_unknown_keys(config, parser, path)
    namespace, given = parse(parser, config, rest, path)
    problem = out_of_range(namespace) or group_problem(namespace)
    if problem:
        raise OptionError(problem)
    try:
        script_args, settings, training_args, model_args = build(parser, namespace)
    except (ValueError, TypeError) as exc:  # a value or combination GRPOConfig or RewardSettings refuses
        raise OptionError(f"refused: {' '.join(str(exc).split())}") from None
    check_options(script_args, training_args, model_args, given)
    best_evaluation(training_args, given)
    os.environ.update(env)  # the preset's env: keys, checked (PRESET_ENV), once every option has passed
    if script_args.truncated == "skip":
        training_args.mask_truncated_completions = True  # and the rewards return None for them (trainer.py)
    return script_args, settings, training_args, model_args


def best_evaluation(training_args, given: set[str]) -> None:
    """With evaluations on, the best one's adapters are kept (trainer.py, <output_dir>/best), chosen by transformers'
    own metric_for_best_model: eval_mean_reward unless set (greater is better), also under --load_best_model_at_end,
    where transformers would take eval_loss, which a GRPO evaluation does not log. A metric the evaluation does not log
    is one line now, not a KeyError at the first evaluation."""
    import evaluation

    if training_args.eval_strategy == "no":
        return
    if "metric_for_best_model" not in given:
        training_args.metric_for_best_model = "eval_mean_reward"
        if "greater_is_better" not in given:
            training_args.greater_is_better = True
    name, logged = training_args.metric_for_best_model, [f"eval_{m}" for m in evaluation.EVAL_METRICS]
    if (name if name.startswith("eval_") else f"eval_{name}") not in logged:
        raise OptionError(f"--metric_for_best_model {name}: the evaluation logs {', '.join(logged)} (the best one's "
                          "adapters go to <output_dir>/best)")  # fmt: skip


def group_problem(namespace: argparse.Namespace) -> str | None:
    """GRPO's batch rule in the user's words: a step's completions are whole groups of num_generations answers to one
    prompt (TRL's own error speaks of generation and eval batch sizes)."""
    n, world = namespace.num_generations, int(os.environ.get("WORLD_SIZE", "1"))
    if n is None:
        return None
    if n < 2:
        return f"--num_generations {n}: GRPO scores each completion against the others of its group: at least 2"
    per_step = namespace.per_device_train_batch_size * world * (namespace.steps_per_generation or
                                                                namespace.gradient_accumulation_steps)  # fmt: skip
    batch = namespace.generation_batch_size or per_step
    processes = f" x {world} processes" if world > 1 else ""
    made = ("--generation_batch_size" if namespace.generation_batch_size else
            f"per_device_train_batch_size {namespace.per_device_train_batch_size}{processes} x "
            f"{'steps_per_generation' if namespace.steps_per_generation else 'gradient_accumulation_steps'} "
            f"{namespace.steps_per_generation or namespace.gradient_accumulation_steps}")  # fmt: skip
    if batch % n:
        fits = [d for d in range(2, batch + 1) if batch % d == 0]
        return (f"--num_generations {n}: a step samples {batch} completions ({made}), which must split into whole "
                f"groups of {n} answers to one prompt: use {', '.join(map(str, fits))}, or a batch that {n} divides "
                f"(--per_device_train_batch_size {n}, say)")  # fmt: skip
    evaluating = namespace.eval_strategy not in ("no", None)
    eval_batch = namespace.per_device_eval_batch_size * world
    if evaluating and eval_batch % (namespace.num_generations_eval or n):
        return (f"--num_generations {n}: TRL also asks that the evaluation's batch, --per_device_eval_batch_size "
                f"{namespace.per_device_eval_batch_size}{processes}, hold whole groups of {n}: make it a multiple of "
                f"{n} (the evaluation samples --eval_samples strategies, that many at once)")  # fmt: skip
    return None


def check_options(script_args, training_args, model_args, given: set[str]) -> None:
    """Ranges and conflicts of our options, and the TRL/transformers ones that ours depend on."""
    if not str(training_args.output_dir or "").strip():
        raise OptionError(f"--output_dir {training_args.output_dir!r}: must name a folder (outputs/my-run, say)")
    if "output_dir" not in given:  # transformers would write to ./trainer_output, unsaid
        raise OptionError("--output_dir is not given (the preset's output_dir is missing or null): name the folder the "
                          "run writes (outputs/my-run, say)")  # fmt: skip
    problem = user_files.name_problem(Path(training_args.output_dir))
    if problem:
        raise OptionError(f"--output_dir: {problem}")
    for key, value in (training_args.chat_template_kwargs or {}).items():
        if key == "reasoning_effort" and value not in REASONING_EFFORTS:
            raise OptionError(f"--chat_template_kwargs: reasoning_effort {models.shown(value)}: one of "
                              f"{', '.join(REASONING_EFFORTS)} (GPT-OSS's)")  # fmt: skip
        if not isinstance(value, str | int | float | bool):
            raise OptionError(f"--chat_template_kwargs: {key} {models.shown(value)}: a chat template's argument is a "
                              "plain value (text, a number, true or false)")  # fmt: skip
    if training_args.max_completion_length >= script_args.max_seq_length:
        raise OptionError(f"--max_completion_length {training_args.max_completion_length}: must be below "
                          f"--max_seq_length {script_args.max_seq_length} (the longest prompt and completion together)")
    if not model_args.model_name_or_path:
        raise OptionError(f"--model_name_or_path is required ({demo_data.TINY}: the CPU demo's model)")
    if not 0 <= script_args.overlong_penalty < training_args.max_completion_length:
        raise OptionError(f"--overlong_penalty {script_args.overlong_penalty}: must be >= 0 and below "
                                  f"--max_completion_length ({training_args.max_completion_length})")  # fmt: skip
    if script_args.truncated == "skip" and "mask_truncated_completions" in given and \
            not training_args.mask_truncated_completions:  # fmt: skip
        raise OptionError("--truncated skip leaves a cut-off completion unscored, which needs "
                                  "--mask_truncated_completions true (no gradient from it either): drop "
                                  "--mask_truncated_completions false, or use --truncated score")  # fmt: skip
    if model_args.use_peft and model_args.lora_target_modules == [] and not model_args.lora_target_parameters:
        raise OptionError(f"--lora_target_modules {CLEAR_WORD}: LoRA on no module, and --lora_target_parameters names "
                          "no parameter either: name the modules (or parameters) to adapt, or --use_peft false to "
                          "train every weight")  # fmt: skip
    resume, other = script_args.resume, training_args.resume_from_checkpoint
    if resume and other and resume != other:
        raise OptionError(f"--resume {resume} and --resume_from_checkpoint {other}: give one of them "
                                  "(--resume auto continues the latest checkpoint of --output_dir)")  # fmt: skip
    if (resume or other) and script_args.overwrite_output_dir:
        raise OptionError("--overwrite_output_dir starts the run over, --resume continues it: give one")
    from transformers.integrations import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

    for name in training_args.report_to or []:
        if name not in INTEGRATION_TO_CALLBACK:
            raise OptionError(f"--report_to {name}: no such integration (transformers knows "
                                      f"{', '.join(INTEGRATION_TO_CALLBACK)}; none: no reports)")  # fmt: skip
        if name not in get_available_reporting_integrations():
            raise OptionError(f"--report_to {name}: it is not installed here (pip install {name}), or "
                                      "leave it out (tensorboard is installed with train_2048)")  # fmt: skip


def warm_start_problem(tokenizer, prompt: str, script_args) -> str | None:
    """Why --warm_start cannot train with these options (None: it can): each example answer, with the prompt, must fit
    --max_seq_length, or SFT cuts the answers off and has nothing left to learn from (a ValueError deep in the
    trainer). Asked once the tokenizer is loaded, before anything trains."""
    if not script_args.warm_start:
        return None
    import demo_data

    longest = max(len(tokenizer.apply_chat_template(row["prompt"] + row["completion"], return_dict=True)["input_ids"])
                  for row in demo_data.sft_rows(prompt))  # fmt: skip
    if longest <= script_args.max_seq_length:
        return None
    return (f"--max_seq_length {script_args.max_seq_length}: the warm start's example answers take up to {longest} "
            f"tokens with the prompt: raise it to {longest} or more, or --warm_start false")


def check_before_loading(script_args, settings, training_args, model_args, backend: str) -> list[str]:
    """Every check of what the options name (paths, the hub, the sandbox), with nothing loaded or written: one line
    and exit 2 now, not a traceback an hour in. What the output folder holds is read under its lock, when the run
    holds it (run_folder.take). Returns the lines to log once logging starts."""
    model_name, output_dir = model_args.model_name_or_path, Path(training_args.output_dir)
    if script_args.save_method == "mxfp4" and backend != "unsloth":
        raise OptionError("--save_method mxfp4 needs the unsloth backend on a CUDA GPU; use lora or merged_16bit here")
    if script_args.save_method == "mxfp4" and not version_at_most("transformers", MXFP4_MAX_TRANSFORMERS):
        raise OptionError(f"--save_method mxfp4: Unsloth writes it with llm-compressor, which needs transformers <= "
            f"{MXFP4_MAX_TRANSFORMERS} (installed: {importlib.metadata.version('transformers')}), so it would fail after "
            "training; save merged_16bit (16-bit weights) and quantize that separately")  # fmt: skip
    if backend == "unsloth" and training_args.router_aux_loss_coef not in (None, 0):
        raise OptionError(
            f"--router_aux_loss_coef {training_args.router_aux_loss_coef:g}: Unsloth's GRPO does not compute the MoE "
            "router loss; set it to 0 (the GPT-OSS presets do)"
        )
    local = trained_base.looks_local(model_name)
    if model_name != demo_data.TINY and local and not Path(model_name).expanduser().exists():
        raise OptionError(f"model path {model_name} does not exist")
    problem = models.not_a_model(model_name) if model_name != demo_data.TINY else None
    if problem:
        raise OptionError(f"model path {model_name}: {problem}")
    inside = run_folder.inside_a_run(output_dir)
    if inside:
        raise OptionError(f"output_dir {output_dir} {inside}: give a folder outside it")
    if not run_folder.writable(output_dir):
        raise OptionError(f"output_dir {output_dir} is not a writable directory")
    notes = list(filter(None, [check_archive_games(script_args)]))
    if training_args.push_to_hub:
        check_hub(training_args)
    walls = sandbox.walls()
    if settings.require_seccomp and not walls["seccomp"]:
        raise OptionError(
            f"the sandbox has no seccomp wall here ({walls['reason']}): install libseccomp (Debian/Ubuntu: "
            "libseccomp2), or pass --require_seccomp false to train with the other walls only (docs/SECURITY.md)"
        )
    return notes


def check_merge_source(script_args, model_args, output_dir: Path) -> str | None:
    """The 16-bit weights merged_16bit merges the LoRA into after training (merging.merge_base: the model itself, or the
    16-bit original of a 4-bit or MXFP4 checkpoint), asked now, so that a merge that cannot work stops the run before
    it starts."""
    if script_args.save_method != "merged_16bit":
        return None
    if not model_args.use_peft:
        raise OptionError("--save_method merged_16bit merges LoRA adapters into their base: with --use_peft false final/ holds the "
            "whole trained model already")  # fmt: skip
    if model_args.model_name_or_path == demo_data.TINY:
        return str((output_dir / "tiny-model").resolve())  # built before training (absolute: the merge runs anywhere)
    try:
        return merging.merge_base(model_args.model_name_or_path)
    except ValueError as error:
        raise OptionError(f"--save_method merged_16bit: {error}, so the merge would fail after training; save lora, then merge "
            "final/ with python merge_2048.py --adapter <output_dir>/final --base <the 16-bit checkpoint>") from None  # fmt: skip


def version_at_most(package: str, highest: str) -> bool:
    """The installed release of `package` is `highest` or older (local build suffixes ignored)."""
    from packaging.version import Version

    return Version(Version(importlib.metadata.version(package)).base_version) <= Version(highest)


def check_archive_games(script_args) -> str | None:
    """--archive_games N: re-scoring a strategy plays N games, within what the archive may save up (its own rule:
    CARRY_STEPS steps' share of the mean step). Refused when no step is long enough for the cheapest re-scoring, and
    a warning line (returned) when only slow steps are, instead of ranking nothing in silence."""
    if not script_args.archive_size or not script_args.archive_games:
        return None
    from strategy_archive import CARRY_STEPS, CHILD_SECONDS

    games, budget, workers = script_args.archive_games, script_args.archive_budget, len(os.sched_getaffinity(0))
    cheapest = games * CHILD_SECONDS / workers  # every game lost at its first move
    step = cheapest / (CARRY_STEPS * budget)
    said = (f"--archive_games {games}: re-scoring one strategy takes at least {cheapest:,.1f} s ({games} games x "
            f"{CHILD_SECONDS * 1000:.0f} ms on {workers} cores), and the archive saves up {CARRY_STEPS} steps x "
            f"{budget:.0%} of a step: only steps of {step:,.1f} s or more leave it time")  # fmt: skip
    if step > MAX_STEP_SECONDS:
        raise OptionError(f"{said}, so nothing would ever be ranked; lower --archive_games or raise --archive_budget")
    if step > 1:
        return f"{said}; on faster steps nothing is ranked (lower --archive_games or raise --archive_budget)"
    return None


def check_hub(training_args) -> None:
    """--push_to_hub: the hub reached and the token accepted now, not after training."""
    from huggingface_hub import HfApi

    try:
        user = HfApi().whoami()
    except Exception as exc:  # offline mode, no token, a refused token, no network: all the user's to fix
        raise OptionError(f"--push_to_hub: the Hugging Face hub cannot say who this machine pushes as ({one_line(exc)}); log in "
            "(hf auth login), reach the hub, or leave --push_to_hub out") from None  # fmt: skip
    repo = training_args.hub_model_id or f"{user['name']}/{Path(training_args.output_dir).name}"
    log.debug(f"--push_to_hub: as {user['name']}, to {repo}")
