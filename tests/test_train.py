"""train_2048's command line, presets, checkpoint picking, tiny model, and every setup error (exit 2, one line)."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import rewards
import train_2048

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "configs" / "cpu-demo.yaml")
ON_CPU = ["--use_cpu", "true", "--bf16", "false"]  # GRPOConfig refuses bf16 without a GPU


def parse(*argv):
    """(script, grpo, model, reward settings)."""
    script, settings, grpo, model = train_2048.parse_args(list(argv))
    return script, grpo, model, settings


# --- options -------------------------------------------------------------------------------------------------


def test_flags_override_yaml_and_both_spellings_work(tmp_path):
    script, grpo, model, settings = parse("--config", DEMO, "--max-steps", "7", "--learning_rate", "1e-5")
    assert grpo.max_steps == 7 and grpo.learning_rate == 1e-5
    assert grpo.num_generations == 8 and model.model_name_or_path == "tiny" and script.warm_start
    assert parse("--config", DEMO, "--max_steps", "9")[1].max_steps == 9


def test_game_options_become_reward_settings():
    argv = ("--config", DEMO, "--size", "5", "--target", "512", "--keys", "ZQSD", "--game_salt", "x7", "--seed", "3")
    *_, settings = parse(*argv)
    assert (settings.size, settings.target, settings.keys, settings.game_salt) == (5, 512, "ZQSD", "x7")
    assert settings.profile == "graded" and settings.games == 2


def test_every_reward_setting_is_an_option(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    shown = capsys.readouterr().out
    for f in dataclasses.fields(rewards.RewardSettings):
        assert f"--{f.name}" in shown
    with pytest.raises(SystemExit) as exc:
        parse("--config", DEMO, "--profile", "easy")
    assert exc.value.code == 2


def test_gpt_oss_preset_is_the_notebook_model_with_seed_001s_batch():
    script, grpo, model, settings = parse("--config", str(train_2048.DEFAULT_CONFIG), *ON_CPU)
    assert model.model_name_or_path == "unsloth/gpt-oss-20b" and model.load_in_4bit and model.use_peft
    assert (model.lora_r, model.lora_alpha) == (4, 8)
    assert set(model.lora_target_modules) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert (script.max_seq_length, script.offload_embedding, script.warm_start) == (768, True, False)
    assert (grpo.learning_rate, grpo.weight_decay, grpo.warmup_steps) == (5e-5, 0.001, 0.1)
    assert grpo.lr_scheduler_type == "linear" and grpo.optim == "adamw_8bit"
    assert (grpo.num_generations, grpo.gradient_accumulation_steps, grpo.max_completion_length) == (2, 4, 200)
    assert (grpo.temperature, grpo.max_steps, grpo.save_steps, grpo.logging_steps) == (1.0, 1000, 100, 1)
    assert grpo.output_dir == "outputs" and grpo.report_to == ["tensorboard"]
    assert grpo.chat_template_kwargs == {"reasoning_effort": "low"}
    assert settings == rewards.RewardSettings()  # graded, default board


def test_notebook_preset_reproduces_the_notebook():
    script, grpo, model, settings = parse("--config", str(REPO / "configs" / "notebook.yaml"), *ON_CPU)
    assert (settings.profile, settings.size, settings.target, settings.games) == ("notebook", 6, 2048, 1)
    assert (grpo.max_completion_length, grpo.gradient_accumulation_steps, grpo.num_generations) == (586, 1, 2)
    assert model.model_name_or_path == "unsloth/gpt-oss-20b" and grpo.learning_rate == 5e-5


def test_cpu_demo_preset_runs_on_the_cpu_with_a_small_board():
    script, grpo, model, settings = parse("--config", DEMO)
    assert grpo.use_cpu and not grpo.bf16 and script.backend == "transformers" and script.cpu_threads == 1
    assert (settings.size, settings.target) == (4, 256) and script.warm_start


def test_early_option_reads_flags_before_yaml():
    config = {"backend": "unsloth", "use_cpu": False}
    assert train_2048.early_option(["--backend", "transformers"], config, "backend") == "transformers"
    assert train_2048.early_option(["--use-cpu"], config, "use_cpu") == "true"
    assert train_2048.early_option(["--use_cpu=false"], config, "use_cpu") == "false"
    assert train_2048.early_option([], config, "backend") == "unsloth"


# --- checkpoints, saving helpers -----------------------------------------------------------------------------


def fake_checkpoint(root: Path, step: int, state: str | None) -> Path:
    path = root / f"checkpoint-{step}"
    path.mkdir()
    (path / "adapter_model.safetensors").write_bytes(b"x")
    if state is not None:
        (path / "trainer_state.json").write_text(state)
    return path


def test_latest_checkpoint_skips_half_written_ones(tmp_path):
    good = fake_checkpoint(tmp_path, 4, json.dumps({"global_step": 4}))
    fake_checkpoint(tmp_path, 6, None)  # killed before trainer_state.json
    fake_checkpoint(tmp_path, 8, '{"global_step": 8, "log_hist')  # killed while writing it
    fake_checkpoint(tmp_path, 10, json.dumps({"global_step": 2}))  # not what its name says
    fake_checkpoint(tmp_path, 2, json.dumps({"global_step": 2}))
    (tmp_path / "checkpoint-12.tmp").mkdir()
    assert train_2048.latest_checkpoint(tmp_path) == good
    assert train_2048.latest_checkpoint(tmp_path / "nothing-here") is None


def test_publish_replaces_a_folder_whole(tmp_path):
    target = tmp_path / "final"
    target.mkdir()
    (target / "old").write_text("1")
    tmp = train_2048.fresh(target)
    tmp.mkdir()
    (tmp / "new").write_text("2")
    train_2048.publish(tmp, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert [p.name for p in target.iterdir()] == ["new"]


def test_writable_creates_nothing(tmp_path):
    assert train_2048.writable(tmp_path / "a" / "b")
    assert not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("")
    assert not train_2048.writable(tmp_path / "file" / "out")


def test_check_same_is_strict_on_transformers_and_a_warning_on_unsloth(tmp_path):
    assert train_2048.check_same([[1, 2]], [[1, 2]], tmp_path, "transformers")
    assert not train_2048.check_same([[1, 2]], [[1, 3]], tmp_path, "transformers")
    assert train_2048.check_same([[1, 2]], [[1, 3]], tmp_path, "unsloth")


def test_short_line_shows_the_health_numbers():
    logs = {"reward": 3.5, "reward_std": 1.25, "game/win_rate": 0.25, "completions/clipped_ratio": 0.0, "kl": 0.001}
    line = train_2048.short_line(3, 10, logs)
    assert line.startswith("step 3/10") and "reward 3.50" in line and "win 25%" in line and "kl 0.0010" in line


def test_eval_line_shows_the_evaluation():
    logs = {"eval_valid_rate": 0.75, "eval_cheat_rate": 0.0, "eval_win_rate": 0.125, "eval_max_tile_log2": 6.5}
    line = train_2048.eval_line(40, {**logs, "eval_mean_score": 812.4, "eval_seconds": 1.5, "epoch": 0.04})
    assert line.startswith("eval at step 40:") and "valid 75%" in line and "win 12%" in line
    assert "tile 2^6.5" in line and "score 812" in line and "epoch" not in line


# --- models --------------------------------------------------------------------------------------------------


def test_tiny_model_round_trips_code_and_takes_reasoning_effort(tmp_path):
    from transformers import AutoTokenizer

    prompt = rewards.build_prompt(rewards.RewardSettings(size=4, target=256))
    corpus = [prompt] + [text for _, _, text in train_2048.demo_data.EXAMPLES]
    path = train_2048.build_tiny_model(tmp_path / "tiny-model", corpus, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for _, _, text in train_2048.demo_data.EXAMPLES:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text and len(ids) <= 80  # answers are short in tokens
    chat = [{"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, reasoning_effort="low")
    assert rendered == "<|user|>hi<|end|><|assistant|>"
    assert train_2048.build_tiny_model(path, ["other"], seed=1) == path  # built once per output dir


def test_evaluate_policy_is_repeatable_and_leaves_training_undisturbed(tmp_path):
    """--eval_steps' evaluation: fixed seeds, so the same weights give the same numbers; the model goes back to
    train mode and torch's random state is as it was, so training goes on as if it had not run."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import sandbox

    *_, settings = parse("--config", DEMO)
    corpus = [rewards.build_prompt(settings)] + [text for _, _, text in train_2048.demo_data.EXAMPLES]
    path = train_2048.build_tiny_model(tmp_path / "tiny-model", corpus, seed=0)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    model.train()
    kwargs = dict(samples=3, games=2, temperature=1.0, max_new_tokens=16, batch_size=2, reasoning_effort="low")
    torch.manual_seed(123)
    before = torch.get_rng_state()
    try:
        first = train_2048.evaluate_policy(model, tokenizer, settings, **kwargs)
        assert model.training and torch.equal(torch.get_rng_state(), before)
        assert train_2048.evaluate_policy(model, tokenizer, settings, **kwargs) == first
    finally:
        sandbox.shutdown()
    assert set(first) == {"valid_rate", "cheat_rate", "win_rate", "max_tile_log2", "mean_score"}
    assert all(0.0 <= first[k] <= 1.0 for k in ("valid_rate", "cheat_rate", "win_rate"))
    assert first["max_tile_log2"] >= 0.0 and first["mean_score"] >= 0.0


