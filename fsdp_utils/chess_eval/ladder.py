"""Games against a ladder of opponents: who they are, how a game goes, how games are scored.

One opponent cannot place a weak model: Stockfish's weakest settings (Skill Level 0, UCI_Elo
1350) beat a random mover every time. A ladder can: a random mover, then Stockfish at depth 1,
at node limits, at Skill Levels, at UCI_Elo levels (`--chess_eval_ladder`, weakest first).

The games (the model's side is played by `evaluator.py`, which owns the model):

- Openings vary: game i starts from opening i // 2 of `OPENINGS` (eight common lines, 4-8
  plies), and the colours alternate (the model is White in even games, Black in odd ones), so
  each opening is played once from each side.
- The model writes its move after the game so far, rendered with the run's template with the
  header asking for the model's win (`[Result 1-0]` when it is White) and ending in checkmate;
  the referee's rules read the move (`referee.judge`, one ply).
- The one rule for an illegal move: the model's first move that is not legal (unparseable,
  illegal, no move) loses the game on the spot. The PGN says what it wrote.
- A game ends at checkmate, stalemate, insufficient material, a claimable draw (threefold
  repetition, 50 moves: claimed at once) or, after `MAX_PLIES` plies or when the game no longer
  fits the model's --max_seq_length, by adjudication: the judge engine's score from White's view
  at `ADJUDICATE_CP` or more wins, else a draw.
- Opponents: `random` plays a uniformly random legal move (seeded per game); `depth:N` and
  `nodes:N` are full-strength Stockfish limited to that search (deterministic: Threads=1, the
  hash cleared before each move); `skill:N` (Skill Level) and `elo:N` (UCI_LimitStrength with
  UCI_Elo) search `MOVETIME_S` per move and choose among moves at random by design. Stockfish
  calibrated UCI_Elo at 60 s + 0.6 s a game, anchored to CCRL 40/4 (Stockfish commit a08b8d4,
  the calibration Stockfish 15 carries): at 10 ms a move it is a weaker opponent, not a rating.
  The Elo differences below are differences to these opponents as they played here.

Masked games (`--chess_eval_masking on|both`): the model's move is the legal move it gives the
highest probability (DeepMind's searchless-chess evaluation), chosen by `evaluator.py`; a masked
game is never lost to an illegal move. Masked and unmasked games are scored apart, never mixed
(`ladder_<rung>_*` and `ladder_masked_<rung>_*`), and the engine judges up to `JUDGED_MOVES` of the
model's moves in each masked game (`LadderGame.judge_moves`).

Scores: the model's points (win 1, draw 1/2) over the games against a rung, with a 95% Wilson
score interval (it stays inside [0, 1] for 0 or 8 points of 8); the Elo difference
-400 * log10(1 / score - 1) and its interval from the interval's ends (infinite at 0 and 1:
written as None in JSON, as +-inf in the table).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import chess
import chess.engine
import chess.pgn

from fsdp_utils.chess_eval.figures import mean, pct, standard_error
from fsdp_utils.chess_eval.judge import (
    DEFAULT_TIMEOUT_S,
    EngineFailed,
    EngineJudge,
    EngineProcess,
    ceiled_cp,
    find_engine,
)
from fsdp_utils.chess_eval.referee import random_move
from fsdp_utils.config.options.evaluation import LADDER_RUNG, ladder_rungs

MOVETIME_S = 0.01  # Skill Level and UCI_Elo rungs: a time per move (they are random anyway)
MAX_PLIES = 200
# Masked games: the model's moves the engine judges per game, evenly spread over the game.
JUDGED_MOVES = 16
ADJUDICATE_CP = 300
Z95 = 1.959963984540054

# Eight common openings (UCI), each played with both colours.
OPENINGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Ruy Lopez", ("e2e4", "e7e5", "g1f3", "b8c6", "f1b5", "a7a6")),
    ("Sicilian, Open", ("e2e4", "c7c5", "g1f3", "d7d6", "d2d4", "c5d4", "f3d4", "g8f6")),
    ("Queen's Gambit Declined", ("d2d4", "d7d5", "c2c4", "e7e6", "b1c3", "g8f6")),
    ("King's Indian", ("d2d4", "g8f6", "c2c4", "g7g6", "b1c3", "f8g7", "e2e4", "d7d6")),
    ("French", ("e2e4", "e7e6", "d2d4", "d7d5")),
    ("Caro-Kann", ("e2e4", "c7c6", "d2d4", "d7d5")),
    ("English", ("c2c4", "e7e5", "b1c3", "g8f6")),
    ("Reti", ("g1f3", "d7d5", "g2g3", "g8f6", "f1g2", "e7e6")),
)


# --- opponents ---------------------------------------------------------------------------


class Opponent:
    """One rung: a random mover, or a Stockfish process of its own (a context manager)."""

    def __init__(
        self, rung: str, *, path: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        ladder_rungs(rung)  # anything else: a ValueError naming the rungs
        match = LADDER_RUNG.fullmatch(rung)
        assert match is not None
        self.rung = rung
        self.kind, value = match.group(1), match.group(2)
        self.value = int(value) if value is not None else None
        self.timeout_s = timeout_s
        self.process: EngineProcess | None = None
        if self.kind is None:  # random
            return
        options: dict[str, Any] = {"Threads": 1, "Hash": 16}
        if self.kind == "skill":
            options["Skill Level"] = self.value
        elif self.kind == "elo":
            options.update({"UCI_LimitStrength": True, "UCI_Elo": self.value})
        self.limit = {
            "depth": chess.engine.Limit(depth=self.value),
            "nodes": chess.engine.Limit(nodes=self.value),
        }.get(self.kind, chess.engine.Limit(time=MOVETIME_S))
        # Restarted when it dies or hangs (each move is a new game: a retried move is the
        # same move at depth and node limits).
        self.process = EngineProcess(find_engine(path), options, timeout_s=timeout_s)

    def __enter__(self) -> Opponent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.process is not None:
            self.process.close()

    def move(self, board: chess.Board, rng: random.Random) -> chess.Move:
        if self.process is None:
            return random_move(board, rng)
        result = self.process.call(
            lambda engine: engine.play(board, self.limit, game=object()),
            f"a move of {self.rung} in {board.fen()}",
        )
        assert result.move is not None
        return result.move


def check_opponents(rungs: list[str] | tuple[str, ...], path: str) -> None:
    """Start each rung's engine once (the preflights): an option this engine refuses (a UCI_Elo
    below its minimum) is a ValueError naming the fix, before any game is played."""
    for rung in rungs:
        try:
            Opponent(rung, path=path).close()
        except EngineFailed as err:
            raise ValueError(
                f"--chess_eval_ladder: the rung {rung!r} cannot be played by {path}: {err}. "
                "Choose a level this engine accepts (Skill Level 0-20; UCI_Elo from 1350 in "
                "Stockfish 15, from 1320 in 16 and later)."
            ) from err


# --- one game ----------------------------------------------------------------------------


@dataclass
class LadderGame:
    index: int  # the game's number against its rung (the opening and colour follow from it)
    rung: str
    seed: int
    # The model's moves chosen among the legal moves by its own probabilities (DeepMind's
    # searchless-chess evaluation) instead of read from what it writes: never illegal.
    masked: bool = False
    board: chess.Board = field(init=False)
    opening: str = field(init=False)
    result: str | None = None  # "1-0", "0-1", "1/2-1/2" once over
    termination: str | None = None
    model_wrote: str | None = None  # the text of the model's illegal move
    rng: random.Random = field(init=False)
    # Masked games: the probability the model put on the legal moves, at each of its moves.
    legal_mass: list[float] = field(default_factory=list)
    judged: list[dict[str, Any]] = field(default_factory=list)  # the engine on its moves

    def __post_init__(self) -> None:
        self.opening, moves = OPENINGS[(self.index // 2) % len(OPENINGS)]
        self.board = chess.Board()
        for uci in moves:
            self.board.push_uci(uci)
        self.rng = random.Random(
            f"{self.seed}/{self.rung}/{self.index}" + ("/masked" if self.masked else "")
        )

    def model_plies(self) -> list[int]:
        """The plies of the game at which the model moved (after the opening)."""
        first = len(OPENINGS[(self.index // 2) % len(OPENINGS)][1])
        mine = 0 if self.model_color == chess.WHITE else 1
        return [p for p in range(first, self.board.ply()) if p % 2 == mine]

    def judge_moves(self, judge: EngineJudge, most: int = JUDGED_MOVES) -> None:
        """The engine judge on (at most `most`, evenly spread) moves the model played."""
        plies = self.model_plies()
        if len(plies) > most:
            plies = [plies[round(k * (len(plies) - 1) / (most - 1))] for k in range(most)]
        board = chess.Board()
        stack = list(self.board.move_stack)
        for ply, move in enumerate(stack):
            if ply in plies:
                verdict = judge.judge_move(board, move)
                self.judged.append(
                    {"ply": ply, "move": verdict.move, "best_move": verdict.best_move,
                     "cp_loss": verdict.cp_loss, "accuracy": verdict.accuracy,
                     "is_best": verdict.is_best, "judgement": verdict.judgement}
                )  # fmt: skip
            board.push(move)

    @property
    def model_color(self) -> chess.Color:
        return chess.WHITE if self.index % 2 == 0 else chess.BLACK

    @property
    def over(self) -> bool:
        return self.result is not None

    @property
    def model_to_move(self) -> bool:
        return not self.over and self.board.turn == self.model_color

    def header_result(self) -> str:
        return "1-0" if self.model_color == chess.WHITE else "0-1"

    def check_end(self) -> None:
        outcome = self.board.outcome(claim_draw=True)
        if outcome is not None:
            self.finish(outcome.result(), outcome.termination.name.lower())

    def finish(self, result: str, termination: str) -> None:
        self.result, self.termination = result, termination

    def forfeit(self, wrote: str, failure: str) -> None:
        """The model's illegal move loses the game."""
        self.model_wrote = wrote
        self.finish("0-1" if self.model_color == chess.WHITE else "1-0", f"model {failure}")

    def adjudicate(self, judge: EngineJudge, why: str) -> None:
        score = judge.search_before(self.board).score  # from the side to move
        white_cp = ceiled_cp(score) * (1 if self.board.turn == chess.WHITE else -1)
        result = "1/2-1/2"
        if abs(white_cp) >= ADJUDICATE_CP:
            result = "1-0" if white_cp > 0 else "0-1"
        self.finish(result, f"adjudicated ({why}, {white_cp:+d} cp for White)")

    def points(self) -> float:
        """The model's points."""
        assert self.result is not None
        if self.result == "1/2-1/2":
            return 0.5
        return 1.0 if self.result == self.header_result() else 0.0

    def pgn(self, *, model_name: str) -> str:
        game = chess.pgn.Game.from_board(self.board)
        model_name += " (masked)" if self.masked else ""
        white, black = (model_name, self.rung) if self.model_color else (self.rung, model_name)
        event = "fsdp_utils chess_eval ladder" + (", masked" if self.masked else "")
        game.headers.update(
            Event=event, Round=str(self.index + 1), White=white,
            Black=black, Result=self.result or "*", Termination=self.termination or "",
            Opening=self.opening,
        )  # fmt: skip
        if self.model_wrote is not None:
            game.end().comment = f"the model wrote {self.model_wrote!r}: an illegal move loses"
        return str(game)

    def record(self) -> dict[str, Any]:
        record = {
            "rung": self.rung, "game": self.index, "masked": self.masked,
            "opening": self.opening, "model_color": "white" if self.model_color else "black",
            "result": self.result, "termination": self.termination, "points": self.points(),
            "plies": self.board.ply(), "moves": [m.uci() for m in self.board.move_stack],
        }  # fmt: skip
        if self.masked:
            record["legal_mass"] = self.legal_mass
            record["judged"] = self.judged
        return record


