"""The GPU check in calls that fit a lent GPU (issue 29): call 1 says in at most 420 s whether `python train_2048.py`
works and how fast; the later calls, each standing alone, add the rest in the order of what they would reveal.

    python3 bench/gpu_matrix.py 1 --commit abc1234   # call 1 on the GPU machine: what the device tool runs
    python3 bench/gpu_matrix.py --next               # the call to run next on this commit, from docs/GPU_MATRIX.md
    python3 bench/gpu_matrix.py --dry-run            # every call: its items, commands and estimates, and its plan
    python3 bench/gpu_matrix.py --cpu 1              # call 1 on a CPU with tiny models: the plumbing (CI runs it)
    python3 bench/gpu_matrix.py --record OUT/call1-results.json   # its rows into docs/GPU_MATRIX.md's results
    python3 bench/gpu_matrix.py 2 --only 2.5         # some items of a call (and what they need) again

A call runs its items side by side (`--jobs` at once) as soon as what they need is there, and keeps every timed part
alone on the machine: a GRPO run's timed step (its second: the first compiles) and a decode benchmark's timed runs
each get a window during which every other process of the call is stopped (SIGSTOP to its process group, SIGCONT
after), so that imports, loads, compiles and warm-up steps overlap while no figure shares the GPU. An item whose
estimate no longer fits the call's time is skipped and named; at the call's end whatever still runs is stopped. Each
item prints its result line as it ends (PASS or FAIL, and its figures); the call ends with its targets table.
Under $OUT (default /tmp/gpu-matrix-out): callN.log (this console), callN-results.json (every item, every figure),
callN-targets.md (the table), callN-logs.tar.gz (each item's output and its run's training.log and metrics.jsonl).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
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
DOC = ROOT / "docs" / "GPU_MATRIX.md"
PY = sys.executable
BUDGET_S = 420  # one call of the device tool, the machine's set-up included
RESERVE_S = 10  # kept at the end of a call for the table and the files
FULL_DEPTH = 24  # GPT-OSS-20B's layers: every figure is extrapolated there
DEPTHS = (2, 4)  # the two reduced depths of call 1: a sliding and a full attention layer per pair
PRESETS = {"gpt-oss-20b": "4-bit", "gpt-oss-20b-bf16": "BF16"}
SETUP = ("setup", "install")  # the kinds of item that make a call's machine ready: not results of their own

# --- estimates (H100, seconds) -----------------------------------------------------------------------------------
# From the one H100 run so far (turn 2: GUIDE 4b; 20B geometry, 24 layers, 8 x 200 tokens, no fast path), scaled
# linearly in layers and tokens (an upper bound: the fast path's gains are not counted), and guesses for the rest.

TURN2_STEP_S = {"gpt-oss-20b": 33.0, "gpt-oss-20b-bf16": 19.5}  # a whole GRPO step, 24 layers, 200 tokens
TURN2_DECODE_MS = 46.5  # a decode step at batch 8 (BF16, model.generate), 24 layers
IMPORT_UNSLOTH_S = 30  # a process that imports Unsloth (turn 2)
IMPORT_TORCH_S = 10  # a process that imports torch and transformers only
LOAD_24_S = {"gpt-oss-20b": 80, "gpt-oss-20b-bf16": 40}  # from_pretrained + LoRA, 24 layers from /dev/shm (guessed)
BUILD_FUSED_24_S = 100  # random BF16 weights, 24 layers, written (42 GB; turn 2: ~240 s with the split copy)
BUILD_SPLIT_24_S = 140  # its split 4-bit copy: a 16-bit split copy written, quantized, saved
COMPILE_24_S = 90  # the fast path's first decode: torch.compile and CUDA graphs at 24 layers (guessed)
TRAINER_S = 10  # LoRA, the trainer, the sandbox: the rest of a run's start
SAVE_CHECK_S = 15  # the LoRA save and its check at the end of a run
INSTALL_S = 30  # .gpu-wheels/install.sh: the wheels and its import check
# Call 1's tiny runs, guessed from the turn-2 tiny run (~150 s with a merged save and its fresh-process check, ~40 s of
# them): the default's (a build quantized, a run's start, 2 steps, the adapters' save checked) and BF16's (no
# quantizing; the merged save and its check in a fresh process).
TINY_RUN_S = 115
MERGED_RUN_S = 130


def size_share(layers: int) -> float:
    """A model's size against the full 24 layers: embeddings and output layer weigh about 1.5 layers."""
    return (1.5 + layers) / (1.5 + FULL_DEPTH)


def step_s(preset: str, layers: int, tokens: int) -> float:
    return TURN2_STEP_S[preset] * layers / FULL_DEPTH * tokens / 200


def compile_s(layers: int) -> float:
    return 10 + (COMPILE_24_S - 10) * layers / FULL_DEPTH


def decode_ms(preset: str, layers: int) -> float:
    """model.generate's decode step at batch 8; the 4-bit one as much slower as its whole step was."""
    return TURN2_DECODE_MS * layers / FULL_DEPTH * TURN2_STEP_S[preset] / TURN2_STEP_S["gpt-oss-20b-bf16"]


# --- the items ---------------------------------------------------------------------------------------------------


@dataclass
class Item:
    """One thing a call runs: a command, what it needs first, its estimate, and how its result is judged."""

    id: str
    what: str
    command: list[str]
    kind: str  # setup | build | default | merged | refusal | grpo | decode | suite | check: how the result is judged
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


def big_folder(work: Path) -> Path:
    """/dev/shm when it holds the largest call's models (24 layers fused: 42 GB, and room), else the work folder."""
    with contextlib.suppress(OSError):
        if shutil.disk_usage("/dev/shm").free >= 50 * 2**30:
            return Path("/dev/shm/gpu-matrix")
    return work / "20b"


