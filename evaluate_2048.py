"""Evaluate 2048 strategies: a trained model's, files', the baselines', on the same seeded games.

    python evaluate_2048.py                                   # the four baselines, 50 games each
    python evaluate_2048.py --adapter outputs/final --base    # the trained model, its base, the baselines
    python evaluate_2048.py --strategy mine.py --no-baselines --games 200
    python evaluate_2048.py --watch expectimax --speed 30     # one game, drawn in the terminal

A model writes S strategies from the training prompt; every strategy (a model's samples, each file, each
baseline) plays the same M seeded games in the sandbox, and each is judged like the rewards judge an
answer: a model's sample or a file is played only when it is one clean `def strategy(board)`. The table
goes to the terminal; every game goes to results.json; max-tile distributions to max_tiles.png.
Everything except the baselines in `--watch` runs in the sandbox: model output and files are untrusted.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import game2048
import rewards
import sandbox
import strategies

NOT_PLAYED = "not_played"  # the status of a game slot whose strategy was not played (invalid or cheating)
ERROR_STATUSES = ("error", "invalid", "crash")


def die(message: str) -> None:
    """A user error: one line on stderr, exit 2, no traceback."""
    print(f"evaluate_2048: {message}", file=sys.stderr)
    sys.exit(2)


# --- configuration ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="evaluate_2048.py",
        description="Play strategies (a model's samples, files, baselines) on the same seeded 2048 games.",
    )
    src = p.add_argument_group("what to evaluate")
    src.add_argument("--adapter", metavar="DIR", help="LoRA adapter directory (outputs/final, a checkpoint-N)")
    src.add_argument(
        "--model", metavar="PATH", help="full model directory, or the adapter's base model instead of its own"
    )
    src.add_argument("--base", action="store_true", help="with --adapter: also evaluate the base model without it")
    src.add_argument(
        "--strategy", metavar="FILE", action="append", default=[], help="a .py file defining strategy (repeatable)"
    )
    src.add_argument(
        "--baselines", dest="baselines", action="store_true", default=True, help="the four baselines (default)"
    )
    src.add_argument("--no-baselines", dest="baselines", action="store_false", help="leave the baselines out")
    src.add_argument("--watch", metavar="SOURCE", help="play one game in the terminal: a baseline, a file, or 'model'")
    src.add_argument("--speed", type=float, default=20.0, help="--watch: moves per second, 0 = as fast as possible")

    gen = p.add_argument_group("sampling (a model)")
    gen.add_argument("--samples", type=int, default=16, help="strategies sampled from each model")
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy decoding")
    gen.add_argument("--max_new_tokens", "--max-new-tokens", type=int, default=512)
    gen.add_argument("--batch_size", "--batch-size", type=int, default=8, help="samples generated at once")
    gen.add_argument("--reasoning_effort", "--reasoning-effort", default="low", help="chat template kwarg (gpt-oss)")

    game = p.add_argument_group("games")
    game.add_argument("--games", type=int, default=50, help="games per strategy, seeds seed..seed+games-1")
    game.add_argument("--seed", type=int, default=0, help="first game seed; also the sampling seed")
    game.add_argument("--size", type=int, default=5)
    game.add_argument("--target", type=int, default=2048)
    game.add_argument("--probability_fours", "--probability-fours", type=float, default=0.10)
    game.add_argument("--keys", default="WASD", help="the key alphabet: up, left, down, right")
    game.add_argument("--move_time_limit", "--move-time-limit", type=float, default=1.0, help="seconds")
    game.add_argument("--game_time_limit", "--game-time-limit", type=float, default=60.0, help="seconds (training: 10)")
    p.add_argument("--output_dir", "--output-dir", default="outputs/eval", help="results.json and max_tiles.png")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> rewards.RewardSettings:
    """Every check that needs nothing loaded, so a mistake costs a second, not a model load."""
    for name in ("samples", "games", "max_new_tokens", "batch_size"):
        if getattr(args, name) < 1:
            die(f"--{name} must be >= 1")
    if args.temperature < 0 or args.speed < 0:
        die("--temperature and --speed must be >= 0")
    try:
        game2048.GameBoard(size=args.size, target=args.target, probability_fours=args.probability_fours, keys=args.keys)
        settings = rewards.RewardSettings(
            size=args.size,
            target=args.target,
            probability_fours=args.probability_fours,
            keys=args.keys,
            move_time_limit=args.move_time_limit,
            game_time_limit=args.game_time_limit,
        )
    except ValueError as exc:
        die(str(exc))
    if args.adapter is not None and not (Path(args.adapter) / "adapter_config.json").is_file():
        die(f"--adapter {args.adapter}: no adapter_config.json there (not a LoRA adapter directory)")
    if args.model is not None:
        if not Path(args.model).expanduser().exists():
            die(f"--model {args.model}: no such directory (local paths only)")
        args.model = str(Path(args.model).expanduser())
    if args.base and args.adapter is None:
        die("--base needs --adapter (it is the model the adapter was trained on)")
    if args.watch is not None:
        if args.watch == "model" and args.adapter is None and args.model is None:
            die("--watch model needs --adapter or --model")
    elif not (args.baselines or args.strategy or args.adapter or args.model):
        die("nothing to evaluate: give --adapter, --model, --strategy or --baselines")
    return settings


# --- sources: who plays -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Sample:
    """One strategy of a source, judged statically like the rewards judge an answer."""

    code: str | None
    analysis: rewards.Analysis
    completion: str | None = None  # a model's raw decoded output

    @property
    def why_not_played(self) -> str | None:
        return self.analysis.why_not_played


@dataclasses.dataclass
class Source:
    name: str
    kind: str  # baseline | file | model
    samples: list[Sample]


def baseline_source(name: str) -> Source:
    code = strategies.source(name)
    return Source(name, "baseline", [Sample(code, rewards.analyse_code(code))])


def file_source(path: str) -> Source:
    """A strategy file, read and parsed but never imported: it is as untrusted as a model's answer."""
    try:
        code = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        die(f"--strategy {path}: cannot read it ({exc.__class__.__name__}: {getattr(exc, 'strerror', None) or exc})")
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError) as exc:
        die(f"--strategy {path}: does not parse ({getattr(exc, 'msg', exc)}, line {getattr(exc, 'lineno', '?')})")
    if not any(isinstance(n, ast.FunctionDef) and n.name == "strategy" for n in tree.body):
        die(f"--strategy {path}: defines no top-level function `strategy`")
    return Source(path, "file", [Sample(code, rewards.analyse_code(code))])


