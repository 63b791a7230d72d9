"""bench/gpu_matrix.py, the GPU check in calls planned within a time limit of 420 s per run: call 1's plan fits by its
estimates, the two-point fit, the windows that keep a timed part alone, the time guard, a run's announcement and its
folder of its own, the results kept in docs/GPU_CHECK.md, the GPU set's script, and call 1 itself on the CPU with tiny
models (the plumbing; the figures need a GPU)."""

import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import gpu_matrix  # noqa: E402

MATRIX = [sys.executable, str(REPO / "bench" / "gpu_matrix.py")]


def gpu_places(tmp_path) -> gpu_matrix.Places:
    return gpu_matrix.Places(out=tmp_path / "out", work=tmp_path / "work", big=tmp_path / "big", cpu=False)


def test_the_two_point_fit_extrapolates_to_24_layers_and_prefers_a_measurement():
    assert gpu_matrix.fit({2: 3.0, 4: 5.0}) == (1.0, 1.0)
    assert gpu_matrix.extrapolate({4: 5.0, 2: 3.0}) == 25.0
    assert gpu_matrix.extrapolate({2: 10.0, 4: 8.0}, layers=8) == 4.0  # a falling line stays a line
    assert gpu_matrix.extrapolate({2: 3.0, 4: 5.0, 24: 30.0}) == 30.0  # measured at 24: that, not the line
    assert gpu_matrix.extrapolate({2: 3.0}) is None and gpu_matrix.extrapolate({2: 3.0, 4: None}) is None


def test_call_1_fits_420_s_by_the_turn_2_figures_and_so_does_every_later_call(tmp_path):
    p = gpu_places(tmp_path)
    for call, build in gpu_matrix.CALLS.items():
        items = build(p)
        end = gpu_matrix.simulate(items, gpu_matrix.JOBS.get(call, 5))["call"]
        assert end <= gpu_matrix.TIME_LIMIT_S - gpu_matrix.RESERVE_S, (call, end)
    items = {i.id: i for i in gpu_matrix.call_1(p)}
    # the figures it stands on: the H100's 33 s per 4-bit step at 24 layers and 200 tokens, scaled to 4 layers, 1024
    grpo = [i for i in items.values() if i.kind == "grpo"]
    assert {(i.preset, i.layers, i.tokens) for i in grpo} == {
        (preset, layers, 1024) for preset in gpu_matrix.PRESETS for layers in (2, 4)
    }
    four = next(i for i in grpo if (i.preset, i.layers) == ("gpt-oss-20b", 4))
    assert four.window_s == pytest.approx(33.0 * 4 / 24 * 1024 / 200)
    assert "--max_completion_length 1024" in " ".join(four.command) and "--fast_generation true" in " ".join(
        four.command
    )
    # reduced depth is why it fits: the same call at 24 layers would not
    deep = [gpu_matrix.grpo_item(p, 1, n, preset, 24, None) for n, preset in enumerate(gpu_matrix.PRESETS, 3)]
    assert (
        gpu_matrix.simulate([*gpu_matrix.setup_items(p, 1), *gpu_matrix.build_items(p, 1, [24], True), *deep], 5)[
            "call"
        ]
        > gpu_matrix.TIME_LIMIT_S
    )


