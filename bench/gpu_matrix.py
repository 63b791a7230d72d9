"""The GPU check: whether `python train_2048.py` works on your GPU machine and how fast, before a long run.

Call 1 (`make gpu-check`, or this script with `1`) answers it in about 6 minutes on an H100: the default's own path on
a tiny model (Unsloth's loader, 2 GRPO steps with fast generation, the saves and their checks), then GPT-OSS-20B's
geometry with random weights at 2 and 4 layers, 4-bit and BF16 (a GRPO step at the presets' 1024 tokens, the decode
step at batch 8, peak memory), each extrapolated to the model's 24 layers, and a table of the targets. Calls 2-5 add
the rest (full depth, the test suite and the saves with the GPU set, the other routes); each stands alone and is
planned to end within 420 s on an H100, for machines with a time limit per run. docs/GPU_CHECK.md says more.

    make gpu-check                                   # after `bash setup.sh`: call 1 (this script's `1`)
    python3 bench/gpu_matrix.py 1                    # the same, in any Python that has the GPU set
    python3 bench/gpu_matrix.py 1 --time_limit 420   # on a machine that stops a command after a time
    python3 bench/gpu_matrix.py --dry-run            # every call: its items, commands, estimates and plan
    python3 bench/gpu_matrix.py --next               # the call not yet run on this commit (docs/GPU_CHECK.md's results)
    python3 bench/gpu_matrix.py --record DIR/call1-results.json   # a call's results into docs/GPU_CHECK.md
    python3 bench/gpu_matrix.py 2 --only 2.2         # some items of a call, and what they need
    python3 bench/gpu_matrix.py --cpu 1              # call 1 on a CPU with tiny models: the plumbing (CI runs it)

Items run side by side (`--jobs` at once) as soon as what they need has ended, and every timed part runs alone: a GRPO
run's second step (its first compiles) and a decode benchmark's timed runs each get a window during which every other
process of the call is stopped (SIGSTOP to its process group, SIGCONT after). With a time limit, an item whose estimate
no longer fits is skipped and named, and whatever still runs at the end is stopped. Each item prints its result line as
it ends; the call ends with its targets table. Results go to a new folder (--out): callN.log (this console),
callN-results.json, callN-targets.md, logs/ (each item's output) and callN-logs.tar.gz (those, with each run's
training.log and metrics.jsonl). The models are built in --work (or /dev/shm when it has 50 GB free and the GPU is not
an integrated one, whose memory /dev/shm is) and kept there for the next run. Exit status: 0 when every item passed, 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "GPU_CHECK.md"
WHEELS = ROOT / ".gpu-wheels"  # the GPU set carried to an offline machine (bench/gpu_set.sh pack)
TOKENIZER_ARCHIVE = ROOT / ".gpu-tokenizer.tar.gz"  # GPT-OSS's tokenizer, carried with them
PY = sys.executable
TIME_LIMIT_S = 420  # what every call is planned to fit, on an H100
RESERVE_S = 10  # kept at the end of a limited run for the table and the files
FULL_DEPTH = 24  # GPT-OSS-20B's layers: every figure is extrapolated there
DEPTHS = (2, 4)  # the two reduced depths of call 1: a sliding and a full attention layer per pair
PRESETS = {"gpt-oss-20b": "4-bit", "gpt-oss-20b-bf16": "BF16"}
SETUP = ("setup", "install")  # the kinds of item that make the machine ready: not results of their own

# --- estimates (H100, seconds) -----------------------------------------------------------------------------------
# From the one H100 run so far (2026-11-23; the 20B geometry, 24 layers, 8 x 200 tokens a step, no fast path), scaled
# linearly in layers and tokens (an upper bound: the fast path's gains are not counted), and guesses for the rest.

H100_STEP_S = {"gpt-oss-20b": 33.0, "gpt-oss-20b-bf16": 19.5}  # a whole GRPO step, 24 layers, 200 tokens
H100_DECODE_MS = 46.5  # a decode step at batch 8 (BF16, model.generate), 24 layers
IMPORT_UNSLOTH_S = 30  # a process that imports Unsloth
IMPORT_TORCH_S = 10  # a process that imports torch and transformers only
LOAD_24_S = {"gpt-oss-20b": 80, "gpt-oss-20b-bf16": 40}  # from_pretrained + LoRA, 24 layers from /dev/shm (guessed)
BUILD_FUSED_24_S = 100  # random BF16 weights, 24 layers, written (42 GB; ~240 s with the split copy)
BUILD_SPLIT_24_S = 140  # its split 4-bit copy: a 16-bit split copy written, quantized, saved
COMPILE_24_S = 90  # the fast path's first decode: torch.compile and CUDA graphs at 24 layers (guessed)
TRAINER_S = 10  # LoRA, the trainer, the sandbox: the rest of a run's start
SAVE_CHECK_S = 15  # the LoRA save and its check at the end of a run
INSTALL_S = 30  # the carried wheels installed, and the GPU set's import check
# Call 1's tiny runs, guessed from the H100's tiny run (~150 s with a merged save and its check in a process of its own, ~40 s of
# them): the default's (a build quantized, a run's start, 2 steps, the adapters' save checked) and BF16's (no
# quantizing; the merged save and its check in a fresh process).
TINY_RUN_S = 115
MERGED_RUN_S = 130


def size_share(layers: int) -> float:
    """A model's size against the full 24 layers: embeddings and output layer weigh about 1.5 layers."""
    return (1.5 + layers) / (1.5 + FULL_DEPTH)


def step_s(preset: str, layers: int, tokens: int) -> float:
    return H100_STEP_S[preset] * layers / FULL_DEPTH * tokens / 200


def compile_s(layers: int) -> float:
    return 10 + (COMPILE_24_S - 10) * layers / FULL_DEPTH


def decode_ms(preset: str, layers: int) -> float:
    """model.generate's decode step at batch 8; the 4-bit one as much slower as its whole step was."""
    return H100_DECODE_MS * layers / FULL_DEPTH * H100_STEP_S[preset] / H100_STEP_S["gpt-oss-20b-bf16"]


# --- the items ---------------------------------------------------------------------------------------------------


@dataclass
class Item:
    """One thing a call runs: a command, what it needs first, its estimate, and how its result is judged."""

    id: str
    what: str
    command: list[str]
    kind: str  # setup | install | build | default | merged | refusal | grpo | decode | suite | check: how it is judged
    estimate_s: float  # the whole item on an H100, its window included
    window_s: float = 0.0  # the part timed alone on the machine
    needs: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    run_dir: str | None = None  # a gpu_check run folder: training.log, metrics.jsonl
    json: str | None = None  # the item's own results file
    turn: str | None = None  # bench_generation's --turn path
    preset: str | None = None
    layers: int | None = None
    tokens: int | None = None  # completion tokens of a GRPO step
    steps: int = 2
    links: tuple[tuple[str, str], ...] = ()  # (link, target) made before it starts: built models in its own folder
    expect: str = ""  # a refusal: a word its one line must hold