def gpu_check(p: Places, *args, run: list[str] = (), tokenizer: list[str] | None = None) -> list[str]:
    cpu = ["--cpu"] if p.cpu else []
    tokenizer = p.tokenizer if tokenizer is None else tokenizer
    return [PY, "bench/gpu_check.py", *args, *cpu, *tokenizer, *(["--", *run] if run else [])]


def model_name(p: Places, layers: int, split: bool = False) -> str:
    """gpu_check's folder name for a built model (it names them by geometry, depth and tokenizer)."""
    geometry = "tiny" if p.cpu else "20b"
    return f"gpt-oss-{geometry}-{layers}" + ("-demo-tokenizer" if p.cpu else "") + ("-split-4bit" if split else "")


def setup_items(p: Places, call: int) -> list[Item]:
    """The carried wheels installed, the carried tokenizer unpacked, the machine described (GPU only)."""
    if p.cpu:
        return []
    describe = ("import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', "
                "torch.version.cuda, torch.cuda.get_device_name(0))")  # fmt: skip
    return [
        Item(f"{call}.0", "the carried wheels installed (.gpu-wheels/install.sh)", ["bash", ".gpu-wheels/install.sh",
             ".gpu-wheels"], "install", INSTALL_S),  # fmt: skip
        Item(f"{call}.t", "GPT-OSS's tokenizer unpacked (.gpu-tokenizer.tar.gz)",
             ["tar", "-xzf", ".gpu-tokenizer.tar.gz", "-C", str(p.work)], "setup", 2),
        Item(f"{call}.m", "the machine: versions, GPU, memory, disk",
             ["bash", "-c", f"{PY} -c \"{describe}\"; nvidia-smi --query-gpu=name,memory.total,driver_version "
              f"--format=csv; free -g | head -2; df -h /dev/shm {p.work} | cat; nproc"], "setup", IMPORT_TORCH_S,
             needs=(f"{call}.0",)),
    ]  # fmt: skip


def build_items(p: Places, call: int, depths, split: bool) -> list[Item]:
    """The 20B geometry at each depth, fused (BF16's layout), and split 4-bit (the default's) when asked."""
    items, setup = [], () if p.cpu else (f"{call}.t",)
    for layers in depths:
        fused = f"{call}.b{layers}"
        items.append(Item(fused, f"build the {'tiny' if p.cpu else '20B'} geometry, {layers} layers, random BF16 (fused experts)",
                          gpu_check(p, "--geometry", "tiny" if p.cpu else "20b", "--layers", str(layers), "--layout",
                                    "fused", "--build_only", "--workdir", str(p.big)),
                          "build", IMPORT_TORCH_S + BUILD_FUSED_24_S * size_share(layers), needs=setup))  # fmt: skip
        if split and not p.cpu:
            items.append(Item(f"{call}.s{layers}", f"its split 4-bit copy (the default's layout), {layers} layers",
                              gpu_check(p, "--geometry", "20b", "--layers", str(layers), "--build_only", "--workdir",
                                        str(p.big)),
                              "build", IMPORT_UNSLOTH_S + BUILD_SPLIT_24_S * size_share(layers),
                              needs=(fused, f"{call}.0")))  # fmt: skip
    return items


def built(p: Places, call: int, preset: str, layers: int) -> tuple[str, Path]:
    """(the build item, the model folder) a preset's run at this depth needs."""
    split = PRESETS[preset] == "4-bit" and not p.cpu
    return f"{call}.{'s' if split else 'b'}{layers}", p.big / model_name(p, layers, split)


def grpo_item(p: Places, call: int, n: int, preset: str, layers: int, tokens: int | None, extra: list[str] = (),
              what: str = "") -> Item:  # fmt: skip
    """One GRPO run through `python train_2048.py` (gpu_check), 2 steps with the fast path: the second is timed."""
    id_ = f"{call}.{n}"
    tokens = tokens or int(yaml.safe_load((ROOT / "configs" / f"{preset}.yaml").read_text())["max_completion_length"])
    need, folder = built(p, call, preset, layers)
    work = p.work / f"run-{id_}"  # its own folder (gpu_check writes <workdir>/run), the built models linked in
    fused = p.big / model_name(p, layers)
    links = {(str(work / fused.name), str(fused)), (str(work / folder.name), str(folder))}
    run = ["--fast_generation", "true", *([] if p.cpu else ["--max_completion_length", str(tokens)]), *extra]
    command = gpu_check(p, "--geometry", "tiny" if p.cpu else "20b", "--layers", str(layers), "--preset", preset,
                        "--steps", "2", "--workdir", str(work), "--json", str(p.out / "items" / f"{id_}.json"),
                        run=run)  # fmt: skip
    load = LOAD_24_S[preset] * size_share(layers)
    step = step_s(preset, layers, tokens)
    estimate = IMPORT_TORCH_S + IMPORT_UNSLOTH_S + load + TRAINER_S + compile_s(layers) + 2 * step + SAVE_CHECK_S
    what = what or f"GRPO step, {PRESETS[preset]}, {layers} layers, {16 if p.cpu else tokens} tokens, fast generation"
    return Item(id_, what, command, "grpo", estimate, window_s=step, needs=(need,), run_dir=str(work / "run"),
                json=str(p.out / "items" / f"{id_}.json"), preset=preset, layers=layers,
                tokens=16 if p.cpu else tokens, links=tuple(sorted(links)))  # fmt: skip


