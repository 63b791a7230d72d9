"""Which board and per-game score keep board-blind play from earning the reward (issue 12), measured.

A player that never looks at the board (random keys, any fixed cycle of keys) must score at most about
half of a depth-2/3 expectimax search and less than a 1-ply greedy; random < greedy ~ corner < search,
each gap wider than the spread of one reward call (the mean of K games); and the score must keep rising
with stronger play. Each player plays each board size once per seed (0..n-1), to the highest target a
candidate needs; the game's state (moves, max tile, tile sum, points) is recorded at every move cap and
when it first makes each target tile, so one set of games scores every candidate (board, target,
per-game score, move cap). Cycles of 5-6 keys and weighted random keys are screened on other seeds
(1000000+) first, and the best few are played in full, so picking them does not flatter their numbers.

    nice -n 10 .venv/bin/python bench/reward_table.py --workers 2 > bench/reward_table.out.txt
"""

import argparse
import functools
import itertools
import math
import random
import statistics
import sys
import time
from collections import namedtuple
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import game2048  # noqa: E402
import strategies  # noqa: E402

NO_TARGET = 1 << 17  # out of reach on these boards: the game runs until no move is left
TILE_MARKS = (256, 512, 1024, 2048, 4096)  # first time the max tile reaches each: a target's win
CAPS = (100, 150, 200, 300, 400, 500, 750, 1000, 1250, 1500, 2000, 2500, 3000)
BOARDS = ((3, 256), (3, 512), (4, 1024), (4, 2048), (4, 4096), (5, 2048))  # (size, target) candidates
PRIMARY = {3: 512, 4: 2048, 5: 2048}  # the board the screen ranks its players on
SCREEN_SEED = 1_000_000
SEARCH = ("expectimax d2", "expectimax d3", "expectimax")
HEURISTICS = ("greedy", "corner")
NAMED_BLIND = ("random", "cycle WASD", "corner spin SASD")  # strategies.BOARD_BLIND, always shown
WEIGHTED = ("AS", "AAS", "AASSD", "AASSDW", "AAASSSD", "AAASSSDW", "AASD", "ASSD")  # random.choice over these
# Where a player's games stop: searches are slow, so they stop at the highest target a candidate needs.
STOP = {
    "expectimax": {3: NO_TARGET, 4: 4096, 5: 2048},
    "expectimax d2": {3: NO_TARGET, 4: 4096, 5: 2048},
    "expectimax d3": {3: NO_TARGET, 4: 2048, 5: 2048},
}
EXPECTIMAX_DEPTH_LINE = "depth, cap = (1, 0) if free > 12 else (2, 4) if free > 4 else (3, 4)"

State = namedtuple("State", "moves max_tile tile_sum points")


# --- players ----------------------------------------------------------------------------------------


