"""Evaluate 2048 strategies: a trained model's, files', the baselines', on the same seeded games.

    python evaluate_2048.py                                   # the four baselines, 50 games each
    python evaluate_2048.py --adapter outputs/final --base    # the trained model, its base, the baselines
    python evaluate_2048.py --config configs/cpu-demo.yaml --adapter outputs/cpu-demo/final   # the run's own board
    python evaluate_2048.py --strategy mine.py --no-baselines --games 200
    python evaluate_2048.py --watch expectimax --speed 30     # one game, drawn in the terminal

A model writes S strategies from the training prompt; every strategy (a model's samples, each file, each
baseline) plays the same M seeded games in the sandbox (by default from a secret start drawn for each evaluation, so
no strategy can know its games; the table and results.json name it, and --seed replays it), and each is judged like
the rewards judge an answer: a model's sample or a file is played only when it is one clean `def strategy(board)`. The game
options are rewards.RewardSettings, parsed as train_2048.py parses them; `--config` (default: train_2048.py's
default preset) gives the board, the token budget and the reasoning effort the model was trained with, and nothing
else of the training run (FROM_PRESET). The table goes to the terminal; every game to results.json; max-tile
distributions to max_tiles.png (in a given --output_dir, only what an evaluation wrote is ever replaced: MARKER).
Everything except the baselines in `--watch` runs in the sandbox.
The work is done by evaluation.py; this file reads the options and reports.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import json
import math
import os
import random
import secrets
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import evaluation
import game2048
import models  # the standard library only at import: the heavy imports wait until the options are checked
import options
import rewards
import run_folder
import sandbox
import strategies
import trained_base
import user_files

DEFAULT_PRESET = Path(__file__).resolve().parent / "configs" / "gpt-oss-20b.yaml"  # train_2048.py's default


def die(message: str) -> None:
    """A user error: one line on stderr, exit 2, no traceback."""
    print(f"evaluate_2048: {message}", file=sys.stderr)
    sys.exit(2)


def one_line(exc: BaseException, limit: int = 300) -> str:
    return options.one_line(exc, limit)


# --- configuration ------------------------------------------------------------------------------------------


RUN = "default: the run's, as --adapter's train_2048_options.json or --config says, else TRL's"


@dataclass
class EvalArguments:
    """What to evaluate and how to sample a model (the games are rewards.RewardSettings)."""

    _argument_group_name = "evaluate_2048"

    adapter: str | None = field(
        default=None, metadata={"help": "LoRA adapter directory (outputs/final, a checkpoint-N)"}
    )
    model: str | None = field(
        default=None, metadata={"help": "full model directory, or the adapter's base model instead of its own"}
    )
    base: bool = field(default=False, metadata={"help": "with --adapter: also evaluate the base model without it"})
    strategy: list[str] = field(
        default_factory=list, metadata={"help": "a .py file defining strategy (repeatable)", "action": "extend"}
    )
    baselines: bool = field(default=True, metadata={"help": "the four baselines beside the rest (--no-baselines)"})
    watch: str | None = field(
        default=None, metadata={"help": "play one game in the terminal: a baseline, a file, or 'model'"}
    )
    speed: float = field(default=20.0, metadata={"help": "--watch: moves per second, 0 = as fast as possible"})
    samples: int = field(default=16, metadata={"help": "strategies sampled from each model"})
    max_new_tokens: int | None = field(
        default=None,
        metadata={"help": "tokens per sampled answer (default: the training budget, the run's max_completion_length)"},
    )  # fmt: skip
    # The sampler: each as TRL's GRPOConfig names it, by default the run's own (RUN: what it trained with), TRL's
    # default where the run's options do not say.
    temperature: float | None = field(default=None, metadata={"help": f"sampling temperature ({RUN}); 0 = greedy"})
    top_p: float | None = field(default=None, metadata={"help": f"nucleus sampling's share ({RUN})"})
    top_k: int | None = field(default=None, metadata={"help": f"top-k sampling, 0 = no cut ({RUN})"})
    min_p: float | None = field(default=None, metadata={"help": f"min-p sampling ({RUN})"})
    repetition_penalty: float | None = field(default=None, metadata={"help": f"repetition penalty ({RUN})"})
    generation_kwargs: dict | str | None = field(
        default=None, metadata={"help": f"more GenerationConfig fields, a JSON mapping ({RUN})"}
    )
    cache_implementation: str | None = field(default=None, metadata={"help": f"generate's KV cache ({RUN})"})
    batch_size: int = field(default=8, metadata={"help": "samples generated at once"})
    reasoning_effort: str = field(default="low", metadata={"help": "chat template argument (gpt-oss)"})
    seed: int | None = field(
        default=None,
        metadata={"help": "first game seed (games use seed..seed+games-1); the sampling seed. Default: a secret "
                  "63-bit start drawn for each evaluation (no strategy can know its games), printed in the table and "
                  "results.json: give it here to replay that evaluation"},
    )  # fmt: skip
    output_dir: str | None = field(
        default=None,
        metadata={"help": "where results.json and max_tiles.png go (default: a new folder outputs/eval/<date>-<time>)"},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "replace the results an earlier evaluation left in --output_dir (never a file no evaluation "
                  "wrote)"},
    )  # fmt: skip


# The range of each number of EvalArguments (a float must also be finite), checked under the option's own name.
RANGES = {
    "samples": ((lambda v: v >= 1), "at least 1"),
    "max_new_tokens": ((lambda v: v >= 1), "at least 1"),
    "batch_size": ((lambda v: v >= 1), "at least 1"),
    "temperature": ((lambda v: v >= 0), "a finite number at least 0 (0 = greedy decoding)"),
    "top_p": ((lambda v: 0 < v <= 1), "above 0 and at most 1"),
    "top_k": ((lambda v: v >= 0), "at least 0 (0: no cut)"),
    "min_p": ((lambda v: 0 <= v <= 1), "at least 0 and at most 1"),
    "repetition_penalty": ((lambda v: v > 0), "a finite number above 0 (1: none)"),
    "speed": ((lambda v: v >= 0), "a finite number at least 0 (0 = as fast as possible)"),
    "seed": ((lambda v: 0 <= v < 2**63), "between 0 and 2^63 - 1 (the range of a drawn start)"),
}

# What an evaluation takes from a training run's options (--adapter's train_2048_options.json, or a --config preset):
# the game the model learned to play, its reward profile, and how it answered (its token budget, its reasoning effort,
# its sampler), each under the preset's key. The other keys are the training run's own (its output folder, games per
# answer, time limits, ...) and are not read: an evaluation writes to its own --output_dir and plays --games (50) games
# per strategy, with time to spare, unless its own flags say otherwise.
FROM_PRESET = {
    **{name: name for name in (*evaluation.BOARD, "profile", *evaluation.SAMPLING)},
    "max_completion_length": "max_new_tokens", "chat_template_kwargs.reasoning_effort": "reasoning_effort",
}  # fmt: skip


def parse_args(argv: list[str] | None) -> tuple[EvalArguments, rewards.RewardSettings]:
    """The options, checked with nothing loaded, so a mistake costs a second, not a model load."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(
        (EvalArguments, rewards.RewardSettings), prog="evaluate_2048.py", allow_abbrev=False, exit_on_error=False
    )
    parser.add_argument("--config", metavar="FILE.yaml", default=None,
                        help="The training preset the model was trained with: the board (size, target, "
                        "probability_fours, keys, max_moves), the reward profile, max_completion_length (as "
                        "--max_new_tokens), the reasoning effort and the sampler are read from it; its other keys "
                        "(output_dir, games, time limits) are the training run's and are not. Without it: the run's "
                        f"own options, which --adapter's {evaluation.RUN_FILE} records (or a --strategy file of the "
                        "strategy archive its game), else train_2048's default preset, "
                        f"{DEFAULT_PRESET.relative_to(DEFAULT_PRESET.parents[1])}. Flags win.")  # fmt: skip
    # Evaluation plays more games per strategy, with time to spare: a loaded machine must not turn slow but good
    # play into timeouts.
    parser.set_defaults(games=50, game_time_limit=60.0)
    try:
        path, rest = options.split_config(list(sys.argv[1:] if argv is None else argv))
        first, given = options.parse(parser, {}, rest, "evaluate_2048")  # the command line alone: what it names
        if path is not None:  # a train_2048 preset, checked as train_2048 checks it (an accelerate config is not one)
            config, label, board_from = options.read_config(path), path, f"--config {path}"
            options.preset_env(config, f"--config {path}")  # (an evaluation sets none of its env:)
            options.refuse_unknown_keys(config, options.train_parser(), f"--config {path}: not a train_2048 preset")
            sampling_from = board_from
        else:
            config, label, board_from, sampling_from = the_runs_options(first, given)
        chat = config.get("chat_template_kwargs")
        if isinstance(chat, dict) and "reasoning_effort" in chat:
            config["chat_template_kwargs.reasoning_effort"] = chat["reasoning_effort"]
        taken = {key: value for key, value in config.items() if key in FROM_PRESET}
        namespace, _ = options.parse(parser, taken, rest, label, names=FROM_PRESET)
        args, settings = options.build(parser, namespace)
    except options.OptionError as exc:
        die(str(exc))
    except ValueError as exc:  # a value RewardSettings rejects (--size 1, --keys WWSD, ...)
        die(" ".join(str(exc).split()))
    args.board_from = with_flags(board_from, given, evaluation.BOARD)
    args.sampling_from = with_flags(sampling_from, given, ("max_new_tokens", *evaluation.SAMPLING))
    if args.max_new_tokens is None:  # a preset without a budget trained with TRL's default one
        from trl import GRPOConfig

        args.max_new_tokens = GRPOConfig.__dataclass_fields__["max_completion_length"].default
    for name, (accepts, said) in RANGES.items():  # each mistake names its own option (NaN fails every test)
        value = getattr(args, name)
        if value is not None and ((isinstance(value, float) and not math.isfinite(value)) or not accepts(value)):
            die(f"--{name} {f'{value:g}' if isinstance(value, float) else value}: must be {said}")
    resolve_sampling(args, given)
    if args.adapter is not None and not (Path(args.adapter) / "adapter_config.json").is_file():
        die(f"--adapter {args.adapter}: no adapter_config.json there (not a LoRA adapter directory)")
    if args.model is not None:
        if not Path(args.model).expanduser().exists():
            die(f"--model {args.model}: no such directory (local paths only)")
        if models.not_a_model(args.model):
            die(f"--model {args.model}: {models.not_a_model(args.model)}")
        if models.weights_damage(Path(args.model)):
            die(f"--model {args.model}: {models.weights_damage(Path(args.model))}")
        args.model = str(Path(args.model).expanduser())
    if args.base and args.adapter is None:
        die("--base needs --adapter (it is the model the adapter was trained on)")
    if args.output_dir is not None and user_files.name_problem(args.output_dir):
        die(f"--output_dir: {user_files.name_problem(args.output_dir)}")
    if args.watch is not None:
        if args.watch == "model" and args.adapter is None and args.model is None:
            die("--watch model needs --adapter or --model")
    elif not (args.baselines or args.strategy or args.adapter or args.model):
        die("nothing to evaluate: give --adapter, --model, --strategy or --baselines")
    return args, settings


