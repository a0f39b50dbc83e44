"""The engine judge's anchors and costs (docs/chess-eval.md's tables).

    python bench/chess_engine.py                 # 100 positions, judge at depth 12 (~5 min on 2 cores)
    python bench/chess_engine.py --positions 30  # a quick look

Anchors: on the same positions (seeded plies of the engine self-play games shipped for the
demo, `fsdp_utils/chess_eval/engine_games/`, none of them over), each mover plays one move and
the judge (`EngineJudge`, Threads=1, hash cleared, fixed depth) scores it: mean centipawn loss,
Lichess accuracy, best-move rate, blunder rate. Movers: a uniformly random legal move (seeded),
Stockfish at Skill Level 0, at UCI_Elo 1350 (its minimum in 15.1) and at Skill Level 5, each
with 10 ms a move; at depth 1; and at full strength with 10 ms a move and at depth 8. The time
limits make their rows move with the machine's load (10 ms of a busy core is a shallower
search); the depth rows do not.

Costs: judged moves per second at depths 8, 10 (the default) and 12 (a move that is not the
engine's best takes two searches), and self-play games per minute on one process at depth 1 and
at 5 ms a move. The load average is printed beside them: on a shared machine the speeds move
with it. Results: bench/results/chess_engine.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import chess
import chess.engine

from fsdp_utils.chess_eval.judge import EngineJudge, engine_version, find_engine
from fsdp_utils.chess_eval.selfplay import self_play
from fsdp_utils.demo import engine_games

RESULTS = Path(__file__).resolve().parent / "results"
MOVERS: dict[str, tuple[dict, chess.engine.Limit | None]] = {
    "random legal move": ({}, None),
    "Skill Level 0, 10 ms": ({"Skill Level": 0}, chess.engine.Limit(time=0.01)),
    "UCI_Elo 1350, 10 ms": (
        {"UCI_LimitStrength": True, "UCI_Elo": 1350},
        chess.engine.Limit(time=0.01),
    ),
    "Skill Level 5, 10 ms": ({"Skill Level": 5}, chess.engine.Limit(time=0.01)),
    "depth 1": ({}, chess.engine.Limit(depth=1)),
    "full strength, 10 ms": ({}, chess.engine.Limit(time=0.01)),
    "full strength, depth 8": ({}, chess.engine.Limit(depth=8)),
}


def positions(n: int, seed: int) -> list[chess.Board]:
    rng = random.Random(seed)
    games = engine_games()
    boards: list[chess.Board] = []
    while len(boards) < n:
        moves = rng.choice(games)["Moves"]
        board = chess.Board()
        for uci in moves[: rng.randrange(len(moves))]:
            board.push_uci(uci)
        if not board.is_game_over():
            boards.append(board)
    return boards


def anchors(boards: list[chess.Board], depth: int, seed: int) -> dict[str, dict[str, float]]:
    path = find_engine()
    rows = {}
    with EngineJudge(path=path, depth=depth) as judge:
        for name, (options, limit) in MOVERS.items():
            rng = random.Random(seed)
            engine = None
            if limit is not None:
                engine = chess.engine.SimpleEngine.popen_uci(path)
                engine.configure({"Threads": 1, "Hash": 16, **options})
            try:
                verdicts = []
                for board in boards:
                    if engine is None or limit is None:
                        move = rng.choice(sorted(board.legal_moves, key=lambda m: m.uci()))
                    else:
                        played = engine.play(board, limit, game=object()).move
                        assert played is not None
                        move = played
                    verdicts.append(judge.judge_move(board, move))
            finally:
                if engine is not None:
                    engine.quit()
            losses = [v.cp_loss for v in verdicts]
            rows[name] = {
                "centipawn_loss": statistics.mean(losses),
                "centipawn_loss_se": statistics.stdev(losses) / len(losses) ** 0.5,
                "accuracy": statistics.mean(v.accuracy for v in verdicts),
                "best_move_rate": statistics.mean(v.is_best for v in verdicts),
                "blunder_rate": statistics.mean(v.judgement == "blunder" for v in verdicts),
            }
            print(
                f"  {name:<22} {rows[name]['centipawn_loss']:6.0f} cp  {rows[name]['accuracy']:5.1f}%",
                flush=True,
            )
    return rows


def judge_speed(boards: list[chess.Board], depth: int) -> float:
    """Judged moves per second: the first legal move that is not the best (two searches)."""
    with EngineJudge(depth=depth, cache_size=0) as judge:
        started = time.perf_counter()
        for board in boards:
            judge.judge_move(board, sorted(board.legal_moves, key=lambda m: m.uci())[0])
        return len(boards) / (time.perf_counter() - started)


def selfplay_speed(games: int, *, depth: int | None, movetime: float | None) -> float:
    started = time.perf_counter()
    if movetime is None:
        for _ in self_play(games, depth=depth):
            pass
    else:  # a time per move, as the issue measured it: python-chess's play with a time limit
        engine = chess.engine.SimpleEngine.popen_uci(find_engine())
        try:
            for i in range(games):
                rng = random.Random(f"0/{i}")
                board = chess.Board()
                for _ in range(rng.randint(4, 8)):
                    board.push(rng.choice(sorted(board.legal_moves, key=lambda m: m.uci())))
                while board.outcome(claim_draw=True) is None:
                    move = engine.play(board, chess.engine.Limit(time=movetime)).move
                    assert move is not None
                    board.push(move)
        finally:
            engine.quit()
    return 60 * games / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--positions", type=int, default=100)
    parser.add_argument("--judge_depth", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    boards = positions(args.positions, args.seed)
    version = engine_version()
    print(
        f"{version}; {len(boards)} positions; judge depth {args.judge_depth}; load {os.getloadavg()[0]:.1f}"
    )
    rows = anchors(boards, args.judge_depth, args.seed)
    speed = {f"judged_moves_per_s_depth_{d}": judge_speed(boards[:40], d) for d in (8, 10, 12)}
    speed["selfplay_games_per_min_depth_1"] = selfplay_speed(10, depth=1, movetime=None)
    speed["selfplay_games_per_min_5ms"] = selfplay_speed(5, depth=None, movetime=0.005)
    load = os.getloadavg()[0]
    result = {"engine": version, "positions": len(boards), "judge_depth": args.judge_depth,
              "anchors": rows, "costs": speed, "load_average": load}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "chess_engine.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        "\n| mover | centipawn loss (± s.e.) | accuracy | best move | blunders |\n|---|---|---|---|---|"
    )
    for name, r in rows.items():
        print(f"| {name} | {r['centipawn_loss']:.0f} ± {r['centipawn_loss_se']:.0f} | "
              f"{r['accuracy']:.1f}% | {r['best_move_rate']:.0%} | {r['blunder_rate']:.0%} |")  # fmt: skip
    print("\n| cost | value |\n|---|---|")
    for name, value in speed.items():
        print(f"| {name} | {value:.1f} |")
    print(f"\n(load average {load:.1f} at the end; results in {RESULTS / 'chess_engine.json'})")


if __name__ == "__main__":
    main()
