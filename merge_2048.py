"""Merge a run's LoRA adapters into their 16-bit base model, and prove the merge.

    python merge_2048.py --adapter outputs/final            # into outputs/final-merged_16bit
    python merge_2048.py --adapter outputs/checkpoint-300   # any checkpoint a run saved
    python merge_2048.py --adapter outputs/final --base unsloth/gpt-oss-20b-BF16 --output_dir merged

`train_2048.py --save_method merged_16bit` runs this on final/ after training; run it yourself to merge again without
training (after a merge that failed, or from a checkpoint). The base is the 16-bit checkpoint of the model the adapters
were trained on (adapter_config.json names it; --base names another): the default preset's 4-bit checkpoint, and its
MXFP4 original, merge into the BF16 copy of the same weights, unsloth/gpt-oss-20b-BF16 (merging.SIXTEEN_BIT_ORIGINAL).
transformers loads it with its own classes (on the GPU when there is one), PEFT merges, and the merged model goes to a
temporary folder, published only when the merge is right: into a new folder or an empty one, or with
--overwrite_output_dir over an earlier merge's own files (its mark lists them; anything else there stays).

The merge is judged by merging.merge_adapters: every merged weight against the base weight plus the adapters' product
computed from the adapter's own files, rounded as a 16-bit merge must round; the merged model, reloaded with
transformers' own classes, against the same base with the adapters applied unmerged. 16-bit weights cannot hold a
LoRA change below half a weight's last digit, and a real run's adapters are mostly that small: what the merge kept is
measured and said in one line and in <output_dir>/merge_report.json, with the advice that follows.

Exit status: 0 a correct merge, whatever 16 bits keep of the adapters; 1 a wrong merge (nothing published); 2 bad
input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import merging  # these: the standard library only at import; the heavy imports wait until the inputs are checked
import models
import run_folder
import saving
import trained_base
import user_files

log = logging.getLogger("train_2048.merge")


@dataclass
class MergeArguments:
    """What to merge, into what, and where."""

    adapter: str = field(metadata={"help": "The LoRA adapter folder: a run's final/ or one of its checkpoint-N."})
    base: str | None = field(
        default=None,
        metadata={"help": "The 16-bit checkpoint to merge into (a folder or a hub id). Default: the model "
                  "adapter_config.json names, or its 16-bit original."},
    )  # fmt: skip
    output_dir: str | None = field(
        default=None, metadata={"help": "Where the merged model goes. Default: <adapter>-merged_16bit beside it."}
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Replace output_dir when it exists (never otherwise)."}
    )
    log_file: str | None = field(
        default=None, metadata={"help": "Also append the log to this file (train_2048.py passes its training.log)."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the sampled completions the distributions are compared on."})


USAGE = "merge_2048.py --adapter FOLDER [--base MODEL] [--output_dir FOLDER] [--option VALUE ...]"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the usage examples as written and shows every default."""


