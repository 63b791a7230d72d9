"""The strategy archive: the strategies the model wrote during a run, kept, re-scored fairly, ranked and playable.

The rewards play every answer and keep only its score; the archive keeps the strategies. Every distinct playable
strategy the rewards played (distinct by its syntax tree: formatting and comments do not count) is kept on the trusted
side with the step it first appeared at, how many times it was written, and its scores on the games it played for its
reward. A rank must not hang on the luck of one step's games: a candidate for the top is re-scored on the run's
held-out games (rewards.held_out_seeds: secret, like the training games, so no strategy can recognise them) before it
is ranked, through the rewards' own play (rewards.play_answers: the same sandbox, the same walls, the same game score),
within a share of the training time (--archive_budget): no game of a re-scoring starts once the step's credit is
spent, so a call ends within one game's time limit of it. A rank must not hang on the luck of a few held-out games
either: the archive ranks by a lower confidence bound (the mean less CONFIDENCE standard errors over the games played),
and two neighbours in the top whose games do not tell them apart (their paired differences on the same seeds) play more
held-out games, a round of --archive_games at a time up to MAX_ROUNDS rounds, within the same budget (docs/PERF.md: on
4 games 3 of 24 biased random players ranked above the corner player; with this, none in any trial). The top N
(--archive_size) go to <output_dir>/strategies/ at every save and at the end: one .py each, index.json and best.py,
swapped in whole. Each checkpoint holds the whole archive (strategy_archive.json, written before transformers marks the
checkpoint complete), so --resume continues it; a damaged one is one line and a fresh archive, and a copy of the files that holds strategies
the archive does not know is kept, never deleted.

A strategy's code is untrusted data here: parsed to tell strategies apart (rewards.analyse has parsed it already),
never compiled or run outside the sandbox. Each file keeps it as data, a string constant (strategy_file): importing or
running the file runs none of it, whatever the model wrote, and `python <file>` hands it to evaluate_2048.py --watch,
which plays it in the sandbox; evaluation.file_source reads the string back from the file's syntax tree, the very
text the rewards played. Around it are comments, numbers and our words; none of the model's text goes into a line of
ours.

Wiring (train_2048.py): `watch(judge)` wraps the rewards' judge, so every batch's verdicts pass through `record`; as a
TrainerCallback the archive closes each step (every process's records merged on the main one, candidates re-scored),
reports at each log (TensorBoard archive/*, a text panel, a console line when the best changes) and writes the files
at each save and at the end (write_files); trainer.py's save_model puts its state into each checkpoint (save_state)
and make_archive continues a checkpoint's (load_state).

The module reads top to bottom: a strategy's identity and record (Entry), the ranking's statistics, the archive
(StrategyArchive: recording, re-scoring and ranking, reporting), then the files it writes (strategies/, one .py per
strategy, index.json) and the checkpoint's state (strategy_archive.json), each a plain function of the archive.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import shlex
import shutil
import statistics
import sys
import time
import typing
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

from transformers import TrainerCallback

import evaluation
import rewards
import run_folder

log = logging.getLogger("train_2048")

STATE_FILE = "strategy_archive.json"  # in each checkpoint-N: the whole archive, as JSON (never pickled)
STATE_FORMAT = 3  # formats 1 and 2 (held_out without "rewards") still load: their ranked strategies are re-scored
FOLDER = "strategies"  # in output_dir: a link to the latest complete copy, .strategies-<step>-<random>/
CARRY_STEPS = 10  # unused re-scoring time carries over, up to this many steps' worth
CHILD_SECONDS = 0.01  # a sandboxed game's cost beyond its own time (a fork and a referee; docs/PERF.md: 5-7 ms)
PANEL_ROWS = 5  # strategies in the TensorBoard text panel
STATUSES = ("seen", "ranked", "too_slow", "cheats")
CONFIDENCE = 2.0  # a rank is the held-out mean less this many standard errors: few or erratic games rank lower
MAX_ROUNDS = 8  # a near-tie in the top plays up to this many rounds of --archive_games held-out games
PROJECT = Path(__file__).resolve().parent  # the train_2048 whose evaluate_2048.py plays a written file


@functools.lru_cache(maxsize=4096)
def strategy_id(code: str) -> str | None:
    """A strategy's identity: a digest of its syntax tree, so that formatting and comments do not count; None when it
    cannot be kept (it does not parse here, nests too deep to walk, or is no text a file can hold)."""
    try:
        code.encode("utf-8")
        dump = ast.dump(ast.parse(code))
    except (UnicodeEncodeError, SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None
    return hashlib.sha256(dump.encode()).hexdigest()[:16]


class PlayedGame(NamedTuple):
    """What the archive keeps of one game a strategy played."""

    reward: float  # the game's score in the run's profile (rewards.game_score)
    points: int
    won: bool
    max_tile: int
    seconds: float


def game_row(result, settings) -> PlayedGame:
    return PlayedGame(rewards.game_score(result, settings), result.score, result.status == "success", result.max_tile,
                result.seconds)  # fmt: skip


@dataclasses.dataclass
class Entry:
    """One distinct strategy and what is known of its play."""

    id: str
    code: str | None  # as first written; None once it was seen cheating (no file, no checkpoint holds it)
    first_step: int
    times: int = 0  # times written (each completion that held it)
    train_games: int = 0  # games played for its rewards, all steps together
    train_reward: float = 0.0  # sums over those games: the game score of the run's profile, points, wins
    train_points: int = 0
    train_wins: int = 0
    train_max_tile: int = 0
    train_seconds: float = 0.0
    status: str = "seen"  # seen | ranked (re-scored on every held-out game) | too_slow | cheats
    held_out: dict | None = None  # once ranked: games, reward, score, win_rate, max_tile (means over the games), and
    # rewards: each game's reward, in seed order (what the ranking's bound and the near-ties are computed from)
    rescored_games: int = 0  # held-out games it played in re-scorings that ran out of time before its turn ended
    rescored_seconds: float = 0.0  # and what they took: its cost on held-out games, where training's misled

    def add_training(self, games: list[PlayedGame]) -> None:
        """Count one more time it was written, and the games it played for that answer's reward."""
        self.times += 1
        self.train_games += len(games)
        self.train_reward += sum(g.reward for g in games)
        self.train_points += sum(g.points for g in games)
        self.train_wins += sum(g.won for g in games)
        self.train_max_tile = max([self.train_max_tile, *(g.max_tile for g in games)])
        self.train_seconds += sum(g.seconds for g in games)

    @property
    def train_mean(self) -> float:
        return self.train_reward / self.train_games if self.train_games else -math.inf

    def seconds_per_game(self) -> float:
        """What one held-out game of it is expected to take: what its training games took, or what its held-out
        games took when those were slower (a strategy fast in training need not be fast on other games)."""
        rescored = self.rescored_seconds / self.rescored_games if self.rescored_games else 0.0
        return max(self.train_seconds / self.train_games, rescored) + CHILD_SECONDS

    @property
    def held_out_games(self) -> list[float]:
        return self.held_out["rewards"] if self.held_out else []

    def bound(self) -> float:
        """The lower confidence bound of its held-out reward: a lucky mean over few games, or over erratic ones, is
        not taken at its word (one game: its reward, no spread being known)."""
        games = self.held_out_games
        spread = statistics.stdev(games) / math.sqrt(len(games)) if len(games) > 1 else 0.0
        return statistics.fmean(games) - CONFIDENCE * spread

    def rank_key(self) -> tuple:
        """Best first: the held-out reward's lower bound, then its mean, then points; the earlier strategy first among
        equals."""
        return (-self.bound(), -self.held_out["reward"], -self.held_out["score"], self.first_step, self.id)


