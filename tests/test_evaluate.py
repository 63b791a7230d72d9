"""evaluate_2048: the same games as the engine, the report's contents, --watch, every error, and a tiny model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import evaluate_2048
import evaluation
import rewards
import sandbox
import strategies

REPO = Path(__file__).resolve().parent.parent
BOARD = ["--size", "4", "--target", "128"]
SLACK = ["--move_time_limit", "10", "--game_time_limit", "60"]  # a loaded CI machine must not time a game out
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}

GOOD = 'def strategy(board):\n    import random\n    return random.choice("WASD")\n'
HELPERS = 'def helper():\n    return "A"\n\n\nprint(helper())\n\n\ndef strategy(board):\n    return helper()\n'
CHEATS = 'def strategy(board):\n    import os\n    return "A"\n'


def run(*args, timeout=120):
    return subprocess.run(
        [sys.executable, str(REPO / "evaluate_2048.py"), *map(str, args)],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, env=ENV,
    )  # fmt: skip


def evaluate(tmp_path, *args) -> dict:
    """main() in this process; returns results.json."""
    assert evaluate_2048.main([*map(str, args), "--output_dir", str(tmp_path)]) == 0
    return json.loads((tmp_path / "results.json").read_text())


def by_source(report: dict) -> dict:
    return {s["source"]: s for s in report["summary"]}


def games_of(report: dict, source: str) -> list[dict]:
    return [g for g in report["games"] if g["source"] == source]


@pytest.fixture(scope="module")
def baselines_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    return out, evaluate(out, "--games", 3, "--seed", 5, *BOARD, *SLACK)


@pytest.mark.parametrize("name", strategies.BASELINES)
def test_baselines_play_the_engines_games(baselines_report, name):
    _, report = baselines_report
    direct = strategies.play_games(strategies.BASELINES[name], 3, seed=5, size=4, target=128)
    games = games_of(report, name)
    assert [g["seed"] for g in games] == [5, 6, 7]
    assert [g["score"] for g in games] == direct["scores"]
    assert [g["max_tile"] for g in games] == direct["max_tiles"]
    assert [g["moves"] for g in games] == direct["moves"]
    row = by_source(report)[name]
    assert row["win_rate"] == direct["win_rate"] and row["median_score"] == direct["median_score"]
    assert (row["samples"], row["valid_rate"], row["cheat_rate"], row["games"]) == (1, 1.0, 0.0, 3)
    assert row["timeouts"] == row["errors"] == 0
    assert {int(k): v for k, v in row["max_tile_counts"].items()} == direct["max_tile_counts"]


def test_report_files_and_table(baselines_report, capsys):
    out, report = baselines_report
    assert [s["source"] for s in report["summary"]] == list(strategies.BASELINES)
    assert report["settings"]["seeds"] == [5, 6, 7] and report["settings"]["size"] == 4
    assert set(report["games"][0]) == {
        "source",
        "sample",
        "seed",
        "status",
        "moves",
        "score",
        "max_tile",
        "seconds",
        "error",
    }
    png = (out / "max_tiles.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_table_shows_every_source(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(GOOD)
    evaluate(tmp_path, "--games", 2, *BOARD, *SLACK, "--strategy", "mine.py")
    table = capsys.readouterr().out
    for name in ["mine.py", *strategies.BASELINES]:
        assert name in table
    for column in ["valid", "cheating", "win rate", "median score", "median max tile", "timeouts / errors"]:
        assert column in table


def test_file_strategies_are_judged_like_answers(tmp_path, capsys):
    files = {}
    for name, code in [("good", GOOD), ("helpers", HELPERS), ("cheats", CHEATS)]:
        files[name] = tmp_path / f"{name}.py"
        files[name].write_text(code)
    report = evaluate(
        tmp_path,
        "--games",
        3,
        "--seed",
        0,
        *BOARD,
        *SLACK,
        "--no-baselines",
        *[a for p in files.values() for a in ("--strategy", p)],
    )
    rows = by_source(report)
    assert list(rows) == [str(p) for p in files.values()]

    good = rows[str(files["good"])]
    direct = strategies.play_games(strategies.random_strategy, 3, seed=0, size=4, target=128)
    assert [g["score"] for g in games_of(report, str(files["good"]))] == direct["scores"]
    assert (good["valid_rate"], good["cheat_rate"], good["played_games"]) == (1.0, 0.0, 3)

    helpers, cheats = rows[str(files["helpers"])], rows[str(files["cheats"])]
    assert (helpers["valid_rate"], helpers["cheat_rate"], helpers["played_games"]) == (0.0, 0.0, 0)
    assert (cheats["valid_rate"], cheats["cheat_rate"], cheats["played_games"]) == (1.0, 1.0, 0)
    for row in (helpers, cheats):
        assert row["statuses"] == {"not_played": 3} and row["win_rate"] == 0 and row["median_score"] == 0
    samples = {s["source"]: s for s in report["samples"]}
    assert samples[str(files["cheats"])]["cheats"] == ["import of 'os'"]
    assert samples[str(files["helpers"])]["why_not_played"].startswith("top level holds a Expr statement")
    out = capsys.readouterr().out
    assert f"{files['cheats']}: not played: cheats: import of 'os'" in out


def test_a_models_best_and_median_sample(tmp_path):
    """Summaries of a model's samples without a model: one good answer, one that never moves, two broken."""
    fence = "```"
    completions = [
        "no code here",
        f"{fence}python\n{CHEATS}{fence}",
        f"{fence}python\ndef strategy(board):\n    return 'A'\n{fence}",  # gets stuck: game over, small tiles
        f"analysis...assistantfinal{fence}python\n{GOOD}{fence}",
    ]
    source = evaluation.model_source("model", completions)
    settings = rewards.RewardSettings(size=4, target=128, move_time_limit=10, game_time_limit=60)
    played = evaluation.play_sources([source], [0, 1, 2], settings)
    summary = evaluation.summarise(source, [played[0, j] for j in range(4)], settings)
    assert (summary["samples"], summary["games"], summary["played_samples"], summary["played_games"]) == (4, 12, 2, 6)
    # the reward training would give each answer on these games: no code -2 -1; cheats +1 -20; the two played +1 +1
    # and their mean game score (eval_mean_reward, by which the best adapters are chosen)
    game = [sum(rewards.game_score(g, settings) for g in played[0, j]) / 3 for j in (2, 3)]
    assert summary["mean_reward"] == pytest.approx((-3 - 19 + 2 + game[0] + 2 + game[1]) / 4)
    assert (summary["valid_rate"], summary["cheat_rate"]) == (0.75, 0.25)
    assert summary["best_sample"]["sample"] == 3 and summary["best_sample"]["games"] == 3
    direct = strategies.play_games(strategies.random_strategy, 3, seed=0, size=4, target=128)
    assert summary["best_sample"]["mean_score"] == pytest.approx(sum(direct["scores"]) / 3)
    scores = sorted([0, 0, sum(g.score for g in played[0, 2]) / 3, sum(direct["scores"]) / 3])
    assert summary["median_sample"]["mean_score"] == pytest.approx((scores[1] + scores[2]) / 2)


