"""The three GRPO rewards, the prompt and the dataset.

Reward functions follow TRL's contract `f(completions, **kwargs) -> list[float]` and never raise: a broken
completion is a score. Code is judged statically here, in the trainer's process (parsed, never compiled or run: that
is the sandbox's job, under its time and memory limits), against policy.py's contract, the one the prompt states;
then played only inside the sandbox, once per batch for both game-dependent rewards, so that what the sandbox sees at
run time (a violation of the contract) is scored as cheating too. Two profiles:

- `graded` (default): the mean over 8 games of a per-game score in [0, 20] from the game's points, on a 3x3
  board to 512, where no player that ignores the board (random keys, any fixed cycle of keys) comes near a
  board-reading one: chosen from measurements (bench/reward_table.py; docs/REWARDS.md). On the notebook's
  6x6 board `random.choice("WASD")` wins ~97% of games, and on 5x5 a four-key cycle wins 87%.
- `notebook`: one 6x6 game to 2048 scored exactly like the public notebook, for reproducing the tutorial.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Literal

import policy
import sandbox
import strategies

PROFILES = ("graded", "notebook")
log = logging.getLogger("train_2048.rewards")


@dataclass(frozen=True)
class RewardSettings(sandbox.Game):
    """The game each completion plays (sandbox.Game's rules and limits, carried as they are to the referee) and how
    it is scored; train_2048.py and evaluate_2048.py parse it as options too."""

    _argument_group_name = "game and rewards"  # its --help section

    profile: Literal["graded", "notebook"] = field(
        default="graded",
        metadata={"help": "graded: mean of K games scored by progress. notebook: the public notebook's table."},
    )
    games: int = field(default=8, metadata={"help": "Games each strategy plays (the notebook profile plays one)."})
    answer_time_limit: float = field(
        default=20.0,
        metadata={
            "help": "Seconds one answer's games may take together; once spent, or once one of its games timed out, "
            "its games not yet started are not played and it is scored on those it played. Bounds a step's scoring "
            "time when answers stall (docs/SECURITY.md)."
        },
    )
    game_salt: str | None = field(
        default=None,
        metadata={
            "help": "Secret mixed into every training game's seed, so no strategy can compute its spawns. Default: "
            "a random one per run, kept in each checkpoint (a resume replays the same games). Set it only to "
            "rerun the same games exactly."
        },
    )
    require_seccomp: bool = field(
        default=True,
        metadata={
            "help": "Refuse to play strategies without the sandbox's seccomp wall (libseccomp missing). false: warn "
            "once and rely on the other walls (docs/SECURITY.md says what is then exposed)."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {self.profile!r}")
        if self.games < 1:
            raise ValueError(f"games must be >= 1, got {self.games!r}")
        limit = self.answer_time_limit
        if isinstance(limit, bool) or not isinstance(limit, int | float) or not limit > 0:
            raise ValueError(f"answer_time_limit must be a positive number of seconds, got {limit!r}")


NOTEBOOK = dict(profile="notebook", size=6, target=2048, probability_fours=0.10, games=1, game_time_limit=5.0)

# --- extraction -------------------------------------------------------------------------------------
# Everything here is linear in the text: completions are untrusted input judged in the trainer's process.

_FINAL_RAW = "<|channel|>final<|message|>"
_FINAL_DECODED = "assistantfinal"
_HARMONY_ENDS = ("<|return|>", "<|end|>", "<|call|>")
_DEFINES_STRATEGY = re.compile(r"^[ \t]*def[ \t]+strategy[ \t]*\(", re.M)  # [ \t], not \s: no backtracking


def completion_text(completion) -> str:
    """The text of a completion, whether TRL passes a string or a conversational message list."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    if isinstance(completion, list | tuple):
        for message in reversed(completion):
            if isinstance(message, dict) and message.get("role", "assistant") == "assistant":
                return str(message.get("content") or "")
    return ""


def final_channel(text: str) -> str:
    """The answer part of gpt-oss Harmony output (raw, or decoded with special tokens skipped)."""
    if _FINAL_RAW in text:
        text = text.rsplit(_FINAL_RAW, 1)[1]
        ends = [i for i in (text.find(end) for end in _HARMONY_ENDS) if i >= 0]
        return text[: min(ends)] if ends else text
    if _FINAL_DECODED in text:
        return text.rsplit(_FINAL_DECODED, 1)[1]
    return text


def code_blocks(text: str) -> list[str]:
    """The bodies of the closed fenced code blocks, in order, read line by line.

    A fence opens on a line that starts with three or more backticks or tildes (CommonMark; any info string after
    them: ```` ```python title=x.py ````, `~~~python`) and closes on a line of at least as many of the same character
    alone, or at the end of a line of code (`return "W"```). Windows line endings are fine. An unclosed block (a
    truncated completion) is not a block.
    """
    blocks, fence, mark, body = [], 0, "", []
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        stripped = line.strip()
        if not fence:
            if stripped.startswith(("```", "~~~")):
                mark = stripped[0]
                fence, body = len(stripped) - len(stripped.lstrip(mark)), []
        elif stripped.startswith(mark * fence) and not stripped.strip(mark):
            blocks.append("\n".join(body))
            fence = 0
        elif fence == 3 and stripped.endswith(mark * 3) and not stripped.endswith(mark * 4):
            body.append(line.rstrip()[:-3])
            blocks.append("\n".join(body))
            fence = 0
        else:
            body.append(line)
    return blocks


def extract_function(text) -> str | None:
    """Source of the last closed code block that defines `strategy`, from the final channel; else None."""
    answer = final_channel(completion_text(text))
    blocks = [body for body in code_blocks(answer) if _DEFINES_STRATEGY.search(body)]
    if not blocks:
        return None
    # Dedent a block that was indented as a whole (e.g. inside a list item); lines as code_blocks split them.
    lines = blocks[-1].split("\n")
    indents = [len(line) - len(line.lstrip()) for line in lines if line.strip()]
    cut = min(indents, default=0)
    return "\n".join(line[cut:] for line in lines).strip("\n") + "\n"


# --- static analysis --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Analysis:
    """What static analysis makes of one completion (policy.py's judgement of its syntax tree)."""

    code: str | None  # None: nothing extracted
    parsed: bool  # the code parses (it is compiled only in the sandbox)
    structure: str | None  # why it is not a module the sandbox plays (policy.structure_problem), None when it is
    cheats: tuple[str, ...]  # what it uses that a strategy may not (policy.py), e.g. ("import of 'os'",)

    @property
    def loadable(self) -> bool:
        """A module that defines `strategy(board)` with only definitions at the top level."""
        return self.parsed and self.structure is None

    @property
    def playable(self) -> bool:
        """The one rule for what is played in the sandbox: a loadable module that keeps the contract."""
        return self.loadable and not self.cheats

    @property
    def why_not_played(self) -> str | None:
        if self.code is None:
            return "no code block defining strategy"
        if not self.parsed:
            return "syntax error"
        if self.structure is not None:
            return self.structure
        if self.cheats:
            return "cheats: " + ", ".join(self.cheats[:4])
        return None


def analyse_code(code: str) -> Analysis:
    """Judge plain Python (extracted from a completion, a file, a baseline) without compiling or running it
    (policy.judge: parsed only; compiling, and any error only the compiler finds, is left to the sandbox's child)."""
    verdict = policy.judge(code)
    if verdict is None:
        return Analysis(code, False, None, ())
    found, structure = verdict
    return Analysis(code, True, structure, found)


@functools.lru_cache(maxsize=1024)
def _analyse_text(text: str) -> Analysis:
    code = extract_function(text)
    return Analysis(None, False, None, ()) if code is None else analyse_code(code)


def analyse(completion) -> Analysis:
    return _analyse_text(completion_text(completion))


# --- scores -----------------------------------------------------------------------------------------

# Per-game scores of the graded profile for a strategy that fails to play: the game's points do the rest.
GRADED_ERROR, GRADED_INVALID = -3.0, -2.0
# The notebook's exact numbers.
NOTEBOOK_SUCCESS, NOTEBOOK_FAILED, NOTEBOOK_TIMEOUT, NOTEBOOK_ERROR = 20.0, 2.0, -1.0, -3.0


def target_points(target: int) -> int:
    """The points (the sum of merged tiles) of building `target` from 2s: log2(target) - 1 merges per unit of value."""
    return (target.bit_length() - 2) * target


def graded_game_score(result, target: int) -> float:
    """20 for the target; else the game's points as a share of the target's, times 20, at most 20.

    Points grow with every merge, so the score separates weak players that end on the same largest tile and keeps
    rising with stronger play (bench/reward_table.py: on the default 3x3 board to 512 the best of ~100 board-blind
    players, fixed key cycles included, earns 0.15 of a depth-2 search and less than a 1-ply greedy). A game that
    runs out of time, or reaches its move cap, is scored by the points it made, as if it had stopped there: a
    timeout costs the rest of the game, never more, so stopping early never pays. Raising or crashing is -3, a
    reply that is not a key -2.
    """
    if result.status == "success":
        return 20.0
    if result.status in ("error", "crash"):
        return GRADED_ERROR
    if result.status == "invalid":
        return GRADED_INVALID
    return min(20.0, 20.0 * result.score / target_points(target))  # failed, capped, timeout


def notebook_game_score(result) -> float:
    """The notebook's table: +20 target, +2 game over, -1 timeout, -3 exception.

    Its engine ends a game on an invalid key as failed (+2); a strategy stuck on a key that changes
    nothing loops there until the 5 s limit, so our idle-move cut-off scores as the timeout it would be.
    """
    if result.status == "success":
        return NOTEBOOK_SUCCESS
    if result.status == "timeout" or (result.status == "failed" and "idle" in (result.error or "")):
        return NOTEBOOK_TIMEOUT
    if result.status in ("error", "crash"):
        return NOTEBOOK_ERROR
    return NOTEBOOK_FAILED  # failed, invalid


def game_score(result, settings: RewardSettings) -> float:
    """One game's score in the run's profile: what strategy_succeeds averages over an answer's games."""
    if settings.profile == "notebook":
        return notebook_game_score(result)
    return graded_game_score(result, settings.target)


def game_seeds(settings: RewardSettings, salt: str, step: int, call: int) -> list[int]:
    """Seeds for one reward call: shared by every completion of the call (so by every GRPO group), new at every
    step and every call within a step, the same on every process and after a resume (the salt is saved).

    The secret salt is what keeps them out of reach: from public inputs alone (step, call) a strategy could
    search for the seed that deals its opening board and then play with foresight.
    """
    n = 1 if settings.profile == "notebook" else settings.games
    return [
        int.from_bytes(hashlib.sha256(f"train_2048/rewards/{salt}/{step}/{call}/{i}".encode()).digest()[:8], "big")
        for i in range(n)
    ]


def held_out_seeds(salt: str, n: int) -> list[int]:
    """The run's held-out games, for its evaluations and its strategy archive alike: n consecutive seeds from a secret
    start drawn from the salt (kept in every checkpoint), so that `evaluate_2048.py --seed <first> --games n` replays
    them, and no strategy can tell them apart from other games (with public seeds, a strategy that knows them
    recognises each game by its own `random`'s first draw, and can play it with foresight)."""
    start = int.from_bytes(hashlib.sha256(f"train_2048/held-out/{salt}".encode()).digest()[:6], "big")
    return [start + i for i in range(n)]


def new_salt() -> str:
    return secrets.token_hex(16)


# --- judging a batch: static analysis, then the games ----------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """One completion, judged and (when playable) played."""

    analysis: Analysis
    games: tuple = ()  # the GameResults of the games it played; games its time budget left unstarted are not here
    violation: str | None = None  # what the sandbox saw it use at run time that policy.py forbids

    @property
    def cheats(self) -> bool:
        """Cheating, seen in the code or at run time: the two are scored alike."""
        return bool(self.analysis.cheats) or self.violation is not None


def make_judge(settings: RewardSettings):
    """A function (completions, trainer_state, log_metric) -> [Verdict], shared by the rewards of one run: the first
    reward TRL calls on a batch plays it, the others read the same verdicts (TRL hands every reward function the same
    list). Its games' seeds come from settings.game_salt (a fresh secret one when it is None)."""
    salt = settings.game_salt or new_salt()
    calls_this_step = {}  # global_step -> batches judged so far; several per step with gradient accumulation
    last = {"completions": None, "step": None, "verdicts": None}

    def judge(completions, trainer_state=None, log_metric=None) -> list[Verdict]:
        step = getattr(trainer_state, "global_step", 0) or 0
        if last["completions"] is completions and last["step"] == step:
            return last["verdicts"]
        call = calls_this_step.get(step, 0)
        calls_this_step.clear()
        calls_this_step[step] = call + 1
        seeds = game_seeds(settings, salt, step, call)

        analyses = [analyse(c) for c in completions]
        playable = sorted({a.code for a in analyses if a.playable})
        failed = False
        try:
            played = play_answers(playable, seeds, settings)
        except Exception as exc:  # the sandbox itself failed: score nothing rather than stop training
            log.error(f"the sandbox failed, this batch is scored as not played: {type(exc).__name__}: {exc}")
            played, failed = {}, True
        verdicts = []
        for a in analyses:
            games = tuple(played.get(a.code, ())) if a.playable else ()
            violation = next((g.error for g in games if g.status == "violation"), None)
            verdicts.append(Verdict(a, games, violation))
        if log_metric is not None:
            for name, value in batch_metrics(verdicts, len(seeds), failed).items():
                log_metric(name, value)
        last.update(completions=completions, step=step, verdicts=verdicts)
        return verdicts

    return judge


def play_answers(codes: list[str], seeds: list[int], settings: RewardSettings, deadline: float = math.inf) -> dict:
    """code -> the GameResults of its games on `seeds`, in seed order, played in the sandbox as an answer is played for
    its reward (the strategy archive re-scores the same way): game by game across the answers, so one that stalls is
    found out in its first games and not played on; once one of an answer's games timed out, or its games together
    took answer_time_limit, its games not yet started are not played and not in its list; nor is any game that would
    start after `deadline` (time.monotonic()). Raises when the sandbox itself fails."""
    jobs = [(code, seed, settings) for seed in seeds for code in codes]
    results = sandbox.play_many(
        jobs, strict=settings.require_seccomp, groups=[code for code, _, _ in jobs],
        group_seconds=settings.answer_time_limit, deadline=deadline,
    )  # fmt: skip
    played = {code: [] for code in codes}
    for (code, _, _), result in zip(jobs, results):
        if result is not None:
            played[code].append(result)
    return played


def batch_metrics(verdicts: list[Verdict], games_each: int, sandbox_failed: bool = False) -> dict[str, float]:
    """Game metrics of one reward call; each completion counts once, its games once each."""
    n = max(len(verdicts), 1)
    played = [v for v in verdicts if v.games]
    flat = [r for v in played for r in v.games]
    metrics = {
        "game/unparseable_frac": sum(v.analysis.code is None or not v.analysis.parsed for v in verdicts) / n,
        "game/cheat_frac": sum(v.cheats for v in verdicts) / n,  # in the code, or seen at run time
        "game/timeout_frac": sum(any(r.status == "timeout" for r in v.games) for v in played) / n,
        "game/error_frac": sum(any(r.status in ("error", "crash", "invalid") for r in v.games) for v in played) / n,
        "game/sandbox_failure": float(sandbox_failed),  # 1 when the sandbox itself failed and nothing was played
    }
    if played:  # games an answer's time budget left unstarted, as a share of its games
        metrics["game/skipped_frac"] = sum(games_each - len(v.games) for v in played) / (games_each * len(played))
    if flat:
        metrics["game/win_rate"] = sum(r.status == "success" for r in flat) / len(flat)
        metrics["game/max_tile_log2"] = sum(math.log2(max(r.max_tile, 1)) for r in flat) / len(flat)
        metrics["game/moves"] = sum(r.moves for r in flat) / len(flat)
        metrics["game/points"] = sum(r.score for r in flat) / len(flat)
    return metrics


# --- the reward functions ---------------------------------------------------------------------------


def function_works(completions, **kwargs) -> list[float]:
    """+1 a loadable `strategy` module; -0.5 parses but is not one (policy.structure_problem); -2 nothing extracted or
    a syntax error."""
    scores = []
    for completion in completions:
        a = analyse(completion)
        scores.append(1.0 if a.loadable else -0.5 if a.parsed else -2.0)
    return scores


def make_no_cheating(settings: RewardSettings, judge=None):
    judge = judge or make_judge(settings)

    def no_cheating(completions, trainer_state=None, log_metric=None, **kwargs) -> list[float]:
        """+1 clean; -20 uses what a strategy may not (policy.py), in its code or, seen by the sandbox, at run time
        (the audit hook, or the kernel on any step outside the process: an escape scores like the plain forbidden
        import); -1 nothing extracted.

        A syntax error cannot be judged: -1 in the graded profile, -20 in the notebook's.
        """
        scores = []
        for v in judge(completions, trainer_state, log_metric):
            if v.analysis.code is None:
                scores.append(-1.0)
            elif not v.analysis.parsed:
                scores.append(-20.0 if settings.profile == "notebook" else -1.0)
            else:
                scores.append(-20.0 if v.cheats else 1.0)
        return scores

    return no_cheating


def make_strategy_succeeds(settings: RewardSettings, judge=None):
    """The game reward."""
    judge = judge or make_judge(settings)

    def strategy_succeeds(completions, trainer_state=None, log_metric=None, **kwargs) -> list[float]:
        """Mean game score of each playable completion over the games it played; 0 for code that is not played or
        that the sandbox caught cheating (no_cheating scores that)."""
        scores = []
        for v in judge(completions, trainer_state, log_metric):
            if not v.games or v.cheats:
                scores.append(0.0)
                continue
            per_game = [game_score(r, settings) for r in v.games]
            scores.append(sum(per_game) / len(per_game))
        return scores

    return strategy_succeeds


def reward_functions(settings: RewardSettings, judge=None) -> list:
    """[function_works, no_cheating, strategy_succeeds] for TRL's `reward_funcs`, configured by `settings`; the last
    two share one judge (make_judge's, or `judge`, one that wraps it), so each batch is played once."""
    judge = judge or make_judge(settings)
    return [function_works, make_no_cheating(settings, judge), make_strategy_succeeds(settings, judge)]


# --- prompt and dataset -----------------------------------------------------------------------------

KEY_NAMES = ("up", "left", "down", "right")


def build_prompt(settings: RewardSettings | None = None) -> str:
    """Our wording of the notebook's task, with this run's board, target and key alphabet, and policy.py's contract in
    its own words: what the prompt allows is what the judge and the sandbox allow."""
    s = settings or RewardSettings()
    keys = ", ".join(f'"{k}" ({name})' for k, name in zip(s.keys, KEY_NAMES))
    return (
        f"Write a Python strategy for the game 2048 on a {s.size}x{s.size} board; the goal is a {s.target} tile.\n"
        f"The function receives `board`, a list of {s.size} lists of {s.size} integers (0 is an empty cell), "
        f"and returns one move as a one-character string: {keys}.\n"
        f"{policy.prompt_rules()}\n"
        "Answer with one Python code block:\n"
        "```python\ndef strategy(board):\n    ...\n```"
    )


def build_dataset(n: int, settings: RewardSettings | None = None, reasoning_effort: str = "low"):
    """n copies of the prompt as conversational rows; gpt-oss's chat template reads `reasoning_effort`."""
    from datasets import Dataset

    prompt = [{"role": "user", "content": build_prompt(settings)}]
    return Dataset.from_dict({"prompt": [prompt] * n, "reasoning_effort": [reasoning_effort] * n})


# --- the token budget -------------------------------------------------------------------------------

# What gpt-oss writes before its final answer, even at low reasoning effort: 150-250 tokens (a public DGX Spark run of
# this task clipped every completion at 200 and 300 tokens). The Harmony framing of both messages is counted on top.
ANALYSIS_TOKENS = 250
NEED_PLAYER = "expectimax_compact"  # the shortest player that searches (strategies.py): what a budget must hold


def completion_need(tokenizer) -> tuple[int, int]:
    """(analysis, answer): the tokens a completion needs for a board-reading answer in this tokenizer: a compact
    depth-2 expectimax in a code block, after an analysis allowance when the tokenizer speaks Harmony (gpt-oss)."""
    answer = "```python\n" + strategies.source(NEED_PLAYER) + "```"
    if "<|channel|>" not in tokenizer.get_added_vocab():
        return 0, len(tokenizer.encode(answer, add_special_tokens=False))
    analysis_frame = "<|channel|>analysis<|message|><|end|><|start|>assistant"
    final = f"<|channel|>final<|message|>{answer}<|return|>"
    count = len(tokenizer.encode(analysis_frame, add_special_tokens=False))
    return ANALYSIS_TOKENS + count, len(tokenizer.encode(final, add_special_tokens=False))


def prompt_tokens(tokenizer, settings: RewardSettings, reasoning_effort: str = "low") -> int:
    """The training prompt's length as the model sees it: its chat template, the generation prompt included."""
    chat = [{"role": "user", "content": build_prompt(settings)}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, reasoning_effort=reasoning_effort,
                                             return_dict=True)  # fmt: skip
    return len(rendered["input_ids"])


def budget_warnings(tokenizer, settings: RewardSettings, budget: int, reasoning_effort: str = "low",
                    max_seq_length: int | None = None) -> list[str]:  # fmt: skip
    """The lines said at start when the token budget cannot hold what the reward pays for: a completion cut off before
    its code block closes holds no code, so a budget below a board-reading answer leaves only board-blind ones to
    learn; `max_seq_length` (Unsloth's context) must hold the prompt and the budget."""
    analysis, answer = completion_need(tokenizer)
    lines = []
    if budget < analysis + answer:
        lines.append(f"max_completion_length {budget} cannot hold a board-reading answer: {analysis} tokens of analysis "
                     f"and {answer} for a compact search answer need {analysis + answer} (docs/TRAINING.md, Token budget)")  # fmt: skip
    prompt = prompt_tokens(tokenizer, settings, reasoning_effort)
    if max_seq_length is not None and prompt + budget > max_seq_length:
        lines.append(f"max_seq_length {max_seq_length} cannot hold the prompt ({prompt} tokens) and "
                     f"max_completion_length {budget}: raise it to {prompt + budget} or more")  # fmt: skip
    return lines
