"""Train a model with GRPO to write Python 2048 strategies: GPT-OSS-20B on a CUDA GPU, or a tiny model on a CPU.

    python train_2048.py                                   # configs/gpt-oss-20b.yaml: Unsloth on one CUDA GPU
    python train_2048.py --config configs/cpu-demo.yaml    # a tiny local model on the CPU, a few minutes
    python train_2048.py --config configs/notebook.yaml    # the public notebook's run, reproduced
    python train_2048.py --max_steps 300 --resume auto     # any option as a flag; continue the last run
    accelerate launch --config_file configs/accelerate/cpu-2proc.yaml train_2048.py --config configs/cpu-demo.yaml
                                                           # the same demo as 2 processes (gloo, CPU only)

Every option is a flag (`--max_steps` or `--max-steps`) and a YAML key; flags override the YAML file.
--help lists TRL's GRPOConfig and ModelConfig options first, then train_2048's own and the game's.

TRL runs the GRPO loop and transformers writes the checkpoints; this file loads the model, wires in the
sandboxed rewards, reports, evaluates every --eval_steps, handles Ctrl-C and saves the result. In <output_dir>:
training.log, metrics.jsonl, runs/ (TensorBoard), checkpoint-N/, final/ (LoRA adapters), final-<save_method>/
(merged).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

import demo_data
import rewards
import sandbox

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "configs" / "gpt-oss-20b.yaml"
TINY = "tiny"  # model_name_or_path that builds the CPU demo's model in <output_dir>/tiny-model
EVAL_SEED = 0  # --eval_steps: the sampling seed and the first game seed, in every run (training's games are hashed)
EVAL_STEPS_HELP = (
    "train_2048: every N steps, sample --eval_samples strategies from the current policy with the training prompt "
    "and a fixed seed, play each on --eval_games fixed games (the same every time) in the sandbox, and log "
    "eval/valid_rate, eval/cheat_rate, eval/win_rate, eval/max_tile_log2 and eval/mean_score to TensorBoard "
    "(evaluate_2048.py's protocol). None or 0: off; below 1: that fraction of max_steps."
)
REAL_GPT_OSS = re.compile(r"gpt-oss-(20|120)b", re.I)  # checkpoints no CPU can train
log = logging.getLogger("train_2048")


# --- configuration ------------------------------------------------------------------------------------------


@dataclass
class ScriptArguments:
    """train_2048's own options (TRL's GRPOConfig and ModelConfig bring the rest)."""

    _argument_group_name = "train_2048"  # a --help section of its own

    backend: Literal["auto", "unsloth", "transformers"] = field(
        default="auto",
        metadata={
            "help": "unsloth: Unsloth's FastLanguageModel (one CUDA GPU). transformers: transformers + PEFT "
            "(CPU, multi-GPU). auto: unsloth when it is installed and one CUDA GPU is used, else transformers."
        },
    )
    max_seq_length: int = field(default=768, metadata={"help": "Longest prompt + completion (Unsloth)."})
    offload_embedding: bool = field(
        default=False, metadata={"help": "Keep the embedding matrix in CPU memory (Unsloth, saves ~1 GB)."}
    )
    dataset_size: int = field(default=1000, metadata={"help": "Rows of the prompt dataset (the same prompt)."})
    warm_start: bool = field(
        default=False,
        metadata={"help": "Before GRPO, fine-tune (SFT) on the example answers of demo_data.py. Skipped on resume."},
    )
    sft_epochs: float = field(default=3.0, metadata={"help": "Epochs of the warm start over the example answers."})
    sft_learning_rate: float = field(default=2e-4, metadata={"help": "Learning rate of the warm start."})
    resume: str | None = field(
        default=None,
        metadata={"help": "'auto': continue from the latest complete checkpoint in output_dir, if any; or a path."},
    )
    save_method: Literal["lora", "merged_16bit", "mxfp4"] = field(
        default="lora",
        metadata={
            "help": "At the end, LoRA adapters always go to <output_dir>/final; merged_16bit and mxfp4 also write "
            "<output_dir>/final-<method> (mxfp4: Unsloth on a GPU only)."
        },
    )
    verify_save: bool = field(
        default=True,
        metadata={"help": "Reload what was saved and check that it generates what the trained model does."},
    )
    cpu_threads: int = field(
        default=0,
        metadata={
            "help": "torch threads on the CPU (0: torch's default). A tiny model is fastest on 1, and "
            "multi-threaded torch slows down badly on a machine shared with other jobs."
        },
    )
    sample_steps: int = field(
        default=10, metadata={"help": "Every N steps, write sample completions and their rewards to TensorBoard."}
    )
    num_samples: int = field(default=4, metadata={"help": "Completions per TensorBoard sample."})
    eval_samples: int = field(
        default=4,
        metadata={"help": "--eval_steps: strategies sampled from the current policy (training prompt, seed 0)."},
    )
    eval_games: int = field(
        default=4,
        metadata={"help": "--eval_steps: games each sampled strategy plays on the training board (seeds 0, 1, ...)."},
    )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the usage examples as written and shows every default."""


