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
        why = str(exc).removeprefix(f"{what} {path}: ").removeprefix(f"cannot read {what} {path}: ")
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


def parsed(text: str, problem: str) -> ast.Module:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"{problem} ({getattr(exc, 'msg', exc)}, line {getattr(exc, 'lineno', '?')})") from exc


def defines_strategy(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == "strategy" for n in tree.body)


def model_source(name: str, completions: list[str]) -> Source:
    samples = []
    for text in completions:
        analysis = rewards.analyse(text)
        samples.append(Sample(analysis.code, analysis, completion=text))
    return Source(name, "model", samples)


# --- sampling ---------------------------------------------------------------------------------------------------


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


def sample_batch(model, tokenizer, inputs, *, index: int, size: int, seed: int, temperature: float,
                 max_new_tokens: int, generate=None) -> list[list[int]]:  # fmt: skip
    """The completion token ids of generation batch `index`: `size` samples of the prompt, seeded by (seed, index).

    temperature 0 is greedy decoding: one generation, repeated. `generate` is generation.generate (the fast path,
    the same tokens) or None for model.generate. The model's random state is left as it was, so a training run
    with evaluations trains exactly like one without.
    """
    import torch
    from transformers import GenerationConfig

    rows = size if temperature > 0 else 1
    input_ids = inputs["input_ids"].to(model.device).repeat(rows, 1)  # what num_return_sequences would do
    attention_mask = inputs["attention_mask"].to(model.device).repeat(rows, 1)
    sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
    config = GenerationConfig(**sampling, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    cuda = [model.device] if model.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        torch.manual_seed((seed * 1_000_003 + index) % 2**64)  # any --seed: a run's held-out one is large
        if generate is not None:
            out = generate(model, input_ids, attention_mask, config)
        else:
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    ids = out[:, input_ids.shape[1] :].tolist()
    return ids if temperature > 0 else ids * size


def decode(tokenizer, ids: list[list[int]]) -> list[str]:
    """Decoded with special tokens skipped, as TRL hands completions to the rewards (gpt-oss's final channel then
    reads "assistantfinal...", which rewards.extract_function understands)."""
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def sample_completions(model, tokenizer, settings, *, samples: int, seed: int, temperature: float,
                       max_new_tokens: int, batch_size: int, chat_kwargs: dict, generate=None,
                       on_batch: Callable[[int], None] | None = None) -> list[str]:  # fmt: skip
    """`samples` decoded completions of the training prompt, `batch_size` at a time, in the model's eval mode."""
    inputs = prompt_inputs(tokenizer, settings, chat_kwargs)
    was_training = model.training
    model.eval()
    texts = []
    try:
        for index, size in enumerate(batch_sizes(samples, batch_size)):
            ids = sample_batch(model, tokenizer, inputs, index=index, size=size, seed=seed, temperature=temperature,
                               max_new_tokens=max_new_tokens, generate=generate)  # fmt: skip
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


def summarise(source: Source, games_by_sample: list[list]) -> dict:
    """One source's row: over every (sample, game) pair; a model also gets its best and its median sample."""
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
        per_sample = [game_stats(games) for games in games_by_sample]
        candidates = [j for j, s in enumerate(source.samples) if s.analysis.playable]
        best = max(candidates, key=lambda j: per_sample[j]["mean_score"], default=None)  # first of equals
        summary["best_sample"] = None if best is None else {"sample": best, **per_sample[best]}
        summary["median_sample"] = {
            k: (statistics.median_low if k == "median_max_tile" else statistics.median)(s[k] for s in per_sample)
            for k in ("win_rate", "median_score", "median_max_tile", "mean_score")
        }
    return summary


EVAL_METRICS = ("valid_rate", "cheat_rate", "win_rate", "max_tile_log2", "mean_score")


def policy_metrics(completions: Iterable[str], seeds: list[int], settings) -> dict[str, float]:
    """The numbers train_2048.py logs as eval/*: valid and cheating shares of the samples; win rate and mean game
    score over every (sample, game) pair, a sample not played counting as a game with nothing; the mean log2 of
    the largest tile over the games played (0 when none was), like train/game/max_tile_log2."""
    source = model_source("model", list(completions))
    played = play_sources([source], seeds, settings)
    summary = summarise(source, [played[0, j] for j in range(len(source.samples))])
    return {name: summary[name] for name in EVAL_METRICS}
