"""Tokens into fixed-length blocks: the arrays a prepared split is made of.

Two packers:
- `pack_stream` (chess, text): the documents' token stream, EOS between documents, cut into
  full blocks; a document may run from one block into the next. Every token is trained.
- `pack_rows` (chat, prompt/completion, alpaca, templates): whole rows, each at most a block
  long, placed into blocks by best-fit decreasing (fewest blocks; the rest is padding). A
  row never spans two blocks, its loss mask travels with it, and its first token is never a
  target (it would be predicted from the row before). The row starts are stored, for
  `--document_masking`: the end-of-turn token of many chat templates is the tokenizer's EOS
  (ChatML's <|im_end|> in Qwen), so EOS cannot mark where a conversation ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def pack_stream(flat: np.ndarray, block: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut the token stream into full blocks; only the final block may be partial (padded).
    Returns (input_ids, lengths)."""
    n_blocks = -(-len(flat) // block)
    padded = np.full(n_blocks * block, pad, dtype=np.int32)
    padded[: len(flat)] = flat
    lengths = np.full(n_blocks, block, dtype=np.int32)
    if n_blocks:
        lengths[-1] = len(flat) - (n_blocks - 1) * block
    return padded.reshape(n_blocks, block), lengths


def pad_documents(
    flat: np.ndarray, offsets: np.ndarray, block: int, pad: int
) -> tuple[np.ndarray, np.ndarray]:
    """One document per row, truncated to `block` tokens and right-padded (the original
    scripts' way). Returns (input_ids, lengths)."""
    n_docs = len(offsets) - 1
    out = np.full((n_docs, block), pad, dtype=np.int32)
    lengths = np.minimum(np.diff(offsets), block).astype(np.int32)
    for i in range(n_docs):
        out[i, : lengths[i]] = flat[offsets[i] : offsets[i] + lengths[i]]
    return out, lengths


@dataclass(frozen=True)
class PackedRows:
    input_ids: np.ndarray  # (blocks, block) int32
    lengths: np.ndarray  # (blocks,) int32: tokens in use; the rest is padding
    loss_mask: np.ndarray  # (blocks, block) bool: the positions trained as targets
    row_starts: np.ndarray  # (blocks, block) bool: where each row begins


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Bin of each item and its offset in the bin: items longest first, each into the fullest
    bin it fits in (a new one if none). Ties keep the input order, so the result is a pure
    function of the input. O(n x capacity / vector width): bins are bucketed by free space."""
    assert (lengths >= 1).all() and (lengths <= capacity).all()
    order = np.argsort(-lengths, kind="stable")
    bins_with_free: list[list[int]] = [[] for _ in range(capacity + 1)]
    any_with_free = np.zeros(capacity + 1, dtype=bool)
    free: list[int] = []
    # int32: 8 bytes a row instead of 16, in the preparation's peak (a bin's index and a place
    # in it stay far below 2**31); positions computed from them are widened first (pack_rows).
    bin_of = np.empty(len(lengths), dtype=np.int32)
    offset = np.empty(len(lengths), dtype=np.int32)
    for item in order:
        size = int(lengths[item])
        fits = int(np.argmax(any_with_free[size:])) + size  # least free space >= size
        if any_with_free[fits]:
            b = bins_with_free[fits].pop()
            any_with_free[fits] = bool(bins_with_free[fits])
        else:
            b = len(free)
            free.append(capacity)
        bin_of[item], offset[item] = b, capacity - free[b]
        free[b] -= size
        if free[b]:
            bins_with_free[free[b]].append(b)
            any_with_free[free[b]] = True
    return bin_of, offset


def pack_rows(
    ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray, block: int, pad: int, *, packing: bool
) -> PackedRows:
    """Rows (flat `ids` and `mask`, row i at offsets[i]:offsets[i + 1], each at most `block`
    long) into blocks: packed by best-fit decreasing, or one row per block (`packing` off)."""
    lengths = np.diff(offsets).astype(np.int64)
    if packing:
        bin_of, at = best_fit_decreasing(lengths, block)
        n_blocks = int(bin_of.max()) + 1 if len(bin_of) else 0
    else:
        bin_of, at, n_blocks = (
            np.arange(len(lengths)),
            np.zeros(len(lengths), np.int64),
            len(lengths),
        )
    starts = bin_of.astype(np.int64) * block + at  # flat position of each row's first token
    # Every token's flat position: its row's start plus its place in the row.
    positions = np.repeat(starts - offsets[:-1], lengths) + np.arange(int(offsets[-1]))
    input_ids = np.full(n_blocks * block, pad, dtype=np.int32)
    input_ids[positions] = ids
    loss_mask = np.zeros(n_blocks * block, dtype=bool)
    loss_mask[positions] = mask.astype(bool)
    row_starts = np.zeros(n_blocks * block, dtype=bool)
    row_starts[starts] = True
    loss_mask[starts] = False  # a row's first token is never a target
    used = np.bincount(bin_of, weights=lengths, minlength=n_blocks).astype(np.int32)
    shape = (n_blocks, block)
    return PackedRows(
        input_ids.reshape(shape), used, loss_mask.reshape(shape), row_starts.reshape(shape)
    )