@dataclass
class Places:
    """Where a call writes: its console and results (out), small runs (work), the 20B geometry (big)."""

    out: Path
    work: Path
    big: Path
    cpu: bool

    @property
    def tokenizer(self) -> list[str]:
        return ["--tokenizer", "demo"] if self.cpu else ["--tokenizer_dir", str(self.work / "gpt-oss-tokenizer")]

    def items_file(self, id_: str) -> str:
        return str(self.out / "items" / f"{id_}.json")


def places(out: Path, work: Path, cpu: bool) -> Places:
    return Places(out=out, work=work, big=work / "models" if cpu else big_folder(work), cpu=cpu)


def big_folder(work: Path) -> Path:
    """/dev/shm when it holds the largest call's models (24 layers fused: 42 GB, and room), else the work folder. Never
    beside an integrated GPU: there /dev/shm is the memory the GPU trains in (a DGX Spark's 128 GB, shared), and 20-35
    GB of models in it would be taken from the runs they are built for."""
    with contextlib.suppress(OSError):
        if shutil.disk_usage("/dev/shm").free >= 50 * 2**30 and not integrated_gpu():
            return Path("/dev/shm/gpu-matrix")
    return work / "20b"


@functools.cache
def integrated_gpu() -> bool:
    """Whether the GPU shares its memory with the CPU, as torch says (`is_integrated`), asked in a process of its own:
    this one never starts CUDA, so its items have the GPU to themselves."""
    code = "import torch; print(int(torch.cuda.is_available() and torch.cuda.get_device_properties(0).is_integrated))"
    try:
        said = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=300).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return False
    return said[-1:] == ["1"]


def gpu_check(p: Places, *args, run: list[str] = (), tokenizer: list[str] | None = None) -> list[str]:
    """bench/gpu_check.py's command line; `run` goes on to train_2048.py."""
    cpu = ["--cpu"] if p.cpu else []
    tokenizer = p.tokenizer if tokenizer is None else tokenizer
    return [PY, "bench/gpu_check.py", *args, *cpu, *tokenizer, *(["--", *run] if run else [])]


def model_name(p: Places, layers: int, split: bool = False) -> str:
    """gpu_check's folder name for a built model (it names them by geometry, depth and tokenizer)."""
    geometry = "tiny" if p.cpu else "20b"
    return f"gpt-oss-{geometry}-{layers}" + ("-demo-tokenizer" if p.cpu else "") + ("-split-4bit" if split else "")


# nvidia-smi's memory.total is N/A on an integrated GPU (a DGX Spark's GB10): torch says what CUDA can use there too.
MACHINE = (
    "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', "
    "torch.version.cuda, torch.cuda.get_device_name(0)); free, total = torch.cuda.mem_get_info(); "
    "print(f'GPU memory (torch): {free / 2**30:.1f} of {total / 2**30:.1f} GiB free, integrated: '"
    "f'{bool(torch.cuda.get_device_properties(0).is_integrated)}')"
)


def setup_items(p: Places, call: int) -> list[Item]:
    """The GPU set (the carried wheels installed first where they are here), GPT-OSS's tokenizer (the carried one
    unpacked, else built from the GPU set's bpe-openai and openai-harmony), the machine described. None on a CPU."""
    if p.cpu:
        return []
    carried = WHEELS.is_dir()
    tokenizer = (["tar", "-xzf", str(TOKENIZER_ARCHIVE), "-C", str(p.work)], 2) if TOKENIZER_ARCHIVE.exists() else (
        [PY, "gpt_oss_tokenizer.py", "--save", p.tokenizer[1]], IMPORT_TORCH_S)
    machine = (f'{PY} -c "{MACHINE}"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; '
               f"free -g | head -2; df -h /dev/shm {p.work} | cat; nproc")
    return [
        Item(f"{call}.0", "the GPU set: " + ("the carried wheels installed, " if carried else "") + "its versions",
             ["bash", "bench/gpu_set.sh", "install" if carried else "check"], "install", INSTALL_S, env={"PYTHON": PY}),
        Item(f"{call}.t", f"GPT-OSS's tokenizer: {' '.join(tokenizer[0][:2])}", *tokenizer[:1], "setup", tokenizer[1]),
        Item(f"{call}.m", "the machine: versions, GPU, memory, disk", ["bash", "-c", machine], "setup", IMPORT_TORCH_S,
             needs=(f"{call}.0",)),
    ]


def build_items(p: Places, call: int, depths, split: bool) -> list[Item]:
    """The 20B geometry (tiny on a CPU) at each depth, fused (BF16's layout), and split 4-bit (the default's)."""
    name, items = "tiny" if p.cpu else "20B", []
    for layers in depths:
        fused = f"{call}.b{layers}"
        build = ["--geometry", name.lower(), "--layers", str(layers), "--build_only", "--workdir", str(p.big)]
        items.append(Item(fused, f"build the {name} geometry, {layers} layers, random BF16 (fused experts)",
                          gpu_check(p, *build, "--layout", "fused"), "build",
                          IMPORT_TORCH_S + BUILD_FUSED_24_S * size_share(layers),
                          needs=() if p.cpu else (f"{call}.t",)))
        if split and not p.cpu:
            items.append(Item(f"{call}.s{layers}", f"its split 4-bit copy (the default's layout), {layers} layers",
                              gpu_check(p, *build), "build", IMPORT_UNSLOTH_S + BUILD_SPLIT_24_S * size_share(layers),
                              needs=(fused, f"{call}.0")))
    return items


def built(p: Places, call: int, preset: str, layers: int) -> tuple[str, Path]:
    """(the build item, the model folder) a preset's run at this depth needs."""
    split = PRESETS[preset] == "4-bit" and not p.cpu
    return f"{call}.{'s' if split else 'b'}{layers}", p.big / model_name(p, layers, split)


def tiny_run(p: Places, id_: str, kind: str, preset: str, save_method: str, tokens: int, estimate: float, what: str,
             needs: tuple[str, ...], folder: str = "", extra: list[str] = ()) -> Item:
    """A gpu_check run of 2 steps with fast generation on the tiny geometry, its save checked (GPT-OSS's tokenizer on a
    CPU too: built from its packages there)."""
    work = p.work / (folder or f"run-{id_}")
    tokens = [] if p.cpu else ["--max_completion_length", str(tokens)]
    command = gpu_check(p, "--geometry", "tiny", "--preset", preset, "--steps", "2", "--save_method", save_method,
                        "--workdir", str(work), "--json", p.items_file(id_), tokenizer=[] if p.cpu else None,
                        run=["--fast_generation", "true", *tokens, *extra])
    return Item(id_, what, command, kind, estimate, needs=needs, run_dir=str(work / "run"), json=p.items_file(id_),
                preset=preset)


def refusal(p: Places, id_: str, args: list[str], expect: str, what: str, needs: tuple[str, ...]) -> Item:
    """train_2048.py refusing a command line at startup: one line holding `expect`, exit status 2."""
    return Item(id_, what, [PY, "train_2048.py", *args, "--output_dir", str(p.work / f"refused-{id_}")], "refusal",
                IMPORT_UNSLOTH_S + 5, needs=needs, expect=expect)


