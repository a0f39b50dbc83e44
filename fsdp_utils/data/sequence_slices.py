"""Each rank's slice of a batch under sequence parallelism (`--sequence_parallel N`).

Every rank of a sequence-parallel group reads the same batch (`fsdp_utils.parallel.sequence`) and
keeps slice `rank` of N contiguous slices of each sequence. Three things must hold for the split
run to compute the unsplit run's loss and gradients, each caught by a test when broken
(tests/test_sequence_parallel.py):

- position ids are the whole sequence's (rank r's slice starts at r x slice, or wherever its
  documents' positions are under --document_masking), never restarted per slice: the rotary
  embeddings and the mask depend on them;
- the labels are shifted on the whole sequence before the split (`shift_labels`: position t's
  target is token t + 1), so the last position of a slice predicts the first token of the next
  slice, and no target is lost or counted twice;
- the loss is normalised by the target tokens of all ranks (`train.step`), each counted on the
  one rank that holds its position.

A sequence whose length N does not divide is padded at its end to the next multiple of N:
token 0, no target, positions that continue the sequence's. Padding after every real token
changes nothing before it under causal attention.
"""

from __future__ import annotations

import torch

from fsdp_utils.data.blocks import IGNORE_INDEX, SHIFT_LABELS

Batch = dict[str, torch.Tensor]


def padded_length(length: int, size: int) -> int:
    """`length` rounded up to a multiple of `size`."""
    return -(-length // size) * size


def slice_batch(batch: Batch, *, rank: int, size: int) -> Batch:
    """Slice `rank` of `size` of every sequence in `batch` (input ids, position ids, labels
    unshifted for counting tokens) with its targets shifted on the whole sequence
    (`shift_labels`); other keys (DPO's pair rows) unchanged. `size` 1: the batch itself."""
    if size == 1:
        return batch
    ids, labels = batch["input_ids"], batch["labels"]
    rows, length = ids.shape
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(length).expand(rows, length)
    shifted = torch.cat([labels[:, 1:], labels.new_full((rows, 1), IGNORE_INDEX)], dim=1)
    whole = {"input_ids": ids, "labels": labels, "position_ids": positions, SHIFT_LABELS: shifted}
    pad = padded_length(length, size) - length
    if pad:
        after = positions[:, -1:] + torch.arange(1, pad + 1)
        whole = {
            "input_ids": torch.cat([ids, ids.new_zeros((rows, pad))], dim=1),
            "labels": torch.cat([labels, labels.new_full((rows, pad), IGNORE_INDEX)], dim=1),
            "position_ids": torch.cat([positions, after], dim=1),
            SHIFT_LABELS: torch.cat([shifted, shifted.new_full((rows, pad), IGNORE_INDEX)], dim=1),
        }
    width = (length + pad) // size
    part = slice(rank * width, (rank + 1) * width)
    out = {key: value for key, value in batch.items() if key not in whole}
    out.update({key: value[:, part].contiguous() for key, value in whole.items()})
    return out


def describe_padding(length: int, size: int) -> str | None:
    """The line a run logs once when its sequences are padded for `size` slices; None when N
    divides the length."""
    padded = padded_length(length, size)
    if padded == length:
        return None
    return (
        f"sequence parallel: sequences of {length:,} tokens padded to {padded:,} (a multiple "
        f"of --sequence_parallel {size}, {padded // size:,} tokens per slice); the "
        f"{padded - length} padding position(s) at the end carry no loss and, being last, "
        "change nothing before them. Use a --max_seq_length that N divides to avoid them."
    )
