"""The output folder and its one owner (run_folder.py): every state a folder can be in, times what a user asks of it,
gives one outcome and one line, and every refusal's advice, followed, works (THE_TABLE); then the races and links
that must lose nothing (a run held up between its check and its lock, --overwrite_output_dir racing a swap of runs/,
a hard-linked lock file), and the modes of the folders a run makes.

Every train_2048 row runs the command's own main() up to the model's load (the folder is held and decided by then),
so the table costs seconds; merge_2048 merges a tiny Llama for real, evaluate_2048 plays a strategy file.
"""

import ast
import errno
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from test_mistakes import checkpoint, finished_run, record

import demo_data
import evaluate_2048
import merge_2048
import rewards
import run_folder
import saving
import train_2048
import trained_base

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "configs" / "cpu-demo.yaml")
UP = "def strategy(board):\n    return 'W'\n"  # what an evaluation plays (root/up.py)
BOARD = ["--size", "3", "--target", "16"]


LOAD_OR_LEAVE = train_2048.load_or_leave


class Started(Exception):
    """train_2048 got past its output folder: the model would load now."""

    def __init__(self, plan):
        super().__init__("started")
        self.plan = plan


@pytest.fixture(autouse=True)
def stop_at_the_model(monkeypatch):
    def started(plan, *_):
        raise Started(plan)

    monkeypatch.setattr(train_2048, "load_or_leave", started)


# --- the states a folder can be in (each builds one in `folder`; `root` holds whatever else it needs) -------------


def published(folder: Path, files: dict, by: str = "train_2048") -> Path:
    """A folder as a command publishes it (saving.publish: its mark lists its files)."""
    tmp = saving.fresh(folder)
    for name, text in files.items():
        (tmp / name).write_text(text)
    saving.publish(tmp, folder, by)
    return folder


def nothing(folder, root):
    pass


def made(folder, root):
    folder.mkdir()


def users(folder, root):
    (folder / "sft").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    (folder / "sft" / "notes").write_text("mine")
    (folder / ".strategies-mine").mkdir()


def users_log(folder, root):
    folder.mkdir()
    (folder / "training.log").write_text("my own log\n")


def untrained(folder, root):
    """As Ctrl-C or a crash in the warm start leaves a run: its record, log, TensorBoard folder and tiny model."""
    folder.mkdir()
    record(folder, [*run_folder.RUN_NAMES, "runs/Dec01_host"])
    (folder / "training.log").write_text("the warm start, stopped\n")
    (folder / "runs" / "Dec01_host").mkdir(parents=True)
    (folder / "runs" / "Dec01_host" / "events").write_text("e")
    published(folder / "tiny-model", {"config.json": "{}"})
    (folder / "notes.txt").write_text("mine")


def stopped(folder, root):
    """A run stopped at step 4 (Ctrl-C): its checkpoints, log and metrics, no final/."""
    finished_run(folder)
    shutil.rmtree(folder / "final")


def finished(folder, root):
    finished_run(folder)
    (folder / "notes.txt").write_text("mine")
    (folder / ".strategies-mine").mkdir()  # a name that begins as the archive's copies do: the user's
    (folder / ".strategies-mine" / "a.py").write_text("mine")


def finished_yours_inside(folder, root):
    """A finished run whose final/ the user put a file and an evaluation's folder in."""
    finished(folder, root)
    (folder / "final" / "mine.txt").write_text("mine")
    (folder / "final" / "eval").mkdir()
    (folder / "final" / "eval" / "results.json").write_text("mine")