def decode_item(p: Places, call: int, n: int, preset: str, layers: int) -> Item:
    """The decode step at batch 8, ours and model.generate, on the model loaded as the preset's run loads it."""
    id_ = f"{call}.{n}"
    need, folder = built(p, call, preset, layers)
    new_tokens, repeats = (8, 2) if p.cpu else (128, 3)
    cpu = ["--cpu"] if p.cpu else []
    run = ["--", *CPU_RUN] if p.cpu else []
    command = [PY, "bench/bench_generation.py", "--model", str(folder), "--preset", preset, "--batch", "8",
               "--new_tokens", str(new_tokens), "--repeats", str(repeats), "--turn", str(p.work / "turns" / id_),
               "--json", str(p.out / "items" / f"{id_}.json"), *cpu, *run]  # fmt: skip
    decode = decode_ms(preset, layers) / 1000
    window = repeats * new_tokens * 2 * decode
    estimate = IMPORT_UNSLOTH_S + LOAD_24_S[preset] * size_share(layers) + TRAINER_S + compile_s(layers) + window * 2
    return Item(id_, f"decode step at batch 8, {PRESETS[preset]}, {layers} layers: ours and model.generate", command,
                "decode", estimate, window_s=window, needs=(need,), json=str(p.out / "items" / f"{id_}.json"),
                turn=str(p.work / "turns" / id_), preset=preset, layers=layers)  # fmt: skip


# what gpu_check --cpu gives train_2048.py, for the decode benchmark's own load on a CPU
CPU_RUN = ["--backend", "transformers", "--load_in_4bit", "false", "--use_cpu", "true", "--bf16", "false", "--dtype",
           "float32", "--offload_embedding", "false", "--gradient_checkpointing", "false"]  # fmt: skip


def call_1(p: Places) -> list[Item]:
    """Whether `python train_2048.py` works and how fast: (a) the default's own path on a tiny model in its own
    layout, (b) the 20B geometry at 2 and 4 layers for the 4-bit default and BF16, extrapolated to 24; (c) the table."""
    default = Item("1.1", "the default on a tiny model in its own layout: Unsloth's loader and get_peft_model, 2 GRPO "
                   "steps with fast generation, the adapters' save and its check",
                   gpu_check(p, "--geometry", "tiny", "--preset", "gpt-oss-20b", "--steps", "2", "--save_method", "lora",
                             "--workdir", str(p.work / "tiny"), "--json", str(p.out / "items/1.1.json"),
                             run=["--fast_generation", "true", *([] if p.cpu else ["--max_completion_length", "256"])],
                             tokenizer=[] if p.cpu else None),  # GPT-OSS's own on a CPU too (built from its cache)
                   "default", TINY_RUN_S, needs=() if p.cpu else ("1.0", "1.t"), run_dir=str(p.work / "tiny" / "run"),
                   json=str(p.out / "items/1.1.json"), preset="gpt-oss-20b")  # fmt: skip
    # Unsloth merges only into 16-bit weights: the merged save is checked where it can run, on the same tiny weights
    # loaded in BF16 (fused experts), and the default's local 4-bit checkpoint must be refused before training.
    merged = Item("1.11", "merged_16bit through Unsloth on the tiny model in BF16: the save and its fresh-process check",
                  gpu_check(p, "--geometry", "tiny", "--preset", "gpt-oss-20b-bf16", "--steps", "2", "--save_method",
                            "merged_16bit", "--workdir", str(p.work / "tiny-bf16"), "--json",
                            str(p.out / "items/1.11.json"),
                            run=["--fast_generation", "true", *([] if p.cpu else ["--max_completion_length", "64"])],
                            tokenizer=[] if p.cpu else None),
                  "merged", MERGED_RUN_S, needs=() if p.cpu else ("1.0", "1.t"),
                  run_dir=str(p.work / "tiny-bf16" / "run"), json=str(p.out / "items/1.11.json"),
                  preset="gpt-oss-20b-bf16")  # fmt: skip
    config = ["--config", "configs/cpu-demo.yaml"] if p.cpu else []
    mxfp4 = Item("1.2", "--save_method mxfp4 refused at startup: one line, exit status 2",
                 [PY, "train_2048.py", *config, "--save_method", "mxfp4", "--output_dir", str(p.work / "mxfp4")],
                 "refusal", IMPORT_UNSLOTH_S + 5, needs=() if p.cpu else ("1.0",), expect="mxfp4" if p.cpu else
                 "llm-compressor")  # fmt: skip
    refused_merge = Item("1.12", "--save_method merged_16bit on the default's local 4-bit checkpoint refused at startup: "
                         "one line, exit status 2", [PY, "train_2048.py", "--model_name_or_path",
                         str(p.work / "tiny" / "gpt-oss-tiny-all-split-4bit"), "--save_method", "merged_16bit",
                         "--output_dir", str(p.work / "merged-refused")], "refusal", IMPORT_UNSLOTH_S + 5,
                         needs=("1.1",), expect="4-bit")  # fmt: skip
    items = [*setup_items(p, 1), default, merged, mxfp4, *([] if p.cpu else [refused_merge]),
             *build_items(p, 1, DEPTHS, split=True)]  # fmt: skip
    n = 3
    for preset in PRESETS:  # the default first: whether it works and how fast matters most
        for layers in DEPTHS:
            items.append(grpo_item(p, 1, n, preset, layers, None))
            n += 1
    for preset in ("gpt-oss-20b-bf16", "gpt-oss-20b"):  # BF16's decode is a target; the 4-bit one says how far off
        for layers in DEPTHS:
            items.append(decode_item(p, 1, n, preset, layers))
            n += 1
    return items


def call_2(p: Places) -> list[Item]:
    """Full depth in BF16 (the 4-bit build alone would fill a call): the decode step and a step at turn 2's budget,
    measured where call 1 extrapolates."""
    return [*setup_items(p, 2), *build_items(p, 2, [FULL_DEPTH], split=False),
            decode_item(p, 2, 1, "gpt-oss-20b-bf16", FULL_DEPTH),
            grpo_item(p, 2, 2, "gpt-oss-20b-bf16", FULL_DEPTH, 200,
                      what="GRPO step, BF16, 24 layers, 200 tokens (turn 2: 19.5 s without the fast path)")]  # fmt: skip


