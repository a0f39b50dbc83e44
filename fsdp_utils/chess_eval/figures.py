"""The engine judge's figures: the moves a model played, judged one by one, and their means.

A continuation's first `--chess_eval_judged_plies` legal moves are judged (`EngineJudge`), each
into one record of the per-move JSONL; a continuation that fails before that many gives one
more record for its failed move (`"legal": false` and the referee's reason, no engine fields).
The figures are means over the judged legal moves, and the failed ones are counted beside them
(`engine_illegal`), never averaged in: an illegal move has no centipawn loss.

Every figure is computed from the records sorted by (position, ply), whichever process judged
them, so one process and several give the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fsdp_utils.chess_eval.games import BALANCED, PHASES, Prefix
from fsdp_utils.chess_eval.judge import JUDGEMENTS, EngineJudge
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


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def engine_metrics(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The figures of metrics.jsonl (flat numbers; None where nothing was judged)."""
    ordered = sorted(records, key=lambda r: (r["position"], r["ply"]))
    legal = [r for r in ordered if r["legal"]]
    illegal = [r for r in ordered if not r["legal"]]
    n = len(legal)
    m: dict[str, Any] = {
        "engine_positions": len({r["position"] for r in ordered}),
        "engine_moves": n,
        "engine_illegal": len(illegal),
        "engine_centipawn_loss": _mean([r["cp_loss"] for r in legal]),
        "engine_accuracy": _mean([r["accuracy"] for r in legal]),
        "engine_best_move_rate": _mean([float(r["is_best"]) for r in legal]),
    }
    for _, name in sorted(JUDGEMENTS):
        m[f"engine_{name}_rate"] = _mean([float(r["judgement"] == name) for r in legal])
    for phase in FIGURE_PHASES:
        mine = [r for r in legal if r["phase"] == phase]
        m[f"engine_centipawn_loss_{phase}"] = _mean([r["cp_loss"] for r in mine])
        m[f"engine_accuracy_{phase}"] = _mean([r["accuracy"] for r in mine])
        m[f"engine_moves_{phase}"] = len(mine)
    return m


def judge_board_score(judge: EngineJudge, moves: Sequence[str]) -> int | None:
    """Centipawns from the side to move after `moves` (None when the game is over there)."""
    board = board_after(moves)
    if board.is_game_over():
        return None
    score = judge.search_before(board).score
    cp = score.score(mate_score=100_000)
    return int(cp) if cp is not None else None
