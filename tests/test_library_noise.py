"""Library noise at import never comes before our one-line errors, whichever CPU kind runs the command.

bitsandbytes (0.50) takes a different path at import on a CPU with AVX512-BF16 (many Xeon and EPYC hosts, H100
machines among them): it asks the Hub for a CPU kernel through the `kernels` package and logs a warning when it cannot.
Each command below runs with bitsandbytes' CPU check forced both ways, so CI takes both paths on any machine, with a
`kernels` package of our own on the path that records whether it was asked, and under ATEN_CPU_CAPABILITY=default
(torch's kernels for a CPU without AVX2/AVX512) on one of them.
"""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "configs" / "cpu-demo.yaml")

# Runs a script as `python SCRIPT ARGS...` would, with bitsandbytes.functional.has_avx512bf16 answering AVX512_BF16
# (bitsandbytes' CPU ops read it once, at import).
STUB = """
import importlib.abc, importlib.util, runpy, sys
AVX512_BF16 = {avx512_bf16}
class ForceCpuKind(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes.functional":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            module.has_avx512bf16 = lambda: AVX512_BF16
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, ForceCpuKind())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
# A `kernels` package (transformers imports it to see that it is there) whose Hub lookup leaves a mark.
FAKE_KERNELS = """
import os
def get_kernel(*args, **kwargs):
    open(os.environ["KERNELS_MARK"], "w").write("asked")
    raise RuntimeError("no kernel here")
"""


def command(name: str, tmp_path: Path) -> tuple[list[str], str]:
    """(argv, how stderr's one line starts): an error each command reports after peft and bitsandbytes load (trl too,
    but for merge_2048, which does not import it)."""
    if name == "train":
        argv = ["train_2048.py", "--config", DEMO, "--model_name_or_path", str(tmp_path / "no-model"),
                "--output_dir", str(tmp_path / "out")]  # fmt: skip
        return argv, "train_2048: model path"
    if name == "merge":  # an adapter whose base's tensors fit it, but whose config.json is no model's: after PEFT
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        import demo_data

        config = LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
        model = LlamaForCausalLM(config)
        model.save_pretrained(tmp_path / "base")
        get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
        demo_data.build_tokenizer(["a b c"]).save_pretrained(tmp_path / "adapter")
        (tmp_path / "base" / "config.json").write_text("{}")
        return ["merge_2048.py", "--adapter", str(tmp_path / "adapter"), "--base", str(tmp_path / "base")], "merge_2048: "
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    return ["evaluate_2048.py", "--model", str(broken), "--output_dir", str(tmp_path / "out")], "evaluate_2048: cannot load"


def run(name: str, avx512_bf16: bool, tmp_path: Path):
    """(the finished process, the line it must print, whether the Hub was asked for a kernel)."""
    tmp_path.mkdir()
    (tmp_path / "kernels.py").write_text(FAKE_KERNELS)
    argv, line = command(name, tmp_path)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(tmp_path), "KERNELS_MARK": str(tmp_path / "mark")}
    if not avx512_bf16:
        env["ATEN_CPU_CAPABILITY"] = "default"
    stub = STUB.format(avx512_bf16=avx512_bf16)
    result = subprocess.run([sys.executable, "-c", stub, *argv], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env=env)  # fmt: skip
    return result, line, (tmp_path / "mark").exists()


@pytest.mark.slow
def test_our_line_is_the_only_line_on_both_cpu_kinds(tmp_path):
    cases = [(name, avx512_bf16) for name in ("train", "evaluate", "merge") for avx512_bf16 in (True, False)]
    with ThreadPoolExecutor(max_workers=2) as pool:  # each is a fresh process that imports torch, TRL and PEFT
        futures = {case: pool.submit(run, *case, tmp_path / f"{case[0]}-{case[1]}") for case in cases}
    for case, future in futures.items():
        result, line, hub_asked = future.result()
        assert result.returncode == 2, (case, result.stderr)
        assert result.stderr.startswith(line) and result.stderr.count("\n") == 1, (case, result.stderr)
        assert not hub_asked, f"{case}: bitsandbytes asked the Hub for a kernel at import"
