"""The merge: a run's LoRA adapters merged into their 16-bit base model with the libraries' own code, and judged.

merge_base names the 16-bit checkpoint adapters merge into; adapter_products reads what the adapter adds to each base
tensor from its own files; merge_adapters merges (transformers and PEFT) and then judges the result: judge_weights
compares every merged weight with the base's plus those products, rounded as a 16-bit merge must round, and the merged
model's next-token distributions are compared with the unmerged model's (kept_effect). merge_2048.py is its command.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import models

# The 16-bit checkpoint a merge reads, for hub checkpoints that are not one: Unsloth's split 4-bit ones
# (models.FUSED_CHECKPOINT) and the MXFP4 originals (the default preset's unsloth/gpt-oss-20b) hold the same weights as these BF16 copies.
SIXTEEN_BIT_ORIGINAL = {
    **models.FUSED_CHECKPOINT,
    "unsloth/gpt-oss-20b": "unsloth/gpt-oss-20b-BF16",
    "unsloth/gpt-oss-120b": "unsloth/gpt-oss-120b-BF16",
}
# A correct merge whose 16-bit weights keep less than this share of the adapters' change is reported with the advice to
# serve the adapters instead (16-bit rounding erases a LoRA change below half a weight's last digit: docs/PERF.md).
MERGED_KEPT = 0.95

# --- merging adapters into their 16-bit base, and proving the merge ------------------------------------------------
# A merge writes round16(W + scale * B @ A). 16-bit weights cannot hold a LoRA change below half a weight's last digit
# (bf16 keeps 8 significant bits), so a real run's small adapters are partly rounded away by a correct merge: that is
# measured and reported, never failed. What fails is a merge that is not base + adapters: each merged weight is judged
# against the base weight the merge read plus the adapters' product computed here from the adapter's own files (not
# from the model PEFT built from them), so a LoRA that the loading or the merge lost, a wrong scale or a dropped module
# shows wherever its change crosses a rounding boundary, which some weights' changes do at any adapter size (the
# smallest weights have the finest 16-bit digits).
MERGED_SHARD = "5GB"  # the merged checkpoint's shards: transformers' default is 50GB, more than many uploads take
MERGE_SLACK = 2.0**-16  # of |scale| |B| |A|: the float32 arithmetic of the product (merge_rounding_once rounds once)
SUM_SLACK = 2.0**-20  # of |W|: the float32 arithmetic of the sum


@dataclass
class Product:
    """One LoRA pair of an adapter, on one tensor of the merged model: scale * B @ A on a Linear's weight (out, in);
    on one expert's slice of a fused GPT-OSS expert tensor (Unsloth's split experts: a Linear per expert, whose weight
    is the transpose of its slice); or on every slice (PEFT's LoRA on the fused tensor, as attach_split_expert_lora
    lays it out: A (experts * r, in), B (out, r * experts))."""

    a: Any
    b: Any
    scale: float
    expert: int | None = None  # a split expert: the one slice it changes
    experts: int = 0  # a fused tensor: how many slices, each with its own rank-r pair

    def pair(self, expert: int | None, transposed: bool):
        """(A, B, whether the slice holds (B @ A).T) on a 2-D tensor (expert None) or on slice `expert` of a 3-D one;
        None where this pair changes nothing. `transposed`: the fused tensor is (experts, in, out), as GPT-OSS's."""
        if self.experts:
            rank = self.a.shape[0] // self.experts
            a = self.a.view(self.experts, rank, -1)[expert]
            return a, self.b.view(self.b.shape[0], rank, self.experts)[:, :, expert], transposed
        if self.expert is not None:
            return (self.a, self.b, True) if expert == self.expert else None
        return self.a, self.b, False


def merge_base(name: str) -> str:
    """The 16-bit checkpoint that adapters trained on `name` merge into, asked of its config.json (a local folder's, else
    the hub's, from the cache first): `name` itself when it is stored unquantized, its BF16 copy for the hub checkpoints
    of SIXTEEN_BIT_ORIGINAL; ValueError saying why there is none."""
    base = SIXTEEN_BIT_ORIGINAL.get(name, name)
    quantization = read_config(base).get("quantization_config") or {}
    if quantization.get("load_in_4bit"):
        raise ValueError(f"{base} is stored in 4-bit ({quantization.get('bnb_4bit_quant_type', 'bitsandbytes')}), and a "
                         "merge needs the 16-bit weights it was made from")  # fmt: skip
    if quantization:
        raise ValueError(f"{base} is stored quantized ({quantization.get('quant_method', 'unknown')}), and a merge needs "
                         "the 16-bit weights of the same model")  # fmt: skip
    return base


