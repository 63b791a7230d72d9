"""GPT-OSS's exact tokenizer and chat format, built offline, for tests and benchmarks.

Training keeps a checkpoint's own tokenizer; this one is for measuring what GPT-OSS would see (token counts, real
prompt ids) where the hub is out of reach: a CPU test, a benchmark, a GPU machine with no internet. It is o200k_base
(from the `bpe-openai` package, which ships the vocabulary) converted to a `tokenizers` BPE, plus the Harmony special
tokens at the ids `openai-harmony` gives them, and a chat template of our own that renders a conversation token for
token as openai-harmony's `render_conversation_for_completion` does. The conversion takes a few seconds, so the built
folder is cached (~/.cache/train_2048/gpt-oss-tokenizer) and loaded from there afterwards.

    python gpt_oss_tokenizer.py --save DIR      # a folder AutoTokenizer.from_pretrained(DIR) loads, for elsewhere
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

VOCAB_SIZE = 201088  # GPT-OSS's embedding rows: o200k's 199998 tokens, then the Harmony specials up to here
EFFORTS = ("low", "medium", "high")
CACHE_VERSION = "v1"  # bump when the conversion changes, so an old cached folder is not reused

# The Harmony system message openai-harmony writes by default (its SystemContent: ChatGPT's identity, knowledge cutoff
# 2024-06, no date unless one is given, medium effort, three channels), then the conversation. A system or developer
# message in `messages` becomes the developer message's instructions, as GPT-OSS's own template treats it. An assistant
# message is a final-channel answer; its `thinking` (the analysis channel) is written only on the last message, the
# answer being trained on, because Harmony drops the analysis of earlier turns. A conversation that ends with an
# assistant answer ends with <|return|>, what the model emits when done.
CHAT_TEMPLATE = r"""
{%- set effort = reasoning_effort | default("medium") -%}
{%- if effort not in ["low", "medium", "high"] -%}
  {{- raise_exception("reasoning_effort must be low, medium or high, not " ~ effort) -}}
{%- endif -%}
{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n" -}}
{{- "Knowledge cutoff: 2024-06\n" -}}
{%- if conversation_start_date is defined and conversation_start_date -%}
  {{- "Current date: " ~ conversation_start_date ~ "\n" -}}
{%- endif -%}
{{- "\nReasoning: " ~ effort ~ "\n\n" -}}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>" -}}
{%- for message in messages -%}
  {%- if message.role in ["system", "developer"] and loop.first -%}
    {{- "<|start|>developer<|message|># Instructions\n\n" ~ message.content ~ "<|end|>" -}}
  {%- elif message.role == "user" -%}
    {{- "<|start|>user<|message|>" ~ message.content ~ "<|end|>" -}}
  {%- elif message.role == "assistant" -%}
    {%- if loop.last and message.thinking is defined and message.thinking is not none -%}
      {{- "<|start|>assistant<|channel|>analysis<|message|>" ~ message.thinking ~ "<|end|>" -}}
    {%- endif -%}
    {{- "<|start|>assistant<|channel|>final<|message|>" ~ message.content -}}
    {{- "<|return|>" if loop.last and not add_generation_prompt else "<|end|>" -}}
  {%- else -%}
    {{- raise_exception("this template renders a first system or developer message, then user and assistant ones") -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- "<|start|>assistant" -}}
{%- endif -%}
""".strip()


def answer_text(final: str, analysis: str | None = None) -> str:
    """What GPT-OSS writes after the prompt's `<|start|>assistant`: an optional analysis message, then the final one.

    Its token count is a completion's length, the number `max_completion_length` caps.
    """
    head = "" if analysis is None else f"<|channel|>analysis<|message|>{analysis}<|end|><|start|>assistant"
    return f"{head}<|channel|>final<|message|>{final}<|return|>"


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "train_2048"


def harmony_encoding():
    """openai-harmony's GPT-OSS encoding, read from bpe-openai's copy of o200k_base: no download is ever tried.

    openai-harmony looks for `o200k_base.tiktoken` in the folder `TIKTOKEN_ENCODINGS_BASE` names (and downloads it
    when that is unset), so the file is unpacked into our cache and the variable pointed there, for this process.
    """
    from importlib import resources

    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    folder = cache_root() / "tiktoken"
    target = folder / "o200k_base.tiktoken"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        packed = resources.files("bpe_openai.data").joinpath("o200k_base.tiktoken.gz").read_bytes()
        part = folder / f".o200k_base.tiktoken.{os.getpid()}"
        part.write_bytes(gzip.decompress(packed))
        os.replace(part, target)  # atomic: a process reading it never sees half a file
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def special_tokens(encoding) -> dict[int, str]:
    """The Harmony special tokens by id, as openai-harmony numbers them, below VOCAB_SIZE.

    openai-harmony also names `<|reserved_201088|>`, one past GPT-OSS's embedding: left out, so every id fits the model.
    """
    ids = {}
    for name in encoding.special_tokens_set:
        (token_id,) = encoding.encode(name, allowed_special="all")  # "all": no per-call regex of the other names
        if token_id < VOCAB_SIZE:
            ids[token_id] = name
    return dict(sorted(ids.items()))


def build():
    """Convert o200k_base to a `tokenizers` BPE and add the Harmony tokens: a few seconds (the merges are the cost).

    tiktoken merges, at every step, the adjacent pair whose concatenation has the lowest rank. A BPE reproduces that
    when every split of a token into two tokens is a merge ranked by the whole token's rank; `ignore_merges` then
    takes a pre-token that is itself in the vocabulary whole, as tiktoken does.
    """
    from bpe_openai import registry
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    o200k = registry.o200k_base()
    ranks, pattern = o200k["mergeable_ranks"], o200k["pat_str"]
    byte_chars = bytes_to_unicode()  # byte-level BPE's printable stand-in for each byte

    def chars(token: bytes) -> str:
        return "".join(byte_chars[b] for b in token)

    splits = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = ranks.get(token[:cut]), ranks.get(token[cut:])
            if left is not None and right is not None:
                splits.append((rank, left, right, token, cut))
    splits.sort()
    merges = [(chars(token[:cut]), chars(token[cut:])) for _, _, _, token, cut in splits]
    vocab = {chars(token): rank for token, rank in ranks.items()}
    bpe = Tokenizer(models.BPE(vocab, merges, ignore_merges=True))
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()

    specials = special_tokens(harmony_encoding())
    if list(specials) != list(range(len(vocab), VOCAB_SIZE)):
        raise RuntimeError(f"Harmony's special tokens do not follow o200k's {len(vocab)} tokens up to {VOCAB_SIZE}")
    bpe.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials.values()])
    return finish(PreTrainedTokenizerFast(tokenizer_object=bpe))


def finish(tokenizer):
    """GPT-OSS's roles for the special tokens, its context length, and our chat template (always the current one)."""
    tokenizer.model_max_length = 131072
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = "<|startoftext|>", "<|return|>", "<|endoftext|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def load(folder: str | Path | None = None):
    """GPT-OSS's tokenizer: from `folder` (one `--save` wrote) as it is there, else from the cache, built on first use.

    Building needs `bpe-openai` and `openai-harmony` (requirements-cpu.txt); loading a saved folder needs neither.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if folder is not None:
        return AutoTokenizer.from_pretrained(str(folder))
    cached = cache_root() / f"gpt-oss-tokenizer-{CACHE_VERSION}"
    if (cached / "tokenizer.json").exists():  # straight from tokenizer.json: 1 s, against 3 s for from_pretrained
        return finish(PreTrainedTokenizerFast(tokenizer_file=str(cached / "tokenizer.json")))
    tokenizer = build()
    cached.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=".gpt-oss-tokenizer-", dir=cached.parent))
    tokenizer.save_pretrained(str(part))
    try:
        part.rename(cached)  # atomic; another process may have won the race, and its folder is as good
    except OSError:
        shutil.rmtree(part, ignore_errors=True)
    return tokenizer


def folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save", required=True, metavar="DIR", help="write the tokenizer folder here")
    parser.add_argument("--rebuild", action="store_true", help="convert again instead of copying the cached build")
    args = parser.parse_args(argv)
    from transformers import PreTrainedTokenizerFast  # noqa: F401  (imported first: its 3 s are not the time reported)

    started = time.monotonic()
    tokenizer = build() if args.rebuild else load()
    seconds = time.monotonic() - started
    tokenizer.save_pretrained(args.save)
    print(f"GPT-OSS tokenizer ({len(tokenizer)} tokens) in {args.save}: {folder_size(Path(args.save)) / 1e6:.1f} MB, "
          f"{'built' if args.rebuild else 'loaded or built'} in {seconds:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