# --- helpers ------------------------------------------------------------------------------------------------


def die(message: str) -> None:
    """A setup error: one line, exit status 2, no traceback."""
    print(f"train_2048: {message}", file=sys.stderr)
    raise SystemExit(2)


def read_config(argv: list[str]) -> dict:
    """The --config YAML file as a dict; it is read before the full parse to choose the backend."""
    path = argv[argv.index("--config") + 1] if argv.index("--config") + 1 < len(argv) else None
    if path is None:
        die("--config needs a YAML file")
    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        die(f"cannot read config {path}: {' '.join(str(exc).split())}")
    if config is None:
        return {}
    if not isinstance(config, dict):
        die(f"config {path} must be a YAML mapping of option: value")
    return config


def early_option(argv: list[str], config: dict, name: str):
    """An option's value before the full parse, which has to wait until Unsloth is imported (or not)."""
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in spellings:
            if eq:
                return value
            following = argv[i + 1] if i + 1 < len(argv) else ""
            return following if following and not following.startswith("-") else "true"
    return config.get(name)


def truthy(value) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes", "y", "t")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def prepare_cuda() -> None:
    """DGX Spark (GB10, compute capability 12.1) needs a ptxas that knows sm_121a; Triton's bundled one may not."""
    import torch

    if torch.cuda.get_device_capability() != (12, 1):
        return
    ptxas = "/usr/local/cuda/bin/ptxas"
    if "TRITON_PTXAS_PATH" not in os.environ and os.path.exists(ptxas):
        os.environ["TRITON_PTXAS_PATH"] = ptxas
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "12.1a")
    if importlib.util.find_spec("flash_attn") is not None:
        log.warning(
            "flash-attn is installed: it has no GB10 (sm_121) build and breaks xformers; pip uninstall flash-attn"
        )


def complete_checkpoint(path: Path) -> bool:
    """transformers writes checkpoint-N in place (no temporary folder), trainer_state.json last: a checkpoint
    is complete when that file parses and, for checkpoint-N, names step N."""
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    match = re.fullmatch(r"checkpoint-(\d+)", path.name)
    return not match or state.get("global_step") == int(match.group(1))


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step; a half-written one (Ctrl-C, crash, full disk) is skipped."""
    found = [(int(p.name.split("-")[1]), p) for p in output_dir.glob("checkpoint-*") if p.name[11:].isdigit()]
    return next((p for _, p in sorted(found, reverse=True) if complete_checkpoint(p)), None)


def writable(path: Path) -> bool:
    """True when `path` is, or can be created as, a writable directory; creates nothing."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)