def held_out_stats(games: list, before: dict | None = None) -> dict:
    """Means over the held-out games of what game_row keeps; with `before`, over its games and these together."""
    b = before or {"games": 0, "reward": 0.0, "score": 0.0, "win_rate": 0.0, "max_tile": 0, "seconds": 0.0,
                   "rewards": []}  # fmt: skip
    n = b["games"] + len(games)
    return {
        "games": n,
        "reward": (b["reward"] * b["games"] + sum(g.reward for g in games)) / n,
        "score": (b["score"] * b["games"] + sum(g.points for g in games)) / n,
        "win_rate": (b["win_rate"] * b["games"] + sum(g.won for g in games)) / n,
        "max_tile": max([b["max_tile"], *(g.max_tile for g in games)]),
        "seconds": b["seconds"] + sum(g.seconds for g in games),
        "rewards": [*b["rewards"], *(g.reward for g in games)],
    }


def told_apart(a: Entry, b: Entry) -> bool:
    """Whether two ranked strategies' held-out games tell which is better: their reward differences on the seeds both
    played (the same games: a paired comparison, blind to how hard each game was) differ from none by more than
    CONFIDENCE standard errors, or never vary (the same play, or a steady gap)."""
    n = min(len(a.held_out_games), len(b.held_out_games))
    gaps = [x - y for x, y in zip(a.held_out_games[:n], b.held_out_games[:n])]
    if n < 2:
        return False
    spread = statistics.stdev(gaps)
    return spread == 0 or abs(statistics.fmean(gaps)) > CONFIDENCE * spread / math.sqrt(n)


