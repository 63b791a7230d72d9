"""Train a model with GRPO to write Python 2048 strategies: GPT-OSS-20B on a CUDA GPU, or a tiny model on a CPU.

    python train_2048.py                                   # configs/gpt-oss-20b.yaml: Unsloth, 4-bit, one CUDA GPU
    python train_2048.py --config configs/gpt-oss-20b-bf16.yaml   # BF16 weights, faster, on a card with >= 48 GB
    python train_2048.py --config configs/cpu-demo.yaml    # a tiny local model on the CPU, a few minutes
    python train_2048.py --config configs/notebook.yaml    # the public notebook's run, reproduced
    python train_2048.py --max_steps 300 --resume auto     # any option as a flag; continue the last run
    accelerate launch --config_file configs/accelerate/cpu-2proc.yaml train_2048.py --config configs/cpu-demo.yaml
                                                           # the same demo as 2 processes (gloo, CPU only)

Every option is a flag (`--max_steps` or `--max-steps`, never abbreviated) and a YAML key; flags override the file.
--help lists TRL's GRPOConfig and ModelConfig options, then train_2048's own and the game's.

TRL runs the GRPO loop and transformers writes the checkpoints; this file checks the options before anything heavy
loads, then runs the steps of `train()`: output and logs, the model, an optional warm start, GRPO (trainer.py:
TRL's GRPOTrainer with our game evaluation every eval_steps), and the verified save. In <output_dir>: training.log,
metrics.jsonl, runs/ (TensorBoard), checkpoint-N/, strategies/ (the best strategies the model wrote),
final/ (LoRA adapters), final-<save_method>/ (merged: merge_2048.py, which merges any saved adapter again).
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
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import demo_data
import models
import options
import rewards
import run_folder
import sandbox

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "configs" / "gpt-oss-20b.yaml"
REAL_GPT_OSS = re.compile(r"gpt-oss-(20|120)b", re.I)  # checkpoints no CPU can train
# Unsloth (2026.10.9) writes mxfp4 through llm-compressor, which runs with transformers up to this version only
# (unsloth/save.py, _LLM_COMPRESSOR_MAX_TRANSFORMERS; tests/unsloth checks it): above it the save fails after training.
MXFP4_MAX_TRANSFORMERS = "4.57.6"
MAX_STEP_SECONDS = 3600  # no preset's GRPO step comes near an hour (GPT-OSS-20B on a DGX Spark: ~90 s)
log = logging.getLogger("train_2048")


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
    offload_embedding: bool = field(
        default=False, metadata={"help": "Keep the embedding matrix in CPU memory (Unsloth, saves ~1 GB)."}
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


def die(message: str) -> None:
    """A setup error: one line, exit status 2, no traceback."""
    print(f"train_2048: {message}", file=sys.stderr)
    raise SystemExit(2)


# --- options ------------------------------------------------------------------------------------------------


def config_and_flags(argv: list[str]) -> tuple[str, dict, list[str]]:
    """(the preset's path, its mapping, the command line's other words); the default preset when none is given. A
    preset's `env:` mapping sets environment variables, as TRL's parser does."""
    path, rest = options.split_config(argv)
    path = path or str(DEFAULT_CONFIG)  # plain `python train_2048.py` is the GPT-OSS-20B run
    config = options.read_config(path)
    env = config.pop("env", None) or {}
    if not isinstance(env, dict) or any(isinstance(v, dict | list) for v in env.values()):
        raise options.OptionError(f"{path}: env: a mapping of NAME: value (environment variables)")
    os.environ.update({str(k): str(v) for k, v in env.items()})
    return path, config, rest


def early_options(argv: list[str]) -> argparse.Namespace:
    """The few options that decide what to import, read before the full parse: Unsloth must be imported before trl.

    The same words as the full parse (the preset's, then the flags), so both read the same values.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for name in ("backend", "model_name_or_path", "use_cpu", "load_in_4bit"):
        parser.add_argument(f"--{name}", f"--{name.replace('_', '-')}", nargs="?", const="true", default=None)
    parser.add_argument("-h", "--help", action="store_true")
    try:
        path, config, rest = config_and_flags(argv)
        words = [w for ws in options.config_words(config, parser, path).values() for w in ws]
        return parser.parse_known_args(words + rest)[0]
    except options.OptionError as exc:
        die(str(exc))


def truthy(value) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes", "y", "t")


def choose_backend(options: argparse.Namespace) -> tuple[str, bool]:
    """(backend, whether CUDA is used), decided before trl is imported."""
    import torch

    backend, model_name = str(options.backend or "auto"), str(options.model_name_or_path or "")
    cuda = not truthy(options.use_cpu) and torch.cuda.is_available()
    if backend == "auto":
        one_process = int(os.environ.get("WORLD_SIZE", "1")) == 1  # Unsloth trains on one GPU
        has_unsloth = importlib.util.find_spec("unsloth") is not None
        backend = "unsloth" if cuda and one_process and has_unsloth and model_name != models.TINY else "transformers"
    if options.help:
        return backend, cuda
    if not cuda and (REAL_GPT_OSS.search(model_name) or truthy(options.load_in_4bit)):
        die(
            f"{model_name} needs a CUDA GPU (none is used here); for a run on this machine: "
            "python train_2048.py --config configs/cpu-demo.yaml"
        )
    if backend == "unsloth" and not cuda:
        die("the unsloth backend needs a CUDA GPU; for a run on this machine: --config configs/cpu-demo.yaml")
    if backend == "unsloth" and importlib.util.find_spec("unsloth") is None:
        die("unsloth is not installed (bash setup.sh installs it on a GPU machine); or use --backend transformers")
    return backend, cuda


def parse_args(argv: list[str]):
    """(script_args, reward settings, training_args, model_args): every option read and checked, the preset's values
    as its flags are, before anything is written or loaded. A mistake is one line and exit status 2."""
    from transformers import HfArgumentParser
    from trl import GRPOConfig, ModelConfig

    parser = HfArgumentParser(
        (ScriptArguments, rewards.RewardSettings, GRPOConfig, ModelConfig),
        prog="train_2048.py",
        usage="train_2048.py [--config FILE.yaml] [--option VALUE ...]   (--help lists every option)",
        description=__doc__,
        formatter_class=HelpFormatter,
        allow_abbrev=False,
        exit_on_error=False,
    )
    parser.add_argument("--config", default=str(DEFAULT_CONFIG.relative_to(HERE)), metavar="FILE.yaml",
                        help="The preset: its keys are options, as flags are; flags after it win.")  # fmt: skip
    try:
        path, config, rest = config_and_flags(argv)
        known = options.long_flags(parser)
        for key in config:
            if str(key).replace("-", "_") not in known:
                close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.75)
                raise options.OptionError(f"{path}: unknown key {key}" + (f" (did you mean {close[0]}?)" if close else
                                          " (train_2048.py --help lists every option)"))  # fmt: skip
        namespace, given = options.parse(parser, config, rest, path)
        groups = group_problem(namespace)
        if groups:
            raise options.OptionError(groups)
        try:
            script_args, settings, training_args, model_args = options.build(parser, namespace)
        except (ValueError, TypeError) as exc:  # a value or combination GRPOConfig or RewardSettings refuses
            raise options.OptionError(f"refused: {' '.join(str(exc).split())}") from None
        check_options(script_args, training_args, model_args, given)
    except options.OptionError as exc:
        die(str(exc))
    if script_args.truncated == "skip":
        training_args.mask_truncated_completions = True  # and the rewards return None for them (trainer.py)
    return script_args, settings, training_args, model_args


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
    if not model_args.model_name_or_path:
        raise options.OptionError(f"--model_name_or_path is required ({models.TINY}: the CPU demo's model)")
    for name in ("eval_samples", "eval_games"):
        if getattr(script_args, name) < 1:
            raise options.OptionError(f"--{name} {getattr(script_args, name)}: must be >= 1")
    for name in ("archive_size", "archive_games"):
        if getattr(script_args, name) < 0:
            raise options.OptionError(f"--{name} {getattr(script_args, name)}: must be >= 0")
    if not 0 < script_args.archive_budget <= 1:
        raise options.OptionError(f"--archive_budget {script_args.archive_budget:g}: a share of the step's time, "
                                  "above 0 and at most 1")  # fmt: skip
    if not 0 <= script_args.overlong_penalty < training_args.max_completion_length:
        raise options.OptionError(f"--overlong_penalty {script_args.overlong_penalty}: must be >= 0 and below "
                                  f"--max_completion_length ({training_args.max_completion_length})")  # fmt: skip
    if script_args.truncated == "skip" and "mask_truncated_completions" in given and \
            not training_args.mask_truncated_completions:  # fmt: skip
        raise options.OptionError("--truncated skip leaves a cut-off completion unscored, which needs "
                                  "--mask_truncated_completions true (no gradient from it either): drop "
                                  "--mask_truncated_completions false, or use --truncated score")  # fmt: skip
    resume, other = script_args.resume, training_args.resume_from_checkpoint
    if resume and other and resume != other:
        raise options.OptionError(f"--resume {resume} and --resume_from_checkpoint {other}: give one of them "
                                  "(--resume auto continues the latest checkpoint of --output_dir)")  # fmt: skip
    if (resume or other) and script_args.overwrite_output_dir:
        raise options.OptionError("--overwrite_output_dir starts the run over, --resume continues it: give one")
    from transformers.integrations import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

    for name in training_args.report_to or []:
        if name not in INTEGRATION_TO_CALLBACK:
            raise options.OptionError(f"--report_to {name}: no such integration (transformers knows "
                                      f"{', '.join(INTEGRATION_TO_CALLBACK)}; none: no reports)")  # fmt: skip
        if name not in get_available_reporting_integrations():
            raise options.OptionError(f"--report_to {name}: it is not installed here (pip install {name}), or "
                                      "leave it out (tensorboard is installed with train_2048)")  # fmt: skip