def die(message: str) -> None:
    """Bad input: one line, exit status 2, no traceback."""
    print(f"merge_2048: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv: list[str] | None) -> MergeArguments:
    """The options; a mistake (an unknown option, a value of the wrong kind, --adapter not given) is one line and exit
    status 2, as train_2048.py's are, never argparse's usage block. --help prints the whole help."""
    from transformers import HfArgumentParser

    import options

    parser = HfArgumentParser(MergeArguments, prog="merge_2048.py", usage=USAGE, description=__doc__,
                              formatter_class=HelpFormatter, allow_abbrev=False, exit_on_error=False)  # fmt: skip
    required = [action for action in parser._actions if action.required]
    for action in required:  # Python 3.11's argparse exits with its usage for these even so: checked below instead
        action.required = False
    try:
        namespace, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    except argparse.ArgumentError as error:
        die(f"{(error.argument_name or '').split('/')[0]}: {error.message}")
    if rest:
        die(options.unknown(parser, rest[0]))
    for action in required:
        if getattr(namespace, action.dest) is None:
            said = action.help[0].lower() + action.help[1:].rstrip(".")
            die(f"{action.option_strings[0]} is required ({said}; --help lists every option)")
    return MergeArguments(**vars(namespace))


def check_inputs(args: MergeArguments) -> tuple[Path, str, Path, str | None]:
    """(adapter folder, base checkpoint, output folder, how the weights it was trained on were quantized), checked
    with nothing loaded: one line and exit 2 otherwise.
    An existing output folder is replaced only with --overwrite_output_dir, and only when a merge wrote it."""
    adapter = Path(args.adapter).expanduser()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (adapter / name).is_file():
            die(f"--adapter {args.adapter}: no {name} there (not a LoRA adapter folder: a run's final/ or checkpoint-N)")
    config, problem = models.adapter_config_problem(adapter)
    if problem:
        die(f"--adapter {args.adapter}: {problem}")
    try:  # --base, else the recorded path, the same name in the run folder, the hub name (trained_base.resolve_base)
        trained_on = trained_base.resolve_base(adapter, args.base, "--base")
        quantized = trained_base.trained_quantized(adapter, config.get("base_model_name_or_path"))  # its record, checked
    except ValueError as error:
        die(f"--adapter {args.adapter}: {error}")
    problem = models.lora_width_problem(config, trained_on)
    if problem:
        die(f"--adapter {args.adapter}: {problem}")
    try:
        base = merging.merge_base(trained_on)
    except ValueError as error:
        source = "--base" if args.base else f"the model {adapter} was trained on"
        die(f"{source}: {error}; --base names the 16-bit checkpoint of the same weights")
    output = Path(args.output_dir).expanduser() if args.output_dir else adapter.resolve().with_name(
        adapter.resolve().name + "-merged_16bit")  # fmt: skip
    problem = user_files.name_problem(output)
    if problem:
        die(f"--output_dir: {problem}" + ("" if args.output_dir else " (the default, <adapter>-merged_16bit: name "
                                          "another --output_dir)"))  # fmt: skip
    for kept, what in ((adapter, "the adapter"), (Path(base).expanduser(), "the base")):
        if kept.exists() and (output.resolve() == kept.resolve() or output.resolve() in kept.resolve().parents):
            die(f"--output_dir {output} holds {what} ({kept}): the merge goes elsewhere")
    check_output(output, args.overwrite_output_dir)
    if args.log_file:
        try:
            Path(args.log_file).open("a").close()
        except OSError as error:
            die(f"--log_file {args.log_file}: cannot write to it ({error.strerror or error})")
    return adapter, base, output, quantized


def check_output(output: Path, overwrite: bool) -> None:
    """Where the merge may go: a new name, an empty folder, or with --overwrite_output_dir a merge's own folder (its
    MARK lists the files it wrote: those are replaced, anything else there stays); never a folder inside one a command
    published or a run claims. One line and exit 2 otherwise, nothing touched."""
    inside = run_folder.inside_a_run(output.parent)  # the folder itself may be a merge's, or the run's own name
    if inside:
        die(f"--output_dir {output} {inside}: name a folder outside it")
    if not (output.exists() or output.is_symlink()):
        return
    if output.is_symlink() or not output.is_dir():
        die(f"--output_dir {output} exists and is not a folder (a link, or a file): name another --output_dir")
    foreign = run_folder.not_published_by(output, "merge_2048")
    if foreign:
        die(f"--output_dir {output} holds {', '.join(foreign[:3])}, and merge_2048 did not write it (no {saving.MARK} "
            "of a merge lists it: a folder of yours, a copy, or an older merge whose mark lists no files): name another "
            "--output_dir (a new or empty folder)")  # fmt: skip
    if any(output.iterdir()) and not overwrite:
        die(f"--output_dir {output} exists (an earlier merge): --overwrite_output_dir replaces the files that merge "
            "wrote (nothing else there), or name another --output_dir")  # fmt: skip


def start_logging(log_file: str | None) -> None:
    """Plain lines on the console; with --log_file, the same with time and level appended to that file."""
    console = logging.StreamHandler(sys.stdout)
    handlers: list[logging.Handler] = [console]
    if log_file:
        to_file = logging.FileHandler(log_file)
        to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        handlers.append(to_file)
    logger = logging.getLogger("train_2048")  # models' lines too
    logger.handlers = handlers
    logger.setLevel(logging.INFO)
    logger.propagate = False


def advice(report: dict, adapter: Path, quantized: str | None = None) -> str:
    """What the merged model is, for the user: with `quantized` (the adapters were trained on NF4 or MXFP4 weights and
    merged into the 16-bit original) never "the trained one", which it is not."""
    if report["kept"] is None:
        return "the adapters change no weight (LoRA B is zero: nothing was learned), so the merged model is the base"
    trained = (f"the adapters were trained on {quantized.upper()} weights and are merged into the 16-bit original: the "
               f"merged model is that original plus the adapters, not the {quantized.upper()} model that was trained "
               "(quantization moves a weight by more than the adapters do), so evaluate it before serving it"
               ) if quantized else None  # fmt: skip
    if report["kept"] >= merging.MERGED_KEPT:
        return trained or "16-bit weights hold the adapters: the merged model is the trained one"
    return (f"16-bit weights cannot hold what the adapters learned, so the adapters ({adapter}) are the faithful "
            "result: serve them on the base, or merge again after a longer run, whose larger changes 16 bits keep"
            + (f"; and {trained}" if trained else ""))  # fmt: skip


def summary(report: dict, output: Path) -> str:
    """The one line a correct merge ends with."""
    said = (f"verified {output}: a correct merge, every weight the base's plus the adapters' rounded to "
            f"{report['dtype']} ({report['adapted_tensors']} tensors changed, {report['tensors']} checked)")  # fmt: skip
    if report["kept"] is not None:
        said += (f"; 16-bit keeps {report['kept']:.3f} of the adapters' change ({report['rounded_away']} of the "
                 f"{report['changed_weights']} weights they change rounded back to the base's)")  # fmt: skip
    if report["kept_effect"] is not None:
        said += (f", and {report['kept_effect']:.3f} ± {report['kept_effect_error']:.3f} of their effect on the "
                 f"next-token distributions (KL to the unmerged model {report['kl_to_unmerged']:.2g} nats/token, "
                 f"the adapters' own {report['adapters_kl']:.2g})")  # fmt: skip
    if report["kept_effect"] is None and report.get("distributions"):
        said += f" ({report['distributions']})"
    return f"{said}; {report['advice']}; report: {output / 'merge_report.json'}"


def merge(args: MergeArguments) -> int:
    adapter, base_name, output, quantized = check_inputs(args)
    start_logging(args.log_file)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        base = merging.checkpoint_folder(base_name)  # a hub checkpoint is downloaded unless cached
    except Exception as error:  # noqa: BLE001 - the hub's errors (no network, no such file): one line
        die(f"cannot fetch {base_name}: {type(error).__name__}: {models.one_line(error)}")
    missing = merging.missing_weights(base, base_name)
    if missing:
        die(missing)
    damage = models.weights_damage(base)
    if damage:
        die(f"the base {base_name}: {damage}")
    other, note = trained_base.compare_base(adapter, base, base_name)
    if other:
        die(f"{other}; --base names the 16-bit checkpoint of the same weights")
    if note:
        log.warning(note)
    try:
        products, whole = merging.adapter_products(adapter, merging.tensor_shapes(base))
    except ValueError as error:
        die(str(error))
    try:
        tmp = saving.fresh(output)
    except OSError as error:
        die(f"--output_dir {output}: cannot write there ({error.strerror or error})")
    pairs = sum(len(p) for p in products.values())
    log.info(f"merging {adapter} ({pairs} LoRA pairs on {len(products)} tensors, {len(whole)} trained in full) into "
             f"{base_name}, to {output}")  # fmt: skip
    try:  # whatever happens before the publish, no half-written or unpublished merge is left beside the adapters
        try:
            report = merging.merge_adapters(adapter, base, tmp, products, whole, seed=args.seed)
        except ValueError as error:
            die(str(error))
        report.update(base=base_name, merged=str(output), trained_on_quantized=quantized,
                      advice=advice(report, adapter, quantized))  # fmt: skip
        if report["wrong"]:
            more = f" (and {len(report['wrong']) - 3} more)" if len(report["wrong"]) > 3 else ""
            log.error(f"{output}: the merge is wrong, so nothing was published: {'; '.join(report['wrong'][:3])}"
                      f"{more}; the adapters in {adapter} are untouched")  # fmt: skip
            return 1
        (tmp / "merge_report.json").write_text(json.dumps(report, indent=1) + "\n")
        try:
            saving.publish(tmp, output, "merge_2048")
        except saving.NotOurs as error:  # a folder put there since the start: left as it is
            die(f"--output_dir {error}")
    finally:
        if tmp.exists():  # published: renamed away
            shutil.rmtree(tmp, ignore_errors=True)
    holds = report["kept"] is None or (report["kept"] >= merging.MERGED_KEPT and not quantized)
    log.log(logging.INFO if holds else logging.WARNING, summary(report, output))
    return 0


def main(argv: list[str] | None = None) -> int:
    models.quiet_library_imports()  # before peft, which imports bitsandbytes
    args = parse_args(argv)
    try:
        return merge(args)
    except KeyboardInterrupt:
        print("merge_2048: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
