"""Evaluate 2048 strategies on fixed games: sample them from a model, judge them, play them, summarise.

Plain functions for evaluate_2048.py (the command line) and train_2048.py (its evaluation every --eval_steps):
the same seeds and the same judging in both, so a step's eval/* numbers are what `evaluate_2048.py --adapter
<output_dir>/checkpoint-N` reports. Everything a model or a file wrote is untrusted: judged statically like the
rewards judge an answer (rewards.analyse), played only in the sandbox. Errors raise; the callers decide how to
report them.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import statistics
from collections import Counter
from collections.abc import Callable, Iterable

import rewards
import sandbox
import strategies
import user_files

NOT_PLAYED = "not_played"  # the status of a game slot whose strategy was not played (invalid or cheating)
ERROR_STATUSES = ("error", "invalid", "crash")


@dataclasses.dataclass
class Sample:
    """One strategy of a source, judged statically like the rewards judge an answer."""

    code: str | None
    analysis: rewards.Analysis
    completion: str | None = None  # a model's raw decoded output


@dataclasses.dataclass
class Source:
    name: str
    kind: str  # baseline | file | model
    samples: list[Sample]


def baseline_source(name: str) -> Source:
    code = strategies.source(name)
    return Source(name, "baseline", [Sample(code, rewards.analyse_code(code))])


def file_source(path: str, what: str = "strategy file") -> Source:
    """A strategy file, read and parsed but never imported: it is as untrusted as a model's answer, and read as a
    user's file (user_files.read_text: a FIFO, a device such as /dev/zero, a folder or a file above STRATEGY_BYTES is
    refused at once, never waited on or read without end).

    Raises user_files.FileRefused (a ValueError: its line names `what` and the path) when it cannot be read, and
    ValueError with a one-line reason when it does not parse or defines no `strategy`.
    """
    try:
        text = user_files.read_text(path, user_files.STRATEGY_BYTES, what)
    except user_files.FileRefused as exc:
        why = str(exc).removeprefix(f"cannot read {what} {path}: ")
        raise user_files.FileRefused(f"{what} {path}: cannot read it: {why}") from None
    code = file_code(text)
    return Source(path, "file", [Sample(code, rewards.analyse_code(code))])


ARCHIVED_CODE = "TRAIN_2048_STRATEGY"  # where a strategy archive's file keeps its strategy's code, as a string


def file_code(text: str) -> str:
    """The strategy a file holds: the file itself when it defines `strategy`; else, in a file of the strategy archive
    (strategy_archive.strategy_code), the string constant named ARCHIVED_CODE, read from the syntax tree, never run.
    Raises ValueError with a one-line reason."""
    tree = parsed(text, "does not parse")
    if defines_strategy(tree):
        return text
    kept = [n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str) and [ast.unparse(t) for t in n.targets] == [ARCHIVED_CODE]]  # fmt: skip
    if len(kept) != 1:
        raise ValueError("defines no top-level function `strategy`")
    if not defines_strategy(parsed(kept[0], f"its {ARCHIVED_CODE} does not parse")):
        raise ValueError(f"its {ARCHIVED_CODE} defines no top-level function `strategy`")
    return kept[0]


ARCHIVED_GAME = "GAME"  # where it keeps the game its run played, as evaluate_2048's options (--size=3, ...)
BOARD = ("size", "target", "probability_fours", "keys", "max_moves")  # the game's options (sandbox.Game's)


def file_game(text: str) -> dict | None:
    """The game a file of the strategy archive names (its ARCHIVED_GAME: a list of `--name=value` words of BOARD),
    read from the syntax tree with ast.literal_eval, never run: each of BOARD, as the words spell it, sandbox.Game's
    default for one it leaves out (older archives wrote only what differed from it). None for any other file (a
    strategy of the user's own). Raises ValueError when an archive's file names its game in another shape."""
    try:
        tree = parsed(text, "does not parse")
    except ValueError:
        return None  # file_code says why
    names = {ast.unparse(t) for n in tree.body if isinstance(n, ast.Assign) for t in n.targets}
    if ARCHIVED_CODE not in names:
        return None
    kept = [n.value for n in tree.body if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == [ARCHIVED_GAME]]  # fmt: skip
    if not kept:
        return None
    try:
        words = ast.literal_eval(kept[-1])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        words = None
    if not isinstance(words, list) or not all(isinstance(w, str) and w.startswith("--") and "=" in w for w in words):
        raise ValueError(f"its {ARCHIVED_GAME} is not a list of --option=value words")
    game = dict(word[2:].split("=", 1) for word in words)
    if unknown := sorted(set(game) - set(BOARD)):
        raise ValueError(f"its {ARCHIVED_GAME} names {unknown[0]}, which is not one of the game's options ({', '.join(BOARD)})")
    default = sandbox.Game()
    return {name: game.get(name, str(getattr(default, name))) for name in BOARD}


def parsed(text: str, problem: str) -> ast.Module:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"{problem} ({getattr(exc, 'msg', exc)}, line {getattr(exc, 'lineno', '?')})") from exc


def defines_strategy(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == "strategy" for n in tree.body)


# --- what an adapter folder keeps of its run, for evaluate_2048 --------------------------------------------------

RUN_FILE = "train_2048_options.json"  # in every adapter folder a run writes (checkpoint-N, final, best)


def run_record(settings, args) -> dict:
    """The options of the run that trained an adapter, under train_2048's names, as a preset would set them: the
    game and its reward profile, the token budget, the chat template's arguments and the sampler (SAMPLING), which is
    what evaluate_2048 --adapter needs to sample and play as the run did. `args`: the run's GRPOConfig."""
    return {
        **{name: getattr(settings, name) for name in (*BOARD, "profile")},
        "max_completion_length": args.max_completion_length,
        "chat_template_kwargs": args.chat_template_kwargs or {},
        **{name: getattr(args, name) for name in SAMPLING},
    }


def write_run_record(folder, settings, args) -> None:
    """RUN_FILE into an adapter folder the run writes (replaced when the folder is saved again)."""
    import json
    from pathlib import Path

    import user_files

    path = Path(folder) / RUN_FILE
    if path.is_file() and not path.is_symlink():
        path.unlink()
    user_files.write_new(path, json.dumps(run_record(settings, args), indent=1) + "\n")


def model_source(name: str, completions: list[str]) -> Source:
    samples = []
    for text in completions:
        analysis = rewards.analyse(text)
        samples.append(Sample(analysis.code, analysis, completion=text))
    return Source(name, "model", samples)


# --- sampling: one sampler for training's rollouts, its evaluations and evaluate_2048 -----------------------------

# The options of a run that decide how it samples (TRL's GRPOConfig names them). transformers fills what a
# GenerationConfig leaves unset from the model's generation_config.json and then its own defaults (top_k 50), where
# TRL's GRPO sets every one of them (top_k 0: no cut): an evaluation sampled otherwise measures another policy.
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "cache_implementation", "generation_kwargs")


