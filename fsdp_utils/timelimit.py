"""Knowing when to stop: the Slurm time limit, a signal, a stop file, or a step budget.

Every rank calls `StopController.poll()` at each optimizer-step boundary; one all-reduce makes
them agree, so all ranks save together and exit cleanly. The trainer sends the next step's target
counts with it, so a step costs one scalar all-reduce in all, on host tensors. Sources of a stop:

- the stop file (default `<output_dir>/STOP`): `slurm/finetune.sh` creates it when Slurm sends
  `#SBATCH --signal=B:USR1@...` to the batch shell, because torchrun does not forward
  SIGUSR1/SIGUSR2 to its workers (pytorch #154849);
- SIGUSR1/SIGUSR2 delivered to a worker directly (`--signal` without `B:`, or `kill`);
- the job's end time (`squeue -o %e`, or `FSDP_UTILS_JOB_END_TIME` in epoch seconds) minus a
  margin estimated from the measured save and step times;
- `--stop_after_steps` (a fixed budget of steps for this run).
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import torch

from fsdp_utils import distributed as dist_utils

END_TIME_ENV = "FSDP_UTILS_JOB_END_TIME"
MIN_MARGIN_SECONDS = 120.0
END_TIME_REFRESH_SECONDS = 300.0  # the limit can be changed with `scontrol update`


def parse_slurm_time(text: str) -> float | None:
    """`2026-11-21T23:17:25` (the controller's local time) -> epoch seconds."""
    text = text.strip()
    if not text or text.upper() in ("N/A", "UNLIMITED", "NONE", "UNKNOWN"):
        return None
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def job_end_time(environ: dict[str, str] | None = None) -> float | None:
    """When the Slurm job will be killed, or None outside Slurm / without a limit."""
    environ = dict(os.environ) if environ is None else environ
    if environ.get(END_TIME_ENV):
        return float(environ[END_TIME_ENV])
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    try:
        result = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%e"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_slurm_time(result.stdout) if result.returncode == 0 else None


class _SignalFlag:
    """Set by SIGUSR1/SIGUSR2; the handler only records, the loop acts at a step boundary."""

    def __init__(self) -> None:
        self.received: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum


REASONS = {1: "stop_after_steps", 2: "stop file", 3: "signal", 4: "time limit"}


@dataclass
class Decision:
    stop: str | None  # reason, or None to go on
    save: bool  # periodic save due
    sums: list[float] = field(default_factory=list)  # `poll(add=...)` summed over all ranks


class StopController:
    def __init__(
        self,
        stop_file: Path,
        *,
        save_every_steps: int,
        save_every_minutes: float,
        stop_after_steps: int | None,
        margin_minutes: float | None,
        is_main: bool,
        device: torch.device,
    ) -> None:
        self.stop_file = stop_file
        self.save_every_steps = save_every_steps
        self.save_every_seconds = save_every_minutes * 60
        self.stop_after_steps = stop_after_steps
        self.fixed_margin = margin_minutes * 60 if margin_minutes is not None else None
        self.is_main = is_main
        self.device = device
        self.flag = _SignalFlag()
        self.flag.install()
        self.started = time.monotonic()
        self.last_save = time.monotonic()
        self.steps_this_run = 0
        self.save_seconds = 0.0
        self.step_seconds = 0.0
        self.end_time: float | None = None
        self._end_time_checked = -float("inf")
        # A STOP file present at start is honoured, not taken for a stale one: the signal may
        # have come while this run was starting. The launcher removes a previous leg's STOP
        # (slurm/finetune.sh), and a run that stops because of it consumes it (consume_stop_file).

    def end_time_known(self) -> bool:
        return self.is_main and self._end_time() is not None

    def end_time_text(self) -> str:
        end = self._end_time()
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(end)) if end else "never"

    def margin(self) -> float:
        if self.fixed_margin is not None:
            return self.fixed_margin
        # Enough to finish the step in flight, save and exit, with room for a slow save.
        return max(MIN_MARGIN_SECONDS, 2 * self.save_seconds + 3 * self.step_seconds)

    def _end_time(self) -> float | None:
        now = time.monotonic()
        if now - self._end_time_checked >= END_TIME_REFRESH_SECONDS:
            self.end_time = job_end_time()
            self._end_time_checked = now
        return self.end_time

    def _local_stop_code(self) -> int:
        if self.flag.received is not None:
            return 3
        if not self.is_main:
            return 0
        if self.stop_after_steps is not None and self.steps_this_run >= self.stop_after_steps:
            return 1
        if self.stop_file.exists():
            return 2
        end = self._end_time()
        if end is not None and time.time() + self.margin() >= end:
            return 4
        return 0

    def poll(self, step: int, step_seconds: float, *, add: Sequence[float] = ()) -> Decision:
        """Collective: every rank calls it after every optimizer step.

        `add`: host scalars to sum over all ranks in the same all-reduce (`Decision.sums`). It
        is one sum of host (CPU) values: each rank votes for the reasons it sees, and the
        decision is the highest-ranked reason any rank voted for. On CUDA the tensor goes over
        the gloo half of the device-mapped backend: no wait for the GPU.
        """
        self.steps_this_run += 1
        self.step_seconds = max(self.step_seconds, step_seconds)
        save = (self.save_every_steps > 0 and step % self.save_every_steps == 0) or (
            self.save_every_seconds > 0
            and time.monotonic() - self.last_save >= self.save_every_seconds
        )
        votes = [0.0] * len(REASONS)
        code = self._local_stop_code()
        if code:
            votes[code - 1] = 1.0
        summed = dist_utils.all_reduce_host_sum([*votes, float(save and self.is_main), *add])
        agreed = max((c for c in REASONS if summed[c - 1] > 0), default=0)
        return Decision(
            stop=REASONS.get(agreed),
            save=summed[len(REASONS)] > 0,
            sums=summed[len(REASONS) + 1 :],
        )

    def consume_stop_file(self) -> None:
        if self.is_main:
            self.stop_file.unlink(missing_ok=True)

    def saved(self, seconds: float) -> None:
        self.last_save = time.monotonic()
        self.save_seconds = max(self.save_seconds, seconds)