def grpo_item(p: Places, call: int, n: int, preset: str, layers: int, tokens: int | None, extra: list[str] = (),
              what: str = "") -> Item:
    """A GRPO run through `python train_2048.py` (gpu_check), 2 steps with the fast path: the second is timed."""
    id_ = f"{call}.{n}"
    tokens = tokens or int(yaml.safe_load((ROOT / "configs" / f"{preset}.yaml").read_text())["max_completion_length"])
    need, folder = built(p, call, preset, layers)
    work = p.work / f"run-{id_}"  # its own folder (gpu_check writes <workdir>/run), the built models linked in
    fused = p.big / model_name(p, layers)
    links = {(str(work / fused.name), str(fused)), (str(work / folder.name), str(folder))}
    run = ["--fast_generation", "true", *([] if p.cpu else ["--max_completion_length", str(tokens)]), *extra]
    command = gpu_check(p, "--geometry", "tiny" if p.cpu else "20b", "--layers", str(layers), "--preset", preset,
                        "--steps", "2", "--workdir", str(work), "--json", p.items_file(id_), run=run)
    step = step_s(preset, layers, tokens)
    start = IMPORT_TORCH_S + IMPORT_UNSLOTH_S + LOAD_24_S[preset] * size_share(layers) + TRAINER_S + compile_s(layers)
    tokens = 16 if p.cpu else tokens
    what = what or f"GRPO step, {PRESETS[preset]}, {layers} layers, {tokens} tokens, fast generation"
    return Item(id_, what, command, "grpo", start + 2 * step + SAVE_CHECK_S, window_s=step, needs=(need,),
                run_dir=str(work / "run"), json=p.items_file(id_), preset=preset, layers=layers, tokens=tokens,
                links=tuple(sorted(links)))


# what gpu_check --cpu gives train_2048.py, for the decode benchmark's own load on a CPU
CPU_RUN = ["--backend", "transformers", "--load_in_4bit", "false", "--use_cpu", "true", "--bf16", "false", "--dtype",
           "float32", "--offload_embedding", "false", "--gradient_checkpointing", "false"]


def decode_item(p: Places, call: int, n: int, preset: str, layers: int) -> Item:
    """The decode step at batch 8, ours and model.generate, on the model loaded as the preset's run loads it."""
    id_ = f"{call}.{n}"
    need, folder = built(p, call, preset, layers)
    new_tokens, repeats = (8, 2) if p.cpu else (128, 3)
    turn = str(p.work / "turns" / id_)
    command = [PY, "bench/bench_generation.py", "--model", str(folder), "--preset", preset, "--batch", "8",
               "--new_tokens", str(new_tokens), "--repeats", str(repeats), "--turn", turn, "--json", p.items_file(id_),
               *(["--cpu", "--", *CPU_RUN] if p.cpu else [])]
    window = repeats * new_tokens * 2 * decode_ms(preset, layers) / 1000
    estimate = IMPORT_UNSLOTH_S + LOAD_24_S[preset] * size_share(layers) + TRAINER_S + compile_s(layers) + window * 2
    return Item(id_, f"decode step at batch 8, {PRESETS[preset]}, {layers} layers: ours and model.generate", command,
                "decode", estimate, window_s=window, needs=(need,), json=p.items_file(id_), turn=turn, preset=preset,
                layers=layers)


def suite(id_: str, what: str, args: list[str], estimate: float, needs: tuple[str, ...], env: dict | None = None
          ) -> Item:
    return Item(id_, what, [PY, *args], "suite", estimate, needs=needs, env=env or {})


# --- the calls ---------------------------------------------------------------------------------------------------


def call_1(p: Places) -> list[Item]:
    """Whether `python train_2048.py` works and how fast: (a) the default's own path on a tiny model in its own
    layout, (b) the 20B geometry at 2 and 4 layers for the 4-bit default and BF16, extrapolated to 24; (c) the table.
    Unsloth merges only into 16-bit weights: the merge is checked on the same tiny weights loaded in BF16, and the
    default's local 4-bit checkpoint must be refused before training."""
    ready = () if p.cpu else ("1.0", "1.t")
    demo = ["--config", "configs/cpu-demo.yaml"] if p.cpu else []
    split_tiny = str(p.work / "tiny" / "gpt-oss-tiny-all-split-4bit")
    return [
        *setup_items(p, 1),
        tiny_run(p, "1.1", "default", "gpt-oss-20b", "lora", 256, TINY_RUN_S, "the default on a tiny model in its own "
                 "layout: Unsloth's loader and get_peft_model, 2 GRPO steps with fast generation, the adapters' save "
                 "and its check", ready, folder="tiny"),
        tiny_run(p, "1.11", "merged", "gpt-oss-20b-bf16", "merged_16bit", 64, MERGED_RUN_S, "merged_16bit after a "
                 "BF16 run on the tiny model: merge_2048.py into its 16-bit base, judged weight by weight", ready, folder="tiny-bf16"),
        refusal(p, "1.2", [*demo, "--save_method", "mxfp4"], "mxfp4" if p.cpu else "llm-compressor",
                "--save_method mxfp4 refused at startup: one line, exit status 2", ready[:1]),
        *([] if p.cpu else [refusal(p, "1.12", ["--model_name_or_path", split_tiny, "--save_method", "merged_16bit"],
                                    "4-bit", "--save_method merged_16bit on the default's local 4-bit checkpoint "
                                    "refused at startup: one line, exit status 2", ("1.1",))]),
        *build_items(p, 1, DEPTHS, split=True),
        grpo_item(p, 1, 3, "gpt-oss-20b", 2, None),  # the default first: whether it works and how fast matters most
        grpo_item(p, 1, 4, "gpt-oss-20b", 4, None),
        grpo_item(p, 1, 5, "gpt-oss-20b-bf16", 2, None),
        grpo_item(p, 1, 6, "gpt-oss-20b-bf16", 4, None),
        decode_item(p, 1, 7, "gpt-oss-20b-bf16", 2),  # BF16's decode is a target; the 4-bit one says how far off
        decode_item(p, 1, 8, "gpt-oss-20b-bf16", 4),
        decode_item(p, 1, 9, "gpt-oss-20b", 2),
        decode_item(p, 1, 10, "gpt-oss-20b", 4),
    ]


def call_2(p: Places) -> list[Item]:
    """Full depth in BF16 (the 4-bit build alone would fill a call): the decode step and a step at 200 tokens, measured
    where call 1 extrapolates."""
    return [
        *setup_items(p, 2),
        *build_items(p, 2, [FULL_DEPTH], split=False),
        decode_item(p, 2, 1, "gpt-oss-20b-bf16", FULL_DEPTH),
        grpo_item(p, 2, 2, "gpt-oss-20b-bf16", FULL_DEPTH, 200,
                  what="GRPO step, BF16, 24 layers, 200 tokens (the H100's 19.5 s without the fast path)"),
    ]


def call_3(p: Places) -> list[Item]:
    """The default at 8 layers: a third depth on call 1's line (24 layers of its split 4-bit copy do not fit a call)."""
    return [
        *setup_items(p, 3),
        *build_items(p, 3, [8], split=True),
        grpo_item(p, 3, 1, "gpt-oss-20b", 8, None),
        decode_item(p, 3, 2, "gpt-oss-20b", 8),
    ]


