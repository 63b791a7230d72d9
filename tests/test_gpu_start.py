"""How train_2048 starts on a GPU, with torch.cuda stood in for (no GPU here): nothing starts CUDA before `import
unsloth`, whose allocator setting for GB10 counts only then, and offload_embedding decided by the device.

The stand-ins answer as an H100 (discrete) or a DGX Spark's GB10 (integrated, compute capability 12.1) would. A call
that starts CUDA in torch (torch.cuda._lazy_init, which every device query below goes through) is recorded, so the
order of the start is read, not assumed.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

import models
import options
import train_2048

ROOT = Path(__file__).resolve().parent.parent

# A fresh interpreter (bitsandbytes imported for real, under the stand-ins), run until options.plan: the events of the
# start in order, and the environment the plan saw.
START = textwrap.dedent(
    """
    import importlib.abc, importlib.machinery, json, os, sys, types
    sys.path.insert(0, sys.argv[1])
    import torch

    events = []
    GB10 = types.SimpleNamespace(name="NVIDIA GB10", major=12, minor=1, is_integrated=1, total_memory=128 * 2**30)
    answers = {"get_device_capability": (12, 1), "get_device_properties": GB10, "get_device_name": GB10.name,
               "current_device": 0, "mem_get_info": (100 * 2**30, 128 * 2**30), "init": None, "_lazy_init": None,
               "set_device": None, "synchronize": None, "max_memory_allocated": 0, "memory_allocated": 0}
    for name, answer in answers.items():  # each starts CUDA in torch (its _lazy_init) on a real GPU
        setattr(torch.cuda, name, lambda *a, _name=name, _answer=answer, **k: events.append("cuda " + _name) or _answer)
    torch.cuda.is_available = lambda: True  # asks the driver for a count: no CUDA context, no allocator
    torch.cuda.device_count = lambda: 1
    torch.cuda.is_initialized = lambda: any(e.startswith("cuda ") for e in events)

    class Unsloth(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        # `import unsloth`: what Unsloth does first, set the allocator, can only count if CUDA is not up yet
        def find_spec(self, name, path=None, target=None):
            return importlib.machinery.ModuleSpec(name, self) if name == "unsloth" else None
        def create_module(self, spec):
            return None
        def exec_module(self, module):
            events.append("import unsloth")
            os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")

    sys.meta_path.insert(0, Unsloth())
    import options, train_2048

    class Planned(Exception):
        pass

    def plan(*args, **kwargs):
        events.append("options.plan")
        raise Planned

    options.plan = plan
    try:
        train_2048.train(["--config", "configs/gpt-oss-20b.yaml"], "unsloth", True)
    except Planned:
        pass
    print(json.dumps({"events": events, "arch": os.environ.get("TORCH_CUDA_ARCH_LIST")}))
    """
)


def start_on_a_gb10() -> dict:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run([sys.executable, "-c", START, str(ROOT)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_nothing_starts_cuda_before_import_unsloth():
    """Unsloth sets PYTORCH_ALLOC_CONF=expandable_segments:True as it is imported (unsloth_zoo/__init__.py), its own
    mitigation for GB10's unified memory; torch reads it when CUDA starts, so a device query before the import (our
    GB10 check, bitsandbytes' import, which asks every card's capability) would leave the allocator without it."""
    said = start_on_a_gb10()
    events = said["events"]
    assert "import unsloth" in events and events[-1] == "options.plan", events
    first = events.index("import unsloth")
    assert not [e for e in events[:first] if e.startswith("cuda ")], events
    # and the GB10 check still ran, after it, before the options (and so before the model): its setting is in place
    assert any(e == "cuda get_device_capability" for e in events[first:]), events
    assert said["arch"] == "12.1a"


# --- offload_embedding, decided by the GPU unless the user sets it ----------------------------------------------

H100 = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, is_integrated=0)
GB10 = SimpleNamespace(name="NVIDIA GB10", major=12, minor=1, is_integrated=1)


def stand_in(monkeypatch, card) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: card if device == 0 else None)


@pytest.mark.parametrize(
    "card, requested, four_bit, offload",
    [(GB10, None, True, False), (GB10, None, False, False), (H100, None, True, True), (H100, None, False, False),
     (GB10, True, True, True), (GB10, False, True, False), (H100, False, True, False), (H100, True, False, True)],
)  # fmt: skip
def test_offload_embedding_is_the_users_else_the_gpus(monkeypatch, card, requested, four_bit, offload):
    stand_in(monkeypatch, card)
    decided, why = models.decide_offload(requested, four_bit)
    assert decided is offload
    assert ("integrated" in why) == bool(card.is_integrated) and ("as set" in why) == (requested is not None)
    if card is GB10 and requested:  # the user's choice stands, and its cost there is said
        assert "frees nothing" in why


class Loaded(Exception):
    pass


@pytest.mark.parametrize("card, preset, offload", [(GB10, "gpt-oss-20b", False), (H100, "gpt-oss-20b", True),
                                                   (GB10, "gpt-oss-20b-bf16", False)])  # fmt: skip
def test_the_preset_loads_with_the_decision_and_says_it(monkeypatch, caplog, tmp_path, card, preset, offload):
    """The default preset no longer forces the offload: off on a DGX Spark, on on an H100, said on the console."""
    stand_in(monkeypatch, card)
    script, settings, grpo, model = options.parse_args(["--config", str(ROOT / "configs" / f"{preset}.yaml"),
                                                        "--use_cpu", "true", "--bf16", "false"])  # fmt: skip
    asked = {}

    def load_model(path, model_args, **kwargs):
        asked.update(kwargs)
        raise Loaded

    monkeypatch.setattr(models, "load_model", load_model)
    with caplog.at_level(logging.INFO, logger="train_2048"), pytest.raises(Loaded):
        train_2048.load_policy(script, grpo, model, "unsloth", "prompt", None, tmp_path)
    assert asked["offload_embedding"] is offload
    (said,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("offload_embedding ")]
    assert said.startswith(f"offload_embedding {str(offload).lower()}: ")
    assert ("decided by the GPU" in said) == (preset == "gpt-oss-20b")


@pytest.mark.parametrize("triton, ptxas", [("3.5.0", "/usr/local/cuda/bin/ptxas"), ("3.7.1", None), (None, None)])
def test_a_gb10_gets_the_toolkits_ptxas_only_where_triton_reads_it(monkeypatch, triton, ptxas):
    """Triton up to 3.5 (NGC 25.11's) rejects sm_121a with its own ptxas and takes TRITON_PTXAS_PATH; 3.6 and later
    (torch 2.13's 3.7.1) use their bundled Blackwell ptxas and ignore it, so it is not set there."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 1))
    monkeypatch.setitem(sys.modules, "triton", None if triton is None else SimpleNamespace(__version__=triton))
    monkeypatch.setattr(train_2048.os.path, "exists", lambda path: path == "/usr/local/cuda/bin/ptxas")
    for name in ("TRITON_PTXAS_PATH", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.delenv(name, raising=False)
    train_2048.prepare_cuda()
    assert train_2048.os.environ.get("TRITON_PTXAS_PATH") == ptxas
    assert train_2048.os.environ["TORCH_CUDA_ARCH_LIST"] == "12.1a"
