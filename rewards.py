"""The three GRPO rewards, the prompt and the dataset.

Reward functions follow TRL's contract `f(completions, **kwargs) -> list[float]` and never raise: a broken
completion is a score. Code is judged statically here, in the trainer's process (parse, never run), and
played only inside the sandbox. Two profiles:

- `graded` (default): the mean over K games of a per-game score in [0, 20] proportional to the largest
  tile, on a board where random play almost never wins, so `random.choice("WASD")` is not a local
  optimum (on the notebook's 6x6 board it wins ~97% of games).
- `notebook`: one 6x6 game to 2048 scored exactly like the public notebook, for reproducing the tutorial.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Literal

import sandbox

PROFILES = ("graded", "notebook")


@dataclass
class RewardSettings:
    """The game each completion plays and how it is scored; train_2048.py parses it as options too."""

    _argument_group_name = "game and rewards"  # its --help section

    profile: Literal["graded", "notebook"] = field(
        default="graded",
        metadata={"help": "graded: mean of K games scored by the largest tile. notebook: the public notebook's."},
    )
    size: int = field(default=5, metadata={"help": "Board size (size x size)."})
    target: int = field(default=2048, metadata={"help": "Tile that wins a game."})
    probability_fours: float = field(default=0.10, metadata={"help": "Chance that a new tile is a 4."})
    keys: str = field(default="WASD", metadata={"help": "The four move keys: up, left, down, right."})
    games: int = field(default=4, metadata={"help": "Games per completion (graded; the notebook plays one)."})
    game_time_limit: float = field(
        default=10.0,  # a ~1000-move 5x5 game of a 3-ply search takes a few seconds
        metadata={"help": "Seconds for a whole game."},
    )
    move_time_limit: float = field(default=1.0, metadata={"help": "Seconds for one move."})
    game_seed: int = field(
        default=0, metadata={"help": "With the step, fixes every game's seed (independent of --seed)."}
    )

    def play_kwargs(self, seed: int) -> dict:
        """The keyword arguments of sandbox.play for one game under these settings."""
        return dict(
            seed=seed,
            size=self.size,
            target=self.target,
            probability_fours=self.probability_fours,
            keys=self.keys,
            move_time_limit=self.move_time_limit,
            game_time_limit=self.game_time_limit,
        )

    def __post_init__(self):
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {self.profile!r}")
        if self.games < 1:
            raise ValueError(f"games must be >= 1, got {self.games!r}")
        if self.game_time_limit <= 0 or self.move_time_limit <= 0:
            raise ValueError("game_time_limit and move_time_limit must be > 0")


NOTEBOOK = dict(profile="notebook", size=6, target=2048, probability_fours=0.10, games=1, game_time_limit=5.0)

# --- extraction -------------------------------------------------------------------------------------

_FINAL_RAW = "<|channel|>final<|message|>"
_FINAL_DECODED = re.compile(r"assistantfinal")
_HARMONY_TAIL = re.compile(r"<\|(?:return|end|call)\|>.*\Z", re.S)
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)```", re.S)
_DEFINES_STRATEGY = re.compile(r"^\s*def\s+strategy\s*\(", re.M)


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
        return _HARMONY_TAIL.sub("", text)
    matches = list(_FINAL_DECODED.finditer(text))
    if matches:
        return text[matches[-1].end() :]
    return text


def extract_function(text) -> str | None:
    """Source of the last closed code fence that defines `strategy`, from the final channel; else None.

    An unclosed fence (a truncated completion) is not an answer.
    """
    answer = final_channel(completion_text(text))
    blocks = [body for _, body in _FENCE.findall(answer) if _DEFINES_STRATEGY.search(body)]
    if not blocks:
        return None
    code = blocks[-1]
    # Dedent a block that was indented as a whole (e.g. inside a list item).
    lines = code.splitlines()
    indents = [len(line) - len(line.lstrip()) for line in lines if line.strip()]
    cut = min(indents, default=0)
    return "\n".join(line[cut:] for line in lines).strip("\n") + "\n"


# --- static analysis --------------------------------------------------------------------------------

ESCAPE_NAMES = frozenset(
    {
        "__import__", "eval", "exec", "compile", "open", "globals", "locals", "vars", "breakpoint", "input",
    }
)  # fmt: skip
# Module names that are an escape hatch even when used without an import (the sandbox has none of them).
ESCAPE_MODULES = frozenset(
    {
        "sys", "os", "gc", "inspect", "ctypes", "signal", "threading", "subprocess", "socket", "importlib",
        "builtins", "multiprocessing", "resource", "pickle", "marshal", "shutil", "pathlib", "io", "types",
        "weakref", "code", "codeop", "pty", "posix", "_thread", "asyncio", "concurrent", "mmap", "fcntl",
        "tempfile", "glob", "sysconfig", "site", "runpy", "traceback", "tracemalloc", "faulthandler",
    }
)  # fmt: skip
ATTRIBUTE_CALLS = frozenset({"getattr", "setattr", "delattr", "hasattr"})  # fine with a plain public name
ESCAPE_ATTRIBUTES = frozenset(
    {
        "f_back", "f_locals", "f_globals", "f_builtins", "f_code", "f_trace", "tb_frame", "tb_next",
        "gi_frame", "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code", "co_code", "co_consts",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Analysis:
    """What static analysis makes of one completion."""

    code: str | None  # None: nothing extracted
    parsed: bool  # the code parses and compiles
    one_function: bool  # only `def strategy(...)` at top level (imports and a docstring allowed)
    cheats: tuple[str, ...]  # escape hatches found, e.g. ("import os", "__subclasses__")


def is_forbidden_dunder(name: str) -> bool:
    return name.startswith("__") and name not in sandbox.SAFE_DUNDERS


def find_cheats(tree: ast.AST) -> list[str]:
    """Every import outside the sandbox's allowlist and every reach for an escape hatch."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] not in sandbox.ALLOWED_MODULES]
        elif isinstance(node, ast.ImportFrom):
            if node.level or (node.module or "").split(".")[0] not in sandbox.ALLOWED_MODULES:
                found.append(f"from {'.' * node.level}{node.module or ''} import")
        elif isinstance(node, ast.Name):
            if node.id in ESCAPE_NAMES or node.id in ESCAPE_MODULES or is_forbidden_dunder(node.id):
                found.append(node.id)
        elif isinstance(node, ast.Attribute):
            if is_forbidden_dunder(node.attr) or node.attr in ESCAPE_ATTRIBUTES:
                found.append(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_CALLS:
            name = node.args[1] if len(node.args) > 1 else None
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str) and not name.value.startswith("_")):
                found.append(f"{node.func.id} with a computed or private name")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.endswith("__") and is_forbidden_dunder(node.value):
                found.append(repr(node.value))  # a dunder name spelled as a string, for getattr & co.
    return sorted(set(found))


