"""Held-out games -> the prefixes the model continues, rendered with the run's own template.

Every game gives three prefixes (the phases): its opening (after 0 to 8 of its plies, drawn
from (seed, game): the start position is one of them, not every game's), a middlegame ply
drawn from (seed, game), and its ending (K/2 plies before the game's last move, so a model
that plays on well can end the game and meet the `[Result ...]` header). The prompt is the
template up to `{moves}`, then the prefix's moves, with trailing whitespace removed: the model
writes the separating space itself, as it did in training.

With the engine judge, a game may give a fourth prefix, `balanced`: the first of a few seeded
plies whose position the engine scores within +-`BALANCED_CP` centipawns, where Lichess's win%
is far from saturated (a move there can visibly gain or lose). Balanced prefixes are judged by
the engine only; the legal-move figures stay those of the three phases.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PHASES = ("opening", "middlegame", "ending")
BALANCED = "balanced"
BALANCED_CP = 100
BALANCED_CANDIDATES = 6
OPENING_PLIES = 8  # a game's opening prefix: after 0 to 8 of its plies (seeded per game)


@dataclass(frozen=True)
class Prefix:
    index: int  # position in the evaluation's item list (seeds sampling)
    game: int  # index of the held-out game
    phase: str
    moves: tuple[str, ...]  # the real game's moves before the continuation
    prompt: str
    header_result: str | None  # the result the prompt's header asks for; None: no header


def require_games(games: Sequence[Mapping[str, Any]]) -> None:
    if not games:
        raise ValueError(
            "The chess evaluation found no held-out games: the eval split is empty. Hold "
            "some out with --eval_examples (e.g. --eval_examples 200)."
        )


def template_head(template: str) -> str:
    """The part of the template before `{moves}` (what precedes the first move)."""
    return template.split("{moves}", 1)[0]


def header_shows_result(template: str) -> bool:
    return "{result}" in template_head(template)


def render_prompt(template: str, game: Mapping[str, Any], moves: Sequence[str]) -> str:
    head = template_head(template).format(
        result=game["Result"], termination=game["Termination"], moves=""
    )
    return (head + " ".join(moves)).rstrip()


def moves_offset(template: str, game: Mapping[str, Any]) -> int:
    """Where the first move starts in the game's full rendered text."""
    return len(
        template_head(template).format(
            result=game["Result"], termination=game["Termination"], moves=""
        )
    )


def phase_plies(num_moves: int, plies: int, rng: random.Random) -> dict[str, int]:
    middle = rng.randint(1, num_moves - 1) if num_moves > 1 else 0
    # The start position once per game would be the same position 32 times over: each game's
    # opening is one of its first OPENING_PLIES plies instead (the start among them).
    opening = rng.randint(0, min(OPENING_PLIES, max(0, num_moves - 1)))
    return {
        "opening": opening,
        "middlegame": middle,
        "ending": max(0, num_moves - max(1, plies // 2)),
    }


def make_prefixes(
    games: Sequence[Mapping[str, Any]], template: str, *, plies: int, seed: int
) -> list[Prefix]:
    shows_result = header_shows_result(template)
    prefixes: list[Prefix] = []
    for g, game in enumerate(games):
        moves = list(game["Moves"])
        rng = random.Random(f"{seed}/{g}")
        for phase, ply in phase_plies(len(moves), plies, rng).items():
            prefixes.append(
                Prefix(
                    index=len(prefixes),
                    game=g,
                    phase=phase,
                    moves=tuple(moves[:ply]),
                    prompt=render_prompt(template, game, moves[:ply]),
                    header_result=str(game["Result"]) if shows_result else None,
                )
            )
    return prefixes


def balanced_ply(
    game: Mapping[str, Any], g: int, *, seed: int, score: Callable[[Sequence[str]], int | None]
) -> int | None:
    """The ply of game `g` whose position is balanced: the first of `BALANCED_CANDIDATES`
    seeded plies (after the opening's first 4) that `score` (centipawns from the side to move;
    None: the game is over there) puts within +-BALANCED_CP; None if none is."""
    moves = list(game["Moves"])
    rng = random.Random(f"{seed}/{g}/balanced")
    plies = list(range(4, len(moves)))
    for ply in rng.sample(plies, min(BALANCED_CANDIDATES, len(plies))):
        cp = score(moves[:ply])
        if cp is not None and abs(cp) <= BALANCED_CP:
            return ply
    return None


def balanced_prefix(
    games: Sequence[Mapping[str, Any]], template: str, g: int, ply: int, index: int
) -> Prefix:
    game = games[g]
    moves = list(game["Moves"])[:ply]
    header = str(game["Result"]) if header_shows_result(template) else None
    return Prefix(index, g, BALANCED, tuple(moves), render_prompt(template, game, moves), header)
