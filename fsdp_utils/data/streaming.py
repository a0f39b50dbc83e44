"""Reading dataset files in batches of rows, in file order, without loading them whole.

Preparation (`fsdp_utils.data.prepare`) reads the rows once, a batch at a time, so its memory does
not grow with the data; nothing is copied (no `datasets` Arrow cache beside the prepared arrays).
One reader per file type, as `fsdp_utils.data.files.BUILDERS` names them: JSON lines line by line
(a bad line is a ValueError naming the file and line), a `.json` file holding one list parsed
whole (the format has no other way), parquet by row group, CSV and Arrow by record batch. Each
batch is a dict of columns (`columns`: the names the format was chosen by; a row without one
gets None, as `datasets` gives it), the shape `RowEncoder` and the renderers take.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fsdp_utils.data.files import builder_of

Batch = dict[str, list[Any]]


def count_rows(files: list[Path]) -> int:
    """The number of rows, from metadata where the format has it (parquet, Arrow), else by
    reading (JSON lines: counting lines is fast; CSV and a JSON list: parsed)."""
    builder = builder_of(files)
    if builder == "parquet":
        import pyarrow.parquet as pq

        return sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    if builder == "json":
        total = 0
        for path in files:
            if _is_json_list(path):
                total += len(_json_list(path))
            else:
                with open(path, "rb") as f:
                    total += sum(1 for line in f if line.strip())
        return total
    return sum(len(b[next(iter(b))]) if b else 0 for b in row_batches(files, None, 1 << 16))


def row_batches(files: list[Path], columns: list[str] | None, size: int) -> Iterator[Batch]:
    """The rows of `files` in order, `size` at a time, as dicts of columns (`columns`, or
    every column of the file)."""
    builder = builder_of(files)
    for path in files:
        if builder == "json":
            yield from _json_batches(path, columns, size)
        elif builder == "parquet":
            import pyarrow.parquet as pq

            parquet = pq.ParquetFile(path)
            for record_batch in parquet.iter_batches(batch_size=size, columns=columns):
                yield _with_columns(record_batch.to_pydict(), columns)
        elif builder == "csv":
            yield from _csv_batches(path, columns, size)
        else:
            yield from _arrow_batches(path, columns, size)


def dataset_batches(dataset: Any, size: int) -> Iterator[Batch]:
    """A `datasets.Dataset` (a --dataset_module's rows, in memory) in batches of columns."""
    for start in range(0, len(dataset), size):
        yield dict(dataset[start : start + size])


def _with_columns(batch: Batch, columns: list[str] | None) -> Batch:
    if columns is None:
        return batch
    n = len(next(iter(batch.values()))) if batch else 0
    return {c: batch[c] if c in batch else [None] * n for c in columns}


def _is_json_list(path: Path) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        while True:
            chunk = f.read(1 << 12)
            if not chunk:
                return False
            head = chunk.lstrip()
            if head:
                return head.startswith("[")


def _json_list(path: Path) -> list[Any]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno}). Fix the file "
            "(python -m json.tool checks it), then run the same command again."
        ) from None
    return rows if isinstance(rows, list) else [rows]


def _json_batches(path: Path, columns: list[str] | None, size: int) -> Iterator[Batch]:
    if _is_json_list(path):
        whole = _json_list(path)
        for start in range(0, len(whole), size):
            yield _columns_of(whole[start : start + size], path, columns)
        return
    rows: list[Any] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                text = line.strip()
                excerpt = repr(text if len(text) <= 80 else text[:80] + "...")
                raise ValueError(
                    f"{path}:{number}: not a valid JSON line ({err.msg}, column {err.colno}): "
                    f"{excerpt}. Fix or remove that line (python -m json.tool checks a file), "
                    "then run the same command again."
                ) from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}:{number}: a row must be a JSON object, got {type(row).__name__}. "
                    "Fix or remove that line, then run the same command again."
                )
            rows.append(row)
            if len(rows) == size:
                yield _columns_of(rows, path, columns)
                rows = []
    if rows:
        yield _columns_of(rows, path, columns)


def _columns_of(rows: list[Any], path: Path, columns: list[str] | None) -> Batch:
    for row in rows:
        if not isinstance(row, dict):
            raise ValueError(
                f"{path}: rows must be JSON objects (one per line, or a list of them), got "
                f"{type(row).__name__}."
            )
    names = columns if columns is not None else list(dict.fromkeys(k for r in rows for k in r))
    return {c: [r.get(c) for r in rows] for c in names}


def _csv_batches(path: Path, columns: list[str] | None, size: int) -> Iterator[Batch]:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from fsdp_utils.data.files import peek_columns

    names = peek_columns([path])
    # Every column as text, as written: a type guessed from the first block may not fit a later one.
    convert = pacsv.ConvertOptions(column_types={c: pa.string() for c in names})
    reader = pacsv.open_csv(path, convert_options=convert)
    pending: Batch = {}
    for record_batch in reader:
        part = record_batch.to_pydict()
        for key, values in part.items():
            pending.setdefault(key, []).extend(values)
        while pending and len(next(iter(pending.values()))) >= size:
            yield _with_columns({k: v[:size] for k, v in pending.items()}, columns)
            pending = {k: v[size:] for k, v in pending.items()}
    if pending and len(next(iter(pending.values()))):
        yield _with_columns(pending, columns)


def _arrow_batches(path: Path, columns: list[str] | None, size: int) -> Iterator[Batch]:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            reader: Any = pa.ipc.open_stream(source)
            batches = iter(reader)
        except pa.ArrowInvalid:  # the random-access file format
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        for record_batch in batches:
            for start in range(0, record_batch.num_rows, size):
                part = record_batch.slice(start, size)
                yield _with_columns(part.to_pydict(), columns)
