"""The referee: python-chess judges the text a model wrote after a game prefix.

Pure functions of (position, text): no model, no torch. The rules, also in the package
docstring and docs/chess-eval.md:

- The continuation is the decoded text after the prompt. It must start with whitespace: a
  first word glued to the prompt's last move (e.g. `q` after `e7e8`) is not a move of its own.
- Words are separated by whitespace. A word is judged once it is complete: followed by
  whitespace, or the text has ended (EOS, or the token budget ran out).
- A word is a legal move when it is UCI as `Move.uci()` writes it (`[a-h][1-8][a-h][1-8]`
  plus an optional lower-case promotion piece `qrbn`; castling as the king's move, `e1g1`)
  and that move is in `board.legal_moves`. The null move `0000`, a move to its own square
  (`a1a1`), SAN (`Nf3`), upper case, off-board squares and any other text are unparseable.
- Judging stops at the first move that is not legal, after K legal plies, or at the end.
  After K legal plies the rest of the text is not read.
- After a move that ends the game (checkmate, stalemate, insufficient material, fivefold
  repetition, 75-move rule) the only right continuation is the end of the text: any further
  word is "a move after the game has ended". The end of the text before the game is over is
  "no move", unless a draw can be claimed there (threefold repetition, 50-move rule): then
  the text ending is the claim, and the game ends drawn.
- Every one of these failures (unparseable, illegal, after the end, no move) counts as one
  illegal move.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import chess

UCI_MOVE = re.compile(r"[a-h][1-8][a-h][1-8][qrbn]?")

Failure = Literal["unparseable", "illegal", "after_end", "no_move"]
FAILURES: tuple[Failure, ...] = ("unparseable", "illegal", "after_end", "no_move")


@dataclass(frozen=True)
class Verdict:
    """What the referee decided about one continuation."""

    legal_plies: int  # legal moves before the first failure (at most K)
    failure: Failure | None  # the first illegal move's kind; None if there was none
    ended: bool  # the game ended within the continuation, legally
    result: str | None  # "1-0", "0-1" or "1/2-1/2" when it ended

    @property
    def moves_judged(self) -> int:
        """Moves counted by the legal-move rate: the legal ones plus the failed one."""
        return self.legal_plies + (self.failure is not None)


def parse_uci(word: str) -> chess.Move | None:
    """The move a word names, or None if the word is not UCI as python-chess writes it."""
    if not UCI_MOVE.fullmatch(word):
        return None
    try:
        return chess.Move.from_uci(word)
    except chess.InvalidMoveError:  # e.g. "a1a1": python-chess writes no such move
        return None


def board_after(moves: Sequence[str]) -> chess.Board:
    """The position after a game's moves (UCI); the moves of a dataset game are legal."""
    board = chess.Board()
    for uci in moves:
        board.push_uci(uci)
    return board


def random_move(board: chess.Board, rng: random.Random) -> chess.Move:
    """A uniformly random legal move, drawn from the moves in UCI order (so that one seed gives
    one move whatever order python-chess generates them in): the ladder's random opponent,
    self-play's openings and random games."""
    return rng.choice(sorted(board.legal_moves, key=lambda m: m.uci()))


def judge(board: chess.Board, text: str, *, plies: int, finished: bool) -> Verdict | None:
    """Judge `text` written after the position `board` (not modified).

    Returns None while the verdict depends on text not yet written (`finished=False`), so a
    generation loop can stop each sequence as soon as its verdict is known.
    """
    if plies < 1:
        raise ValueError(f"The number of plies to judge must be at least 1, got {plies}.")
    board = board.copy()
    legal = 0
    if text and not text[0].isspace():
        # Glued to the prompt's last word: judged as soon as that word is known to be a word.
        if finished or any(c.isspace() for c in text):
            return Verdict(0, "unparseable", False, None)
        return None
    words = text.split()
    complete = len(words) if finished or (text and text[-1].isspace()) else len(words) - 1
    for i, word in enumerate(words):
        if board.is_game_over():  # any word after the end fails, complete or not
            return Verdict(legal, "after_end", True, board.result())
        if i == complete:
            break
        move = parse_uci(word)
        if move is None:
            return Verdict(legal, "unparseable", False, None)
        if move not in board.legal_moves:
            return Verdict(legal, "illegal", False, None)
        board.push(move)
        legal += 1
        if legal == plies:
            over = board.is_game_over()
            return Verdict(legal, None, over, board.result() if over else None)
    if not finished:
        return None
    if board.is_game_over():
        return Verdict(legal, None, True, board.result())
    if board.can_claim_draw():
        return Verdict(legal, None, True, "1/2-1/2")
    return Verdict(legal, "no_move", False, None)