def check_before_loading(script_args, settings, training_args, model_args, backend: str) -> tuple[Path | None, list]:
    """Every check of what the options name (paths, checkpoints, the output folder, the hub, the sandbox), with
    nothing loaded or written: one line and exit 2 now, not a traceback an hour in. Returns the checkpoint to resume
    from, if any, and the lines to log about newer checkpoints that cannot be loaded."""
    model_name, output_dir = model_args.model_name_or_path, Path(training_args.output_dir)
    if script_args.save_method == "mxfp4" and backend != "unsloth":
        die("--save_method mxfp4 needs the unsloth backend on a CUDA GPU; use lora or merged_16bit here")
    if script_args.save_method == "mxfp4" and not version_at_most("transformers", MXFP4_MAX_TRANSFORMERS):
        die(f"--save_method mxfp4: Unsloth writes it with llm-compressor, which needs transformers <= "
            f"{MXFP4_MAX_TRANSFORMERS} (installed: {importlib.metadata.version('transformers')}), so it would fail after "
            "training; save merged_16bit (16-bit weights) and quantize that separately")  # fmt: skip
    if backend == "unsloth" and training_args.router_aux_loss_coef not in (None, 0):
        die(
            f"--router_aux_loss_coef {training_args.router_aux_loss_coef:g}: Unsloth's GRPO does not compute the MoE "
            "router loss; set it to 0 (the GPT-OSS presets do)"
        )
    looks_local = model_name.startswith((".", "/", "~")) or model_name.count("/") > 1  # a hub id is org/name
    if model_name != models.TINY and looks_local and not Path(model_name).expanduser().exists():
        die(f"model path {model_name} does not exist")
    problem = models.not_a_model(model_name) if model_name != models.TINY else None
    if problem:
        die(f"model path {model_name}: {problem}")
    if not run_folder.writable(output_dir):
        die(f"output_dir {output_dir} is not a writable directory")
    checkpoint, notes = resume_point(script_args, training_args, model_args, output_dir)
    notes += filter(None, [check_archive_games(script_args)])
    if training_args.push_to_hub:
        check_hub(training_args)
    walls = sandbox.walls()
    if settings.require_seccomp and not walls["seccomp"]:
        die(
            f"the sandbox has no seccomp wall here ({walls['reason']}): install libseccomp (Debian/Ubuntu: "
            "libseccomp2), or pass --require_seccomp false to train with the other walls only (docs/SECURITY.md)"
        )
    return checkpoint, notes