def fresh(path: Path) -> Path:
    """An empty temporary sibling of `path` to write into; publish() moves it into place when complete."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def publish(tmp: Path, path: Path) -> None:
    """Swap a fully written folder in for `path`, so `path` is never half-written."""
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


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
        return path
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
        vocab_size=600,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<|pad|>", eos_token="<|end|>", chat_template=CHAT_TEMPLATE
    )
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

    tmp = fresh(path)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    publish(tmp, path)
    return path


def load_model(path: str, backend: str, script_args, model_args, training_args, adapter=None, train=True):
    """(model, tokenizer): to train (with fresh LoRA adapters when use_peft), or a saved model to check:
    the base with the adapters saved in `adapter`, or a merged one."""
    if backend == "unsloth":
        from unsloth import FastLanguageModel

        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name=adapter or path,  # an adapter folder names its base model; Unsloth loads both
            max_seq_length=script_args.max_seq_length,
            load_in_4bit=model_args.load_in_4bit,
            offload_embedding=script_args.offload_embedding,
            full_finetuning=train and not model_args.use_peft,
        )
        if train and model_args.use_peft:
            model = FastLanguageModel.get_peft_model(
                model,
                r=model_args.lora_r,
                lora_alpha=model_args.lora_alpha,
                lora_dropout=model_args.lora_dropout,
                target_modules=model_args.lora_target_modules,
                use_gradient_checkpointing="unsloth" if training_args.gradient_checkpointing else False,
                random_state=training_args.seed,
            )
        return model, tokenizer

    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import get_peft_config, get_quantization_config

    quantization = get_quantization_config(model_args)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        revision=model_args.model_revision,
        dtype=model_args.dtype or "auto",
        attn_implementation=model_args.attn_implementation,
        quantization_config=quantization,
        device_map={"": int(os.environ.get("LOCAL_RANK", 0))} if quantization else None,  # bitsandbytes: this GPU
        trust_remote_code=training_args.trust_remote_code,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        path, revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code
    )
    if adapter is not None:
        return PeftModel.from_pretrained(model, adapter), tokenizer
    if not (train and model_args.use_peft):
        return model, tokenizer
    peft_config = get_peft_config(model_args)
    fused = {"gate_proj", "up_proj", "down_proj"}
    if (
        model.config.model_type == "gpt_oss"
        and not peft_config.target_parameters
        and fused & set(peft_config.target_modules or ())
    ):
        # transformers fuses each layer's experts into two tensors, not Linear layers: LoRA reaches them by name
        peft_config.target_modules = set(peft_config.target_modules) - fused
        peft_config.target_parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        if peft_config.lora_dropout:
            log.warning("LoRA on GPT-OSS's fused experts cannot use dropout: lora_dropout set to 0")
            peft_config.lora_dropout = 0.0
    return get_peft_model(model, peft_config), tokenizer


def keep_scores(func, latest: dict):
    """`func` as a TRL reward that also keeps its last scores (and the completions) for the TensorBoard samples."""

    @functools.wraps(func)
    def reward(completions, **kwargs):
        scores = func(completions, **kwargs)
        latest["completions"], latest[func.__name__] = completions, scores
        return scores

    return reward


def sample_tokens(model, tokenizer, prompt: str, chat_kwargs: dict, seed: int, max_new_tokens: int) -> list[list[int]]:
    """Four seeded sampled completions' token ids: the check that a saved model is the trained one."""
    import torch

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
        **chat_kwargs,
    ).to(model.device)
    model.eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            **inputs,
            do_sample=True,
            num_return_sequences=4,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    return out[:, inputs["input_ids"].shape[1] :].tolist()


def evaluate_policy(
    model, tokenizer, settings, *, samples, games, temperature, max_new_tokens, batch_size, reasoning_effort
) -> dict[str, float]:
    """evaluate_2048.py's protocol on the model being trained, for --eval_steps: `samples` strategies sampled from
    the training prompt with seed EVAL_SEED, each judged like the rewards judge an answer and, when it is one clean
    function, played on the training board on the games with seeds EVAL_SEED, EVAL_SEED + 1, ... in the sandbox.
    The same weights give the same numbers in any run. valid_rate and cheat_rate are shares of the samples;
    win_rate and mean_score are over every (sample, game) pair, a strategy not played counting as a game with
    nothing (as in evaluate_2048's table); max_tile_log2 is the mean log2 of the largest tile over the games
    played, like train/game/max_tile_log2 (0 when none was). The model is left in the mode it was in and torch's
    random state as it was, so a run with evaluations trains exactly like one without."""
    import torch

    import evaluate_2048

    args = argparse.Namespace(
        samples=samples,
        seed=EVAL_SEED,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        reasoning_effort=reasoning_effort,
    )
    progress = evaluate_2048.NoProgress()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    was_training = model.training
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else []):
        model.eval()
        try:
            completions = evaluate_2048.sample_completions(model, tokenizer, args, settings, progress, "eval")
        finally:
            model.train(was_training)
    source = evaluate_2048.model_source("model", completions)
    seeds = [EVAL_SEED + i for i in range(games)]
    played = evaluate_2048.play_sources([source], seeds, settings, progress)
    games_by_sample = [played[0, j] for j in range(len(source.samples))]
    summary = evaluate_2048.summarise(source, games_by_sample)
    played_games = [g for games in games_by_sample for g in games if g.status != evaluate_2048.NOT_PLAYED]
    return {
        "valid_rate": summary["valid_rate"],
        "cheat_rate": summary["cheat_rate"],
        "win_rate": summary["win_rate"],
        "max_tile_log2": sum(math.log2(max(g.max_tile, 1)) for g in played_games) / max(len(played_games), 1),
        "mean_score": summary["mean_score"],
    }


# --- reporting ----------------------------------------------------------------------------------------------