def the_runs_options(first, given: set[str]) -> tuple[dict, str, str, str]:
    """Without --config: (the options the evaluation starts from, the name its mistakes are said under, where the
    board comes from, where the sampler comes from), from what the command line names (`first`, the names `given`):
    the run's own options, as --adapter's RUN_FILE records them; else the game a --strategy (or --watch) file of the
    strategy archive names (evaluation.file_game); else train_2048's default preset. Runs whose games differ on a board
    option the flags leave open are one line, exit 2."""
    default = options.read_config(str(DEFAULT_PRESET))
    preset = f"train_2048's default preset, {DEFAULT_PRESET.relative_to(DEFAULT_PRESET.parents[1])}"
    record = run_record(Path(first.adapter)) if first.adapter is not None else None
    files = [*first.strategy, *([first.watch] if first.watch not in (None, "model", *strategies.BASELINES) else [])]
    games = {f"{path}'s {evaluation.ARCHIVED_GAME}": game for path in files if (game := strategy_game(path))}
    if record is not None:
        games = {f"--adapter {first.adapter}'s run": {name: record.get(name) for name in evaluation.BOARD}, **games}
    open_ = [name for name in evaluation.BOARD if name not in given]
    if len({tuple(str(game[name]) for name in open_) for game in games.values()}) > 1:
        said = "; ".join(f"{where}: {describe_game(game)}" for where, game in games.items())
        die(f"the strategies and models given were trained on different games ({said}): name the board to play "
            "with --config or --size/--target/--probability_fours/--keys/--max_moves")  # fmt: skip
    if record is not None:
        where = f"the run's own options, {Path(first.adapter) / evaluation.RUN_FILE}"
        return {**default, **record}, str(Path(first.adapter) / evaluation.RUN_FILE), where, where
    if games:
        where, game = next(iter(games.items()))
        return {**default, **game}, where, f"the game its run played, {where}", preset
    if first.adapter is not None:
        preset += f" (--adapter {first.adapter} records no run options: trained before train_2048 kept them, or not by it)"
    return default, str(DEFAULT_PRESET), preset, preset