def model_source(name: str, completions: list[str]) -> Source:
    samples = []
    for text in completions:
        analysis = rewards.analyse(text)
        samples.append(Sample(analysis.code, analysis, completion=text))
    return Source(name, "model", samples)


# --- the model ----------------------------------------------------------------------------------------------


def load_model(args: argparse.Namespace):
    """(model, tokenizer) from local files: a full model, or a base model with the LoRA adapter on top."""
    base = args.model
    if args.adapter is not None and base is None:
        config = json.loads((Path(args.adapter) / "adapter_config.json").read_text())
        base = config.get("base_model_name_or_path")
        if not base:
            die(f"--adapter {args.adapter}: adapter_config.json names no base model; pass --model")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cuda = torch.cuda.is_available()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            base, dtype="auto", local_files_only=True, device_map="auto" if cuda else None
        )
        has_tokenizer = args.adapter is not None and (Path(args.adapter) / "tokenizer_config.json").is_file()
        tokenizer = AutoTokenizer.from_pretrained(args.adapter if has_tokenizer else base, local_files_only=True)
        if args.adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, args.adapter, local_files_only=True)
    except Exception as exc:  # not a model folder, not in the cache, a broken adapter: all the user's to fix
        die(f"cannot load model {base}{' with adapter ' + args.adapter if args.adapter else ''}: {one_line(exc)}")
    model.eval()
    return model, tokenizer


class NoProgress:
    """rich's Progress where nothing is drawn: sample_completions and play_sources inside another program
    (train_2048.py's --eval_steps)."""

    def add_task(self, description: str, total: float | None = None) -> None:
        return None

    def advance(self, task, advance: float = 1) -> None:
        pass


def one_line(exc: BaseException, limit: int = 300) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:limit]


def sample_completions(model, tokenizer, args, settings, progress, label: str) -> list[str]:
    """S decoded completions of the training prompt, seeded, `batch_size` at a time.

    Decoded with special tokens skipped, as TRL hands completions to the rewards (gpt-oss's final
    channel then reads "assistantfinal...", which rewards.extract_function understands).
    """
    import torch

    try:
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": rewards.build_prompt(settings)}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
            reasoning_effort=args.reasoning_effort,
        ).to(model.device)
    except Exception as exc:  # most often: the tokenizer has no chat template
        die(f"cannot build the prompt with the tokenizer's chat template: {one_line(exc)}")
    prompt_length = inputs["input_ids"].shape[1]
    task = progress.add_task(f"sampling {label}", total=args.samples)
    torch.manual_seed(args.seed)
    texts = []
    sampling = dict(do_sample=True, temperature=args.temperature) if args.temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        while len(texts) < args.samples:
            if args.temperature == 0 and texts:  # greedy decoding: every sample is the first one
                texts.append(texts[0])
                progress.advance(task)
                continue
            n = 1 if args.temperature == 0 else min(args.batch_size, args.samples - len(texts))
            out = model.generate(
                **inputs,
                **sampling,
                num_return_sequences=n,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            )
            texts += tokenizer.batch_decode(out[:, prompt_length:], skip_special_tokens=True)
            progress.advance(task, n)
    return texts