def sampling_options(**given):
    """The sampling options (SAMPLING) as an object like the GRPOConfig a run has: `given` (None: not given), TRL's
    defaults for the rest."""
    import types

    from trl import GRPOConfig

    fields = GRPOConfig.__dataclass_fields__
    return types.SimpleNamespace(**{n: fields[n].default if given.get(n) is None else given[n] for n in SAMPLING})


def generation_kwargs(options, tokenizer, max_new_tokens: int, *, greedy: bool = False) -> dict:
    """How the run samples a completion of at most `max_new_tokens` tokens: `options` is the run's GRPOConfig (or
    sampling_options), and every field TRL's GRPOTrainer sets on its transformers path is set (trl 1.14,
    grpo_trainer.py:1105-1122; Unsloth's generated trainer keeps that code: tests/test_sampler.py and tests/unsloth),
    generation_kwargs last, as TRL applies them. The trainer's rollouts, its evaluations, evaluate_2048 and the save
    check all sample through here. greedy (evaluate_2048 --temperature 0): argmax, the repetition penalty kept."""
    kwargs = {
        "max_new_tokens": max_new_tokens,
        "do_sample": True,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k,
        "min_p": options.min_p,
        "repetition_penalty": options.repetition_penalty,
        "cache_implementation": options.cache_implementation,
    }
    kwargs.update(options.generation_kwargs or {})
    if greedy:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("temperature", "top_p", "top_k", "min_p")}
        kwargs["do_sample"] = False
    return kwargs


def generation_config(options, tokenizer, max_new_tokens: int, *, greedy: bool = False):
    """generation_kwargs as the GenerationConfig TRL builds from them (compiling off, as TRL has it)."""
    from transformers import GenerationConfig

    return GenerationConfig(**generation_kwargs(options, tokenizer, max_new_tokens, greedy=greedy),
                            disable_compile=True)  # fmt: skip


