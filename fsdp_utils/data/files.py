"""Dataset file types, and their columns without reading them.

One builder per file type (the names are `datasets`' loaders'): `.parquet` (parquet), `.json` (a
list of objects, or JSON lines), `.jsonl` (json), `.csv` (csv), `.arrow` (arrow, e.g. the files
of `Dataset.save_to_disk`). A dataset is files of one type; `fsdp_utils.data.streaming` reads
their rows in batches. `peek_columns` reads only a schema or the first row, so the format can
be chosen (and the prepared cache found) without loading the data.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

BUILDERS = {
    ".parquet": "parquet",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".arrow": "arrow",
}


def builder_of(files: list[Path]) -> str:
    """The `datasets` builder of the files; mixed or unknown types are a ValueError."""
    suffixes = sorted({f.suffix for f in files})
    unknown = [s or "(no suffix)" for s in suffixes if s not in BUILDERS]
    if unknown:
        raise ValueError(
            f"Unsupported data file type {', '.join(unknown)}: --dataset reads "
            f"{', '.join(BUILDERS)} files. Convert the data, or read it yourself in a "
            "--dataset_module file.py:function that returns rows."
        )
    builders = sorted({BUILDERS[s] for s in suffixes})
    if len(builders) > 1:
        raise ValueError(
            f"Mixed data file types {suffixes}: a dataset is files of one type. Choose them "
            "with --dataset_include (e.g. '*.parquet')."
        )
    return builders[0]


def peek_columns(files: list[Path]) -> list[str]:
    """The column names of the first file, from its schema or its first row."""
    builder = builder_of(files)
    path = files[0]
    if builder == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    if builder == "arrow":
        import pyarrow as pa

        with pa.memory_map(str(path)) as source:
            try:
                return list(pa.ipc.open_stream(source).schema.names)
            except pa.ArrowInvalid:  # the random-access file format
                return list(pa.ipc.open_file(source).schema.names)
    if builder == "csv":
        with open(path, newline="", encoding="utf-8") as f:
            return next(csv.reader(f), [])
    return list(_first_json_row(path))


def _first_json_row(path: Path) -> dict[str, Any]:
    """The first object of JSON lines or of a JSON list, reading no more than it needs."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        text = ""
        while True:
            chunk = f.read(1 << 16)
            text += chunk
            body = text.lstrip()
            if body.startswith("["):
                body = body[1:].lstrip()
            try:
                row, _ = decoder.raw_decode(body)
            except json.JSONDecodeError:
                if chunk:
                    continue
                raise ValueError(f"{path} does not start with a JSON object.") from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}: rows must be JSON objects (one per line, or a list of them), "
                    f"got {type(row).__name__}."
                )
            return row