def call_4(p: Places) -> list[Item]:
    """Correctness on the GPU machine: the test suite with the GPU set (in shards, side by side), the saves and their
    checks, evaluate_2048 on a default run's adapter in a fresh process. Nothing here is timed."""
    tests = sorted(str(t.relative_to(ROOT)) for t in (ROOT / "tests").glob("test_*.py"))
    pytest = ["-m", "pytest", "-q", "-p", "no:cacheprovider"]
    ready = ("4.0", "4.t")
    saves = [("4.5", "gpt-oss-20b", "lora", [], "default preset (split 4-bit), save lora: the adapter 4.10 evaluates"),
             ("4.6", "gpt-oss-20b-bf16", "merged_16bit", [], "BF16 preset (Unsloth), save merged_16bit"),
             ("4.7", "gpt-oss-20b-bf16", "lora", ["--backend", "transformers"], "--backend transformers, save lora"),
             ("4.8", "gpt-oss-20b-bf16", "merged_16bit", ["--backend", "transformers"],
              "--backend transformers, save merged_16bit")]
    big_merge = gpu_check(p, "--geometry", "20b", "--layers", "2", "--steps", "2", "--preset", "gpt-oss-20b-bf16",
                          "--save_method", "merged_16bit", "--workdir", str(p.work / "run-4.9"), "--json",
                          p.items_file("4.9"), run=["--max_completion_length", "64"])
    evaluate = ["evaluate_2048.py", "--adapter", str(p.work / "run-4.5/run/final"), "--model",
                str(p.work / "run-4.5/gpt-oss-tiny-all"), "--samples", "2", "--games", "2", "--output_dir",
                str(p.work / "eval-4.10")]
    return [
        *setup_items(p, 4),
        *(suite(f"4.{i}", f"the test suite with the GPU set, shard {i} of 3", [*pytest, *tests[i - 1::3]], 200,
                ("4.0",)) for i in (1, 2, 3)),
        suite("4.4", "the Unsloth tier with the GPU set", [*pytest, "tests/unsloth"], 120, ("4.0",),
              {"TRAIN2048_UNSLOTH_TIER": "1"}),
        *(tiny_run(p, id_, "check", preset, method, 256, 120, f"tiny, {what}", ready, extra=extra)
          for id_, preset, method, extra, what in saves),
        Item("4.9", "2 layers of the 20B geometry in BF16, save merged_16bit (merge_2048.py): its check "
             "at the real widths (the default's local 4-bit checkpoint is refused: 1.12)", big_merge, "check", 200,
             needs=ready, json=p.items_file("4.9"), run_dir=str(p.work / "run-4.9" / "run")),
        suite("4.10", "evaluate_2048.py --adapter on 4.5's adapter (a LoRA per split expert) in a fresh process",
              evaluate, 60, ("4.5",)),
    ]


def call_5(p: Places) -> list[Item]:
    """The other routes at 2 and 4 layers, extrapolated: BF16 on the transformers backend (transformers + PEFT) and the
    default with LoRA on attention only (Unsloth's grouped 4-bit experts)."""
    attention = ["--lora_target_modules", "q_proj", "k_proj", "v_proj", "o_proj"]
    return [
        *setup_items(p, 5),
        *build_items(p, 5, DEPTHS, split=True),
        *(grpo_item(p, 5, n, "gpt-oss-20b-bf16", layers, None, ["--backend", "transformers"],
                    f"GRPO step, BF16 on --backend transformers, {layers} layers, 1024 tokens")
          for n, layers in enumerate(DEPTHS, 1)),
        *(grpo_item(p, 5, n, "gpt-oss-20b", layers, None, attention,
                    f"GRPO step, 4-bit, LoRA on attention only, {layers} layers, 1024 tokens")
          for n, layers in enumerate(DEPTHS, 3)),
    ]


CALLS = {1: call_1, 2: call_2, 3: call_3, 4: call_4, 5: call_5}
# Items at once on a GPU: 5, the most 2-4-layer runs of the 20B geometry that share 80 GB; call 1 has a sixth slot for
# its two tiny runs (megabytes of GPU memory); call 4's are CPU-bound.
JOBS = {1: 6, 4: 8}


def with_needs(items: list[Item], only: set[str]) -> list[Item]:
    """The items named, and every item they need, in call order."""
    by_id, keep, todo = {i.id: i for i in items}, set(), list(only)
    while todo:
        id_ = todo.pop()
        if id_ in by_id and id_ not in keep:
            keep.add(id_)
            todo += by_id[id_].needs
    return [i for i in items if i.id in keep]


# --- the plan and the scheduler ----------------------------------------------------------------------------------


def simulate(items: list[Item], jobs: int) -> dict[str, float]:
    """Each item's end by the estimates, run as `run_call` runs them: at most `jobs` at once, each started once its
    needs have ended, the windows one at a time with everything else stopped. Returns {id: end}; "call": the last."""
    ids = {i.id for i in items}
    pending, running, ends, now = list(items), {}, {}, 0.0
    windows: list[str] = []  # items waiting for or in their window, in order
    while pending or running:
        for item in list(pending):
            if len(running) < jobs and all(n in ends for n in item.needs if n in ids):
                pending.remove(item)
                running[item.id] = [item.estimate_s - item.window_s, item.window_s]  # untimed left, window left
        if not running:
            raise ValueError(f"items that need what the call does not run: {[i.id for i in pending]}")
        windows += [id_ for id_, (untimed, window) in running.items() if untimed <= 0 < window and id_ not in windows]
        if windows:  # the window runs alone: the others wait
            owner = windows.pop(0)
            dt, running[owner][1] = running[owner][1], 0
        else:
            dt = min(untimed for untimed, _ in running.values())
            for left in running.values():
                left[0] -= dt
        now += dt
        for id_, (untimed, window) in list(running.items()):
            if untimed <= 1e-9 and window <= 1e-9:
                ends[id_] = now
                del running[id_]
    ends["call"] = max(ends.values(), default=0.0)
    return ends


@dataclass
class Run:
    """An item's process while it runs."""

    item: Item
    proc: subprocess.Popen
    started: float
    log: Path
    stopped: bool = False
    window: list[float] = field(default_factory=list)  # start, end (one window per item)
    interrupted: bool = False  # stopped during its timed step: its figure is not to be trusted