def necklaces(length: int) -> list[str]:
    """Every key cycle of this length up to rotation, written from its smallest rotation; no repeats of a shorter one."""
    found = []
    for keys in map("".join, itertools.product("ADSW", repeat=length)):
        if any(keys == keys[:d] * (length // d) for d in range(1, length) if length % d == 0):
            continue
        if keys == min(keys[i:] + keys[:i] for i in range(length)):
            found.append(keys)
    return found


@functools.cache
def fixed_depth_expectimax(depth: int):
    """The expectimax baseline searching `depth` own moves everywhere (the baseline adapts 1-3 to the board)."""
    code = strategies.source("expectimax")
    if EXPECTIMAX_DEPTH_LINE not in code:
        raise RuntimeError("expectimax_strategy's depth line changed: update EXPECTIMAX_DEPTH_LINE")
    namespace = {"__builtins__": __builtins__}
    exec(code.replace(EXPECTIMAX_DEPTH_LINE, f"depth, cap = ({depth}, 4)"), namespace)
    return namespace["strategy"]


def make_player(name: str):
    """A fresh player for one game, so a cycle's place never carries over from the last game."""
    if name == "cycle WASD":
        return strategies.load("cycle")
    if name == "corner spin SASD":
        return strategies.load("corner_spin")
    if name.startswith("expectimax d"):
        return fixed_depth_expectimax(int(name.removeprefix("expectimax d")))
    kind, _, keys = name.partition(" ")
    if kind == "cycle":
        cycle = itertools.cycle(keys)
        return lambda board: next(cycle)
    if kind == "weighted":
        return lambda board: random.choice(keys)  # play_game seeds `random` per game
    return strategies.BASELINES[name]


def is_blind(name: str) -> bool:
    return name in NAMED_BLIND or name.startswith(("cycle ", "weighted "))


def stop_of(name: str, size: int) -> int:
    """The target a player's games stopped at: a candidate with a higher target cannot score them."""
    return STOP.get(name, {}).get(size, NO_TARGET)


# --- games ------------------------------------------------------------------------------------------


def state_of(board, moves: int) -> State:
    """The state a capped game is scored by. Points come from the board: building a tile v from 2s earns
    v * (log2 v - 1), and each spawned 4 earned nothing for its 4; the spawns' count gives the 4s."""
    tiles = [v for row in board for v in row if v]
    tile_sum = sum(tiles)
    fours = (tile_sum - 2 * (moves + 2)) // 2  # moves + 2 spawns, each a 2 or a 4
    points = sum(v * (v.bit_length() - 2) for v in tiles) - 4 * fours
    return State(moves, max(tiles), tile_sum, points)


def play_recorded(name: str, size: int, seed: int, stop: int):
    """One game through game2048.play_game, watching the boards the player is shown.

    A board that differs from the last one shown means a move happened (a move that changes nothing
    spawns nothing), so the watcher knows the move count and snapshots the state at each cap and at
    each first target tile. Returns (final state, {cap: state}, {tile: state}, seconds).
    """
    player = make_player(name)
    caps, tiles = {}, {}
    pending_caps = list(CAPS)
    pending_tiles = [t for t in TILE_MARKS if t < stop]  # reaching `stop` ends the game: its final state
    last, moves = None, 0

    def watched(board):
        nonlocal last, moves
        if board != last:
            if last is not None:
                moves += 1
                if pending_caps and moves == pending_caps[0]:
                    caps[pending_caps.pop(0)] = state_of(board, moves)
                if pending_tiles and max(map(max, board)) >= pending_tiles[0]:
                    tiles[pending_tiles.pop(0)] = state_of(board, moves)
            last = board
        return player(board)

    start = time.perf_counter()
    game = game2048.play_game(watched, seed=seed, size=size, target=stop)
    seconds = time.perf_counter() - start
    final = state_of(game.board(), game.moves)
    if final.points != game.score() or game.moves - moves not in (0, 1):  # the last move may go unseen
        raise AssertionError(f"{name} seed {seed}: recorded state {final} disagrees with the game")
    return final, caps, tiles, seconds


def play_job(job):
    """A worker's job: (player, size, seeds, stop) -> [(player, size, seed, game record), ...]."""
    name, size, seeds, stop = job
    return [(name, size, seed, play_recorded(name, size, seed, stop)) for seed in seeds]


def run_jobs(pool, players, sizes, counts, first_seed=0):
    """Play players x sizes; slow players one game per job, the longest first so the workers end together."""
    jobs = []
    for size in sizes:
        for name in players[size]:
            stop = stop_of(name, size)
            seeds = range(first_seed, first_seed + counts(name, size))
            if name in SEARCH:
                jobs += [(name, size, [s], stop) for s in seeds]
            else:
                jobs += [(name, size, list(seeds[i : i + 25]), stop) for i in range(0, len(seeds), 25)]
    expected_cost = {"expectimax d3": 4, "expectimax": 3, "expectimax d2": 2}
    jobs.sort(key=lambda job: (-expected_cost.get(job[0], 0), -job[1]))
    games = {}
    for done in pool.imap_unordered(play_job, jobs):
        for name, size, seed, record in done:
            games.setdefault((name, size), []).append((seed, record))
    return {key: [record for _, record in sorted(records)] for key, records in games.items()}


# --- scoring ----------------------------------------------------------------------------------------


def outcome(record, target: int, cap: float):
    """(state it is scored by, won) for a game on this target with this move cap, or None if not played that far."""
    final, caps, tiles, _ = record
    reached = tiles.get(target) or (final if final.max_tile >= target else None)
    if reached is not None and reached.moves <= cap:
        return reached, True
    if final.moves <= cap:
        return final, False
    return caps[cap], False


def tile_ratio(s: State, target: int) -> float:
    """(a) today's: doubles with each doubling of the max tile."""
    return 20 * s.max_tile / target


def log_tile(s: State, target: int) -> float:
    """(b) linear in log2(max tile)."""
    return 20 * math.log2(s.max_tile) / math.log2(target)


def game_points(s: State, target: int) -> float:
    """(c) the game's score over (log2 target - 1) * target, the points of building the target from 2s."""
    return 20 * s.points / ((math.log2(target) - 1) * target)


def log_progress(s: State, target: int) -> float:
    """(d) log2(max tile) plus the share of the next tile the rest of the board already holds."""
    rest = (s.tile_sum - s.max_tile) / s.max_tile
    return 20 * (math.log2(s.max_tile) + min(1.0, rest)) / math.log2(target)


def tile_progress(s: State, target: int) -> float:
    """(e) (d) on the tile scale: max tile + the rest of the board up to one more max tile = min(sum, 2 * max)."""
    return 20 * min(s.tile_sum, 2 * s.max_tile) / target


def tile_squared(s: State, target: int) -> float:
    """(f) (max tile / target) squared: each doubling quadruples."""
    return 20 * (s.max_tile / target) ** 2


SCORES = {
    "tile": tile_ratio,
    "log tile": log_tile,
    "points": game_points,
    "log progress": log_progress,
    "tile+progress": tile_progress,
    "tile^2": tile_squared,
}


def summarise(records, stop: int, target: int, cap: float, score) -> dict | None:
    """One player on one candidate: the per-game scores (20 for a win, else the score capped at 20) and the play."""
    if not records or stop < target:
        return None
    outcomes = [outcome(r, target, cap) for r in records]
    scores = [20.0 if won else min(20.0, score(s, target)) for s, won in outcomes]
    sd = statistics.stdev(scores) if len(scores) > 1 else 0.0
    wins = [s.moves for s, won in outcomes if won]
    moves = [s.moves for s, _ in outcomes]
    return {
        "games": len(scores),
        "win": sum(won for _, won in outcomes) / len(scores),
        "tile": statistics.median(s.max_tile for s, _ in outcomes),
        "moves": statistics.median(moves),
        "p90 moves": statistics.quantiles(moves, n=10, method="inclusive")[-1] if len(moves) > 1 else moves[0],
        "max moves": max(moves),
        "max moves to win": max(wins) if wins else 0,
        "seconds": statistics.mean(r[3] for r in records),
        "mean": statistics.mean(scores),
        "sd": sd,
        "sd4": sd / 2,
        "sd8": sd / math.sqrt(8),
    }


def evaluate(games, players, size: int, target: int, cap: float, score) -> dict:
    """Every player on one candidate, plus the reference rows the criteria use."""
    rows = {}
    for name in players:
        row = summarise(games[(name, size)], stop_of(name, size), target, cap, score)
        if row is not None:
            rows[name] = row
    return rows


def criteria(rows: dict) -> dict:
    """The issue's criteria on one candidate; `search` is the weaker of the fixed-depth searches."""
    blind = {n: r for n, r in rows.items() if is_blind(n)}
    best_blind = max(blind, key=lambda n: blind[n]["mean"])
    searches = [n for n in ("expectimax d2", "expectimax d3") if n in rows] or ["expectimax"]
    search = min(searches, key=lambda n: rows[n]["mean"])
    b, s = blind[best_blind]["mean"], rows[search]["mean"]
    greedy, corner, rand = rows["greedy"], rows["corner"], rows["random"]
    low, high = min(greedy["mean"], corner["mean"]), max(greedy["mean"], corner["mean"])
    strongest = max(rows[n]["mean"] for n in SEARCH if n in rows)
    result = {
        "best blind": best_blind,
        "search": search,
        "ratio": b / s if s else math.inf,
        "ratio total": (b + 2) / (s + 2),
        "half": b <= 0.5 * s,
        "below greedy": b < greedy["mean"],
        "rising": rand["mean"] < low and high < s and high <= 10 and strongest <= 19,
    }
    for k in ("sd4", "sd8"):
        spread_low = max(rand[k], greedy[k], corner[k])
        spread_high = max(greedy[k], corner[k], rows[search][k])
        result[f"ladder {k}"] = low - rand["mean"] > spread_low and s - high > spread_high
    result["all K4"] = all(result[c] for c in ("half", "below greedy", "rising", "ladder sd4"))
    result["all K8"] = all(result[c] for c in ("half", "below greedy", "rising", "ladder sd8"))
    return result


def suggested_cap(games, size: int, target: int) -> float:
    """The smallest listed cap at least 1.25x the most moves any search needed to win: it never binds them."""
    needed = [
        s.moves
        for name in SEARCH
        if (name, size) in games and stop_of(name, size) >= target
        for s, won in (outcome(r, target, math.inf) for r in games[(name, size)])
        if won
    ]
    if not needed:
        return math.inf
    return next((c for c in CAPS if c >= 1.25 * max(needed)), math.inf)


# --- printing ---------------------------------------------------------------------------------------


def table(header, rows) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    print()


def cap_name(cap: float) -> str:
    return "none" if cap == math.inf else str(cap)


def yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


def shown_players(rows: dict) -> list[str]:
    """The rows a reader needs: the named blind players, the best other blind one, and every board-aware player."""
    blind_best = max((n for n in rows if is_blind(n) and n not in NAMED_BLIND), key=lambda n: rows[n]["mean"])
    return [*NAMED_BLIND, blind_best, *HEURISTICS, *(n for n in SEARCH if n in rows)]


def print_board(games, players, size: int, target: int, cap: float) -> list:
    """Play table and per-score tables for one board and cap; returns its criteria rows for the summary."""
    print(f"### {size}x{size}, target {target}, move cap {cap_name(cap)}\n")
    play = evaluate(games, players[size], size, target, cap, tile_ratio)
    header = ["player", "games", "win", "median tile", "median moves", "p90 moves", "max moves"]
    header += ["max moves to win", "s/game"]
    table(
        header,
        [
            [n, r["games"], f"{100 * r['win']:.1f}%", f"{r['tile']:g}", f"{r['moves']:g}", f"{r['p90 moves']:.0f}"]
            + [r["max moves"], r["max moves to win"] or "-", f"{r['seconds']:.2f}"]
            for n, r in ((n, play[n]) for n in shown_players(play))
        ],
    )
    summary = []
    for score_name, score in SCORES.items():
        rows = evaluate(games, players[size], size, target, cap, score)
        c = criteria(rows)
        search_mean = rows[c["search"]]["mean"]
        print(f"**{score_name}** ({score.__doc__.strip()}); best board-blind: {c['best blind']}\n")
        shown = shown_players(rows)
        if c["best blind"] not in shown:
            shown.insert(len(NAMED_BLIND) + 1, c["best blind"])
        table(
            ["player", "mean", "sd/game", "±K=4", "±K=8", "/ search", "total / search total"],
            [
                [n, f"{r['mean']:.2f}", f"{r['sd']:.2f}", f"{r['sd4']:.2f}", f"{r['sd8']:.2f}"]
                + [f"{r['mean'] / search_mean:.2f}", f"{(r['mean'] + 2) / (search_mean + 2):.2f}"]
                for n, r in ((n, rows[n]) for n in shown)
            ],
        )
        summary.append((f"{size}x{size}/{target}", cap_name(cap), score_name, c, rows))
    return summary


def print_summary(summary) -> None:
    header = ["board", "cap", "score", "best blind", "blind / search", "total ratio", "≤ ½", "blind < greedy"]
    header += ["ladder K=4", "ladder K=8", "rising", "ALL (K=4)", "ALL (K=8)"]
    rows = []
    for board, cap, score_name, c, _ in summary:
        rows.append(
            [board, cap, score_name, c["best blind"], f"{c['ratio']:.2f} ({c['search']})", f"{c['ratio total']:.2f}"]
            + [yes(c["half"]), yes(c["below greedy"]), yes(c["ladder sd4"]), yes(c["ladder sd8"]), yes(c["rising"])]
            + [yes(c["all K4"]), yes(c["all K8"])]
        )
    table(header, rows)


def print_compact(summary) -> None:
    """mean ±K=4/±K=8 per player, one column per score: the table to read first."""
    boards = list(dict.fromkeys((board, cap) for board, cap, *_ in summary))
    for board, cap in boards:
        parts = [(score_name, rows) for b, c_, score_name, _, rows in summary if (b, c_) == (board, cap)]
        names = []
        for _, rows in parts:
            names += [n for n in shown_players(rows) if n not in names]
        print(f"**{board}, cap {cap}**: mean ±sd(K=4)/±sd(K=8), win rate, median tile (uncapped score: tile)\n")
        table(
            ["player", "win", "median tile", *(s for s, _ in parts)],
            [
                [n, f"{100 * parts[0][1][n]['win']:.0f}%", f"{parts[0][1][n]['tile']:g}"]
                + [f"{rows[n]['mean']:.2f} ±{rows[n]['sd4']:.2f}/{rows[n]['sd8']:.2f}" for _, rows in parts]
                for n in names
            ],
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--games", type=int, default=200, help="games per board-blind, greedy and corner player")
    parser.add_argument("--expectimax-games", type=int, default=32, help="the adaptive baseline, 4x4 and 5x5")
    parser.add_argument("--d2-games", type=int, default=100, help="fixed depth 2, 4x4 and 5x5")
    parser.add_argument("--d3-games", type=int, default=24, help="fixed depth 3 on 4x4 (~20 ms a move)")
    parser.add_argument("--d3-games-5x5", type=int, default=8, help="fixed depth 3 on 5x5 (~40 ms a move)")
    parser.add_argument("--search-games-3x3", type=int, default=100, help="each search on 3x3 (short games)")
    parser.add_argument("--screen-games", type=int, default=30, help="games per screened player")
    parser.add_argument("--screen-length", type=int, default=6, help="longest key cycle screened")
    parser.add_argument("--promote", type=int, default=2, help="screened players promoted per size and score")
    parser.add_argument("--sizes", type=int, nargs="+", default=[3, 4, 5])
    args = parser.parse_args()

    def counts(name, size):
        if name in SEARCH and size == 3:
            return args.search_games_3x3
        if name == "expectimax d3":
            return args.d3_games_5x5 if size == 5 else args.d3_games
        return {"expectimax": args.expectimax_games, "expectimax d2": args.d2_games}.get(name, args.games)

    short_cycles = [f"cycle {k}" for length in range(1, 5) for k in necklaces(length)]
    screened = [f"cycle {k}" for length in range(5, args.screen_length + 1) for k in necklaces(length)]
    screened += [f"weighted {keys}" for keys in WEIGHTED]
    start = time.perf_counter()
    with Pool(args.workers) as pool:
        screen = run_jobs(
            pool, {s: screened for s in args.sizes}, args.sizes, lambda n, s: args.screen_games, SCREEN_SEED
        )
        screen_wall = time.perf_counter() - start
        promoted = {size: [] for size in args.sizes}
        for size in args.sizes:
            for score in SCORES.values():
                means = {
                    n: summarise(screen[(n, size)], NO_TARGET, PRIMARY[size], math.inf, score)["mean"] for n in screened
                }
                best = sorted(means, key=means.get, reverse=True)[: args.promote]
                promoted[size] += [n for n in best if n not in promoted[size]]
        players = {s: [*NAMED_BLIND, *short_cycles, *promoted[s], *HEURISTICS, *SEARCH] for s in args.sizes}
        games = run_jobs(pool, players, args.sizes, counts)
    wall = time.perf_counter() - start

    print("# Reward candidates: board-blind play vs. heuristics vs. search\n")
    print(f"Wall time {wall / 60:.1f} min on {args.workers} workers (screen {screen_wall / 60:.1f} min). Seeds 0..n-1.")
    print(f"Games per player: board-blind, greedy, corner {args.games}; expectimax (adaptive) {args.expectimax_games},")
    print(f"depth 2 {args.d2_games}, depth 3 {args.d3_games} (5x5: {args.d3_games_5x5}); every search on 3x3:")
    print(f"{args.search_games_3x3}. Board-blind: random, the {len(short_cycles)} key cycles of length 1-4 (up to")
    print(f"rotation), and {sum(len(p) for p in promoted.values())} promoted from a screen of {len(screened)} (cycles")
    print(
        f"of 5-{args.screen_length} keys, weighted random keys; {args.screen_games} games each on seeds {SCREEN_SEED}+):"
    )
    for size in args.sizes:
        print(f"{size}x{size}: {', '.join(promoted[size])}.")
    print("Searches stop at: " + "; ".join(f"{n} {STOP[n]}" for n in SEARCH) + f" ({NO_TARGET} = no target).")
    print("A game scores 20 when it reaches the target, else min(20, score). 'search' in the ratios is the weaker")
    print("of fixed depth 2 and 3; 'ladder' = random < greedy,corner < search with each gap above the larger per-call")
    print("sd (sd/game / sqrt(K)) of the players on either side; 'rising' = that order in means, greedy and corner")
    print("≤ 10 (half the ceiling) and the strongest search ≤ 19 (room left to climb). The best blind player is the")
    print(
        "best of ~100 on the same seeds, so it is slightly flattered (selection), which only makes the test harder.\n"
    )

    summary = []
    caps = {}
    for size, target in BOARDS:
        if size in args.sizes:
            caps[(size, target)] = suggested_cap(games, size, target)
    print("## Uncapped\n")
    for size, target in BOARDS:
        if size in args.sizes:
            summary += print_board(games, players, size, target, math.inf)
    print("## With the suggested move cap (smallest listed cap ≥ 1.25x the most moves any search needed to win)\n")
    for size, target in BOARDS:
        if size in args.sizes and caps[(size, target)] != math.inf:
            summary += print_board(games, players, size, target, caps[(size, target)])

    print("## Move caps\n")
    rows = []
    for size, target in BOARDS:
        if size not in args.sizes:
            continue
        play = {n: summarise(games[(n, size)], stop_of(n, size), target, math.inf, tile_ratio) for n in players[size]}
        blind_moves = max(r["max moves"] for n, r in play.items() if r and is_blind(n))
        rows.append(
            [f"{size}x{size}/{target}", cap_name(caps[(size, target)])]
            + [f"{play[n]['max moves to win'] or '-'}" if play[n] else "n/a" for n in SEARCH]
            + [f"{play[n]['max moves']}" if play[n] else "n/a" for n in (*HEURISTICS, *SEARCH)]
            + [blind_moves]
        )
    header = ["board", "suggested cap", *(f"{n}: max moves to win" for n in SEARCH)]
    header += [f"{n}: max moves" for n in (*HEURISTICS, *SEARCH)] + ["board-blind: max moves"]
    table(header, rows)

    print("## Top board-blind players per size (primary board, uncapped)\n")
    for size in args.sizes:
        blind = [n for n in players[size] if is_blind(n)]
        for score_name, score in SCORES.items():
            means = {n: summarise(games[(n, size)], NO_TARGET, PRIMARY[size], math.inf, score)["mean"] for n in blind}
            best = sorted(means, key=means.get, reverse=True)[:6]
            print(f"{size}x{size}/{PRIMARY[size]} {score_name}: " + ", ".join(f"{n} {means[n]:.2f}" for n in best))
        print()

    print("## Compact: per candidate\n")
    print_compact(summary)
    print("## Criteria, every candidate\n")
    print_summary(summary)


if __name__ == "__main__":
    main()