def test_call_1_asks_what_the_issue_asks_in_its_order(tmp_path):
    items = gpu_matrix.call_1(gpu_places(tmp_path))
    kinds = [i.kind for i in items if i.kind not in gpu_matrix.SETUP + ("build",)]
    assert kinds == ["default", "merged", "refusal", "refusal"] + ["grpo"] * 4 + ["decode"] * 4
    default = " ".join(items[3].command)
    assert "--geometry tiny --preset gpt-oss-20b --steps 2 --save_method lora" in default
    # Unsloth merges only into 16-bit weights: the merge is checked on the tiny weights in BF16, and the default's own
    # local 4-bit checkpoint must be refused before training (the tier tests that refusal on the CPU)
    merged, refused = (next(i for i in items if i.id == n) for n in ("1.11", "1.12"))
    assert "--preset gpt-oss-20b-bf16 --steps 2 --save_method merged_16bit" in " ".join(merged.command)
    assert refused.kind == "refusal" and refused.needs == ("1.1",) and refused.expect == "4-bit"
    assert "tiny/gpt-oss-tiny-all-split-4bit --save_method merged_16bit" in " ".join(refused.command)
    assert "--fast_generation true" in default and "--layout" not in default  # the default's own (split) layout
    decode = [i for i in items if i.kind == "decode"]
    assert {(i.preset, i.layers) for i in decode} == {(p, d) for p in gpu_matrix.PRESETS for d in (2, 4)}
    assert all("--batch 8" in " ".join(i.command) and "--turn" in i.command for i in decode)
    four_bit = [i for i in items if i.preset == "gpt-oss-20b" and i.kind in ("grpo", "decode")]
    assert all(
        any("-split-4bit" in part for part in i.command + [n for link in i.links for n in link]) for i in four_bit
    )
    commands = [" ".join(i.command) for i in items]
    assert all("--tokenizer_dir " in c for c in commands if "gpu_check.py" in c), "GPT-OSS's own tokenizer"
    assert not any("--verify_save false" in c for c in commands)


def test_the_machine_is_made_ready_from_the_carried_files_where_they_are_else_from_its_own_set(tmp_path, monkeypatch):
    """Offline, the wheels and the tokenizer that bench/gpu_set.sh packed are installed and unpacked first; on a machine
    set up by setup.sh, the GPU set is checked and GPT-OSS's tokenizer built from its packages. Either way call 1's
    plan keeps within the time limit."""
    p = gpu_places(tmp_path)
    monkeypatch.setattr(gpu_matrix, "WHEELS", tmp_path / ".gpu-wheels")
    monkeypatch.setattr(gpu_matrix, "TOKENIZER_ARCHIVE", tmp_path / ".gpu-tokenizer.tar.gz")
    for carried in (False, True):
        if carried:
            (tmp_path / ".gpu-wheels").mkdir()
            (tmp_path / ".gpu-tokenizer.tar.gz").touch()
        gpu_set, tokenizer, machine = gpu_matrix.setup_items(p, 1)
        assert gpu_set.command == ["bash", "bench/gpu_set.sh", "install" if carried else "check"]
        assert gpu_set.env == {"PYTHON": gpu_matrix.PY}, "into the Python that runs the check"
        if carried:
            assert tokenizer.command == ["tar", "-xzf", str(tmp_path / ".gpu-tokenizer.tar.gz"), "-C", str(p.work)]
        else:
            assert tokenizer.command == [gpu_matrix.PY, "gpt_oss_tokenizer.py", "--save", str(p.tokenizer[1])]
        end = gpu_matrix.simulate(gpu_matrix.call_1(p), gpu_matrix.JOBS[1])["call"]
        assert end <= gpu_matrix.TIME_LIMIT_S - gpu_matrix.RESERVE_S, (carried, end)
    assert (gpu_matrix.ROOT / "bench" / "gpu_set.sh").exists()


FAKE_TORCH = """
import types
version = types.SimpleNamespace(cuda="13.0")
__version__ = "2.13.0"
class cuda:
    is_available = staticmethod(lambda: True)
    get_device_name = staticmethod(lambda i=0: "NVIDIA GB10")
    get_device_properties = staticmethod(lambda i=0: types.SimpleNamespace(is_integrated={integrated}))
    mem_get_info = staticmethod(lambda: (100 * 2**30, 119.7 * 2**30))
"""


def stand_in_torch(tmp_path, monkeypatch, integrated: int) -> None:
    """A `torch` that answers as a GB10 (integrated) or an H100 would, first on the path of every process started."""
    (tmp_path / "torch").mkdir(exist_ok=True)
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH.format(integrated=integrated))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    gpu_matrix.integrated_gpu.cache_clear()  # the answer is kept per process: ask again