def start(item: Item, p: Places, env: dict) -> Run:
    """The item's command in a process group of its own (so that a window stops it as one), its output in its log.
    What an earlier run in the same work folder left (its results, its turn files, its run folder) goes first: it
    would open or close the window at once."""
    for stale in (item.json, *(f"{item.turn}{x}" for x in (".ask", ".go", ".done") if item.turn)):
        if stale:
            Path(stale).unlink(missing_ok=True)
    if item.run_dir:
        shutil.rmtree(item.run_dir, ignore_errors=True)
    for link, target in item.links:
        Path(link).parent.mkdir(parents=True, exist_ok=True)
        if not Path(link).is_symlink():
            Path(link).symlink_to(target)
    log = p.out / "logs" / f"{item.id}.log"
    with open(log, "w") as out:
        out.write("$ " + " ".join(item.command) + "\n")
        out.flush()
        env = {**env, **item.env, "UNSLOTH_COMPILE_LOCATION": str(p.work / f"unsloth-{item.id}")}
        proc = subprocess.Popen(item.command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return Run(item, proc, time.monotonic(), log)


def steps_logged(run_dir: str | None) -> int:
    with contextlib.suppress(OSError):
        return sum('"time/step_s"' in line for line in Path(run_dir, "metrics.jsonl").read_text().splitlines())
    return 0


def wants_window(run: Run) -> bool:
    if run.item.turn:
        return Path(f"{run.item.turn}.ask").exists()
    return run.item.kind == "grpo" and steps_logged(run.item.run_dir) >= 1


def window_over(run: Run) -> bool:
    if run.item.turn:
        return Path(f"{run.item.turn}.done").exists()
    return steps_logged(run.item.run_dir) >= run.item.steps


def signal_group(run: Run, sig) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(run.proc.pid, sig)


def next_window(running: dict[str, Run], say) -> Run | None:
    """Every stopped process resumed; then the earliest started run that asks for its window gets the machine, and
    every other process of the call stops (SIGSTOP to its group) until the window closes."""
    for run in running.values():
        if run.stopped:
            signal_group(run, signal.SIGCONT)
            run.stopped = False
    owner = next((r for r in running.values() if not r.window and wants_window(r)), None)
    if owner is None:
        return None
    for run in running.values():
        if run is not owner:
            if run.item.kind == "grpo" and 1 <= steps_logged(run.item.run_dir) < run.item.steps:
                run.interrupted = True  # it logged its first step within the same poll: a rare tie
            signal_group(run, signal.SIGSTOP)
            run.stopped = True
    owner.window.append(time.monotonic())
    if owner.item.turn:
        Path(f"{owner.item.turn}.go").touch()
    stopped = ", ".join(r.item.id for r in running.values() if r.stopped) or "none"
    say(f"[{owner.item.id}] timing alone on the machine (stopped: {stopped})")
    return owner


def run_call(call: int, items: list[Item], p: Places, jobs: int, time_limit: float | None, say) -> list[dict]:
    """Run the items (see the module's docstring); returns one record per item, in call order."""
    for folder in (p.out / "items", p.out / "logs", p.work / "turns", p.big):
        folder.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + time_limit - RESERVE_S if time_limit else math.inf
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           **({"CUDA_VISIBLE_DEVICES": ""} if p.cpu else {})}
    pending, running, records, owner, ids = list(items), {}, {}, None, {i.id for i in items}

    def finish(run: Run, cut: bool = False):
        record = judge(run.item, run.proc.returncode, run.log, p)
        for why, applies in (("cut at the call's end", cut),
                             ("its timed step was interrupted by another's window", run.interrupted)):
            if applies:
                record.update(status="FAIL", figure=f"{why}; {record['figure']}")
        record.update(seconds=round(time.monotonic() - run.started, 1), estimate_s=round(run.item.estimate_s),
                      window_s=round(run.window[1] - run.window[0], 1) if len(run.window) == 2 else None)
        records[run.item.id] = record
        say(f"[{run.item.id}] {record['status']} in {record['seconds']:.0f} s (est {record['estimate_s']}): "
            f"{run.item.what}: {record['figure']}")
        for line in record.get("tail", [])[-6:] if record["status"] != "PASS" else []:
            say(f"    {line}")

    def skip(item: Item, why: str, hint: str = ""):
        pending.remove(item)
        records[item.id] = skipped(item, why)
        say(f"[{item.id}] SKIPPED, {why}: {hint or item.what}")

    while pending or running:
        if time.monotonic() > deadline:  # the time limit: stop what still runs, keep what it said
            for run in running.values():
                signal_group(run, signal.SIGCONT)
                signal_group(run, signal.SIGKILL)
                run.proc.wait()
                finish(run, cut=True)
            running.clear()
            for item in list(pending):
                skip(item, "the call's time was up")
            break
        for id_, run in list(running.items()):
            if run.proc.poll() is not None:
                if owner is run:
                    owner = None
                    run.window.append(time.monotonic())
                del running[id_]
                finish(run)
        if owner is not None and window_over(owner):
            owner.window.append(time.monotonic())
            say(f"[{owner.item.id}] timed alone for {owner.window[1] - owner.window[0]:.1f} s")
            owner = None
        if owner is None:
            owner = next_window(running, say)
        for item in list(pending) if owner is None else []:
            if len(running) >= jobs:
                break
            needs = [n for n in item.needs if n in ids]  # only those among the items run
            failed = [n for n in needs if records.get(n, {}).get("status") in ("FAIL", "SKIPPED")]
            left = deadline - time.monotonic()
            if failed:
                skip(item, f"needs {', '.join(failed)}, which did not pass")
            elif any(n not in records for n in needs):
                continue
            elif item.estimate_s > left and not p.cpu:  # an H100's estimates: not a CPU's
                skip(item, f"~{item.estimate_s:.0f} s does not fit the {left:.0f} s left",
                     f"`bench/gpu_matrix.py {call} --only {item.id}` runs it (and what it needs)")
            else:
                pending.remove(item)
                running[item.id] = start(item, p, env)
                say(f"[{item.id}] start (~{item.estimate_s:.0f} s): {item.what}")
        time.sleep(0.02)
    return [records[i.id] for i in items if i.id in records]


def skipped(item: Item, why: str) -> dict:
    return {"id": item.id, "what": item.what, "kind": item.kind, "status": "SKIPPED", "figure": why, "figures": {},
            "command": item.command, "seconds": 0, "estimate_s": round(item.estimate_s)}


# --- judging an item ---------------------------------------------------------------------------------------------


def load_json(path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError, TypeError):
        return None


def run_metrics(run_dir: str | None) -> list[dict]:
    with contextlib.suppress(OSError):
        lines = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines() if line.strip()]
        return [m for m in lines if "time/step_s" in m]
    return []


def fast_path_problem(result: dict, metrics: list[dict]) -> str | None:
    """Why the fast path did not serve every step (None when it did): generation/fast_path is 1 on each step, and no
    fallback or uncompiled warning was logged."""
    served = [m.get("generation/fast_path") for m in metrics]
    said = " | ".join(result.get("generation") or [])
    if not served or any(s != 1.0 for s in served):
        return f"generation/fast_path {served}: {said[:200]}"
    for bad in ("unavailable", "failed", "uncompiled"):
        if bad in said:
            return f"fast generation {bad}: {said[:200]}"
    return None