def model_sources(args, settings, progress, only_adapter: bool = False) -> list[Source]:
    """The model's row, or with --base the base model's and the adapter's, sampled with the same seed."""
    model, tokenizer = load_model(args)
    if args.adapter is None:
        return [model_source("model", sample_completions(model, tokenizer, args, settings, progress, "model"))]
    sources = []
    if args.base and not only_adapter:
        with model.disable_adapter():  # the same weights minus the LoRA: no second load
            base = sample_completions(model, tokenizer, args, settings, progress, "model (base)")
        sources.append(model_source("model (base)", base))
    adapted = sample_completions(model, tokenizer, args, settings, progress, "model (adapter)")
    sources.append(model_source("model (adapter)", adapted))
    return sources


# --- playing ------------------------------------------------------------------------------------------------


def play_sources(sources: list[Source], seeds: list[int], settings, progress) -> dict[tuple[int, int], list]:
    """(source index, sample index) -> one result per seed, every playable strategy in the sandbox at once.

    Identical code is played once (a model at low temperature repeats itself). Jobs go to play_many in
    chunks so the progress bar moves; a chunk is several games per core, so the cores stay busy.
    """
    codes = sorted({s.code for src in sources for s in src.samples if s.why_not_played is None})
    jobs = [(code, seed, settings) for code in codes for seed in seeds]
    chunk = max(16, 8 * len(os.sched_getaffinity(0)))
    task = progress.add_task("playing", total=len(jobs))
    results = []
    for start in range(0, len(jobs), chunk):
        results += sandbox.play_many(jobs[start : start + chunk])
        progress.advance(task, len(jobs[start : start + chunk]))
    by_code = {code: results[i * len(seeds) : (i + 1) * len(seeds)] for i, code in enumerate(codes)}
    played = {}
    for i, src in enumerate(sources):
        for j, sample in enumerate(src.samples):
            if sample.why_not_played is None:
                played[i, j] = by_code[sample.code]
            else:
                played[i, j] = [sandbox.GameResult(NOT_PLAYED, error=sample.why_not_played)] * len(seeds)
    return played


# --- report -------------------------------------------------------------------------------------------------


def game_stats(games: list) -> dict:
    """Win rate, median score and max tile, mean score; a slot not played counts as a game with nothing."""
    return {
        "games": len(games),
        "win_rate": sum(g.status == "success" for g in games) / len(games) if games else 0.0,
        "median_score": statistics.median(g.score for g in games) if games else 0,
        "median_max_tile": statistics.median_low(g.max_tile for g in games) if games else 0,  # always a tile
        "mean_score": statistics.fmean(g.score for g in games) if games else 0.0,
    }


def summarise(source: Source, games_by_sample: list[list]) -> dict:
    """One source's row: over every (sample, game) pair; a model also gets its best and its median sample."""
    flat = [g for games in games_by_sample for g in games]
    played = [g for g in flat if g.status != NOT_PLAYED]
    n = len(source.samples)
    summary = {
        "source": source.name,
        "kind": source.kind,
        "samples": n,
        "valid_rate": sum(s.analysis.parsed and s.analysis.one_function for s in source.samples) / n,
        "cheat_rate": sum(bool(s.analysis.cheats) for s in source.samples) / n,
        "played_samples": sum(s.why_not_played is None for s in source.samples),
        **game_stats(flat),
        "played_games": len(played),
        "timeouts": sum(g.status == "timeout" for g in played),
        "errors": sum(g.status in ERROR_STATUSES for g in played),
        "statuses": dict(Counter(g.status for g in flat)),
        "max_tile_counts": {str(k): v for k, v in sorted(Counter(g.max_tile for g in played).items())},
    }
    if source.kind == "model":
        per_sample = [game_stats(games) for games in games_by_sample]
        candidates = [j for j, s in enumerate(source.samples) if s.why_not_played is None]
        best = max(candidates, key=lambda j: per_sample[j]["mean_score"], default=None)  # first of equals
        summary["best_sample"] = None if best is None else {"sample": best, **per_sample[best]}
        summary["median_sample"] = {
            k: (statistics.median_low if k == "median_max_tile" else statistics.median)(s[k] for s in per_sample)
            for k in ("win_rate", "median_score", "median_max_tile", "mean_score")
        }
    return summary