@pytest.mark.parametrize("integrated", [1, 0])
def test_the_models_stay_out_of_dev_shm_beside_an_integrated_gpu(tmp_path, monkeypatch, integrated):
    """/dev/shm is the fastest place for the 20-35 GB of models, but beside a DGX Spark's GB10 it is the same memory the
    GPU trains in: there they go to the work folder, whatever /dev/shm has free. torch is asked in a process of its
    own (the check's own process never starts CUDA)."""
    stand_in_torch(tmp_path, monkeypatch, integrated)
    free = type("Usage", (), {"free": 100 * 2**30})
    monkeypatch.setattr(gpu_matrix.shutil, "disk_usage", lambda path: free)
    try:
        assert gpu_matrix.integrated_gpu() is bool(integrated)
        expected = tmp_path / "work" / "20b" if integrated else Path("/dev/shm/gpu-matrix")
        assert gpu_matrix.big_folder(tmp_path / "work") == expected
    finally:
        gpu_matrix.integrated_gpu.cache_clear()


def test_the_machine_item_says_the_gpus_memory_as_torch_sees_it(tmp_path, monkeypatch):
    """nvidia-smi's memory.total is N/A on a GB10: the machine's description also says torch's free and total memory,
    and whether the GPU is integrated."""
    stand_in_torch(tmp_path, monkeypatch, 1)
    said = subprocess.run([sys.executable, "-c", gpu_matrix.MACHINE], capture_output=True, text=True, timeout=60)
    assert said.returncode == 0, said.stderr
    assert "GPU memory (torch): 100.0 of 119.7 GiB free, integrated: True" in said.stdout


def test_gpu_utilisation_is_kept_where_nvidia_smi_says_memory_is_na(monkeypatch):
    """On a GB10 nvidia-smi answers `45, [N/A]`: the utilisation samples count, the memory is left to torch's peak."""
    import gpu_check

    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)  # no nvidia-smi started here
    for lines, memory in ((["45, [N/A]\n", "55, [N/A]\n"], None), (["45, 1000\n", "55, 3000\n"], 3000.0)):
        sampler = gpu_check.GPUSampler()
        sampler.proc = type("Proc", (), {"stdout": lines, "terminate": lambda self: None, "wait": lambda self: 0})()
        sampler.read()
        said = sampler.stop()
        assert said["gpu_util_median"] == 50 and said["gpu_memory_max_mib"] == memory


def test_the_simulated_plan_runs_windows_one_at_a_time_and_the_rest_side_by_side():
    def item(id_, estimate, window=0.0, needs=()):
        return gpu_matrix.Item(id_, id_, ["true"], "suite", estimate, window_s=window, needs=needs)

    # two runs of 15 s with 10 s alone each: 5 s side by side, then 10 + 10 alone
    assert gpu_matrix.simulate([item("a", 15, 10), item("b", 15, 10)], jobs=5)["call"] == 25
    ends = gpu_matrix.simulate([item("a", 10), item("b", 10), item("c", 10, needs=("a",))], jobs=2)
    assert (ends["a"], ends["b"], ends["c"]) == (10, 10, 20)
    assert gpu_matrix.simulate([item("a", 10), item("b", 10), item("c", 10)], jobs=2)["call"] == 20


def fake(tmp_path, id_, code, kind="suite", estimate=1.0, turn=False, needs=()):
    return gpu_matrix.Item(id_, f"fake {id_}", [sys.executable, "-c", code], kind, estimate, needs=needs,
                           turn=str(tmp_path / "work" / "turns" / id_) if turn else None)


def test_a_window_stops_every_other_process_of_the_call_and_resumes_them_after(tmp_path):
    ticks, marks = tmp_path / "ticks", tmp_path / "marks"
    ticker = f"import time\nend = time.time() + 3\nwhile time.time() < end:\n    open({str(ticks)!r}, 'a').write(f'{{time.time()}}\\n')\n    time.sleep(0.005)"
    turn = tmp_path / "work" / "turns" / "1.2"
    timed = (f"import time, pathlib\ntime.sleep(0.5)\nt = pathlib.Path({str(turn)!r})\n"
             f"pathlib.Path(str(t) + '.ask').touch()\nwhile not pathlib.Path(str(t) + '.go').exists(): time.sleep(0.01)\n"
             f"a = time.time(); time.sleep(0.8); b = time.time()\nopen({str(marks)!r}, 'w').write(f'{{a}} {{b}}')\n"
             f"pathlib.Path(str(t) + '.done').touch()")
    items = [fake(tmp_path, "1.1", ticker), fake(tmp_path, "1.2", timed, turn=True)]
    lines = []
    records = gpu_matrix.run_call(1, items, gpu_places(tmp_path), jobs=5, time_limit=60, say=lines.append)
    assert [r["status"] for r in records] == ["PASS", "PASS"], records
    start, end = map(float, marks.read_text().split())
    stamps = [float(x) for x in ticks.read_text().split()]
    assert any(t < start for t in stamps) and any(t > end for t in stamps), "it ran before and after the window"
    assert not [t for t in stamps if start < t < end], "the other process ran during the timed part"
    assert any("[1.2] timing alone on the machine (stopped: 1.1)" in line for line in lines)
    assert records[1]["window_s"] >= 0.8