def check_merge_source(script_args, model_args, output_dir: Path) -> str | None:
    """The 16-bit weights merged_16bit merges the LoRA into after training (models.merge_base: the model itself, or the
    16-bit original of a 4-bit or MXFP4 checkpoint), asked now, so that a merge that cannot work stops the run before
    it starts."""
    if script_args.save_method != "merged_16bit":
        return None
    if not model_args.use_peft:
        die("--save_method merged_16bit merges LoRA adapters into their base: with --use_peft false final/ holds the "
            "whole trained model already")  # fmt: skip
    if model_args.model_name_or_path == models.TINY:
        return str(output_dir / "tiny-model")  # built before training
    try:
        return models.merge_base(model_args.model_name_or_path)
    except ValueError as error:
        die(f"--save_method merged_16bit: {error}, so the merge would fail after training; save lora, then merge "
            "final/ with python merge_2048.py --adapter <output_dir>/final --base <the 16-bit checkpoint>")  # fmt: skip


def version_at_most(package: str, highest: str) -> bool:
    """The installed release of `package` is `highest` or older (local build suffixes ignored)."""
    from packaging.version import Version

    return Version(Version(importlib.metadata.version(package)).base_version) <= Version(highest)


# --- the output folder and its checkpoints (run_folder.py reads them) -------------------------------------------


