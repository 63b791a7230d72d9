"""One run of the GPU check: train_2048's real command line on a GPT-OSS model with random weights built here (no
download). The whole check, these runs and more, is one command on a GPU machine: `make gpu-check` (docs/GPU_CHECK.md).

It builds the model (tiny, or GPT-OSS-20B's geometry with all or some of its 24 layers) in the layout the preset loads:
for the 4-bit default, Unsloth's pre-quantized split layout (a Linear per expert, 4-bit, as
unsloth/gpt-oss-20b-unsloth-bnb-4bit stores it: Unsloth loads any unquantized checkpoint with its fused layout instead),
so that the check times what `python train_2048.py` runs; for BF16, transformers' fused layout. It uses GPT-OSS's own tokenizer
(gpt_oss_tokenizer.py, built offline: the prompt has its real length and ids, the vocabulary its 201088 rows; the CPU
demo's 600-token one with `--tokenizer demo`, or when bpe-openai and openai-harmony are not installed and no
`--tokenizer_dir` names a folder `gpt_oss_tokenizer.py --save` wrote), runs `train_2048.py` with a preset for a few
steps, and reports: the median steady step time and its split (generate / reward scoring / log-probs + backward /
optimizer, from the time/* metrics every training log carries), peak GPU memory, GPU utilisation (nvidia-smi, sampled
twice a second), and the save round trip (the verify lines of training.log: LoRA always, merged_16bit or mxfp4 on
request).

    python bench/gpu_check.py                                            # tiny model, default preset: a minute
    python bench/gpu_check.py --geometry 20b --steps 6                   # the 4-bit default at full size
    python bench/gpu_check.py --geometry 20b --preset gpt-oss-20b-bf16   # BF16 (>= 48 GB)
    python bench/gpu_check.py --geometry 20b --layers 4 --save_method merged_16bit   # the save, on less disk
    python bench/gpu_check.py --cpu --steps 2                            # the plumbing, on a CPU (tests use it)
    python bench/gpu_check.py --tokenizer_dir gpt-oss-tokenizer          # a saved tokenizer, on a machine without it
    python bench/gpu_check.py --model unsloth/gpt-oss-20b --steps 10     # the real model (a download)
    python bench/gpu_check.py ... -- --fast_generation true              # anything after -- goes to train_2048.py
    python bench/gpu_check.py --geometry 20b --workdir /tmp/w --build_only      # the model alone, for later runs

Random weights rarely emit EOS, so every completion runs to max_completion_length: the worst case for step time.
They also give every completion the same reward, so training leaves LoRA B at zero and a merged save would merge
nothing: unless --model or --adapters fresh, every LoRA B is drawn at random before training (move_adapters), at a
real run's size (ADAPTER_SHARE), and the merged rows say whether the merge is right and what 16 bits kept of the
adapters (merge_2048.py's line and merge_report.json, in the --json results as "merge"). The split 4-bit layout is built
by the code the tests' Unsloth tier builds its checkpoint with (quantize_split, there on the CPU), and trains through
Unsloth's own loader as there; merged_16bit on it is refused at startup (Unsloth merges into 16-bit weights only).
The full 20B geometry takes 42 GB on disk (--workdir; /dev/shm is fastest, but not beside an integrated GPU such as a DGX
Spark's, whose memory it is) and a merged_16bit save 42 GB more; its split 4-bit copy ~12 GB more, written through a
16-bit split copy in --scratch (default: the workdir), removed after.
Exit status: 0 when the run and every save check passed, 1 otherwise, 2 on bad arguments or without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PARTS = ("generate", "rewards", "logprobs_and_backward", "optimizer")
# The size of the adapters a merged save is checked with: each LoRA changes its weights by this share of a weight's RMS,
# a 300-step run's (Adam moves lora_B's RMS by ~13% of the summed learning rate: ~1e-3 after 300 steps at the presets'
# 5e-5, which at the 20B's widths, r=4 and alpha=8 changes a weight by ~0.2% of its RMS; 50 steps: ~0.03%).
ADAPTER_SHARE = 0.002


def gpt_oss_config(geometry: str, layers: int | None, vocab_size: int):
    """GPT-OSS-20B's geometry (24 layers, hidden 2880, 32 experts top-4, vocab 201088), or a tiny one."""
    from transformers import GptOssConfig

    if geometry == "tiny":
        n = layers or 2
        return GptOssConfig(
            vocab_size=vocab_size, hidden_size=256, intermediate_size=256, num_hidden_layers=n,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"] * (n // 2) + ["sliding_attention"] * (n % 2),
            sliding_window=128, max_position_embeddings=4096,
        )  # fmt: skip
    n = layers or 24
    return GptOssConfig(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=n, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * (n // 2) + ["sliding_attention"] * (n % 2),
        max_position_embeddings=131072, rope_theta=150000.0, swiglu_limit=7.0, attention_bias=True,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 4096},
        router_aux_loss_coef=0.9, tie_word_embeddings=False,
    )  # fmt: skip


