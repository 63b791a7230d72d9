"""One sampler: the GenerationConfig TRL's GRPOTrainer builds for its rollouts is the one the run's evaluations,
evaluate_2048 and the save check sample with (evaluation.generation_config), field by field, from the run's own
options; and evaluate_2048 plays the run's own board. A config that leaves top_k unset gets transformers' top_k 50,
where TRL samples with top_k 0: on the demo's 600-token vocabulary that evaluates a far cleaner policy than the one
trained."""

import json
from pathlib import Path

import pytest
import torch

import demo_data
import evaluate_2048
import evaluation
import rewards
import trainer

# Every sampling option TRL reads set away from its default, generation_kwargs last (they override the rest).
SAMPLER = dict(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
               generation_kwargs={"no_repeat_ngram_size": 4, "top_p": 0.95})  # fmt: skip
SETTINGS = rewards.RewardSettings(size=4, target=256, games=2, require_seccomp=False, game_salt="sampler-tests")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The CPU demo's tiny model and tokenizer (a 600-token BPE)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    corpus = [rewards.build_prompt(SETTINGS)] + [text for _, _, text in demo_data.EXAMPLES]
    path = demo_data.build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-model", corpus, seed=0)
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def grpo_args(tmp_path: Path, **sampler):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none",
                      per_device_train_batch_size=2, num_generations=2, per_device_eval_batch_size=2,
                      max_completion_length=8, **sampler)  # fmt: skip


def reward(completions, **kwargs):
    return [0.0] * len(completions)


def trainers(model, tokenizer, args, captured: list):
    """(TRL's own GRPOTrainer, ours), on the same model and options; ours samples through `captured`'s recorder."""
    from trl import GRPOTrainer

    def generate(model, input_ids, attention_mask, config):  # the fast path's place: records what it is handed
        captured.append(config)
        return torch.cat([input_ids, torch.full((input_ids.shape[0], 3), tokenizer.eos_token_id)], dim=1)

    dataset = rewards.build_dataset(4, SETTINGS)
    theirs = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                         processing_class=tokenizer)  # fmt: skip
    ours = trainer.GameGRPOTrainer(
        model=model, reward_funcs=[reward], args=args, train_dataset=dataset, processing_class=tokenizer,
        settings=SETTINGS, eval_samples=2, eval_seeds=[5, 6], times=trainer.StepTimes(torch.device("cpu")),
        generate=generate,
    )  # fmt: skip
    return theirs, ours


def differences(ours, theirs) -> dict:
    """The fields where two GenerationConfigs differ: name -> (ours, TRL's)."""
    a, b = ours.to_dict(), theirs.to_dict()
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


@pytest.mark.parametrize("sampler", [SAMPLER, {}], ids=["every option set", "TRL's defaults"])
def test_the_runs_evaluation_samples_with_the_config_trl_trains_with(tiny, tmp_path, sampler):
    """TRL's GRPOTrainer, built for real, against what our trainer's evaluation hands to generate and what its
    rollouts sample with: equal field by field, and resolved by the model alike (top_k 0 stays 0, not 50)."""
    model, tokenizer = tiny
    captured = []
    theirs, ours = trainers(model, tokenizer, grpo_args(tmp_path, **sampler), captured)
    ours.evaluate()
    assert len(captured) == 1  # 2 samples, one batch of 2
    assert differences(captured[0], theirs.generation_config) == {}  # the evaluation's sampler is training's
    assert differences(ours.generation_config, theirs.generation_config) == {}  # and the rollouts'
    assert ours.generation_kwargs == theirs.generation_kwargs
    resolved, _ = model._prepare_generation_config(captured[0])  # as generate (and generation.py) resolve it
    trained, _ = model._prepare_generation_config(theirs.generation_config)
    assert differences(resolved, trained) == {}
    assert resolved.top_k == (20 if sampler else 0) and resolved.top_p == (0.95 if sampler else 1.0)
    assert evaluation.generation_config(theirs.args, tokenizer, 8).to_dict() == theirs.generation_config.to_dict()


def test_evaluate_2048_samples_and_plays_as_the_run_recorded(tiny, tmp_path, capsys):
    """An adapter folder keeps its run's options (evaluation.RUN_FILE, written with every save): evaluate_2048 --adapter
    without --config reads them as a preset, so it samples with TRL's config of that run and plays its board; flags
    still win, and the table says where each came from."""
    model, tokenizer = tiny
    theirs, _ = trainers(model, tokenizer, grpo_args(tmp_path, **SAMPLER), [])
    adapter = tmp_path / "checkpoint-2"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    evaluation.write_run_record(adapter, SETTINGS, theirs.args)
    args, settings = evaluate_2048.parse_args(["--adapter", str(adapter)])
    assert (settings.size, settings.target, settings.profile, args.max_new_tokens) == (4, 256, "graded", 8)
    ours = evaluation.generation_config(args, tokenizer, args.max_new_tokens, greedy=args.temperature == 0)
    assert differences(ours, theirs.generation_config) == {}
    assert args.board_from == args.sampling_from == f"the run's own options, {adapter / evaluation.RUN_FILE}"

    flags = ["--target", "512", "--top_k", "0", "--top_p", "0.5"]  # top_p: also in the run's generation_kwargs
    args, settings = evaluate_2048.parse_args(["--adapter", str(adapter), *flags])
    assert (settings.size, settings.target, args.top_k, args.top_p) == (4, 512, 0, 0.5)
    config = evaluation.generation_config(args, tokenizer, args.max_new_tokens)
    assert (config.top_k, config.top_p, config.no_repeat_ngram_size, config.min_p) == (0, 0.5, 4, 0.05)
    assert args.board_from.endswith("; --target from the command line")
    assert args.sampling_from.endswith("; --top_p, --top_k from the command line")
    args, _ = evaluate_2048.parse_args(["--adapter", str(adapter), "--temperature", "0"])
    greedy = evaluation.generation_config(args, tokenizer, args.max_new_tokens, greedy=True)
    assert greedy.do_sample is False and greedy.repetition_penalty == 1.1

    (adapter / evaluation.RUN_FILE).unlink()  # an adapter of an older run: the default preset, and the table says so
    args, settings = evaluate_2048.parse_args(["--adapter", str(adapter)])
    assert (settings.size, settings.target) == (3, 512) and "records no run options" in args.board_from


def test_a_runs_record_is_read_as_a_preset_is(tmp_path, capsys):
    """The record is a user's file like a preset: a key no train_2048 option has, or a value out of range, is one
    line naming the file, exit 2."""
    adapter = tmp_path / "final"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    for record, said in [({"size": 3, "rm_rf": 1}, "unknown key rm_rf"), ({"top_p": 7}, "--top_p 7: must be above 0"),
                         ([1, 2], "not a mapping")]:  # fmt: skip
        (adapter / evaluation.RUN_FILE).write_text(json.dumps(record))
        with pytest.raises(SystemExit) as stop:
            evaluate_2048.parse_args(["--adapter", str(adapter)])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and said in err and err.count("\n") == 1, err
