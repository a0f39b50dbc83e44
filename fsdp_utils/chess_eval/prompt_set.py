"""Prompts for reinforcement learning on chess: positions from games, rendered in the run's
template, for `--method grpo` with the chess rewards (fsdp_utils/chess_eval/rewards.py).

    python -m fsdp_utils.chess_eval.prompt_set GAMES OUT.jsonl [--per_game 2] [--template T]

GAMES is a folder (or file) of games in the laion/strategic_game_chess schema (Moves,
Termination, Result; parquet, jsonl, ...), as the SFT run trained on. Each game gives
`--per_game` positions after a number of plies drawn from (seed, game) (at most `--max_plies`:
prompts must leave --max_completion_length tokens in --max_seq_length), before its last move;
each line of OUT.jsonl holds:

    prompt      the template up to {moves}, then the moves so far, trailing space removed: the
                model writes the space and the next move, as it learned in the SFT run
    moves       the moves so far (UCI), fen: the position, next_move: the game's own move

(the columns the chess rewards read: `fen` or `moves`; the others are handed to any reward).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fsdp_utils.chess_eval.games import render_prompt
from fsdp_utils.chess_eval.referee import board_after
from fsdp_utils.config.train_config import DEFAULT_TEMPLATE
from fsdp_utils.data.render import CHESS_COLUMNS
from fsdp_utils.data.streaming import row_batches
from fsdp_utils.hub.resolve import resolve_dataset_files


def positions(
    games: Sequence[dict[str, Any]],
    *,
    template: str,
    per_game: int,
    seed: int,
    max_plies: int | None = None,
) -> Iterator[dict[str, Any]]:
    """The prompt rows of `games`: `per_game` distinct positions of each (fewer in a short
    game), after at most `max_plies` plies, in the game's order."""
    for g, game in enumerate(games):
        moves = [str(m) for m in game["Moves"]]
        last = len(moves) if max_plies is None else min(len(moves), max_plies + 1)
        if last < 1:
            continue
        rng = random.Random(f"{seed}/{g}")
        plies = sorted(rng.sample(range(last), min(per_game, last)))
        for ply in plies:
            before = moves[:ply]
            yield {
                "prompt": render_prompt(template, game, before),
                "moves": before,
                "fen": board_after(before).fen(),
                "next_move": moves[ply],
            }


def read_games(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The games of a folder or file of data files, in file order (at most `limit`)."""
    files = resolve_dataset_files(str(path))
    games: list[dict[str, Any]] = []
    for batch in row_batches(files, list(CHESS_COLUMNS), 1024):
        for j in range(len(batch[CHESS_COLUMNS[0]])):
            games.append({c: batch[c][j] for c in CHESS_COLUMNS})
            if limit is not None and len(games) >= limit:
                return games
    return games


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_utils.chess_eval.prompt_set",
        description="Positions from chess games as GRPO prompts (jsonl), in the run's template.",
    )
    parser.add_argument("games_dir", type=Path, metavar="GAMES", help="a folder or file of games")
    parser.add_argument("out", type=Path, help="the jsonl file to write")
    parser.add_argument("--per_game", type=int, default=2, help="positions per game (2)")
    parser.add_argument("--games", type=int, default=None, help="read at most this many games")
    parser.add_argument(
        "--max_plies", type=int, default=None, help="positions after at most this many plies"
    )
    parser.add_argument("--template", default=DEFAULT_TEMPLATE, help="the run's --template")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if "{moves}" not in args.template:
        parser.error(f"--template must contain {{moves}}: got {args.template!r}")
    try:
        games = read_games(args.games_dir, args.games)
    except (OSError, ValueError) as err:
        parser.exit(2, f"error: {err}\n")
    rows = list(
        positions(
            games, template=args.template, per_game=args.per_game, seed=args.seed,
            max_plies=args.max_plies,
        )
    )  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{len(rows):,} prompts from {len(games):,} games -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
