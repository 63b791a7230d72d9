"""What a run writes, put in place whole and proven: folders written apart and published (fresh, publish), marked with
the command and the files it wrote (MARK), so a later save replaces those files and nothing else; and the final save: the LoRA adapters checked against the trained ones
(save_and_verify, verify_adapter), the merged 16-bit model through merge_2048.py, Unsloth's MXFP4 export.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import models
import run_folder

log = logging.getLogger("train_2048.saving")

MARK = run_folder.MARK  # in every folder publish() puts in place: {"by": the command, "files": what it wrote}


class NotOurs(ValueError):
    """A folder in the way that this project did not write: never replaced, never deleted."""


def fresh(path: Path) -> Path:
    """A new empty folder beside `path` to write into, named as no user names a folder (.train_2048-XXXXXXXX, with
    the mode the user's umask gives a folder): never `<path>.tmp`, which may be the user's. publish() moves it into
    place when it is complete. The run that holds the folder beside claims it (run_folder.claim)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = run_folder.make_folder(path.parent, ".train_2048-")
    run_folder.claim(path.parent, tmp.name)
    return tmp


def written_by(path: Path) -> str | None:
    """Which of our commands published the folder `path` (its MARK), or None: a user's folder, or not a folder."""
    return run_folder.marked_by(path)


def publish(tmp: Path, path: Path, by: str) -> None:
    """Put the fully written folder `tmp` in place as `path`, marked `by`'s: MARK lists each file it holds with its size
    and modification time. A new name, or an empty folder: `tmp` is renamed to it, so it appears whole. A folder `by`
    published before: its own files (what its MARK lists, unchanged since) are replaced file by file from `tmp`, and
    nothing else in it is touched (a user's notes, an evaluation's folder). NotOurs, with nothing touched, when `path`
    is a link or a file, holds files and no MARK of `by`'s, or holds a name `tmp` writes that is not `by`'s."""
    tmp_fd = os.open(tmp, run_folder.FOLDER_FLAGS)
    try:
        files = run_folder.listing(tmp_fd)
        run_folder.write_through(tmp_fd, MARK, json.dumps({"by": by, "files": files}) + "\n")
        try:
            os.rename(tmp, path)  # a new name (or an empty folder): the whole folder at once
            run_folder.unclaim(path.parent, tmp.name)
            return
        except OSError:
            if not (path.exists() or path.is_symlink()):
                raise
        try:
            fd = os.open(path, run_folder.FOLDER_FLAGS)
        except OSError:
            raise NotOurs(f"{path} exists and is not a folder {by} wrote (a link, or a file): it is left as it is") from None
        try:
            replace_own_files(tmp_fd, fd, files, path, by)
        finally:
            os.close(fd)
    finally:
        os.close(tmp_fd)
    shutil.rmtree(tmp, ignore_errors=True)  # its MARK alone is left there
    run_folder.unclaim(path.parent, tmp.name)


def replace_own_files(tmp_fd: int, fd: int, files: dict, path: Path, by: str) -> None:
    """publish() into an existing folder: `by`'s own files there replaced by `files` (in `tmp_fd`), one rename each,
    through the folders' descriptors. Its MARK is written first listing the old and the new files together, so a
    stop half-way leaves only files it lists; then the new ones alone."""
    own, mark = run_folder.own_files(fd, by), run_folder.read_mark(fd)
    there = set(os.listdir(fd)) - {MARK}
    clash = sorted((there - own) & files.keys() if mark and mark["by"] == by else there)
    if clash:
        others = sorted(there - own)
        raise NotOurs(f"{path} holds {', '.join(clash[:3])}, which {by} did not write (no {MARK} of its own lists "
                      f"it{'; also there: ' + ', '.join(others[:3]) if others != clash else ''}): it is left as it "
                      "is")  # fmt: skip
    before = {name: mark["files"][name] for name in own}
    run_folder.write_through(fd, MARK, json.dumps({"by": by, "files": {**before, **files}}) + "\n")
    for name in sorted(own - files.keys()):
        if run_folder.kind(fd, name) == "folder":
            shutil.rmtree(name, dir_fd=fd)
        else:
            os.unlink(name, dir_fd=fd)
    for name in sorted(files):
        if name in own and run_folder.kind(fd, name) == "folder":
            shutil.rmtree(name, dir_fd=fd)
        os.replace(name, name, src_dir_fd=tmp_fd, dst_dir_fd=fd)
    run_folder.write_through(fd, MARK, json.dumps({"by": by, "files": files}) + "\n")


# --- saving, and proving the save ------------------------------------------------------------------------------


def save_and_verify(trainer, tokenizer, *, save_method: str, verify: bool, use_peft: bool, backend: str,
                    prompt_inputs, seed: int, output_dir: Path, merge_base: str | None = None) -> bool:  # fmt: skip
    """LoRA adapters (and the tokenizer) to <output_dir>/final always. With `verify`, its tensors must equal the trained
    adapters exactly, and, loaded beside them as a second adapter of the same model, it must sample the same seeded
    tokens (verify_adapter: only the adapters held twice).

    merged_16bit: the trained model is released, and merge_2048.py merges final/ into `merge_base` (the 16-bit weights
    train_2048 found before training) in a process of its own, as it merges any saved adapter later: into
    final-merged_16bit, judged as merging.merge_adapters says. mxfp4: Unsloth's own export (unsloth_mxfp4).

    Returns False when a check fails. Every process calls this (sharded models save together); the main writes.
    """
    from accelerate.utils import broadcast_object_list

    final = output_dir / "final"
    main = trainer.accelerator.is_main_process
    name = [fresh(final).name if main else None]
    broadcast_object_list(name)  # every process saves its part into the folder the main one made
    tmp = output_dir / name[0]
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(tmp))  # with train_2048_base.json (trainer.py's save_model)
    if not main:
        return True
    try:
        publish(tmp, final, "train_2048")
    except NotOurs as error:
        log.error(f"{error}; the adapters are in {tmp}")
        return False
    log.info(f"saved the LoRA adapters and the tokenizer to {final}")
    model, ok = trainer.model, True
    trainer.optimizer = trainer.lr_scheduler = None  # room for the checks
    models.empty_cuda_cache()
    if backend == "unsloth":
        from unsloth import FastLanguageModel

        FastLanguageModel.for_inference(model)
    if verify and use_peft:
        ok &= verify_adapter(model, tokenizer, final, prompt_inputs, seed)
    if save_method == "mxfp4":
        return ok & unsloth_mxfp4(model, tokenizer, output_dir / "final-mxfp4")
    if save_method == "merged_16bit":
        del model
        release(trainer)  # the merge loads the 16-bit base: a 20B model does not fit twice on one GPU
        log_file = output_dir / "training.log"  # train_2048's, opened by start_logging (never through a link)
        return ok & merge_in_fresh_process(final, merge_base, output_dir / "final-merged_16bit",
                                           log_file if log_file.is_file() else None)  # fmt: skip
    return ok