def judge_run(item: Item, result: dict | None, p: Places, record: dict) -> tuple[list[str], str]:
    """A gpu_check run: its steps, the fast path, its saves checked, its layout; its figures into `record`."""
    metrics = run_metrics(item.run_dir)
    if not result or result.get("failed"):
        return ["no results from gpu_check"], ""
    problems = [] if len(metrics) == item.steps else [f"{len(metrics)} steps logged of {item.steps}"]
    if "--fast_generation" in item.command:
        problems += [x for x in [fast_path_problem(result, metrics)] if x]
    checks = result.get("save_checks", [])
    if result.get("save_problems") or not checks:
        problems.append(f"save: {(result.get('save_problems') or ['not verified'])[0][:160]}")
    if item.kind == "default" and not p.cpu:  # on a CPU, gpu_check --cpu picks its own layout and backend
        if "experts split" not in (result.get("experts") or ""):
            problems.append(f"layout: {result.get('experts')}")
        if result.get("backend") != "unsloth":
            problems.append(f"backend {result.get('backend')}, not unsloth")
    if item.kind == "default" and not any("/final:" in c for c in checks):
        problems.append("the adapters' save was not verified")
    if item.kind == "merged" and not any("final-merged_16bit" in c for c in checks):
        problems.append("the merged_16bit save was not verified")
    last = metrics[-1] if metrics else {}
    figures = {name: last.get(f"time/{name}_s") for name in
               ("step", "generate", "rewards", "logprobs_and_backward", "optimizer")}
    figures["peak_memory_gb"] = max((m.get("gpu/peak_memory_gb") or 0 for m in metrics), default=None) or None
    if figures["generate"] and item.tokens:  # every completion runs to the budget (random weights)
        figures["decode_ms_in_step"] = 1000 * figures["generate"] / item.tokens
    record.update(figures=figures, fast_path=[m.get("generation/fast_path") for m in metrics])
    f = {k: "-" if v is None else f"{v:.2f}" for k, v in figures.items()}
    figure = (f"step {f['step']} s (generate {f['generate']}, rewards {f['rewards']}, log-probs+backward "
              f"{f['logprobs_and_backward']}, optimizer {f['optimizer']}), peak {f['peak_memory_gb']} GB, "
              f"fast_path {record['fast_path']}")
    if item.kind != "grpo":
        checks = [c for c in checks if "merged" in c] or checks
        figure += f"; {result.get('experts')}; {checks[-1][:200] if checks else 'no save verified'}"
    return problems, figure


def judge(item: Item, rc: int, log: Path, p: Places) -> dict:
    """PASS or FAIL, one line of figures, and the figures themselves."""
    tail = log.read_text(errors="replace").splitlines()[-40:] if log.exists() else []
    said = [line for line in tail[1:] if line.strip()]  # after the command line the log opens with
    record = {"id": item.id, "what": item.what, "kind": item.kind, "command": item.command, "rc": rc, "tail": tail,
              "preset": item.preset, "layers": item.layers, "tokens": item.tokens, "figures": {}}
    result = load_json(item.json) if item.json else None
    problems, figure = ([] if rc == 0 else [f"exit status {rc}"]), said[-1][:200] if said else ""
    if item.kind == "refusal":  # Unsloth's banner may come first (stdout); the refusal is the last line
        refused = rc == 2 and said and item.expect in said[-1] and not any("Traceback" in line for line in said)
        problems = [] if refused else [f"exit status {rc}, said {said[-3:]}"]
        figure = figure or "nothing said"
    elif item.kind == "install":  # the GPU set's one line says the versions and the GPU
        line = next((line for line in said if line.startswith("gpu set:")), None)
        problems += [] if line else ["the GPU set does not import (no 'gpu set:' line)"]
        figure = line or figure
    elif item.kind in ("default", "merged", "grpo", "check"):
        found, figure = judge_run(item, result, p, record)
        problems += found
    elif item.kind == "decode":
        rows = {r["method"]: r for r in (result or {}).get("rows", []) if r["batch"] == 8}
        if set(rows) != {"model.generate", "generation.generate"}:
            problems.append("no decode rows")
        else:
            ours, theirs = rows["generation.generate"], rows["model.generate"]
            if not ours.get("path", "").startswith("fast ("):
                problems.append(f"ours did not take the fast path: {ours.get('path')}")
            record["figures"] = {"decode_ms": ours["decode_ms_per_step"], "prefill_ms": ours["prefill_ms"],
                                 "decode_ms_generate": theirs["decode_ms_per_step"]}
            figure = (f"ours {ours['decode_ms_per_step']} ms, model.generate {theirs['decode_ms_per_step']} ms per "
                      f"step (prefill {ours['prefill_ms']} ms), same greedy tokens: {ours.get('same_greedy_tokens')}; "
                      f"{ours.get('path')}")
    record["status"] = "FAIL" if problems else "PASS"
    record["figure"] = "; ".join(problems + [figure]) if problems else figure
    return record


# --- the two-point fit and the targets -----------------------------------------------------------------------------


def fit(points: dict[int, float]) -> tuple[float, float]:
    """a, b of a + b x layers through two measured depths."""
    (l1, y1), (l2, y2) = sorted(points.items())[:2]
    b = (y2 - y1) / (l2 - l1)
    return y1 - b * l1, b


def extrapolate(points: dict[int, float], layers: int = FULL_DEPTH) -> float | None:
    points = {k: v for k, v in points.items() if v is not None}
    if layers in points:
        return points[layers]
    if len(points) < 2:
        return None
    a, b = fit(points)
    return a + b * layers


def figures_by_depth(records: list[dict], kind: str, preset: str, name: str, tokens: int | None = None) -> dict:
    return {r["layers"]: r["figures"].get(name) for r in records if r["kind"] == kind and r["preset"] == preset
            and r["status"] == "PASS" and name in r["figures"] and tokens in (None, r["tokens"])}


GRPO_FIGURES = (("step", "GRPO step", "s"), ("generate", "  generate", "s"), ("rewards", "  rewards", "s"),
                ("logprobs_and_backward", "  log-probs+backward", "s"), ("peak_memory_gb", "  peak memory", "GB"),
                ("decode_ms_in_step", "  generate / tokens", "ms"))
DECODE_FIGURES = (("decode_ms", "decode step at batch 8, ours", "ms"),
                  ("decode_ms_generate", "decode step at batch 8, model.generate", "ms"),
                  ("prefill_ms", "prefill at batch 8", "ms"))


