"""Tokens on disk: rows appended to flat files as they are tokenised, then written into a split's
prepared arrays block by block, so that preparation holds a few batches of rows in memory and
never the whole dataset (`fsdp_utils.data.prepare`).

- `TokenSpill`: each row's tokens (and loss mask) appended as it comes, in file order; what stays
  in memory is one length per row.
- `SpilledRows`: reads any row back (`os.pread`: the page cache, not this process, holds the file).
- `write_stream`, `write_padded`, `write_packed`: a split's rows, in split order, into the arrays
  `fsdp_utils.data.blocks.TokenBlocks` memory-maps, written as `.npy` files a chunk of blocks at
  a time. They place rows exactly as `fsdp_utils.data.packing`'s in-memory packers do
  (`pack_stream`, `pad_documents`, `pack_rows`: best-fit decreasing over the split's lengths).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from fsdp_utils.data.packing import best_fit_decreasing

BLOCKS_PER_WRITE = 1024  # blocks assembled in memory before they are written


class TokenSpill:
    """Rows' tokens (int32) and, for the masked formats, loss masks (uint8), appended to
    `folder`'s spill files in the order they are given."""

    def __init__(self, folder: Path, *, masked: bool) -> None:
        self.ids_path = folder / "spill_ids.bin"
        self.mask_path = folder / "spill_mask.bin" if masked else None
        self._ids: BinaryIO = open(self.ids_path, "wb")  # noqa: SIM115 - closed in close()
        self._mask: BinaryIO | None = open(self.mask_path, "wb") if self.mask_path else None  # noqa: SIM115
        self._lengths: list[np.ndarray] = []

    def append(self, ids: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Rows `lengths` long, concatenated in `ids` (and `mask`)."""
        self._ids.write(np.ascontiguousarray(ids, dtype=np.int32).tobytes())
        if self._mask is not None:
            assert mask is not None
            self._mask.write(np.ascontiguousarray(mask, dtype=np.uint8).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int32))  # a row's: < 2**31 tokens

    def close(self) -> SpilledRows:
        self._ids.close()
        if self._mask is not None:
            self._mask.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        self._lengths = []
        return SpilledRows(self.ids_path, self.mask_path, lengths)


class SpilledRows:
    """The spilled rows, read back one at a time."""

    def __init__(self, ids_path: Path, mask_path: Path | None, lengths: np.ndarray) -> None:
        self.lengths = lengths
        self.offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, dtype=np.int64, out=self.offsets[1:])
        self._ids = os.open(ids_path, os.O_RDONLY)
        self._mask = os.open(mask_path, os.O_RDONLY) if mask_path else None
        self._paths = [p for p in (ids_path, mask_path) if p is not None]

    def ids(self, row: int) -> np.ndarray:
        start, n = int(self.offsets[row]), int(self.lengths[row])
        return np.frombuffer(os.pread(self._ids, 4 * n, 4 * start), dtype=np.int32)

    def mask(self, row: int) -> np.ndarray:
        assert self._mask is not None
        start, n = int(self.offsets[row]), int(self.lengths[row])
        return np.frombuffer(os.pread(self._mask, n, start), dtype=np.uint8)

    def close(self, *, delete: bool = True) -> None:
        for fd in (self._ids, self._mask):
            if fd is not None:
                os.close(fd)
        if delete:
            for path in self._paths:
                path.unlink(missing_ok=True)


class NpyWriter:
    """A `.npy` file of a known shape written front to back (np.load reads it, memory-mapped)."""

    def __init__(self, path: Path, shape: tuple[int, ...], dtype: Any) -> None:
        self.dtype = np.dtype(dtype)
        self.remaining = int(np.prod(shape))
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close()
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False}
        np.lib.format.write_array_header_1_0(self._file, {**header, "shape": shape})

    def write(self, values: np.ndarray) -> None:
        self.remaining -= values.size
        assert self.remaining >= 0
        self._file.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())

    def close(self) -> None:
        assert self.remaining == 0, self.remaining
        self._file.close()


@dataclass(frozen=True)
class Written:
    tokens: int
    blocks: int
    slots: int
    trained: int = 0


def write_stream(rows: SpilledRows, order: np.ndarray, block: int, pad: int, out: Path) -> Written:
    """`pack_stream` on disk: the rows in `order`, one token stream, cut into full blocks; only
    the last may be partial. Writes `out`_input_ids.npy and `out`_lengths.npy."""
    total = int(rows.lengths[order].sum(dtype=np.int64))
    n_blocks = -(-total // block)
    lengths = np.full(n_blocks, block, dtype=np.int32)
    if n_blocks:
        lengths[-1] = total - (n_blocks - 1) * block
    ids_out = NpyWriter(Path(f"{out}_input_ids.npy"), (n_blocks, block), np.int32)
    chunk = block * BLOCKS_PER_WRITE
    pending: list[np.ndarray] = []
    held = 0
    for row in order:
        pending.append(rows.ids(int(row)))
        held += len(pending[-1])
        if held >= chunk:
            stream = np.concatenate(pending)
            ids_out.write(stream[:chunk])
            pending, held = [stream[chunk:]], len(stream) - chunk
    tail = np.concatenate(pending) if pending else np.zeros(0, np.int32)
    padded = np.full(-(-len(tail) // block) * block, pad, dtype=np.int32)
    padded[: len(tail)] = tail
    ids_out.write(padded)
    ids_out.close()
    np.save(Path(f"{out}_lengths.npy"), lengths)
    return Written(total, n_blocks, n_blocks * block)


def write_padded(rows: SpilledRows, order: np.ndarray, block: int, pad: int, out: Path) -> Written:
    """`pad_documents` on disk: one row per block, truncated to `block` and right-padded."""
    lengths = np.minimum(rows.lengths[order], block).astype(np.int32)
    ids_out = NpyWriter(Path(f"{out}_input_ids.npy"), (len(order), block), np.int32)
    tokens = int(lengths.sum(dtype=np.int64))
    for start in range(0, len(order), BLOCKS_PER_WRITE):
        part = order[start : start + BLOCKS_PER_WRITE]
        blocks = np.full((len(part), block), pad, dtype=np.int32)
        for i, row in enumerate(part):
            ids = rows.ids(int(row))[:block]
            blocks[i, : len(ids)] = ids
        ids_out.write(blocks)
    ids_out.close()
    np.save(Path(f"{out}_lengths.npy"), lengths)
    return Written(tokens, len(order), len(order) * block)


def write_packed(
    rows: SpilledRows, order: np.ndarray, block: int, pad: int, out: Path, *, packing: bool
) -> Written:
    """`pack_rows` on disk: whole rows (each at most `block` long), in `order`, placed by
    best-fit decreasing over their lengths (or one per block without `packing`). Writes
    input_ids, lengths, loss_mask and row_starts; a row's first token is never a target."""
    lengths = rows.lengths[order]
    if packing:
        bin_of, at = best_fit_decreasing(lengths, block)
        n_blocks = int(bin_of.max()) + 1 if len(bin_of) else 0
    else:
        bin_of, at = np.arange(len(order), dtype=np.int32), np.zeros(len(order), np.int32)
        n_blocks = len(order)
    used = np.bincount(bin_of, weights=lengths, minlength=n_blocks).astype(np.int32)
    # Rows grouped by block, blocks in order; int32 (4 bytes a row): it lives as long as the
    # writing, beside the split's other per-row arrays.
    by_block = np.argsort(bin_of, kind="stable").astype(np.int32)
    first = np.searchsorted(bin_of[by_block], np.arange(n_blocks + 1))
    shape = (n_blocks, block)
    writers = {
        "input_ids": NpyWriter(Path(f"{out}_input_ids.npy"), shape, np.int32),
        "loss_mask": NpyWriter(Path(f"{out}_loss_mask.npy"), shape, bool),
        "row_starts": NpyWriter(Path(f"{out}_row_starts.npy"), shape, bool),
    }
    trained = 0
    for start in range(0, n_blocks, BLOCKS_PER_WRITE):
        stop = min(start + BLOCKS_PER_WRITE, n_blocks)
        ids = np.full((stop - start, block), pad, dtype=np.int32)
        mask = np.zeros((stop - start, block), dtype=bool)
        starts = np.zeros((stop - start, block), dtype=bool)
        for k in by_block[first[start] : first[stop]]:
            row, b, offset = int(order[k]), int(bin_of[k]) - start, int(at[k])
            n = int(lengths[k])
            ids[b, offset : offset + n] = rows.ids(row)
            mask[b, offset : offset + n] = rows.mask(row).astype(bool)
            starts[b, offset] = True
        mask[starts] = False  # a row's first token is never a target
        trained += int(mask.sum())
        writers["input_ids"].write(ids)
        writers["loss_mask"].write(mask)
        writers["row_starts"].write(starts)
    for writer in writers.values():
        writer.close()
    np.save(Path(f"{out}_lengths.npy"), used)
    return Written(int(lengths.sum(dtype=np.int64)), n_blocks, n_blocks * block, trained)
