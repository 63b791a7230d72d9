"""How train_2048 starts on a GPU, with torch.cuda stood in for (no GPU here): nothing starts CUDA before `import
unsloth`, whose allocator setting for GB10 counts only then, and offload_embedding decided by the device.

The stand-ins answer as an H100 (discrete) or a DGX Spark's GB10 (integrated, compute capability 12.1) would. A call
that starts CUDA in torch (torch.cuda._lazy_init, which every device query below goes through) is recorded, so the
order of the start is read, not assumed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

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