def test_a_grpo_runs_window_is_its_second_step_even_after_an_earlier_call_left_its_metrics(tmp_path):
    """On a warm machine the run folder holds the last call's metrics.jsonl until gpu_check clears it: that must not
    open (and close) the window before the run's own first step."""
    run = tmp_path / "work" / "run-1.2" / "run"
    run.mkdir(parents=True)
    step = '{"time/step_s": 1.0}'
    (run / "metrics.jsonl").write_text(f"{step}\n{step}\n")
    code = (f"import time, pathlib\nm = pathlib.Path({str(run / 'metrics.jsonl')!r})\nm.parent.mkdir(parents=True, "
            f"exist_ok=True)\ntime.sleep(0.5)\nm.write_text({step!r} + '\\n')\ntime.sleep(0.6)\n"
            f"m.write_text({step!r} + '\\n' + {step!r} + '\\n')\ntime.sleep(0.3)")
    grpo = fake(tmp_path, "1.2", code, kind="grpo")
    grpo.run_dir = str(run)
    lines = []
    records = gpu_matrix.run_call(1, [fake(tmp_path, "1.1", "import time; time.sleep(2)"), grpo], gpu_places(tmp_path),
                                  jobs=5, time_limit=60, say=lines.append)
    assert any("[1.2] timing alone on the machine (stopped: 1.1)" in line for line in lines)
    assert records[1]["window_s"] >= 0.5


def test_the_time_guard_skips_what_does_not_fit_and_stops_what_runs_past_the_end(tmp_path):
    items = [fake(tmp_path, "1.1", "import time; time.sleep(60)", estimate=1.0),
             fake(tmp_path, "1.2", "pass", estimate=500.0),
             fake(tmp_path, "1.3", "pass", needs=("1.2",))]
    lines = []
    started = time.monotonic()
    records = gpu_matrix.run_call(
        1, items, gpu_places(tmp_path), jobs=5, time_limit=gpu_matrix.RESERVE_S + 3, say=lines.append
    )
    assert time.monotonic() - started < 20
    status = {r["id"]: (r["status"], r["figure"]) for r in records}
    assert status["1.1"][0] == "FAIL" and status["1.1"][1].startswith("cut at the call's end")
    assert status["1.2"][0] == "SKIPPED" and "does not fit" in status["1.2"][1]
    assert status["1.3"] == ("SKIPPED", "needs 1.2, which did not pass")
    assert any("bench/gpu_matrix.py 1 --only 1.2" in line for line in lines), "it names the call that runs it later"


def run_folder(tmp_path, fast_path, generation="generation: fast (module experts, compile=reduce-overhead)"):
    run = tmp_path / "run"
    run.mkdir(parents=True, exist_ok=True)
    steps = [{"time/step_s": 10.0, "time/generate_s": 4.0, "time/rewards_s": 0.5, "time/logprobs_and_backward_s": 5.0,
              "time/optimizer_s": 0.5, "generation/fast_path": f, "gpu/peak_memory_gb": 7.0} for f in fast_path]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    result = {"generation": [generation], "save_checks": ["verified final"], "save_problems": []}
    (tmp_path / "r.json").write_text(json.dumps(result))
    log = tmp_path / "log"
    log.write_text("$ run\n")
    return run, log


