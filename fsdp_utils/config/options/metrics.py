"""Logging, profiling and trackers (fsdp_utils/metrics/)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .section import Section, check_at_least

SECTION = Section("metrics", "logging and trackers")
_opt = SECTION.option


def parse_step_range(text: str) -> tuple[int, int]:
    """'3:5' -> (3, 5); '4' -> (4, 4). Steps count from 1."""
    first, sep, last = text.partition(":")
    try:
        start, end = int(first), int(last if sep else first)
    except ValueError:
        start = end = 0
    if not 1 <= start <= end:
        raise ValueError(
            f"--profile_steps {text!r}: give the first and last optimizer step to record as "
            "A:B with 1 <= A <= B, e.g. --profile_steps 3:5 (the first steps are slower: "
            "start after them)."
        )
    return start, end


@dataclass
class MetricsOptions:
    log_every: int = field(default=1, metadata=_opt("Log metrics every N optimizer steps."))
    sync_free_steps: bool = field(
        default=False,
        metadata=_opt(
            "No step waits for the GPU before its update: the loss and gradient norm are "
            "copied back without blocking and read on log steps only, after the update is "
            "queued (a non-finite value is then found at the next log step or before any "
            "save, as between log steps). Use with --log_every N > 1."
        ),
    )
    peak_tflops: float | None = field(
        default=None,
        metadata=_opt("Peak TFLOP/s of one device for MFU (detected for A100/H100/H200)."),
    )
    profile_steps: str | None = field(
        default=None,
        metadata=_opt(
            "A:B: record optimizer steps A to B with the torch profiler, one trace per rank in "
            "output_dir/profile (Perfetto, TensorBoard); on CUDA also a memory snapshot "
            "(llama-recipes' use_profiler / profiler_dir)."
        ),
    )
    flop_counter: bool = field(
        default=False,
        metadata=_opt(
            "Count the first step's FLOPs with torch's FlopCounterMode and log them beside the "
            "estimate that MFU uses (llama-recipes' flop_counter)."
        ),
    )
    tensorboard: bool = field(
        default=False,
        metadata=_opt(
            "Also write the metrics as TensorBoard event files into output_dir/tensorboard "
            "(view on the login node: tensorboard --logdir runs/)."
        ),
    )
    wandb: str | None = field(
        default=None,
        metadata=_opt(
            "Also log to this W&B project, always offline, into output_dir/wandb (no network "
            "call; the end of the log gives the `wandb sync` command for the login node). "
            "Needs pip install -e '.[wandb]'."
        ),
    )

    @property
    def profile_step_range(self) -> tuple[int, int] | None:
        """--profile_steps A:B as (A, B), optimizer steps counted from 1; None when off."""
        if self.profile_steps is None:
            return None
        return parse_step_range(self.profile_steps)


def check(options: MetricsOptions) -> None:
    check_at_least(options, ("log_every",))
    _ = options.profile_step_range  # a malformed --profile_steps fails here