SHORT_LINE = [  # (metric, how it is shown); TRL's metrics, then the games' from rewards.py
    ("reward", "reward {:.2f}"),
    ("reward_std", "±{:.2f}"),
    ("rewards/function_works/mean", "works {:.2f}"),
    ("rewards/no_cheating/mean", "clean {:.2f}"),
    ("rewards/strategy_succeeds/mean", "game {:.2f}"),
    ("game/win_rate", "win {:.0%}"),
    ("game/max_tile_log2", "tile 2^{:.1f}"),
    ("completions/mean_length", "len {:.0f}"),
    ("completions/clipped_ratio", "clipped {:.0%}"),
    ("kl", "kl {:.4f}"),
    ("learning_rate", "lr {:.1e}"),
]


def short_line(step: int, max_steps: int, logs: dict) -> str:
    """One console line per logging step: the numbers that say whether the run is healthy."""
    shown = [template.format(logs[key]) for key, template in SHORT_LINE if isinstance(logs.get(key), int | float)]
    return "  ".join([f"step {step}/{max_steps}", *shown])


EVAL_LINE = [  # (metric as the Trainer logs it, how it is shown)
    ("eval_valid_rate", "valid {:.0%}"),
    ("eval_cheat_rate", "cheating {:.0%}"),
    ("eval_win_rate", "win {:.0%}"),
    ("eval_max_tile_log2", "tile 2^{:.1f}"),
    ("eval_mean_score", "score {:.0f}"),
    ("eval_seconds", "({:.1f} s)"),
]


def eval_line(step: int, logs: dict) -> str:
    """The console line of one --eval_steps evaluation."""
    shown = [template.format(logs[key]) for key, template in EVAL_LINE if isinstance(logs.get(key), int | float)]
    return "  ".join([f"eval at step {step}:", *shown])


def sample_markdown(latest: dict, count: int) -> str:
    """A few completions with their rewards, as TensorBoard markdown (code indented, as answers contain ```)."""
    names = [n for n in latest if n != "completions"]
    blocks = []
    for i, completion in enumerate(latest["completions"][:count]):
        scores = {n: latest[n][i] for n in names}
        total = sum(s for s in scores.values() if s is not None)
        detail = ", ".join(f"{n} {s:.2f}" for n, s in scores.items() if s is not None)
        code = "\n".join("    " + line for line in rewards.completion_text(completion).splitlines())
        blocks.append(f"**total {total:.2f}** ({detail})\n\n{code}")
    return "\n\n---\n\n".join(blocks)