def resume_point(script_args, training_args, model_args, output_dir: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint to continue from (None: a fresh start), and a line for each newer one that cannot be loaded. A
    fresh start never goes into a folder that holds a run, and a damaged checkpoint is never resumed from."""
    resume = script_args.resume or training_args.resume_from_checkpoint
    checkpoint, skipped = None, []
    if resume == "auto":
        for path in run_folder.checkpoints(output_dir):
            problem = run_folder.checkpoint_damage(path)
            if problem is None:
                checkpoint = path
                break
            skipped.append(f"{path.name} is skipped: {problem}")
        if checkpoint is None and run_folder.holds_a_run(output_dir):
            damaged = f" ({'; '.join(skipped)})" if skipped else ""
            die(f"--resume auto: {output_dir} holds a run but no checkpoint that can be loaded{damaged}; start over "
                "with --overwrite_output_dir true, or give another --output_dir")  # fmt: skip
    elif resume:
        checkpoint = Path(resume)
        problem = run_folder.checkpoint_damage(checkpoint)
        if problem:
            die(f"--resume {resume}: not a checkpoint that can be loaded ({problem})")
        if checkpoint.resolve().parent != output_dir.resolve() and run_folder.holds_a_run(output_dir):
            die(f"output_dir {output_dir} holds another run than {checkpoint}'s: continue there (--output_dir "
                f"{checkpoint.parent}) or give an empty --output_dir")  # fmt: skip
    elif run_folder.holds_a_run(output_dir) and not script_args.overwrite_output_dir:
        die(f"output_dir {output_dir} holds a run: continue it with --resume auto, start over with "
            "--overwrite_output_dir true (its files are deleted), or give another --output_dir")  # fmt: skip
    if checkpoint is not None:
        check_adapter_shape(checkpoint, model_args)
    return checkpoint, skipped


def check_adapter_shape(checkpoint: Path, model_args) -> None:
    """A resume loads the checkpoint's LoRA into adapters made from the options: their rank and scale must be the
    checkpoint's (the modules are compared once the model is built: compare_adapters)."""
    config_file = checkpoint / "adapter_config.json"
    if not model_args.use_peft or not config_file.is_file():
        return
    try:
        saved = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        die(f"--resume: {config_file} cannot be read ({type(exc).__name__})")
    for option, key in (("lora_r", "r"), ("lora_alpha", "lora_alpha")):
        if key in saved and saved[key] != getattr(model_args, option):
            die(f"--{option} {getattr(model_args, option)}: {checkpoint} was trained with --{option} {saved[key]}; "
                f"resume with the run's own (--{option} {saved[key]}), or start a new run in another --output_dir")  # fmt: skip


def compare_adapters(model, checkpoint: Path) -> None:
    """The built model's adapters against the checkpoint's: --lora_target_modules or --lora_modules_to_save that
    differ from the run's stop here, in one line, not as a traceback in the optimizer's load or a resume that silently
    leaves some adapters fresh."""
    differences = run_folder.adapter_differences(model, checkpoint)
    if differences:
        die(f"--resume: {checkpoint}'s adapters are not the ones these options build ({differences}); resume with "
            "the run's own --lora_target_modules and --lora_modules_to_save, or start a new run in another "
            "--output_dir")  # fmt: skip


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
        die(f"{said}, so nothing would ever be ranked; lower --archive_games or raise --archive_budget")
    if step > 1:
        return f"{said}; on faster steps nothing is ranked (lower --archive_games or raise --archive_budget)"
    return None


def check_hub(training_args) -> None:
    """--push_to_hub: the hub reached and the token accepted now, not after training."""
    from huggingface_hub import HfApi

    try:
        user = HfApi().whoami()
    except Exception as exc:  # offline mode, no token, a refused token, no network: all the user's to fix
        die(f"--push_to_hub: the Hugging Face hub cannot say who this machine pushes as ({one_line(exc)}); log in "
            "(hf auth login), reach the hub, or leave --push_to_hub out")  # fmt: skip
    repo = training_args.hub_model_id or f"{user['name']}/{Path(training_args.output_dir).name}"
    log.debug(f"--push_to_hub: as {user['name']}, to {repo}")


def prepare_cuda() -> None:
    """DGX Spark (GB10, compute capability 12.1) needs a ptxas that knows sm_121a; Triton's bundled one may not."""
    import torch

    if torch.cuda.get_device_capability() != (12, 1):
        return
    ptxas = "/usr/local/cuda/bin/ptxas"
    if "TRITON_PTXAS_PATH" not in os.environ and os.path.exists(ptxas):
        os.environ["TRITON_PTXAS_PATH"] = ptxas
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "12.1a")
    if importlib.util.find_spec("flash_attn") is not None:
        log.warning(
            "flash-attn is installed: it has no GB10 (sm_121) build and breaks xformers; pip uninstall flash-attn"
        )