def run_record(adapter: Path) -> dict | None:
    """The run options an adapter folder keeps (evaluation.RUN_FILE), checked as a preset is: None when there is none."""
    path = adapter / evaluation.RUN_FILE
    if not os.path.lexists(path):
        return None
    try:
        record = user_files.read_json(path, what=f"--adapter {adapter}'s run options")
    except user_files.FileRefused as exc:
        die(str(exc))
    if not isinstance(record, dict):
        die(f"--adapter {adapter}: {path.name} is not a mapping of option: value")
    options.refuse_unknown_keys(record, options.train_parser(), f"{path}: not a train_2048 run's options")
    return record


def strategy_game(path: str) -> dict | None:
    """The game a strategy file of the archive names; None for another file, or one that cannot be read (file_source
    says why, in its own line)."""
    try:
        text = user_files.read_text(path, user_files.STRATEGY_BYTES, "--strategy")
    except (user_files.FileRefused, OSError):
        return None
    try:
        return evaluation.file_game(text)
    except ValueError as exc:
        die(f"--strategy {path}: {exc}")


def describe_game(game: dict) -> str:
    return " ".join(f"--{name} {game[name]}" for name in evaluation.BOARD)


def with_flags(where: str, given: set[str], names) -> str:
    """`where`, and the options of `names` the command line gave (they win)."""
    flags = [f"--{name}" for name in names if name in given]
    return where + (f"; {', '.join(flags)} from the command line" if flags else "")