def call_3(p: Places) -> list[Item]:
    """The default at 8 layers: a third depth on call 1's line (24 layers of its split 4-bit copy do not fit a call)."""
    return [*setup_items(p, 3), *build_items(p, 3, [8], split=True), grpo_item(p, 3, 1, "gpt-oss-20b", 8, None),
            decode_item(p, 3, 2, "gpt-oss-20b", 8)]  # fmt: skip


def call_4(p: Places) -> list[Item]:
    """Correctness on the GPU machine: the test suite with the GPU set (in shards, side by side), the saves and their
    checks, evaluate_2048 on a default run's adapter in a fresh process. Nothing here is timed."""
    tests = sorted(str(t.relative_to(ROOT)) for t in (ROOT / "tests").glob("test_*.py"))
    shards = [tests[i::3] for i in range(3)]
    items = [*setup_items(p, 4)]
    for i, shard in enumerate(shards, 1):
        items.append(Item(f"4.{i}", f"the test suite with the GPU set, shard {i} of 3", [PY, "-m", "pytest", "-q",
                          "-p", "no:cacheprovider", *shard], "suite", 200, needs=("4.0",)))  # fmt: skip
    items.append(Item("4.4", "the Unsloth tier with the GPU set", [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                      "tests/unsloth"], "suite", 120, needs=("4.0",), env={"TRAIN2048_UNSLOTH_TIER": "1"}))  # fmt: skip
    tiny = ["--geometry", "tiny", "--steps", "2"]
    saves = [("4.5", "gpt-oss-20b", "lora", [], "default preset (split 4-bit), save lora: the adapter 4.10 evaluates"),
             ("4.6", "gpt-oss-20b-bf16", "merged_16bit", [], "BF16 preset (Unsloth), save merged_16bit"),
             ("4.7", "gpt-oss-20b-bf16", "lora", ["--backend", "transformers"], "--backend transformers, save lora"),
             ("4.8", "gpt-oss-20b-bf16", "merged_16bit", ["--backend", "transformers"],
              "--backend transformers, save merged_16bit")]  # fmt: skip
    for id_, preset, method, extra, what in saves:
        items.append(Item(id_, f"tiny, {what}", gpu_check(p, *tiny, "--preset", preset, "--save_method", method,
                          "--workdir", str(p.work / f"run-{id_}"), "--json", str(p.out / "items" / f"{id_}.json"),
                          run=["--fast_generation", "true", "--max_completion_length", "256", *extra]),
                          "check", 120, needs=("4.0", "4.t"), json=str(p.out / "items" / f"{id_}.json"),
                          run_dir=str(p.work / f"run-{id_}" / "run")))  # fmt: skip
    items.append(Item("4.9", "2 layers of the 20B geometry in BF16, save merged_16bit through Unsloth: its fresh-process "
                      "check at the real widths (the default's local 4-bit checkpoint is refused: 1.12)",
                      gpu_check(p, "--geometry", "20b", "--layers", "2", "--steps", "2", "--preset", "gpt-oss-20b-bf16",
                                "--save_method", "merged_16bit", "--workdir", str(p.work / "run-4.9"), "--json",
                                str(p.out / "items/4.9.json"), run=["--max_completion_length", "64"]),
                      "check", 200, needs=("4.0", "4.t"), json=str(p.out / "items/4.9.json"),
                      run_dir=str(p.work / "run-4.9" / "run")))  # fmt: skip
    items.append(Item("4.10", "evaluate_2048.py --adapter on 4.5's adapter (a LoRA per split expert) in a fresh process",
                      [PY, "evaluate_2048.py", "--adapter", str(p.work / "run-4.5/run/final"), "--model",
                       str(p.work / "run-4.5/gpt-oss-tiny-all"), "--samples", "2", "--games", "2", "--output_dir",
                       str(p.work / "eval-4.10")], "suite", 60, needs=("4.5",)))  # fmt: skip
    return items


def call_5(p: Places) -> list[Item]:
    """The other routes at 2 and 4 layers, extrapolated: BF16 on the transformers backend (transformers + PEFT, the
    issue-14 setting of the decode step) and the default with LoRA on attention only (Unsloth's grouped 4-bit experts)."""
    items = [*setup_items(p, 5), *build_items(p, 5, DEPTHS, split=True)]
    n = 1
    for layers in DEPTHS:
        items.append(grpo_item(p, 5, n, "gpt-oss-20b-bf16", layers, None, ["--backend", "transformers"],
                               f"GRPO step, BF16 on --backend transformers, {layers} layers, 1024 tokens"))  # fmt: skip
        n += 1
    for layers in DEPTHS:
        items.append(grpo_item(p, 5, n, "gpt-oss-20b", layers, None,
                               ["--lora_target_modules", "q_proj", "k_proj", "v_proj", "o_proj"],
                               f"GRPO step, 4-bit, LoRA on attention only, {layers} layers, 1024 tokens"))  # fmt: skip
        n += 1
    return items


CALLS = {1: call_1, 2: call_2, 3: call_3, 4: call_4, 5: call_5}
# Items at once on a GPU: 5, the most 2-4-layer runs of the 20B geometry that share 80 GB; call 1 has a sixth slot for
# its two tiny runs (the default's and BF16's merge: megabytes of GPU memory); call 4's are CPU-bound.
JOBS = {1: 6, 4: 8}


def with_needs(items: list[Item], only: set[str]) -> list[Item]:
    """The items named, and every item they need, in call order."""
    by_id, keep = {i.id: i for i in items}, set()

    def add(id_):
        if id_ in by_id and id_ not in keep:
            keep.add(id_)
            for need in by_id[id_].needs:
                add(need)

    for id_ in only:
        add(id_)
    return [i for i in items if i.id in keep]


# --- the plan: when each item would end, by the estimates ----------------------------------------------------------


