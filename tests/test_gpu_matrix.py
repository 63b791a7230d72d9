"""bench/gpu_matrix.sh, the GPU matrix of issue 21: its dry run lists every item of the matrix, as valid bash, and its
summary judges the targets. No model runs here: the GPU machine runs the items (docs/GPU_MATRIX.md)."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_matrix.sh"
PARTS = ("1", "2", "3", "4", "5")
ITEM = re.compile(r"^(?P<command>.+)  # \[(?P<id>\d+\.\d+) ~(?P<est>\d+)s (?P<how>\S+)\] (?P<what>.+)$")


def script(*args, tmp_path, check=True):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "PYTHON": "python3"}
    r = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def items(text: str) -> list[dict]:
    return [m.groupdict() for m in map(ITEM.match, text.splitlines()) if m]


def flag(command: str, name: str, default: str | None = None) -> str | None:
    """The value after --name in a command line (the last one), else `default`."""
    values = re.findall(rf"--{name} (\S+)", command)
    return values[-1] if values else default


@pytest.fixture(scope="module")
def dry(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("dry")
    out = {part: script("--dry-run", part, tmp_path=tmp).stdout for part in PARTS}
    assert not (tmp / "out").exists() and not (tmp / "work").exists(), "a dry run writes nothing"
    return out


def test_the_script_is_valid_bash():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_each_dry_run_is_valid_bash_one_command_a_line(dry, tmp_path):
    for part, text in dry.items():
        listing = tmp_path / f"part{part}.sh"
        listing.write_text(text)
        r = subprocess.run(["bash", "-n", str(listing)], capture_output=True, text=True)
        assert r.returncode == 0, (part, r.stderr)
        lines = [line for line in text.splitlines() if not line.startswith("#")]
        assert all(ITEM.match(line) or line.endswith("  # [setup]") for line in lines), part


def test_every_part_installs_the_carried_wheels_and_tokenizer_and_stays_offline(dry):
    for part, text in dry.items():
        assert "bash .gpu-wheels/install.sh .gpu-wheels  # [setup]" in text, part
        assert "tar -xzf .gpu-tokenizer.tar.gz" in text and "HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1" in text, part
        ids = [i["id"] for i in items(text)]
        assert ids and len(ids) == len(set(ids)) and all(i.startswith(f"{part}.") for i in ids), part
        # every item fits one 600-s call by itself, beside the setup
        assert all(int(i["est"]) <= 540 for i in items(text)), part


def test_the_dry_runs_cover_the_matrix_of_issue_21(dry):
    listed = [i for text in dry.values() for i in items(text)]
    checks = [i["command"] for i in listed if "bench/gpu_check.py" in i["command"]]
    runs = [c for c in checks if "--build_only" not in c]
    assert all("--tokenizer_dir " in c for c in checks), "every model is built with GPT-OSS's real tokenizer"
    assert not any("--verify_save false" in c for c in runs), "every save is verified"

    def key(c):
        return (flag(c, "preset"), flag(c, "backend", "auto"), flag(c, "fast_generation", "false"))

    tiny = {key(c) for c in runs if "--geometry tiny" in c}
    for preset, backend in [
        ("gpt-oss-20b", "auto"),
        ("gpt-oss-20b-bf16", "auto"),
        ("gpt-oss-20b-bf16", "transformers"),
    ]:
        assert {(preset, backend, "false"), (preset, backend, "true")} <= tiny, (preset, backend)
    assert {flag(c, "save_method", "lora") for c in runs} >= {"lora", "merged_16bit"}
    (mxfp4,) = [i["command"] for i in listed if "mxfp4" in i["command"]]
    assert "train_2048.py --save_method mxfp4" in mxfp4 and "-eq 2" in mxfp4, "mxfp4: refused at startup, exit 2"
    # what the CPU tier cannot run comes first on a GPU: Unsloth's loader and merge on the default's own layout
    first = items(dry["1"])[0]["command"]
    assert "--geometry tiny" in first and flag(first, "preset") == "gpt-oss-20b" and "--layout" not in first
    assert flag(first, "save_method") == "merged_16bit"
    builds = [c for c in checks if "--build_only" in c and "--geometry 20b" in c]
    assert builds and all("--scratch " in c and "--layout" not in c for c in builds), "the split 4-bit copy too"
    # the 20B geometry, all 24 layers, 3 steps: both presets, fast generation off and on, at 200 tokens (the before)
    # and at the presets' own budget (no --max_completion_length)
    full = [c for c in runs if "--geometry 20b" in c and "--layers" not in c]
    assert all("--steps 3" in c for c in full)
    at = {(*key(c), flag(c, "max_completion_length", "preset")) for c in full}
    for preset in ("gpt-oss-20b", "gpt-oss-20b-bf16"):
        assert {
            (preset, "auto", "false", "200"),
            (preset, "auto", "true", "200"),
            (preset, "auto", "true", "preset"),
        } <= at
    assert ("gpt-oss-20b-bf16", "auto", "false", "preset") in at
    assert ("gpt-oss-20b-bf16", "transformers", "true", "200") in at

    (evaluate,) = [i for i in listed if "evaluate_2048.py" in i["command"]]
    for words in ("--samples 2", "--games 2", "--adapter ", "--model "):
        assert words in evaluate["command"]
    (trained,) = [
        i for i in listed if f"{flag(i['command'], 'workdir')}/run/final" == flag(evaluate["command"], "adapter")
    ]
    assert key(trained["command"]) == ("gpt-oss-20b", "auto", "false"), "an Unsloth adapter (the default preset)"
    assert evaluate["how"].endswith(f"@{trained['id']}"), "it starts once the adapter is trained"
    assert flag(evaluate["command"], "model") == flag(trained["command"], "workdir") + "/gpt-oss-tiny-all"

    generation = [i["command"] for i in listed if "bench/bench_generation.py" in i["command"]]
    assert any("--geometry 20b --lora --batch 8 " in c for c in generation)
    assert any("timeout 550 python3 -m pytest -q" in i["command"] for i in listed)


def test_only_runs_the_items_named(tmp_path):
    text = script("--dry-run", "2", "--only", "2.3", tmp_path=tmp_path).stdout
    assert [i["id"] for i in items(text)] == ["2.3"] and "install.sh" in text


def test_bad_arguments_exit_2(tmp_path):
    for args in (["--dry-run", "9"], ["--dry-run"], ["--bogus", "1"], ["--summary"]):
        r = script(*args, tmp_path=tmp_path, check=False)
        assert r.returncode == 2 and "usage:" in r.stderr, args


def test_the_summary_judges_the_targets_across_parts(tmp_path):
    """Results as parts 1-3 write them (made up here): each target line says PASS or FAIL."""

    def run(preset, fast, step, backend="unsloth", **extra):
        return {"geometry": "20b", "layers": None, "preset": preset, "backend": backend, "fast_generation": fast,
                "max_completion_length": 200, "time/step_s": step, "time/generate_s": step / 2,
                "time/rewards_s": 0.5, "time/logprobs_and_backward_s": step / 2 - 1, "time/optimizer_s": 0.5,
                "peak_memory_gb": 40.0, "save_method": "lora", "save_checks": ["verified final"], "save_problems": [],
                "generation": ["generation: fast (grouped experts, compile=reduce-overhead, step compiled)"], **extra}  # fmt: skip

    check = "python3 bench/gpu_check.py --geometry 20b"

    def part(n, results):
        items = [{"id": f"{n}.{k}", "status": "passed", "seconds": 1, "estimate_s": 1, "what": "", "command": command,
                  "result": result, "tail": ["3 passed"]} for k, (command, result) in enumerate(results, 1)]  # fmt: skip
        path = tmp_path / f"part{n}-results.json"
        path.write_text(json.dumps({"part": n, "items": items}))
        return str(path)

    bench = {"environment": {"geometry": "20b", "layers": 24},
             "rows": [{"method": "model.generate", "batch": 8, "prefill_ms": 100.0, "decode_ms_per_step": 46.0},
                      {"method": "generation.generate", "batch": 8, "prefill_ms": 100.0, "decode_ms_per_step": 9.0,
                       "same_greedy_tokens": "yes"}]}  # fmt: skip
    split = "GPT-OSS experts split, a Linear per expert (Unsloth's 4-bit layout); LoRA on 1536 of them"
    fused = "GPT-OSS experts fused into tensors (transformers' layout); LoRA on 48 expert tensors"
    files = [
        part(1, [(check, run("gpt-oss-20b-bf16", True, 10.0, experts=fused, fast_path_share=1.0)),
             (check, run("gpt-oss-20b", True, 16.0, experts=fused, fast_path_share=0.5))]),
        part(2, [(check, run("gpt-oss-20b-bf16", False, 20.0)),
                 (check, run("gpt-oss-20b", False, 33.0, experts=split))]),
        part(3, [("bench_generation", bench), ("python3 evaluate_2048.py --adapter x", None),
                 ("timeout 550 python3 -m pytest -q", None)]),
    ]  # fmt: skip
    out = script("--summary", *files, tmp_path=tmp_path).stdout
    assert "decode step, BF16 + LoRA, batch 8, 24 layers: 9.0 ms (<= 10) PASS" in out
    assert "4-bit / BF16 step (Unsloth), fast generation on, 200 tokens: 16.0 / 10.0 s = 1.60x (<= 1.5) FAIL" in out
    assert "4-bit / BF16 step (Unsloth), fast generation off, 200 tokens: 33.0 / 20.0 s = 1.65x (<= 1.5) FAIL" in out
    # generation alone: 0.1 + 199 * 9 ms = 1.89 s; + rewards 0.5 + log-probs/backward 4 = 6.39 s against a 10 s step
    assert "fast on, 200 tokens: 10.0 / 6.4 s = 1.56x (<= 1.3) FAIL" in out
    assert "fast path taken, gpt-oss-20b-bf16 on unsloth, 200 tokens: yes" in out
    assert "fast path taken, gpt-oss-20b on unsloth, 200 tokens: no (fast_path 0.5" in out  # half the steps fell back
    assert f"layout, gpt-oss-20b (20b, 200 tokens): {fused} FAIL" in out  # the 4-bit row timed fused experts
    assert f"layout, gpt-oss-20b (20b, 200 tokens): {split} PASS" in out
    assert f"layout, gpt-oss-20b-bf16 (20b, 200 tokens): {fused} PASS" in out
    assert "saves verified: 4 of 4 runs (lora) PASS" in out
    assert "evaluate_2048 --adapter (an Unsloth adapter, fresh process) [3.2]: passed" in out
    assert "test suite [3.3]: passed: 3 passed" in out