def resolve_sampling(args: EvalArguments, given: set[str]) -> None:
    """The sampler's options as the evaluation samples with them: the run's or the flags', TRL's defaults for the
    rest (evaluation.sampling_options), --generation_kwargs read as the JSON mapping it is. A flag the command line
    `given` wins over the same field in the run's generation_kwargs (which TRL applies last)."""
    extra = args.generation_kwargs
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            extra = None
        if not isinstance(extra, dict):
            die(f"--generation_kwargs {args.generation_kwargs}: must be a JSON mapping of GenerationConfig fields")
    if "generation_kwargs" not in given:
        extra = {k: v for k, v in (extra or {}).items() if k not in given}
    sampling = evaluation.sampling_options(**{**{n: getattr(args, n) for n in evaluation.SAMPLING},
                                              "generation_kwargs": extra})  # fmt: skip
    for name in evaluation.SAMPLING:
        setattr(args, name, getattr(sampling, name))


def sampler(args: EvalArguments) -> str:
    """How a model is sampled, in a few words."""
    if args.temperature == 0:
        return f"greedy, {args.max_new_tokens} tokens"
    shown = [f"{name} {getattr(args, name)}" for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
             if getattr(args, name) is not None]  # fmt: skip
    extra = [f"{k} {v}" for k, v in (args.generation_kwargs or {}).items()]
    return ", ".join([*shown, *extra, f"{args.max_new_tokens} tokens"])


# --- sources ------------------------------------------------------------------------------------------------


def file_source(path: str, flag: str = "--strategy") -> evaluation.Source:
    try:
        return evaluation.file_source(path, what=flag)
    except user_files.FileRefused as exc:  # a FIFO, a device, a folder, too large: said as user_files says it
        die(str(exc))
    except ValueError as exc:
        die(f"{flag} {path}: {exc}")


def adapter_base(args: EvalArguments) -> str:
    """The model --adapter goes on, checked with nothing loaded or written (main): the adapter's files, then --model or the
    base trained_base.resolve_base finds (the recorded path, the same name in the run folder, the hub name), in transformers'
    layout, whose fingerprint must be the trained base's."""
    config, problem = models.adapter_config_problem(Path(args.adapter))
    problem = problem or models.adapter_weights_problem(Path(args.adapter))
    if problem:
        die(f"--adapter {args.adapter}: {problem}")
    try:
        base = trained_base.resolve_base(Path(args.adapter), args.model, "--model")
    except trained_base.BaseRefused as error:
        die(f"--adapter {args.adapter}: {error}")
    problem = models.lora_width_problem(config, base)
    if problem:
        die(f"--adapter {args.adapter}: {problem}")
    problem = models.weights_damage(Path(base)) if args.model is None else None  # --model: checked with the options
    if problem:
        die(f"--adapter {args.adapter}: its base {base}: {problem}")
    if args.model is None and base in models.FUSED_CHECKPOINT:  # a default run's: Unsloth's split 4-bit checkpoint
        print(f"evaluate_2048: {base} stores GPT-OSS's experts split for Unsloth's 4-bit classes; evaluating on "
              f"the same model in transformers' layout, {models.FUSED_CHECKPOINT[base]} (--model picks another)")  # fmt: skip
        base = models.FUSED_CHECKPOINT[base]
    elif args.model is None and split_checkpoint(base):
        die(f"--adapter {args.adapter}: its base {base} stores GPT-OSS's experts split (Unsloth's 4-bit layout), "
            "which transformers cannot load; pass --model with the same weights in transformers' layout")
    check_base(Path(args.adapter), base)
    return base