def simulate(items: list[Item], jobs: int, budget: float = BUDGET_S) -> dict[str, float]:
    """Each item's end by the estimates, run as `run_call` runs them: at most `jobs` at once, each started once its
    needs have ended, the windows one at a time with everything else stopped. Returns {id: end}; "call": the last."""
    pending, running, ends, now = list(items), {}, {}, 0.0
    windows: list[str] = []  # items waiting for or in their window, in order
    while pending or running:
        for item in list(pending):
            if len(running) < jobs and all(n in ends for n in item.needs if n in {i.id for i in items}):
                pending.remove(item)
                running[item.id] = [item, item.estimate_s - item.window_s, item.window_s]  # untimed left, window left
        if not running:
            raise ValueError(f"items that need what the call does not run: {[i.id for i in pending]}")
        for id_, (_, untimed, window) in running.items():
            if untimed <= 0 and window > 0 and id_ not in windows:
                windows.append(id_)
        owner = windows[0] if windows else None
        if owner is not None:  # the window runs alone: the others wait
            dt = running[owner][2]
            running[owner][2] = 0
            windows.pop(0)
        else:
            dt = min(v[1] for v in running.values())
            for v in running.values():
                v[1] -= dt
        now += dt
        for id_, (_, untimed, window) in list(running.items()):
            if untimed <= 1e-9 and window <= 1e-9:
                ends[id_] = now
                del running[id_]
    ends["call"] = max(ends.values(), default=0.0)
    return ends


# --- running a call ----------------------------------------------------------------------------------------------


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


def run_call(call: int, items: list[Item], p: Places, jobs: int, budget: float, say) -> list[dict]:
    """Run the items (see the module's docstring); returns one record per item, in call order."""
    (p.out / "items").mkdir(parents=True, exist_ok=True)
    (p.out / "logs").mkdir(parents=True, exist_ok=True)
    p.work.mkdir(parents=True, exist_ok=True)
    (p.work / "turns").mkdir(exist_ok=True)
    p.big.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    deadline = started + budget - RESERVE_S
    pending, running, records, owner = list(items), {}, {}, None
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    if p.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""

    def finish(run: Run, status: str | None = None):
        rc = run.proc.returncode
        record = judge(run.item, rc, run.log, p)
        if status:
            record.update(status="FAIL", figure=f"{status}; {record['figure']}")
        if run.interrupted:
            record.update(
                status="FAIL", figure="its timed step was interrupted by another's window; " + record["figure"]
            )
        record.update(seconds=round(time.monotonic() - run.started, 1), estimate_s=round(run.item.estimate_s),
                      window_s=round(run.window[1] - run.window[0], 1) if len(run.window) == 2 else None)  # fmt: skip
        records[run.item.id] = record
        say(f"[{run.item.id}] {record['status']} in {record['seconds']:.0f} s (est {record['estimate_s']}): "
            f"{run.item.what}: {record['figure']}")  # fmt: skip
        for line in record.get("tail", [])[-6:] if record["status"] != "PASS" else []:
            say(f"    {line}")

    while pending or running:
        now = time.monotonic()
        if now > deadline:  # the call's end: stop what still runs, keep what it said
            for run in running.values():
                signal_group(run, signal.SIGCONT)
                signal_group(run, signal.SIGKILL)
                run.proc.wait()
                finish(run, "cut at the call's end")
            running.clear()
            for item in pending:
                records[item.id] = skipped(item, "the call's time was up")
                say(f"[{item.id}] SKIPPED: the call's time was up: {item.what}")
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
            for run in running.values():
                if run.stopped:
                    signal_group(run, signal.SIGCONT)
                    run.stopped = False
            asking = [r for r in running.values() if not r.window and wants_window(r)]
            if asking:  # the earliest started of those asking gets the machine; every other process stops
                owner = asking[0]
                for run in running.values():
                    if run is not owner:
                        if run.item.kind == "grpo" and 1 <= steps_logged(run.item.run_dir) < run.item.steps:
                            run.interrupted = True  # it logged its first step within the same poll: a rare tie
                        signal_group(run, signal.SIGSTOP)
                        run.stopped = True
                owner.window.append(time.monotonic())
                if owner.item.turn:
                    Path(f"{owner.item.turn}.go").touch()
                others = ", ".join(r.item.id for r in running.values() if r.stopped) or "none"
                say(f"[{owner.item.id}] timing alone on the machine (stopped: {others})")
        if owner is None and len(running) < jobs:
            for item in list(pending):
                needs = [n for n in item.needs if n in {i.id for i in items}]
                failed = [n for n in needs if records.get(n, {}).get("status") in ("FAIL", "SKIPPED")]
                if failed:
                    pending.remove(item)
                    records[item.id] = skipped(item, f"needs {', '.join(failed)}, which did not pass")
                    say(f"[{item.id}] SKIPPED: {records[item.id]['figure']}: {item.what}")
                    continue
                if any(n not in records for n in needs):
                    continue
                pending.remove(item)
                left = deadline - time.monotonic()
                if item.estimate_s > left and not p.cpu:
                    records[item.id] = skipped(item, f"~{item.estimate_s:.0f} s does not fit the {left:.0f} s left")
                    say(f"[{item.id}] SKIPPED, ~{item.estimate_s:.0f} s does not fit the {left:.0f} s left: "
                        f"bench/gpu_matrix.py {call} --only {item.id}")  # fmt: skip
                    continue
                log = p.out / "logs" / f"{item.id}.log"
                for stale in (item.json, *(f"{item.turn}{x}" for x in (".ask", ".go", ".done") if item.turn)):
                    if stale:  # an earlier call's on a warm machine would open (or close) its window at once
                        Path(stale).unlink(missing_ok=True)
                if item.run_dir:
                    shutil.rmtree(item.run_dir, ignore_errors=True)
                for link, target in item.links:
                    Path(link).parent.mkdir(parents=True, exist_ok=True)
                    if not Path(link).is_symlink():
                        Path(link).symlink_to(target)
                with open(log, "w") as out:
                    out.write("$ " + " ".join(item.command) + "\n")
                    out.flush()
                    item_env = {**env, **item.env, "UNSLOTH_COMPILE_LOCATION": str(p.work / f"unsloth-{item.id}")}
                    proc = subprocess.Popen(
                        item.command,
                        cwd=ROOT,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=item_env,
                        start_new_session=True,
                    )  # its own process group: stopped as one
                running[item.id] = Run(item, proc, time.monotonic(), log)
                say(f"[{item.id}] start (~{item.estimate_s:.0f} s): {item.what}")
                if len(running) >= jobs:
                    break
        time.sleep(0.02)
    return [records[i.id] for i in items if i.id in records]


