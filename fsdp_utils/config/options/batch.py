"""The batch: the total held fixed whatever the number of GPUs, the per-device batch, the
sequence length (the arithmetic: fsdp_utils/config/batch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .section import Section, check_at_least

SECTION = Section("batch", "batch (the total batch is held fixed; accumulation is derived)")
_opt = SECTION.option

DEFAULT_TOTAL_BATCH_SIZE = 32
DEFAULT_MAX_SEQ_LENGTH = 1024  # or the model's context where shorter: config/seq_length.py


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
    max_seq_length: int | None = field(
        default=None,
        metadata=_opt(
            f"Tokens per sequence (block). Default: {DEFAULT_MAX_SEQ_LENGTH}, or the model's "
            "context length where that is shorter (the log says so); a value above the "
            "context is an error."
        ),
    )

    @property
    def seq_length(self) -> int:
        """`--max_seq_length` as the run uses it: the model fits a default one first
        (`fsdp_utils.config.seq_length.fit_seq_length`); unfitted, the default."""
        return DEFAULT_MAX_SEQ_LENGTH if self.max_seq_length is None else self.max_seq_length


def check(options: BatchOptions) -> None:
    check_at_least(options, ("batch_size_per_device", "max_seq_length"))
    check_at_least(options, ("total_batch_size", "gradient_accumulation_steps"))
