"""Batch arithmetic: hold the total batch fixed whatever the number of devices.

    total_batch_size = batch_size_per_device x data-parallel ranks x gradient_accumulation_steps

The data-parallel ranks are the processes, or with `--sequence_parallel N` the groups of N
processes that share each sequence (world size / N).

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
    # The data-parallel ranks: ranks that read different sequences (the step sampler's grid).
    # The processes, or their groups of `sequence_parallel` that share each sequence.
    world_size: int
    gradient_accumulation_steps: int
    seq_length: int
    # Sequences per example: 2 for DPO, whose batch sizes count pairs (a chosen and a rejected
    # sequence each: fsdp_utils/data/preference.py); G for GRPO, whose batch sizes count
    # prompts (--num_generations completions each: fsdp_utils/data/prompts.py).
    sequences_per_example: int = 1
    prompts: bool = False  # the examples are prompts (GRPO), each sampled G times
    sequence_parallel: int = 1  # processes per sequence (--sequence_parallel)

    @property
    def devices(self) -> int:
        """The processes (GPUs) of the run."""
        return self.world_size * self.sequence_parallel

    @property
    def tokens_per_step(self) -> int:
        """Tokens (sequence positions) per optimizer step, over all devices."""
        return self.total_batch_size * self.sequences_per_example * self.seq_length

    @property
    def example_name(self) -> str:
        if self.prompts:
            return f"prompts ({self.sequences_per_example} completions each)"
        return "pairs (2 sequences each)" if self.sequences_per_example == 2 else "sequences"

    def describe(self) -> str:
        ranks = f"{self.world_size} devices"
        if self.sequence_parallel > 1:
            ranks = (
                f"{self.world_size} data-parallel groups of {self.sequence_parallel} devices "
                f"(each sequence split over a group: {self.seq_length // self.sequence_parallel}"
                " tokens per device)"
            )
        return (
            f"total batch {self.total_batch_size} {self.example_name} = "
            f"{self.batch_size_per_device} per device x {ranks} x "
            f"{self.gradient_accumulation_steps} accumulation steps; {self.seq_length} tokens "
            f"per sequence -> {self.tokens_per_step:,} tokens per optimizer step"
        )


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending."""
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
        best = max(d for d in divisors(per_rank) if d <= per_device)
        if best != per_device:
            suggestions.append(
                f"--batch_size_per_device {best} "
                f"(= {best} x {world_size} x {per_rank // best} accumulation)"
            )
    else:
        worlds = [w for w in divisors(total) if total % (w * per_device) == 0]
        if worlds:
            nearest = min(worlds, key=lambda w: abs(w - world_size))
            suggestions.append(
                f"{nearest} devices in all (= {per_device} x {nearest} x "
                f"{total // (per_device * nearest)} accumulation)"
            )
    return suggestions


def data_parallel_size(world_size: int, sequence_parallel: int) -> int:
    """The data-parallel ranks of `world_size` processes, each sequence split over
    `sequence_parallel` of them; ValueError, naming the valid values, if that does not divide."""
    if sequence_parallel < 1:
        raise ValueError(f"--sequence_parallel must be at least 1, got {sequence_parallel}.")
    if world_size % sequence_parallel:
        valid = ", ".join(str(d) for d in divisors(world_size))
        raise ValueError(
            f"--sequence_parallel {sequence_parallel} does not divide the {world_size} "
            f"processes: each sequence is split over N ranks of one data-parallel group, so N "
            f"must divide the world size. Valid values for {world_size} processes: {valid}."
        )
    return world_size // sequence_parallel


def plan_batch(config: TrainConfig, world_size: int) -> BatchPlan:
    """Derive (or check) gradient accumulation for `world_size` devices (with
    --sequence_parallel N: for their world_size / N data-parallel groups)."""
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}.")
    world_size = data_parallel_size(world_size, config.sequence_parallel)
    per_device = config.batch_size_per_device
    step = per_device * world_size
    total, accum = config.total_batch_size, config.gradient_accumulation_steps
    if total is None:
        total = step * accum if accum is not None else DEFAULT_TOTAL_BATCH_SIZE
    if total % step != 0 or total < step:
        alternatives = "\n".join(
            f"  {s}" for s in nearest_valid_settings(total, per_device, world_size)
        )
        ranks = "world_size"
        if config.sequence_parallel > 1:
            ranks = (
                f"data-parallel groups (processes / --sequence_parallel {config.sequence_parallel})"
            )
        raise ValueError(
            f"The total batch size does not divide: total_batch_size={total} must be a multiple "
            f"of batch_size_per_device x {ranks} = {per_device} x {world_size} = {step} "
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
        seq_length=config.seq_length,
        sequences_per_example=config.sequences_per_example,
        prompts=config.trains_on_prompts,
        sequence_parallel=config.sequence_parallel,
    )