def read_config(name: str) -> dict:
    """A checkpoint's config.json: a local folder's, or the hub's (its cache first); ValueError when there is none."""
    local = Path(name).expanduser()
    if local.is_dir() or name.startswith((".", "/", "~")):
        path = local / "config.json"
    else:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            path = Path(hf_hub_download(name, "config.json"))
        except RepositoryNotFoundError as error:
            raise ValueError(f"{name}: no such model on the Hugging Face hub, and no such folder here") from error
        except Exception as error:  # offline (HF_HUB_OFFLINE) or no network, and not in the cache
            raise ValueError(f"{name} cannot be reached on the Hugging Face hub from here, and is not in its cache "
                             f"({models.one_line(error, 200)})") from error  # fmt: skip
    import user_files

    try:
        config = user_files.read_json(path, what="config.json")
    except user_files.FileRefused as error:
        raise ValueError(f"{name} is not a model folder (no readable config.json: {error})") from error
    if not isinstance(config, dict):
        raise ValueError(f"{name} is not a model folder (its config.json is not a record)")
    return config


def checkpoint_folder(name: str) -> Path:
    """A checkpoint's files here: a local folder as it is; a hub checkpoint's configuration, tokenizer and safetensors
    (top level only: the hub's GPT-OSS repos keep other formats in subfolders), downloaded unless cached."""
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"],
                                  ignore_patterns=["*/*"]))  # fmt: skip


def missing_weights(folder: Path, name: str) -> str | None:
    """Why the checkpoint `name` in `folder` has no weights here (None: every shard its index names is there): a hub
    snapshot cached in part (config.json alone, after a config look-up) is a folder without them."""
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            needed = sorted({p.name for p in models.tensor_files(folder).values()})
        except ValueError as error:
            return str(error)
        absent = [shard for shard in needed if not (folder / shard).is_file()]
        if absent:
            return (f"{name}: {len(absent)} of the {len(needed)} weight files its index names are not in {folder} "
                    f"({', '.join(absent[:3])}): download them, or run where the hub can be reached")  # fmt: skip
        return None
    if not shards:
        held = ", ".join(sorted(p.name for p in folder.iterdir())[:4]) or "nothing"
        return (f"{name}: its weights (*.safetensors) are not in {folder} (it holds {held}): a hub checkpoint cached in "
                "part; download it, or run where the hub can be reached")  # fmt: skip
    return None


def tensor_shapes(folder: Path) -> dict[str, tuple]:
    """Each tensor's shape, read from the shards' headers (nothing loaded)."""
    from safetensors import safe_open

    shapes, by_shard = {}, {}
    for name, shard in models.tensor_files(folder).items():
        by_shard.setdefault(shard, []).append(name)
    for shard, names in by_shard.items():
        with safe_open(str(shard), framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in names})
    return shapes