def broken(folder, root):
    """A run whose only checkpoint cannot be loaded."""
    folder.mkdir()
    checkpoint(folder, 2)
    (folder / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2, "lo')
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    record(folder, [*run_folder.RUN_NAMES, "checkpoint-2"])


def older(folder, root):
    finished_run(folder, recorded=False)


def older_broken(folder, root):
    broken(folder, root)
    (folder / run_folder.MANIFEST).unlink()


def adopted(folder, root):
    """An older run that --resume auto adopted: its files are the run's to continue, never to delete."""
    older(folder, root)
    held = run_folder.take(folder, resume="auto")
    held.start()
    held.release()


def live(folder, root):
    """A run that holds the folder now (another process; here another descriptor of this one)."""
    stopped(folder, root)
    held = run_folder.take(folder, resume="auto")
    held.start()
    return held


def linked_runs(folder, root):
    users(folder, root)
    (root / "elsewhere").mkdir()
    (folder / "runs").symlink_to(root / "elsewhere")


def two_runs(folder, root):
    stopped(folder, root)
    stopped(root / "other", root)


def merged(folder, root):
    published(folder, {"config.json": "{}", "model.safetensors": "w"}, by="merge_2048")


def merged_and_mine(folder, root):
    merged(folder, root)
    (folder / "notes.txt").write_text("mine")


def users_model(folder, root):
    folder.mkdir()
    (folder / "config.json").write_text("my model")


def copied_mark(folder, root):
    """A merge's folder copied without its files' times (cp -r), then given the user's own files."""
    merged(root / "a-merge", root)
    folder.mkdir()
    shutil.copyfile(root / "a-merge" / saving.MARK, folder / saving.MARK)
    (folder / "config.json").write_text("my model")
    (folder / "mine.txt").write_text("mine")


class Case(NamedTuple):
    name: str
    state: object  # a builder above
    command: str  # train, merge, evaluate, save
    asked: list  # the command's arguments; {folder}, {root} filled in
    rc: int | str  # an exit status; "started" (train_2048 got to its model), or "step 0" / "checkpoint-N" that it will
    said: list  # words of the one line (rc 2, or train_2048's rc 0), or for a start, that the folder holds
    follow: list = []  # for a refusal: each piece of advice it gives, followed: (how, what), and it must work


NEW, AUTO, OVER = [], ["--resume", "auto"], ["--overwrite_output_dir", "true"]
ADVICE_AUTO = ("flags", ["--resume", "auto", "--max_steps", "8"])  # each follows a refusal with these flags alone
ADVICE_OVER = ("flags", ["--overwrite_output_dir", "true"])

THE_TABLE = [
    # train_2048: a new run, --resume auto, --overwrite_output_dir, --resume <checkpoint>
    Case("empty-new", nothing, "train", NEW, "step 0", []),
    Case("empty-auto", nothing, "train", AUTO, "step 0", []),
    Case("empty-overwrite", nothing, "train", OVER, "step 0", []),
    Case("made-new", made, "train", NEW, "step 0", []),
    Case("users-new", users, "train", NEW, "step 0", ["notes.txt", "sft", ".strategies-mine"]),
    Case("users-overwrite", users, "train", OVER, "step 0", ["notes.txt", "sft", ".strategies-mine"]),
    Case("users-log-new", users_log, "train", NEW, 2, ["holds training.log, which no run", "move it"],
         [("move", "training.log")]),  # fmt: skip
    Case("users-log-auto", users_log, "train", AUTO, 2, ["holds training.log, which no run", "move it"],
         [("move", "training.log")]),  # fmt: skip
    Case("untrained-new", untrained, "train", NEW, "step 0", ["training.log", "notes.txt", "!tiny-model", "!runs"]),
    Case("untrained-auto", untrained, "train", AUTO, "step 0", ["training.log", "notes.txt", "!tiny-model"]),
    Case("untrained-overwrite", untrained, "train", OVER, "step 0", ["notes.txt", "!tiny-model", "!runs"]),
    Case("stopped-new", stopped, "train", ["--max_steps", "8"], 2,
         ["holds a run at step 4", "continue it with --resume auto", "--overwrite_output_dir true"],
         [ADVICE_AUTO, ADVICE_OVER]),  # fmt: skip
    Case("stopped-auto", stopped, "train", ["--resume", "auto", "--max_steps", "8"], "checkpoint-4", []),
    Case("stopped-overwrite", stopped, "train", OVER, "step 0", ["!checkpoint-2", "!checkpoint-4", "!metrics.jsonl"]),
    Case("stopped-checkpoint", stopped, "train", ["--resume", "{folder}/checkpoint-2"], "checkpoint-2", []),
    Case("stopped-another-run", two_runs, "train", ["--resume", "{root}/other/checkpoint-2"], 2,
         ["holds another run than", "continue there (--output_dir"],
         [("flags", ["--resume", "{root}/other/checkpoint-2", "--output_dir", "{root}/other"])]),  # fmt: skip
    Case("finished-new", finished, "train", ["--max_steps", "4"], 2,
         ["holds a run at step 4", "--resume auto and a --max_steps above 4", "--overwrite_output_dir true"],
         [ADVICE_AUTO, ADVICE_OVER]),  # fmt: skip
    Case("finished-auto", finished, "train", ["--resume", "auto", "--max_steps", "4"], 0,
         ["finished at step 4 of --max_steps 4", "raise --max_steps above 4"]),  # fmt: skip
    Case("finished-auto-further", finished, "train", ["--resume", "auto", "--max_steps", "6"], "checkpoint-4",
         ["final", "notes.txt"]),  # fmt: skip
    Case("finished-overwrite", finished, "train", OVER, "step 0", ["notes.txt", "!final", "!checkpoint-4"]),
    Case("broken-new", broken, "train", NEW, 2, ["holds a run: start over with --overwrite_output_dir true"],
         [ADVICE_OVER]),  # fmt: skip
    Case("broken-auto", broken, "train", AUTO, 2,
         ["no checkpoint that can be loaded", "checkpoint-2 is skipped", "--overwrite_output_dir true"],
         [ADVICE_OVER]),  # fmt: skip
    Case("older-new", older, "train", NEW, 2,
         ["a run of an older train_2048", "no record", "continue it with --resume auto", "move its files"],
         [ADVICE_AUTO]),  # fmt: skip
    Case("older-overwrite", older, "train", OVER, 2, ["a run of an older train_2048", "nothing there is deleted",
                                                      "continue it with --resume auto"], [ADVICE_AUTO]),  # fmt: skip
    Case("older-auto", older, "train", ["--resume", "auto", "--max_steps", "8"], "checkpoint-4", []),
    Case("older-broken-auto", older_broken, "train", AUTO, 2,
         ["no checkpoint that can be loaded and no record", "move its files yourself"],
         [("move", "checkpoint-2", "metrics.jsonl")]),  # fmt: skip
    Case("adopted-overwrite", adopted, "train", OVER, 2, ["adopted", "never deletes: move them yourself"],
         [("move", "checkpoint-2", "checkpoint-4", "final", "metrics.jsonl", "training.log")]),  # fmt: skip
    Case("live-new", live, "train", NEW, 2, ["in use by a running train_2048 (pid", "wait for it to end"],
         [("stop", ["--resume", "auto", "--max_steps", "8"])]),  # fmt: skip
    Case("live-overwrite", live, "train", OVER, 2, ["in use by a running train_2048 (pid"], [("stop", OVER)]),
    Case("runs-a-link-new", linked_runs, "train", NEW, 2, ["runs is a symbolic link", "move it"], [("move", "runs")]),
    Case("inside-final-new", finished, "train", ["--output_dir", "{folder}/final/x"], 2,
         ["is inside", "a folder train_2048 published", "give a folder outside it"]),  # fmt: skip
    Case("inside-checkpoint-new", finished, "train", ["--output_dir", "{folder}/checkpoint-2/x"], 2,
         ["is inside", "which the run in", "give a folder outside it"]),  # fmt: skip
    # the final save (saving.publish, as save_and_verify calls it) into final/ as it is
    Case("save-new", nothing, "save", [], 0, ["adapter_config.json"]),
    Case("save-empty", made, "save", [], 0, ["adapter_config.json"]),
    Case("save-its-own", finished, "save", [], 0, ["adapter_config.json"]),
    Case("save-its-own-and-yours", finished_yours_inside, "save", [], 0, ["adapter_config.json", "mine.txt", "eval"]),
    Case("save-users-folder", users_model, "save", [], "refused", ["holds config.json", "did not write"]),
    Case("save-copied-mark", copied_mark, "save", [], "refused", ["holds config.json", "did not write"]),
    # merge_2048 --output_dir
    Case("merge-new", nothing, "merge", [], 0, ["verified"]),
    Case("merge-empty", made, "merge", [], 0, ["verified"]),
    Case("merge-its-own", merged, "merge", [], 2, ["exists (an earlier merge)", "--overwrite_output_dir"],
         [("flags", ["--overwrite_output_dir"])]),  # fmt: skip
    Case("merge-its-own-and-users", merged_and_mine, "merge", ["--overwrite_output_dir"], 0, ["verified"]),
    Case("merge-users-folder", users_model, "merge", ["--overwrite_output_dir"], 2,
         ["holds config.json", "merge_2048 did not write it", "name another --output_dir"]),  # fmt: skip
    Case("merge-copied-mark", copied_mark, "merge", ["--overwrite_output_dir"], 2,
         ["holds config.json", "merge_2048 did not write it"]),  # fmt: skip
    Case("merge-inside-final", finished, "merge", ["--output_dir", "{folder}/final/merged"], 2,
         ["is inside", "a folder train_2048 published"]),  # fmt: skip
    # evaluate_2048 --output_dir
    Case("evaluate-empty", made, "evaluate", [], 0, []),
    Case("evaluate-users", users, "evaluate", [], 0, []),
    Case("evaluate-a-runs-folder", finished, "evaluate", [], 0, []),
    Case("evaluate-inside-final", finished, "evaluate", ["--output_dir", "{folder}/final/eval"], 2,
         ["is inside", "a folder train_2048 published"]),  # fmt: skip
    Case("evaluate-inside-checkpoint", finished, "evaluate", ["--output_dir", "{folder}/checkpoint-4/eval"], 2,
         ["is inside", "which the run in"]),  # fmt: skip
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny Llama in bf16 and a LoRA adapter of it, saved as a run saves final/ (its base recorded)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    tokenizer = demo_data.build_tokenizer([rewards.build_prompt(rewards.RewardSettings())], vocab_size=300)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    model = get_peft_model(LlamaForCausalLM.from_pretrained(root / "base"), LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(root / "adapter")
    tokenizer.save_pretrained(root / "adapter")
    trained_base.write_base_identity(root / "adapter", trained_base.base_identity(str(root / "base")))
    return root


def run(case: Case, folder: Path, root: Path, asked: list, capsys, tiny: Path | None) -> tuple:
    """The command of `case` with `asked`: (exit status or what it got to, its one line)."""
    fill = [str(a).replace("{folder}", str(folder)).replace("{root}", str(root)) for a in asked]
    capsys.readouterr()
    try:
        if case.command == "train":
            rc = train_2048.main(["--config", DEMO, "--output_dir", str(folder), *fill])
        elif case.command == "merge":
            rc = merge_2048.main(["--adapter", str(tiny / "adapter"), "--base", str(tiny / "base"), "--output_dir",
                                  str(folder), *fill])  # fmt: skip
        elif case.command == "evaluate":
            rc = evaluate_2048.main(["--strategy", str(root / "up.py"), "--no-baselines", "--games", "1", *BOARD,
                                     "--output_dir", str(folder), *fill])  # fmt: skip
        else:
            rc = save(folder)
    except SystemExit as stop:
        rc = stop.code
    except Started as started:
        rc = started.plan.checkpoint.name if started.plan.checkpoint else "step 0"
    out = capsys.readouterr()
    lines = [line for line in (out.err if rc in (1, 2, "refused") else out.out).splitlines() if line.strip()]
    return rc, lines


def save(folder: Path) -> int | str:
    """What save_and_verify does with final/: a new save published over it."""
    final = folder / "final" if (folder / run_folder.MANIFEST).exists() else folder
    tmp = saving.fresh(final)
    (tmp / "adapter_config.json").write_text('{"r": 16}')
    try:
        saving.publish(tmp, final, "train_2048")
    except saving.NotOurs as refused:
        print(refused, file=sys.stderr)
        shutil.rmtree(tmp)  # save_and_verify leaves it, and names it: the adapters, kept apart
        return "refused"
    return 0


def what_it_holds(folder: Path) -> set[str]:
    found = set(os.listdir(folder)) if folder.is_dir() else set()
    final = folder / "final"
    return found | ({f"{name}" for name in os.listdir(final)} if final.is_dir() else set())


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")}


def users_files(root: Path) -> dict:
    """The user's own files anywhere under root (what the builders write as theirs), by content."""
    mine = ("mine", "my model", "my own log\n")
    return {str(p.relative_to(root)): p.read_text() for p in root.rglob("*")
            if p.is_file() and not p.is_symlink() and p.stat().st_size < 64 and p.read_text() in mine}  # fmt: skip


@pytest.mark.parametrize("case", THE_TABLE, ids=[case.name for case in THE_TABLE])
def test_each_state_times_each_command(case, tmp_path, capsys, request):
    """One outcome and one line per state and command; a refusal touches nothing, no command loses a file of the
    user's, and each piece of advice a refusal gives, followed on the same state, works."""
    tiny = request.getfixturevalue("tiny") if case.command == "merge" else None
    root, folder = tmp_path, tmp_path / "run"
    holding = case.state(folder, root)
    (root / "up.py").write_text(UP)
    before, theirs = snapshot(root), users_files(root)
    try:
        rc, lines = run(case, folder, root, case.asked, capsys, tiny)
    finally:
        if holding is not None:
            holding.release()
    assert rc == case.rc, (rc, lines)
    assert users_files(root) == theirs
    if rc in (2, "refused") or case.command == "train" and rc == 0:  # one line: a refusal, or a run at its end
        assert len(lines) == 1 and all(word in lines[0] for word in case.said), lines
        assert rc == 0 or snapshot(root) == before  # nothing written, nothing deleted, no lock file left behind
    elif case.command in ("train", "save"):  # started, or saved: what the folder (and its final/) holds
        held = what_it_holds(folder)
        for word in case.said:
            assert (word[1:] not in held) if word.startswith("!") else (word in held), (word, sorted(held))
    else:
        assert all(word in " ".join(lines) for word in case.said), lines
    for how, *what in case.follow:  # each piece of advice, on a fresh copy of the state
        again = tmp_path / f"followed-{case.follow.index((how, *what))}"
        again.mkdir()
        holding, asked = case.state(again / "run", again), case.asked
        (again / "up.py").write_text(UP)
        if how == "flags":
            asked = what[0]
        elif how == "move":
            for name in what:
                os.rename(again / "run" / name, again / f"moved-{name}")
        elif how == "stop":
            holding.release()
            holding, asked = None, what[0]
        try:
            rc, lines = run(case, again / "run", again, asked, capsys, tiny)
        finally:
            if holding is not None:
                holding.release()
        assert rc in (0, "step 0") or str(rc).startswith("checkpoint-"), (how, what, rc, lines)


# --- races and links ------------------------------------------------------------------------------------------------


def test_a_run_held_up_before_its_lock_does_not_train_into_the_run_that_got_there_first(tmp_path, monkeypatch, capsys):
    """Two runs into one new folder, the second held up (a slow machine, Ctrl-Z) after its options were checked and
    before it holds the folder, while the first runs to its end: the second, going on, reads the folder under its lock,
    finds the first's run and is refused in one line, nothing of the first's touched."""
    out = tmp_path / "run"
    take, seen = run_folder.take, {}

    def held_up(*args, **kwargs):
        finished_run(out)  # meanwhile, the first run, finished
        seen["before"] = snapshot(out)
        return take(*args, **kwargs)

    monkeypatch.setattr(run_folder, "take", held_up)
    with pytest.raises(SystemExit) as stop:
        train_2048.main(["--config", DEMO, "--output_dir", str(out)])
    line = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and f"output_dir {out} holds a run" in line and snapshot(out) == seen["before"]


def test_overwrite_racing_a_swap_of_runs_for_a_link_deletes_nothing_of_yours(tmp_path, monkeypatch):
    """--overwrite_output_dir removes the earlier run's runs/<its folder>; runs/ swapped for a link to a folder of the
    user's that holds the same name, between the check and the removal: the removal goes through the descriptor of the
    runs/ it checked, so the user's folder is whole."""
    run = finished_run(tmp_path / "run")
    record(run, [*run_folder.RUN_NAMES, "checkpoint-2", "checkpoint-4", "runs/Nov28_host"])
    (run / "runs" / "Nov28_host").mkdir(parents=True)
    (run / "runs" / "Nov28_host" / "events").write_text("the run's")
    (tmp_path / "mine" / "Nov28_host").mkdir(parents=True)
    (tmp_path / "mine" / "Nov28_host" / "precious").write_text("mine")
    rmtree = shutil.rmtree

    def swapped_first(path, *args, **kwargs):
        if str(path).endswith("Nov28_host") and not (run / "runs").is_symlink():
            os.rename(run / "runs", tmp_path / "runs-moved")
            os.symlink(tmp_path / "mine", run / "runs")
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", swapped_first)
    with pytest.raises(Started):
        train_2048.main(["--config", DEMO, "--output_dir", str(run), "--overwrite_output_dir", "true"])
    assert (tmp_path / "mine" / "Nov28_host" / "precious").read_text() == "mine"
    assert not (tmp_path / "runs-moved" / "Nov28_host").exists()  # the run's own went


@pytest.mark.parametrize("folder_locks", [True, False], ids=["lock-on-the-folder", "lock-file-nfs"])
def test_a_lock_file_hard_linked_to_yours_is_never_written(tmp_path, monkeypatch, capsys, folder_locks):
    """The lock's file name made a hard link to a file of the user's: taking the lock never truncates or writes it.
    Where the file system cannot lock a folder (NFS), the lock file itself is locked, and one that is not proven ours
    (regular, one link, this user's) is refused in one line whose advice, followed, works; and it still excludes."""
    import fcntl

    if not folder_locks:
        flock = fcntl.flock

        def no_folder_locks(fd, operation):
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                raise OSError(errno.EBADF, "no locks on folders here")
            return flock(fd, operation)

        monkeypatch.setattr(fcntl, "flock", no_folder_locks)
    mine, run = tmp_path / "mine.txt", tmp_path / "run"
    mine.write_text("precious")
    run.mkdir()
    os.link(mine, run / run_folder.LOCK)
    argv = ["--config", DEMO, "--output_dir", str(run)]
    if folder_locks:
        with pytest.raises(Started):
            train_2048.main(argv)
    else:
        with pytest.raises(SystemExit) as stop:
            train_2048.main(argv)
        line = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and "is not a lock file of train_2048's (a hard link" in line and "remove it" in line
        (run / run_folder.LOCK).unlink()  # the advice
        with pytest.raises(Started):
            train_2048.main(argv)
        first = run_folder.take(run, resume="auto")  # the lock file is the lock: a second holder is refused
        with pytest.raises(run_folder.FolderRefused, match="in use by a running train_2048"):
            run_folder.take(run, resume="auto")
        first.release()
    assert mine.read_text() == "precious" and os.stat(mine).st_nlink == 1


# --- what a run makes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_the_folders_a_run_makes_have_the_mode_your_umask_gives(tmp_path, umask):
    """final/ (any published folder), tiny-model/ and the archive's copies are made as checkpoint-N/ is (os.makedirs,
    by the umask), not 0700 as mkdtemp makes them."""
    before = os.umask(umask)
    try:
        tmp = saving.fresh(tmp_path / "final")
        (tmp / "adapter_config.json").write_text("{}")
        saving.publish(tmp, tmp_path / "final", "train_2048")
        demo_data.build_tiny_model(tmp_path / "tiny-model", [UP * 20], seed=0)
        os.makedirs(tmp_path / "checkpoint-1")  # as transformers makes it
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
        assert set(modes.values()) == {0o777 & ~umask}, {k: oct(v) for k, v in modes.items()}
        copy = run_folder.make_folder(tmp_path, ".strategies-1-")  # the archive's (strategy_archive.write_files)
        assert stat.S_IMODE(copy.stat().st_mode) == 0o777 & ~umask
    finally:
        os.umask(before)


def test_the_archive_does_not_import_the_trainer():
    """strategy_archive.py and trainer.py imported each other (the archive's console line came from trainer.say): the
    trainer hands the archive its say, and the archive imports nothing of the trainer's."""
    tree = ast.parse((REPO / "strategy_archive.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "trainer" not in imported


def test_a_run_whose_model_does_not_load_leaves_the_folder_as_it_found_it(tmp_path, monkeypatch, capsys):
    """A new run into a folder of yours whose model then fails to load: one line, exit 2, and the folder as it was:
    what the run made (its log, record, lock file, TensorBoard folder inside your runs/) gone, yours all there."""
    monkeypatch.setattr(train_2048, "load_or_leave", LOAD_OR_LEAVE)
    root, folder = tmp_path, tmp_path / "run"
    users(folder, root)
    (folder / "runs" / "other-project").mkdir(parents=True)
    (root / "says-nothing").mkdir()
    (root / "says-nothing" / "config.json").write_text("{}")
    before = {str(p.relative_to(folder)) for p in folder.rglob("*")}
    with pytest.raises(SystemExit) as stop:
        train_2048.main(["--config", DEMO, "--output_dir", str(folder), "--model_name_or_path",
                         str(root / "says-nothing")])  # fmt: skip
    assert stop.value.code == 2 and "cannot load model" in capsys.readouterr().err
    assert {str(p.relative_to(folder)) for p in folder.rglob("*")} == before
