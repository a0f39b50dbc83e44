"""The batch: the total held fixed whatever the number of GPUs, the per-device batch, the
sequence length (the arithmetic: fsdp_utils/config/batch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .section import Section, check_at_least

SECTION = Section("batch", "batch (the total batch is held fixed; accumulation is derived)")
_opt = SECTION.option

DEFAULT_TOTAL_BATCH_SIZE = 32


@dataclass
class BatchOptions:
    total_batch_size: int | None = field(
        default=None,
        metadata=_opt(
            "Sequences per optimizer step, held fixed whatever the number of GPUs: gradient "
            f"accumulation is derived from it (default {DEFAULT_TOTAL_BATCH_SIZE})."
        ),
    )
    batch_size_per_device: int = field(
        default=1,
        metadata=_opt("Sequences per forward/backward pass on each device."),
    )
    gradient_accumulation_steps: int | None = field(
        default=None,
        metadata=_opt(
            "Micro-batches per optimizer step. Normally derived from --total_batch_size; "
            "if both are given they must agree."
        ),
    )
    max_seq_length: int = field(default=1024, metadata=_opt("Tokens per sequence (block)."))


def check(options: BatchOptions) -> None:
    check_at_least(options, ("batch_size_per_device", "max_seq_length"))
    check_at_least(options, ("total_batch_size", "gradient_accumulation_steps"))