# --- scores ------------------------------------------------------------------------------


def wilson_interval(score: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion `score` over `n` trials."""
    if n == 0:
        return (0.0, 1.0)
    centre = (score + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(score * (1 - score) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def elo_difference(score: float) -> float:
    """-400 * log10(1 / score - 1): +-inf at 1 and 0."""
    if score <= 0:
        return -math.inf
    if score >= 1:
        return math.inf
    return -400 * math.log10(1 / score - 1)


@dataclass(frozen=True)
class RungScore:
    rung: str
    games: int
    wins: int
    draws: int
    losses: int
    illegal_losses: int
    masked: bool = False
    judged: tuple[dict[str, Any], ...] = ()  # the engine on the model's moves (masked games)
    legal_mass: tuple[float, ...] = ()

    @property
    def score(self) -> float:
        return (self.wins + self.draws / 2) / self.games

    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.score, self.games)

    def elo(self) -> tuple[float, float, float]:
        low, high = self.interval()
        return elo_difference(self.score), elo_difference(low), elo_difference(high)

    def metrics(self) -> dict[str, Any]:
        """Flat numbers for metrics.jsonl (None for an infinite Elo difference); a masked
        rung's names begin `ladder_masked_` and add the engine's figures on its moves."""
        name = ("masked_" if self.masked else "") + self.rung.replace(":", "")
        low, high = self.interval()

        def finite(x: float) -> float | None:
            return x if math.isfinite(x) else None

        elo, elo_low, elo_high = self.elo()
        return {
            f"ladder_{name}_games": self.games,
            f"ladder_{name}_wins": self.wins,
            f"ladder_{name}_draws": self.draws,
            f"ladder_{name}_losses": self.losses,
            f"ladder_{name}_score": self.score,
            f"ladder_{name}_score_low": low,
            f"ladder_{name}_score_high": high,
            f"ladder_{name}_elo_diff": finite(elo),
            f"ladder_{name}_elo_diff_low": finite(elo_low),
            f"ladder_{name}_elo_diff_high": finite(elo_high),
            f"ladder_{name}_illegal_losses": self.illegal_losses,
        } | (self.masked_figures(f"ladder_{name}_") if self.masked else {})

    def masked_figures(self, prefix: str) -> dict[str, Any]:
        return {
            prefix + "moves_judged": len(self.judged),
            prefix + "centipawn_loss": mean([j["cp_loss"] for j in self.judged]),
            prefix + "centipawn_loss_se": standard_error([j["cp_loss"] for j in self.judged]),
            prefix + "accuracy": mean([j["accuracy"] for j in self.judged]),
            prefix + "accuracy_se": standard_error([j["accuracy"] for j in self.judged]),
            prefix + "legal_mass": mean(list(self.legal_mass)),
        }


def score_rungs(records: list[dict[str, Any]], rungs: list[str]) -> list[RungScore]:
    """Each rung's score, its unmasked games and its masked ones apart (never mixed)."""
    scores = []
    for rung in rungs:
        for masked in (False, True):
            mine = [r for r in records if r["rung"] == rung and r.get("masked", False) == masked]
            if not mine:
                continue
            scores.append(
                RungScore(
                    rung=rung,
                    games=len(mine),
                    wins=sum(r["points"] == 1.0 for r in mine),
                    draws=sum(r["points"] == 0.5 for r in mine),
                    losses=sum(r["points"] == 0.0 for r in mine),
                    illegal_losses=sum(str(r["termination"]).startswith("model ") for r in mine),
                    masked=masked,
                    judged=tuple(j for r in mine for j in r.get("judged", [])),
                    legal_mass=tuple(x for r in mine for x in r.get("legal_mass", [])),
                )
            )
    return scores


def masked_totals(scores: list[RungScore]) -> dict[str, Any]:
    """The engine's figures on the model's moves over every masked game (all rungs)."""
    masked = [s for s in scores if s.masked]
    if not masked:
        return {}
    everything = RungScore(
        "all", sum(s.games for s in masked), 0, 0, 0, 0, True,
        tuple(j for s in masked for j in s.judged), tuple(x for s in masked for x in s.legal_mass),
    )  # fmt: skip
    return everything.masked_figures("ladder_masked_")


def ladder_line(m: dict[str, Any], name: str) -> str:
    """One rung's line of the table, from the flat metrics (`RungScore.metrics`); `name` is
    the rung's metric name (`skill0`, or `masked_skill0` for its masked games)."""

    def elo(value: float | None, sign: int) -> str:
        return f"{value:+.0f}" if value is not None else ("+inf" if sign > 0 else "-inf")

    k = f"ladder_{name}_"
    score = m[k + "score"]
    masked = name.startswith("masked_")
    shown = name.removeprefix("masked_") + (" masked" if masked else "")
    how = (
        f"model's legal probability {pct(m.get(k + 'legal_mass'))}"
        if masked
        else f"{m[k + 'illegal_losses']} by an illegal move"
    )
    # An infinite end is -inf below a score of 1/2 and +inf above it.
    line = (
        f"  vs {shown:<15} {m[k + 'wins']}W {m[k + 'draws']}D {m[k + 'losses']}L "
        f"({how})  score {score:.2f} "
        f"[{m[k + 'score_low']:.2f}, {m[k + 'score_high']:.2f}]  Elo difference "
        f"{elo(m[k + 'elo_diff'], 1 if score >= 0.5 else -1)} "
        f"[{elo(m[k + 'elo_diff_low'], -1)}, {elo(m[k + 'elo_diff_high'], 1)}]"
    )
    if masked and m.get(k + "moves_judged"):
        line += (
            f"; its moves: centipawn loss {m[k + 'centipawn_loss']:.0f}, accuracy "
            f"{m[k + 'accuracy']:.1f}% ({m[k + 'moves_judged']} judged)"
        )
    return line
