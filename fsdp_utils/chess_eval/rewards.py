"""Chess rewards for reinforcement learning (`--method grpo`'s built-ins: chess_format,
chess_legal, chess_engine, chess_centipawn): how good the next move a model writes after a
position is.

Pure python-chess and the engine judge, no torch. A completion is the text written after a
prompt that ends with a position's moves (fsdp_utils/chess_eval/prompt_set.py writes such
prompts): its first word, written after a space as the games were, is the move judged; the
rest is not read. The position comes from the row's `fen` column, or its `moves` (UCI, from the
start position). The referee's parsing rules apply (`referee.parse_uci`).

    format_reward   1.0 for a first word in UCI, legal or not; else 0.0
    legal_reward    1.0 for a legal first move; else 0.0
    EngineReward    the engine judge's verdict on a legal first move:
                    "accuracy" (chess_engine): Lichess's move accuracy from the win% before and
                    after (judge.py), in [0, 1]; 0.0 for an illegal or unparseable move;
                    "centipawn" (chess_centipawn): dense in centipawns, 1 - cp_loss / 1000 in
                    [0, 1] (the loss ceiled at 1000, as the judge scores it: the best move 1.0,
                    a move that loses 200 cp 0.8, one that throws a won game away 0.0), and
                    -1.0 for an illegal or unparseable move, below every legal one. Win%
                    saturates in decided positions (a blunder from +900 to +400 hardly moves
                    it); centipawns do not, so every legal move gets a graded signal (Chess-R1,
                    arXiv 2507.00726: sparse rewards stall GRPO, a dense engine value does not).

The engine is one Stockfish process per reward and training process, started at the first call
and ended at the run's end (`close_shared`, from the method's `close`); its searches of a
position are cached, so the G completions of one prompt cost one search of the position and one
per distinct move. An engine that dies or hangs is restarted and the position judged again
(`judge.EngineProcess`: each restart counted, `take_restart_notes` gives the log lines); one
that keeps failing raises `judge.EngineGaveUp`, which GRPO answers by saving and stopping.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import chess

from fsdp_utils.chess_eval.judge import CP_CEILING, DEFAULT_TIMEOUT_S, EngineJudge
from fsdp_utils.chess_eval.referee import board_after, parse_uci

DEFAULT_DEPTH = 8  # ~34 positions/s on one busy core (docs/grpo.md)
ILLEGAL_CENTIPAWN_REWARD = -1.0  # below every legal move's 1 - cp_loss / 1000 in [0, 1]
Kind = Literal["accuracy", "centipawn"]


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


def move_text(completion: Any) -> str:
    """A completion as the text `first_move` reads. A plain completion continues the prompt's
    text, so its first word must follow whitespace; a chat completion (TRL's
    [{"role", "content"}]) is a reply of its own, never glued to the prompt: its content counts
    as written after a space."""
    if isinstance(completion, list):
        content = "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
        return " " + content
    return str(completion)


def format_reward(text: str) -> float:
    return 1.0 if first_move(text) is not None else 0.0


def legal_reward(board: chess.Board, text: str) -> float:
    move = first_move(text)
    return 1.0 if move is not None and move in board.legal_moves else 0.0


class EngineReward:
    """A reward function (TRL's signature) scoring the first move with the engine judge; also
    usable from a reward file of one's own with another depth or kind:
    `engine = EngineReward(depth=12, kind="centipawn")` and `--reward_funcs my_rewards.py:engine`."""

    def __init__(
        self,
        *,
        depth: int = DEFAULT_DEPTH,
        path: str | None = None,
        kind: Kind = "accuracy",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        name: str | None = None,
    ) -> None:
        if kind not in ("accuracy", "centipawn"):
            raise ValueError(f"EngineReward(kind={kind!r}): accuracy or centipawn.")
        self.depth, self.path, self.kind, self.timeout_s = depth, path, kind, timeout_s
        if name is not None:  # the metrics' name (rewards/<name>/mean), as a function's
            self.__name__ = name
        self._judge: EngineJudge | None = None
        _REWARDS.add(self)

    @property
    def judge(self) -> EngineJudge:
        if self._judge is None:  # started at the first call, in the process that calls
            self._judge = EngineJudge(
                path=self.path or _ENGINE_PATH, depth=self.depth, timeout_s=self.timeout_s
            )
        return self._judge

    @property
    def restarts(self) -> int:
        return self._judge.restarts if self._judge is not None else 0

    def reward(self, board: chess.Board, text: str) -> float:
        move = first_move(text)
        if move is None or move not in board.legal_moves:
            return ILLEGAL_CENTIPAWN_REWARD if self.kind == "centipawn" else 0.0
        verdict = self.judge.judge_move(board, move)
        if self.kind == "centipawn":
            return 1.0 - verdict.cp_loss / CP_CEILING
        return verdict.accuracy / 100.0

    def __call__(self, completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        rows = zip(positions(kwargs), completions, strict=True)
        return [self.reward(board, move_text(c)) for board, c in rows]

    def take_notes(self) -> list[str]:
        return self._judge.process.take_notes() if self._judge is not None else []

    def close(self) -> None:
        """End the engine process and python-chess's thread that talks to it. A run closes it
        at its end (`Method.close`); a script of one's own must too: Python waits for that
        thread before it runs any atexit handler, so an engine left open keeps it alive."""
        if self._judge is not None:
            _CLOSED_NOTES.extend(self.take_notes())
            self._judge.close()
            self._judge = None


# Every EngineReward of this process (the built-ins' and a reward file's): their restarts.
_REWARDS: weakref.WeakSet[EngineReward] = weakref.WeakSet()
_CLOSED_NOTES: list[str] = []  # of rewards closed since
# The run's engine (--chess_engine, chosen and checked by the GRPO method), for every
# EngineReward without a path of its own; None: `find_engine`'s search.
_ENGINE_PATH: str | None = None


def use_engine_path(path: str | None) -> None:
    global _ENGINE_PATH
    _ENGINE_PATH = path


def take_restart_notes() -> list[str]:
    """The log lines of the engine restarts of this process's engine rewards since the last
    call (each restart once)."""
    notes = [*_CLOSED_NOTES, *(note for reward in list(_REWARDS) for note in reward.take_notes())]
    _CLOSED_NOTES.clear()
    return notes


_SHARED: dict[str, EngineReward] = {}


def shared_judge(kind: Kind = "accuracy") -> EngineReward:
    """The process's engine reward of that kind at the default depth (the built-ins)."""
    if kind not in _SHARED:
        _SHARED[kind] = EngineReward(kind=kind)
    return _SHARED[kind]


def close_shared() -> None:
    """End the built-ins' engines, if they started (the run's end: see EngineReward.close)."""
    for reward in _SHARED.values():
        reward.close()
