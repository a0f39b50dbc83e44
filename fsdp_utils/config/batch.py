"""Batch arithmetic: hold the total batch fixed whatever the number of devices.

    total_batch_size = batch_size_per_device x world_size x gradient_accumulation_steps

Given the total and the per-device batch, accumulation is derived; a total that does not divide
is a `ValueError` that shows every number and the nearest settings that work, raised before any
model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_utils.config.train_config import DEFAULT_TOTAL_BATCH_SIZE, TrainConfig


@dataclass(frozen=True)
class BatchPlan:
    total_batch_size: int
    batch_size_per_device: int
    world_size: int
    gradient_accumulation_steps: int
    seq_length: int
    # Sequences per example: 2 for DPO, whose batch sizes count pairs (a chosen and a rejected
    # sequence each: fsdp_utils/data/preference.py).
    sequences_per_example: int = 1

    @property
    def tokens_per_step(self) -> int:
        """Tokens (sequence positions) per optimizer step, over all devices."""
        return self.total_batch_size * self.sequences_per_example * self.seq_length

    @property
    def example_name(self) -> str:
        return "pairs (2 sequences each)" if self.sequences_per_example == 2 else "sequences"

    def describe(self) -> str:
        return (
            f"total batch {self.total_batch_size} {self.example_name} = "
            f"{self.batch_size_per_device} per "
            f"device x {self.world_size} devices x {self.gradient_accumulation_steps} "
            f"accumulation steps; {self.seq_length} tokens per sequence -> "
            f"{self.tokens_per_step:,} tokens per optimizer step"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def nearest_valid_settings(total: int, per_device: int, world_size: int) -> list[str]:
    """Human-readable alternatives that divide, closest first."""
    suggestions: list[str] = []
    step = per_device * world_size
    lower, upper = (total // step) * step, -(-total // step) * step
    for candidate in sorted({lower, upper} - {0}, key=lambda c: abs(c - total)):
        suggestions.append(
            f"--total_batch_size {candidate} "
            f"(= {per_device} x {world_size} x {candidate // step} accumulation)"
        )
    if total % world_size == 0:
        per_rank = total // world_size
        # Never suggest a larger per-device batch than asked: it may not fit in memory.
        best = max(d for d in _divisors(per_rank) if d <= per_device)
        if best != per_device:
            suggestions.append(
                f"--batch_size_per_device {best} "
                f"(= {best} x {world_size} x {per_rank // best} accumulation)"
            )
    else:
        worlds = [w for w in _divisors(total) if total % (w * per_device) == 0]
        if worlds:
            nearest = min(worlds, key=lambda w: abs(w - world_size))
            suggestions.append(
                f"{nearest} devices in all (= {per_device} x {nearest} x "
                f"{total // (per_device * nearest)} accumulation)"
            )
    return suggestions


def plan_batch(config: TrainConfig, world_size: int) -> BatchPlan:
    """Derive (or check) gradient accumulation for `world_size` devices."""
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}.")
    per_device = config.batch_size_per_device
    step = per_device * world_size
    total, accum = config.total_batch_size, config.gradient_accumulation_steps
    if total is None:
        total = step * accum if accum is not None else DEFAULT_TOTAL_BATCH_SIZE
    if total % step != 0 or total < step:
        alternatives = "\n".join(
            f"  {s}" for s in nearest_valid_settings(total, per_device, world_size)
        )
        raise ValueError(
            f"The total batch size does not divide: total_batch_size={total} must be a multiple "
            f"of batch_size_per_device x world_size = {per_device} x {world_size} = {step} "
            f"({total} / {step} = {total / step:.3g} accumulation steps). "
            f"Settings that work:\n{alternatives}"
        )
    derived = total // step
    if accum is not None and accum != derived:
        raise ValueError(
            f"--gradient_accumulation_steps {accum} contradicts --total_batch_size {total}: with "
            f"batch_size_per_device={per_device} and world_size={world_size} the total batch "
            f"needs {total} / ({per_device} x {world_size}) = {derived} accumulation steps. "
            "Give only --total_batch_size (recommended: it stays fixed when the number of GPUs "
            "changes) or make the three agree."
        )
    return BatchPlan(
        total_batch_size=total,
        batch_size_per_device=per_device,
        world_size=world_size,
        gradient_accumulation_steps=derived,
        seq_length=config.max_seq_length,
        sequences_per_example=2 if config.trains_on_pairs else 1,
    )
