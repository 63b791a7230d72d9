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
import os
import socket
import sys
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
import rewards
import run_folder
import saving
import trained_base
import user_files

log = logging.getLogger("train_2048")
BEST = "best"  # <output_dir>/best: the adapters of the run's best evaluation (GameGRPOTrainer.save_best)
BEST_FILE = "train_2048_best.json"  # in it: which evaluation they scored best in, on which metric


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
        # The run's one sampler (evaluation.generation_config: the config TRL builds, from the run's own options): the
        # rollouts (TRL's transformers path, and our fast one) and every evaluation sample with it, so eval/* measures
        # the policy that is trained, not a cleaner one (a config without top_k gets transformers' top_k 50).
        budget = self.args.max_completion_length
        self.generation_kwargs = evaluation.generation_kwargs(self.args, self._tokenizer, budget)
        self.generation_config = evaluation.generation_config(self.args, self._tokenizer, budget)
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
                        seed=self.eval_seeds[0], config=self.generation_config, generate=self.fast_generate,
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

    # --- the best evaluated adapters ---------------------------------------------------------------------------

    def _determine_best_metric(self, metrics: dict[str, float], trial) -> bool:
        # transformers' own bookkeeping of the best evaluation (metric_for_best_model, greater_is_better; state's
        # best_metric and best_global_step, kept in trainer_state.json so a resume goes on from them). A new best's
        # adapters are saved to <output_dir>/best at once, the weights just evaluated, whichever steps save
        # checkpoints (load_best_model_at_end can only go back to a checkpoint).
        new_best = super()._determine_best_metric(metrics, trial)
        if new_best:
            self.save_best()
        return new_best

    def save_best(self) -> None:
        """The adapters to <output_dir>/best, put in place whole (saving.publish, over a best/ of this run's only),
        with BEST_FILE: the step, the metric and its value. Every process saves its part; the main one publishes."""
        folder = Path(self.args.output_dir) / BEST
        main = self.accelerator.is_main_process
        if main:
            run_folder.claim(folder.parent, BEST)  # recorded as the run's before a byte of it is written
        name = [saving.fresh(folder).name if main else None]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(name)
        tmp = folder.parent / name[0]
        self.accelerator.wait_for_everyone()
        self.save_model(str(tmp), _internal_call=True)  # internal: a hub push carries final/, not each best
        if not main:
            return
        metric = self.args.metric_for_best_model
        metric = metric if metric.startswith("eval_") else f"eval_{metric}"
        said = {"step": self.state.global_step, "metric": metric, "value": self.state.best_metric,
                "greater_is_better": bool(self.args.greater_is_better)}  # fmt: skip
        user_files.write_new(tmp / BEST_FILE, json.dumps(said, indent=1) + "\n")
        try:
            saving.publish(tmp, folder, "train_2048")
        except saving.NotOurs as error:
            log.error(f"{error}; the best adapters are in {tmp}")
            return
        say(f"best evaluation so far: {metric} {self.state.best_metric:.4g} at step {self.state.global_step}, its "
            f"adapters saved to {folder}")  # fmt: skip

    # --- the strategy archive in each checkpoint ------------------------------------------------------------

    base_identity: dict | None = None  # trained_base.base_identity of the base trained on (train_2048's make_trainer)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # A checkpoint's save starts here, and transformers writes trainer_state.json, which marks it complete, last:
        # the archive and the base's record written now are in every checkpoint that --resume auto takes; final/ is
        # saved through here too (saving.save_and_verify), so every adapter folder of a run names its base.
        super().save_model(output_dir, _internal_call)
        if self.base_identity is not None and output_dir and self.args.should_save:
            trained_base.write_base_identity(Path(output_dir), self.base_identity)  # which base these adapters belong to
        if output_dir and self.args.should_save:  # how the run played and sampled: evaluate_2048 --adapter does alike
            evaluation.write_run_record(Path(output_dir), self.settings, self.args)
        if self.archive is not None and output_dir and Path(output_dir).name == f"checkpoint-{self.state.global_step}":
            import strategy_archive

            strategy_archive.save_state(self.archive, Path(output_dir))

    def _save_checkpoint(self, model, trial) -> None:
        # transformers writes checkpoint-N in place, trainer_state.json last: a save cut short (a full disk, most
        # often) leaves a folder that --resume auto skips. Which folder it was goes with the error, for its one line.
        folder = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
        try:
            if self.is_world_process_zero():
                if folder.is_symlink():
                    raise FileExistsError(f"{folder} is a symbolic link: never written through")
                run_folder.claim(folder.parent, folder.name)  # recorded as the run's before a byte of it is written
            super()._save_checkpoint(model, trial)
        except Exception as exc:
            raise CheckpointError(Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}") from exc

    def create_model_card(self, *args, **kwargs) -> None:
        # TRL writes <output_dir>/README.md at every checkpoint, over whatever README.md the folder holds (a user's,
        # or the project's own with --output_dir .). The card is written only for a hub push, into a README.md the
        # run claimed when it started (absent then).
        readme = Path(self.args.output_dir) / "README.md"
        if self.args.push_to_hub and "README.md" in run_folder.claimed(readme.parent):
            super().create_model_card(*args, **kwargs)

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
    ("eval_mean_reward", "reward {:.2f}"),
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


