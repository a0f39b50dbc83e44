"""Prepared blocks at training time, and which of them every rank sees at every step.

`TokenBlocks` memory-maps a split prepared by `fsdp_utils.data.prepare` and turns block indices
into batches: `input_ids` and `labels` (IGNORE_INDEX on padding, and where the split's loss
mask is off: the prompts of chat and instruction data). With `--document_masking` batches
also carry position ids that restart at every document (`fsdp_utils.data.document_masking`):
after every EOS for chess and text (derived at batch time, not stored), at the stored row
starts for the masked formats. `StepSampler` makes the data order a pure function of the
step, whatever the world size; `--num_epochs` turns into steps with `epoch_steps`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fsdp_utils.config.batch import BatchPlan
from fsdp_utils.config.train_config import TrainConfig, validate_config
from fsdp_utils.data.document_masking import document_position_ids, positions_from_starts

# --- training-time access -------------------------------------------------------------------


@dataclass(frozen=True)
class TokenBlocks:
    input_ids: np.ndarray  # (blocks, seq_len) int32, memory-mapped
    lengths: np.ndarray  # (blocks,) int32
    document_eos: int | None = None  # set: batches carry per-document position ids
    loss_mask: np.ndarray | None = None  # (blocks, seq_len) bool: masked formats only
    row_starts: np.ndarray | None = None  # (blocks, seq_len) bool: document masking of rows

    @classmethod
    def load(
        cls,
        folder: Path,
        split: str,
        *,
        document_eos: int | None = None,
        row_starts: bool = False,
    ) -> TokenBlocks:
        """A prepared split. `document_eos`: position ids restart after this token;
        `row_starts`: they restart at the stored row starts (masked formats)."""
        ids = folder / f"{split}_input_ids.npy"
        if not ids.is_file():
            return cls(np.zeros((0, 1), np.int32), np.zeros(0, np.int32), document_eos)
        mask = folder / f"{split}_loss_mask.npy"
        return cls(
            np.load(ids, mmap_mode="r"),
            np.load(folder / f"{split}_lengths.npy", mmap_mode="r"),
            document_eos,
            np.load(mask, mmap_mode="r") if mask.is_file() else None,
            np.load(folder / f"{split}_row_starts.npy", mmap_mode="r") if row_starts else None,
        )

    def __len__(self) -> int:
        return len(self.lengths)

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """input_ids and labels; labels are IGNORE_INDEX on padding and outside the loss mask
        (the model shifts them). With document masking also position_ids, restarting at
        every document."""
        order = np.sort(indices)  # sequential reads from the memory map
        restore = np.argsort(np.argsort(indices))

        def read(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array[order]))[restore]

        rows, lengths = read(self.input_ids).long(), read(self.lengths).long()
        positions = torch.arange(rows.shape[1]).unsqueeze(0)
        labels = rows.masked_fill(positions >= lengths.unsqueeze(1), IGNORE_INDEX)
        if self.loss_mask is not None:
            labels = labels.masked_fill(~read(self.loss_mask), IGNORE_INDEX)
        if self.row_starts is not None:
            position_ids = positions_from_starts(read(self.row_starts))
        elif self.document_eos is not None:
            position_ids = document_position_ids(rows, self.document_eos)
        else:
            return {"input_ids": rows, "labels": labels}
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
        self.steps_per_epoch = steps_per_epoch(num_blocks, plan.total_batch_size)
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


def steps_per_epoch(num_blocks: int, total_batch_size: int) -> int:
    """Full total batches in the training blocks: an epoch leaves out the remainder (another
    one each epoch, as the order is reshuffled)."""
    return num_blocks // total_batch_size


def epoch_steps(
    config: TrainConfig, num_blocks: int, total_batch_size: int, repeat: int = 1
) -> TrainConfig:
    """--num_epochs: the config with max_training_steps = epochs x steps per epoch. A pure
    function of the prepared training blocks and the total batch (fixed whatever the number
    of GPUs), so a resumed or requeued run, or another world size, gets the same count.
    `repeat`: optimizer steps per total batch (GRPO's --num_iterations)."""
    assert config.num_epochs is not None
    steps = config.num_epochs * steps_per_epoch(num_blocks, total_batch_size) * repeat
    resolved = config.replace(max_training_steps=max(steps, 1), num_epochs=None)
    validate_config(resolved)  # the warmup against the step count, now that it is known
    return config.replace(max_training_steps=resolved.max_training_steps)


def describe_epochs(
    config: TrainConfig, num_blocks: int, total_batch_size: int, repeat: int = 1
) -> str:
    per_epoch = steps_per_epoch(num_blocks, total_batch_size) * repeat
    again = f", each batch {repeat} times" if repeat > 1 else ""
    return (
        f"epochs: {config.num_epochs} x {per_epoch} steps ({num_blocks:,} training blocks // "
        f"{total_batch_size} sequences per step{again}) = {config.max_training_steps} steps, "
        f"{config.resolved_warmup_steps} warmup"
    )


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
# A batch's key for labels already shifted (position t's target is token t + 1), as
# transformers' losses name them: a slice of a sequence under sequence parallelism carries
# them, since its last position's target is on another rank; its `labels` (its slice of the
# unshifted ones) then only count its tokens (fsdp_utils/data/sequence_slices.py).
SHIFT_LABELS = "shift_labels"


def next_token_labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[rows, positions]: the token each position of the batch predicts, IGNORE_INDEX where
    none. A whole sequence's last position predicts nothing and is left out ([rows, seq - 1]);
    a slice's shifted labels cover all its positions."""
    shifted = batch.get(SHIFT_LABELS)
    return shifted if shifted is not None else batch["labels"][:, 1:]