def GameSalt(salt: str):
    """A callback that only carries the salt into every checkpoint's trainer_state.json (transformers saves the
    state of ExportableState callbacks there), so --resume replays the same games."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState

    class GameSalt(TrainerCallback, ExportableState):
        def __init__(self, salt: str):
            self.salt = salt

        def state(self) -> dict:
            return {"args": {"salt": self.salt}, "attributes": {}}

    return GameSalt(salt)


def make_callbacks(output_dir: Path, script_args, latest: dict, evaluate=None):
    """TrainerCallbacks for what TRL does not do: short console lines, training.log, metrics.jsonl,
    warnings, sample completions in TensorBoard, a checkpoint on Ctrl-C, and the --eval_steps evaluation
    (`evaluate(model)`: evaluate_policy with this run's settings)."""
    from transformers import ProgressCallback, Trainer, TrainerCallback

    class ProgressBar(ProgressCallback):
        """The Trainer's bar without its dump of every metric at each log; Report prints a short line."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            pass

    class Report(TrainerCallback):
        def __init__(self):
            self.tensorboard = None  # transformers' TensorBoardCallback, whose writer the samples share

        def on_log(self, args, state, control, logs=None, **kwargs):
            from tqdm.auto import tqdm

            if not state.is_world_process_zero or not logs:
                return
            if "eval_valid_rate" in logs:  # Evaluate's numbers
                line = eval_line(state.global_step, logs)
                tqdm.write(line)
                log.debug(line)
                with open(output_dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps({"step": state.global_step, **logs}) + "\n")
                return
            if "reward" not in logs:  # the warm start's SFT
                if "loss" in logs:
                    accuracy = logs.get("mean_token_accuracy", float("nan"))
                    line = f"warm start  epoch {logs.get('epoch', 0):.1f}  loss {logs['loss']:.3f}  tokens right {accuracy:.0%}"
                    tqdm.write(line)
                    log.debug(line)
                return
            step = state.global_step
            line = short_line(step, state.max_steps, logs)
            tqdm.write(line)
            log.debug(line)  # training.log only (the console already has it)
            with open(output_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, **logs}) + "\n")
            if logs.get("frac_reward_zero_std") == 1.0:
                log.warning(
                    f"step {step}: in every group all completions scored the same, so this step taught nothing "
                    "(fine once the policy has settled; early on, raise num_generations or temperature)"
                )
            if logs.get("completions/clipped_ratio") == 1.0:
                log.warning(
                    f"step {step}: every completion hit max_completion_length and was cut off before its end; "
                    "raise --max_completion_length or ask for shorter answers"
                )
            writer = getattr(self.tensorboard, "tb_writer", None)
            if writer is not None and latest.get("completions") and step % max(script_args.sample_steps, 1) == 0:
                writer.add_text("samples", sample_markdown(latest, script_args.num_samples), step)
                writer.flush()

    class CtrlC(TrainerCallback):
        """First Ctrl-C: finish the step, save checkpoint-N, stop. The second one quits at once."""

        def __init__(self):
            self.requested = False

        def on_sigint(self, signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True
            log.warning("Ctrl-C: saving a checkpoint at the end of this step, then stopping (Ctrl-C again quits now)")

        def on_step_end(self, args, state, control, **kwargs):
            if self.requested:
                control.should_save = True
                control.should_training_stop = True

    class Evaluate(TrainerCallback):
        """--eval_steps N: every N steps the main process evaluates the current policy and logs eval/* through the
        Trainer, so TensorBoard (and any other report_to) records them at the step; the other processes wait in
        the next step. It runs before that step's log and checkpoint, which it leaves as they would be."""

        def __init__(self):
            self.trainer = None  # set once the trainer exists: the numbers go to its log()

        def on_step_end(self, args, state, control, **kwargs):
            if not args.eval_steps or evaluate is None or self.trainer is None or not state.is_world_process_zero:
                return
            every = args.eval_steps if args.eval_steps >= 1 else math.ceil(state.max_steps * args.eval_steps)
            if state.global_step % every:  # (not state.eval_steps: a resume takes that from the checkpoint)
                return
            started = time.monotonic()
            logs = {f"eval_{name}": value for name, value in evaluate(self.trainer.model).items()}
            logs["eval_seconds"] = time.monotonic() - started
            should_log = control.should_log  # a log clears it, and this step's own log is still to come
            Trainer.log(self.trainer, logs)  # not GRPOTrainer.log: it would fold in (and clear) the step's metrics
            control.should_log = should_log

    return ProgressBar(), Report(), CtrlC(), Evaluate()


# --- main ---------------------------------------------------------------------------------------------------


def choose_backend(argv: list[str], config: dict) -> tuple[str, bool]:
    """(backend, whether CUDA is used), decided before trl is imported: Unsloth has to be imported first."""
    backend = str(early_option(argv, config, "backend") or "auto")
    model_name = str(early_option(argv, config, "model_name_or_path") or "")
    cuda = not truthy(early_option(argv, config, "use_cpu")) and cuda_available()
    if backend == "auto":
        one_process = int(os.environ.get("WORLD_SIZE", "1")) == 1  # Unsloth trains on one GPU
        has_unsloth = importlib.util.find_spec("unsloth") is not None
        backend = "unsloth" if cuda and one_process and has_unsloth and model_name != TINY else "transformers"
    if {"-h", "--help"} & set(argv):
        return backend, cuda
    if not cuda and (REAL_GPT_OSS.search(model_name) or truthy(early_option(argv, config, "load_in_4bit"))):
        die(
            f"{model_name} needs a CUDA GPU (none is used here); for a run on this machine: "
            "python train_2048.py --config configs/cpu-demo.yaml"
        )
    if backend == "unsloth" and not cuda:
        die("the unsloth backend needs a CUDA GPU; for a run on this machine: --config configs/cpu-demo.yaml")
    if backend == "unsloth" and importlib.util.find_spec("unsloth") is None:
        die("unsloth is not installed (bash setup.sh installs it on a GPU machine); or use --backend transformers")
    return backend, cuda


def parse_args(argv: list[str]):
    """(script_args, reward settings, training_args, model_args); a bad option is a usage error."""
    from trl import GRPOConfig, ModelConfig, TrlParser

    parser = TrlParser(
        (ScriptArguments, rewards.RewardSettings, GRPOConfig, ModelConfig),
        prog="train_2048.py",
        usage="train_2048.py [--config FILE.yaml] [--option VALUE ...]   (--help lists every option)",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    for action in parser._actions:  # GRPOConfig owns --eval_steps; here it drives our game evaluation
        if action.dest == "eval_steps":
            action.help = EVAL_STEPS_HELP
    try:
        script_args, settings, training_args, model_args = parser.parse_args_and_config(argv)
    except (ValueError, TypeError) as exc:  # an unknown YAML key, or a value GRPOConfig or RewardSettings rejects
        parser.error(" ".join(str(exc).split()))
    for name, choices in (
        ("backend", ("auto", "unsloth", "transformers")),
        ("save_method", ("lora", "merged_16bit", "mxfp4")),
    ):
        if getattr(script_args, name) not in choices:  # a YAML value skips argparse's own check
            parser.error(
                f"argument --{name}: invalid choice: {getattr(script_args, name)!r} (choose from {', '.join(choices)})"
            )
    if not model_args.model_name_or_path:
        parser.error(f"--model_name_or_path is required ({TINY}: the CPU demo's model)")
    if (training_args.eval_steps or 0) < 0:
        parser.error(f"argument --eval_steps: must be >= 0 (0: off), got {training_args.eval_steps:g}")
    for name in ("eval_samples", "eval_games"):
        if getattr(script_args, name) < 1:
            parser.error(f"argument --{name}: must be >= 1")
    if training_args.eval_strategy != "no":
        parser.error("--eval_strategy: train_2048 has no eval dataset; --eval_steps N alone runs its game evaluation")
    return script_args, settings, training_args, model_args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--config=") else [arg])]
    if "--config" not in argv:  # plain `python train_2048.py` is the GPT-OSS-20B run
        argv = ["--config", str(DEFAULT_CONFIG), *argv]
    config = read_config(argv)
    sandbox.start()  # its server starts now, before torch has threads and before CUDA exists (one per process)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # accelerate launch / torchrun: one process per rank
    try:
        rc = train(argv, config)
    except KeyboardInterrupt:
        print("train_2048: interrupted", file=sys.stderr)
        rc = 130
    finally:
        sandbox.shutdown()
    if world > 1:  # the sign that this rank got through (the test of the 2-process run reads it)
        print(f"train_2048: rank {os.environ.get('RANK', '?')}/{world} finished, exit status {rc}", file=sys.stderr)
    return rc


def train(argv: list[str], config: dict) -> int:
    backend, cuda = choose_backend(argv, config)
    if cuda:
        prepare_cuda()
    if backend == "unsloth":
        import unsloth  # noqa: F401  (it patches trl, transformers and peft, so it comes before them)

    script_args, settings, training_args, model_args = parse_args(argv)
    model_name = model_args.model_name_or_path
    output_dir = Path(training_args.output_dir)

    # --- checks that need nothing loaded: one line and exit 2 now, not a traceback an hour in
    if script_args.save_method == "mxfp4" and backend != "unsloth":
        die("--save_method mxfp4 needs the unsloth backend on a CUDA GPU; use lora or merged_16bit here")
    looks_local = model_name.startswith((".", "/", "~")) or model_name.count("/") > 1  # a hub id is org/name
    if model_name != TINY and looks_local and not Path(model_name).expanduser().exists():
        die(f"model path {model_name} does not exist")
    resume = script_args.resume or training_args.resume_from_checkpoint
    checkpoint = None
    if resume == "auto":
        checkpoint = latest_checkpoint(output_dir) if output_dir.is_dir() else None
    elif resume:
        checkpoint = Path(resume)
        if not complete_checkpoint(checkpoint):
            die(f"--resume {resume}: not a complete checkpoint (no readable trainer_state.json for its step)")
    if not writable(output_dir):
        die(f"output_dir {output_dir} is not a writable directory")

    # --- output directory and logs. Under accelerate launch every rank runs this file: what is written once
    # per run (the directory, training.log, the tiny model, the final save) is written by the main process,
    # and the others wait for it where they need it; each rank scores its own share of completions.
    from accelerate import PartialState

    state = PartialState()  # set up by GRPOConfig: one process, or this rank of an accelerate launch
    main_process = state.is_main_process
    created = main_process and not output_dir.exists()
    if main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        console = logging.StreamHandler(sys.stdout)
        console.setLevel(logging.INFO)
        logfile = logging.FileHandler(output_dir / "training.log")
        logfile.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.handlers = [console, logfile]
        log.setLevel(logging.DEBUG)  # DEBUG: training.log only
    else:  # the main process reports for every rank; another one speaks up only for an error of its own
        errors = logging.StreamHandler(sys.stderr)
        errors.setFormatter(logging.Formatter(f"train_2048 rank {state.process_index}: %(message)s"))
        log.handlers = [errors]
        log.setLevel(logging.ERROR)
    log.propagate = False
    log.info(f"train_2048: {model_name} on the {backend} backend, writing to {output_dir}")
    if state.num_processes > 1:
        log.info(f"{state.num_processes} processes ({state.distributed_type.value}), each scoring its own completions")
    if checkpoint is not None:
        log.info(f"resuming from {checkpoint}")
    elif resume == "auto":
        log.info("--resume auto: no complete checkpoint yet, starting at step 0")
    elif latest_checkpoint(output_dir) is not None:
        log.warning(f"{output_dir} has checkpoints of an earlier run; starting over (--resume auto continues it)")

    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback, set_seed
    from transformers.integrations import TensorBoardCallback
    from trl import GRPOTrainer, SFTConfig, SFTTrainer

    set_seed(training_args.seed)
    settings = dataclasses.replace(settings, game_salt=game_salt(settings, checkpoint, state))
    if script_args.cpu_threads > 0:
        import torch

        torch.set_num_threads(script_args.cpu_threads)
    prompt = rewards.build_prompt(settings)
    chat_kwargs = training_args.chat_template_kwargs or {}

    # --- model and tokenizer
    if model_name == TINY:
        corpus = [prompt] + [text for _, copies, text in demo_data.EXAMPLES for _ in range(copies)]
        with state.main_process_first():  # built once, by the main process; the other ranks then load it
            model_name = str(build_tiny_model(output_dir / "tiny-model", corpus, training_args.seed))
    try:
        model, tokenizer = load_model(model_name, backend, script_args, model_args, training_args)
    except OSError as exc:  # not on the hub, no network, not a model folder
        if created:
            shutil.rmtree(output_dir, ignore_errors=True)
        die(f"cannot load model {model_name}: {' '.join(str(exc).split())[:300]}")
    if backend == "unsloth":
        training_args.gradient_checkpointing = False  # Unsloth's own is in place; the Trainer must not add HF's

    latest = {}  # the last batch's completions and scores, for the TensorBoard samples
    evaluate = functools.partial(
        evaluate_policy,
        tokenizer=tokenizer,
        settings=settings,
        samples=script_args.eval_samples,
        games=script_args.eval_games,
        temperature=training_args.temperature,
        max_new_tokens=training_args.max_completion_length or 256,
        batch_size=training_args.per_device_train_batch_size,
        reasoning_effort=chat_kwargs.get("reasoning_effort", "low"),
    )
    progress_bar, report, ctrl_c, evaluator = make_callbacks(output_dir, script_args, latest, evaluate)

    def short_lines(trainer, bar):
        """The bar and our short line per log, instead of the Trainer's dump of every metric."""
        if trainer.pop_callback(ProgressCallback) is not None:
            trainer.add_callback(bar)
        trainer.pop_callback(PrinterCallback)
        trainer.add_callback(report)

    # --- warm start: SFT on example answers, for a model that cannot write a working strategy yet
    # Under accelerate launch it is one data-parallel job of every rank (a Trainer on one rank alone would wait for
    # the others forever), the batch split between them so an update sees as many examples as in one process;
    # the main process writes its logs.
    if script_args.warm_start and checkpoint is None:
        rows = demo_data.sft_rows(prompt)
        log.info(f"warm start: SFT on {len(rows)} example answers for {script_args.sft_epochs:g} epochs")
        sft_args = SFTConfig(
            output_dir=str(output_dir / "sft"),
            num_train_epochs=script_args.sft_epochs,
            learning_rate=script_args.sft_learning_rate,
            lr_scheduler_type="constant",
            per_device_train_batch_size=-(-training_args.per_device_train_batch_size // state.num_processes),
            optim=training_args.optim,
            gradient_checkpointing=training_args.gradient_checkpointing,
            ddp_find_unused_parameters=training_args.ddp_find_unused_parameters,
            max_length=script_args.max_seq_length,
            use_cpu=training_args.use_cpu,
            bf16=training_args.bf16,
            fp16=training_args.fp16,
            seed=training_args.seed,
            logging_steps=10,
            save_strategy="no",
            report_to=training_args.report_to,
            disable_tqdm=training_args.disable_tqdm,
        )
        sft = SFTTrainer(model, sft_args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
        short_lines(sft, progress_bar)
        sft.train()

    # --- GRPO: TRL runs the loop; the rewards play each completion's strategy in the sandbox
    dataset = rewards.build_dataset(script_args.dataset_size, settings, chat_kwargs.get("reasoning_effort", "low"))
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[keep_scores(f, latest) for f in rewards.reward_functions(settings)],
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[ctrl_c, evaluator, GameSalt(settings.game_salt)],
    )
    evaluator.trainer = trainer
    short_lines(trainer, progress_bar)
    report.tensorboard = next(
        (c for c in trainer.callback_handler.callbacks if isinstance(c, TensorBoardCallback)), None
    )
    previous_handler = signal.signal(signal.SIGINT, ctrl_c.on_sigint)
    try:
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    step = trainer.state.global_step
    if ctrl_c.requested:
        log.info(
            f"stopped by Ctrl-C after step {step}, saved as {output_dir / f'checkpoint-{step}'}; --resume auto continues"
        )
        return 130

    # --- save: LoRA adapters always, a merged model on request; then reload each and compare samples
    final = output_dir / "final"
    tmp = fresh(final) if trainer.accelerator.is_main_process else final.with_name("final.tmp")
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(tmp))  # every process takes part (sharded models); the main one writes
    if not trainer.accelerator.is_main_process:
        return 0
    publish(tmp, final)
    log.info(f"saved the LoRA adapters and the tokenizer to {final}")
    model, ok = trainer.model, True
    seed, new_tokens = training_args.seed, min(training_args.max_completion_length or 48, 48)
    trainer.optimizer = trainer.lr_scheduler = None  # room for the reloaded copies
    if cuda:
        import torch

        torch.cuda.empty_cache()
    if backend == "unsloth":
        from unsloth import FastLanguageModel

        FastLanguageModel.for_inference(model)
    if script_args.verify_save and model_args.use_peft:
        expected = sample_tokens(model, tokenizer, prompt, chat_kwargs, seed, new_tokens)
        reloaded, _ = load_model(model_name, backend, script_args, model_args, training_args, str(final), train=False)
        if backend == "unsloth":
            FastLanguageModel.for_inference(reloaded)
        got = sample_tokens(reloaded, tokenizer, prompt, chat_kwargs, seed, new_tokens)
        ok &= check_same(expected, got, final, backend)
        del reloaded
    if script_args.save_method != "lora":
        merged_dir = output_dir / f"final-{script_args.save_method}"
        tmp = fresh(merged_dir)
        if backend == "unsloth":
            model.save_pretrained_merged(str(tmp), tokenizer, save_method=script_args.save_method)
            merged = model
        else:
            import torch

            merged = model.merge_and_unload() if model_args.use_peft else model
            if merged.dtype == torch.float32:
                merged = merged.to(torch.bfloat16)  # merged_16bit: 16-bit weights, also from a float32 CPU run
            merged.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        publish(tmp, merged_dir)
        log.info(f"saved the merged model ({script_args.save_method}) to {merged_dir}")
        if script_args.verify_save:
            expected = sample_tokens(merged, tokenizer, prompt, chat_kwargs, seed, new_tokens)
            reloaded, _ = load_model(str(merged_dir), backend, script_args, model_args, training_args, train=False)
            if backend == "unsloth":
                FastLanguageModel.for_inference(reloaded)
            got = sample_tokens(reloaded, tokenizer, prompt, chat_kwargs, seed, new_tokens)
            ok &= check_same(expected, got, merged_dir, backend)
    log.info(f"done after {step} steps. TensorBoard: tensorboard --logdir {output_dir}")
    return 0 if ok else 1


def game_salt(settings, checkpoint: Path | None, state) -> str:
    """The secret mixed into the training games' seeds: the checkpoint's on a resume, else --game_salt, else a fresh
    random one; the main process decides and every rank uses it (each rank plays its share of the same games)."""
    from accelerate.utils import broadcast_object_list

    salt = settings.game_salt or rewards.new_salt()
    if checkpoint is not None:
        saved = json.loads((checkpoint / "trainer_state.json").read_text()).get("stateful_callbacks", {})
        salt = saved.get("GameSalt", {}).get("args", {}).get("salt") or salt
    return broadcast_object_list([salt])[0] if state.num_processes > 1 else salt


def check_same(expected: list[list[int]], got: list[list[int]], path: Path, backend: str) -> bool:
    """Exact on the transformers backend; on Unsloth the reload can differ in low bits (4-bit vs 16-bit kernels),
    so a mismatch there is a warning to look at, not a failure."""
    if expected == got:
        log.info(f"verified {path}: reloaded, it samples the same {len(got)} seeded completions as the trained model")
        return True
    differ = sum(a != b for a, b in zip(expected, got))
    message = f"{path}: reloaded, {differ} of {len(expected)} seeded completions differ from the trained model's"
    if backend == "unsloth":
        log.warning(message + " (4-bit and 16-bit weights can differ in low bits; spot-check its answers)")
        return True
    log.error(message)
    return False


if __name__ == "__main__":
    sys.exit(main())