def test_watch_a_baseline_when_piped():
    r = run("--watch", "greedy", *BOARD, "--speed", 0, "--seed", 0)
    assert r.returncode == 0, r.stderr
    direct = strategies.play_games(strategies.greedy_strategy, 1, seed=0, size=4, target=128)
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("greedy · seed 0 · move")
    status = "success" if direct["win_rate"] else "failed"
    moves, score, tile = direct["moves"][0], direct["scores"][0], direct["max_tiles"][0]
    assert lines[-1] == f"greedy: {status} after {moves} moves, score {score}, max tile {tile}"
    assert "\x1b" not in r.stdout  # no cursor movement or colour when piped


def test_watch_a_file_plays_it_in_the_sandbox(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(GOOD)
    r = run("--watch", path, *BOARD, "--seed", 2, *SLACK)
    assert r.returncode == 0, r.stderr
    direct = strategies.play_games(strategies.random_strategy, 1, seed=2, size=4, target=128)
    assert (
        r.stdout.strip()
        .splitlines()[-1]
        .endswith(f"after {direct['moves'][0]} moves, score {direct['scores'][0]}, max tile {direct['max_tiles'][0]}")
    )
    assert f"move {direct['moves'][0]} · score {direct['scores'][0]}" in r.stdout  # replayed from the recorded keys
    assert "replay differs" not in r.stdout


def test_watch_a_file_that_cheats_is_not_played(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(CHEATS)
    r = run("--watch", path, *BOARD)
    assert r.returncode == 1 and "not played: cheats: import of 'os'" in r.stdout


def test_a_model_that_cannot_load(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    r = run("--model", tmp_path / "broken", "--output_dir", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.startswith("evaluate_2048: cannot load model")
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


# --- a tiny local model ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer Llama with a char-level tokenizer, and a LoRA adapter (random, so it changes the output)."""
    import string

    import torch
    from peft import LoraConfig, get_peft_model
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tiny")
    special = ["<|pad|>", "<|user|>", "<|assistant|>", "<|end|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(special + sorted(set(string.printable)))}
    chars = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    chars.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    chars.decoder = decoders.Fuse()
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=chars, pad_token="<|pad|>", eos_token="<|end|>", unk_token="<unk>", chat_template=template
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    base = LlamaForCausalLM.from_pretrained(root / "base")  # so the adapter names its base model's path
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], init_lora_weights=False
    )
    model = get_peft_model(base, lora)
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(-1.0)
    model.save_pretrained(root / "adapter")
    tokenizer.save_pretrained(root / "adapter")
    return root


MODEL_ARGS = ["--samples", 3, "--max_new_tokens", 24, "--batch_size", 2, "--games", 2, *BOARD, "--no-baselines"]


def test_a_model_and_its_base_are_sampled_and_reported(tiny_model, tmp_path, capsys):
    report = evaluate(tmp_path / "both", "--adapter", tiny_model / "adapter", "--base", *MODEL_ARGS, "--seed", 3)
    rows = by_source(report)
    assert list(rows) == ["model (base)", "model (adapter)"]
    for name, row in rows.items():
        assert (row["samples"], row["games"]) == (3, 6)
        assert sum(row["statuses"].values()) == 6 and len(games_of(report, name)) == 6
        assert {(g["sample"], g["seed"]) for g in games_of(report, name)} == {(j, s) for j in range(3) for s in (3, 4)}
        assert "best_sample" in row and "median_sample" in row
    completions = {name: [s["completion"] for s in report["samples"] if s["source"] == name] for name in rows}
    assert all(len(c) == 3 and all(isinstance(t, str) and t for t in c) for c in completions.values())
    assert completions["model (base)"] != completions["model (adapter)"]
    table = capsys.readouterr().out
    assert "model (base)" in table and "model (adapter)" in table and "median of 3 samples" in table

    # the base row is the base model itself on the same seed (the adapter switched off, not a second model)
    alone = evaluate(tmp_path / "base", "--model", tiny_model / "base", *MODEL_ARGS, "--seed", 3)
    assert [s["source"] for s in alone["summary"]] == ["model"]
    assert [s["completion"] for s in alone["samples"]] == completions["model (base)"]


def test_watch_a_model_with_nothing_playable(tiny_model, capsys):
    assert (
        evaluate_2048.main(["--watch", "model", "--adapter", str(tiny_model / "adapter"), *map(str, MODEL_ARGS)]) == 1
    )
    assert "none of its 3 samples is playable" in capsys.readouterr().out


def test_the_adapters_base_path_is_read_from_its_config(tiny_model):
    config = json.loads((tiny_model / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model / "base")


def teardown_module():
    sandbox.shutdown()


def test_models_are_sampled_with_the_training_budget_by_default():
    """A model trained to write within max_completion_length tokens is sampled with as many: the preset's."""
    import yaml

    default = yaml.safe_load(evaluate_2048.DEFAULT_PRESET.read_text())["max_completion_length"]
    assert evaluate_2048.parse_args([])[0].max_new_tokens == default == 1024
    demo = str(REPO / "configs" / "cpu-demo.yaml")
    assert evaluate_2048.parse_args(["--config", demo])[0].max_new_tokens == 96
    assert evaluate_2048.parse_args(["--config", demo, "--max_new_tokens", "12"])[0].max_new_tokens == 12


def test_config_gives_the_trained_game_and_nothing_of_the_training_run(tmp_path, capsys):
    """--config names the preset a model was trained with: its board, token budget and reasoning effort are the
    evaluation's defaults; its output folder, games per answer and time limits are the training run's, not read
    (the demo's would write into the training run's folder and play 4 games instead of 50)."""
    demo = str(REPO / "configs" / "cpu-demo.yaml")
    args, settings = evaluate_2048.parse_args(["--config", demo])
    assert (settings.size, settings.target, args.max_new_tokens, args.reasoning_effort) == (3, 128, 96, "low")
    assert args.output_dir is None and settings.games == 50 and settings.game_time_limit == 60.0
    preset = tmp_path / "preset.yaml"
    preset.write_text("size: 4\nkeys: ZQSD\nchat_template_kwargs: {reasoning_effort: high}\ngames: 2\nseed: 7\n")
    args, settings = evaluate_2048.parse_args(["--config", str(preset), "--games", "3"])
    assert (settings.size, settings.keys, args.reasoning_effort, settings.games, args.seed) == (4, "ZQSD", "high", 3, None)
    with pytest.raises(SystemExit) as stop:
        evaluate_2048.parse_args(["--help"])
    assert stop.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "--config FILE.yaml" in shown and "max_completion_length (as --max_new_tokens)" in shown


def test_a_file_of_the_strategy_archive_plays_the_game_its_run_played(tmp_path, capsys):
    """A file the archive wrote names its run's game (GAME, read from its syntax tree, never run): --strategy and
    --watch play that board, not the default preset's (the demo's 3x3-to-128 best.py was played to 512); flags and
    --config win; files of runs on other games are one line; a file of the user's own plays the default board."""
    import strategy_archive

    def archived(name: str, game: list[str]) -> str:
        path = tmp_path / name
        path.write_text(strategy_archive.strategy_code(GOOD, game))
        return str(path)

    demo = archived("best.py", strategy_archive.game_options(rewards.RewardSettings(size=3, target=128)))
    older = archived("older.py", ["--target=128"])  # an older archive wrote only what differs from sandbox.Game's
    for path in (demo, older):
        args, settings = evaluate_2048.parse_args(["--strategy", path])
        assert (settings.size, settings.target, settings.keys) == (3, 128, "WASD")
        assert args.board_from == f"the game its run played, {path}'s GAME"
    args, settings = evaluate_2048.parse_args(["--watch", demo])
    assert settings.target == 128
    args, settings = evaluate_2048.parse_args(["--strategy", demo, "--target", "64"])
    assert settings.target == 64 and args.board_from.endswith("; --target from the command line")
    args, settings = evaluate_2048.parse_args(["--strategy", demo, "--config", str(REPO / "configs" / "notebook.yaml")])
    assert (settings.size, settings.target) == (6, 2048) and args.board_from.startswith("--config ")
    other = archived("other.py", strategy_archive.game_options(rewards.RewardSettings(size=4, target=256)))
    err = refused(capsys, ["--strategy", demo, "--strategy", other, "--no-baselines"])
    assert "trained on different games" in err and "--size 4 --target 256" in err
    args, settings = evaluate_2048.parse_args(["--strategy", demo, "--strategy", other, "--size", "4", "--target", "32"])
    assert (settings.size, settings.target) == (4, 32)
    mine = tmp_path / "mine.py"
    mine.write_text(GOOD)
    args, settings = evaluate_2048.parse_args(["--strategy", str(mine)])
    assert (settings.size, settings.target) == (3, 512) and args.board_from.startswith("train_2048's default preset")
    broken = archived("broken.py", ["--target=128"])
    Path(broken).write_text(Path(broken).read_text().replace("GAME = ['--target=128']", "GAME = ['--rm=rf']"))
    assert "names rm, which is not one of the game's options" in refused(capsys, ["--strategy", broken])


def test_no_evaluation_replaces_another(tmp_path, monkeypatch, capsys):
    """By default each evaluation writes a new folder under outputs/eval; a given --output_dir that holds an earlier
    evaluation's results is refused, in one line, unless --overwrite_output_dir."""
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine.py"
    mine.write_text(GOOD)
    quick = ["--strategy", str(mine), "--no-baselines", "--games", "1", *BOARD]
    assert evaluate_2048.main(quick) == 0 and evaluate_2048.main(quick) == 0
    folders = sorted((tmp_path / "outputs" / "eval").iterdir())
    assert len(folders) == 2 and all((folder / "results.json").is_file() for folder in folders)
    given = tmp_path / "given"
    assert evaluate_2048.main([*quick, "--output_dir", str(given)]) == 0
    first = (given / "results.json").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        evaluate_2048.main([*quick, "--output_dir", str(given), "--seed", "5"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "--overwrite_output_dir true" in err
    assert (given / "results.json").read_text() == first
    assert evaluate_2048.main([*quick, "--output_dir", str(given), "--seed", "5", "--overwrite_output_dir", "true"]) == 0
    assert (given / "results.json").read_text() != first


def test_by_default_each_evaluation_plays_games_no_strategy_can_know(tmp_path, capsys):
    """Public seeds can be looked up: a strategy that recognises game 0 by its random's first draw plays it with
    foresight. Without --seed, each evaluation draws a secret 63-bit start, prints it in the table's header and keeps it
    in results.json, so the run replays with --seed; with --seed, those games."""
    mine = tmp_path / "mine.py"
    mine.write_text(GOOD)
    quick = ["--strategy", str(mine), "--no-baselines", "--games", "2", *BOARD, *SLACK]
    first, second = (evaluate(tmp_path / name, *quick) for name in ("first", "second"))
    out = " ".join(capsys.readouterr().out.split())
    starts = [report["settings"]["seeds"][0] for report in (first, second)]
    assert starts[0] != starts[1] and all(start >= 2**32 for start in starts), starts
    assert all(report["settings"]["seed_drawn"] and report["settings"]["seed"] == report["settings"]["seeds"][0]
               for report in (first, second))  # fmt: skip
    assert all(f"--seed {start} replays it" in out for start in starts), out
    again = evaluate(tmp_path / "again", *quick, "--seed", starts[0])
    assert again["settings"]["seeds"] == first["settings"]["seeds"] and not again["settings"]["seed_drawn"]
    assert [g["score"] for g in again["games"]] == [g["score"] for g in first["games"]]


def refused(capsys, argv) -> str:
    """main() stopped at a user's mistake: exit 2 and one line on stderr; that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        evaluate_2048.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(("flag", "kind"), [("--strategy", "fifo"), ("--strategy", "/dev/zero"),
                                           ("--strategy", "/dev/stdin"), ("--watch", "fifo")])  # fmt: skip
def test_a_strategy_file_that_is_no_file_is_one_line_not_a_hang(flag, kind, tmp_path):
    """A FIFO nobody writes (the open would wait for ever), /dev/zero (endless), /dev/stdin (here a pipe nobody
    closes): one line, exit 2, at once, and no output folder made."""
    path = tmp_path / "strategy.py" if kind == "fifo" else kind
    if kind == "fifo":
        os.mkfifo(path)
    with subprocess.Popen([sys.executable, str(REPO / "evaluate_2048.py"), flag, str(path), "--no-baselines",
                           "--output_dir", str(tmp_path / "out"), *BOARD], cwd=REPO, env=ENV, text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:  # fmt: skip
        try:
            out, err = child.communicate(timeout=60)  # stdin stays open: /dev/stdin would wait on it
        except subprocess.TimeoutExpired:
            child.kill()
            raise AssertionError(f"{flag} {kind}: still running after 60 s") from None
    assert child.returncode == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert str(path) in err and "not a regular file" in err and not (tmp_path / "out").exists(), err


def test_a_folder_as_strategy_file_is_one_line(tmp_path, capsys):
    err = refused(capsys, ["--strategy", str(tmp_path), "--no-baselines", "--output_dir", str(tmp_path / "out")])
    assert f"--strategy {tmp_path}: cannot read it: a folder, not a regular file" in err and not (tmp_path / "out").exists(), err


def test_a_users_max_tiles_png_in_output_dir_is_never_replaced(tmp_path, capsys):
    """A max_tiles.png of the user's own in the given --output_dir (no evaluation wrote it) is refused, even with
    --overwrite_output_dir: one line, exit 2, the folder as it was."""
    mine = tmp_path / "mine.py"
    mine.write_text(GOOD)
    given = tmp_path / "given"
    given.mkdir()
    (given / "max_tiles.png").write_bytes(b"my own picture")
    quick = ["--strategy", str(mine), "--no-baselines", "--games", "1", "--output_dir", str(given), *BOARD]
    for overwrite in ([], ["--overwrite_output_dir", "true"]):
        err = refused(capsys, [*quick, *overwrite])
        assert "max_tiles.png that no evaluation wrote" in err, err
        assert sorted(os.listdir(given)) == ["max_tiles.png"]
        assert (given / "max_tiles.png").read_bytes() == b"my own picture"


def test_a_dangling_results_link_is_never_written_through(tmp_path, capsys):
    """results.json a link to a file outside (not there yet): refused, even with --overwrite_output_dir, and the
    file outside is never made. What an evaluation wrote, it replaces with --overwrite_output_dir; a link put in its
    place afterwards is refused again."""
    mine = tmp_path / "mine.py"
    mine.write_text(GOOD)
    given, outside = tmp_path / "given", tmp_path / "elsewhere" / "notes.txt"
    given.mkdir()
    outside.parent.mkdir()
    (given / "results.json").symlink_to(outside)
    quick = ["--strategy", str(mine), "--no-baselines", "--games", "1", "--output_dir", str(given), *BOARD]
    for overwrite in ([], ["--overwrite_output_dir", "true"]):
        err = refused(capsys, [*quick, *overwrite])
        assert "results.json that no evaluation wrote" in err and not outside.exists(), err
    (given / "results.json").unlink()
    assert evaluate_2048.main([*quick, "--seed", "1"]) == 0
    assert evaluate_2048.main([*quick, "--seed", "2", "--overwrite_output_dir", "true"]) == 0  # its own: replaced
    assert json.loads((given / "results.json").read_text())["settings"]["seeds"] == [2]
    (given / "results.json").unlink()
    (given / "results.json").symlink_to(outside)
    err = refused(capsys, [*quick, "--overwrite_output_dir", "true"])
    assert "results.json that no evaluation wrote" in err and not outside.exists(), err