def batch_sizes(samples: int, batch_size: int) -> list[int]:
    """How many samples each generation batch holds: every batch is seeded on its own (sample_batch), so the
    samples do not depend on which process generates which batch."""
    return [min(batch_size, samples - start) for start in range(0, samples, batch_size)]


def prompt_inputs(tokenizer, settings, chat_kwargs: dict):
    """The training prompt for these settings, through the tokenizer's chat template, as model inputs."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": rewards.build_prompt(settings)}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
        **chat_kwargs,
    )


def sample_batch(model, tokenizer, inputs, *, index: int, size: int, seed: int, config,
                 generate=None) -> list[list[int]]:  # fmt: skip
    """The completion token ids of generation batch `index`: `size` samples of the prompt, seeded by (seed, index),
    with `config` (generation_config: the run's own sampler, its token budget included).

    A greedy config (do_sample False) gives one generation, repeated. `generate` is generation.generate (the fast
    path, the same tokens) or None for model.generate. The model's random state is left as it was, so a training run
    with evaluations trains exactly like one without.
    """
    import torch

    rows = size if config.do_sample else 1
    input_ids = inputs["input_ids"].to(model.device).repeat(rows, 1)  # what num_return_sequences would do
    attention_mask = inputs["attention_mask"].to(model.device).repeat(rows, 1)
    cuda = [model.device] if model.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        torch.manual_seed((seed * 1_000_003 + index) % 2**64)  # any --seed: a run's held-out one is large
        if generate is not None:
            out = generate(model, input_ids, attention_mask, config)
        else:
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    ids = out[:, input_ids.shape[1] :].tolist()
    return ids if config.do_sample else ids * size


def decode(tokenizer, ids: list[list[int]]) -> list[str]:
    """Decoded with special tokens skipped, as TRL hands completions to the rewards (gpt-oss's final channel then
    reads "assistantfinal...", which rewards.extract_function understands)."""
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def sample_completions(model, tokenizer, settings, *, samples: int, seed: int, config, batch_size: int,
                       chat_kwargs: dict, generate=None,
                       on_batch: Callable[[int], None] | None = None) -> list[str]:  # fmt: skip
    """`samples` decoded completions of the training prompt, `batch_size` at a time, in the model's eval mode, sampled
    with `config` (generation_config)."""
    inputs = prompt_inputs(tokenizer, settings, chat_kwargs)
    was_training = model.training
    model.eval()
    texts = []
    try:
        for index, size in enumerate(batch_sizes(samples, batch_size)):
            ids = sample_batch(model, tokenizer, inputs, index=index, size=size, seed=seed, config=config,
                               generate=generate)  # fmt: skip
            texts += decode(tokenizer, ids)
            if on_batch is not None:
                on_batch(size)
    finally:
        model.train(was_training)
    return texts


# --- playing ----------------------------------------------------------------------------------------------------


def play_sources(sources: list[Source], seeds: list[int], settings,
                 on_games: Callable[[int, int], None] | None = None) -> dict[tuple[int, int], list]:  # fmt: skip
    """(source index, sample index) -> one result per seed, every playable strategy in the sandbox at once.

    Identical code is played once (a model at low temperature repeats itself). Jobs go to play_many in chunks of
    several games per core, so the cores stay busy and `on_games(done, total)` can report progress.
    """
    codes = sorted({s.code for src in sources for s in src.samples if s.analysis.playable})
    jobs = [(code, seed, settings) for code in codes for seed in seeds]
    chunk = max(16, 8 * len(os.sched_getaffinity(0)))
    results = []
    for start in range(0, len(jobs), chunk):
        results += sandbox.play_many(jobs[start : start + chunk], strict=settings.require_seccomp)
        if on_games is not None:
            on_games(len(results), len(jobs))
    by_code = {code: results[i * len(seeds) : (i + 1) * len(seeds)] for i, code in enumerate(codes)}
    played = {}
    for i, src in enumerate(sources):
        for j, sample in enumerate(src.samples):
            if sample.analysis.playable:
                played[i, j] = by_code[sample.code]
            else:
                played[i, j] = [sandbox.GameResult(NOT_PLAYED, error=sample.analysis.why_not_played)] * len(seeds)
    return played


# --- summaries --------------------------------------------------------------------------------------------------


def cheats(sample: Sample, games: list) -> bool:
    return bool(sample.analysis.cheats) or any(g.status == "violation" for g in games)


def game_stats(games: list) -> dict:
    """Win rate, median score and max tile, mean score; a slot not played counts as a game with nothing."""
    return {
        "games": len(games),
        "win_rate": sum(g.status == "success" for g in games) / len(games) if games else 0.0,
        "median_score": statistics.median(g.score for g in games) if games else 0,
        "median_max_tile": statistics.median_low(g.max_tile for g in games) if games else 0,  # always a tile
        "mean_score": statistics.fmean(g.score for g in games) if games else 0.0,
    }


def sample_rewards(source: Source, games_by_sample: list[list], settings) -> list[float]:
    """Each of a model's samples scored as training scores an answer, the three rewards summed (rewards.py's own
    functions, handed this evaluation's games as their verdicts), on these games: the mean is eval/mean_reward."""
    verdicts = []
    for sample, games in zip(source.samples, games_by_sample):
        played = tuple(g for g in games if g.status != NOT_PLAYED)
        violation = next((g.error for g in played if g.status == "violation"), None)
        verdicts.append(rewards.Verdict(sample.analysis, played, violation))
    completions = [sample.completion for sample in source.samples]
    scores = [f(completions=completions) for f in rewards.reward_functions(settings, judge=lambda *_: verdicts)]
    return [sum(each) for each in zip(*scores)]


def summarise(source: Source, games_by_sample: list[list], settings) -> dict:
    """One source's row: over every (sample, game) pair; a model also gets its mean reward (sample_rewards, under
    `settings`' profile), its best and its median sample."""
    flat = [g for games in games_by_sample for g in games]
    played = [g for g in flat if g.status != NOT_PLAYED]
    n = len(source.samples)
    summary = {
        "source": source.name,
        "kind": source.kind,
        "samples": n,
        "valid_rate": sum(s.analysis.loadable for s in source.samples) / n,
        # cheating in the code, or seen by the sandbox at run time (a way out of Python): the rewards score both alike
        "cheat_rate": sum(cheats(s, games) for s, games in zip(source.samples, games_by_sample)) / n,
        "played_samples": sum(s.analysis.playable for s in source.samples),
        **game_stats(flat),
        "played_games": len(played),
        "timeouts": sum(g.status == "timeout" for g in played),
        "errors": sum(g.status in ERROR_STATUSES for g in played),
        "max_tile_log2": statistics.fmean(math.log2(max(g.max_tile, 1)) for g in played) if played else 0.0,
        "statuses": dict(Counter(g.status for g in flat)),
        "max_tile_counts": {str(k): v for k, v in sorted(Counter(g.max_tile for g in played).items())},
    }
    if source.kind == "model":
        summary["mean_reward"] = statistics.fmean(sample_rewards(source, games_by_sample, settings))
        per_sample = [game_stats(games) for games in games_by_sample]
        candidates = [j for j, s in enumerate(source.samples) if s.analysis.playable]
        best = max(candidates, key=lambda j: per_sample[j]["mean_score"], default=None)  # first of equals
        summary["best_sample"] = None if best is None else {"sample": best, **per_sample[best]}
        summary["median_sample"] = {
            k: (statistics.median_low if k == "median_max_tile" else statistics.median)(s[k] for s in per_sample)
            for k in ("win_rate", "median_score", "median_max_tile", "mean_score")
        }
    return summary


EVAL_METRICS = ("valid_rate", "cheat_rate", "win_rate", "max_tile_log2", "mean_score", "mean_reward")


def policy_metrics(completions: Iterable[str], seeds: list[int], settings) -> dict[str, float]:
    """The numbers train_2048.py logs as eval/*: valid and cheating shares of the samples; win rate and mean game
    score over every (sample, game) pair, a sample not played counting as a game with nothing; the mean log2 of
    the largest tile over the games played (0 when none was), like train/game/max_tile_log2; the mean reward of the
    samples, as train/reward sums it (eval_mean_reward: what the best adapters are chosen by)."""
    source = model_source("model", list(completions))
    played = play_sources([source], seeds, settings)
    summary = summarise(source, [played[0, j] for j in range(len(source.samples))], settings)
    return {name: summary[name] for name in EVAL_METRICS}
