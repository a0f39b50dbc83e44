"""The engine judge's figures: the moves a model played, judged one by one, and their means.

A continuation's first `--chess_eval_judged_plies` legal moves are judged (`EngineJudge`), each
into one record of the per-move JSONL; a continuation that fails before that many gives one
more record for its failed move (`"legal": false` and the referee's reason, no engine fields).
Each distinct position is judged once (`distinct_positions`): the same position reached by
several prefixes (every game's start, a transposition) would otherwise count its one answer
again and again.

Two kinds of figures, never mixed up:

- **every move** (`engine_all_centipawn_loss`, `engine_all_accuracy`): the headline strength,
  over every judged move, an illegal one scored as the worst move (the centipawn ceiling, 1000,
  and accuracy 0), as a game would forfeit it: it can only improve as the model plays more
  legal moves, and better ones;
- **legal moves only** (`engine_centipawn_loss`, `engine_accuracy`, best-move and lila's
  judgement rates): how good the moves it did play are; the failed ones are counted beside
  them (`engine_illegal`). A model that plays more (and harder) legal moves can see this one
  get worse while it gets stronger.

Each mean comes with its standard error (`..._se`: the sample standard deviation over the
square root of the number of moves), and the counts it rests on: `engine_moves` legal and
`engine_illegal` illegal moves from `engine_positions` distinct positions.

Every figure is computed from the records sorted by (position, ply), whichever process judged
them, so one process and several give the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fsdp_utils.chess_eval.games import BALANCED, PHASES, Prefix
from fsdp_utils.chess_eval.judge import CP_CEILING, JUDGEMENTS, EngineJudge
from fsdp_utils.chess_eval.referee import Verdict, board_after, parse_uci

FIGURE_PHASES = (*PHASES, BALANCED)


@dataclass(frozen=True)
class Played:
    """One continuation as the referee saw it."""

    prefix: Prefix
    words: tuple[str, ...]  # the continuation's words (legal moves first)
    verdict: Verdict


def move_records(judge: EngineJudge, played: Played, judged_plies: int) -> list[dict[str, Any]]:
    """The per-move records of one continuation (raises EngineFailed if the engine fails)."""
    p, v = played.prefix, played.verdict
    board = board_after(p.moves)
    where = {"position": p.index, "game": p.game, "phase": p.phase}
    records = []
    for ply in range(min(judged_plies, v.legal_plies)):
        move = parse_uci(played.words[ply])
        assert move is not None  # the referee found it legal
        verdict = judge.judge_move(board, move)
        records.append({**where, "ply": ply, "legal": True, "failure": None, **verdict.to_record()})
        board.push(move)
    if v.failure is not None and v.legal_plies < judged_plies:
        ply = v.legal_plies
        wrote = played.words[ply] if ply < len(played.words) else None
        records.append(
            {**where, "ply": ply, "legal": False, "failure": v.failure, "fen": board.fen(),
             "move": wrote}
        )  # fmt: skip
    return records


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def pct(value: float | None) -> str:
    """A share as the tables print it (`n/a` for nothing measured)."""
    return "n/a" if value is None else f"{100 * value:.1f}%"


def standard_error(values: Sequence[float]) -> float | None:
    """The standard error of the mean: the sample standard deviation / sqrt(n); None under 2."""
    n = len(values)
    if n < 2:
        return None
    centre = sum(values) / n
    return math.sqrt(sum((v - centre) ** 2 for v in values) / (n - 1) / n)


def scored(record: dict[str, Any]) -> tuple[float, float]:
    """(centipawn loss, accuracy) of any judged move: an illegal one is the worst move."""
    if record["legal"]:
        return float(record["cp_loss"]), float(record["accuracy"])
    return float(CP_CEILING), 0.0


def distinct_positions(prefixes: Sequence[Prefix]) -> set[int]:
    """The prefixes the engine judges: the first of each distinct position (the board, the
    side to move, castling and en passant rights), in prefix order."""
    seen: set[str] = set()
    chosen: set[int] = set()
    for prefix in sorted(prefixes, key=lambda p: p.index):
        key = board_after(prefix.moves).epd()
        if key not in seen:
            seen.add(key)
            chosen.add(prefix.index)
    return chosen


def engine_metrics(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The figures of metrics.jsonl (flat numbers; None where nothing was judged)."""
    ordered = sorted(records, key=lambda r: (r["position"], r["ply"]))
    legal = [r for r in ordered if r["legal"]]
    illegal = [r for r in ordered if not r["legal"]]
    n = len(legal)
    losses, accuracies = [r["cp_loss"] for r in legal], [r["accuracy"] for r in legal]
    every = [scored(r) for r in ordered]
    m: dict[str, Any] = {
        "engine_positions": len({r["position"] for r in ordered}),
        "engine_moves": n,
        "engine_illegal": len(illegal),
        "engine_all_centipawn_loss": mean([loss for loss, _ in every]),
        "engine_all_centipawn_loss_se": standard_error([loss for loss, _ in every]),
        "engine_all_accuracy": mean([acc for _, acc in every]),
        "engine_all_accuracy_se": standard_error([acc for _, acc in every]),
        "engine_centipawn_loss": mean(losses),
        "engine_centipawn_loss_se": standard_error(losses),
        "engine_accuracy": mean(accuracies),
        "engine_accuracy_se": standard_error(accuracies),
        "engine_best_move_rate": mean([float(r["is_best"]) for r in legal]),
    }
    for _, name in sorted(JUDGEMENTS):
        m[f"engine_{name}_rate"] = mean([float(r["judgement"] == name) for r in legal])
    for phase in FIGURE_PHASES:
        mine = [r for r in legal if r["phase"] == phase]
        m[f"engine_centipawn_loss_{phase}"] = mean([r["cp_loss"] for r in mine])
        m[f"engine_accuracy_{phase}"] = mean([r["accuracy"] for r in mine])
        m[f"engine_moves_{phase}"] = len(mine)
        m[f"engine_illegal_{phase}"] = sum(r["phase"] == phase for r in illegal)
    return m


def judge_board_score(judge: EngineJudge, moves: Sequence[str]) -> int | None:
    """Centipawns from the side to move after `moves` (None when the game is over there)."""
    board = board_after(moves)
    if board.is_game_over():
        return None
    score = judge.search_before(board).score
    cp = score.score(mate_score=100_000)
    return int(cp) if cp is not None else None
