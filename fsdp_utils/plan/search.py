"""Which per-device batch sizes a run allows, and the largest that fits (binary search)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fsdp_utils.config.batch import plan_batch
from fsdp_utils.config.train_config import TrainConfig


def resolved_total_batch(config: TrainConfig, world_size: int) -> int:
    """The total batch the run holds fixed (what `plan_batch` derives for this config)."""
    return plan_batch(config, world_size).total_batch_size


def batch_candidates(total_batch_size: int, world_size: int) -> list[int]:
    """Per-device batch sizes that divide the total batch on `world_size` devices, ascending."""
    if total_batch_size % world_size != 0:
        raise ValueError(
            f"The total batch of {total_batch_size} sequences cannot be split over "
            f"{world_size} GPUs, whatever the batch per device. Use a --total_batch_size that "
            f"is a multiple of {world_size}."
        )
    per_rank = total_batch_size // world_size
    return [b for b in range(1, per_rank + 1) if per_rank % b == 0]


def largest_fitting(candidates: Sequence[int], fits: Callable[[int], bool]) -> int | None:
    """The largest candidate for which `fits` holds, assuming that memory grows with the batch
    (if b fits, every smaller b fits): about log2(len) + 1 calls instead of len."""
    best = None
    low, high = 0, len(candidates) - 1
    while low <= high:
        middle = (low + high) // 2
        if fits(candidates[middle]):
            best = candidates[middle]
            low = middle + 1
        else:
            high = middle - 1
    return best