# --- the steps of a run -------------------------------------------------------------------------------------


def start_logging(output_dir: Path, state) -> None:
    """Console and training.log on the main process; another process speaks up only for an error of its own.

    Under accelerate launch every rank runs this file: what is written once per run (the directory, training.log,
    the tiny model, the final save) is written by the main process, and the others wait for it where they need it.
    """
    logging.raiseExceptions = False  # a log line that cannot be written (a full disk) is dropped, not a traceback
    if state.is_main_process:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            logfile = logging.FileHandler(output_dir / "training.log")
        except OSError as exc:
            die(f"output_dir {output_dir}: {exc.strerror or exc}")
        console = logging.StreamHandler(sys.stdout)
        console.setLevel(logging.INFO)
        logfile.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.handlers = [console, logfile]
        log.setLevel(logging.DEBUG)  # DEBUG: training.log only
    else:
        errors = logging.StreamHandler(sys.stderr)
        errors.setFormatter(logging.Formatter(f"train_2048 rank {state.process_index}: %(message)s"))
        log.handlers = [errors]
        log.setLevel(logging.ERROR)
    log.propagate = False


def load_policy(script_args, training_args, model_args, backend: str, prompt: str, state, output_dir: Path):
    """(model, tokenizer) to train; the CPU demo's tiny model is built first, once, by the main process."""
    model_name = model_args.model_name_or_path
    if model_name == models.TINY:
        with state.main_process_first():
            built = models.build_tiny_model(output_dir / "tiny-model", demo_data.corpus(prompt), training_args.seed)
        model_name = str(built)
    model, tokenizer = models.load_model(
        model_name,
        model_args,
        backend=backend,
        trainable=True,
        max_seq_length=script_args.max_seq_length,
        offload_embedding=script_args.offload_embedding,
        seed=training_args.seed,
        gradient_checkpointing=training_args.gradient_checkpointing,
        trust_remote_code=training_args.trust_remote_code,
    )
    if models.experts_layout(model) is not None:
        log.info(f"model: {models.describe_experts(model)}")
    if backend == "unsloth":
        # --gradient_checkpointing chose Unsloth's own above ("unsloth" checkpointing); the Trainer must not add HF's.
        training_args.gradient_checkpointing = False
    if backend == "unsloth" and training_args.router_aux_loss_coef is None:
        coef = getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0
        if coef and hasattr(model.config, "output_router_logits"):  # TRL would turn on the loss Unsloth refuses
            die(f"{model_name} declares a MoE router loss ({coef:g}) that Unsloth's GRPO cannot compute: "
                "pass --router_aux_loss_coef 0")  # fmt: skip
    return model, tokenizer


def check_budget(tokenizer, settings, script_args, training_args, model_name: str, backend: str, reasoning: str) -> None:
    """One warning line when the token budget cannot hold what the reward pays for: a completion cut off before its
    code block closes holds no code, so a budget below a board-reading answer leaves only board-blind ones to learn."""
    if model_name == models.TINY:
        return  # the demo's budget is set by its own example answers (tests/test_train.py checks they fit)
    analysis, answer = rewards.completion_need(tokenizer)
    prompt = rewards.prompt_tokens(tokenizer, settings, reasoning)
    budget = training_args.max_completion_length
    if budget < analysis + answer:
        log.warning(
            f"max_completion_length {budget} cannot hold a board-reading answer: {analysis} tokens of analysis and "
            f"{answer} for a compact search answer need {analysis + answer} (docs/TRAINING.md, Token budget)"
        )
    if backend == "unsloth" and prompt + budget > script_args.max_seq_length:
        log.warning(f"max_seq_length {script_args.max_seq_length} cannot hold the prompt ({prompt} tokens) and "
                    f"max_completion_length {budget}: raise it to {prompt + budget} or more")  # fmt: skip