def rescored(entry: Entry, wanted: int, games: list, settings) -> None:
    """What a re-scoring's games (the sandbox's GameResults, `wanted` of them asked for) make of a strategy: cheating,
    ranked on them with its earlier held-out games, too slow, or waiting for its turn with its cost now known."""
    took = sum(g.seconds for g in games)
    if any(g.status == "violation" for g in games):
        mark_cheating(entry)
    elif len(games) == wanted:
        rows = [game_row(g, settings) for g in games]
        entry.status, entry.held_out = "ranked", held_out_stats(rows, entry.held_out)
    elif any(g.status == "timeout" for g in games) or took >= settings.answer_time_limit:
        entry.status, entry.held_out = "too_slow", None  # its own games stopped it, as for an answer's reward
    else:  # the call ran out of time first: it waits, its cost now counted from these games
        entry.rescored_games += len(games)
        entry.rescored_seconds += took


def mark_cheating(entry: Entry) -> None:
    """Seen cheating (at run time): never ranked, and its code is kept nowhere."""
    entry.status, entry.code, entry.held_out = "cheats", None, None


class StrategyArchive(TrainerCallback):
    """The archive of one run (its state lives on the main process; the others only forward what they played).

    settings: the run's rewards.RewardSettings. size: how many go to the files. seeds: the held-out games. budget: the
    share of each step's time that re-scoring may take. timing: a context manager factory that counts the re-scoring
    in the step's time split (trainer.StepTimes.timing). writer: TensorBoard's SummaryWriter, or None. say: how a
    console line is said (trainer.say).
    """

    def __init__(self, settings, *, size: int, seeds: list[int], budget: float, output_dir: Path, main: bool = True,
                 world: int = 1, timing=None, writer=None, say=None):  # fmt: skip
        self.settings, self.size, self.seeds, self.budget = settings, size, list(seeds), budget
        self.output_dir, self.main, self.world = Path(output_dir), main, world
        self.timing = timing or (lambda: nullcontext())
        self.writer = writer
        self.say = say or log.info  # a console line (trainer.say under the progress bar)
        self.entries: dict[str, Entry] = {}
        self.records: list = []  # this process's (step, code, games, cheats) since the step began
        self.answers_this_step = 0  # this process's answers judged since the step began, playable or not
        self.answers = 0  # every process's, all steps together
        self.seen_verdicts = None  # the verdict list recorded last: both game rewards get the same one per batch
        self.credit = 0.0  # seconds of re-scoring the run may still spend (negative after an overrun)
        self.training_seconds = 0.0  # every step's time, re-scoring left out
        self.steps = 0
        self.spent_seconds = 0.0  # re-scoring, all steps together
        self.distinct_last_step = 0
        self.step_started = None
        self.reported = {"best": None}  # what the console line last showed
        self.copies: set[str] = set()  # the copies of strategies/ this archive made (write_files)

    def describe(self) -> str:
        """The log line that states what the archive does and its budget."""
        seeds = f"seeds {self.seeds[0]}-{self.seeds[-1]}" if len(self.seeds) > 1 else f"seed {self.seeds[0]}"
        return (
            f"strategy archive: every distinct playable strategy kept; a candidate for the top {self.size} is "
            f"re-scored on {len(self.seeds)} held-out games ({seeds}) and ranked by its mean less {CONFIDENCE:g} "
            f"standard errors; neighbours in the top those games do not tell apart play up to {MAX_ROUNDS} rounds of "
            f"{len(self.seeds)} more; all within {self.budget:.0%} of each step's time "
            f"(unused time carries over up to {CARRY_STEPS} steps' worth; an overrun, at most one game's time limit, "
            f"is paid back from the next steps'); {self.output_dir / FOLDER}/ is written at every save and at the end"
        )

    # --- recording: the rewards' verdicts -----------------------------------------------------------------------

    def watch(self, judge):
        """`judge` (rewards.make_judge's) that also records each batch's verdicts, once per batch."""

        def watched(completions, trainer_state=None, log_metric=None):
            verdicts = judge(completions, trainer_state, log_metric)
            if verdicts is not self.seen_verdicts:
                self.seen_verdicts = verdicts
                self.answers_this_step += len(verdicts)
                self.record(verdicts, (getattr(trainer_state, "global_step", 0) or 0) + 1)
            return verdicts

        return watched

    def record(self, verdicts, step: int) -> None:
        """Keep what was played of each playable answer: its code and its games (the judge's GameResults); a
        strategy the sandbox caught cheating is kept as cheating, with no games."""
        for v in verdicts:
            if v.analysis.playable and (v.games or v.violation):
                games = [] if v.cheats else [game_row(g, self.settings) for g in v.games]
                self.records.append((step, v.analysis.code, games, v.cheats))

    def merge(self, records) -> None:
        """Fold (step, code, games, cheats) records into the entries, in order."""
        this_step = set()
        for step, code, games, cheats in records:
            key = strategy_id(code)
            if key is None:
                continue
            entry = self.entries.get(key)
            if entry is None:
                entry = self.entries[key] = Entry(key, code, step)
            if cheats or entry.status == "cheats":
                mark_cheating(entry)
                continue
            this_step.add(key)
            entry.add_training(games)
        self.distinct_last_step = len(this_step)

    # --- the end of a step: merge, then re-score within the budget ---------------------------------------------

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_started = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        took = time.monotonic() - self.step_started if self.step_started is not None else 0.0
        with self.timing():
            self.end_step(took)

    def end_step(self, step_seconds: float) -> None:
        """Merge every process's records of the step, earn this step's re-scoring time, spend what fits."""
        parts = [(self.records, self.answers_this_step)]
        self.records, self.answers_this_step = [], 0
        if self.world > 1:  # every process calls this at the end of every step
            from accelerate.utils import gather_object

            parts = gather_object(parts)
        if not self.main:
            return
        self.merge([r for records, _ in parts for r in records])
        self.answers += sum(answers for _, answers in parts)
        self.steps += 1
        self.training_seconds += step_seconds
        self.credit = min(self.credit + self.budget * step_seconds, self.carry())
        self.rescore()

    def carry(self) -> float:
        """The most re-scoring time that may be saved up: CARRY_STEPS steps' share of the mean step."""
        return CARRY_STEPS * self.budget * self.training_seconds / max(self.steps, 1)

    def ranked(self) -> list[Entry]:
        return sorted((e for e in self.entries.values() if e.status == "ranked"), key=Entry.rank_key)

    def candidates(self) -> list[Entry]:
        """Strategies not yet re-scored whose training games put them above the top's last: best first."""
        top = self.ranked()[: self.size]
        bar = top[-1].bound() if len(top) >= self.size else -math.inf
        waiting = [e for e in self.entries.values() if e.status == "seen" and e.train_games and e.train_mean > bar]
        return sorted(waiting, key=lambda e: (-e.train_mean, e.first_step, e.id))

    def near_ties(self) -> list[Entry]:
        """Ranked strategies of the top that need more held-out games: of each pair of neighbours their games do not
        tell apart (told_apart), the one with fewer games (both when even), until MAX_ROUNDS rounds; best first."""
        top, rounds, out = self.ranked()[: self.size], MAX_ROUNDS * len(self.seeds), []
        for a, b in zip(top, top[1:]):
            if told_apart(a, b):
                continue
            fewer = min(len(a.held_out_games), len(b.held_out_games))
            out += [e for e in (a, b) if len(e.held_out_games) == fewer < rounds and e not in out]
        return out

    def jobs(self) -> list[tuple[Entry, list[int]]]:
        """What to play next, in order, each with its seeds: more games for a near-tie at the very top (it decides
        best.py), then the candidates on the first round, then the other near-ties."""
        ties, top = self.near_ties(), self.ranked()[:2]
        first = [e for e in ties if e in top]
        return ([(e, self.next_seeds(e)) for e in first] + [(e, self.seeds) for e in self.candidates()]
                + [(e, self.next_seeds(e)) for e in ties if e not in first])  # fmt: skip

    def next_seeds(self, entry: Entry) -> list[int]:
        """A ranked strategy's next round of held-out games: the --archive_games seeds after the ones it played (the
        held-out seeds run on from a secret start, so these are as secret)."""
        start = self.seeds[-1] + 1 + len(entry.held_out_games) - len(self.seeds)
        return list(range(start, start + len(self.seeds)))

    def rescore(self) -> float:
        """Re-score the candidates, best first, while what their games are expected to take fits the credit; returns
        the seconds spent. No game starts once the credit is spent, so the call takes at most the credit and one
        game's time limit, whatever the candidates do on the held-out games. One whose cost exceeds what may ever be
        saved up is too slow to re-score, and so is one whose own games stop it (a game timed out, or they took
        answer_time_limit together, as for a reward); one the call's end cut short waits, its cost now known."""
        workers = len(os.sched_getaffinity(0))
        chosen, cost, slowest, full = [], 0.0, 0.0, False
        for entry, seeds in self.jobs():
            per_game = entry.seconds_per_game()
            need = per_game * len(seeds)  # seconds of games; they run `workers` at a time
            if max(need / workers, per_game) > self.carry():
                if entry.status == "seen":
                    entry.status = "too_slow"  # (a ranked one keeps its rank on the games it played)
            elif not full and max((cost + need) / workers, per_game, slowest) <= self.credit:
                chosen.append((entry, seeds))
                cost, slowest = cost + need, max(slowest, per_game)
            else:
                full = True  # the rest wait for their turn: none jumps the queue
        if not chosen:
            return 0.0
        started = time.monotonic()
        played = {}
        try:
            for seeds in dict.fromkeys(tuple(seeds) for _, seeds in chosen):  # a call per round, in order
                codes = [e.code for e, s in chosen if tuple(s) == seeds]
                got = rewards.play_answers(codes, list(seeds), self.settings, deadline=started + self.credit)
                played.update({(code, seeds): games for code, games in got.items()})
        except Exception as exc:  # the sandbox failed: they stay where they were
            log.error(f"strategy archive: the sandbox failed, nothing re-scored: {type(exc).__name__}: {exc}")
            played = None
        spent = time.monotonic() - started
        self.credit -= spent
        self.spent_seconds += spent
        for entry, seeds in chosen if played is not None else []:
            rescored(entry, len(seeds), played[(entry.code, tuple(seeds))], self.settings)
        return spent

    # --- reporting ----------------------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """TensorBoard's archive/* numbers."""
        out = {
            "archive/distinct": sum(e.status != "cheats" for e in self.entries.values()),
            "archive/distinct_last_step": self.distinct_last_step,
            "archive/ranked": sum(e.status == "ranked" for e in self.entries.values()),
            "archive/rescoring_share": self.spent_seconds / self.training_seconds if self.training_seconds else 0.0,
        }
        ranked = self.ranked()
        if ranked:
            out["archive/best_score"] = ranked[0].held_out["score"]
            out["archive/best_reward"] = ranked[0].held_out["reward"]
        return out

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.main and logs and "loss" in logs:  # a training log
            self.report(state.global_step)

    def report(self, step: int) -> None:
        """TensorBoard's archive/* scalars and its text panel (at every log, so its "written" counts stay current); a
        console line when the best changed."""
        top = self.ranked()[: self.size]
        if self.writer is not None:
            for name, value in self.metrics().items():
                self.writer.add_scalar(name, value, step)
            if top:
                self.writer.add_text("archive", panel(top[:PANEL_ROWS]), step)
            self.writer.flush()
        if top and top[0].id != self.reported["best"]:
            self.reported["best"] = top[0].id
            self.say(f"archive at step {step}: new best {describe_entry(top[0])}; "
                f"{sum(e.status != 'cheats' for e in self.entries.values())} distinct so far, "
                f"{self.distinct_last_step} in this step")  # fmt: skip

    # --- files: written at each save and at the end (write_files, below) ---------------------------------------

    def on_save(self, args, state, control, **kwargs):
        self.write_files_or_say_why(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.write_files_or_say_why(state.global_step)

    def write_files_or_say_why(self, step: int) -> None:
        """The files of the main process; one that cannot be written (a full disk) is an error line, not the end of
        the run: the checkpoint holds the archive, and the next save writes them again."""
        if self.main:
            try:
                write_files(self, step)
            except OSError as exc:
                log.error(f"strategy archive: cannot write {self.output_dir / FOLDER}: {exc}")


# --- files: <output_dir>/strategies/ for the user ------------------------------------------------------------


def write_files(archive: StrategyArchive, step: int) -> Path:
    """<output_dir>/strategies/: the top N as NN-<id>.py, best.py and index.json, in a new folder swapped in by
    one rename of a link, so a reader (or a crash) sees the previous copy whole or this one whole."""
    top = archive.ranked()[: archive.size]
    folder = run_folder.make_folder(archive.output_dir, f".{FOLDER}-{step}-")  # the umask's mode, as checkpoint-N's
    run_folder.claim(archive.output_dir, folder.name)  # the run's record lists it: what --overwrite_output_dir deletes
    archive.copies.add(folder.name)
    rows = []
    for rank, entry in enumerate(top, 1):
        name = f"{rank:02d}-{entry.id}.py"
        (folder / name).write_text(strategy_file(entry, rank, step, archive.settings, archive.seeds), encoding="utf-8")
        rows.append({"rank": rank, "file": name, **entry_json(entry)})
    if top:
        shutil.copyfile(folder / rows[0]["file"], folder / "best.py")
    index = {
        "step": step,
        "board": archive.settings.rules() | {"profile": archive.settings.profile},
        "held_out_seeds": archive.seeds,
        "answers": archive.answers,
        "distinct": sum(e.status != "cheats" for e in archive.entries.values()),
        "ranked": sum(e.status == "ranked" for e in archive.entries.values()),
        "waiting": len(archive.candidates()),
        "too_slow": sum(e.status == "too_slow" for e in archive.entries.values()),
        "rescoring": {"budget_share": archive.budget, "seconds": archive.spent_seconds,
                      "training_seconds": archive.training_seconds},  # fmt: skip
        "strategies": rows,
    }
    (folder / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    link = archive.output_dir / FOLDER
    keep = unknown_copy(link, archive.entries)
    tmp_link = archive.output_dir / f".{FOLDER}.link-{os.getpid()}"
    tmp_link.unlink(missing_ok=True)
    os.symlink(folder.name, tmp_link)
    try:
        os.replace(tmp_link, link)
    except OSError as exc:  # `strategies` is a folder of the user's own: leave it alone
        tmp_link.unlink(missing_ok=True)
        log.warning(f"strategy archive: cannot replace {link} ({exc.strerror}); this copy is in {folder}")
        return folder
    ours = archive.copies | {n for n in run_folder.claimed(archive.output_dir) if n.startswith(f".{FOLDER}-")}
    for name in sorted(ours - {folder.name}):  # earlier copies of this run, and any a crash left: never a user's
        old = archive.output_dir / name
        if old == keep:
            kept = old.with_name(old.name.lstrip("."))
            old.rename(kept)
            log.warning(f"strategy archive: {link} showed strategies this archive has not ranked (it did not "
                        f"continue the state that wrote them); that copy is kept as {kept}")  # fmt: skip
        elif not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        archive.copies.discard(name)
        run_folder.unclaim(archive.output_dir, name)
    return folder


def unknown_copy(link: Path, entries: dict) -> Path | None:
    """The copy `link` shows when it holds a strategy the archive has not judged (ranked, too slow or cheating: one it
    never saw, or saw again without its held-out games yet), or an index that cannot be read: the files of a state this
    archive did not continue (a damaged checkpoint, or a save newer than the checkpoint resumed), which a copy that
    holds less must not replace. None when there is none, or this archive has judged all it shows."""
    if not link.is_symlink():
        return None
    target = link.parent / os.readlink(link)
    try:
        shown = json.loads((target / "index.json").read_text())["strategies"]
        known = all(row["id"] in entries and entries[row["id"]].status != "seen" for row in shown)
    except (OSError, ValueError, LookupError, TypeError, RecursionError):
        known = False
    return None if known or not target.is_dir() else target


def entry_json(entry: Entry) -> dict:
    """A ranked strategy's numbers as index.json lists them (its held-out games' rewards left out)."""
    n = max(entry.train_games, 1)
    train = {"games": entry.train_games, "reward": entry.train_reward / n, "score": entry.train_points / n,
             "win_rate": entry.train_wins / n, "max_tile": entry.train_max_tile}  # fmt: skip
    held_out = entry.held_out and {k: v for k, v in entry.held_out.items() if k != "rewards"} | {
        "lower_bound": entry.bound()}
    return {"id": entry.id, "first_step": entry.first_step, "times_written": entry.times,
            "held_out": held_out, "training": train}  # fmt: skip


def strategy_file(entry: Entry, rank: int, step: int, settings, seeds: list[int]) -> str:
    """A ranked strategy as a file: our header (comments: numbers and our words only), then the model's code as
    data (strategy_code) and what `python <this file>` does with it: hand it to evaluate_2048.py --watch."""
    s, h = settings, entry.held_out
    train = entry_json(entry)["training"]
    command = ["python evaluate_2048.py --strategy <this file>", f"--games {h['games']}", f"--seed {seeds[0]}"]
    header = [
        f"train_2048 strategy archive, rank {rank} at step {step}: a strategy the model wrote during training",
        f"Untrusted code, kept as data: the string {evaluation.ARCHIVED_CODE} below, which this file never runs.",
        "`python <this file>` plays a game of it in train_2048's sandbox (evaluate_2048.py --watch); to measure it:",
        "  " + " ".join(command),
        f"on its run's game, which evaluate_2048 reads from {evaluation.ARCHIVED_GAME} below: {shlex.join(game_options(s))}",
        f"first written at step {entry.first_step}; written {times(entry.times)}",
        f"held-out games: {h['games']} (seeds {seeds[0]}-{seeds[0] + h['games'] - 1}, {s.size}x{s.size} "
        f"board to {s.target}): mean reward {h['reward']:.2f} (lower bound {entry.bound():.2f}), mean score "
        f"{h['score']:.1f}, win rate {h['win_rate']:.0%}, largest tile {h['max_tile']}",
        f"training games: {train['games']}: mean reward {train['reward']:.2f}, mean score {train['score']:.1f}, "
        f"win rate {train['win_rate']:.0%}, largest tile {train['max_tile']}",
        f"id {entry.id} (a digest of its syntax tree: formatting and comments do not count)",
    ]
    return "".join(comment(line) for line in header) + strategy_code(entry.code, game_options(s))


# --- the checkpoint's state: strategy_archive.json -------------------------------------------------------------


def state_json(archive: StrategyArchive) -> dict:
    """The whole archive as the checkpoint keeps it."""
    return {
        "format": STATE_FORMAT,
        "board": archive.settings.rules() | {"profile": archive.settings.profile},
        "seeds": archive.seeds,
        "credit": archive.credit,
        "training_seconds": archive.training_seconds,
        "steps": archive.steps,
        "answers": archive.answers,
        "spent_seconds": archive.spent_seconds,
        "reported": archive.reported["best"],
        "entries": [dataclasses.asdict(e) for e in archive.entries.values()],
    }


def save_state(archive: StrategyArchive, checkpoint: Path) -> None:
    """The whole archive into a checkpoint folder (the main process's; call it before trainer_state.json)."""
    if archive.main:
        tmp = checkpoint / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(state_json(archive)))
        os.replace(tmp, checkpoint / STATE_FILE)


def load_state(archive: StrategyArchive, checkpoint: Path) -> None:
    """Continue the archive a checkpoint holds; a checkpoint without one, with a damaged one (state_problem), or of
    another board starts a new one, in one line, and the files already written stay (unknown_copy). Held-out
    scores on other seeds than this run's are dropped: those strategies are re-scored."""
    path = checkpoint / STATE_FILE
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        log.warning(f"{checkpoint} holds no strategy archive: a new one starts here")
        return
    except (OSError, ValueError, RecursionError) as exc:
        problem = f"unreadable: {type(exc).__name__}"
    else:
        problem = state_problem(saved)
    if problem is not None:
        log.warning(f"{path} is damaged ({problem}): a new strategy archive starts here (the strategies already "
                    f"in {archive.output_dir / FOLDER} are kept)")  # fmt: skip
        return
    if saved["board"] != archive.settings.rules() | {"profile": archive.settings.profile}:
        log.warning(f"{path} was played on another board or profile: a new strategy archive starts here")
        return
    archive.entries = {e["id"]: Entry(**e) for e in saved["entries"]}
    if saved["format"] < STATE_FORMAT:  # ranked before each held-out game's reward was kept: ranked again
        saved["seeds"] = None
    archive.credit, archive.steps, archive.answers = saved["credit"], saved["steps"], saved["answers"]
    archive.training_seconds, archive.spent_seconds = saved["training_seconds"], saved["spent_seconds"]
    archive.reported["best"] = saved["reported"]
    if saved["seeds"] != archive.seeds:
        why = "on other held-out games" if saved["seeds"] else "before each game's reward was kept"
        log.warning(f"{path} re-scored {why}: its ranked strategies are re-scored again")
        for entry in archive.entries.values():
            if entry.status in ("ranked", "too_slow"):
                entry.status, entry.held_out = "seen", None
    log.info(f"strategy archive: continuing {checkpoint}'s, {len(archive.entries)} distinct strategies")


STATE_TYPES = {"format": int, "board": dict, "seeds": list, "credit": float, "training_seconds": float, "steps": int,
               "answers": int, "spent_seconds": float, "reported": str | None, "entries": list}  # fmt: skip
HELD_OUT_TYPES = {"games": int, "reward": float, "score": float, "win_rate": float, "max_tile": int, "seconds": float,
                  "rewards": list}  # fmt: skip
NEW_IN_FORMAT_2 = {"rescored_games": 0, "rescored_seconds": 0.0}


def state_problem(saved) -> str | None:
    """Why a checkpoint's archive (JSON, as read) cannot be continued, or None: every field there and of its type,
    none unknown, each strategy's code the one its id names (so it parses), statuses that agree with the rest."""
    problem = fields_problem(saved, STATE_TYPES, "") if isinstance(saved, dict) else "not a JSON object"
    if problem is None and saved["format"] not in (1, 2, STATE_FORMAT):
        problem = f"format {saved['format']}, not {STATE_FORMAT}"
    if problem is None and not all(is_a(seed, int) for seed in saved["seeds"]):
        problem = "seeds is not a list of counts"
    if problem is not None:
        return problem
    entry_types, ids = typing.get_type_hints(Entry), set()
    for i, entry in enumerate(saved["entries"]):
        where = f"entries[{i}]"
        if not isinstance(entry, dict):
            return f"{where} is not an object"
        if saved["format"] == 1:
            entry = {**NEW_IN_FORMAT_2, **entry}
        if saved["format"] < 3 and isinstance(entry.get("held_out"), dict):  # (re-scored on loading: load_state)
            entry["held_out"] = {"rewards": [], **entry["held_out"]}
        saved["entries"][i] = entry
        problem = fields_problem(entry, entry_types, where + ".")
        if problem is not None:
            return problem
        code, status, held_out = entry["code"], entry["status"], entry["held_out"]
        if status not in STATUSES:
            return f"{where}: status {status!r}, not one of {', '.join(STATUSES)}"
        if (code is None) != (status == "cheats"):
            return f"{where}: {'no code' if code is None else 'code'} with status {status!r}"
        if code is not None and strategy_id(code) != entry["id"]:
            return f"{where}: its code does not parse, or is not the strategy its id names"
        if entry["id"] in ids:
            return f"{where}: id {entry['id']} twice"
        ids.add(entry["id"])
        if (held_out is None) == (status == "ranked"):
            return f"{where}: {'no held-out scores' if held_out is None else 'held-out scores'} with status {status!r}"
        if held_out is not None and (problem := fields_problem(held_out, HELD_OUT_TYPES, f"{where}.held_out.")):
            return problem
        if held_out is not None and not all(is_a(g, float) for g in held_out["rewards"]):
            return f"{where}.held_out.rewards is not a list of numbers"
        if held_out is not None and saved["format"] == STATE_FORMAT and len(held_out["rewards"]) != held_out["games"]:
            return f"{where}: {len(held_out['rewards'])} held-out game rewards for {held_out['games']} games"
    return None


def fields_problem(saved: dict, types: dict, where: str) -> str | None:
    """The first field of `saved` (`where` names it: "" or "entries[3].") that is unknown, missing or not of its type
    in `types` (is_a), said in a few words."""
    unknown, missing = sorted(saved.keys() - types.keys()), sorted(types.keys() - saved.keys())
    if unknown or missing:
        return f"unknown field {where}{unknown[0]}" if unknown else f"no field {where}{missing[0]}"
    for name, kind in types.items():
        if not is_a(saved[name], kind):
            names = {int: "a count", float: "a number", str: "a string", dict: "an object", list: "a list"}
            kinds = " or ".join(names.get(k, "null") for k in typing.get_args(kind) or (kind,))
            return f"{where}{name} is {json.dumps(saved[name])[:40]}, not {kinds}"
    return None


def is_a(value, kind) -> bool:
    """Whether a JSON value is of a field's type: an int is a float too, but a bool is neither; an int is a count
    (never negative), a float a finite number."""
    if isinstance(value, bool):
        return False
    if isinstance(value, float):
        return math.isfinite(value) and isinstance(1.0, kind)
    if isinstance(value, int):
        return value >= 0 if isinstance(1, kind) else isinstance(1.0, kind)
    return isinstance(value, kind)


def describe_entry(entry: Entry) -> str:
    h = entry.held_out
    return (
        f"{entry.id} (first written at step {entry.first_step}, {times(entry.times)}): held-out reward "
        f"{h['reward']:.2f} (lower bound {entry.bound():.2f}), score {h['score']:.0f}, win {h['win_rate']:.0%}, tile "
        f"{h['max_tile']} over {h['games']} games"
    )


def panel(top: list[Entry]) -> str:
    """The text panel: the best strategies and their scores, then the best one's code (indented: it may hold
    fences)."""
    rows = ["| rank | id | first step | written | held-out reward | score | win | tile |", "|---" * 8 + "|"]
    for rank, e in enumerate(top, 1):
        h = e.held_out
        rows.append(f"| {rank} | {e.id} | {e.first_step} | {e.times} | {h['reward']:.2f} | {h['score']:.0f} | "
                    f"{h['win_rate']:.0%} | {h['max_tile']} |")  # fmt: skip
    code = "\n".join("    " + line for line in top[0].code.splitlines())
    return "\n".join(rows) + f"\n\nbest ({top[0].id}):\n\n{code}"


def comment(text: str) -> str:
    """One comment line: any character that is not printable (a line break of any kind, a control character) is
    written as its escape, so that nothing in it can end the comment."""
    return "# " + "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text) + "\n"


def times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def game_options(settings) -> list[str]:
    """The run's game as evaluate_2048.py's options, every one of them (evaluation.BOARD): what a file's GAME says,
    whatever evaluate_2048's default board is (evaluation.file_game reads it)."""
    return [f"--{name}={getattr(settings, name)}" for name in evaluation.BOARD]


def strategy_code(code: str, options: list[str]) -> str:
    """The body of a strategy file: the model's code as one string constant, a string literal per line (repr writes
    any text as a literal that reads back as the same text, every character that could end a line escaped), so no
    text can leave the string; then our `python <this file>`, which runs evaluate_2048.py --watch on the file with
    the Python and the train_2048 that wrote it (run options after the file's name go to evaluate_2048.py)."""
    literals = "".join(f"    {line!r}\n" for line in code.splitlines(keepends=True)) or "    ''\n"
    return (
        f"\n{evaluation.ARCHIVED_CODE} = (\n{literals})\n"
        f"PYTHON, TRAIN_2048 = {sys.executable or 'python3'!r}, {str(PROJECT)!r}  # what wrote this file\n"
        f"{evaluation.ARCHIVED_GAME} = {options!r}  # the run's game, as evaluate_2048.py's options\n"
        "\n"
        'if __name__ == "__main__":\n'
        "    import os\n"
        "    import sys\n"
        "\n"
        '    command = [PYTHON, os.path.join(TRAIN_2048, "evaluate_2048.py"), "--watch", __file__, *GAME]\n'
        "    command += sys.argv[1:]\n"
        "    try:\n"
        "        os.execv(PYTHON, command)\n"
        "    except OSError as exc:\n"
        '        print(f"{__file__}: cannot start {PYTHON} {command[1]} ({exc.strerror}): play it with '
        'evaluate_2048.py --watch", file=sys.stderr)\n'
        "        sys.exit(2)\n"
    )