def targets(records: list[dict]) -> tuple[list[str], list[dict]]:
    """The table of the figures at each depth and at 24 layers, then the targets against them (markdown lines), and
    each target's row."""
    lines = ["| figure | " + " | ".join(f"{d} layers" for d in DEPTHS) + f" | {FULL_DEPTH} layers |",
             "|---|" + "---:|" * (len(DEPTHS) + 1)]
    full = {}  # (preset, figure): the figure at 24 layers
    for preset, name in PRESETS.items():
        grpo = [r for r in records if r["kind"] == "grpo" and r["preset"] == preset and r["status"] == "PASS"]
        tokens = full[preset, "tokens"] = max((r["tokens"] for r in grpo), default=None)
        rows = [(figure, f"{name}: {label}" + (f" ({tokens} tokens)" if figure == "step" else ""), unit,
                 figures_by_depth(grpo, "grpo", preset, figure, tokens)) for figure, label, unit in GRPO_FIGURES]
        rows += [(figure, f"{name}: {label}", unit, figures_by_depth(records, "decode", preset, figure))
                 for figure, label, unit in DECODE_FIGURES]
        for figure, label, unit, by_depth in rows:
            full[preset, figure] = at = extrapolate(by_depth)
            if by_depth:
                cells = [f"{by_depth[d]:.2f} {unit}" if by_depth.get(d) is not None else "-" for d in DEPTHS]
                how = "measured" if FULL_DEPTH in by_depth else "extrapolated"
                lines.append(f"| {label} | " + " | ".join(cells) + f" | {'-' if at is None else f'{at:.2f} {unit}'} "
                             f"({how}) |")
    rows = []

    def target(what: str, value: float | None, limit: float, text: str):
        verdict = "n/a" if value is None else ("PASS" if value <= limit else "FAIL")
        rows.append({"target": what, "figure": "not measured" if value is None else text, "result": verdict})

    bf16, four = "gpt-oss-20b-bf16", "gpt-oss-20b"
    decode = full.get((bf16, "decode_ms"))
    target("BF16 decode step at batch 8 <= 10 ms at 24 layers", decode, 10.0, f"{decode or 0:.1f} ms")
    a, b = full.get((four, "step")), full.get((bf16, "step"))
    ratio = a / b if a is not None and b else None
    target("4-bit GRPO step within 1.5x of BF16 at 24 layers", ratio, 1.5, f"{a or 0:.1f} / {b or 0:.1f} s = "
           f"{ratio or 0:.2f}x")
    default = [r for r in records if r["preset"] == four and r["kind"] in ("default", "grpo")]
    served = [s for r in default for s in r.get("fast_path", [])]
    ran = [r for r in default if r["status"] != "SKIPPED"]
    everywhere = bool(served) and all(s == 1.0 for s in served) and all(r.get("fast_path") for r in ran)
    rows.append({"target": "generation/fast_path = 1 on every step of the default", "result": "PASS" if everywhere
                 else "FAIL" if served else "n/a", "figure": f"{len(served)} steps of {len(ran)} runs: {served}"})
    for preset, name in PRESETS.items():
        what = f"{name} GRPO step within 1.3x of generate + score + log-probs/backward"
        step, tokens, decode, prefill, rewards, backward = (full.get((preset, figure)) for figure in (
            "step", "tokens", "decode_ms", "prefill_ms", "rewards", "logprobs_and_backward"))
        if None in (step, tokens, decode, prefill, rewards, backward):
            target(what, None, 1.3, "")
            continue
        generate = (prefill + decode * (tokens - 1)) / 1000
        parts = generate + rewards + backward
        target(what, step / parts, 1.3, f"{step:.1f} / ({generate:.1f} generate alone + {rewards:.1f} + "
               f"{backward:.1f}) s = {step / parts:.2f}x at 24 layers")
    lines += ["", "| target (H100) | figure | result |", "|---|---|---|"]
    lines += [f"| {r['target']} | {r['figure']} | {r['result']} |" for r in rows]
    return lines, rows


# --- the results kept: docs/GPU_CHECK.md -------------------------------------------------------------------------

RESULTS_HEADER = "| date | machine | commit | item | what | figure | result |"


def recorded(doc: Path = DOC) -> list[dict]:
    """The rows of docs/GPU_CHECK.md's results table."""
    rows, inside = [], False
    for line in doc.read_text().splitlines() if doc.exists() else []:
        if line.strip() == RESULTS_HEADER:
            inside = True
        elif inside and line.startswith("| "):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows.append(dict(zip(("date", "machine", "commit", "item", "what", "figure", "result"), cells)))
        elif inside and not line.startswith("|---"):
            break
    return rows


def record(results: list[dict], doc: Path = DOC, commit: str | None = None) -> int:
    """The items and targets of each results file, as rows of the results table (added after the last row)."""
    lines = doc.read_text().splitlines()
    if RESULTS_HEADER not in lines:
        raise SystemExit(f"gpu_matrix: {doc} has no results table (its header: {RESULTS_HEADER})")
    at = lines.index(RESULTS_HEADER) + 2
    while at < len(lines) and lines[at].startswith("| "):
        at += 1
    new = []
    for result in results:
        head = [result["date"], result["machine"], commit or result.get("commit") or "unknown"]
        new += [head + [r["id"], r["what"], cell(r["figure"]), r["status"]] for r in result["items"]
                if r["kind"] != "setup"]  # the GPU set's line stays: it names the versions
        new += [head + [f"{result['call']}.c", r["target"], cell(r["figure"]), r["result"]]
                for r in result.get("targets", [])]
    lines[at:at] = ["| " + " | ".join(c) + " |" for c in new]
    doc.write_text("\n".join(lines) + "\n")
    return len(new)


def cell(text: str) -> str:
    return " ".join(str(text).replace("|", "/").split())[:300]


def head_commit() -> str | None:
    """This tree's commit, where git and the repository are here (a copied tree has neither: --commit names it)."""
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True)
        return git.stdout.strip() or None
    return None


def next_call(commit: str | None, doc: Path = DOC) -> tuple[int, list[str], bool] | None:
    """(call, its items not yet run on `commit`, whether some of it has), the first such call; None when every call has
    run on it."""
    done = {r["item"] for r in recorded(doc) if commit and r["commit"] == commit and r["result"] != "SKIPPED"}
    for call, build in CALLS.items():
        items = [i.id for i in build(places(Path("/tmp/out"), Path("/tmp/work"), cpu=False)) if i.kind not in SETUP]
        missing = [i for i in items if i not in done]
        if missing:
            return call, missing, len(missing) < len(items)
    return None


def command_line(call: int, commit: str | None, only: list[str] | None = None) -> str:
    """The shell command that runs a call on a GPU machine with a time limit per run."""
    return (f"python3 bench/gpu_matrix.py {call} --commit {commit or 'COMMIT'} --time_limit {TIME_LIMIT_S}"
            + (f" --only {','.join(only)}" if only else ""))


# --- the command line --------------------------------------------------------------------------------------------


def print_plan(call: int, items: list[Item], jobs: int) -> None:
    ends = simulate(items, jobs)
    print(f"# call {call}: {(CALLS[call].__doc__ or '').split(chr(10))[0]}")
    for item in items:
        window = f", {item.window_s:.0f} s alone" if item.window_s else ""
        needs = f" after {','.join(item.needs)}" if item.needs else ""
        print(f"#   [{item.id} ~{item.estimate_s:.0f} s{window}{needs}, ends ~{ends[item.id]:.0f} s] {item.what}")
        print(" ".join(item.command))
    verdict = "fits" if ends["call"] <= TIME_LIMIT_S - RESERVE_S else "does NOT fit"
    print(f"# call {call}: ~{ends['call']:.0f} s by the estimates ({jobs} at once), {verdict} {TIME_LIMIT_S} s "
          f"({RESERVE_S} s kept for the table)\n")