def test_a_step_that_fell_back_to_model_generate_fails_with_its_reason(tmp_path):
    p = gpu_places(tmp_path)
    item = gpu_matrix.grpo_item(p, 1, 3, "gpt-oss-20b", 2, None)
    run, log = run_folder(
        tmp_path, [1.0, 0.0], "WARNING fast generation failed (CUDA graphs: boom); using model.generate"
    )
    item.run_dir, item.json = str(run), str(tmp_path / "r.json")
    record = gpu_matrix.judge(item, 0, log, p)
    assert record["status"] == "FAIL" and "generation/fast_path [1.0, 0.0]" in record["figure"]
    assert "boom" in record["figure"]
    run_folder(tmp_path, [1.0, 1.0])
    record = gpu_matrix.judge(item, 0, log, p)
    assert record["status"] == "PASS" and record["figures"]["step"] == 10.0
    assert record["figures"]["decode_ms_in_step"] == pytest.approx(4000 / 1024)


def test_the_mxfp4_refusal_passes_after_unsloths_banner_but_not_after_a_traceback(tmp_path):
    p = gpu_places(tmp_path)
    item = next(i for i in gpu_matrix.call_1(p) if i.id == "1.2")
    log = tmp_path / "log"
    refusal = (
        "train_2048: --save_method mxfp4: Unsloth writes it with llm-compressor, which needs transformers <= 4.57.6"
    )
    log.write_text(f"$ cmd\n🦥 Unsloth: Will patch your computer to enable 2x faster free finetuning.\n{refusal}\n")
    assert gpu_matrix.judge(item, 2, log, p)["status"] == "PASS"
    log.write_text(f"$ cmd\nTraceback (most recent call last):\n{refusal}\n")
    assert gpu_matrix.judge(item, 2, log, p)["status"] == "FAIL"
    assert gpu_matrix.judge(item, 1, log, p)["status"] == "FAIL"


def test_the_merge_refusal_on_the_4bit_checkpoint_passes_only_as_one_line_before_training(tmp_path):
    p = gpu_places(tmp_path)
    item = next(i for i in gpu_matrix.call_1(p) if i.id == "1.12")
    log = tmp_path / "log"
    refusal = ("train_2048: --save_method merged_16bit: /w/tiny/gpt-oss-tiny-all-split-4bit is stored in 4-bit (nf4), "
               "and Unsloth merges only into 16-bit weights; save lora, or train from a 16-bit checkpoint")
    log.write_text(f"$ cmd\n{refusal}\n")
    assert gpu_matrix.judge(item, 2, log, p)["status"] == "PASS"
    assert gpu_matrix.judge(item, 0, log, p)["status"] == "FAIL", "a run that trained is no refusal"
    log.write_text("$ cmd\ntrain_2048: --save_method mxfp4: Unsloth writes it with llm-compressor\n")
    assert gpu_matrix.judge(item, 2, log, p)["status"] == "FAIL", "another refusal is not this one"


def test_the_targets_table_judges_the_extrapolated_figures():
    def grpo(preset, layers, step):
        return {"kind": "grpo", "preset": preset, "layers": layers, "tokens": 1024, "status": "PASS",
                "fast_path": [1.0, 1.0], "figures": {"step": step, "generate": step / 2, "rewards": 0.1,
                "logprobs_and_backward": step / 2 - 0.1, "peak_memory_gb": 5.0, "decode_ms_in_step": 1.0}}

    def decode(preset, layers, ms):
        return {"kind": "decode", "preset": preset, "layers": layers, "tokens": None, "status": "PASS",
                "figures": {"decode_ms": ms, "decode_ms_generate": 4 * ms, "prefill_ms": 10.0}}

    records = [
        grpo("gpt-oss-20b", 2, 3.0),
        grpo("gpt-oss-20b", 4, 5.0),  # 1 + 1 x layers: 25 s at 24
        grpo("gpt-oss-20b-bf16", 2, 2.0),
        grpo("gpt-oss-20b-bf16", 4, 3.0),  # 1 + 0.5 x layers: 13 s
        decode("gpt-oss-20b-bf16", 2, 1.0),
        decode("gpt-oss-20b-bf16", 4, 1.8),
    ]  # 0.2 + 0.4 x layers: 9.8 ms
    lines, rows = gpu_matrix.targets(records)
    result = {r["target"]: (r["figure"], r["result"]) for r in rows}
    assert result["BF16 decode step at batch 8 <= 10 ms at 24 layers"] == ("9.8 ms", "PASS")
    assert result["4-bit GRPO step within 1.5x of BF16 at 24 layers"] == ("25.0 / 13.0 s = 1.92x", "FAIL")
    assert result["generation/fast_path = 1 on every step of the default"][1] == "PASS"
    assert result["4-bit GRPO step within 1.3x of generate + score + log-probs/backward"][1] == "n/a"  # no 4-bit decode
    # BF16: 13 s against (10 + 9.8 ms x 1023) generate alone + 0.1 + (6.5 - 0.1) = 16.5 s
    assert result["BF16 GRPO step within 1.3x of generate + score + log-probs/backward"][1] == "PASS"
    assert "| 4-bit: GRPO step (1024 tokens) | 3.00 s | 5.00 s | 25.00 s (extrapolated) |" in lines
    records[0]["fast_path"] = [1.0, 0.0]
    assert (
        dict((r["target"], r["result"]) for r in gpu_matrix.targets(records)[1])[
            "generation/fast_path = 1 on every step of the default"
        ]
        == "FAIL"
    )