def test_gpt_oss_experts_get_lora_through_target_parameters(tmp_path):
    """transformers fuses GPT-OSS experts into tensors; the PEFT path must still put LoRA on them."""
    from transformers import GptOssConfig, GptOssForCausalLM, PreTrainedTokenizerFast
    from trl import ModelConfig

    config = GptOssConfig(
        vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=32, max_position_embeddings=256,
    )  # fmt: skip
    GptOssForCausalLM(config).save_pretrained(tmp_path)
    tokenizer_dir = train_2048.build_tiny_model(tmp_path / "tok", ["a b c"], seed=0)
    PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(tmp_path)
    model_args = ModelConfig(
        model_name_or_path=str(tmp_path), use_peft=True, lora_r=4, lora_alpha=8, attn_implementation="eager",
        lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )  # fmt: skip
    training_args = SimpleNamespace(trust_remote_code=False, seed=0, gradient_checkpointing=False)
    model, _ = train_2048.load_model(str(tmp_path), "transformers", None, model_args, training_args)
    lora = [n for n, p in model.named_parameters() if "lora_" in n and p.requires_grad]
    assert any("experts" in n for n in lora) and any("q_proj" in n for n in lora)


# --- setup errors: one line on stderr, exit 2, no traceback, nothing written ---------------------------------


