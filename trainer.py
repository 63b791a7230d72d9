"""The GRPO trainer of train_2048: TRL's GRPOTrainer with our game evaluation, a step-time breakdown, the fast
generation path and the strategy archive's state in every checkpoint, plus callbacks for what TRL does not do (short
console lines, metrics.jsonl, warnings, TensorBoard samples, Ctrl-C, the game salt in every checkpoint).

train_2048.py imports this module only after Unsloth when Unsloth is used: Unsloth patches TRL's trainers as it
is imported, and the class below must subclass the patched one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
import time
from collections import defaultdict
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list, gather_object
from transformers import ProgressCallback, TrainerCallback
from transformers.trainer_callback import ExportableState
from trl import GRPOTrainer

import evaluation
import generation
import models
import rewards

log = logging.getLogger("train_2048")


class GameGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose `evaluate()` is the game evaluation (evaluation.py's protocol) on the run's held-out games
    (rewards.held_out_seeds: secret, so no strategy can recognise them, and the same in every evaluation and after a
    resume), sampled with the first of them as seed, so `evaluate_2048.py --seed <it>` on a checkpoint gets the same
    numbers: every process samples its share of the strategies, the main process plays them all in the sandbox, and
    eval/* is logged like any Trainer evaluation, so `eval_strategy`/`eval_steps` mean what they mean in transformers.
    The model's mode and torch's random state are left as they were, so a run with evaluations trains exactly like one
    without.

    Each training log also gets the step's time split (time/generate_s, time/rewards_s, time/optimizer_s,
    time/archive_s: the strategy archive's re-scoring, and the rest: log-probs, loss and backward), on a GPU the peak
    memory, generation/fast_path: the share of the step's generations that our decode loop served (1: all of them; 0:
    TRL's model.generate, by choice or by fallback), and with --fast_generation generation/compiled: the share whose
    decode steps ran as compiled code (generation.py: Dynamo traced them; 0 on the CPU, where the step is not
    compiled, and wherever torch.compile left it eager).
    """

    def __init__(self, *args, settings, eval_samples: int, eval_seeds: list[int], times: StepTimes, generate=None,
                 archive=None, **kwargs):  # fmt: skip
        super().__init__(*args, **kwargs)
        self.settings, self.eval_samples, self.eval_seeds = settings, eval_samples, eval_seeds
        self.fast_generate = generate  # generation.generate, or None for TRL's own path
        self.archive = archive  # strategy_archive.StrategyArchive, or None
        self.times = times  # also counts the rewards' time (timed_reward)
        self.generations = {"fast": 0, "compiled": 0, "all": 0}  # since the last training log: generation/*
        self.add_callback(times)

    def unwrap_for_generation(self):
        """The context TRL generates in, looked up where Unsloth replaces it (trl.trainer.grpo_trainer, not
        trl.models): on the Unsloth backend its for_inference / for_training then wrap our generation too, so the
        fast path sees the model as Unsloth's own generate does."""
        import trl.trainer.grpo_trainer as trl_grpo

        return trl_grpo.unwrap_model_for_generation(
            self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
            generation_kwargs=self.generation_kwargs,
        )  # fmt: skip

    def prepare_fast_generation(self) -> str:
        """Build and self-check the fast path in the state rollouts will see it in (inside unwrap_for_generation),
        before the first step; returns generation.describe's line."""
        with self.unwrap_for_generation() as model, torch.no_grad():
            generation.prepare(model)
            return generation.describe(model)

    # --- evaluation -----------------------------------------------------------------------------------------

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        started = time.monotonic()
        args = self.args
        chat_kwargs = args.chat_template_kwargs or {}
        sizes = evaluation.batch_sizes(self.eval_samples, args.per_device_eval_batch_size)
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        rounds = math.ceil(len(sizes) / world)  # every process generates as often (FSDP and ZeRO-3 run in lockstep)
        mine = {}
        was_training = self.model.training
        try:
            with self.unwrap_for_generation() as model:
                model.eval()
                inputs = evaluation.prompt_inputs(self.processing_class, self.settings, chat_kwargs)
                for r in range(rounds):
                    index = r * world + rank
                    size = sizes[index] if index < len(sizes) else sizes[-1]  # a spare batch, thrown away
                    ids = evaluation.sample_batch(
                        model, self.processing_class, inputs, index=min(index, len(sizes) - 1), size=size,
                        seed=self.eval_seeds[0], temperature=args.temperature,
                        max_new_tokens=args.max_completion_length, generate=self.fast_generate,
                    )  # fmt: skip
                    if index < len(sizes):
                        mine[index] = evaluation.decode(self.processing_class, ids)
        finally:
            self.model.train(was_training)  # after the unwrap: Unsloth's for_training on leaving it sets training mode
        batches = {}
        for part in gather_object([mine]) if world > 1 else [mine]:
            batches.update(part)
        metrics = None
        if self.accelerator.is_main_process:
            completions = [text for index in sorted(batches) for text in batches[index]]
            metrics = evaluation.policy_metrics(completions, self.eval_seeds, self.settings)
        if world > 1:
            metrics = broadcast_object_list([metrics])[0]
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        metrics[f"{metric_key_prefix}_seconds"] = time.monotonic() - started
        mode_was_training = self.model.training
        self.model.eval()  # GRPOTrainer.log folds in the metrics of the mode the model is in: none for eval
        self.log(metrics)
        self.model.train(mode_was_training)
        self.control = self.callback_handler.on_evaluate(args, self.state, self.control, metrics)
        return metrics

    # --- the strategy archive in each checkpoint ------------------------------------------------------------

    base_identity: dict | None = None  # models.base_identity of the base trained on (train_2048's make_trainer)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # A checkpoint's save starts here, and transformers writes trainer_state.json, which marks it complete, last:
        # the archive and the base's record written now are in every checkpoint that --resume auto takes; final/ is
        # saved through here too (models.save_and_verify), so every adapter folder of a run names its base.
        super().save_model(output_dir, _internal_call)
        if self.base_identity is not None and output_dir and self.args.should_save:
            models.write_base_identity(Path(output_dir), self.base_identity)  # which base these adapters belong to
        if self.archive is not None and output_dir and Path(output_dir).name == f"checkpoint-{self.state.global_step}":
            self.archive.save_state(Path(output_dir))

    def _save_checkpoint(self, model, trial) -> None:
        # transformers writes checkpoint-N in place, trainer_state.json last: a save cut short (a full disk, most
        # often) leaves a folder that --resume auto skips. Which folder it was goes with the error, for its one line.
        try:
            super()._save_checkpoint(model, trial)
        except Exception as exc:
            raise CheckpointError(Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}") from exc

    # --- step timings ---------------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and "loss" in logs:  # a training log: add the time split since the last one
            logs.update(self.times.pop())
            if self.generations["all"]:
                logs["generation/fast_path"] = self.generations["fast"] / self.generations["all"]
                if self.fast_generate is not None:
                    logs["generation/compiled"] = self.generations["compiled"] / self.generations["all"]
            self.generations = {"fast": 0, "compiled": 0, "all": 0}
        super().log(logs, start_time)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        # The one override of a TRL internal (pinned trl==1.14.0, and Unsloth's rewrite of it, which `_generate`
        # calls the same way: tests/unsloth): the fast path for plain text generation, and the generation time of the
        # step split. Anything else (vLLM, images, tools) is TRL's own path.
        with self.times.timing("generate"):
            self.generations["all"] += 1
            if self.fast_generate is None or self.use_vllm or images or multimodal_fields or self.tools:
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, has_tool_images)
            out = self._fast_generate(prompt_ids)
            self.generations["fast"] += generation.last_path() == "fast"
            self.generations["compiled"] += generation.last_step_compiled()
            return out

    def _fast_generate(self, prompt_ids):
        """TRL's regular generation path (left-padded prompts, everything after the first EOS cut) with our
        decode loop in place of `model.generate`."""
        from trl.trainer.utils import pad

        tokenizer = self.processing_class
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(prompts, padding_value=tokenizer.pad_token_id, padding_side="left").to(self.accelerator.device)
        attention_mask = pad([torch.ones_like(t) for t in prompts], padding_value=0, padding_side="left")
        with self.unwrap_for_generation() as model, torch.no_grad():
            out = self.fast_generate(model, input_ids, attention_mask.to(input_ids.device), self.generation_config)
        completions = []
        for row in out[:, input_ids.size(1) :].tolist():
            end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
            completions.append(row[:end])
        return completions, None