def adapters_said(trainer, output_dir: Path) -> str:
    """Which adapters the run leaves, for its last line: final/ (the last step's, or with --load_best_model_at_end the
    best checkpoint's, which transformers loaded back), and best/ when the run evaluated (its BEST_FILE)."""
    final = output_dir / "final"
    if trainer.args.load_best_model_at_end and trainer.state.best_model_checkpoint:
        said = [f"{final} holds {Path(trainer.state.best_model_checkpoint).name}'s adapters (--load_best_model_at_end)"]
    else:
        said = [f"{final} holds the last step's adapters"]
    try:
        best = user_files.read_json(output_dir / BEST / BEST_FILE, what=BEST_FILE)
        said.append(f"{output_dir / BEST} the best evaluation's ({best['metric']} {best['value']:.4g} at step "
                    f"{best['step']}; evaluate_2048 and merge_2048 take either as --adapter)")  # fmt: skip
    except (user_files.FileRefused, LookupError, TypeError, ValueError):
        pass  # no evaluation, or none saved
    return ", ".join(said)


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
        with user_files.open_append(self.metrics) as f:  # never through a symbolic link
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


# --- wiring: the warm start's SFT trainer, the GRPO trainer with our callbacks, the console -----------------------


def quiet_console(trainer) -> QuietProgressBar | None:
    """The Trainer's bar without its dump of every metric at each log (our reports print short lines instead);
    returns the bar's callback, whose bars close_bars() closes."""
    from transformers import PrinterCallback

    bar = None
    if trainer.pop_callback(ProgressCallback) is not None:
        bar = QuietProgressBar()
        trainer.add_callback(bar)
    trainer.pop_callback(PrinterCallback)
    return bar


def close_bars(bar: QuietProgressBar | None) -> None:
    """The Trainer's progress bars closed now: left open, they redraw at exit, after our last line."""
    for shown in (getattr(bar, "training_bar", None), getattr(bar, "prediction_bar", None)):
        if shown is not None:
            shown.close()


def warm_start(model, tokenizer, prompt: str, script_args, training_args, state, writer=None) -> None:
    """SFT on demo_data.py's example answers, for a model that cannot write a working strategy yet. Under accelerate
    launch it is one data-parallel job of every rank, the batch split so an update sees as many examples. Its
    TensorBoard scalars go to the run's writer as warm_start/*."""
    from datasets import Dataset
    from transformers.integrations import TensorBoardCallback
    from trl import SFTConfig, SFTTrainer

    import demo_data

    rows = demo_data.sft_rows(prompt)
    log.info(f"warm start: SFT on {len(rows)} example answers for {script_args.sft_epochs:g} epochs")
    sft_args = SFTConfig(
        output_dir=training_args.output_dir,  # it saves nothing (save_strategy "no"): no folder of its own
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
    quiet_console(sft)
    sft.pop_callback(TensorBoardCallback)  # its train/* would share GRPO's charts
    sft.add_callback(WarmStartReport(writer))
    sft.train()


def make_archive(settings, script_args, output_dir: Path, held_out: list[int], state, times: StepTimes, checkpoint):
    """The strategy archive (strategy_archive.py), continuing the checkpoint's on a resume; None when it is off."""
    if not script_args.archive_size:
        return None
    import strategy_archive

    archive = strategy_archive.StrategyArchive(
        settings, size=script_args.archive_size, budget=script_args.archive_budget, output_dir=output_dir,
        seeds=held_out[: script_args.archive_games or script_args.eval_games],
        main=state.is_main_process, world=state.num_processes, timing=lambda: times.timing("archive"), say=say,
    )  # fmt: skip
    if checkpoint is not None:
        strategy_archive.load_state(archive, checkpoint)
    log.info(archive.describe())
    return archive


def reward_funcs(settings, script_args, training_args, judge, tokenizer, times, latest) -> list:
    """The rewards TRL calls, each timed and its scores kept for the TensorBoard samples; DAPO's overlong penalty as
    a fourth with --overlong_penalty; with --truncated skip, a cut-off completion gets no score (TRL's own rule for
    one: its last token is neither EOS nor padding)."""
    funcs = rewards.reward_functions(settings, judge)
    if script_args.overlong_penalty:
        from trl.rewards import get_soft_overlong_punishment

        funcs.append(get_soft_overlong_punishment(training_args.max_completion_length, script_args.overlong_penalty))
    stop_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id} if script_args.truncated == "skip" else None
    if stop_ids is not None:  # TRL warns, with the whole prompt, for every completion left unscored: here by design
        logging.getLogger("trl.trainer.grpo_trainer").addFilter(
            lambda record: "All reward functions returned None" not in record.getMessage()
        )
    return [timed_reward(f, times, latest, skip_unless_ends_with=stop_ids) for f in funcs]


