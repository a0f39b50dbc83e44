"""Chess rewards for reinforcement learning (`--method grpo`'s built-ins: chess_format,
chess_legal, chess_engine): how good the next move a model writes after a position is.

Pure python-chess and the engine judge, no torch. A completion is the text written after a
prompt that ends with a position's moves (fsdp_utils/chess_eval/prompt_set.py writes such
prompts): its first word, written after a space as the games were, is the move judged; the
rest is not read. The position comes from the row's `fen` column, or its `moves` (UCI, from the
start position). The referee's parsing rules apply (`referee.parse_uci`).

    format_reward   1.0 for a first word in UCI, legal or not; else 0.0
    legal_reward    1.0 for a legal first move; else 0.0
    EngineReward    the engine judge's accuracy of a legal first move, in [0, 1] (Lichess's
                    move accuracy from the win% before and after: judge.py); 0.0 for an
                    illegal or unparseable one

The engine is one Stockfish process per training process (`shared_judge`), started at the
first call and ended at the run's end (`close_shared`, from the method's `close`); its searches of a position are cached, so the G
completions of one prompt cost one search of the position and one per distinct move.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import chess

from fsdp_utils.chess_eval.judge import EngineJudge
from fsdp_utils.chess_eval.referee import board_after, parse_uci

DEFAULT_DEPTH = 8  # ~34 positions/s on one busy core (docs/grpo.md)


def positions(columns: Mapping[str, Sequence[Any]]) -> list[chess.Board]:
    """Each row's position: from `fen`, else from `moves` played from the start."""
    if "fen" in columns:
        return [chess.Board(str(fen)) for fen in columns["fen"]]
    if "moves" in columns:
        return [board_after(list(moves)) for moves in columns["moves"]]
    raise ValueError(
        "The chess rewards judge a move in the row's position: the prompts need a column "
        "`fen` (the position) or `moves` (UCI moves from the start), as "
        "`python -m fsdp_utils.chess_eval.prompt_set` writes them."
    )


def first_move(text: str) -> chess.Move | None:
    """The move the completion's first word names, if it is one: written after whitespace (a
    word glued to the prompt's last move is not a move of its own) and in UCI."""
    if not text or not text[0].isspace():
        return None
    words = text.split()
    return parse_uci(words[0]) if words else None


def format_reward(text: str) -> float:
    return 1.0 if first_move(text) is not None else 0.0


def legal_reward(board: chess.Board, text: str) -> float:
    move = first_move(text)
    return 1.0 if move is not None and move in board.legal_moves else 0.0


class EngineReward:
    """A reward function (TRL's signature) scoring the first move with the engine judge; also
    usable from a reward file of one's own with another depth:
    `engine = EngineReward(depth=12)` and `--reward_funcs my_rewards.py:engine`."""

    def __init__(self, *, depth: int = DEFAULT_DEPTH, path: str | None = None) -> None:
        self.depth, self.path = depth, path
        self._judge: EngineJudge | None = None

    @property
    def judge(self) -> EngineJudge:
        if self._judge is None:  # started at the first call, in the process that calls
            self._judge = EngineJudge(path=self.path or _ENGINE_PATH, depth=self.depth)
        return self._judge

    def reward(self, board: chess.Board, text: str) -> float:
        move = first_move(text)
        if move is None or move not in board.legal_moves:
            return 0.0
        return self.judge.judge_move(board, move).accuracy / 100.0

    def __call__(self, completions: Sequence[str], **kwargs: Any) -> list[float | None]:
        return [self.reward(b, str(c)) for b, c in zip(positions(kwargs), completions, strict=True)]

    def close(self) -> None:
        """End the engine process and python-chess's thread that talks to it. A run closes it
        at its end (`Method.close`); a script of one's own must too: Python waits for that
        thread before it runs any atexit handler, so an engine left open keeps it alive."""
        if self._judge is not None:
            self._judge.close()
            self._judge = None


_SHARED: EngineReward | None = None
# The run's engine (--chess_engine, chosen and checked by the GRPO method), for every
# EngineReward without a path of its own; None: `find_engine`'s search.
_ENGINE_PATH: str | None = None


def use_engine_path(path: str | None) -> None:
    global _ENGINE_PATH
    _ENGINE_PATH = path


def shared_judge() -> EngineReward:
    """The process's engine reward at the default depth (the chess_engine built-in)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = EngineReward()
    return _SHARED


def close_shared() -> None:
    """End the built-in's engine, if it started (the run's end: see EngineReward.close)."""
    if _SHARED is not None:
        _SHARED.close()