def unsloth_mxfp4(model, tokenizer, folder: Path) -> bool:
    """Unsloth's MXFP4 export (train_2048 refuses it at startup where Unsloth's llm-compressor cannot run). A quantized
    checkpoint is not base + adapters to the bit, so it is not judged here: evaluate_2048.py --model plays it."""
    tmp = fresh(folder)
    try:
        model.save_pretrained_merged(str(tmp), tokenizer, save_method="mxfp4")
        publish(tmp, folder, "train_2048")
    except Exception as error:  # noqa: BLE001 - after training, one line: final/ holds the adapters
        shutil.rmtree(tmp, ignore_errors=True)
        log.error(f"{folder}: Unsloth's mxfp4 save failed ({type(error).__name__}: "
                  f"{models.one_line(error, 400)}); final/ holds the adapters")  # fmt: skip
        log.debug("the mxfp4 save failed", exc_info=True)
        return False
    log.warning(f"saved {folder} (Unsloth's mxfp4 export, not checked: evaluate_2048.py --model {folder} plays it)")
    return True


def merge_in_fresh_process(adapter: Path, base: str, folder: Path, log_file: Path | None = None) -> bool:
    """merge_2048.py on `adapter`, in a process of its own (transformers' own classes: Unsloth swaps GPT-OSS's expert
    classes process-wide), its lines on this console and appended to `log_file` (training.log). True for a correct
    merge. The file is named, not looked for among the handlers: train_2048 writes it through a StreamHandler."""
    logger = logging.getLogger("train_2048")
    for handler in logger.handlers:
        handler.flush()
    command = [sys.executable, str(Path(__file__).with_name("merge_2048.py")), "--adapter", str(adapter), "--base",
               str(base), "--output_dir", str(folder), "--overwrite_output_dir"]  # fmt: skip
    command += ["--log_file", str(log_file)] if log_file else []
    result = subprocess.run(command, stderr=subprocess.PIPE, text=True)
    if result.returncode == 0 or (result.returncode == 1 and "Traceback" not in result.stderr):
        return result.returncode == 0  # its own line said how the merge went
    said = [line for line in result.stderr.splitlines() if line.strip()] or [f"exit status {result.returncode}"]
    log.error(f"{folder}: the merge failed ({said[-1][:400]}); final/ holds the adapters, and `python merge_2048.py "
              f"--adapter {adapter}` merges them later")  # fmt: skip
    return False