def load_model(args: EvalArguments):
    """(model, tokenizer) from local files: a full model, or a base model (adapter_base) with the LoRA adapter on top."""
    base = args.model
    import torch
    import transformers
    from trl import ModelConfig

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        model, tokenizer = models.load_model(
            base,
            ModelConfig(model_name_or_path=base, dtype="auto"),
            adapter=args.adapter,
            device_map="auto" if torch.cuda.is_available() else None,
            local_files_only=True,
        )
    except Exception as exc:  # not a model folder, not in the cache, a broken adapter: all the user's to fix
        die(f"cannot load model {base}{' with adapter ' + args.adapter if args.adapter else ''}: {one_line(exc)}")
    if args.adapter is not None and models.split_expert_lora(args.adapter):
        print(f"evaluate_2048: {args.adapter} holds a LoRA per expert (Unsloth's split layout, a default run's): "
              "mapped onto the fused expert tensors of transformers' GPT-OSS, the same function")  # fmt: skip
    model.eval()
    return model, tokenizer


def check_base(adapter: Path, base: str) -> None:
    """The adapter goes on the base it was trained on (its train_2048_base.json): another base is one line, exit 2;
    a base that cannot be compared (an older adapter, no embedding in the files) is said in one line, and evaluated."""
    folder, _ = models.checkpoint_files(base)
    try:
        other, note = trained_base.compare_base(adapter, folder, base)
    except ValueError as error:  # its train_2048_base.json, damaged or holding what no run writes
        die(f"--adapter {adapter}: {error}")
    if other:
        die(f"--adapter {adapter}: {other}; --model names the model it was trained on")
    if note:
        print(f"evaluate_2048: {note}", file=sys.stderr)


def split_checkpoint(folder: str) -> bool:
    """A local checkpoint whose tensors are Unsloth's split experts (gate_up_projs.<e>), not transformers' fused ones."""
    index = Path(folder) / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = models.tensor_files(Path(folder))
        except ValueError:  # a damaged index: the load says so in its own line
            return False
    else:
        from safetensors import safe_open

        names = []
        for shard in Path(folder).glob("*.safetensors") if Path(folder).is_dir() else []:
            with safe_open(str(shard), framework="pt") as f:
                names += list(f.keys())  # noqa: SIM118 (safe_open has keys(), no iteration)
    return any(".experts.gate_up_projs." in name for name in names)


def model_sources(args, settings, progress, only_adapter: bool = False) -> list[evaluation.Source]:
    """The model's row, or with --base the base model's and the adapter's, sampled with the same seed."""
    model, tokenizer = load_model(args)
    try:  # the template renders the prompt as the sampling will: bounded in time and length (a user's folder)
        models.check_template(tokenizer, [{"role": "user", "content": rewards.build_prompt(settings)}],
                              args.adapter or args.model, reasoning_effort=args.reasoning_effort)  # fmt: skip
    except models.TemplateRefused as exc:  # none, one that fails, never ends or floods
        die(str(exc))

    def sample(label: str) -> evaluation.Source:
        task = progress.add_task(f"sampling {label}", total=args.samples)
        try:
            texts = evaluation.sample_completions(
                model, tokenizer, settings, samples=args.samples, seed=args.seed, batch_size=args.batch_size,
                config=evaluation.generation_config(args, tokenizer, args.max_new_tokens, greedy=args.temperature == 0),
                chat_kwargs={"reasoning_effort": args.reasoning_effort},
                on_batch=lambda n: progress.advance(task, n),
            )  # fmt: skip
        except (TypeError, ValueError, KeyError) as exc:  # most often: the tokenizer has no chat template
            die(f"cannot sample from {label}: {one_line(exc)}")
        return evaluation.model_source(label, texts)

    if args.adapter is None:
        return [sample("model")]
    sources = []
    if args.base and not only_adapter:
        with model.disable_adapter():  # the same weights minus the LoRA: no second load
            sources.append(sample("model (base)"))
    sources.append(sample("model (adapter)"))
    return sources


def play_sources(sources, seeds, settings, progress) -> dict:
    task = progress.add_task("playing", total=None)
    return evaluation.play_sources(
        sources, seeds, settings, on_games=lambda done, total: progress.update(task, completed=done, total=total)
    )


# --- report -------------------------------------------------------------------------------------------------