def render_table(summaries: list[dict], settings, seeds: list[int]):
    from rich.table import Table
    from rich.text import Text

    title = (
        f"{settings.size}x{settings.size} board, target {settings.target}, p(4) {settings.probability_fours:g}, "
        f"{len(seeds)} games per strategy (seeds {seeds[0]}..{seeds[-1]})"
    )
    table = Table(title=title)
    for name, justify in [
        ("source", "left"), ("samples", "right"), ("valid", "right"), ("cheating", "right"), ("games", "right"),
        ("win rate", "right"), ("median score", "right"), ("median max tile", "right"), ("timeouts / errors", "right"),
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
        )
        if s["kind"] == "model":
            best = s["best_sample"]
            if best is None:
                table.add_row("  best sample: none played", "", "", "", "", "", "", "", "")
            else:
                table.add_row(
                    f"  best sample (#{best['sample']})", "", "", "", str(best["games"]), f"{best['win_rate']:.1%}",
                    number(best["median_score"]), number(best["median_max_tile"]), "",
                )  # fmt: skip
            med = s["median_sample"]
            table.add_row(
                f"  median of {s['samples']} samples", "", "", "", "", f"{med['win_rate']:.1%}",
                number(med["median_score"]), number(med["median_max_tile"]), "",
            )  # fmt: skip
    return table


def plot_max_tiles(summaries: list[dict], path: Path, settings) -> None:
    """Grouped bars: for each source, the share of its played games that ended on each max tile."""
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
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(path: Path, args, settings, seeds, sources, played, summaries) -> None:
    samples, games = [], []
    for i, src in enumerate(sources):
        for j, sample in enumerate(src.samples):
            samples.append(
                {
                    "source": src.name,
                    "sample": j,
                    "valid": sample.analysis.parsed and sample.analysis.one_function,
                    "cheats": list(sample.analysis.cheats),
                    "played": sample.why_not_played is None,
                    "why_not_played": sample.why_not_played,
                    "code": sample.code,
                    "completion": sample.completion,
                }
            )
            for seed, g in zip(seeds, played[i, j]):
                games.append(
                    {"source": src.name, "sample": j, "seed": seed, "status": g.status, "moves": g.moves,
                     "score": g.score, "max_tile": g.max_tile, "seconds": g.seconds, "error": g.error}
                )  # fmt: skip
    config = {k: v for k, v in vars(args).items() if k not in ("watch", "speed")}
    report = {"settings": {**config, "seeds": seeds}, "summary": summaries, "samples": samples, "games": games}
    path.write_text(json.dumps(report, indent=1) + "\n")


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
                seeds = [args.seed + i for i in range(args.games)]
                played = play_sources([source], seeds, settings, progress)
            summary = summarise(source, [played[0, j] for j in range(len(source.samples))])
            best = summary["best_sample"]
            if best is None:
                print(f"{source.name}: none of its {len(source.samples)} samples is playable; nothing to watch")
                return 1
            print(f"{source.name}: best of {len(source.samples)} samples is #{best['sample']} "
                  f"(mean score {best['mean_score']:.0f} over {args.games} games)")  # fmt: skip
            sample = source.samples[best["sample"]]
        else:
            if not Path(name).exists():
                die(f"--watch {name}: not a baseline ({', '.join(strategies.BASELINES)}), 'model', or a file")
            sample = file_source(name).samples[0]
            if sample.why_not_played is not None:
                print(f"{name}: not played: {sample.why_not_played}")
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


# --- main ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = check_args(args)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(width=None if sys.stdout.isatty() else 160)
    stderr = Console(stderr=True)
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=stderr, transient=True, disable=not stderr.is_terminal,
    )  # fmt: skip
    sandbox.start()  # its server starts before torch exists in this process (no threads, no CUDA to fork)
    try:
        if args.watch is not None:
            return watch(args, settings, console, progress)
        output_dir = Path(args.output_dir)
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            die(f"--output_dir {output_dir}: {exc.strerror or exc}")
        if not os.access(output_dir, os.W_OK):
            die(f"--output_dir {output_dir} is not writable")

        files = [file_source(path) for path in args.strategy]  # checked before a model takes minutes to load
        seeds = [args.seed + i for i in range(args.games)]
        with progress:
            sources = model_sources(args, settings, progress) if args.adapter or args.model else []
            sources += files + ([baseline_source(name) for name in strategies.BASELINES] if args.baselines else [])
            played = play_sources(sources, seeds, settings, progress)
        summaries = [summarise(src, [played[i, j] for j in range(len(src.samples))]) for i, src in enumerate(sources)]

        console.print(render_table(summaries, settings, seeds))
        for src in sources:
            if src.kind == "file" and src.samples[0].why_not_played:
                plain(console, f"{src.name}: not played: {src.samples[0].why_not_played}")
        write_results(output_dir / "results.json", args, settings, seeds, sources, played, summaries)
        plot_max_tiles(summaries, output_dir / "max_tiles.png", settings)
        plain(console, f"wrote {output_dir / 'results.json'} and {output_dir / 'max_tiles.png'}")
        return 0
    except KeyboardInterrupt:
        print("evaluate_2048: interrupted", file=sys.stderr)
        return 130
    finally:
        sandbox.shutdown()


if __name__ == "__main__":
    sys.exit(main())