def new_folder(parent: Path, call: int) -> Path:
    """A folder of its own for this run's results: outputs/gpu-check/callN-<date and time>[-k]."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder, k = parent / f"call{call}-{stamp}", 1
    while folder.exists():
        k += 1
        folder = parent / f"call{call}-{stamp}-{k}"
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("call", nargs="?", type=int, help=f"the call to run: {', '.join(map(str, CALLS))}")
    parser.add_argument("--dry-run", action="store_true", help="print the calls' items, commands, plans; run nothing")
    parser.add_argument("--cpu", action="store_true", help="tiny models on the CPU: the plumbing")
    parser.add_argument("--next", action="store_true", help="the call to run next on this commit, and its command")
    parser.add_argument("--record", nargs="+", metavar="RESULTS", help="add callN-results.json files to the table")
    parser.add_argument("--only", help="these items (comma-separated ids) and what they need")
    parser.add_argument("--commit", help="the commit this tree is, where git cannot say (a copy without .git)")
    parser.add_argument("--jobs", type=int, help="items at once (default: 5 on a GPU, 6 for call 1; 2 on a CPU)")
    parser.add_argument("--time_limit", "--time-limit", type=float, metavar="SECONDS",
                        help=f"stop by then (the calls are planned for {TIME_LIMIT_S} s on an H100); default: none")
    parser.add_argument("--out", type=Path, help="the results folder, new or empty (default: a new folder under "
                        "outputs/gpu-check/)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-matrix"), help="where the models are built and "
                        "the runs go, kept for the next run (default: /tmp/gpu-matrix; /dev/shm with 50 GB free, beside a discrete "
                        "GPU)")
    parser.add_argument("--doc", type=Path, default=DOC, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.call is not None and args.call not in CALLS:
        parser.error(f"call {args.call}: the calls are {', '.join(map(str, CALLS))}")

    def jobs_for(call: int) -> int:
        return args.jobs or (2 if args.cpu else JOBS.get(call, 5))

    commit = args.commit or head_commit()
    if args.record:
        results = [load_json(path) for path in args.record]
        if any(r is None or "items" not in r for r in results):
            parser.error("--record takes callN-results.json files that gpu_matrix.py wrote")
        if any(r["machine"] == "cpu" for r in results):
            parser.error("--record keeps GPU runs: a --cpu run's figures say nothing about a GPU")
        if not args.commit and any(not r.get("commit") for r in results):
            parser.error("--record: a results file does not say its commit (its tree had no git): --commit names it")
        print(f"gpu_matrix: {record(results, args.doc, args.commit)} rows added to {args.doc}")
        return 0
    out = (args.out or new_folder(Path("outputs") / "gpu-check", args.call or 0)).resolve()
    work = args.work.resolve()
    if args.next or (args.dry_run and args.call is None):
        if args.dry_run:
            for call, build in CALLS.items():
                print_plan(call, build(places(out, work, args.cpu)), jobs_for(call))
        found = next_call(commit, args.doc)
        if found is None:
            print(f"next: nothing; every call has run on {commit}")
            return 0
        call, missing, partly = found
        print(f"next: call {call} (not yet run on {commit}: {', '.join(missing)})\n"
              f"  {command_line(call, commit, missing if partly else None)}\n"
              f"  on an offline GPU machine, beside the project's files: {WHEELS.name}/ and {TOKENIZER_ARCHIVE.name} "
              f"(bash bench/gpu_set.sh pack); allow the command {TIME_LIMIT_S + 60} s; its results go to a new folder "
              "under outputs/gpu-check/ (--out DIR: that folder instead)")
        return 0
    if args.call is None:
        parser.error("name a call (1-5), or --dry-run, --next, --record")
    if args.cpu and args.call != 1 and not args.dry_run:
        parser.error("--cpu runs call 1 (its plumbing is the later calls' too); the others need a GPU")
    p = places(out, work, args.cpu)
    items = CALLS[args.call](p)
    if args.only:
        names = {x for x in args.only.split(",") if x}
        if not names <= {i.id for i in items}:
            parser.error(f"--only {args.only}: call {args.call} has items {', '.join(i.id for i in items)}")
        items = with_needs(items, names)
    if args.dry_run:
        print_plan(args.call, items, jobs_for(args.call))
        return 0
    if out.exists() and (not out.is_dir() or any(out.glob(f"call{args.call}[.-]*"))):
        parser.error(f"--out {args.out}: " + (f"call {args.call} already ran there; name another folder, or leave "
                     "--out out for a new one" if out.is_dir() else "not a folder"))
    return run_and_report(args.call, items, p, jobs_for(args.call), args.time_limit, commit)


def run_and_report(call: int, items: list[Item], p: Places, jobs: int, time_limit: float | None,
                   commit: str | None) -> int:
    """The call's items run, the time they will take said first; its files written, the table printed last."""
    p.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(p.out / f"call{call}.log", "a") as console:

        def say(line: str) -> None:
            line = f"{time.monotonic() - t0:6.1f}s {line}"
            print(line, flush=True)
            console.write(line + "\n")
            console.flush()

        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
        plan = simulate(items, jobs)["call"]
        limit = f"it stops itself at {time_limit - RESERVE_S:.0f} s" if time_limit else "no time limit"
        say(f"== gpu_matrix call {call} ({'cpu' if p.cpu else 'gpu'}), {date}, commit {commit or 'unknown'}, {jobs} "
            f"at once, models in {p.big}")
        say(f"== {len(items)} items: about {math.ceil(plan / 60)} min by an H100's estimates ({plan:.0f} s); {limit}; "
            f"results in {p.out}")
        records = run_call(call, items, p, jobs, time_limit, say)
        lines, rows = targets(records) if call == 1 else ([], [])
        machine = machine_name(records, p.cpu)
        result = {"call": call, "date": date, "machine": machine, "commit": commit,
                  "seconds": round(time.monotonic() - t0), "items": records, "targets": rows}
        (p.out / f"call{call}-results.json").write_text(json.dumps(result, indent=1) + "\n")
        table = [f"# call {call}, {machine}, commit {commit or 'unknown'}, {date}", "",
                 "| item | what | result | figure |",
                 "|---|---|---|---|", *(f"| {r['id']} | {r['what']} | {r['status']} | {cell(r['figure'])} |"
                                        for r in records), "", *lines]
        (p.out / f"call{call}-targets.md").write_text("\n".join(table) + "\n")
        with tarfile.open(p.out / f"call{call}-logs.tar.gz", "w:gz") as tar:
            tar.add(p.out / "logs", arcname="logs")
            for item in items:
                for name in ("training.log", "metrics.jsonl", "console.txt"):
                    if item.run_dir and Path(item.run_dir, name).exists():
                        tar.add(Path(item.run_dir, name), arcname=f"runs/{item.id}/{name}")
        say(f"== call {call} done in {time.monotonic() - t0:.0f} s. Each item's output: {p.out / 'logs'}; with each "
            f"run's training.log and metrics.jsonl: {p.out / f'call{call}-logs.tar.gz'}; every figure: "
            f"{p.out / f'call{call}-results.json'}; this table: {p.out / f'call{call}-targets.md'}")
        for line in table:
            say(line)
    return 0 if all(r["status"] == "PASS" for r in records) else 1


def machine_name(records: list[dict], cpu: bool) -> str:
    if cpu:
        return "cpu"
    for r in records:
        for line in r.get("tail", []):
            if line.startswith("python ") and " cuda " in line:
                return line.rsplit(" cuda ", 1)[1].split(" ", 1)[-1]
    return "unknown GPU"


if __name__ == "__main__":
    sys.exit(main())
