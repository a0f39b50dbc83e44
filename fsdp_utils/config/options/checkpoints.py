"""The run folder, sharded checkpoints, time limits and stops, the final model
(fsdp_utils/checkpoint/, fsdp_utils/train/timelimit.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .section import Section

SECTION = Section("checkpoints", "run folder, checkpoints, time limits and the final model")
_opt = SECTION.option

ExportDtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass
class CheckpointOptions:
    output_dir: str = field(
        default="runs/chess",
        metadata=_opt("Run folder: config, metrics, checkpoints, final model, logs."),
    )
    save_every_steps: int = field(
        default=0,
        metadata=_opt("Save a sharded checkpoint every N steps (0: off)."),
    )
    save_every_minutes: float = field(
        default=30.0,
        metadata=_opt("Save a sharded checkpoint every M minutes (0: off)."),
    )
    keep_last: int = field(default=2, metadata=_opt("Checkpoints to keep (older are deleted)."))
    resume: str = field(
        default="auto",
        metadata=_opt(
            "auto: continue from the newest complete checkpoint in output_dir if there is one; "
            "never: start fresh (the previous run moves to output_dir/previous-<time>/); or a "
            "checkpoint folder. A requeued job's later legs always resume their own newest."
        ),
    )
    time_limit_margin_minutes: float | None = field(
        default=None,
        metadata=_opt(
            "Save and stop this long before the Slurm job ends (default: estimated from the "
            "measured save time, at least 2 minutes)."
        ),
    )
    stop_file: str | None = field(
        default=None,
        metadata=_opt(
            "Save and stop at the next step boundary once this file exists (the sbatch "
            "script creates it when Slurm signals the job; default: output_dir/STOP)."
        ),
    )
    stop_after_steps: int | None = field(
        default=None,
        metadata=_opt(
            "Save and stop after this many steps in this run, as if the time limit had come "
            "(split a long run into shorter jobs; the next run resumes)."
        ),
    )
    no_final_save: bool = field(
        default=False,
        metadata=_opt("Do not write the Hugging Face model at the end."),
    )
    export_dtype: ExportDtype = field(
        default="auto",
        metadata=_opt(
            "dtype of the final model's weights: auto (the source model's, from its "
            "config.json), float32, bfloat16 or float16."
        ),
    )


def check(options: CheckpointOptions) -> None:
    """Nothing to check alone: the checkpointer checks --resume against the run folder."""