def run(*args, cwd=REPO):
    return subprocess.run(
        [sys.executable, str(REPO / "train_2048.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )


def one_line_error(result, *words):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def usage_error(result, *words):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("usage: train_2048.py") and len(result.stderr.splitlines()) == 2
    for word in words:
        assert word in result.stderr, result.stderr


@pytest.fixture
def out(tmp_path):
    return tmp_path / "out"


def test_help_is_readable_and_lists_our_options():
    result = run("--help")
    assert result.returncode == 0
    for flag in ("--resume", "--save_method", "--warm_start", "--size", "--max_steps", "--lora_r", "--config"):
        assert flag in result.stdout
    assert "train_2048:" in result.stdout and "game and rewards:" in result.stdout
    for flag in ("--eval_steps", "--eval_samples", "--eval_games"):
        assert flag in result.stdout
    assert "eval/win_rate" in " ".join(result.stdout.split())  # --eval_steps is GRPOConfig's, with our help


@pytest.mark.parametrize(
    "args, words",
    [
        (["--no_such_flag", "1"], ["--no_such_flag"]),
        (["--max_steps", "many"], ["--max_steps", "many"]),
        (["--save_method", "zip"], ["--save_method", "zip"]),
        (["--profile", "easy"], ["--profile"]),
        (["--games", "0"], ["games"]),
        (["--eval_steps", "-1"], ["--eval_steps", ">= 0"]),
        (["--eval_samples", "0"], ["--eval_samples"]),
        (["--eval_games", "0"], ["--eval_games"]),
        (["--eval_strategy", "steps"], ["--eval_strategy", "--eval_steps"]),
    ],
)
def test_bad_options_are_usage_errors(out, args, words):
    result = run("--config", DEMO, "--output_dir", str(out), *args)
    usage_error(result, *words)
    assert not out.exists()


def test_unknown_yaml_key_is_a_usage_error(tmp_path, out):
    config = tmp_path / "c.yaml"
    config.write_text(Path(DEMO).read_text() + "\nmax_stepz: 3\n")
    usage_error(run("--config", str(config), "--output_dir", str(out)), "max_stepz")
    assert not out.exists()


@pytest.mark.parametrize("content", [None, "a: [unclosed\n", "- just\n- a list\n"])
def test_unreadable_config(tmp_path, out, content):
    config = tmp_path / "c.yaml"
    if content is not None:
        config.write_text(content)
    one_line_error(run("--config", str(config), "--output_dir", str(out)), str(config))
    assert not out.exists()


def test_unwritable_output_dir(tmp_path):
    (tmp_path / "a-file").write_text("")
    one_line_error(run("--config", DEMO, "--output_dir", str(tmp_path / "a-file" / "out")), "output_dir", "writable")


def test_missing_model_path(tmp_path, out):
    result = run("--config", DEMO, "--output_dir", str(out), "--model_name_or_path", str(tmp_path / "no-model"))
    one_line_error(result, "no-model", "does not exist")
    assert not out.exists()


def test_resume_from_something_that_is_not_a_checkpoint(tmp_path, out):
    fake_checkpoint(tmp_path, 3, None)
    result = run("--config", DEMO, "--output_dir", str(out), "--resume", str(tmp_path / "checkpoint-3"))
    one_line_error(result, "checkpoint-3", "not a complete checkpoint")
    assert not out.exists()


def test_gpt_oss_without_a_gpu_points_at_the_cpu_demo(out):
    one_line_error(run("--output_dir", str(out)), "CUDA GPU", "configs/cpu-demo.yaml")
    assert not out.exists()


def test_mxfp4_without_a_gpu_fails_at_startup(out):
    one_line_error(run("--config", DEMO, "--output_dir", str(out), "--save_method", "mxfp4"), "mxfp4")
    assert not out.exists()


def test_model_that_cannot_be_loaded(tmp_path, out):
    env_offline = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run(
        [sys.executable, str(REPO / "train_2048.py"), "--config", DEMO, "--output_dir", str(out)]
        + ["--model_name_or_path", "nobody/no-such-model"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=env_offline,
    )  # fmt: skip
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("[transformers]")]
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert lines[-1].startswith("train_2048: cannot load model nobody/no-such-model"), result.stderr
    assert not out.exists()


def test_rewards_rank_the_demo_answers_good_over_random_over_broken_over_cheating():
    import sandbox

    *_, settings = parse("--config", DEMO)
    funcs = rewards.reward_functions(settings)
    answers = train_2048.demo_data.EXAMPLES
    totals = [0.0] * len(answers)
    for step in range(8):
        state = SimpleNamespace(global_step=step)
        for f in funcs:
            for i, score in enumerate(f(completions=[text for _, _, text in answers], trainer_state=state)):
                totals[i] += score
    sandbox.shutdown()
    by_kind = {}
    for (kind, _, _), total in zip(answers, totals):
        by_kind[kind] = min(by_kind.get(kind, total), total)
    broken = max(by_kind[k] for k in ("no_code", "syntax_error", "crashes"))
    assert by_kind["corner"] > by_kind["random"] > by_kind["stuck"] > broken > by_kind["cheats"], by_kind