def adapter_products(folder: Path, shapes: dict[str, tuple]) -> tuple[dict[str, list[Product]], dict]:
    """What the adapter in `folder` adds to each tensor of a base with these tensor shapes, read from the adapter's own
    files: ({tensor: [Product]}, {tensor: its whole trained value} for modules trained in full, modules_to_save).
    ValueError for an adapter that does not fit the base, or that holds what merge_2048 does not merge."""
    import math

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config, problem = models.adapter_config_problem(folder)
    if problem:
        raise ValueError(f"{folder}: {problem}")
    try:
        saved = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError, SafetensorError) as error:  # a damaged or half-copied folder
        raise ValueError(f"{folder} does not read as an adapter ({models.one_line(error, 200)})") from error
    if not isinstance(config.get("r"), int) or "lora_alpha" not in config:
        raise ValueError(f"{folder}: adapter_config.json names no LoRA rank and alpha")
    problem = models.non_finite_tensors(saved)
    if problem:
        raise ValueError(f"{folder}: adapter_model.safetensors holds {problem}: a run that diverged, or a damaged file")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{folder} holds a {config.get('peft_type')} adapter, not LoRA")
    unsupported = {"use_dora": "DoRA", "rank_pattern": "ranks per module", "alpha_pattern": "alphas per module",
                   "lora_bias": "LoRA biases", "fan_in_fan_out": "Conv1D layers", "trainable_token_indices": "token rows"}  # fmt: skip
    for key, what in unsupported.items():
        if config.get(key):
            raise ValueError(f"{folder} uses {what} ({key}), which merge_2048 does not merge")
    layout = config.get("unsloth_fused_expert_lora", {}).get("lora_B_layout", config.get("lora_B_layout", "rank_major"))
    if layout != "rank_major":  # Unsloth's marker; PEFT (and this check) read B's columns rank-major only
        raise ValueError(f"{folder}: its fused experts' LoRA B is laid out {layout!r} (an older Unsloth's), which PEFT "
                         "reads as another adapter; merge it with that Unsloth's own save_pretrained_merged")  # fmt: skip
    if config.get("bias", "none") != "none":
        raise ValueError(f"{folder} trains biases (bias: {config['bias']}), which merge_2048 does not merge")
    rank = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    pairs, whole = {}, {}
    for key, tensor in saved.items():
        name = key.removeprefix("base_model.model.")
        found = re.fullmatch(r"(.*)\.lora_([AB])\.weight", name)
        if found:
            pairs.setdefault(found[1], {})[found[2]] = tensor.double()
        elif ".lora_" in name:
            raise ValueError(f"{folder}: {key} is a kind of LoRA tensor merge_2048 does not merge")
        elif shapes.get(name) != tuple(tensor.shape):
            raise ValueError(f"{folder}: {key} ({tuple(tensor.shape)}) fits no tensor of the base")
        else:
            whole[name] = tensor
    products = {}
    for module, pair in sorted(pairs.items()):
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.shape[0] != b.shape[1] or a.shape[0] % rank:
            raise ValueError(f"{folder}: the LoRA of {module} is not a pair of rank {rank}")
        split = models.SPLIT_EXPERT.match(module)
        if split:  # Unsloth's Linear per expert: its weight (out, in) is the fused slice (in, out) transposed
            name, index = f"{split['experts']}.{split['kind'][:-1]}", int(split["index"])
            fits = len(shapes.get(name, ())) == 3 and index < shapes[name][0] and shapes[name][1:] == (a.shape[1], b.shape[0])
            found = [Product(a, b, scale, expert=index)] if fits else []
            names = [name]
        elif a.shape[0] == rank:  # a Linear
            names = [f"{module}.weight"]
            found = [Product(a, b, scale)] if shapes.get(names[0]) == (b.shape[0], a.shape[1]) else []
        else:  # PEFT's LoRA on a fused expert tensor, named after its module (nested: experts.base_layer...)
            owner = re.sub(r"(\.base_layer)+$", "", module)
            names = [n for n, s in shapes.items() if n.rpartition(".")[0] == owner and len(s) == 3
                     and s[0] * rank == a.shape[0] and sorted(s[1:]) == sorted((a.shape[1], b.shape[0]))]  # fmt: skip
            found = [Product(a, b, scale, experts=shapes[names[0]][0])] if len(names) == 1 else []
        if not found:
            raise ValueError(f"{folder}: the LoRA of {module} fits no tensor of the base ({names[:2] or 'none named so'})")
        products.setdefault(names[0], []).extend(found)
    return products, whole