def warm_start(model, tokenizer, prompt: str, script_args, training_args, state, output_dir: Path, writer=None) -> None:
    """SFT on demo_data.py's example answers, for a model that cannot write a working strategy yet. Under accelerate
    launch it is one data-parallel job of every rank, the batch split so an update sees as many examples. Its
    TensorBoard scalars go to the run's writer as warm_start/*."""
    from datasets import Dataset
    from transformers.integrations import TensorBoardCallback
    from trl import SFTConfig, SFTTrainer

    import trainer as grpo

    rows = demo_data.sft_rows(prompt)
    log.info(f"warm start: SFT on {len(rows)} example answers for {script_args.sft_epochs:g} epochs")
    sft_args = SFTConfig(
        output_dir=str(output_dir / "sft"),
        num_train_epochs=script_args.sft_epochs,
        learning_rate=script_args.sft_learning_rate,
        lr_scheduler_type="constant",
        per_device_train_batch_size=-(-training_args.per_device_train_batch_size // state.num_processes),
        optim=training_args.optim,
        gradient_checkpointing=training_args.gradient_checkpointing,
        ddp_find_unused_parameters=training_args.ddp_find_unused_parameters,
        max_length=script_args.max_seq_length,
        use_cpu=training_args.use_cpu,
        bf16=training_args.bf16,
        fp16=training_args.fp16,
        seed=training_args.seed,
        logging_steps=10,
        save_strategy="no",
        report_to=training_args.report_to,
        disable_tqdm=training_args.disable_tqdm,
    )
    sft = SFTTrainer(model, sft_args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    quiet_console(sft)
    sft.pop_callback(TensorBoardCallback)  # its train/* would share GRPO's charts
    sft.add_callback(grpo.WarmStartReport(writer))
    sft.train()


def quiet_console(trainer) -> None:
    """The Trainer's bar without its dump of every metric at each log (our reports print short lines instead)."""
    from transformers import PrinterCallback, ProgressCallback

    import trainer as grpo

    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(grpo.QuietProgressBar())
    trainer.pop_callback(PrinterCallback)


def make_trainer(model, tokenizer, settings, script_args, training_args, state, output_dir: Path, reasoning: str,
                 checkpoint: Path | None = None, writer=None):  # fmt: skip
    """(trainer, ctrl_c): TRL's GRPOTrainer with our rewards, evaluation, reports, timings and strategy archive
    (trainer.py, strategy_archive.py; the archive continues the checkpoint's on a resume), and the callback that
    Ctrl-C asks for a checkpoint. `writer`: the run's TensorBoard writer (main process), or None."""
    from transformers.integrations import TensorBoardCallback

    import trainer as grpo

    generate = None
    if script_args.fast_generation:
        import generation

        generate = generation.generate
    latest = {}  # the last batch's completions and scores, for the TensorBoard samples
    times, ctrl_c = grpo.StepTimes(state.device), grpo.CtrlC()
    evaluating = training_args.eval_strategy != "no"
    judge, archive = rewards.make_judge(settings), None
    held_out = rewards.held_out_seeds(settings.game_salt, max(script_args.archive_games, script_args.eval_games))
    if evaluating:
        log.info(f"evaluation: {script_args.eval_samples} strategies sampled, each on {script_args.eval_games} held-out "
                 f"games (seeds {held_out[0]}-{held_out[script_args.eval_games - 1]}, from the secret game salt)")  # fmt: skip
    if script_args.archive_size:
        import strategy_archive

        archive = strategy_archive.StrategyArchive(
            settings, size=script_args.archive_size, budget=script_args.archive_budget, output_dir=output_dir,
            seeds=held_out[: script_args.archive_games or script_args.eval_games],
            main=state.is_main_process, world=state.num_processes, timing=lambda: times.timing("archive"),
        )  # fmt: skip
        if checkpoint is not None:
            archive.load_state(checkpoint)
        judge = archive.watch(judge)  # every batch's verdicts pass through the archive
        log.info(archive.describe())
    funcs = rewards.reward_functions(settings, judge)
    if script_args.overlong_penalty:
        from trl.rewards import get_soft_overlong_punishment

        funcs.append(get_soft_overlong_punishment(training_args.max_completion_length, script_args.overlong_penalty))
    # TRL's own rule for a cut-off completion: its last token is neither EOS nor padding.
    stop_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id} if script_args.truncated == "skip" else None
    if stop_ids is not None:  # TRL warns, with the whole prompt, for every completion left unscored: here by design
        logging.getLogger("trl.trainer.grpo_trainer").addFilter(
            lambda record: "All reward functions returned None" not in record.getMessage()
        )
    trainer = grpo.GameGRPOTrainer(
        model=model,
        reward_funcs=[grpo.timed_reward(f, times, latest, skip_unless_ends_with=stop_ids) for f in funcs],
        args=training_args,
        train_dataset=rewards.build_dataset(script_args.dataset_size, settings, reasoning),
        eval_dataset=rewards.build_dataset(script_args.eval_samples, settings, reasoning) if evaluating else None,
        processing_class=tokenizer,
        callbacks=[grpo.GRPOReport(output_dir), ctrl_c, grpo.GameSalt(settings.game_salt), *filter(None, [archive])],
        settings=settings,
        eval_samples=script_args.eval_samples,
        eval_seeds=held_out[: script_args.eval_games],
        times=times,
        generate=generate,
        archive=archive,
    )
    quiet_console(trainer)
    if generate is not None:
        log.info(f"generation: {trainer.prepare_fast_generation()}")
    if writer is not None:  # one writer for the Trainer's scalars and ours, handed to transformers' own callback
        trainer.remove_callback(TensorBoardCallback)
        trainer.add_callback(TensorBoardCallback(tb_writer=writer))
        trainer.add_callback(grpo.TensorBoardSamples(writer, latest, script_args.sample_steps, script_args.num_samples))
        if archive is not None:
            archive.writer = writer
    return trainer, ctrl_c


def run_grpo(trainer, ctrl_c, checkpoint: Path | None) -> bool:
    """trainer.train() with Ctrl-C handled (a checkpoint at the end of the step); True when Ctrl-C stopped it. A disk
    that fills up (or any write that fails) stops the run with one line; the checkpoint it was writing is removed
    and the last complete one is left as it was, for --resume auto."""
    import trainer as grpo

    previous = signal.signal(signal.SIGINT, ctrl_c.on_sigint)
    output_dir = Path(trainer.args.output_dir)
    try:
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    except grpo.CheckpointError as exc:
        import shutil

        if trainer.is_world_process_zero() and run_folder.checkpoint_damage(exc.folder):
            shutil.rmtree(exc.folder, ignore_errors=True)  # a half-written one, and the space it held
        close_bars(trainer)
        die(f"cannot write {exc.folder} ({one_line(exc.__cause__)}): {last_complete(output_dir)}")
    except OSError as exc:  # writing metrics.jsonl, training.log, strategies/, TensorBoard's files
        close_bars(trainer)
        die(f"stopped at step {trainer.state.global_step} ({one_line(exc)}): {last_complete(output_dir)}")
    finally:
        signal.signal(signal.SIGINT, previous)
    return ctrl_c.requested


def close_bars(trainer) -> None:
    """The Trainer's progress bars closed now: left open, they redraw at exit, after our last line."""
    for callback in trainer.callback_handler.callbacks:
        for bar in (getattr(callback, "training_bar", None), getattr(callback, "prediction_bar", None)):
            if bar is not None:
                bar.close()


def one_line(exc: BaseException | None, limit: int = 200) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:limit]