def skipped(item: Item, why: str) -> dict:
    return {"id": item.id, "what": item.what, "kind": item.kind, "status": "SKIPPED", "figure": why, "figures": {},
            "command": item.command, "seconds": 0, "estimate_s": round(item.estimate_s)}  # fmt: skip


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


def judge(item: Item, rc: int, log: Path, p: Places) -> dict:
    """PASS or FAIL, one line of figures, and the figures themselves."""
    tail = log.read_text(errors="replace").splitlines()[-40:] if log.exists() else []
    record = {"id": item.id, "what": item.what, "kind": item.kind, "command": item.command, "rc": rc, "tail": tail,
              "preset": item.preset, "layers": item.layers, "tokens": item.tokens, "figures": {}}  # fmt: skip
    result = load_json(item.json) if item.json else None
    problems = [] if rc == 0 else [f"exit status {rc}"]
    figure = ""
    if item.kind == "refusal":  # Unsloth's banner may come first (stdout); the refusal is the last line
        said = [line for line in tail[1:] if line.strip()]
        refused = rc == 2 and said and item.expect in said[-1] and not any("Traceback" in line for line in said)
        problems = [] if refused else [f"exit status {rc}, said {said[-3:]}"]
        figure = said[-1][:200] if said else "nothing said"
    elif item.kind == "install":  # install.sh's own status is its last echo's: its import check says more
        said = [line for line in tail if line.startswith("gpu set:")]
        problems += [] if said else ["the GPU set does not import (no 'gpu set:' line)"]
        figure = said[0] if said else (tail[-1] if tail else "")
    elif item.kind in ("default", "merged", "grpo", "check"):
        metrics = run_metrics(item.run_dir)
        if not result or result.get("failed"):
            problems.append("no results from gpu_check")
        else:
            if len(metrics) != item.steps:
                problems.append(f"{len(metrics)} steps logged of {item.steps}")
            fast = fast_path_problem(result, metrics) if "--fast_generation" in item.command else None
            if fast:
                problems.append(fast)
            if result.get("save_problems") or not result.get("save_checks"):
                problems.append(f"save: {(result.get('save_problems') or ['not verified'])[0][:160]}")
            if item.kind == "default" and not p.cpu:  # on a CPU, gpu_check --cpu picks its own layout and backend
                if "experts split" not in (result.get("experts") or ""):
                    problems.append(f"layout: {result.get('experts')}")
                if result.get("backend") != "unsloth":
                    problems.append(f"backend {result.get('backend')}, not unsloth")
            checks = result.get("save_checks", [])
            if item.kind == "default" and not any("/final:" in c for c in checks):
                problems.append("the adapters' save was not verified")
            if item.kind == "merged" and not any("final-merged_16bit" in c for c in checks):
                problems.append("the merged_16bit save was not verified")
            last = metrics[-1] if metrics else {}
            figures = {k.split("/")[1][:-2]: last.get(k) for k in ("time/step_s", "time/generate_s", "time/rewards_s",
                       "time/logprobs_and_backward_s", "time/optimizer_s")}  # fmt: skip
            figures["peak_memory_gb"] = max((m.get("gpu/peak_memory_gb") or 0 for m in metrics), default=None) or None
            if figures["generate"] and item.tokens:  # every completion runs to the budget (random weights)
                figures["decode_ms_in_step"] = 1000 * figures["generate"] / item.tokens
            record["figures"] = figures
            record["fast_path"] = [m.get("generation/fast_path") for m in metrics]
            f = {k: "-" if v is None else f"{v:.2f}" for k, v in figures.items()}
            figure = (f"step {f['step']} s (generate {f['generate']}, rewards {f['rewards']}, log-probs+backward "
                      f"{f['logprobs_and_backward']}, optimizer {f['optimizer']}), peak {f['peak_memory_gb']} GB, "
                      f"fast_path {record['fast_path']}")  # fmt: skip
            if item.kind != "grpo":
                checks = [c for c in result.get("save_checks", []) if "merged" in c] or result.get("save_checks", [])
                figure += f"; {result.get('experts')}; {checks[-1][:200] if checks else 'no save verified'}"
    elif item.kind == "decode":
        rows = {r["method"]: r for r in (result or {}).get("rows", []) if r["batch"] == 8}
        if set(rows) != {"model.generate", "generation.generate"}:
            problems.append("no decode rows")
        else:
            ours, theirs = rows["generation.generate"], rows["model.generate"]
            if not ours.get("path", "").startswith("fast ("):
                problems.append(f"ours did not take the fast path: {ours.get('path')}")
            record["figures"] = {"decode_ms": ours["decode_ms_per_step"], "decode_ms_generate": theirs["decode_ms_per_step"],
                                 "prefill_ms": ours["prefill_ms"]}  # fmt: skip
            figure = (f"ours {ours['decode_ms_per_step']} ms, model.generate {theirs['decode_ms_per_step']} ms per step "
                      f"(prefill {ours['prefill_ms']} ms), same greedy tokens: {ours.get('same_greedy_tokens')}; "
                      f"{ours.get('path')}")  # fmt: skip
    else:  # setup, build, suite: the command's exit status and its last line
        said = [line for line in tail if line.strip()]
        figure = said[-1][:200] if said else ""
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
            and r["status"] == "PASS" and name in r["figures"] and (tokens is None or r["tokens"] == tokens)}  # fmt: skip


