"""Chess games in the schema of laion/strategic_game_chess, written as its parquet shards
(`Moves`: list of UCI strings, `Termination`: python-chess's Termination name, `Result`;
files `chess_game_NNNN.parquet`): the demo's games, the engine's self-play games
(`python -m fsdp_utils.chess_eval.selfplay`) and the tests' games. Self-play's labelled
positions lie beside them as `chess_position_NNNN.parquet`, which a folder read as a data set
leaves out (fsdp_utils.hub.selection.POSITION_SHARDS)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def shard_name(index: int) -> str:
    """File name of shard `index` in laion/strategic_game_chess (they start at 0001 there)."""
    return f"chess_game_{index:04d}.parquet"


def position_shard_name(index: int) -> str:
    """File name of the labelled positions drawn from games shard `index`."""
    return f"chess_position_{index:04d}.parquet"


def write_chess_shards(
    games: list[dict[str, Any]], folder: str | Path, num_shards: int = 1, first_index: int = 1
) -> list[Path]:
    """Write games as parquet shards with the laion schema (Moves: list<string>, ...)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    schema = pa.schema(
        [("Moves", pa.list_(pa.string())), ("Termination", pa.string()), ("Result", pa.string())]
    )
    paths = []
    per_shard = -(-len(games) // num_shards)
    for shard in range(num_shards):
        rows = games[shard * per_shard : (shard + 1) * per_shard]
        table = pa.Table.from_pylist(rows, schema=schema)
        path = folder / shard_name(first_index + shard)
        pq.write_table(table, path)
        paths.append(path)
    return paths