def verify_adapter(model, tokenizer, folder: Path, prompt_inputs, seed: int) -> bool:
    """The saved adapters are the trained ones: the same tensors, and loaded as a second adapter of the same model,
    the same seeded samples. Catches a save that drops or renames tensors (unsloth-zoo issue 885 dropped GPT-OSS's
    per-expert LoRA once), with only the adapters held twice."""
    import copy

    import torch
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(folder / "adapter_model.safetensors"))
    trained = {k: v.detach().to("cpu") for k, v in get_peft_model_state_dict(model).items()}
    if saved.keys() != trained.keys():
        lost, extra = sorted(trained.keys() - saved.keys()), sorted(saved.keys() - trained.keys())
        log.error(f"{folder}: the save lacks {len(lost)} trained tensors ({lost[:3]}) and has {len(extra)} others")
        return False
    differ = [k for k in trained if not torch.equal(trained[k], saved[k])]
    if differ:
        log.error(
            f"{folder}: {len(differ)} of {len(trained)} saved tensors differ from the trained ones ({differ[:3]})"
        )
        return False
    active = model.active_adapter
    expected = models.seeded_samples(model, tokenizer, prompt_inputs, seed)
    try:
        model.add_adapter("saved", copy.deepcopy(model.peft_config[active]))
        loaded = set_peft_model_state_dict(model, saved, adapter_name="saved")
        model.set_adapter("saved")
        got = models.seeded_samples(model, tokenizer, prompt_inputs, seed)
    except Exception as exc:  # a backend whose adapters cannot be doubled (untested on Unsloth's fused experts)
        log.warning(f"{folder}: its {len(saved)} tensors equal the trained ones, but it could not be loaded beside "
                    f"them to sample ({type(exc).__name__}: {exc})")  # fmt: skip
        return True
    finally:
        if "saved" in model.peft_config:
            model.set_adapter(active)
            model.delete_adapter("saved")
    if loaded.unexpected_keys or got != expected:
        log.error(f"{folder}: loaded as an adapter, it samples {sum(a != b for a, b in zip(expected, got))} of "
                  f"{len(got)} seeded completions differently ({len(loaded.unexpected_keys)} unexpected keys)")  # fmt: skip
        return False
    log.info(f"verified {folder}: its {len(saved)} tensors equal the trained adapters, and reloaded it samples the "
             f"same {len(got)} seeded completions")  # fmt: skip
    return True


def release(trainer) -> None:
    """Let go of the trained model, its optimizer and the accelerator's references, so that another model can be
    loaded alone (a 20B model does not fit twice on one GPU)."""
    import gc

    trainer.accelerator.free_memory()
    trainer.model = trainer.model_wrapped = trainer.callback_handler.model = None
    gc.collect()
    models.empty_cuda_cache()