def make_trainer(model, tokenizer, settings, plan, state, writer=None):
    """(trainer, ctrl_c, bar): TRL's GRPOTrainer with our rewards, evaluation, reports, timings and strategy archive,
    the callback that Ctrl-C asks for a checkpoint, and the console's bar. `plan`: options.Plan; `writer`: the run's
    TensorBoard writer (main process), or None."""
    from transformers.integrations import TensorBoardCallback

    script_args, training_args, output_dir = plan.script_args, plan.training_args, plan.output_dir
    reasoning = (training_args.chat_template_kwargs or {}).get("reasoning_effort", "low")
    latest = {}  # the last batch's completions and scores, for the TensorBoard samples
    times, ctrl_c = StepTimes(state.device), CtrlC()
    evaluating = training_args.eval_strategy != "no"
    held_out = rewards.held_out_seeds(settings.game_salt, max(script_args.archive_games, script_args.eval_games))
    if evaluating:
        log.info(f"evaluation: {script_args.eval_samples} strategies sampled, each on {script_args.eval_games} held-out "
                 f"games (seeds {held_out[0]}-{held_out[script_args.eval_games - 1]}, from the secret game salt)")  # fmt: skip
    archive = make_archive(settings, script_args, output_dir, held_out, state, times, plan.checkpoint)
    judge = rewards.make_judge(settings)
    judge = archive.watch(judge) if archive is not None else judge  # every batch's verdicts pass through the archive
    trainer = GameGRPOTrainer(
        model=model,
        reward_funcs=reward_funcs(settings, script_args, training_args, judge, tokenizer, times, latest),
        args=training_args,
        train_dataset=rewards.build_dataset(script_args.dataset_size, settings, reasoning),
        eval_dataset=rewards.build_dataset(script_args.eval_samples, settings, reasoning) if evaluating else None,
        processing_class=tokenizer,
        callbacks=[GRPOReport(output_dir), ctrl_c, GameSalt(settings.game_salt), *filter(None, [archive])],
        settings=settings,
        eval_samples=script_args.eval_samples,
        eval_seeds=held_out[: script_args.eval_games],
        times=times,
        generate=generation.generate if script_args.fast_generation else None,
        archive=archive,
    )
    bar = quiet_console(trainer)
    trainer.base_identity = getattr(model, "train_2048_base", None)  # train_2048_base.json in every adapter save
    if script_args.fast_generation:
        log.info(f"generation: {trainer.prepare_fast_generation()}")
    if writer is not None:  # one writer for the Trainer's scalars and ours, handed to transformers' own callback
        trainer.remove_callback(TensorBoardCallback)
        trainer.add_callback(TensorBoardCallback(tb_writer=writer))
        trainer.add_callback(TensorBoardSamples(writer, latest, script_args.sample_steps, script_args.num_samples))
        if archive is not None:
            archive.writer = writer
    return trainer, ctrl_c, bar


def tensorboard_command(output_dir: Path) -> str:
    """The command that opens this run in TensorBoard from here: the one installed beside this Python (setup.sh's
    .venv/bin/tensorboard, not on PATH until the venv is activated), else whatever PATH has."""
    import shlex
    import shutil

    beside = Path(sys.executable).parent / "tensorboard"
    if beside.is_file():
        relative = os.path.relpath(beside)
        program = [relative if not relative.startswith("..") else str(beside)]
    else:
        program = ["tensorboard"] if shutil.which("tensorboard") else [sys.executable, "-m", "tensorboard.main"]
    return shlex.join([*program, "--logdir", str(output_dir)])