def last_complete(output_dir: Path) -> str:
    """Where a stopped run stands: its last complete checkpoint, and how to go on."""
    last = run_folder.last_complete(output_dir)
    if last is None:
        return "no checkpoint was completed"
    return f"the last complete checkpoint, {last.name}, is intact: --resume auto continues from it once there is room"


def game_salt(settings, checkpoint: Path | None, state) -> str:
    """The secret mixed into the training games' seeds: the checkpoint's on a resume, else --game_salt, else a fresh
    random one; the main process decides and every rank uses it (each rank plays its share of the same games)."""
    from accelerate.utils import broadcast_object_list

    import trainer as grpo

    salt = settings.game_salt or rewards.new_salt()
    if checkpoint is not None:
        saved = grpo.saved_salt(checkpoint)
        if saved is None:
            log.warning(f"{checkpoint} keeps no game salt (written by an older train_2048): new games from here")
        elif settings.game_salt and settings.game_salt != saved:
            log.warning(f"--game_salt differs from the one {checkpoint} was trained with: the checkpoint's is used")
        salt = saved or salt
    return broadcast_object_list([salt])[0] if state.num_processes > 1 else salt


def train(argv: list[str], backend: str, cuda: bool) -> int:
    models.quiet_library_imports()  # before unsloth and trl, which import bitsandbytes
    if cuda:
        prepare_cuda()
    if backend == "unsloth":
        import unsloth  # noqa: F401  (it patches trl, transformers and peft, so it comes before them)

    script_args, settings, training_args, model_args = parse_args(argv)
    checkpoint, notes = check_before_loading(script_args, settings, training_args, model_args, backend)
    output_dir = Path(training_args.output_dir)
    merge_source = check_merge_source(script_args, model_args, output_dir)

    from accelerate import PartialState
    from transformers import set_seed

    state = PartialState()  # set up by GRPOConfig: one process, or this rank of an accelerate launch
    if script_args.overwrite_output_dir and state.is_main_process:
        run_folder.clear_run(output_dir)  # every check has passed: the user asked for this run to replace the earlier one
    created = state.is_main_process and not output_dir.exists()
    start_logging(output_dir, state)
    log.info(f"train_2048: {model_args.model_name_or_path} on the {backend} backend, writing to {output_dir}")
    for note in notes:
        log.warning(note)
    if merge_source is not None:
        log.info(f"--save_method merged_16bit: merge_2048.py will merge the LoRA into {merge_source} after training")
    if state.num_processes > 1:
        log.info(f"{state.num_processes} processes ({state.distributed_type.value}), each scoring its own completions")
    if checkpoint is not None:
        log.info(f"resuming from {checkpoint}")
        if state.is_main_process:
            run_folder.drop_later_metrics(output_dir / "metrics.jsonl", checkpoint)
    elif (script_args.resume or training_args.resume_from_checkpoint) == "auto":
        log.info("--resume auto: no checkpoint yet, starting at step 0")

    set_seed(training_args.seed)
    if script_args.cpu_threads > 0:
        import torch

        torch.set_num_threads(script_args.cpu_threads)
    settings = dataclasses.replace(settings, game_salt=game_salt(settings, checkpoint, state))
    prompt = rewards.build_prompt(settings)
    reasoning = (training_args.chat_template_kwargs or {}).get("reasoning_effort", "low")
    try:
        model, tokenizer = load_policy(script_args, training_args, model_args, backend, prompt, state, output_dir)
    except Exception as exc:  # not on the hub, no network, damaged or foreign files: all the user's to fix
        log.debug("the model did not load", exc_info=True)  # the traceback, in training.log
        if created:
            import shutil

            shutil.rmtree(output_dir, ignore_errors=True)
        die(f"cannot load model {model_args.model_name_or_path}: {one_line(exc, 300)}")
    if checkpoint is not None:
        compare_adapters(model, checkpoint)
    check_budget(tokenizer, settings, script_args, training_args, model_args.model_name_or_path, backend, reasoning)
    import trainer as grpo

    writer = None
    if state.is_main_process and "tensorboard" in training_args.report_to:
        writer = grpo.tensorboard_writer(output_dir)
    if script_args.warm_start and checkpoint is None:
        warm_start(model, tokenizer, prompt, script_args, training_args, state, output_dir, writer)

    trainer, ctrl_c = make_trainer(model, tokenizer, settings, script_args, training_args, state, output_dir, reasoning,
                                   checkpoint, writer)
    del model  # the trainer holds it; the save step may release it to check a merged copy alone
    if run_grpo(trainer, ctrl_c, checkpoint):
        step = trainer.state.global_step
        log.info(f"stopped by Ctrl-C after step {step}, saved as {output_dir / f'checkpoint-{step}'}; "
                 "--resume auto continues")  # fmt: skip
        return 130

    import evaluation

    steps = trainer.state.global_step
    ok = models.save_and_verify(
        trainer, tokenizer, save_method=script_args.save_method, verify=script_args.verify_save,
        use_peft=model_args.use_peft, backend=backend, seed=training_args.seed, output_dir=output_dir,
        prompt_inputs=evaluation.prompt_inputs(tokenizer, settings, training_args.chat_template_kwargs or {}),
        merge_base=merge_source,
    )  # fmt: skip
    log.info(f"done after {steps} steps. TensorBoard: {tensorboard_command(output_dir)} (its Custom Scalars tab, "
             "#custom_scalars, has the charts that say whether it learned)")
    return 0 if ok else 1


