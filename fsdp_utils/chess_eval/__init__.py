"""Did the model learn chess? python-chess as the referee, Stockfish as the judge.

For held-out games (the eval split of `--dataset`, rendered with the run's `--template`) the
model continues three prefixes per game (opening, middlegame, ending) for up to K plies
(`--chess_eval_plies`, greedy unless `--chess_eval_temperature`), and python-chess judges
every move:

- legal-move rate: legal moves / moves judged (the legal ones plus the first failure);
- plies until the first illegal move: the mean, and the share of continuations that reach K
  legal plies or end the game legally;
- next-move accuracy: teacher-forced over every move of the games; a move counts when every
  one of its tokens is the model's top-1 prediction given the true text before it;
- result: where the template puts `{result}` before the moves, whether the games the model
  ended (checkmate, stalemate, ..., or a claimable draw at its EOS) ended with that result.

Parsing rules (`referee.judge`):

- The continuation is the decoded text after the prompt (special tokens other than EOS stay
  in it). It must start with whitespace: a first word glued to the prompt's last move is not
  a move of its own.
- Words are separated by whitespace; a word is judged once it is complete (followed by
  whitespace, or the text ended: EOS or the token budget of 2x the longest move's tokens per
  ply).
- A word is a legal move when it is lower-case UCI as python-chess writes it
  (`[a-h][1-8][a-h][1-8]` plus an optional promotion `q`, `r`, `b`, `n`; castling as the
  king's move `e1g1`) and the move is in `board.legal_moves`. SAN (`Nf3`), `0000`,
  `a1a1`, upper case, off-board squares, punctuation, a result such as `1-0`: unparseable.
- Judging stops at the first failure, after K legal plies, or at the end of the text. After
  a move that ends the game, any further word is a move after the end; the text ending
  before the game is over is "no move", unless a draw can be claimed (threefold repetition,
  50-move rule), which the end of the text then claims.
- Unparseable, illegal, after the end, no move: each is one illegal move.

With Stockfish (`judge.py`; `--chess_engine auto|on|off|PATH`) the model's moves are also
judged for quality, each distinct position once: centipawn loss and Lichess's accuracy over every
move (an illegal one scored as the worst) and over its legal moves alone, with standard errors,
best-move rate and lila's inaccuracy/mistake/blunder rates (`figures.py`), with balanced
positions beside the three phases, and the model plays games against a ladder of opponents,
unmasked and with its moves masked to the legal ones (`ladder.py`). An engine that dies or hangs
is restarted (`judge.EngineProcess`). Engine games as data, by shards and Slurm array tasks:
`python -m fsdp_utils.chess_eval.selfplay`.

Standalone: `python -m fsdp_utils.chess_eval MODEL` (one process, or sharded under torchrun);
during training: `--chess_eval_every N` (every rank takes part under FSDP; see
`fsdp_utils.parallel.generate`). docs/chess-eval.md has the figures, formulas and sources.
"""

from fsdp_utils.chess_eval.evaluator import ChessEvaluator, Example, format_table, log_record
from fsdp_utils.chess_eval.judge import EngineJudge, MoveVerdict, find_engine
from fsdp_utils.chess_eval.referee import FAILURES, Verdict

# `judge` is the engine judge's module (fsdp_utils.chess_eval.judge); the referee's function
# of that name is `fsdp_utils.chess_eval.referee.judge`.
__all__ = [
    "FAILURES",
    "ChessEvaluator",
    "EngineJudge",
    "Example",
    "MoveVerdict",
    "Verdict",
    "find_engine",
    "format_table",
    "log_record",
]