DOC = """# The GPU check

## Results

{header}
|---|---|---|---|---|---|---|
{rows}
## After
"""


def test_the_results_kept_say_which_call_is_next_on_this_commit(tmp_path):
    doc = tmp_path / "GPU_CHECK.md"
    doc.write_text(DOC.format(header=gpu_matrix.RESULTS_HEADER, rows=""))
    assert gpu_matrix.next_call("abc1234", doc)[:1] == (1,)
    items = [i for i in gpu_matrix.call_1(gpu_places(tmp_path))]
    result = {"call": 1, "date": "2026-11-30", "machine": "NVIDIA H100 80GB HBM3", "commit": "abc1234",
              "items": [{"id": i.id, "what": i.what, "kind": i.kind, "status": "PASS", "figure": "x | y"} for i in items],
              "targets": [{"target": "BF16 decode step at batch 8 <= 10 ms at 24 layers", "figure": "9.5 ms",
                           "result": "PASS"}]}
    result["items"][5]["status"] = "SKIPPED"
    assert gpu_matrix.record([result], doc) == len([i for i in items if i.kind != "setup"]) + 1
    rows = gpu_matrix.recorded(doc)
    assert rows[0]["date"] == "2026-11-30" and rows[0]["commit"] == "abc1234" and rows[-1]["item"] == "1.c"
    assert "## After" in doc.read_text() and "x / y" in doc.read_text()
    assert gpu_matrix.next_call("abc1234", doc) == (1, [items[5].id], True), "a skipped item is still to run"
    r = subprocess.run([*MATRIX, "--next", "--commit", "abc1234", "--doc", str(doc)], capture_output=True, text=True)
    assert f"\n  python3 bench/gpu_matrix.py 1 --commit abc1234 --time_limit 420 --only {items[5].id}\n" in r.stdout
    assert gpu_matrix.next_call("fffffff", doc)[0] == 1, "another commit starts again"
    result["items"][5]["status"] = "FAIL"
    gpu_matrix.record([result], doc)
    assert gpu_matrix.next_call("abc1234", doc)[0] == 2
    r = subprocess.run([*MATRIX, "--next", "--commit", "abc1234", "--doc", str(doc)], capture_output=True, text=True)
    assert r.returncode == 0 and "\n  python3 bench/gpu_matrix.py 2 --commit abc1234 --time_limit 420\n" in r.stdout
    assert ".gpu-wheels/ and .gpu-tokenizer.tar.gz" in r.stdout, "the files an offline machine needs"
    assert "run(" not in r.stdout and "carry" not in r.stdout