class CheckpointError(Exception):
    """A checkpoint that could not be written: its folder (the cause is the exception's __cause__)."""

    def __init__(self, folder: Path):
        super().__init__(str(folder))
        self.folder = folder


class StepTimes(TrainerCallback):
    """Wall time of each part of an optimizer step, summed between two logs and reported per step. On a GPU the
    clock is read after a synchronize, so queued kernels count where they run."""

    PARTS = ("generate", "rewards", "optimizer", "archive")

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.started = {}

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def timing(self, part: str):
        start = self.now()
        try:
            yield
        finally:
            self.totals[part] += self.now() - start

    def on_step_begin(self, args, state, control, **kwargs):
        self.started["step"] = self.now()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.started["optimizer"] = self.now()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.totals["optimizer"] += self.now() - self.started.pop("optimizer", self.now())

    def on_step_end(self, args, state, control, **kwargs):
        self.totals["step"] += self.now() - self.started.pop("step", self.now())
        self.steps += 1

    def pop(self) -> dict[str, float]:
        if not self.steps:
            return {}
        per_step = {part: self.totals[part] / self.steps for part in ("step", *self.PARTS)}
        out = {f"time/{part}_s": per_step[part] for part in self.PARTS}
        out["time/logprobs_and_backward_s"] = max(0.0, per_step["step"] - sum(per_step[p] for p in self.PARTS))
        out["time/step_s"] = per_step["step"]
        if self.cuda:
            out["gpu/peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        self.totals.clear()
        self.steps = 0
        return out


def timed_reward(func, times: StepTimes, latest: dict, skip_unless_ends_with: set[int] | None = None):
    """`func` as a TRL reward that also counts its time in the step split and keeps its last scores (and the
    completions) for the TensorBoard samples.

    With `skip_unless_ends_with` (the EOS and pad ids), a completion cut off by the budget gets None: when every reward
    does so, TRL leaves it out of its group's baseline and gives it no advantage, so a budget that clips answers
    teaches neither brevity nor anything else (`--truncated skip`).
    """

    def reward(completions, **kwargs):
        with times.timing("rewards"):
            scores = func(completions=completions, **kwargs)
        if skip_unless_ends_with is not None:
            ids = kwargs.get("completion_ids") or [[]] * len(scores)
            scores = [s if row and row[-1] in skip_unless_ends_with else None for s, row in zip(scores, ids)]
        latest["completions"], latest[func.__name__] = completions, scores
        return scores

    reward.__name__ = func.__name__  # TRL names the reward's metrics after it
    return reward


# --- callbacks ------------------------------------------------------------------------------------------------


class QuietProgressBar(ProgressCallback):
    """The Trainer's progress bar without its dump of every metric at each log; the reports print short lines."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


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
    ("time/step_s", "{:.1f} s"),
]
EVAL_LINE = [  # (metric as the Trainer logs it, how it is shown)
    ("eval_valid_rate", "valid {:.0%}"),
    ("eval_cheat_rate", "cheating {:.0%}"),
    ("eval_win_rate", "win {:.0%}"),
    ("eval_max_tile_log2", "tile 2^{:.1f}"),
    ("eval_mean_score", "score {:.0f}"),
    ("eval_seconds", "({:.1f} s)"),
]


def short_line(step: int, max_steps: int, logs: dict) -> str:
    """One console line per logging step: the numbers that say whether the run is healthy."""
    shown = [template.format(logs[key]) for key, template in SHORT_LINE if isinstance(logs.get(key), int | float)]
    return "  ".join([f"step {step}/{max_steps}", *shown])


def eval_line(step: int, metrics: dict) -> str:
    """The console line of one evaluation."""
    shown = [template.format(metrics[key]) for key, template in EVAL_LINE if isinstance(metrics.get(key), int | float)]
    return "  ".join([f"eval at step {step}:", *shown])


def say(line: str) -> None:
    """A console line under the progress bar, and the same line in training.log."""
    from tqdm.auto import tqdm

    tqdm.write(line)
    log.debug(line)  # DEBUG: training.log only


class GRPOReport(TrainerCallback):
    """Per log: a short console line, every metric into metrics.jsonl, and warnings when a step cannot teach; per
    evaluation, its line. On the main process only."""

    def __init__(self, output_dir: Path):
        self.metrics = output_dir / "metrics.jsonl"

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        with open(self.metrics, "a") as f:
            f.write(json.dumps({"step": state.global_step, **logs}) + "\n")
        if any(key.startswith("eval_") for key in logs):  # an evaluation's numbers: on_evaluate reports them
            return
        step = state.global_step
        say(short_line(step, state.max_steps, logs))
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

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if state.is_world_process_zero and metrics:
            say(eval_line(state.global_step, metrics))


# The Custom Scalars tab of TensorBoard: one screen of the charts that say whether a run learns (tags are regexes).
TENSORBOARD_LAYOUT = {
    "train_2048": {
        "reward (the sum of the rewards)": ["Multiline", [r"train/reward$"]],
        "each reward": ["Multiline", [r"train/rewards/[^/]+/mean$"]],
        "eval: mean game score (the held-out games)": ["Multiline", [r"eval/mean_score$"]],
        "archive: best strategy's held-out reward": ["Multiline", [r"archive/best_reward$"]],
        "KL to the reference (with --beta > 0)": ["Multiline", [r"train/kl$"]],
        "completion length (tokens)": ["Multiline", [r"train/completions/(mean|max)_length$"]],
        "generation path (share of the step's generations)": ["Multiline", [r"train/generation/"]],
    }
}
# The samples' name in the Text tab, which opens its first two groups in the order of their names: "answers" and the
# strategy archive's "archive" come before "args" (the Trainer's dump of its arguments).
ANSWERS_TEXT = "answers"


def tensorboard_writer(output_dir: Path):
    """The run's one TensorBoard writer, <output_dir>/runs/<date>_<host>: the warm start's scalars (warm_start/*), the
    Trainer's (train/*, eval/*), the archive's and the texts all go into it, so TensorBoard shows one run, with
    TENSORBOARD_LAYOUT as its Custom Scalars tab."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(output_dir / "runs" / f"{time.strftime('%b%d_%H-%M-%S')}_{socket.gethostname()}"))
    writer.add_custom_scalars(TENSORBOARD_LAYOUT)
    return writer


class WarmStartReport(TrainerCallback):
    """The warm start's (SFT) console line per log, and its numbers as warm_start/* in TensorBoard (not train/*: those
    charts are GRPO's, and the SFT steps are not GRPO's steps)."""

    def __init__(self, writer=None):
        self.writer = writer

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if self.writer is not None:
            for name, value in logs.items():
                if isinstance(value, int | float):
                    self.writer.add_scalar(f"warm_start/{name}", value, state.global_step)
            self.writer.flush()
        if "loss" in logs:
            accuracy = logs.get("mean_token_accuracy", float("nan"))
            say(f"warm start  epoch {logs.get('epoch', 0):.1f}  loss {logs['loss']:.3f}  tokens right {accuracy:.0%}")


class TensorBoardSamples(TrainerCallback):
    """Every `every` steps, a few completions with their three rewards as TensorBoard text ("answers"), through the
    writer the Trainer's own TensorBoardCallback uses (train_2048.py hands both the same one)."""

    def __init__(self, writer, latest: dict, every: int, count: int):
        self.writer, self.latest, self.every, self.count = writer, latest, max(every, 1), count

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.latest.get("completions") and state.global_step % self.every == 0:
            self.writer.add_text(ANSWERS_TEXT, sample_markdown(self.latest, self.count), state.global_step)
            self.writer.flush()


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


class GameSalt(TrainerCallback, ExportableState):
    """Carries the secret game salt into every checkpoint: transformers saves the state of ExportableState
    callbacks in trainer_state.json, written with the checkpoint, so --resume replays the same games."""

    def __init__(self, salt: str):
        self.salt = salt

    def state(self) -> dict:
        return {"args": {"salt": self.salt}, "attributes": {}}


def saved_salt(checkpoint: Path) -> str | None:
    """The game salt a checkpoint was trained with (None for checkpoints written before salts were kept)."""
    saved = json.loads((checkpoint / "trainer_state.json").read_text()).get("stateful_callbacks", {})
    return saved.get(GameSalt.__name__, {}).get("args", {}).get("salt")
