"""Prepared blocks at training time, and which of them every rank sees at every step.

`TokenBlocks` memory-maps a split prepared by `fsdp_utils.data.prepare` and turns block indices
into batches: `input_ids` and `labels` (IGNORE_INDEX on padding). With `--document_masking`
batches also carry position ids that restart after every EOS (`fsdp_utils.data.document_masking`):
derived at batch time, not stored, so the prepared layout and its cache key are unchanged.
`StepSampler` makes the data order a pure function of the step, whatever the world size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fsdp_utils.config.batch import BatchPlan
from fsdp_utils.data.document_masking import document_position_ids

# --- training-time access -------------------------------------------------------------------


@dataclass(frozen=True)
class TokenBlocks:
    input_ids: np.ndarray  # (blocks, seq_len) int32, memory-mapped
    lengths: np.ndarray  # (blocks,) int32
    document_eos: int | None = None  # set: batches carry per-document position ids

    @classmethod
    def load(cls, folder: Path, split: str, *, document_eos: int | None = None) -> TokenBlocks:
        ids = folder / f"{split}_input_ids.npy"
        if not ids.is_file():
            return cls(np.zeros((0, 1), np.int32), np.zeros(0, np.int32), document_eos)
        return cls(
            np.load(ids, mmap_mode="r"),
            np.load(folder / f"{split}_lengths.npy", mmap_mode="r"),
            document_eos,
        )

    def __len__(self) -> int:
        return len(self.lengths)

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """input_ids and labels; labels are IGNORE_INDEX on padding (the model shifts them).
        With document masking also position_ids, restarting at every document."""
        order = np.sort(indices)  # sequential reads from the memory map
        rows = torch.from_numpy(np.ascontiguousarray(self.input_ids[order])).long()
        lengths = torch.from_numpy(np.ascontiguousarray(self.lengths[order])).long()
        restore = np.argsort(np.argsort(indices))
        rows, lengths = rows[restore], lengths[restore]
        positions = torch.arange(rows.shape[1]).unsqueeze(0)
        labels = rows.masked_fill(positions >= lengths.unsqueeze(1), IGNORE_INDEX)
        if self.document_eos is None:
            return {"input_ids": rows, "labels": labels}
        position_ids = document_position_ids(rows, self.document_eos)
        return {"input_ids": rows, "labels": labels, "position_ids": position_ids}


def batch_position_ids(batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The batch's per-document position ids on `device`, or None (positions 0..T-1). Passed
    to the model with no attention mask and use_cache=False, or transformers ignores them
    for packing (fsdp_utils.data.document_masking)."""
    position_ids = batch.get("position_ids")
    return None if position_ids is None else position_ids.to(device, non_blocking=True)


class StepSampler:
    """Which blocks every rank sees at every optimizer step; a pure function of the step.

    Step s of epoch e = s // steps_per_epoch takes the global batch
    perm_e[(s % steps_per_epoch) * total : ... + total], with perm_e a permutation seeded by
    (seed, e). It is split into (accumulation, world, per-device) micro-batches. The set of
    sequences in a step therefore does not depend on how many devices share it, and a resumed
    run only needs the step number to see the same data in the same order.
    """

    def __init__(self, num_blocks: int, plan: BatchPlan, seed: int) -> None:
        if num_blocks < plan.total_batch_size:
            raise ValueError(
                f"The training split has only {num_blocks} blocks of {plan.seq_length} tokens, "
                f"fewer than one total batch ({plan.total_batch_size} sequences). Use more data "
                "(--dataset_include, --max_examples), a smaller --total_batch_size or a smaller "
                "--max_seq_length."
            )
        self.num_blocks = num_blocks
        self.plan = plan
        self.seed = seed
        self.steps_per_epoch = num_blocks // plan.total_batch_size
        self._cached_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._cached_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_blocks)
            self._cached_epoch = epoch
        return self._perm

    def global_batch(self, step: int) -> np.ndarray:
        epoch, position = divmod(step, self.steps_per_epoch)
        total = self.plan.total_batch_size
        return self._permutation(epoch)[position * total : (position + 1) * total]

    def batch_fingerprint(self, step: int) -> str:
        """Short hash of the blocks of a step: lets the metrics log show that two runs (or a
        run and its resumption) saw the same data in the same order."""
        return hashlib.sha1(self.global_batch(step).astype(np.int64).tobytes()).hexdigest()[:12]

    def micro_batches(self, step: int, rank: int) -> list[np.ndarray]:
        p = self.plan
        grid = self.global_batch(step).reshape(
            p.gradient_accumulation_steps, p.world_size, p.batch_size_per_device
        )
        return [grid[m, rank] for m in range(p.gradient_accumulation_steps)]


def eval_batches(
    num_blocks: int, batch_size: int, rank: int, world_size: int, max_batches: int
) -> list[np.ndarray]:
    """This rank's share of the eval split, in fixed order.

    Every rank gets the same number of blocks (and so of forward passes: FSDP's collectives
    would hang otherwise); the remainder of num_blocks / world_size is left out.
    """
    mine = np.arange(rank, (num_blocks // world_size) * world_size, world_size)
    batches = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
    return batches[:max_batches]


IGNORE_INDEX = -100  # labels carrying no loss (padding)