def merge_adapters(adapter: Path, base: Path, out: Path, products: dict, whole: dict, seed: int = 0) -> dict:
    """Merge the adapter in `adapter` into the 16-bit checkpoint in `base` and write the merged model to `out`, with the
    libraries' own code: transformers loads the base with its own classes, PEFT puts the adapters on it (a default
    run's split-expert LoRA through attach_split_expert_lora) and merges them (merge_and_unload). Then the merge is
    judged, and what 16 bits keep of the adapters is measured:

    - judge_weights: every tensor of the checkpoint against the base tensor read + the adapters' products
      (adapter_products), shard by shard, slice by slice. A wrong merge stops here;
    - distributions: the base with the adapters applied unmerged samples two seeded completions of the training
      prompt, and on them the merged checkpoint, reloaded with transformers' own classes (every tensor must load), is
      compared with it (KL, and kept_effect: the share of the adapters' effect it keeps) and the base with it (the
      adapters' own effect). In float32 arithmetic: in 16-bit arithmetic the unmerged and merged models round their
      activations differently, by more than a real run's adapters move them. Never against a model quantized
      otherwise (the 4-bit model a default run trained).

    Returns the report (merge_report.json): "wrong" lists why the checkpoint is not base + adapters (empty when the
    merge is correct). ValueError when the base does not load as a model of transformers' classes. On a GPU the
    float32 models may not fit: accelerate then keeps part of them in CPU memory."""
    import torch

    try:
        tokenizer = models.load_tokenizer(str(base), str(adapter))
    except Exception as error:  # noqa: BLE001 - no tokenizer, or a damaged one: the user's to fix, in one line
        raise ValueError(f"{adapter} and {base} hold no tokenizer that loads ({type(error).__name__}: "
                         f"{models.one_line(error)})") from error  # fmt: skip
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    label = str(adapter if (adapter / "tokenizer_config.json").is_file() else base)
    models.check_template(tokenizer, evaluation_messages(), label, reasoning_effort="low")  # TemplateRefused
    model, dtype, transposed = _with_adapters(base, adapter, dtype="auto", gpu=torch.cuda.is_available())
    merged = merge_rounding_once(model)
    dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16  # merged_16bit: 16 bits
    if merged.dtype != dtype:  # a float32 base (the CPU demo's)
        merged = merged.to(dtype)
    merged.save_pretrained(out, max_shard_size=MERGED_SHARD)
    tokenizer.save_pretrained(out)
    del model, merged
    _collect()
    weights = judge_weights(out, base, products, whole, transposed, dtype)
    report = {"adapter": str(adapter), "base": str(base), "dtype": str(dtype).removeprefix("torch."), **weights,
              "adapters_kl": None, "kl_to_unmerged": None, "adapters_kl_median": None, "kl_to_unmerged_median": None,
              "kept_effect": None, "kept_effect_error": None}  # fmt: skip
    if report["wrong"]:
        return report
    room = _float32_room(base)
    if room is None:
        report["distributions"] = "not compared: the models do not fit in memory in float32"
        return report
    report["distributions"] = f"compared in float32 arithmetic, on the {room}"
    unmerged, _, _ = _with_adapters(base, adapter, dtype=torch.float32, gpu=room == "GPU")
    inputs = evaluation_prompt(tokenizer)
    start = inputs["input_ids"].shape[1]
    sequences = [inputs["input_ids"][0].tolist() + completion for completion in models.seeded_samples(unmerged, tokenizer, inputs, seed, size=2)]
    trained = _logprobs(unmerged, sequences, start)
    with unmerged.disable_adapter():
        plain = _logprobs(unmerged, sequences, start)
    del unmerged
    _collect()
    reloaded, info = _load(out, torch.float32, gpu=room == "GPU")
    if any(info.values()):
        report["wrong"].append(f"it does not load as the base's model: {loading_problems(info)}")
        return report
    got = _logprobs(reloaded.eval(), sequences, start)
    del reloaded
    _collect()
    kept = kept_effect({"trained": trained, "base": plain}, got)
    report.update(adapters_kl=mean_kl(trained, plain), kl_to_unmerged=mean_kl(trained, got),
                  adapters_kl_median=median_kl(trained, plain), kl_to_unmerged_median=median_kl(trained, got),
                  kept_effect=kept[0] if kept else None, kept_effect_error=kept[1] if kept else None,
                  positions=sum(len(s) - start for s in sequences))  # fmt: skip
    return report


def merge_rounding_once(model):
    """model.merge_and_unload(), each weight rounded to its 16 bits once. PEFT merges a Linear's LoRA by adding the
    float32 product to the weight, rounded once; a LoRA on a tensor (its ParamWrapper: GPT-OSS's fused experts, and
    a default run's split-expert LoRA mapped onto them) it rounds to the tensor's 16 bits before adding it, so that at
    a 10% adapter 9% of the changed expert weights were one 16-bit step off the correctly rounded sum. Each such tensor
    is merged here by PEFT's own merge while held in float64, one tensor at a time, then rounded once."""
    import warnings

    import torch
    from peft.tuners.lora.layer import ParamWrapper

    for module in model.modules():
        if isinstance(module, ParamWrapper) and not module.merged:
            param = getattr(module.get_base_layer(), module.parameter_name)
            dtype = param.dtype
            param.data = param.data.to(torch.float64)
            module.merge()
            param.data = param.data.to(dtype)
    with warnings.catch_warnings():  # PEFT says, for each tensor merged above, that it is merged already
        warnings.filterwarnings("ignore", message="All adapters are already merged")
        return model.merge_and_unload()  # the Linear layers' merge, and the model without its LoRA layers