def test_the_dry_run_shows_each_call_its_plan_and_the_next(tmp_path):
    r = subprocess.run([*MATRIX, "--dry-run", "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for call in gpu_matrix.CALLS:
        assert re.search(rf"# call {call}: ~\d+ s by the estimates \(\d at once\), fits 420 s", r.stdout), call
    assert "bench/gpu_check.py --geometry tiny --preset gpt-oss-20b --steps 2 --save_method lora" in r.stdout
    assert "\nnext: call " in r.stdout and not (tmp_path / "o").exists(), "a dry run writes nothing"


def test_bad_arguments_exit_2_with_one_line(tmp_path):
    cpu = tmp_path / "call1-results.json"
    cpu.write_text(json.dumps({"call": 1, "machine": "cpu", "items": []}))
    copied = tmp_path / "copied-call1-results.json"  # from a tree without git: no commit of its own
    copied.write_text(json.dumps({"call": 1, "machine": "NVIDIA H100", "commit": None, "date": "2026-11-30",
                                  "items": [{"id": "1.1", "what": "x", "kind": "default", "figure": "", "status": "PASS"}]}))
    cases = (["9"], ["1", "--only", "1.99"], ["--record", str(tmp_path / "none.json")], [], ["--record", str(cpu)],
             ["--record", str(copied)], ["1", "--time_limit", "soon"])
    runs = [(args, subprocess.Popen([*MATRIX, *args, "--out", str(tmp_path / "o")], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)) for args in cases]
    for args, run in runs:
        _, err = run.communicate(timeout=60)
        assert run.returncode == 2 and "error:" in err.splitlines()[-1] and "Traceback" not in err, (args, err)
    doc = tmp_path / "GPU_CHECK.md"
    doc.write_text(DOC.format(header=gpu_matrix.RESULTS_HEADER, rows=""))
    r = subprocess.run([*MATRIX, "--record", str(copied), "--commit", "abc1234", "--doc", str(doc)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and [row["commit"] for row in gpu_matrix.recorded(doc)] == ["abc1234"], r.stderr


def test_a_run_says_its_time_first_and_keeps_its_results_in_a_folder_of_its_own(tmp_path, monkeypatch, capsys):
    """What a user sees of `make gpu-check`: the time the call will take, before it starts; where the logs are; the
    table last. A second run never writes over the first one's results: a new folder each time, a used --out refused."""
    monkeypatch.setitem(gpu_matrix.CALLS, 1, lambda p: [fake(tmp_path, "1.1", "print('done')", estimate=150.0)])
    monkeypatch.chdir(tmp_path)
    args = ["1", "--work", str(tmp_path / "work"), "--commit", "abc"]
    assert gpu_matrix.main(args) == 0
    said = capsys.readouterr().out.splitlines()
    assert "== 1 items: about 3 min by an H100's estimates (150 s); no time limit; results in " in said[1]
    (first,) = (tmp_path / "outputs" / "gpu-check").iterdir()
    assert first.name.startswith("call1-") and said[1].endswith(str(first))
    assert any(f"Each item's output: {first / 'logs'}; " in line for line in said)
    assert said[-1].endswith((first / "call1-targets.md").read_text().splitlines()[-1]), "the table is printed last"
    results = (first / "call1-results.json").read_text()
    assert json.loads(results)["items"][0]["status"] == "PASS"

    assert gpu_matrix.main([*args, "--time_limit", "420"]) == 0
    assert "; it stops itself at 410 s; " in capsys.readouterr().out
    assert len(list((tmp_path / "outputs" / "gpu-check").iterdir())) == 2, "a new folder"
    with pytest.raises(SystemExit) as refused:
        gpu_matrix.main([*args, "--out", str(first)])
    assert refused.value.code == 2 and "call 1 already ran there" in capsys.readouterr().err.splitlines()[-1]
    assert (first / "call1-results.json").read_text() == results


def test_the_gpu_set_script_says_in_one_line_what_is_wrong(tmp_path):
    """bench/gpu_set.sh, which item N.0 runs: a wrong verb or nothing to install is a command line it cannot run (exit
    2); a Python without the GPU set, or without a GPU, is a machine not ready (exit 1); one line each, no traceback."""
    bare = tmp_path / "bare-python"  # this Python without its site packages: none of the GPU set
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    script = ["bash", str(REPO / "bench" / "gpu_set.sh")]
    cases = {"typo": (["instal"], sys.executable), "bare": (["check"], str(bare)), "cpu": (["check"], sys.executable)}
    if not (REPO / ".gpu-wheels").exists():  # a packed folder here would really be installed
        cases["install"] = (["install"], sys.executable)
    runs = {name: subprocess.Popen([*script, *args], env={**os.environ, "PYTHON": python}, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for name, (args, python) in cases.items()}
    said = {name: (run.communicate(timeout=120), run.returncode) for name, run in runs.items()}
    for name, ((_, err), rc) in said.items():
        assert "Traceback" not in err and len(err.strip().splitlines()) == (rc != 0), (name, err)
    assert said["typo"][1] == 2 and "usage: bash bench/gpu_set.sh pack" in said["typo"][0][1]
    assert said["bare"][1] == 1 and "gpu_set.sh: missing torch, transformers, trl" in said["bare"][0][1]
    (out, err), rc = said["cpu"]  # this machine's own set: a GPU and its line, or no GPU and why
    assert (rc == 0 and out.startswith("gpu set: python ") and "transformers 5.17.0" in out) or (
        rc == 1 and err.startswith("gpu_set.sh: torch sees no GPU")), (out, err)
    if "install" in said:
        assert said["install"][1] == 2 and "no wheels in .gpu-wheels/" in said["install"][0][1]


@pytest.mark.slow
def test_call_1_on_the_cpu_runs_every_item_and_writes_its_table(tmp_path):
    """Call 1 in --cpu mode: the default's path on a tiny model (GPT-OSS's tokenizer; gpu_check --cpu's backend),
    mxfp4 refused, tiny models at 2 and 4 layers for both presets (GRPO steps, decode steps, their windows), the fit and
    the targets table: every item passes and every file is written. The figures are a CPU's: only the plumbing counts."""
    out = tmp_path / "out"
    r = subprocess.run([*MATRIX, "--cpu", "1", "--out", str(out), "--work", str(tmp_path / "work"), "--commit", "abc"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    result = json.loads((out / "call1-results.json").read_text())
    status = {i["id"]: i["status"] for i in result["items"]}
    assert set(status.values()) == {"PASS"} and len(status) == 13, status
    default = result["items"][0]
    assert default["id"] == "1.1" and default["fast_path"] == [1.0, 1.0]
    figures = default["figures"]
    parts = [figures[p] for p in ("generate", "rewards", "logprobs_and_backward", "optimizer")]
    assert figures["generate"] > 0 and sum(parts) == pytest.approx(figures["step"], rel=0.2)
    assert "/final:" in default["figure"]
    report = json.loads((out / "items" / "1.1.json").read_text())  # gpu_check's own record of the run
    assert (report["steps"], report["steady_steps"], report["preset"], report["device"]) == (2, 1, "gpt-oss-20b", "cpu")
    assert report["tokenizer"] == "gpt-oss" and report["save_problems"] == []
    built = json.loads((tmp_path / "work" / "tiny" / "gpt-oss-tiny-all" / "config.json").read_text())
    assert built["model_type"] == "gpt_oss" and built["vocab_size"] == 201088
    assert "| whole step (median, s) |" in (out / "logs" / "1.1.log").read_text()
    items = {i["id"]: i for i in result["items"]}
    assert "final-merged_16bit" in items["1.11"]["figure"] and items["1.11"]["preset"] == "gpt-oss-20b-bf16"
    assert all(items[i]["window_s"] for i in items if items[i]["kind"] in ("grpo", "decode")), "each was timed alone"
    assert {(i["preset"], i["layers"]) for i in result["items"] if i["kind"] == "decode"} == {
        (p, d) for p in gpu_matrix.PRESETS for d in (2, 4)
    }
    table = (out / "call1-targets.md").read_text()
    assert "| BF16: decode step at batch 8, ours |" in table and "(extrapolated) |" in table
    assert [t["target"] for t in result["targets"]][:3] == [
        "BF16 decode step at batch 8 <= 10 ms at 24 layers",
        "4-bit GRPO step within 1.5x of BF16 at 24 layers",
        "generation/fast_path = 1 on every step of the default",
    ]
    assert r.stdout.rstrip().endswith(table.rstrip().splitlines()[-1]), "the table is printed last"
    assert (out / "call1.log").read_text().count("PASS in") == 13
    with tarfile.open(out / "call1-logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/1.1.log" in names and "runs/1.3/metrics.jsonl" in names
