"""train_2048's command line, presets, checkpoint picking, tiny model, and every setup error (exit 2, one line)."""

import dataclasses
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

import demo_data
import evaluation
import models
import options
import rewards
import run_folder
import saving
import train_2048
import trainer

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "configs" / "cpu-demo.yaml")


def demo_with(text: str) -> str:
    """The demo preset with the keys of `text` in place of its own (a preset that gives a key twice is refused)."""
    keys = {line.split(":")[0] for line in text.splitlines() if line and not line.startswith((" ", "#"))}
    kept = [line for line in Path(DEMO).read_text().splitlines() if line.split(":")[0] not in keys]
    return "\n".join(kept) + "\n" + text + "\n"
ON_CPU = ["--use_cpu", "true", "--bf16", "false"]  # GRPOConfig refuses bf16 without a GPU


def parse(*argv):
    """(script, grpo, model, reward settings)."""
    script, settings, grpo, model = options.parse_args(list(argv))
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
    assert settings.profile == "graded" and settings.games == 4  # the demo's


def test_every_reward_setting_is_an_option(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    shown = capsys.readouterr().out
    for f in dataclasses.fields(rewards.RewardSettings):
        assert f"--{f.name}" in shown
    with pytest.raises(options.OptionError, match="--profile: invalid choice: 'easy'"):
        parse("--config", DEMO, "--profile", "easy")


def test_gpt_oss_preset_is_the_notebook_model_with_seed_001s_batch():
    script, grpo, model, settings = parse("--config", str(options.DEFAULT_CONFIG), *ON_CPU)
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
    assert (script.max_seq_length, script.offload_embedding, script.warm_start) == (1536, None, False)  # decided by the GPU
    assert (grpo.learning_rate, grpo.weight_decay, grpo.warmup_steps) == (5e-5, 0.001, 0.1)
    assert grpo.lr_scheduler_type == "linear" and grpo.optim == "adamw_8bit"
    assert (grpo.num_generations, grpo.gradient_accumulation_steps, grpo.max_completion_length) == (8, 4, 1024)
    assert grpo.mask_truncated_completions and script.truncated == "score"  # chosen by bench/bench_truncation.py
    # one group of 8 per step, generated at once, trained 2 completions at a time (the memory of the old 4 x 2)
    assert (grpo.generation_batch_size, grpo.per_device_train_batch_size) == (8, 2)
    assert grpo.router_aux_loss_coef == 0  # Unsloth's GRPO refuses GPT-OSS's own MoE router loss
    assert (grpo.temperature, grpo.max_steps, grpo.save_steps, grpo.logging_steps) == (1.0, 1000, 100, 1)
    assert grpo.output_dir == "outputs" and grpo.report_to == ["tensorboard"]
    assert grpo.chat_template_kwargs == {"reasoning_effort": "low"}
    assert settings == rewards.RewardSettings()  # graded, default board


def test_bf16_preset_is_the_default_run_with_16_bit_weights():
    default = parse("--config", str(options.DEFAULT_CONFIG), *ON_CPU)
    script, grpo, model, settings = parse("--config", str(REPO / "configs" / "gpt-oss-20b-bf16.yaml"), *ON_CPU)
    assert model.model_name_or_path == "unsloth/gpt-oss-20b-BF16" and not model.load_in_4bit
    assert not script.offload_embedding and grpo.router_aux_loss_coef == 0 and settings == default[3]
    for name in ("learning_rate", "num_generations", "generation_batch_size", "max_completion_length", "optim"):
        assert getattr(grpo, name) == getattr(default[1], name), name
    assert (model.lora_r, model.lora_target_modules) == (default[2].lora_r, default[2].lora_target_modules)


def test_wide_preset_samples_one_group_of_16():
    default = parse("--config", str(REPO / "configs" / "gpt-oss-20b-bf16.yaml"), *ON_CPU)
    script, grpo, model, settings = parse("--config", str(REPO / "configs" / "gpt-oss-20b-bf16-wide.yaml"), *ON_CPU)
    assert (grpo.num_generations, grpo.generation_batch_size) == (16, 16) and settings == default[3]
    assert model.model_name_or_path == default[2].model_name_or_path and grpo.learning_rate == default[1].learning_rate


def test_notebook_preset_reproduces_the_notebook():
    script, grpo, model, settings = parse("--config", str(REPO / "configs" / "notebook.yaml"), *ON_CPU)
    assert (settings.profile, settings.size, settings.target, settings.games) == ("notebook", 6, 2048, 1)
    assert (grpo.max_completion_length, grpo.gradient_accumulation_steps, grpo.num_generations) == (586, 1, 2)
    assert model.model_name_or_path == "unsloth/gpt-oss-20b" and grpo.learning_rate == 5e-5
    assert grpo.router_aux_loss_coef == 0


def test_cpu_demo_preset_runs_on_the_cpu_with_a_small_board():
    script, grpo, model, settings = parse("--config", DEMO)
    assert grpo.use_cpu and not grpo.bf16 and script.backend == "transformers" and script.cpu_threads == 1
    assert (settings.size, settings.target, settings.games) == (3, 128, 4) and script.warm_start
    assert grpo.eval_strategy == "steps" and grpo.eval_steps == 20 and script.eval_samples == 8


def test_early_options_read_flags_after_yaml_and_never_abbreviations(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("backend: unsloth\nuse_cpu: false\n")
    early = lambda *argv: options.early_options(["--config", str(preset), *argv])  # noqa: E731
    assert early("--backend", "transformers").backend == "transformers"
    assert early("--use-cpu").use_cpu == "true"
    assert early("--use_cpu=false").use_cpu == "false"
    assert early().backend == "unsloth" and early().use_cpu == "false"  # a YAML boolean, as its flag would say it
    # an abbreviation is no option for the early read, and the full parse refuses it: both read the same values
    assert early("--back", "transformers").backend == "unsloth"
    with pytest.raises(options.OptionError, match="unknown option --back"):
        parse("--config", DEMO, "--back", "unsloth")


def test_a_yaml_value_is_checked_as_its_flag_is(tmp_path):
    """A preset's values become the words of their flags: a list for a list option, true/false, a mapping's JSON;
    the flags after them win (tests/test_mistakes.py has the values refused)."""
    preset = tmp_path / "preset.yaml"
    preset.write_text(demo_with("report_to: [tensorboard]\nlearning_rate: 5e-5\nmax_steps: 7\n"
                                "chat_template_kwargs: {reasoning_effort: medium}\nlora_modules_to_save: null"))
    script, grpo, model, settings = parse("--config", str(preset), "--max_steps", "9")
    assert grpo.report_to == ["tensorboard"] and grpo.learning_rate == 5e-5 and grpo.max_steps == 9
    assert grpo.chat_template_kwargs == {"reasoning_effort": "medium"} and model.lora_modules_to_save is None
    assert parse("--config", str(preset), "--report_to", "none")[1].report_to == []


def test_the_best_evaluation_is_chosen_by_the_eval_reward_unless_said_otherwise():
    """transformers' metric_for_best_model picks the adapters kept in <output_dir>/best: eval_mean_reward (greater is
    better) where the run evaluates, also under --load_best_model_at_end (whose eval_loss a GRPO evaluation does not
    log); a metric given stays, with transformers' greater_is_better rule; no evaluation, no metric."""
    grpo = parse("--config", DEMO)[1]
    assert (grpo.metric_for_best_model, grpo.greater_is_better) == ("eval_mean_reward", True)
    grpo = parse("--config", DEMO, "--load_best_model_at_end", "true")[1]
    assert (grpo.metric_for_best_model, grpo.greater_is_better, grpo.load_best_model_at_end) == ("eval_mean_reward",
                                                                                                True, True)  # fmt: skip
    grpo = parse("--config", DEMO, "--metric_for_best_model", "cheat_rate", "--greater_is_better", "false")[1]
    assert (grpo.metric_for_best_model, grpo.greater_is_better) == ("cheat_rate", False)
    assert parse("--config", DEMO, "--eval_strategy", "no")[1].metric_for_best_model is None


# Every list option of train_2048 (a field typed list[...]): a value a preset may set, and what clearing it gives.
LISTS = {
    "lora_target_modules": (["q_proj", "v_proj"], []), "lora_modules_to_save": (["embed_tokens", "lm_head"], []),
    "lora_target_parameters": (["mlp.experts.gate_up_proj"], []), "report_to": (["tensorboard"], []),
    "reward_weights": ([1.0, 2.0, 0.5], None), "label_names": (["labels"], []), "include_for_metrics": (["inputs"], []),
    "debug": (["underflow_overflow"], []), "optim_target_modules": (["q_proj", "v_proj"], None),
}  # fmt: skip


def without_key(text, name):
    """The preset's text without its own line for the key: a preset gives each key once."""
    return "\n".join(line for line in text.splitlines() if not line.startswith(f"{name}:"))


def value_of(parsed, name):
    return next(getattr(part, name) for part in parsed if hasattr(part, name))


def test_every_list_option_can_be_cleared_from_the_command_line_and_from_yaml(tmp_path, capsys):
    """A preset's list, cleared by the spelling transformers has for --report_to (`none`), by an empty word, by
    `--name=` and by a YAML []: the empty list (None where the library reads no empty list); `none` beside other values
    is one line; --help says how for each."""
    parser = options.train_parser()
    lists = {name for name, text in options.field_types(parser).items() if "list" in text}
    assert lists == set(LISTS)  # a new list option gets its case here
    helps = {action.dest: " ".join((action.help or "").split()) for action in parser._actions}
    for name, (value, cleared) in LISTS.items():
        assert "`none` (or '') clears it, a preset's list too" in helps[name], name
        extra = ["--lora_target_parameters", "mlp.experts.gate_up_proj"] if name == "lora_target_modules" else []
        preset = tmp_path / f"{name}.yaml"
        preset.write_text(without_key(Path(DEMO).read_text(), name) + f"\n{name}: {value}\n")
        got = value_of(parse("--config", str(preset)), name)
        assert [str(getattr(v, "value", v)) for v in got] == [str(v) for v in value], name
        for spelling in (["none"], [""], ["None"]):
            assert value_of(parse("--config", str(preset), f"--{name}", *spelling, *extra), name) == cleared, name
        assert value_of(parse("--config", str(preset), f"--{name}=", *extra), name) == cleared, name
        preset.write_text(without_key(Path(DEMO).read_text(), name) + f"\n{name}: []\n")
        assert value_of(parse("--config", str(preset), *extra), name) == cleared, name
    with pytest.raises(options.OptionError, match="--lora_modules_to_save none empties the list: give it alone"):
        parse("--config", DEMO, "--lora_modules_to_save", "none", "lm_head")
    with pytest.raises(options.OptionError, match="--lora_target_modules none: LoRA on no module"):
        parse("--config", DEMO, "--lora_target_modules", "none")


def test_the_demo_preset_without_its_trained_embeddings(tiny):
    """The issue's case: configs/cpu-demo.yaml trains the embeddings and the output layer in full; on a real model a
    user clears that from the command line and trains the LoRA alone."""
    path, _ = tiny

    def trainable(*flags):
        model_args = parse("--config", DEMO, *flags)[2]
        model = models.attach_lora(models.load_model(str(path), model_args)[0], model_args, "tiny", backend="transformers")
        return sum(p.numel() for p in model.parameters() if p.requires_grad), str(model)

    full, shown = trainable()
    assert "modules_to_save" in shown
    for word in ("none", ""):  # (before: a module list ["none"], which PEFT let pass matching nothing, and [""])
        lora, cleared = trainable("--lora_modules_to_save", word)
        assert "modules_to_save" not in cleared and lora < full / 2, word


def test_unsloth_refuses_a_router_loss_before_loading(tmp_path, capsys):
    script, grpo, model, settings = parse(
        "--config", DEMO, "--output_dir", str(tmp_path), "--router_aux_loss_coef", "0.9"
    )
    with pytest.raises(options.OptionError) as exc:
        options.check_before_loading(script, settings, grpo, model, backend="unsloth")
    line = str(exc.value)
    assert line.startswith("--router_aux_loss_coef 0.9") and "set it to 0" in line
    for coef in ("0", None):  # 0, and the model's own (checked once the model is loaded)
        extra = ["--router_aux_loss_coef", coef] if coef else []
        script, grpo, model, settings = parse("--config", DEMO, "--output_dir", str(tmp_path), *extra)
        assert options.check_before_loading(script, settings, grpo, model, backend="unsloth") == []


def test_training_without_the_seccomp_wall_stops_with_one_line(tmp_path, capsys):
    import sandbox

    sandbox.shutdown()
    sandbox.start(_disable_seccomp=True)  # as where libseccomp is missing
    try:
        script, grpo, model, settings = parse("--config", DEMO, "--output_dir", str(tmp_path / "out"))
        with pytest.raises(options.OptionError) as exc:
            options.check_before_loading(script, settings, grpo, model, backend="transformers")
        assert str(exc.value).startswith("the sandbox has no seccomp wall here")
        optout = parse("--config", DEMO, "--output_dir", str(tmp_path / "out"), "--require_seccomp", "false")
        assert options.check_before_loading(*optout[:1], optout[3], optout[1], optout[2], "transformers") == []
    finally:
        sandbox.shutdown()


# --- checkpoints, saving helpers -----------------------------------------------------------------------------


def test_publish_replaces_only_the_files_it_wrote(tmp_path):
    """publish() puts a folder in place whole; over a folder the same command published, it replaces the files its mark
    lists (one it wrote and no longer writes goes) and nothing else there (a user's file, an evaluation's folder), and
    leaves nothing beside it; a user's folder of the same name is refused, untouched, and so is a file of the user's
    put in place of one it wrote."""
    target = tmp_path / "final"
    for content in ("1", "2"):
        tmp = saving.fresh(target)
        (tmp / "new").write_text(content)
        (tmp / f"only-{content}").write_text(content)
        saving.publish(tmp, target, "train_2048")
        (target / "mine.txt").write_text("mine")
        (target / "eval").mkdir(exist_ok=True)
        (target / "eval" / "results.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert sorted(p.name for p in target.iterdir()) == [saving.MARK, "eval", "mine.txt", "new", "only-2"]
    assert (target / "new").read_text() == "2" and (target / "eval" / "results.json").read_text() == "{}"
    (target / "new").unlink()
    (target / "new").write_text("the user's own, in place of ours")
    tmp = saving.fresh(target)
    (tmp / "new").write_text("3")
    with pytest.raises(saving.NotOurs, match="holds new, which train_2048 did not write"):
        saving.publish(tmp, target, "train_2048")
    assert (target / "new").read_text() == "the user's own, in place of ours" and (target / "only-2").exists()
    users = tmp_path / "users"
    users.mkdir()
    (users / "keep").write_text("mine")
    tmp = saving.fresh(users)
    with pytest.raises(saving.NotOurs):
        saving.publish(tmp, users, "train_2048")
    assert [p.name for p in users.iterdir()] == ["keep"]


def test_writable_creates_nothing(tmp_path):
    assert run_folder.writable(tmp_path / "a" / "b")
    assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("")
    assert not run_folder.writable(tmp_path / "file" / "out")
    assert not run_folder.writable(Path("/proc/train_2048-out"))  # root passes /proc's permission check


def test_short_line_shows_the_health_numbers():
    logs = {"reward": 3.5, "reward_std": 1.25, "game/win_rate": 0.25, "completions/clipped_ratio": 0.0, "kl": 0.001}
    line = trainer.short_line(3, 10, {**logs, "time/step_s": 12.25})
    assert line.startswith("step 3/10") and "reward 3.50" in line and "win 25%" in line and "kl 0.0010" in line
    assert line.endswith("12.2 s")


def test_eval_line_shows_the_evaluation():
    logs = {"eval_valid_rate": 0.75, "eval_cheat_rate": 0.0, "eval_win_rate": 0.125, "eval_max_tile_log2": 6.5}
    line = trainer.eval_line(40, {**logs, "eval_mean_score": 812.4, "eval_mean_reward": 7.891, "eval_seconds": 1.5,
                                  "epoch": 0.04})  # fmt: skip
    assert line.startswith("eval at step 40:") and "valid 75%" in line and "win 12%" in line
    assert "tile 2^6.5" in line and "score 812" in line and "reward 7.89" in line and "epoch" not in line


# --- models --------------------------------------------------------------------------------------------------


def test_tiny_model_round_trips_code_and_takes_reasoning_effort(tmp_path):
    from transformers import AutoTokenizer

    script, grpo, _, settings = parse("--config", DEMO)
    corpus = train_2048.demo_data.corpus(rewards.build_prompt(settings))  # as train_2048 builds it
    path = demo_data.build_tiny_model(tmp_path / "tiny-model", corpus, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for _, _, text in train_2048.demo_data.EXAMPLES:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text and len(ids) < grpo.max_completion_length  # every answer fits, with EOS
    chat = [{"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, reasoning_effort="low")
    assert rendered == "<|user|>hi<|end|><|assistant|>"
    assert demo_data.build_tiny_model(path, ["other"], seed=1) == path  # built once per output dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The CPU demo's tiny model, on disk, and its training settings."""
    *_, settings = parse("--config", DEMO)
    corpus = [rewards.build_prompt(settings)] + [text for _, _, text in train_2048.demo_data.EXAMPLES]
    return demo_data.build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-model", corpus, seed=0), settings


def test_evaluation_is_repeatable_and_leaves_training_undisturbed(tiny):
    """The evaluation every eval_steps: fixed seeds, so the same weights give the same numbers; the model goes back
    to train mode and torch's random state is as it was, so training goes on as if it had not run."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import sandbox

    path, settings = tiny
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    model.train()
    config = evaluation.generation_config(evaluation.sampling_options(), tokenizer, max_new_tokens=16)
    kwargs = dict(samples=3, seed=0, config=config, batch_size=2, chat_kwargs={})
    torch.manual_seed(123)
    before = torch.get_rng_state()
    try:
        first = evaluation.sample_completions(model, tokenizer, settings, **kwargs)
        assert model.training and torch.equal(torch.get_rng_state(), before)
        assert evaluation.sample_completions(model, tokenizer, settings, **kwargs) == first
        # batches are seeded on their own: the same samples whichever process generates which batch
        assert evaluation.sample_completions(model, tokenizer, settings, **{**kwargs, "samples": 2}) == first[:2]
        metrics = evaluation.policy_metrics(first, [0, 1], settings)
        assert evaluation.policy_metrics(first, [0, 1], settings) == metrics
    finally:
        sandbox.shutdown()
    assert set(metrics) == set(evaluation.EVAL_METRICS)
    assert all(0.0 <= metrics[k] <= 1.0 for k in ("valid_rate", "cheat_rate", "win_rate"))
    assert metrics["max_tile_log2"] >= 0.0 and metrics["mean_score"] >= 0.0


def tiny_gpt_oss(path: Path) -> Path:
    """A GPT-OSS-architecture model with random weights (2 layers, 4 experts) and the demo's tokenizer."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=32, max_position_embeddings=256,
    )  # fmt: skip
    model = GptOssForCausalLM(config)
    model.generation_config.max_length = 4096  # as a hub checkpoint's generation_config.json may carry
    model.save_pretrained(path)
    demo_data.build_tokenizer(["a b c"], vocab_size=300).save_pretrained(path)
    return path


GPT_OSS_LORA = dict(
    use_peft=True, lora_r=4, lora_alpha=8, attn_implementation="eager",
    lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
)  # fmt: skip


def test_gpt_oss_experts_get_lora_through_target_parameters_and_generation_is_quiet(tmp_path, caplog):
    """transformers fuses GPT-OSS experts into tensors; the PEFT path must still put LoRA on them. The checkpoint's
    max_length is dropped at load, so generating with max_new_tokens does not warn at every call."""
    import logging

    from trl import ModelConfig

    path = tiny_gpt_oss(tmp_path / "gpt-oss")
    model, tokenizer = models.load_model(str(path), ModelConfig(model_name_or_path=str(path), **GPT_OSS_LORA),
                                         trainable=True)  # fmt: skip
    lora = [n for n, p in model.named_parameters() if "lora_" in n and p.requires_grad]
    assert any("experts" in n for n in lora) and any("q_proj" in n for n in lora)
    assert model.generation_config.max_length is None
    with caplog.at_level(logging.WARNING):
        model.generate(input_ids=tokenizer("a b", return_tensors="pt")["input_ids"], max_new_tokens=3, do_sample=False)
    assert "max_length" not in caplog.text


def trained_peft(tmp_path, settings_path=None):
    """A tiny GPT-OSS with LoRA (experts included) whose adapters are not zero, as after training."""
    import torch
    from trl import ModelConfig

    path = tiny_gpt_oss(tmp_path / "gpt-oss")
    model, tokenizer = models.load_model(str(path), ModelConfig(model_name_or_path=str(path), **GPT_OSS_LORA),
                                         trainable=True)  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "a b"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)  # fmt: skip
    return model, tokenizer, inputs


def test_verify_adapter_passes_a_true_save_and_fails_a_tampered_one(tmp_path):
    from safetensors.torch import load_file, save_file

    model, tokenizer, inputs = trained_peft(tmp_path)
    model.save_pretrained(tmp_path / "final")
    assert saving.verify_adapter(model, tokenizer, tmp_path / "final", inputs, seed=0)
    assert list(model.peft_config) == ["default"]  # the second adapter is gone again
    saved = load_file(str(tmp_path / "final" / "adapter_model.safetensors"))
    experts = [k for k in saved if "experts" in k]
    assert experts  # GPT-OSS's per-expert LoRA is in the save
    save_file(
        {k: v for k, v in saved.items() if k not in experts}, str(tmp_path / "final" / "adapter_model.safetensors")
    )
    assert not saving.verify_adapter(model, tokenizer, tmp_path / "final", inputs, seed=0)  # unsloth-zoo #885's bug
    changed = {k: v + 1e-3 if k == experts[0] else v for k, v in saved.items()}
    save_file(changed, str(tmp_path / "final" / "adapter_model.safetensors"))
    assert not saving.verify_adapter(model, tokenizer, tmp_path / "final", inputs, seed=0)


# --- setup errors: one line on stderr, exit 2, no traceback, nothing written ---------------------------------


def run(*args, env=None):
    return subprocess.run(
        [sys.executable, str(REPO / "train_2048.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})},
    )


def one_line_error(result, *words):
    """Exit 2, no traceback, and our line last. On a GPU machine libraries may print at import before it (the
    known ones are filtered); nothing of theirs may come after."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("train_2048: "), result.stderr
    for word in words:
        assert word in last, last


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """The command lines whose behaviour is the process's (what it prints and its exit status, with the environment
    it imports its libraries in), started together: each is a fresh process that spends ~11 s of a 2-core machine
    importing torch, transformers and TRL before it can fail. tests/test_mistakes.py runs the whole table of mistakes
    in-process. A test waits for its own: `cli[name]` is (its output folder, which must stay absent; the process's
    future)."""
    root = tmp_path_factory.mktemp("cli")
    preset = root / "float-for-int.yaml"
    preset.write_text(demo_with("max_steps: 2.5"))
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(root / "hf"), "HF_TOKEN": ""}
    cases = {
        "help": (["--help"], None),
        "yaml-float-for-int": (["--config", str(preset)], None),
        "gpt-oss-on-cpu": ([], None),
        "cannot-load": (["--config", DEMO, "--model_name_or_path", "nobody/no-such-model"], offline),
        "push-to-hub": (["--config", DEMO, "--push_to_hub", "true"], offline),
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        started = {}
        for name, (args, env) in cases.items():
            out = root / name / "out"
            if name != "help":
                args = [*args, "--output_dir", str(out)]
            started[name] = (out, pool.submit(run, *args, env=env))
        yield started


def finished(cli, name):
    out, future = cli[name]
    return out, future.result()


def test_help_is_readable_and_lists_our_options(cli):
    _, result = finished(cli, "help")
    assert result.returncode == 0
    for flag in ("--resume", "--save_method", "--warm_start", "--size", "--max_steps", "--lora_r", "--config"):
        assert flag in result.stdout
    for flag in ("--overwrite_output_dir", "--config FILE.yaml"):
        assert flag in result.stdout
    assert "train_2048:" in result.stdout and "game and rewards:" in result.stdout
    for flag in ("--eval_strategy", "--eval_steps", "--eval_samples", "--eval_games", "--fast_generation"):
        assert flag in result.stdout
    assert "eval/win_rate" in " ".join(result.stdout.split())


def test_a_yaml_value_of_the_wrong_type_is_one_line_before_anything_loads(cli):
    out, result = finished(cli, "yaml-float-for-int")
    one_line_error(result, "float-for-int.yaml: max_steps: invalid int value: '2.5'")
    assert not out.exists()


def test_gpt_oss_without_a_gpu_points_at_the_cpu_demo(cli):
    out, result = finished(cli, "gpt-oss-on-cpu")
    one_line_error(result, "CUDA GPU", "configs/cpu-demo.yaml")
    assert not out.exists()


def test_model_that_cannot_be_loaded(cli):
    out, result = finished(cli, "cannot-load")
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("[transformers]")]
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert lines[-1].startswith("train_2048: cannot load model nobody/no-such-model"), result.stderr
    assert not out.exists()


def test_push_to_hub_is_asked_of_the_hub_at_start(cli):
    """Not logged in, or offline: said at start, not after training when the Trainer pushes."""
    out, result = finished(cli, "push-to-hub")
    one_line_error(result, "--push_to_hub", "hf auth login")
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


def test_answer_kind_names_each_demo_answer_and_its_trimmed_versions():
    """demo_data.answer_kind, by which the learning test and bench/bench_demo.py judge a trained demo."""
    named = {"corner": "corner", "cycle": "cycle", "random": "random", "biased_random": "random"}
    for kind, _, text in train_2048.demo_data.EXAMPLES:
        assert train_2048.demo_data.answer_kind(text) == named.get(kind, "other"), kind
        trimmed = text.replace('    return "A"\n```', "```")  # a policy that drops the last line
        assert train_2048.demo_data.answer_kind(trimmed) == named.get(kind, "other"), kind


# --- truncated completions -----------------------------------------------------------------------------------


def test_truncated_skip_masks_the_loss_and_leaves_them_unscored():
    script, grpo, *_ = parse("--config", DEMO, "--truncated", "skip")
    assert script.truncated == "skip" and grpo.mask_truncated_completions
    script, grpo, *_ = parse("--config", DEMO)
    assert script.truncated == "score" and not grpo.mask_truncated_completions
    times, latest = trainer.StepTimes(SimpleNamespace(type="cpu")), {}
    reward = trainer.timed_reward(rewards.function_works, times, latest, skip_unless_ends_with={0, 9})
    done = "```python\ndef strategy(board):\n    return 'W'\n```"
    scores = reward([done, done, "```python\ndef strat"], completion_ids=[[5, 0], [5, 9], [5, 6]])
    assert scores == [1.0, 1.0, None]  # ended by EOS, by padding; cut off: no score at all (TRL: unscorable)
    scored = trainer.timed_reward(rewards.function_works, times, latest)
    assert scored([done, "```python\ndef strat"], completion_ids=[[5, 0], [5, 6]]) == [1.0, -2.0]


def test_overlong_penalty_is_checked_against_the_budget():
    script, grpo, *_ = parse("--config", DEMO, "--overlong_penalty", "16")
    assert script.overlong_penalty == 16
    with pytest.raises(options.OptionError, match="--overlong_penalty 96"):
        parse("--config", DEMO, "--overlong_penalty", "96")  # the whole budget (96 tokens)