def _load(folder: Path, dtype, gpu: bool):
    """(model, loading info) with transformers' own classes, on the GPUs or on the CPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="auto" if gpu else None,
                                                output_loading_info=True)  # fmt: skip


def _float32_room(base: Path) -> str | None:
    """Where the base fits in float32 (4 bytes a weight, and a tenth more): "GPU" (free memory, less a tenth),
    "CPU" (memory_available), or None. A 20B model takes 84 GB: more than an H100 has, less than its host."""
    import math

    import torch

    need = 4.4 * sum(math.prod(shape) for shape in tensor_shapes(base).values())
    if torch.cuda.is_available():
        free = sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
        if 0.9 * free > need:
            return "GPU"
    available = memory_available()
    return "CPU" if available is None or available > need else None


def memory_available(root: Path = Path("/")) -> int | None:
    """Bytes this process can still take: the least of /proc/meminfo's MemAvailable and its cgroup's room (v2:
    memory.max - memory.current; v1: memory.limit_in_bytes - memory.usage_in_bytes), which a container's limit sets and
    MemAvailable does not show. None when none of them can be read (not Linux)."""
    import user_files

    def number(path: str) -> int | None:
        try:
            text = user_files.read_text(root / path, 1 << 16, "memory figure").strip()
        except user_files.FileRefused:
            return None
        return int(text) if text.isdigit() else None  # "max": no limit

    room = []
    try:
        meminfo = user_files.read_text(root / "proc/meminfo", 1 << 20, "/proc/meminfo")
        fields = dict(line.split(":", 1) for line in meminfo.splitlines() if ":" in line)
        room.append(int(fields["MemAvailable"].split()[0]) * 1024)
    except (user_files.FileRefused, KeyError, ValueError, IndexError):
        pass
    for limit, usage in (("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory.current"),
                         ("sys/fs/cgroup/memory/memory.limit_in_bytes", "sys/fs/cgroup/memory/memory.usage_in_bytes")):  # fmt: skip
        cap, used = number(limit), number(usage)
        if cap is not None and used is not None and cap < 1 << 60:  # v1 writes "no limit" as a huge number
            room.append(max(0, cap - used))
    return min(room) if room else None


def _with_adapters(base: Path, adapter: Path, dtype, gpu: bool):
    """(the base with the adapters on it, the base's dtype, the fused expert modules laid out (experts, in, out)).
    ValueError when the base does not load as a model of transformers' own classes."""
    from peft import PeftModel

    try:
        model, info = _load(base, dtype, gpu)
    except Exception as error:  # noqa: BLE001 - a damaged or foreign checkpoint: the user's to fix, in one line
        raise ValueError(f"{base} does not load ({type(error).__name__}: {models.one_line(error)})") from error
    if info["missing_keys"] or info["mismatched_keys"]:
        raise ValueError(f"{base} does not load with transformers' own classes: {loading_problems(info)}")
    transposed = {name for name, module in model.named_modules() if getattr(module, "is_transposed", False)}
    base_dtype = model.dtype
    if models.split_expert_lora(adapter):
        return models.attach_split_expert_lora(model, adapter), base_dtype, transposed
    return PeftModel.from_pretrained(model, str(adapter)), base_dtype, transposed


def evaluation_prompt(tokenizer):
    """The training prompt, with the default game settings, as model inputs (what the distributions are compared on)."""
    import evaluation
    import rewards

    return evaluation.prompt_inputs(tokenizer, rewards.RewardSettings(), {"reasoning_effort": "low"})


def evaluation_messages() -> list[dict]:
    """evaluation_prompt's conversation, for models.check_template."""
    import rewards

    return [{"role": "user", "content": rewards.build_prompt(rewards.RewardSettings())}]


def _collect() -> None:
    import gc

    gc.collect()
    models.empty_cuda_cache()


def loading_problems(info: dict) -> str:
    """from_pretrained's loading info in a few words: what is missing, unexpected or mismatched."""
    kinds = ("missing_keys", "unexpected_keys", "mismatched_keys")
    return "; ".join(f"{len(info[k])} {k.replace('_', ' ')} ({sorted(map(str, info[k]))[:3]})" for k in kinds if info.get(k))


def judge_weights(merged: Path, base: Path, products: dict, whole: dict, transposed: set[str], dtype=None) -> dict:
    """Every tensor of the merged checkpoint against the base's, one shard and one slice at a time (a 20B model's
    expert tensors are 16 GB in float64): the base's own where no adapter reaches, else base + the adapters' products
    rounded as a 16-bit merge must round: within the two 16-bit neighbours of the exact sum, give or take the
    arithmetic the merge may do in 16 or 32 bits (MERGE_SLACK, SUM_SLACK). Also measured: how much of the adapters'
    change the 16-bit weights keep (the merged change projected on the adapters' own, over every weight they reach),
    and how many weights they change that stay the base's in 16 bits.

    Every base tensor must be there, of the base's shape, and of the base's dtype, the merge's 16-bit `dtype`, or
    float32 (transformers keeps GPT-OSS's norms in float32, which holds every 16-bit value): a checkpoint missing one
    loads with that tensor random, and is wrong whatever else is compared. A merged weight that is NaN or infinite
    where base + adapters is finite is wrong (every comparison with NaN is false)."""
    import contextlib

    import torch
    from safetensors import safe_open

    device = "cuda" if torch.cuda.is_available() else "cpu"
    base_files, merged_files = models.tensor_files(base), models.tensor_files(merged)
    wrong = [f"{name} is missing" for name in sorted((products.keys() | whole.keys() | base_files.keys())
                                                     - merged_files.keys())]  # fmt: skip
    wrong += [f"{name} is not in the base" for name in sorted(merged_files.keys() - base_files.keys())]
    totals = dict.fromkeys(("along", "norm", "changed", "rounded_away"), 0)
    with contextlib.ExitStack() as stack:
        opened = {}

        def tensor(path: Path, name: str):
            if path not in opened:
                opened[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            return opened[path].get_tensor(name)

        for name in sorted(merged_files.keys() & base_files.keys(), key=lambda n: (str(merged_files[n]), n)):
            got, was = tensor(merged_files[name], name), tensor(base_files[name], name)
            if got.shape != was.shape:
                wrong.append(f"{name} is {tuple(got.shape)}, the base's {tuple(was.shape)}")
                continue
            if got.dtype not in {was.dtype, dtype or was.dtype, torch.float32} or (
                    got.is_floating_point() != was.is_floating_point()):  # fmt: skip
                wrong.append(f"{name} is {str(got.dtype).removeprefix('torch.')}, the base's "
                             f"{str(was.dtype).removeprefix('torch.')}")  # fmt: skip
                continue
            if name not in products and name not in whole:
                same = got == was.to(got.dtype)
                if got.is_floating_point():
                    same |= got.isnan() & was.to(got.dtype).isnan()
                differ = int((~same).sum())
                if differ:
                    wrong.append(f"{name}: {differ} of {got.numel()} weights differ from the base's, and no adapter "
                                 "changes it")  # fmt: skip
                continue
            owner = name.rpartition(".")[0]
            bad = 0
            for expert, rows in _slices(got.shape):
                part = _judge_slice(got, was, products.get(name, []), whole.get(name), expert, rows,
                                    owner in transposed, device)  # fmt: skip
                bad += part.pop("bad")
                for key, value in part.items():
                    totals[key] += value
            if bad:
                dtype = str(got.dtype).removeprefix("torch.")
                wrong.append(f"{name}: {bad} of {got.numel()} weights are not base + adapters rounded to {dtype}")
    checked = len(merged_files.keys() & base_files.keys())
    kept = totals["along"] / totals["norm"] if totals["norm"] else None
    return {"wrong": wrong, "tensors": checked, "adapted_tensors": len(products.keys() | whole.keys()), "kept": kept,
            "changed_weights": totals["changed"], "rounded_away": totals["rounded_away"]}  # fmt: skip


def _slices(shape: tuple):
    """(expert or None, rows) pieces of a tensor of up to 2**24 elements: per expert, then per block of rows."""
    experts = shape[0] if len(shape) == 3 else None
    rows = shape[-2] if len(shape) >= 2 else 1
    step = max(1, 2**24 // (shape[-1] if len(shape) >= 2 else max(1, shape[0])))
    for expert in range(experts) if experts is not None else [None]:
        for start in range(0, rows, step):
            yield expert, slice(start, start + step)


def _judge_slice(got, was, products: list[Product], whole, expert, rows, transposed: bool, device) -> dict:
    import torch

    pick = (lambda t: t[expert][rows]) if expert is not None else (lambda t: t[rows] if t.dim() > 1 else t)
    merged, base = pick(got).to(device), pick(was).to(device, torch.float64)
    if whole is not None:  # a module trained in full: its merged value is its own, in 16 bits
        exact = pick(whole).to(device, torch.float64)
        delta, bound = exact - base, torch.zeros_like(base)
    else:
        delta, bound = torch.zeros_like(base), torch.zeros_like(base)
        for product in products:
            pair = product.pair(expert, transposed)
            if pair is None:
                continue
            a, b, flipped = (t.to(device) if torch.is_tensor(t) else t for t in pair)
            if flipped:  # the slice holds (B @ A).T: its rows are A's columns
                delta += product.scale * (a[:, rows].T @ b.T)
                bound += abs(product.scale) * (a[:, rows].abs().T @ b.abs().T)
            else:
                delta += product.scale * (b[rows] @ a)
                bound += abs(product.scale) * (b[rows].abs() @ a.abs())
        exact = base + delta
    slack = MERGE_SLACK * bound + SUM_SLACK * base.abs()
    low, high = (exact - slack).to(merged.dtype), (exact + slack).to(merged.dtype)
    plain = pick(was).to(device, merged.dtype)  # the base in 16 bits
    moved = merged.double() - plain.double()
    changed = delta != 0
    broken = ~torch.isfinite(merged) & torch.isfinite(exact)  # NaN passes both comparisons below
    return {"bad": int(((merged < low) | (merged > high) | broken).sum()), "along": float((moved * delta).sum()),
            "norm": float((delta * delta).sum()), "changed": int(changed.sum()),
            "rounded_away": int((changed & (merged == plain)).sum())}  # fmt: skip


def _logprobs(model, sequences: list[list[int]], start: int) -> list:
    """Log-softmax of the next-token logits at positions start-1 .. end-2 of each sequence, on the CPU, in float64 (the
    KL between models that differ by a real run's adapters is below float32's resolution of a log-probability)."""
    import torch

    device = next(p for p in model.parameters() if p.device.type != "meta").device
    out = []
    with torch.no_grad():
        for ids in sequences:
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, start - 1 : len(ids) - 1]
            out.append(torch.log_softmax(logits.double(), dim=-1).cpu())
    return out


def kl_per_position(reference: list, other: list) -> list[float]:
    """KL(reference || other) at each position, in nats."""
    return [float(kl) for p, q in zip(reference, other) for kl in (p.exp() * (p - q)).sum(-1)]


def mean_kl(reference: list, other: list) -> float:
    """Mean KL(reference || other) per position, in nats."""
    values = kl_per_position(reference, other)
    return sum(values) / max(1, len(values))


def median_kl(reference: list, other: list) -> float:
    """The median position's KL: one token whose top-k experts flip between two models (routing is discontinuous)
    weighs more in the mean than every other position together; the median is what the rest say."""
    import statistics

    return statistics.median(kl_per_position(reference, other) or [0.0])


def kept_effect(reference: dict, saved: list) -> tuple[float, float] | None:
    """(share, its standard error) of the adapters' effect a merged model keeps, or None when the adapters change
    nothing at all. Per position, with the unmerged model's probabilities p as weights: the adapters' shift d =
    trained - base and the merged one m = saved - base (log-probabilities, each centred on its p-mean), share =
    sum <m, d>_p / sum <d, d>_p over positions; the error from how the positions' own ratios scatter around it."""
    import torch

    along, norms = [], []
    for trained, base, merged in zip(reference["trained"], reference["base"], saved):
        p = trained.double().exp()
        d, m = (trained - base).double(), (merged - base).double()
        d = d - (p * d).sum(-1, keepdim=True)
        m = m - (p * m).sum(-1, keepdim=True)
        along.append((p * m * d).sum(-1))
        norms.append((p * d * d).sum(-1))
    along, norms = torch.cat(along), torch.cat(norms)
    total = float(norms.sum())
    if total == 0.0:
        return None
    share = float(along.sum()) / total
    return share, float((along - share * norms).pow(2).sum().sqrt()) / total