def render_table(summaries: list[dict], settings, seeds: list[int], drawn: bool = False, caption: str | None = None):
    from rich.table import Table
    from rich.text import Text

    title = (
        f"{settings.size}x{settings.size} board, target {settings.target}, p(4) {settings.probability_fours:g}, "
        f"{len(seeds)} games per strategy (seeds {seeds[0]}..{seeds[-1]}"
        + (f": a secret start drawn for this evaluation; --seed {seeds[0]} replays it)" if drawn else ")")
    )
    table = Table(title=title, caption=Text(caption or ""), caption_justify="left")  # paths: no markup
    for name, justify in [
        ("source", "left"), ("samples", "right"), ("valid", "right"), ("cheating", "right"), ("games", "right"),
        ("win rate", "right"), ("median score", "right"), ("median max tile", "right"), ("timeouts / errors", "right"),
        ("mean reward", "right"),  # a model's: its samples as training rewards them (eval_mean_reward)
    ]:  # fmt: skip
        table.add_column(name, justify=justify)

    def number(x) -> str:  # a median of two scores can end in .5
        return str(int(x)) if x == int(x) else f"{x:.1f}"

    for s in summaries:
        table.add_row(
            Text(s["source"]),
            str(s["samples"]),
            f"{s['valid_rate']:.0%}",
            f"{s['cheat_rate']:.0%}",
            str(s["games"]),
            f"{s['win_rate']:.1%}",
            number(s["median_score"]),
            number(s["median_max_tile"]),
            f"{s['timeouts']} / {s['errors']}",
            f"{s['mean_reward']:.2f}" if "mean_reward" in s else "",
        )
        if s["kind"] == "model":
            best = s["best_sample"]
            if best is None:
                table.add_row("  best sample: none played", "", "", "", "", "", "", "", "", "")
            else:
                table.add_row(
                    f"  best sample (#{best['sample']})", "", "", "", str(best["games"]), f"{best['win_rate']:.1%}",
                    number(best["median_score"]), number(best["median_max_tile"]), "", "",
                )  # fmt: skip
            med = s["median_sample"]
            table.add_row(
                f"  median of {s['samples']} samples", "", "", "", "", f"{med['win_rate']:.1%}",
                number(med["median_score"]), number(med["median_max_tile"]), "", "",
            )  # fmt: skip
    return table


def caption(args: EvalArguments, sources: list) -> str:
    """Under the table: where its board came from, and how the models were sampled and from where."""
    lines = [f"board: {args.board_from}"]
    if any(src.kind == "model" for src in sources):
        lines.append(f"sampled: {sampler(args)} ({args.sampling_from})")
    return "\n".join(lines)