def tensorboard_command(output_dir: Path) -> str:
    """The command that opens this run in TensorBoard from here: the one installed beside this Python (setup.sh's
    .venv/bin/tensorboard, not on PATH until the venv is activated), else whatever PATH has."""
    import shlex
    import shutil

    beside = Path(sys.executable).parent / "tensorboard"
    if beside.is_file():
        relative = os.path.relpath(beside)
        program = relative if not relative.startswith("..") else str(beside)
    else:
        program = "tensorboard" if shutil.which("tensorboard") else f"{sys.executable} -m tensorboard.main"
    return f"{shlex.quote(program)} --logdir {shlex.quote(str(output_dir))}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    backend, cuda = choose_backend(early_options(argv))
    sandbox.start()  # a fresh interpreter (not a fork), started before CUDA is used: one per process
    world = int(os.environ.get("WORLD_SIZE", "1"))  # accelerate launch / torchrun: one process per rank
    try:
        rc = train(argv, backend, cuda)
    except KeyboardInterrupt:
        print("train_2048: interrupted", file=sys.stderr)
        rc = 130
    finally:
        sandbox.shutdown()
    if world > 1:  # the sign that this rank got through (the test of the 2-process run reads it)
        print(f"train_2048: rank {os.environ.get('RANK', '?')}/{world} finished, exit status {rc}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
