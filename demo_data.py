"""The CPU demo: its tiny model, built locally, and the warm-start answers, what a small model might write, from
useless to decent.

A randomly initialised model cannot find a working strategy by sampling, so the demo first fine-tunes it
on these answers (SFT) and then lets GRPO sort them out with the real rewards and sandbox. The mix is
deliberately mostly bad, so learning shows as the good answers taking over. Every answer is short, so a
few dozen tokens of the demo's tokenizer cover it.

The copies set where GRPO starts: while bad answers fill its groups, GRPO pushes every playable answer up about
alike, so the board-blind answer the warm start writes most can take over before the corner player pulls ahead. With 3
copies of the corner player, 6 of 32 answers after the first step were it and 7 the two random.choice answers, and
runs settled on random.choice; with 4, 13 of 32 are the corner player and 3 random.choice, and 40 of 40 fresh-salt runs
learned it (docs/PERF.md, "The CPU demo's spread").
"""

from __future__ import annotations

import shutil
from pathlib import Path

import saving

TINY = "tiny"  # model_name_or_path that builds the CPU demo's model in <output_dir>/tiny-model

FENCE = "```"


def _code(body: str) -> str:
    return f"{FENCE}python\ndef strategy(board):\n{body}{FENCE}"


# (kind, copies in the SFT set, answer). Kinds: what the rewards should make of it.
EXAMPLES = [
    ("no_code", 2, "Move left, then down, and keep the big tile in a corner."),
    ("syntax_error", 2, f'{FENCE}python\ndef strategy(board)\n    return "A"\n{FENCE}'),
    ("syntax_error", 1, _code('    return "A" if board[0][0] else\n')),
    ("crashes", 2, _code("    return board.move()\n")),
    ("cheats", 2, _code('    import os\n    os.system("echo win")\n    return "A"\n')),
    ("cheats", 1, _code('    import subprocess\n    return "A"\n')),
    ("stuck", 2, _code('    return "A"\n')),
    ("random", 2, _code('    import random\n    return random.choice("WASD")\n')),
    ("biased_random", 1, _code('    import random\n    return random.choice("AAASSD")\n')),
    # Never reads the board: on 5x5 this wins most games; the default reward must not prefer it (issue 12).
    ("cycle", 2, _code('    n = getattr(strategy, "n", 0)\n    strategy.n = n + 1\n    return "WASD"[n % 4]\n')),
    (
        "corner",
        4,
        _code(
            "    def moves(b):\n"
            "        return any(x == y != 0 or x == 0 != y for r in b for x, y in zip(r, r[1:]))\n"
            "    t = [list(c) for c in zip(*board)]\n"
            '    for k, b in (("A", board), ("S", [c[::-1] for c in t]), ("D", [r[::-1] for r in board]), ("W", t)):\n'
            "        if moves(b):\n"
            "            return k\n"
            '    return "A"\n'
        ),
    ),
]


def sft_rows(prompt: str) -> list[dict]:
    """Conversational prompt/completion rows for TRL's SFTTrainer, each answer as many times as its copies."""
    return [
        {"prompt": [{"role": "user", "content": prompt}], "completion": [{"role": "assistant", "content": text}]}
        for _kind, copies, text in EXAMPLES
        for _ in range(copies)
    ]


def corpus(prompt: str) -> list[str]:
    """What the demo's tokenizer is trained on: the prompt and every answer as many times as its copies."""
    return [prompt] + [text for _kind, copies, text in EXAMPLES for _ in range(copies)]


def answer_kind(text: str) -> str:
    """Which of the example answers a completion is a version of (a trained policy may trim a line or two): corner,
    cycle, random (either random.choice) or other. The learning test and the benches judge a trained demo by it."""
    import rewards

    code = rewards.extract_function(text) or ""
    if "moves(b)" in code:
        return "corner"  # reads the board: the first move that changes it, in the order A, S, D, W
    if "strategy.n" in code:
        return "cycle"  # never reads the board
    return "random" if "random" in code else "other"


# How a demo run is judged, by the learning test (tests/test_train_runs.py) and bench/bench_demo.py alike.
SAMPLES = 32


def sample_answers(output_dir) -> list[str]:
    """SAMPLES answers of a finished demo run (its final/ adapters on its tiny-model), seeded, sampled as the demo
    trains (TRL's sampler at temperature 1)."""
    from trl import ModelConfig

    import evaluation
    import models
    import rewards

    out = Path(output_dir)
    model, tokenizer = models.load_model(str(out / "tiny-model"), ModelConfig(), adapter=str(out / "final"))
    return evaluation.sample_completions(
        model, tokenizer, rewards.RewardSettings(size=3, target=128), samples=SAMPLES, seed=1, batch_size=16,
        config=evaluation.generation_config(evaluation.sampling_options(temperature=1.0), tokenizer, 96), chat_kwargs={},
    )  # fmt: skip


def learned(first10: float, last10: float, kinds: dict) -> bool:
    """The bar a run meets when it learned the corner player: the mean reward of its last 10 steps at least 4 above its
    first 10's, and of its sampled answers (counted by answer_kind) half or more the corner player and more than 4
    times the cycle."""
    corner, cycle = kinds.get("corner", 0), kinds.get("cycle", 0)
    return last10 >= first10 + 4 and corner >= SAMPLES // 2 and corner > 4 * cycle


# --- the demo's model: a tiny Llama and a tokenizer trained on the demo's own text -----------------------------------
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)  # other variables (gpt-oss's reasoning_effort) are accepted and unused


def build_tiny_model(path: Path, corpus: list[str], seed: int) -> Path:
    """The CPU demo's model: a 2-layer, 128-wide Llama and a 600-token BPE trained on the demo's prompt and
    answers, saved like a hub checkpoint so it loads through the same from_pretrained call as a real one.

    Pre-tokens are whole lines, so merges span spaces and an answer is a few dozen tokens. Built once per
    output directory (a resume reuses it), in a temporary folder renamed at the end.
    """
    if (path / "config.json").exists():
        return path.resolve()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    tokenizer = build_tokenizer(corpus)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    tmp = saving.fresh(path)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" on stderr: never before a run's one-line error
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        saving.publish(tmp, path, "train_2048")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return path.resolve()  # absolute: adapter_config.json and train_2048_base.json name it from any working folder


def build_tokenizer(corpus: list[str], vocab_size: int = 600):
    """A byte-level BPE trained on `corpus`, with the demo's chat template: no download, a few seconds."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n|[^\n]+"), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<|pad|>", eos_token="<|end|>", chat_template=CHAT_TEMPLATE
    )
