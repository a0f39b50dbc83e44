"""Engine games as data: Stockfish plays itself from varied openings, written in the schema of
laion/strategic_game_chess (`Moves`, `Termination`, `Result`; parquet shards), which is itself
Stockfish playing itself.

    python -m fsdp_utils.chess_eval.selfplay --games 2000 --output data/engine_games \\
        --processes 4 --depth 1 --seed 0

Game i opens with 4 to 8 uniformly random legal plies drawn from its own seed (`seed/i`), then
the engine plays both sides at a fixed depth (or node limit) with Threads=1 and its hash cleared
before every move, so a game depends only on (seed, i, limit) and the engine's version: one
process or eight write the same games, in the same order. A game ends where python-chess says
it is over, claimable draws (threefold repetition, 50 moves) claimed at once.

The work is spread over `--processes` processes, each with its own engine. Depth 1 plays about
100 games a minute per process on a busy 2-core machine (about 90 plies a game); `make demo`
trains on 1,500 such games.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import chess
import chess.engine

from fsdp_utils.arguments import ArgumentParser
from fsdp_utils.chess_eval.judge import (
    EngineFailed,
    choose_engine,
    close_engine,
    engine_version,
    find_engine,
    guarded,
    open_engine,
)
from fsdp_utils.data.chess_files import write_chess_shards

OPENING_PLIES = (4, 8)


def opening(rng: random.Random) -> chess.Board:
    """4-8 random legal plies (never a finished game: it is drawn again)."""
    while True:
        board = chess.Board()
        for _ in range(rng.randint(*OPENING_PLIES)):
            board.push(rng.choice(sorted(board.legal_moves, key=lambda m: m.uci())))
            if board.is_game_over():
                break
        if not board.is_game_over():
            return board


def play_game(
    engine: chess.engine.SimpleEngine, index: int, *, seed: int, limit: chess.engine.Limit
) -> dict[str, Any]:
    board = opening(random.Random(f"{seed}/{index}"))
    while (outcome := board.outcome(claim_draw=True)) is None:
        result = guarded(engine, 60.0, lambda: engine.play(board, limit, game=object()))
        assert result.move is not None
        board.push(result.move)
    return {
        "Moves": [m.uci() for m in board.move_stack],
        "Termination": outcome.termination.name,
        "Result": outcome.result(),
    }


def play_range(
    path: str, first: int, stop: int, seed: int, depth: int | None, nodes: int | None
) -> list[dict[str, Any]]:
    """Games first..stop-1 on one engine of this process's own (ended on every way out)."""
    engine = open_engine(path, {"Threads": 1, "Hash": 16})
    try:
        limit = chess.engine.Limit(depth=depth, nodes=nodes)
        return [play_game(engine, i, seed=seed, limit=limit) for i in range(first, stop)]
    finally:
        close_engine(engine)


def self_play(
    games: int,
    *,
    seed: int = 0,
    depth: int | None = 1,
    nodes: int | None = None,
    processes: int = 1,
    path: str | None = None,
) -> list[dict[str, Any]]:
    """`games` engine games, in order, played on `processes` processes."""
    engine = find_engine(path)
    if processes <= 1:
        return play_range(engine, 0, games, seed, depth, nodes)
    # Small chunks in order, so that every process stays busy to the end.
    chunk = max(1, min(25, games // (4 * processes)))
    starts = list(range(0, games, chunk))
    stops = [min(s + chunk, games) for s in starts]
    n = len(starts)
    with ProcessPoolExecutor(max_workers=processes) as pool:
        parts = pool.map(
            play_range, [engine] * n, starts, stops, [seed] * n, [depth] * n, [nodes] * n
        )
        return [game for part in parts for game in part]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m fsdp_utils.chess_eval.selfplay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--games", type=int, required=True)
    parser.add_argument("--output", type=Path, required=True, help="folder for the shards")
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--depth", type=int, help="search depth per move (default 1)")
    limit.add_argument("--nodes", type=int, help="node limit per move instead")
    parser.add_argument("--chess_engine", metavar="PATH", help="the Stockfish binary")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    depth = None if args.nodes else (args.depth or 1)
    try:
        path = choose_engine(args.chess_engine or "on")  # a path given must be a UCI engine
        assert path is not None
        version = engine_version(path)
        started = time.perf_counter()
        games = self_play(
            args.games, seed=args.seed, depth=depth, nodes=args.nodes,
            processes=args.processes, path=path,
        )  # fmt: skip
    except ValueError as err:  # EngineNotFound: how to install one
        print(f"\nerror: {err}\n", file=sys.stderr)
        return 2
    except EngineFailed as err:
        print(f"\nerror: {err}\n", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - started
    shards = write_chess_shards(games, args.output, num_shards=args.shards)
    limit = f"--depth {depth}" if depth else f"--nodes {args.nodes}"
    made = {
        "games": args.games, "seed": args.seed, "depth": depth, "nodes": args.nodes,
        "engine": version, "opening_plies": list(OPENING_PLIES),
        "command": f"python -m fsdp_utils.chess_eval.selfplay --games {args.games} --seed "
        f"{args.seed} {limit} --output {args.output}",
    }  # fmt: skip
    (args.output / "selfplay.json").write_text(json.dumps(made, indent=2) + "\n")
    plies = sum(len(g["Moves"]) for g in games)
    print(
        f"selfplay: {len(games)} games ({plies / len(games):.0f} plies on average) by {version} "
        f"at {'depth ' + str(depth) if depth else str(args.nodes) + ' nodes'} in {seconds:.0f}s "
        f"on {args.processes} process(es) ({60 * len(games) / seconds:.0f} games/minute) -> "
        + ", ".join(str(s) for s in shards)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