def targets(records: list[dict]) -> tuple[list[str], list[dict]]:
    """The table of the targets against the figures (markdown lines), and each target's row."""
    rows, lines = [], ["| figure | " + " | ".join(f"{d} layers" for d in DEPTHS) + f" | {FULL_DEPTH} layers |",
                       "|---|" + "---:|" * (len(DEPTHS) + 1)]  # fmt: skip

    def measured(label, by_depth, unit):
        if not by_depth:
            return None
        cells = [f"{by_depth[d]:.2f} {unit}" if by_depth.get(d) is not None else "-" for d in DEPTHS]
        at = extrapolate(by_depth)
        how = "measured" if FULL_DEPTH in by_depth else "extrapolated"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {'-' if at is None else f'{at:.2f} {unit}'} ({how}) |")
        return at

    full = {}
    for preset, name in PRESETS.items():
        grpo = [r for r in records if r["kind"] == "grpo" and r["preset"] == preset and r["status"] == "PASS"]
        tokens = max((r["tokens"] for r in grpo), default=None)
        for figure, label, unit in (("step", "GRPO step", "s"), ("generate", "  generate", "s"),
                                    ("rewards", "  rewards", "s"), ("logprobs_and_backward", "  log-probs+backward", "s"),
                                    ("peak_memory_gb", "  peak memory", "GB"),
                                    ("decode_ms_in_step", "  generate / tokens", "ms")):  # fmt: skip
            full[preset, figure] = measured(f"{name}: {label} ({tokens} tokens)" if figure == "step" else
                                            f"{name}: {label}", figures_by_depth(grpo, "grpo", preset, figure, tokens),
                                            unit)  # fmt: skip
        full[preset, "tokens"] = tokens
        for figure, label in (("decode_ms", "decode step at batch 8, ours"),
                              ("decode_ms_generate", "decode step at batch 8, model.generate"),
                              ("prefill_ms", "prefill at batch 8")):  # fmt: skip
            full[preset, figure] = measured(
                f"{name}: {label}", figures_by_depth(records, "decode", preset, figure), "ms"
            )

    def target(what, value, limit, text):
        verdict = "n/a" if value is None else ("PASS" if value <= limit else "FAIL")
        rows.append({"target": what, "figure": text if value is not None else "not measured", "result": verdict})

    bf16, four = "gpt-oss-20b-bf16", "gpt-oss-20b"
    decode = full.get((bf16, "decode_ms"))
    target(
        "BF16 decode step at batch 8 <= 10 ms at 24 layers",
        decode,
        10.0,
        f"{decode:.1f} ms" if decode is not None else "",
    )
    a, b = full.get((four, "step")), full.get((bf16, "step"))
    ratio = a / b if a is not None and b else None
    target(
        "4-bit GRPO step within 1.5x of BF16 at 24 layers",
        ratio,
        1.5,
        f"{a:.1f} / {b:.1f} s = {ratio:.2f}x" if ratio is not None else "",
    )
    served = [
        s for r in records if r["preset"] == four and r["kind"] in ("default", "grpo") for s in r.get("fast_path", [])
    ]
    ran = [r for r in records if r["preset"] == four and r["kind"] in ("default", "grpo") and r["status"] != "SKIPPED"]
    everywhere = bool(served) and all(s == 1.0 for s in served) and all(r.get("fast_path") for r in ran)
    rows.append({"target": "generation/fast_path = 1 on every step of the default",
                 "figure": f"{len(served)} steps of {len(ran)} runs: {served}", "result": "PASS" if everywhere else
                 "FAIL" if served else "n/a"})  # fmt: skip
    for preset, name in PRESETS.items():
        step, tokens = full.get((preset, "step")), full.get((preset, "tokens"))
        decode, prefill = full.get((preset, "decode_ms")), full.get((preset, "prefill_ms"))
        rewards, backward = full.get((preset, "rewards")), full.get((preset, "logprobs_and_backward"))
        if None in (step, tokens, decode, prefill, rewards, backward):
            target(f"{name} GRPO step within 1.3x of generate + score + log-probs/backward", None, 1.3, "")
            continue
        generate = (prefill + decode * (tokens - 1)) / 1000
        parts = generate + rewards + backward
        target(f"{name} GRPO step within 1.3x of generate + score + log-probs/backward", step / parts, 1.3,
               f"{step:.1f} / ({generate:.1f} generate alone + {rewards:.1f} + {backward:.1f}) s = {step / parts:.2f}x "
               f"at 24 layers")  # fmt: skip
    lines += ["", "| target (H100) | figure | result |", "|---|---|---|"]
    lines += [f"| {r['target']} | {r['figure']} | {r['result']} |" for r in rows]
    return lines, rows


# --- the results kept: docs/GPU_MATRIX.md ------------------------------------------------------------------------

RESULTS_HEADER = "| date | machine | commit | item | what | figure | result |"


def recorded(doc: Path = DOC) -> list[dict]:
    """The rows of docs/GPU_MATRIX.md's results table."""
    rows, inside = [], False
    for line in doc.read_text().splitlines() if doc.exists() else []:
        if line.strip() == RESULTS_HEADER:
            inside = True
            continue
        if inside and line.startswith("|---"):
            continue
        if inside and line.startswith("| "):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows.append(dict(zip(("date", "machine", "commit", "item", "what", "figure", "result"), cells)))
        elif inside:
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
        for r in result["items"]:
            if r["kind"] != "setup":  # the install's line stays: it names the versions
                new.append(head + [r["id"], r["what"], cell(r["figure"]), r["status"]])
        for r in result.get("targets", []):
            new.append(head + [f"{result['call']}.c", r["target"], cell(r["figure"]), r["result"]])
    lines[at:at] = ["| " + " | ".join(c) + " |" for c in new]
    doc.write_text("\n".join(lines) + "\n")
    return len(new)


def cell(text: str) -> str:
    return " ".join(str(text).replace("|", "/").split())[:300]