def is_one_function(tree: ast.Module) -> bool:
    body = list(tree.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # module docstring
    defs = [n for n in body if isinstance(n, ast.FunctionDef)]
    rest = [n for n in body if not isinstance(n, ast.FunctionDef | ast.Import | ast.ImportFrom)]
    if rest or len(defs) != 1 or defs[0].name != "strategy":
        return False
    args = defs[0].args
    return len(args.posonlyargs) + len(args.args) >= 1 or args.vararg is not None


@functools.lru_cache(maxsize=4096)
def _analyse_text(text: str) -> Analysis:
    code = extract_function(text)
    if code is None:
        return Analysis(None, False, False, ())
    try:
        tree = ast.parse(code)
        compile(tree, "<strategy>", "exec", dont_inherit=True)  # compile only: catches what parse lets by
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return Analysis(code, False, False, ())
    return Analysis(code, True, is_one_function(tree), tuple(find_cheats(tree)))


def analyse(completion) -> Analysis:
    return _analyse_text(completion_text(completion))


# --- scores -----------------------------------------------------------------------------------------

# Per-game scores for the graded profile (success scores 20; a finished game scores by its largest tile).
GRADED_TIMEOUT, GRADED_ERROR, GRADED_INVALID = -1.0, -3.0, -2.0
# The notebook's exact numbers.
NOTEBOOK_SUCCESS, NOTEBOOK_FAILED, NOTEBOOK_TIMEOUT, NOTEBOOK_ERROR = 20.0, 2.0, -1.0, -3.0


def graded_game_score(result, target: int) -> float:
    """20 for the target; else 20 * max tile / target: each doubling of the best tile doubles the score.

    Measured on 5x5/2048: a score linear in log2(max tile) gave random play 83% of the corner player's
    reward (random reaches 256-1024 there); this one gives it about a third (README, "Rewards").
    """
    if result.status == "success":
        return 20.0
    if result.status == "timeout":
        return GRADED_TIMEOUT
    if result.status in ("error", "crash"):
        return GRADED_ERROR
    if result.status == "invalid":
        return GRADED_INVALID
    return 20.0 * min(result.max_tile, target) / target


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


def game_seeds(settings: RewardSettings, step: int, call: int) -> list[int]:
    """Seeds for one reward call: shared by every completion of the call (so by every GRPO group),
    new at every step and every call within a step, the same on every process and after a resume."""
    digest = hashlib.sha256(f"train_2048/rewards/{settings.game_seed}/{step}/{call}".encode()).digest()
    base = int.from_bytes(digest[:6], "big")
    return [base + i for i in range(1 if settings.profile == "notebook" else settings.games)]


# --- the reward functions ---------------------------------------------------------------------------


def function_works(completions, **kwargs) -> list[float]:
    """+1 one loadable `strategy`; -0.5 parses but is not one function; -2 nothing extracted or a syntax error."""
    scores = []
    for completion in completions:
        a = analyse(completion)
        scores.append(1.0 if a.parsed and a.one_function else -0.5 if a.parsed else -2.0)
    return scores


def make_no_cheating(settings: RewardSettings):
    def no_cheating(completions, **kwargs) -> list[float]:
        """+1 clean; -20 an import outside the allowlist or an escape hatch; -1 nothing extracted.

        A syntax error cannot be judged: -1 in the graded profile, -20 in the notebook's.
        """
        scores = []
        for completion in completions:
            a = analyse(completion)
            if a.code is None:
                scores.append(-1.0)
            elif not a.parsed:
                scores.append(-20.0 if settings.profile == "notebook" else -1.0)
            else:
                scores.append(-20.0 if a.cheats else 1.0)
        return scores

    return no_cheating


_unlogged_metrics: dict[str, list[float]] = {}


def make_strategy_succeeds(settings: RewardSettings):
    calls_this_step = {}  # global_step -> reward calls so far; several per step with gradient accumulation

    def strategy_succeeds(completions, trainer_state=None, log_metric=None, **kwargs) -> list[float]:
        """Mean game score of each playable completion in the sandbox; 0 for code that is not played."""
        step = getattr(trainer_state, "global_step", 0) or 0
        call = calls_this_step.get(step, 0)
        calls_this_step.clear()
        calls_this_step[step] = call + 1
        seeds = game_seeds(settings, step, call)

        analyses = [analyse(c) for c in completions]
        playable = sorted({a.code for a in analyses if a.parsed and a.one_function and not a.cheats})
        jobs = [(code, settings.play_kwargs(seed)) for code in playable for seed in seeds]
        try:
            results = sandbox.play_many(jobs)
        except Exception as exc:  # the sandbox itself failed: score nothing rather than stop training
            print(f"rewards: sandbox failure, batch scored as not played: {type(exc).__name__}: {exc}")
            results = []
        by_code = {code: results[i * len(seeds) : (i + 1) * len(seeds)] for i, code in enumerate(playable)}

        scores, games = [], []
        for a in analyses:
            played = by_code.get(a.code) if a.parsed and a.one_function and not a.cheats else None
            if not played:
                scores.append(0.0)
                continue
            games.append(played)
            if settings.profile == "notebook":
                per_game = [notebook_game_score(r) for r in played]
            else:
                per_game = [graded_game_score(r, settings.target) for r in played]
            scores.append(sum(per_game) / len(per_game))

        metrics = batch_metrics(analyses, games)
        for name, value in metrics.items():
            if log_metric is not None:
                log_metric(name, value)
            else:
                _unlogged_metrics.setdefault(name, []).append(value)
        return scores

    return strategy_succeeds


def batch_metrics(analyses: list[Analysis], games: list[list]) -> dict[str, float]:
    """Game metrics of one reward call; each completion counts once, its games once each."""
    n = max(len(analyses), 1)
    flat = [r for played in games for r in played]
    metrics = {
        "game/unparseable_frac": sum(a.code is None or not a.parsed for a in analyses) / n,
        "game/cheat_frac": sum(bool(a.cheats) for a in analyses) / n,
        "game/timeout_frac": sum(any(r.status == "timeout" for r in p) for p in games) / n,
        "game/error_frac": sum(any(r.status in ("error", "crash", "invalid") for r in p) for p in games) / n,
    }
    if flat:
        metrics["game/win_rate"] = sum(r.status == "success" for r in flat) / len(flat)
        metrics["game/max_tile_log2"] = sum(math.log2(max(r.max_tile, 1)) for r in flat) / len(flat)
        metrics["game/moves"] = sum(r.moves for r in flat) / len(flat)
    return metrics


def pop_metrics() -> dict[str, float]:
    """Means of the metrics of calls made without TRL's `log_metric` (e.g. outside a trainer), then reset."""
    means = {k: sum(v) / len(v) for k, v in _unlogged_metrics.items() if v}
    _unlogged_metrics.clear()
    return means


def reward_functions(settings: RewardSettings | None = None) -> list:
    """[function_works, no_cheating, strategy_succeeds] for TRL's `reward_funcs`, configured by `settings`."""
    settings = settings or RewardSettings()
    return [function_works, make_no_cheating(settings), make_strategy_succeeds(settings)]


# Module-level versions with the default settings, for direct use.
no_cheating = make_no_cheating(RewardSettings())
strategy_succeeds = make_strategy_succeeds(RewardSettings())

# --- prompt and dataset -----------------------------------------------------------------------------

KEY_NAMES = ("up", "left", "down", "right")


def build_prompt(settings: RewardSettings | None = None) -> str:
    """Our wording of the notebook's contract, with this run's board, target and key alphabet."""
    s = settings or RewardSettings()
    keys = ", ".join(f'"{k}" ({name})' for k, name in zip(s.keys, KEY_NAMES))
    return (
        f"Write a Python strategy for the game 2048 on a {s.size}x{s.size} board; the goal is a {s.target} tile.\n"
        f"The function receives `board`, a list of {s.size} lists of {s.size} integers (0 is an empty cell), "
        f"and returns one move as a one-character string: {keys}.\n"
        "Use plain Python and only standard-library modules such as math, random, itertools or collections. "
        "Put every import and helper function inside the function.\n"
        "Answer with one Python code block:\n"
        "```python\ndef strategy(board):\n    ...\n```"
    )


def build_dataset(n: int, settings: RewardSettings | None = None, reasoning_effort: str = "low"):
    """n copies of the prompt as conversational rows; gpt-oss's chat template reads `reasoning_effort`."""
    from datasets import Dataset

    prompt = [{"role": "user", "content": build_prompt(settings)}]
    return Dataset.from_dict({"prompt": [prompt] * n, "reasoning_effort": [reasoning_effort] * n})