def plot_max_tiles(summaries: list[dict], settings) -> bytes:
    """Grouped bars: for each source, the share of its played games that ended on each max tile (a PNG's bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiles = sorted({int(t) for s in summaries for t in s["max_tile_counts"]})
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(tiles) + 2), 4.5))
    width = 0.8 / max(1, len(summaries))
    for k, s in enumerate(summaries):
        total = sum(s["max_tile_counts"].values())
        shares = [s["max_tile_counts"].get(str(t), 0) / total if total else 0.0 for t in tiles]
        ax.bar(
            [i + (k - (len(summaries) - 1) / 2) * width for i in range(len(tiles))], shares, width, label=s["source"]
        )
    ax.set_xticks(range(len(tiles)), [str(t) for t in tiles])
    ax.set_xlabel("max tile")
    ax.set_ylabel("share of played games")
    ax.set_title(f"Max tile per game, {settings.size}x{settings.size} board, target {settings.target}")
    if not tiles:
        ax.text(0.5, 0.5, "no game was played", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize="small")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    return png.getvalue()


def results_json(args, settings, seeds, sources, played, summaries, drawn: bool = False) -> str:
    """results.json's text: the settings (the seeds, and whether their start was drawn for this evaluation), the
    summaries, every sample and every game."""
    samples, games = [], []
    for i, src in enumerate(sources):
        for j, sample in enumerate(src.samples):
            samples.append(
                {
                    "source": src.name,
                    "sample": j,
                    "valid": sample.analysis.loadable,
                    "cheats": list(sample.analysis.cheats)
                    + [f"at run time: {g.error}" for g in played[i, j][:1] if g.status == "violation"],
                    "played": sample.analysis.playable,
                    "why_not_played": sample.analysis.why_not_played,
                    "code": sample.code,
                    "completion": sample.completion,
                }
            )
            for seed, g in zip(seeds, played[i, j]):
                games.append(
                    {"source": src.name, "sample": j, "seed": seed, "status": g.status, "moves": g.moves,
                     "score": g.score, "max_tile": g.max_tile, "seconds": g.seconds, "error": g.error}
                )  # fmt: skip
    config = {k: v for k, v in {**dataclasses.asdict(args), **settings.rules(), "profile": settings.profile,
                                "games": settings.games, "board_from": args.board_from,
                                "sampling_from": args.sampling_from}.items() if k not in ("watch", "speed")}  # fmt: skip
    report = {"settings": {**config, "seeds": seeds, "seed_drawn": drawn}, "summary": summaries, "samples": samples,
              "games": games}  # fmt: skip
    return json.dumps(report, indent=1) + "\n"


# --- watch --------------------------------------------------------------------------------------------------


def watch(args, settings, console, progress) -> int:
    """One game (seed --seed) drawn move by move. A baseline is trusted and plays here; a file or the model's
    best sample plays in the sandbox, which records its keys, and the engine replays them to draw each board."""
    name = args.watch
    board = dict(size=settings.size, target=settings.target, probability_fours=settings.probability_fours)
    board["keys"] = settings.keys
    if name in strategies.BASELINES:
        strategy, result = strategies.BASELINES[name], None
    else:
        if name == "model":
            with progress:
                (source,) = model_sources(args, settings, progress, only_adapter=True)
                seeds = [args.seed + i for i in range(settings.games)]
                played = play_sources([source], seeds, settings, progress)
            summary = evaluation.summarise(source, [played[0, j] for j in range(len(source.samples))], settings)
            best = summary["best_sample"]
            if best is None:
                print(f"{source.name}: none of its {len(source.samples)} samples is playable; nothing to watch")
                return 1
            print(f"{source.name}: best of {len(source.samples)} samples is #{best['sample']} "
                  f"(mean score {best['mean_score']:.0f} over {settings.games} games)")  # fmt: skip
            sample = source.samples[best["sample"]]
        else:
            if not Path(name).exists():
                die(f"--watch {name}: not a baseline ({', '.join(strategies.BASELINES)}), 'model', or a file")
            sample = file_source(name, "--watch").samples[0]
            if sample.analysis.why_not_played is not None:
                print(f"{name}: not played: {sample.analysis.why_not_played}")
                return 1
        result = sandbox.play(sample.code, seed=args.seed, record_keys=True, **settings.rules())
        keys = iter(result.played_keys or "")
        strategy = lambda _board: next(keys, None)  # noqa: E731

    game = game2048.GameBoard(seed=args.seed, max_idle_moves=game2048.MAX_IDLE_MOVES, **board)
    random.seed(game2048.strategy_seed(args.seed))  # as play_game does: a random baseline replays its game

    def frame():
        from rich.console import Group
        from rich.text import Text

        heading = Text(f"{name} · seed {args.seed} · move {game.moves} · score {game.score()}")
        return Group(heading, game2048.render_rich(game.board()))

    if console.is_terminal:
        from rich.live import Live

        with Live(frame(), console=console, auto_refresh=False) as live:
            while game.state() == "ongoing":
                key = strategy(game.board())
                if key is None:  # the recorded keys ran out: the sandbox's game ended here (timeout, error)
                    break
                if game.do_action(key):
                    live.update(frame(), refresh=True)
                    if args.speed:
                        time.sleep(1 / args.speed)
    else:  # piped: the final board and the result only
        while game.state() == "ongoing" and (key := strategy(game.board())) is not None:
            game.do_action(key)
        console.print(frame())
    if result is None:  # a baseline, played here
        error = "idle: 100 keys in a row changed nothing" if game.idle_moves >= game2048.MAX_IDLE_MOVES else ""
        plain(console, result_line(name, game.state(), game.moves, game.score(), game.max_tile(), error))
        return 0
    if (game.moves, game.score(), game.max_tile()) != (result.moves, result.score, result.max_tile):
        console.print("(warning: the replay differs from the sandbox's game)")
    plain(console, result_line(name, result.status, result.moves, result.score, result.max_tile, result.error))
    return 0


def plain(console, text: str) -> None:
    """Print text that may come from untrusted code or a file name: no markup, no highlighting."""
    console.print(text, markup=False, highlight=False)


def result_line(name: str, status: str, moves: int, score: int, max_tile: int, error: str = "") -> str:
    return f"{name}: {status} after {moves} moves, score {score}, max tile {max_tile}" + (
        f" ({error})" if error else ""
    )


WRITES = ("results.json", "max_tiles.png")  # what an evaluation writes in its folder
MARKER = ".evaluate_2048.json"  # beside them: the SHA-256 of each file evaluations wrote there (the last two of each)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_digest(path: Path) -> str | None:
    """The SHA-256 of a regular file, opened without following a link; None for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest() if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else None


def recorded(folder: Path) -> dict:
    """What MARKER says evaluations wrote in `folder`: name -> digests; {} when there is no marker of ours (a link, a
    damaged file, another shape)."""
    marker = folder / MARKER
    try:
        if not stat.S_ISREG(os.lstat(marker).st_mode):
            return {}
        written = user_files.read_json(marker, what="marker")["written"]
    except (OSError, ValueError, LookupError, TypeError):
        return {}
    if not isinstance(written, dict):
        return {}
    return {n: d for n, d in written.items()
            if n in WRITES and isinstance(d, list) and all(isinstance(x, str) for x in d)}  # fmt: skip


def not_written_here(folder: Path) -> list[str]:
    """The files of WRITES in `folder` (links included, dangling or not) that no evaluation wrote: not regular files,
    or contents MARKER does not record."""
    known = recorded(folder)
    return [name for name in WRITES if os.path.lexists(folder / name)
            and file_digest(folder / name) not in known.get(name, [])]  # fmt: skip