def head_commit() -> str | None:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip() or None  # fmt: skip
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


def device_command(call: int, commit: str | None, only: list[str] | None = None) -> str:
    only_ = f" --only {','.join(only)}" if only else ""
    return (
        f'run(command="python3 bench/gpu_matrix.py {call} --commit {commit or "COMMIT"}{only_}", '
        f'carry=[".gpu-wheels", ".gpu-tokenizer.tar.gz"], timeout_s=480)'
    )


# --- the command line --------------------------------------------------------------------------------------------


def places(out: Path, work: Path, cpu: bool) -> Places:
    return Places(out=out, work=work, big=work / "models" if cpu else big_folder(work), cpu=cpu)


def print_plan(call: int, items: list[Item], jobs: int) -> None:
    ends = simulate(items, jobs)
    print(f"# call {call}: {(CALLS[call].__doc__ or '').split(chr(10))[0]}")
    for item in items:
        window = f", {item.window_s:.0f} s alone" if item.window_s else ""
        needs = f" after {','.join(item.needs)}" if item.needs else ""
        print(f"#   [{item.id} ~{item.estimate_s:.0f} s{window}{needs}, ends ~{ends[item.id]:.0f} s] {item.what}")
        print(" ".join(item.command))
    verdict = "fits" if ends["call"] <= BUDGET_S - RESERVE_S else "does NOT fit"
    print(
        f"# call {call}: ~{ends['call']:.0f} s by the estimates ({jobs} at once), {verdict} {BUDGET_S} s "
        f"({RESERVE_S} s kept for the table)\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("call", nargs="?", type=int, help=f"the call to run: {', '.join(map(str, CALLS))}")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the calls' items, commands and plans; run nothing"
    )
    parser.add_argument("--cpu", action="store_true", help="tiny models on the CPU: the plumbing")
    parser.add_argument("--next", action="store_true", help="the next call to run on this commit")
    parser.add_argument("--record", nargs="+", metavar="RESULTS", help="add callN-results.json files to the table")
    parser.add_argument("--only", help="these items (comma-separated ids) and what they need")
    parser.add_argument("--commit", help="the commit this working tree is (the GPU machine has no git)")
    parser.add_argument("--jobs", type=int, help="items at once (default: 5 on a GPU, 2 on a CPU)")
    parser.add_argument("--budget", type=float, help=f"the call's seconds (default: {BUDGET_S} on a GPU)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/gpu-matrix-out"))
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("WORK") or "/tmp/gpu-matrix"))
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
        print(f"gpu_matrix: {record(results, args.doc, args.commit)} rows added to {args.doc}")
        return 0
    if args.next or (args.dry_run and args.call is None):
        if args.dry_run:
            for call, build in CALLS.items():
                print_plan(call, build(places(args.out, args.work, args.cpu)), jobs_for(call))
        found = next_call(commit, args.doc)
        if found is None:
            print(f"next: nothing; every call has run on {commit}")
        else:
            call, missing, partly = found
            command = device_command(call, commit, missing if partly else None)
            print(f"next: call {call} (not yet run on {commit}: {', '.join(missing)})\n  {command}")
        return 0
    if args.call is None:
        parser.error("name a call (1-5), or --dry-run, --next, --record")
    if args.cpu and args.call != 1 and not args.dry_run:
        parser.error("--cpu runs call 1 (its plumbing is the later calls' too); the others need a GPU")
    p = places(args.out, args.work, args.cpu)
    items = CALLS[args.call](p)
    if args.only:
        names = {x for x in args.only.split(",") if x}
        if not names <= {i.id for i in items}:
            parser.error(f"--only {args.only}: call {args.call} has items {', '.join(i.id for i in items)}")
        items = with_needs(items, names)
    if args.dry_run:
        print_plan(args.call, items, jobs_for(args.call))
        return 0
    budget = args.budget or (3600 if args.cpu else BUDGET_S)
    p.out.mkdir(parents=True, exist_ok=True)
    console = open(p.out / f"call{args.call}.log", "a")

    def say(line: str) -> None:
        stamp = f"{time.monotonic() - t0:6.1f}s "
        print(stamp + line, flush=True)
        console.write(stamp + line + "\n")
        console.flush()

    t0 = time.monotonic()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    say(f"== gpu_matrix call {args.call} ({'cpu' if args.cpu else 'gpu'}), {date}, commit {commit}, budget {budget:.0f} s, "
        f"{jobs_for(args.call)} at once, models in {p.big}")  # fmt: skip
    records = run_call(args.call, items, p, jobs_for(args.call), budget, say)
    lines, rows = targets(records) if args.call == 1 else ([], [])
    machine = machine_name(records, args.cpu)
    result = {"call": args.call, "date": date, "machine": machine, "commit": commit, "seconds": round(time.monotonic() - t0),
              "items": records, "targets": rows}  # fmt: skip
    (p.out / f"call{args.call}-results.json").write_text(json.dumps(result, indent=1) + "\n")
    table = [f"# call {args.call}, {machine}, commit {commit}, {date}", "", "| item | what | result | figure |",
             "|---|---|---|---|", *(f"| {r['id']} | {r['what']} | {r['status']} | {cell(r['figure'])} |" for r in records),
             "", *lines]  # fmt: skip
    (p.out / f"call{args.call}-targets.md").write_text("\n".join(table) + "\n")
    say(f"== call {args.call} done in {time.monotonic() - t0:.0f} s")
    for line in table:
        say(line)
    with tarfile.open(p.out / f"call{args.call}-logs.tar.gz", "w:gz") as tar:
        tar.add(p.out / "logs", arcname="logs")
        for item in items:
            for name in ("training.log", "metrics.jsonl", "console.txt"):
                if item.run_dir and Path(item.run_dir, name).exists():
                    tar.add(Path(item.run_dir, name), arcname=f"runs/{item.id}/{name}")
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
