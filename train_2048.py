"""Train a model with GRPO to write Python 2048 strategies: GPT-OSS-20B on a CUDA GPU, or a tiny model on a CPU.

    python train_2048.py                                   # configs/gpt-oss-20b.yaml: Unsloth, 4-bit, one CUDA GPU
    python train_2048.py --config configs/gpt-oss-20b-bf16.yaml   # BF16 weights, faster, on a card with >= 48 GB
    python train_2048.py --config configs/cpu-demo.yaml    # a tiny local model on the CPU, a few minutes
    python train_2048.py --config configs/notebook.yaml    # the public notebook's run, reproduced
    python train_2048.py --max_steps 300 --resume auto     # any option as a flag; continue the last run
    accelerate launch --config_file configs/accelerate/cpu-2proc.yaml train_2048.py --config configs/cpu-demo.yaml
                                                           # the same demo as 2 processes (gloo, CPU only)

Every option is a flag (`--max_steps` or `--max-steps`, never abbreviated) and a YAML key; flags override the file.
--help lists TRL's GRPOConfig and ModelConfig options, then train_2048's own and the game's.

TRL runs the GRPO loop and transformers writes the checkpoints. options.py turns the command line and the preset into
a checked plan (every check that needs no model, before anything is written); this file runs the steps of `train()`:
the output folder held (run_folder.py), logs, the model, an optional warm start, GRPO (trainer.py: TRL's GRPOTrainer
with our game evaluation every eval_steps, the strategy archive, the console), and the verified save. In <output_dir>: training.log,
metrics.jsonl, runs/ (TensorBoard), checkpoint-N/, strategies/ (the best strategies the model wrote),
final/ (LoRA adapters), final-<save_method>/ (merged: merge_2048.py, which merges any saved adapter again).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import signal
import sys
from pathlib import Path

import checkpoint_state
import demo_data
import models
import options
import rewards
import run_folder
import sandbox
import saving
import trained_base
import user_files

HELD: list = []  # the output folder, held while the run lives (run_folder.Held: its lock and record)
log = logging.getLogger("train_2048")


def die(message: str) -> None:
    """A setup error: one line, exit status 2, no traceback."""
    print(f"train_2048: {message}", file=sys.stderr)
    raise SystemExit(2)


# --- checks that need the model (every other check is options.plan's) -------------------------------------------


def compare_adapters(model, checkpoint: Path) -> None:
    """The built model's adapters against the checkpoint's: --lora_target_modules or --lora_modules_to_save that
    differ from the run's stop here, in one line, not as a traceback in the optimizer's load or a resume that silently
    leaves some adapters fresh."""
    differences = checkpoint_state.adapter_differences(model, checkpoint)
    if differences:
        die(f"--resume: {checkpoint}'s adapters are not the ones these options build ({differences}); resume with "
            "the run's own --lora_target_modules and --lora_modules_to_save, or start a new run in another "
            "--output_dir")  # fmt: skip


def prepare_cuda() -> None:
    """DGX Spark (GB10, compute capability 12.1), asked once CUDA is up (after `import unsloth`): extensions built from
    source target sm_121a, and a Triton up to 3.5 (NGC 25.11's) gets the CUDA toolkit's ptxas, as its own rejects
    sm_121a; Triton 3.6 and later (torch >= 2.11) use their own Blackwell ptxas and ignore TRITON_PTXAS_PATH."""
    import torch

    if torch.cuda.get_device_capability() != (12, 1):
        return
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "12.1a")
    try:
        import triton

        old_triton = tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 6)
    except (ImportError, ValueError):
        old_triton = False
    if old_triton and os.path.exists("/usr/local/cuda/bin/ptxas"):
        os.environ.setdefault("TRITON_PTXAS_PATH", "/usr/local/cuda/bin/ptxas")
    if importlib.util.find_spec("flash_attn") is not None:
        log.warning(
            "flash-attn is installed: it has no GB10 (sm_121) build and breaks xformers; pip uninstall flash-attn"
        )


# --- the steps of a run -------------------------------------------------------------------------------------


class NoFollowFileHandler(logging.FileHandler):
    """logging's file handler, opening training.log without following a symbolic link (user_files.open_append)."""

    def _open(self):
        return user_files.open_append(Path(self.baseFilename))


def start_logging(output_dir: Path, state) -> None:
    """Console and training.log on the main process; another process speaks up only for an error of its own.

    Under accelerate launch every rank runs this file: what is written once per run (the directory, training.log,
    the tiny model, the final save) is written by the main process, and the others wait for it where they need it.
    """
    logging.raiseExceptions = False  # a log line that cannot be written (a full disk) is dropped, not a traceback
    if state.is_main_process:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            logfile = NoFollowFileHandler(output_dir / "training.log")
        except OSError as exc:
            die(f"output_dir {output_dir}: {exc.strerror or exc}")
        console = logging.StreamHandler(sys.stdout)
        console.setLevel(logging.INFO)
        logfile.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.handlers = [console, logfile]
        log.setLevel(logging.DEBUG)  # DEBUG: training.log only
    else:
        errors = logging.StreamHandler(sys.stderr)
        errors.setFormatter(logging.Formatter(f"train_2048 rank {state.process_index}: %(message)s"))
        log.handlers = [errors]
        log.setLevel(logging.ERROR)
    log.propagate = False


def load_policy(script_args, training_args, model_args, backend: str, prompt: str, state, output_dir: Path):
    """(model, tokenizer) to train; the CPU demo's tiny model is built first, once, by the main process."""
    model_name = model_args.model_name_or_path
    if model_name == demo_data.TINY:
        with state.main_process_first():
            built = demo_data.build_tiny_model(output_dir / "tiny-model", demo_data.corpus(prompt), training_args.seed)
        model_name = str(built)
    offload = bool(script_args.offload_embedding)
    if backend == "unsloth":  # only Unsloth's loader offloads
        offload, why = models.decide_offload(script_args.offload_embedding, model_args.load_in_4bit)
        log.info(f"offload_embedding {str(offload).lower()}: {why}")
    model, tokenizer = models.load_model(
        model_name,
        model_args,
        backend=backend,
        trainable=True,
        max_seq_length=script_args.max_seq_length,
        offload_embedding=offload,
        seed=training_args.seed,
        gradient_checkpointing=training_args.gradient_checkpointing,
        trust_remote_code=training_args.trust_remote_code,
    )
    model.train_2048_base = trained_base.base_identity(model_name, model_args.model_revision, model)  # for each save
    if models.experts_layout(model) is not None:
        log.info(f"model: {models.describe_experts(model)}")
    if backend == "unsloth":
        # --gradient_checkpointing chose Unsloth's own above ("unsloth" checkpointing); the Trainer must not add HF's.
        training_args.gradient_checkpointing = False
    if backend == "unsloth" and training_args.router_aux_loss_coef is None:
        coef = getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0
        if coef and hasattr(model.config, "output_router_logits"):  # TRL would turn on the loss Unsloth refuses
            die(f"{model_name} declares a MoE router loss ({coef:g}) that Unsloth's GRPO cannot compute: "
                "pass --router_aux_loss_coef 0")  # fmt: skip
    return model, tokenizer


def run_grpo(trainer, ctrl_c, bar, checkpoint: Path | None) -> bool:
    """trainer.train() with Ctrl-C handled (a checkpoint at the end of the step); True when Ctrl-C stopped it. A disk
    that fills up (or any write that fails) stops the run with one line; the checkpoint it was writing is removed
    and the last complete one is left as it was, for --resume auto."""
    import trainer as grpo

    previous = signal.signal(signal.SIGINT, ctrl_c.on_sigint)
    output_dir = Path(trainer.args.output_dir)
    try:
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    except grpo.CheckpointError as exc:
        import shutil

        said = user_files.write_failure(exc.__cause__, output_dir)  # a full disk named as one, before space is freed
        if trainer.is_world_process_zero() and checkpoint_state.checkpoint_damage(exc.folder):
            shutil.rmtree(exc.folder, ignore_errors=True)  # a half-written one, and the space it held
        grpo.close_bars(bar)
        die(f"cannot write {exc.folder} ({said}): {last_complete(output_dir)}")
    except OSError as exc:  # writing metrics.jsonl, training.log, strategies/, TensorBoard's files
        grpo.close_bars(bar)
        die(f"stopped at step {trainer.state.global_step} ({user_files.write_failure(exc, output_dir)}): "
            f"{last_complete(output_dir)}")
    finally:
        signal.signal(signal.SIGINT, previous)
    return ctrl_c.requested


def last_complete(output_dir: Path) -> str:
    """Where a stopped run stands: its last complete checkpoint, and how to go on."""
    last = checkpoint_state.last_complete(output_dir)
    if last is None:
        return "no checkpoint was completed"
    return f"the last complete checkpoint, {last.name}, is intact: --resume auto continues from it once there is room"


def game_salt(settings, checkpoint: Path | None, state) -> str:
    """The secret mixed into the training games' seeds: the checkpoint's on a resume, else --game_salt, else a fresh
    random one; the main process decides and every rank uses it (each rank plays its share of the same games)."""
    from accelerate.utils import broadcast_object_list

    import trainer as grpo

    salt = settings.game_salt or rewards.new_salt()
    if checkpoint is not None:
        saved = grpo.saved_salt(checkpoint)
        if saved is None:
            log.warning(f"{checkpoint} keeps no game salt (written by an older train_2048): new games from here")
        elif settings.game_salt and settings.game_salt != saved:
            log.warning(f"--game_salt differs from the one {checkpoint} was trained with: the checkpoint's is used")
        salt = saved or salt
    return broadcast_object_list([salt])[0] if state.num_processes > 1 else salt


def train(argv: list[str], backend: str, cuda: bool) -> int:
    """The steps of a run, in order. Order rules: Unsloth is imported first (it patches trl, transformers and peft,
    and its CUDA allocator setting for GB10 counts only if nothing started CUDA before: importing bitsandbytes does);
    every option is checked before anything is written; the folder is held (its lock, its record) before anything is
    written there; the model is deleted from here once the trainer holds it, so the save step can release it."""
    if backend == "unsloth":
        models.quiet_library_logs()
        import unsloth  # noqa: F401
    models.quiet_library_imports()  # before trl, which imports bitsandbytes
    if cuda:
        prepare_cuda()
    try:
        plan = options.plan(argv, backend, description=__doc__)
    except options.OptionError as exc:
        die(str(exc))
    from accelerate import PartialState
    from transformers import set_seed

    state = PartialState()  # set up by GRPOConfig: one process, or this rank of an accelerate launch
    hold_the_folder(plan, state)
    start_logging(plan.output_dir, state)
    announce(plan, state)
    set_seed(plan.training_args.seed)
    if plan.script_args.cpu_threads > 0:
        import torch

        torch.set_num_threads(plan.script_args.cpu_threads)
    settings = dataclasses.replace(plan.settings, game_salt=game_salt(plan.settings, plan.checkpoint, state))
    prompt = rewards.build_prompt(settings)
    model, tokenizer = load_or_leave(plan, prompt, state)
    import trainer as grpo

    writer = None
    if state.is_main_process and "tensorboard" in plan.training_args.report_to:
        writer = grpo.tensorboard_writer(plan.output_dir)
        run_folder.claim(plan.output_dir, Path(writer.log_dir).relative_to(plan.output_dir).as_posix())  # its own
    if plan.script_args.warm_start and plan.checkpoint is None:
        grpo.warm_start(model, tokenizer, prompt, plan.script_args, plan.training_args, state, writer)
    trainer, ctrl_c, bar = grpo.make_trainer(model, tokenizer, settings, plan, state, writer)
    del model  # the trainer holds it; the save step may release it to check a merged copy alone
    if run_grpo(trainer, ctrl_c, bar, plan.checkpoint):
        step = trainer.state.global_step
        log.info(f"stopped by Ctrl-C after step {step}, saved as {plan.output_dir / f'checkpoint-{step}'}; "
                 "--resume auto continues")  # fmt: skip
        return 130
    return save(trainer, tokenizer, settings, plan)


def hold_the_folder(plan, state) -> None:
    """The output folder held by the main process (run_folder.take: its lock first, then what it holds, read once, and
    what this run may do there), its checkpoint to continue from checked against the options, then its record written
    (with --overwrite_output_dir, the earlier run's claims deleted now: every check has passed). Every rank learns the
    verdict: the checkpoint, or the one line that stops the run (exit 2, or 0 for a run already at its end)."""
    verdict = None
    if state.is_main_process:
        resume = plan.script_args.resume or plan.training_args.resume_from_checkpoint
        try:
            held = run_folder.take(plan.output_dir, resume=resume, overwrite=plan.script_args.overwrite_output_dir,
                                   max_steps=plan.training_args.max_steps)  # fmt: skip
            try:
                if held.checkpoint is not None:
                    checkpoint_state.check_checkpoint(held.checkpoint, plan.training_args, plan.model_args, plan.output_dir)
                held.start(push_to_hub=plan.training_args.push_to_hub)
            except BaseException:
                held.release()
                raise
            HELD.append(held)
            verdict = ("go", held.checkpoint, held.notes)
        except (run_folder.FolderRefused, checkpoint_state.ResumeRefused) as exc:
            verdict = ("refused", str(exc), 2)
        except run_folder.Finished as exc:
            verdict = ("finished", str(exc), 0)
        except OSError as exc:
            verdict = ("refused", f"output_dir {plan.output_dir}: {options.one_line(exc)}", 2)
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        verdict = broadcast_object_list([verdict])[0]
    if verdict[0] == "go":
        plan.checkpoint, plan.notes = verdict[1], [*verdict[2], *plan.notes]
        return
    if not state.is_main_process:
        raise SystemExit(verdict[2])  # the main process says why
    if verdict[0] == "finished":
        raise run_folder.Finished(verdict[1])
    die(verdict[1])


def announce(plan, state) -> None:
    """The run's first lines: what trains where, the notes of the checks, what a resume continues."""
    log.info(f"train_2048: {plan.model_args.model_name_or_path} on the {plan.backend} backend, writing to "
             f"{plan.output_dir}")  # fmt: skip
    log.info(sandbox.describe_walls(sandbox.walls()))  # what a strategy the model writes can reach here
    for note in plan.notes:
        log.warning(note)
    if plan.merge_source is not None:
        log.info(f"--save_method merged_16bit: merge_2048.py will merge the LoRA into {plan.merge_source} after training")
    if state.num_processes > 1:
        log.info(f"{state.num_processes} processes ({state.distributed_type.value}), each scoring its own completions")
    if plan.checkpoint is not None:
        log.info(f"resuming from {plan.checkpoint}")
        if state.is_main_process:
            checkpoint_state.drop_later_metrics(plan.output_dir / "metrics.jsonl", plan.checkpoint)
    elif (plan.script_args.resume or plan.training_args.resume_from_checkpoint) == "auto":
        log.info("--resume auto: no checkpoint yet, starting at step 0")


def load_or_leave(plan, prompt: str, state):
    """(model, tokenizer), with the checks that need them; a model that does not load, or LoRA options it cannot take
    (models.LoraRefused, which names them), leaves the folder as it was (the run's own files removed) and ends the run
    with one line."""
    try:
        model, tokenizer = load_policy(plan.script_args, plan.training_args, plan.model_args, plan.backend, prompt,
                                       state, plan.output_dir)  # fmt: skip
    except SystemExit:  # a check of the loaded model said no (its one line is printed)
        leave_as_found(state)
        raise
    except Exception as exc:  # not on the hub, no network, damaged or foreign files: all the user's to fix
        log.debug("the model did not load", exc_info=True)  # the traceback, in training.log
        leave_as_found(state)
        if isinstance(exc, models.LoraRefused):
            die(str(exc))
        die(f"cannot load model {plan.model_args.model_name_or_path}: {options.one_line(exc, 300)}")
    if plan.checkpoint is not None:
        compare_adapters(model, plan.checkpoint)
    problem = options.warm_start_problem(tokenizer, prompt, plan.script_args) if plan.checkpoint is None else None
    if problem:
        leave_as_found(state)
        die(problem)
    if plan.model_args.model_name_or_path != demo_data.TINY:  # the demo's budget is its example answers' (test_train)
        reasoning = (plan.training_args.chat_template_kwargs or {}).get("reasoning_effort", "low")
        unsloth_length = plan.script_args.max_seq_length if plan.backend == "unsloth" else None
        for line in rewards.budget_warnings(tokenizer, plan.settings, plan.training_args.max_completion_length,
                                            reasoning, unsloth_length):  # fmt: skip
            log.warning(line)
    return model, tokenizer


def leave_as_found(state) -> None:
    """A new run that stops before it trained: the folder as it was before it (run_folder.Held.leave_as_found: what the
    run made, by its record), so that the next run starts there without a word."""
    if state.is_main_process and HELD:
        HELD[-1].leave_as_found()


def save(trainer, tokenizer, settings, plan) -> int:
    """The verified save (final/, and the merge with --save_method merged_16bit), and the run's last line."""
    import evaluation
    import trainer as grpo

    steps = trainer.state.global_step
    ok = saving.save_and_verify(
        trainer, tokenizer, save_method=plan.script_args.save_method, verify=plan.script_args.verify_save,
        use_peft=plan.model_args.use_peft, backend=plan.backend, seed=plan.training_args.seed,
        output_dir=plan.output_dir, merge_base=plan.merge_source,
        prompt_inputs=evaluation.prompt_inputs(tokenizer, settings, plan.training_args.chat_template_kwargs or {}),
    )  # fmt: skip
    log.info(f"done after {steps} steps: {grpo.adapters_said(trainer, plan.output_dir)}. TensorBoard: "
             f"{grpo.tensorboard_command(plan.output_dir)} (its Custom Scalars tab, #custom_scalars, has the charts that "
             "say whether it learned)")  # fmt: skip
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # accelerate launch / torchrun: one process per rank
    rc = None
    try:
        try:
            backend, cuda = options.choose_backend(options.early_options(argv))
        except options.OptionError as exc:
            die(str(exc))
        sandbox.start()  # a fresh interpreter (not a fork), started before CUDA is used: one per process
        rc = train(argv, backend, cuda)
    except run_folder.Finished as finished:  # a resume of a run at its end: nothing to do
        print(f"train_2048: {finished}")
        rc = 0
    except KeyboardInterrupt:  # Ctrl-C, in the imports too
        print("train_2048: interrupted", file=sys.stderr)
        rc = 130
    finally:
        sandbox.shutdown()
        while HELD:  # the output folder's lock (the kernel would release it at exit; a test runs several in a process)
            HELD.pop().release()
    if world > 1:  # the sign that this rank got through (the test of the 2-process run reads it)
        print(f"train_2048: rank {os.environ.get('RANK', '?')}/{world} finished, exit status {rc}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