def replace_file(path: Path, data: bytes) -> None:
    """`path` holds `data`: written to a new temporary name beside it (tempfile), then renamed over it, so a link of
    that name is replaced, never written through, and a reader sees the old file or the new one whole."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_outputs(folder: Path, files: dict[str, bytes]) -> None:
    """The evaluation's files into its folder, MARKER first (it keeps the digests of what was there and of what comes),
    so that an evaluation stopped half-way leaves only files MARKER knows."""
    known = recorded(folder)
    for name, data in files.items():
        known[name] = [*known.get(name, [])[-1:], digest(data)]
    replace_file(folder / MARKER, (json.dumps({"written": known}, indent=1) + "\n").encode())
    for name, data in files.items():
        replace_file(folder / name, data)


def results_folder(args: EvalArguments) -> Path:
    """The folder this evaluation writes, made now: a new one under outputs/eval by default, so that no evaluation
    replaces another's results; a given --output_dir that holds results is refused unless --overwrite_output_dir, and
    one that holds a results.json or max_tiles.png no evaluation wrote (a user's own, a link), or that is inside a
    folder a run claims or a command published (run_folder.inside_a_run), is refused always."""
    if args.output_dir is None:
        output_dir = first = Path("outputs/eval") / time.strftime("%Y%m%d-%H%M%S")
        for n in itertools.count(2):
            if not output_dir.exists():
                break
            output_dir = first.with_name(f"{first.name}-{n}")
    else:
        output_dir = Path(args.output_dir)
        inside = run_folder.inside_a_run(output_dir)
        if inside:
            die(f"--output_dir {output_dir} {inside}: give a folder outside it")
        foreign = not_written_here(output_dir)
        if foreign:
            die(f"--output_dir {output_dir} holds {' and '.join(foreign)} that no evaluation wrote (a file of your "
                "own, or a link): nothing was touched; give another --output_dir")  # fmt: skip
        if any(os.path.lexists(output_dir / name) for name in WRITES) and not args.overwrite_output_dir:
            die(f"--output_dir {output_dir} holds an earlier evaluation's results.json: give another --output_dir, or "
                "--overwrite_output_dir true to replace it")  # fmt: skip
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        die(f"--output_dir {output_dir}: {exc.strerror or exc}")
    return output_dir


# --- main ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    models.quiet_library_imports()  # before trl, which imports bitsandbytes
    args, settings = parse_args(argv)
    drawn = args.seed is None
    if drawn:  # a fresh secret start: no strategy can recognise its games (public seeds can be looked up)
        args.seed = secrets.randbits(63)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(width=None if sys.stdout.isatty() else 160)
    stderr = Console(stderr=True)
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=stderr, transient=True, disable=not stderr.is_terminal,
    )  # fmt: skip
    sandbox.start()  # its server starts before torch exists in this process (no threads, no CUDA to fork)
    walls = sandbox.walls()
    if settings.require_seccomp and not walls["seccomp"]:
        die(f"the sandbox has no seccomp wall here ({walls['reason']}); install libseccomp, or pass "
            "--require_seccomp false to play with the other walls only")  # fmt: skip
    try:
        if args.adapter is not None:  # (torch is imported here, after the sandbox's server has started)
            args.model = adapter_base(args)  # checked before anything is written
        if args.watch is not None:
            return watch(args, settings, console, progress)
        files = [file_source(path) for path in args.strategy]  # checked before a model takes minutes to load
        output_dir = results_folder(args)  # and before anything is written
        seeds = [args.seed + i for i in range(settings.games)]
        with progress:
            sources = model_sources(args, settings, progress) if args.adapter or args.model else []
            sources += files
            sources += [evaluation.baseline_source(name) for name in strategies.BASELINES] if args.baselines else []
            played = play_sources(sources, seeds, settings, progress)
        summaries = [
            evaluation.summarise(src, [played[i, j] for j in range(len(src.samples))], settings)
            for i, src in enumerate(sources)
        ]
        console.print(render_table(summaries, settings, seeds, drawn, caption(args, sources)))
        for src in sources:
            if src.kind == "file" and src.samples[0].analysis.why_not_played:
                plain(console, f"{src.name}: not played: {src.samples[0].analysis.why_not_played}")
        results = results_json(args, settings, seeds, sources, played, summaries, drawn).encode()
        try:
            write_outputs(output_dir, {"results.json": results, "max_tiles.png": plot_max_tiles(summaries, settings)})
        except OSError as exc:
            die(f"cannot write {output_dir}: {exc.strerror or exc}")
        plain(console, f"wrote {output_dir / 'results.json'} and {output_dir / 'max_tiles.png'}")
        return 0
    except KeyboardInterrupt:
        print("evaluate_2048: interrupted", file=sys.stderr)
        return 130
    finally:
        sandbox.shutdown()


if __name__ == "__main__":
    sys.exit(main())
