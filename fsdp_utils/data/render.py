"""How a chess game of `laion/strategic_game_chess` becomes training text.

A row has `Moves` (a list of UCI strings such as "e2e4"), `Termination` (a python-chess
termination name such as "CHECKMATE") and `Result` ("1-0", "0-1", "1/2-1/2"). The default
template (`fsdp_utils.config.train_config.DEFAULT_TEMPLATE`) puts the outcome first so the model learns to
play towards a stated result:

    [Result 1-0] [Termination CHECKMATE] e2e4 e7e5 g1f3 ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_utils.config.train_config import DEFAULT_TEMPLATE

CHESS_COLUMNS = ("Moves", "Termination", "Result")


def render_game(
    moves: Sequence[str], termination: str, result: str, template: str = DEFAULT_TEMPLATE
) -> str:
    return template.format(moves=" ".join(moves), termination=termination, result=result)


def render_row(row: Mapping[str, Any], template: str = DEFAULT_TEMPLATE) -> str:
    return render_game(row["Moves"], row["Termination"], row["Result"], template)


def is_chess_schema(column_names: Sequence[str]) -> bool:
    return all(c in column_names for c in CHESS_COLUMNS)