def build_tokenizer(kind: str, folder: str | None):
    """(tokenizer, the kind it is): GPT-OSS's own when it can be had offline, else the CPU demo's 600-token one."""
    import demo_data
    import rewards

    if kind == "gpt-oss":
        import gpt_oss_tokenizer

        try:
            return gpt_oss_tokenizer.load(folder), "gpt-oss"
        except ImportError as error:  # building it needs bpe-openai and openai-harmony (requirements-cpu.txt)
            print(f"gpu_check: no GPT-OSS tokenizer here ({error}; --tokenizer_dir takes a saved one): the demo's")
    return demo_data.build_tokenizer([rewards.build_prompt(rewards.RewardSettings())]), "demo"


def build_model(path: Path, geometry: str, layers: int | None, device: str, tokenizer) -> Path:
    """Random weights in BF16, created on `device` (the 20B geometry needs 84 GB in float32 on the host).

    The tiny geometry takes the tokenizer's vocabulary: with GPT-OSS's 201088 rows its embedding and output layer are
    nearly all of its 0.1 B parameters (a --cpu run takes ~35 s instead of ~12 s), but the prompt's ids and the output
    softmax are then the real ones.
    """
    import torch
    from transformers import GptOssForCausalLM

    if (path / "config.json").exists():
        return path
    part = path.with_name(path.name + ".part")  # renamed once whole: a killed build is never taken for a model
    shutil.rmtree(part, ignore_errors=True)
    config = gpt_oss_config(geometry, layers, len(tokenizer))
    config.pad_token_id, config.eos_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id, None
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = GptOssForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(part)
    tokenizer.save_pretrained(part)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(part, path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    print(f"built GPT-OSS ({geometry}, {config.num_hidden_layers} layers): {params / 1e9:.2f} B parameters in {path}")
    return path


def layout_for(preset: dict, cpu: bool, model: str | None) -> str:
    """The layout train_2048.py loads for this preset: "split" for Unsloth's 4-bit default on a GPU, else "fused"."""
    return "split" if preset.get("load_in_4bit") and not cpu and not model else "fused"


def write_split_checkpoint(fused: Path, dest: Path) -> Path:
    """The fused checkpoint in Unsloth's split layout (models.split_experts), 16-bit, one shard at a time: the input of
    quantize_split. A folder renamed once whole."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    import models

    part = dest.with_name(dest.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    shutil.copytree(fused, part, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    weight_map = {}
    for shard in sorted(fused.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            tensors = models.split_experts({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
        save_file(tensors, str(part / shard.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard.name))
        del tensors
    (part / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(part, dest)
    return dest


def quantize_split(split16: Path, dest: Path, device: str = "cuda") -> Path:
    """The split checkpoint quantized to 4-bit with bitsandbytes (NF4, double quantization, BF16 compute, the router
    and output layer left 16-bit) in Unsloth's own expert classes, saved pre-quantized: what Unsloth's loader takes for
    its split 4-bit layout (it reads the tensors' dtypes), as from the hub. In this process, on the GPU, or with
    device "cpu" on the CPU (bitsandbytes >= 0.49 quantizes NF4 there: the tests' Unsloth tier builds its checkpoint so).
    An unquantized split checkpoint is no substitute: Unsloth's loader takes it for the fused layout (every expert
    tensor unexpected, the fused ones missing, so random experts)."""
    import torch
    import unsloth  # noqa: F401  (before transformers' model code runs: its expert classes)
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from unsloth_zoo.temporary_patches.gpt_oss import patch_gpt_oss_bnb4bit, restore_gpt_oss_original

    part = dest.with_name(dest.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    patch_gpt_oss_bnb4bit()
    try:
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=torch.bfloat16,
                                          llm_int8_skip_modules=["router", "lm_head", "embed_tokens"])  # fmt: skip
        model, info = AutoModelForCausalLM.from_pretrained(split16, quantization_config=quantization, dtype=torch.bfloat16,
                                                           device_map={"": 0 if device == "cuda" else device},
                                                           output_loading_info=True)  # fmt: skip
        if info["missing_keys"] or info["unexpected_keys"]:
            raise SystemExit(f"gpu_check: the split checkpoint does not fit Unsloth's classes: {info}")
        model.save_pretrained(part)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
            if (split16 / name).exists():
                shutil.copy(split16 / name, part / name)
    finally:
        restore_gpt_oss_original()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(part, dest)
    return dest


def build_split_4bit(fused: Path, scratch: Path, device: str = "cuda") -> Path:
    """<fused>-split-4bit beside the fused model, built once (reused by later runs with the same --workdir)."""
    dest = fused.with_name(fused.name + "-split-4bit")
    if (dest / "config.json").exists():
        return dest
    started = time.monotonic()
    split16 = write_split_checkpoint(fused, scratch / (fused.name + "-split-16bit"))
    try:
        quantize_split(split16, dest, device)
    finally:
        shutil.rmtree(split16, ignore_errors=True)
    print(f"built the split 4-bit layout (Unsloth's default) in {dest} ({time.monotonic() - started:.0f} s)")
    return dest


def move_adapters(model, seed: int = 0, share: float | None = None) -> int:
    """Every LoRA's B drawn at random (PEFT starts it at zero), so that the adapters change the model: each LoRA's change
    to its weight has an RMS of `share` (default ADAPTER_SHARE) of a weight of the model's initializer_range (random
    weights are drawn so). Fresh adapters, and adapters after steps whose rewards had no spread (random weights: no
    gradient), leave the model as it was, and a merged save then merges nothing. Returns how many LoRA weights were
    drawn."""
    import torch

    std = getattr(model.config, "initializer_range", 0.02)
    generator = torch.Generator().manual_seed(seed)
    drawn = 0
    with torch.no_grad():
        for module in model.modules():
            lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
            if not isinstance(lora_a, torch.nn.ModuleDict) or not isinstance(lora_b, torch.nn.ModuleDict):
                continue
            for name in lora_b:
                b = lora_b[name].weight
                b.copy_(draw_lora_b(lora_a[name].weight, b.shape, module.r[name], module.scaling[name],
                                    (ADAPTER_SHARE if share is None else share) * std, generator))  # fmt: skip
                drawn += 1
    return drawn


def draw_lora_b(a, shape, rank: int, scaling: float, rms: float, generator):
    """A random LoRA B for this A such that scaling * B @ A changes each weight by `rms` (root mean square). Element
    (j, k) of B A sums rank products B_ji A_ik (per expert, for the experts' stacked pairs), so its variance is
    rank * var(B) * mean(A^2): B's deviation follows from A's mean squared row length."""
    import torch

    rows = float(a.float().pow(2).sum(1).mean())  # |A_i|^2 = in * mean(A^2)
    sigma = rms * (a.shape[1] / (rank * rows)) ** 0.5 / scaling
    return torch.randn(tuple(shape), generator=generator) * sigma


@contextlib.contextmanager
def adapters_moved(share: float | None = None):
    """models.load_model, for as long as this lasts, with move_adapters applied to each policy it loads to train."""
    import models

    load = models.load_model

    def load_moved(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        if kwargs.get("trainable"):
            print(f"gpu_check: drew B of {move_adapters(model, share=share)} LoRA weights (move_adapters)", flush=True)
        return model, tokenizer

    models.load_model = load_moved
    try:
        yield
    finally:
        models.load_model = load


def train_with_moved_adapters(argv: list[str]) -> int:
    """train_2048.py's main with moved adapters (adapters_moved): the GPU check's training run."""
    import train_2048

    with adapters_moved():
        return train_2048.main(argv)


def prompt_tokens(tokenizer) -> int:
    import rewards

    chat = [{"role": "user", "content": rewards.build_prompt(rewards.RewardSettings())}]
    return len(tokenizer.apply_chat_template(chat, add_generation_prompt=True, reasoning_effort="low",
                                             return_dict=True)["input_ids"])  # fmt: skip


class GPUSampler:
    """nvidia-smi's utilisation and memory, twice a second, in the background. On an integrated GPU (a DGX Spark's
    GB10) nvidia-smi says N/A for memory: the utilisation is kept, and torch's own peak (peak_memory_gb) is the figure."""

    def __init__(self):
        self.samples: list[tuple[float, float | None]] = []
        self.proc = None
        if shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"]
            self.proc = subprocess.Popen([*query, "-lms", "500", "-i", "0"], stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        for line in self.proc.stdout:
            util, _, memory = line.partition(",")
            try:
                self.samples.append((float(util), None if "N/A" in memory else float(memory)))
            except ValueError:
                continue

    def stop(self) -> dict:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
        if not self.samples:
            return {}
        utils, memory = [u for u, _ in self.samples], [m for _, m in self.samples if m is not None]
        return {"gpu_util_median": statistics.median(utils), "gpu_util_mean": statistics.fmean(utils),
                "gpu_memory_max_mib": max(memory) if memory else None}  # fmt: skip


def summarise(out: Path, skip: int) -> dict:
    """Medians of the steady training steps (the first `skip` are warm-up), and the save checks of training.log."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "time/step_s" in m]
    steady = steps[skip:] or steps
    result = {"steps": len(steps), "steady_steps": len(steady)}
    for key in ["time/step_s", *(f"time/{p}_s" for p in PARTS)]:
        values = [m[key] for m in steady if key in m]
        result[key] = statistics.median(values) if values else None
    served = [m["generation/fast_path"] for m in steps if "generation/fast_path" in m]
    result["fast_path_share"] = statistics.fmean(served) if served else None  # 1.0: every step, the fast path
    compiled = [m["generation/compiled"] for m in steps if "generation/compiled" in m]
    result["compiled_share"] = statistics.fmean(compiled) if compiled else None  # 1.0: its decode steps compiled
    memory = [m["gpu/peak_memory_gb"] for m in steps if "gpu/peak_memory_gb" in m]
    result["peak_memory_gb"] = max(memory) if memory else None
    result["reward_mean"] = statistics.fmean(m["reward"] for m in steps) if steps else None
    # The learning signal a step carries: the spread of rewards within its groups, zero for a group whose
    # completions all scored the same. Per second of steady step time, it compares group sizes. It needs a model
    # that writes strategies (random weights never do: 0 then).
    signal = [m.get("reward_std", 0.0) * (1 - m.get("frac_reward_zero_std", 0.0)) for m in steady]
    result["signal_per_s"] = statistics.fmean(signal) / result["time/step_s"] if result["time/step_s"] else None
    log = (out / "training.log").read_text() if (out / "training.log").exists() else ""
    result["save_checks"] = [line.split(" ", 3)[-1] for line in log.splitlines() if "verified " in line]
    # A correct merge whose 16-bit weights keep little of the adapters says so on a WARNING line that starts with
    # "verified": what 16 bits keep is measured, not a problem.
    result["save_problems"] = [line.split(" ", 3)[-1] for line in log.splitlines() if " ERROR " in line
                               or ("WARNING" in line and "final" in line and "verified " not in line)]  # fmt: skip
    report = out / "final-merged_16bit" / "merge_report.json"
    result["merge"] = json.loads(report.read_text()) if report.exists() else None  # merge_2048's figures
    # Which generation path the run took: the fast one, or model.generate and why (issue 21 asks for the former on
    # Unsloth's models, so a silent fallback must show here).
    said = [line.split(" ", 3)[-1] for line in log.splitlines() if "generation: " in line or "fast generation" in line]
    result["generation"] = list(dict.fromkeys(said))[:4]
    experts = [line.split("model: ", 1)[1] for line in log.splitlines() if " model: " in line]
    result["experts"] = experts[0] if experts else None  # the layout trained, and its LoRA (models.describe_experts)
    backend = [line.split(" backend, writing to ")[0].rsplit(" ", 1)[-1] for line in log.splitlines()
               if " backend, writing to " in line]  # fmt: skip
    result["backend"] = backend[0] if backend else None
    return result


def option(command: list[str], name: str, default):
    """What train_2048.py gets for --name: the last value on its command line, else `default` (the preset's)."""
    values = [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == f"--{name}"]
    return values[-1] if values else default


def table(result: dict) -> str:
    def cell(x, fmt="{:.2f}"):
        return "–" if x is None else fmt.format(x)

    rows = [("whole step (median, s)", cell(result["time/step_s"]))]
    rows += [(f"  {p.replace('_', ' ')} (s)", cell(result[f"time/{p}_s"])) for p in PARTS]
    rows += [("peak GPU memory, torch (GB)", cell(result["peak_memory_gb"], "{:.1f}"))]
    rows += [("learning signal per second (reward spread / s)", cell(result["signal_per_s"], "{:.3f}"))]
    if "gpu_util_median" in result:
        rows += [
            ("GPU utilisation, median / mean (%)", f"{result['gpu_util_median']:.0f} / {result['gpu_util_mean']:.0f}")
        ]
    rows += [
        ("steps (steady)", f"{result['steps']} ({result['steady_steps']})"),
        ("wall (s)", f"{result['wall_s']:.0f}"),
    ]
    return "\n".join(["| measure | value |", "|---|---:|", *(f"| {a} | {b} |" for a, b in rows)])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", choices=("tiny", "20b"), default="tiny")
    parser.add_argument("--layers", type=int, help="decoder layers (default: 2 tiny, 24 for 20b)")
    parser.add_argument("--preset", default="gpt-oss-20b", help="a configs/*.yaml name")
    parser.add_argument("--model", help="a real checkpoint (path or hub id) instead of building random weights")
    parser.add_argument("--steps", type=int, default=5, help="training steps; the first is warm-up")
    parser.add_argument("--save_method", choices=("lora", "merged_16bit", "mxfp4"), default="lora")
    parser.add_argument("--workdir", help="where the model and the run go (default: a temporary folder, removed)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--cpu", action="store_true", help="the plumbing only: tiny model, transformers backend")
    parser.add_argument("--tokenizer", choices=("gpt-oss", "demo"), default="gpt-oss",
                        help="the built model's tokenizer: GPT-OSS's own (offline), or the CPU demo's")  # fmt: skip
    parser.add_argument("--tokenizer_dir", help="GPT-OSS's tokenizer from this folder (gpt_oss_tokenizer.py --save)")
    parser.add_argument("--layout", choices=("auto", "fused", "split"), default="auto",
                        help="the experts' layout built: auto is the preset's (split 4-bit for the default on a GPU)")  # fmt: skip
    parser.add_argument("--scratch", help="where the 16-bit split copy is written on the way to 4-bit (default: --workdir)")
    parser.add_argument("--adapters", choices=("auto", "moved", "fresh"), default="auto",
                        help="moved: every LoRA B drawn at random before training (move_adapters, at a real run's "
                        "size), so that a merged save has something to merge; fresh: PEFT's zero B; auto: moved unless "
                        "--model")  # fmt: skip
    parser.add_argument("--build_only", action="store_true",
                        help="build the model in --workdir and stop: later runs with that --workdir reuse it")  # fmt: skip
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is warm-up)")
    if args.tokenizer_dir and args.tokenizer != "gpt-oss":
        parser.error("--tokenizer_dir is GPT-OSS's tokenizer: it goes with --tokenizer gpt-oss")
    if args.tokenizer_dir and not (Path(args.tokenizer_dir) / "tokenizer.json").exists():
        parser.error(f"--tokenizer_dir {args.tokenizer_dir}: no tokenizer.json there")
    if args.build_only and (args.model or not args.workdir):
        parser.error("--build_only builds random weights into --workdir: it needs --workdir and no --model")
    import torch
    import yaml

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; --cpu checks the plumbing on a CPU", file=sys.stderr)
        return 2
    preset = ROOT / "configs" / f"{args.preset}.yaml"
    if not preset.exists():
        parser.error(f"--preset {args.preset}: no {preset}")

    layout = args.layout if args.layout != "auto" else layout_for(yaml.safe_load(preset.read_text()), args.cpu, args.model)
    if layout == "split" and (args.cpu or args.model):
        parser.error("--layout split is built from random weights and quantized on the GPU: not with --cpu or --model")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        tokenizer_kind = None
        if not args.model:
            tokenizer, tokenizer_kind = build_tokenizer(args.tokenizer, args.tokenizer_dir)
            name = f"gpt-oss-{args.geometry}-{args.layers or 'all'}"
            name += "-demo-tokenizer" if tokenizer_kind == "demo" else ""
            print(f"tokenizer: {tokenizer_kind}, {len(tokenizer)} tokens; the default prompt is "
                  f"{prompt_tokens(tokenizer)} tokens at low reasoning effort")  # fmt: skip
        started = time.monotonic()
        model = args.model or build_model(work / name, args.geometry, args.layers, "cpu" if args.cpu else "cuda",
                                          tokenizer)  # fmt: skip
        if layout == "split":
            model = build_split_4bit(Path(model), Path(args.scratch) if args.scratch else work)
        if args.build_only:
            print(f"gpu_check: the model is in {model} ({time.monotonic() - started:.0f} s)")
            return 0
        out = work / "run"
        shutil.rmtree(out, ignore_errors=True)
        command = [sys.executable, str(ROOT / "train_2048.py"), "--config", str(preset), "--model_name_or_path",
                   str(model), "--output_dir", str(out), "--max_steps", str(args.steps), "--save_steps", "100000",
                   "--logging_steps", "1", "--save_method", args.save_method, "--eval_strategy", "no"]  # fmt: skip
        if args.cpu:
            command += ["--use_cpu", "true", "--bf16", "false", "--backend", "transformers", "--load_in_4bit", "false",
                        "--optim", "adamw_torch", "--max_completion_length", "16", "--offload_embedding", "false",
                        "--gradient_checkpointing", "false", "--cpu_threads", "1", "--dtype", "float32"]  # fmt: skip
        command += passthrough
        moved = args.adapters == "moved" or (args.adapters == "auto" and not args.model)
        launch = [sys.executable, str(Path(__file__).resolve()), "train-moved", *command[2:]] if moved else command
        print("$ " + " ".join(launch), flush=True)
        sampler = GPUSampler() if not args.cpu else None
        started = time.monotonic()
        out.mkdir(parents=True)
        with open(out / "console.txt", "w") as console:  # the child's output as it comes: a run cut off shows where
            run = subprocess.run(launch, cwd=ROOT, stdout=console, stderr=subprocess.STDOUT)
        wall = time.monotonic() - started
        gpu = sampler.stop() if sampler else {}
        said = (out / "console.txt").read_text(errors="replace")
        if run.returncode != 0 or not (out / "metrics.jsonl").exists():
            print(said[-8000:])
            print(f"gpu_check: train_2048.py failed with exit status {run.returncode}", file=sys.stderr)
            if args.json:  # a failed run still leaves a record for whoever collects the results
                Path(args.json).write_text(json.dumps({"failed": True, "returncode": run.returncode, "command": command,
                                                       "console_tail": said[-3000:]}, indent=1))  # fmt: skip
            return 1
        result = {**summarise(out, skip=1), **gpu, "wall_s": wall, "command": command}
        defaults = yaml.safe_load(preset.read_text())
        result.update(max_completion_length=int(option(command, "max_completion_length",
                                                       defaults.get("max_completion_length"))),
                      fast_generation=str(option(command, "fast_generation", False)).lower() == "true",
                      save_method=args.save_method, adapters="moved" if moved else "fresh")  # fmt: skip
        result.update(geometry=args.geometry, layers=args.layers, preset=args.preset, tokenizer=tokenizer_kind, layout=layout,
                      device=torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.cpu else "cpu",
                      versions=versions())  # fmt: skip
        print(table(result))
        for line in result["save_checks"]:
            print("save:", line)
        for line in result["save_problems"]:
            print("save problem:", line)
        for line in result["generation"]:
            print(line)
        print(f"model: {result['experts']}")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        return 0 if not result["save_problems"] and result["save_checks"] else 1
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


def versions() -> dict:
    import importlib.metadata as metadata

    found = {}
    for name in ("torch", "transformers", "trl", "peft", "unsloth", "unsloth_zoo", "bitsandbytes", "accelerate"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


if __name__ == "__main__":
    sys.exit(train_with_moved_adapters(sys.argv[2:]) if sys.argv[1:2] == ["train-moved"] else main())
