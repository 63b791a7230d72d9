"""The token budget, counted with GPT-OSS's own tokenizer (offline): prompt, each player's answer, what presets leave.

A completion that runs out of tokens before its code block closes scores as no code at all, so a preset's
`max_completion_length` must hold the analysis GPT-OSS writes first (~150-250 tokens even at low effort) and then a
whole answer, and `max_seq_length` the prompt as well. The need counted here is rewards.completion_need, the one
train_2048.py checks at start: an allowance of 250 analysis tokens (with its Harmony framing) plus the compact depth-2
expectimax as a complete final-channel answer, the shortest strong player we have.

    .venv/bin/python bench/bench_budget.py [--json FILE] [--tokenizer_dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import gpt_oss_tokenizer  # noqa: E402
import rewards  # noqa: E402
import strategies  # noqa: E402

# A short analysis, as GPT-OSS writes one at low effort when it goes straight to the point.
SHORT_ANALYSIS = (
    "We need a Python function strategy(board) for 2048 on a small board. A depth-2 expectimax is cheap here: try "
    "each move, average over the spawns, score boards by empty cells and keeping the largest tile in a corner. Keep "
    "imports inside the function and return one of W, A, S, D."
)
BOARDS = {
    "default (3x3 to 512)": rewards.RewardSettings(),
    "notebook (6x6 to 2048)": rewards.RewardSettings(**rewards.NOTEBOOK),
}


def count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def answer_tokens(tokenizer, name: str, analysis: str | None = None) -> int:
    """A player's source in a ```python fence as the final channel, ended by <|return|>: a whole completion."""
    return count(tokenizer, gpt_oss_tokenizer.answer_text(f"```python\n{strategies.source(name)}```", analysis))


def players() -> dict[str, str]:
    """Every player once, with the groups it belongs to (random is both a baseline and board-blind)."""
    groups: dict[str, list[str]] = {}
    for group, members in (("baseline", strategies.BASELINES), ("board-blind", strategies.BOARD_BLIND),
                           ("compact", strategies.COMPACT)):  # fmt: skip
        for name in members:
            groups.setdefault(name, []).append(group)
    return {name: ", ".join(found) for name, found in groups.items()}


def preset_budget(tokenizer, path: Path, need: int) -> dict:
    """A preset's limits, its own prompt (its board, its reasoning effort), and what is left once the need is met."""
    config = yaml.safe_load(path.read_text())
    known = {f.name for f in dataclasses.fields(rewards.RewardSettings)}
    settings = rewards.RewardSettings(**{k: v for k, v in config.items() if k in known})
    effort = (config.get("chat_template_kwargs") or {}).get("reasoning_effort", "medium")
    prompt = rewards.prompt_tokens(tokenizer, settings, effort)
    completion, sequence = config["max_completion_length"], config["max_seq_length"]
    return {"board": f"{settings.size}x{settings.size} to {settings.target}", "reasoning_effort": effort,
            "prompt": prompt, "max_completion_length": completion, "completion_left": completion - need,
            "max_seq_length": sequence, "sequence_left": sequence - prompt - need}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--tokenizer_dir", help="a folder `gpt_oss_tokenizer.py --save` wrote (default: the cache)")
    args = parser.parse_args(argv)
    tokenizer = gpt_oss_tokenizer.load(args.tokenizer_dir)

    efforts = gpt_oss_tokenizer.EFFORTS
    prompts = {board: {e: rewards.prompt_tokens(tokenizer, s, e) for e in efforts} for board, s in BOARDS.items()}
    short = count(tokenizer, SHORT_ANALYSIS)
    answers = {name: {"groups": groups, "source": count(tokenizer, strategies.source(name)),
                      "answer": answer_tokens(tokenizer, name),
                      "answer_with_short_analysis": answer_tokens(tokenizer, name, SHORT_ANALYSIS)}
               for name, groups in players().items()}  # fmt: skip
    need = sum(rewards.completion_need(tokenizer))
    presets = {path.stem: preset_budget(tokenizer, path, need) for path in sorted((ROOT / "configs").glob("*.yaml"))
               if path.name != "cpu-demo.yaml"}  # fmt: skip

    print("Prompt (system + user, with the generation prompt), tokens per reasoning effort:\n")
    print("| board | " + " | ".join(efforts) + " |")
    print("|---|" + "---:|" * len(efforts))
    for board, by_effort in prompts.items():
        print(f"| {board} | " + " | ".join(str(n) for n in by_effort.values()) + " |")
    print(f"\nAnswers: the code alone, as a whole final-channel answer, and after a short analysis ({short} tokens):\n")
    print("| player | group | code | answer | with short analysis |")
    print("|---|---|---:|---:|---:|")
    for name, a in answers.items():
        print(f"| {name} | {a['groups']} | {a['source']} | {a['answer']} | {a['answer_with_short_analysis']} |")
    print(f"\nPresets: need = {rewards.ANALYSIS_TOKENS} analysis tokens (and their framing) + the {rewards.NEED_PLAYER} "
          f"answer = {need} tokens; left = "
          "limit - need (completion), limit - prompt - need (sequence); negative: the answer is cut off\n")
    print("| preset | board | effort | prompt | max_completion_length | left | max_seq_length | left |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name, p in presets.items():
        print(f"| {name} | {p['board']} | {p['reasoning_effort']} | {p['prompt']} | {p['max_completion_length']} | "
              f"{p['completion_left']} | {p['max_seq_length']} | {p['sequence_left']} |")  # fmt: skip
    if args.json:
        result = {"prompt": prompts, "short_analysis": short, "answers": answers,
                  "analysis_allowance": rewards.ANALYSIS_TOKENS, "need_player": rewards.NEED_PLAYER, "need": need,
                  "presets": presets}  # fmt: skip
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
