"""Knowing when to stop: the Slurm time limit, a signal, Ctrl-C, a stop file, or a step budget.

Every rank calls `StopController.poll()` at each optimizer-step boundary; one all-reduce makes
them agree, so all ranks save together and exit cleanly. The trainer sends the next step's target
counts with it, so a step costs one scalar all-reduce in all, on host tensors. Sources of a stop:

- the stop file (default `<output_dir>/STOP`): `slurm/finetune.sh` creates it when Slurm sends
  `#SBATCH --signal=B:USR1@...` to the batch shell, because torchrun does not forward
  SIGUSR1/SIGUSR2 to its workers (pytorch #154849);
- SIGUSR1/SIGUSR2 delivered to a worker directly (`--signal` without `B:`, or `kill`);
- Ctrl-C (SIGINT: a terminal sends it to its foreground process group; torchrun, whose workers
  are in sessions of their own, passes it on to each): the same stop as the stop file's, never
  deferred, one line when it comes; a second Ctrl-C ends the process at once, without saving
  (`_SignalFlag`);
- the job's end time (`squeue -o %e`, or `FSDP_UTILS_JOB_END_TIME` in epoch seconds) minus a
  margin estimated from the measured save and step times;
- `--stop_after_steps` (a fixed budget of steps for this run).

A stop does not always end the leg: when it comes at the last step, or when the work left
(remaining steps, evaluations, the final save and export) fits in the time left before the
trainer's own margin, the run finishes in this job instead of waiting in the queue again for
a leg that would do only that (`choose_leg_end`). Requests by stop file or signal are then
deferred; the job's end time still stops the run at the margin if the estimate was wrong.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.parallel import distributed as dist_utils

END_TIME_ENV = "FSDP_UTILS_JOB_END_TIME"
MIN_MARGIN_SECONDS = 120.0
END_TIME_REFRESH_SECONDS = 300.0  # the limit can be changed with `scontrol update`
# Finishing in this leg must fit with room to spare: estimates come from a few steps and one
# save, and an export (one process writes the whole model) is slower than a sharded save.
FINISH_SAFETY = 1.5
EXPORT_SAVES = 2.0  # an export is estimated at this many sharded saves
RECENT_STEPS = 20  # the step time is the median of this many recent steps (the first excluded)


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


INTERRUPT = "Ctrl-C"  # the reason of a stop asked by SIGINT
EXIT_INTERRUPTED = 130  # a process stopped by Ctrl-C: 128 + SIGINT, as shells report it
FIRST_INTERRUPT = (
    "\nCtrl-C: stopping as the stop file does (the checkpoint is saved at the next step "
    "boundary, then the run ends); Ctrl-C again ends it at once, without saving.\n"
)
INTERRUPT_AFTER_TRAINING = (
    "\nCtrl-C: the training is over; the final model is saved, then the run ends without the "
    "benchmarks (--eval_tasks); Ctrl-C again ends it at once, without saving.\n"
)
SECOND_INTERRUPT = (
    "\nCtrl-C again: ending at once, without saving (the newest checkpoint in the run folder "
    "is what the same command resumes).\n"
)


class _SignalFlag:
    """Set by SIGUSR1/SIGUSR2 and by SIGINT (Ctrl-C); the handler only records (and says one
    line, on rank 0: `announce`), the loop acts at a step boundary or between the pieces of a
    long step. The second SIGINT (or, after a first, torchrun's SIGTERM) ends the process at
    once, by that signal itself (what a shell expects of a program it interrupted), after
    `on_abort` (the run's status)."""

    def __init__(self, *, announce: bool = False) -> None:
        self.received: int | None = None
        self.interrupts = 0
        self.announce = announce
        # The last step is done: what is left is the final save (kept) and the benchmarks
        # (skipped on Ctrl-C), so the first Ctrl-C says that instead of "the next step boundary".
        self.training_over = False
        self.on_abort: Callable[[], None] | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            self._previous[sig] = signal.signal(sig, self._handle)
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)

    def uninstall(self) -> None:
        """The handlers from before (a process that goes on after the run: a test, a tool)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        self.interrupts += 1
        if self.interrupts > 1:
            self._abort(signum, frame)
            return
        self._say(INTERRUPT_AFTER_TRAINING if self.training_over else FIRST_INTERRUPT)
        # torchrun answers a second Ctrl-C (its workers are in sessions of their own: only it
        # gets it) with SIGTERM to them: the same abort, recorded, rather than a silent death.
        self._previous.setdefault(signal.SIGTERM, signal.signal(signal.SIGTERM, self._abort))

    def _abort(self, signum: int, frame: FrameType | None) -> None:
        if self.on_abort is not None:
            with contextlib.suppress(Exception):  # ending now matters more than the record
                self.on_abort()
        self._say(SECOND_INTERRUPT)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _say(self, text: str) -> None:
        # os.write, not print: the handler may run in the middle of a print of the main thread
        if self.announce:
            with contextlib.suppress(OSError):
                os.write(2, text.encode())


REASONS = {1: "stop_after_steps", 2: "stop file", 3: "signal", 4: "time limit", 5: INTERRUPT}


class StoppedBeforeFirstStep(Exception):
    """A stop was requested during the work before the first step (data preparation, a
    method's own: DPO's reference pass). What that work finished is kept; the leg ends as
    interrupted, so that the sbatch script requeues it and the next leg goes on from there."""

    def __init__(self, reason: str, during: str) -> None:
        super().__init__(f"{reason} during {during}")
        self.reason = reason
        self.during = during


@dataclass
class Decision:
    stop: str | None  # reason, or None to go on
    save: bool  # periodic save due
    sums: list[float] = field(default_factory=list)  # `poll(add=...)` summed over all ranks


@dataclass(frozen=True)
class RemainingWork:
    """What is left to do in this run, with its estimated time."""

    steps: int
    step_seconds: float
    evals: int
    eval_seconds: float
    saves: int
    save_seconds: float
    export: bool
    export_seconds: float

    @property
    def seconds(self) -> float:
        return (
            self.steps * self.step_seconds
            + self.evals * self.eval_seconds
            + self.saves * self.save_seconds
            + (self.export_seconds if self.export else 0.0)
        )

    def describe(self) -> str:
        parts = [f"{self.steps} step(s)"] if self.steps else []
        if self.evals:
            parts.append(f"{self.evals} eval(s)")
        if self.saves:
            parts.append(f"{self.saves} save(s)")
        if self.export:
            parts.append("the final model")
        return f"{', '.join(parts) or 'nothing'}: ~{self.seconds:.0f} s"


def remaining_work(
    config: TrainConfig,
    *,
    step: int,
    step_seconds: float,
    save_seconds: float,
    eval_seconds: float | None,
    has_eval: bool,
    accumulation: int,
) -> RemainingWork:
    """The work between `step` and the end of the run, timed with what this leg measured
    (an evaluation not yet measured: one step per `accumulation` eval batches, forward and
    backward, which overestimates a forward-only pass)."""
    last = config.max_training_steps
    steps = max(last - step, 0)
    evals = 0
    if has_eval:
        every = config.eval_every
        evals = (last // every - step // every) if every else 0
        evals += 1 if (not every or last % every) else 0  # the final evaluation
    saves = 0
    if steps:
        every = config.save_every_steps
        saves = (last // every - step // every) if every else 0
        checkpointing = config.save_every_steps > 0 or config.save_every_minutes > 0
        saves = max(saves, 1 if checkpointing else 0)  # the checkpoint at the end
    if eval_seconds is None:
        eval_seconds = step_seconds * max(1.0, config.eval_batches / max(accumulation, 1))
    return RemainingWork(
        steps=steps,
        step_seconds=step_seconds,
        evals=evals,
        eval_seconds=eval_seconds,
        saves=saves,
        save_seconds=save_seconds,
        export=not config.no_final_save,
        export_seconds=EXPORT_SAVES * save_seconds,
    )


@dataclass(frozen=True)
class LegEnd:
    finish: bool  # finish the run in this job; False: stop here (saved) and requeue
    why: str

    def event(self, step: int, reason: str) -> tuple[str, str]:
        """(kind, message) of the log event that announces it."""
        if reason == INTERRUPT and not self.finish:
            return "stopping", (
                f"stopping at step {step}: {reason}; the checkpoint is saved (rerun the same "
                "command to resume)"
            )
        if self.finish:
            return "finishing", (
                f"finishing in this job instead of requeueing (stop at step {step}: {reason}): "
                f"{self.why}"
            )
        return "stopping", (
            f"stopping at step {step}: {reason}; not finishing in this job: {self.why}; the "
            "checkpoint is saved (rerun the same command to resume; a requeued job does)"
        )


def choose_leg_end(
    reason: str, work: RemainingWork, time_left: float | None, margin: float
) -> LegEnd:
    """After a stop request (the checkpoint of this step is saved): finish the run in this
    job, or stop and let the next leg continue. Before the last step, the rest must end before
    the trainer's own margin (at which it would stop anyway); at the last step, the final
    evaluation and export must end before the job does."""
    if reason == "stop_after_steps" and work.steps:
        return LegEnd(False, "this run's --stop_after_steps budget is used up")
    if reason == INTERRUPT and work.steps:
        return LegEnd(False, "Ctrl-C asks to stop now")
    if time_left is None:
        if not work.steps:
            why = (
                "the stop came at the last step: the final evaluation and model are done now, "
                "not in another leg"
            )
            return LegEnd(True, why)
        why = (
            f"the job's end time is unknown, so the remaining work ({work.describe()}) cannot "
            "be planned in this job"
        )
        return LegEnd(False, why)
    budget = time_left - (margin if work.steps else 0.0)
    needed = FINISH_SAFETY * work.seconds
    before = f" before the {margin:.0f} s margin" if work.steps else " before the job ends"
    verdict = "fits" if needed <= budget else "does not fit"
    why = (
        f"the remaining work ({work.describe()}, x{FINISH_SAFETY:g} = {needed:.0f} s) "
        f"{verdict} in the {max(budget, 0):.0f} s left{before}"
    )
    return LegEnd(needed <= budget, why)


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
    ) -> None:
        self.stop_file = stop_file
        self.save_every_steps = save_every_steps
        self.save_every_seconds = save_every_minutes * 60
        self.stop_after_steps = stop_after_steps
        self.fixed_margin = margin_minutes * 60 if margin_minutes is not None else None
        self.is_main = is_main
        self.flag = _SignalFlag(announce=is_main)
        self.flag.install()
        self.started = time.monotonic()
        self.last_save = time.monotonic()
        self.steps_this_run = 0
        self.save_seconds = 0.0
        self.step_seconds = 0.0
        self.recent_steps: list[float] = []
        self.deferred = False  # stop file and signals ignored: the run finishes in this job
        self.end_time: float | None = None
        self._end_time_checked = -float("inf")
        # A STOP file present at start is honoured, not taken for a stale one: the signal may
        # have come while this run was starting. The launcher removes a previous leg's STOP
        # (slurm/finetune.sh), and a run that stops because of it consumes it (consume_stop_file).

    @classmethod
    def for_run(cls, config: TrainConfig, layout: RunLayout, *, is_main: bool) -> StopController:
        """The controller of a run: its stop file, save cadence, step budget and margin."""
        return cls(
            layout.stop_file(config.stop_file),
            save_every_steps=config.save_every_steps,
            save_every_minutes=config.save_every_minutes,
            stop_after_steps=config.stop_after_steps,
            margin_minutes=config.time_limit_margin_minutes,
            is_main=is_main,
        )

    def describe_time_limit(self) -> str | None:
        """The log's line about the job's end (rank 0, and only when the end is known)."""
        if not self.end_time_known():
            return None
        return (
            f"time limit: the job ends at {self.end_time_text()}; saving and stopping at least "
            f"{self.margin() / 60:.1f} min before"
        )

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

    def time_left(self) -> float | None:
        """Seconds until the job ends (rank 0 only; None elsewhere or without a limit)."""
        end = self._end_time() if self.is_main else None
        return end - time.time() if end is not None else None

    def typical_step_seconds(self) -> float:
        """The median of recent steps (the leg's first, with its warm-up, left out)."""
        return statistics.median(self.recent_steps) if self.recent_steps else self.step_seconds

    def leg_end(self, reason: str, work: RemainingWork) -> LegEnd:
        """Collective: rank 0 decides (it alone knows the end time), every rank follows.
        Finishing defers further stop-file and signal requests (the file is consumed)."""
        decision = choose_leg_end(reason, work, self.time_left(), self.margin())
        # Host scalars, as in `poll`: the vote neither waits for nor enters the GPU's queue.
        finish = dist_utils.all_reduce_host_sum([float(decision.finish and self.is_main)])[0] > 0
        if finish:
            self.deferred = True
            self.consume_stop_file()
        return LegEnd(finish, decision.why)

    def _local_stop_code(self, *, end_time: bool = True) -> int:
        if self.flag.interrupts:  # never deferred: the user asked to stop
            return 5
        if self.flag.received is not None and not self.deferred:
            return 3
        if not self.is_main:
            return 0
        if self.stop_after_steps is not None and self.steps_this_run >= self.stop_after_steps:
            return 1
        if self.stop_file.exists() and not self.deferred:
            return 2
        if not end_time:
            return 0
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
        if self.steps_this_run > 1:
            self.recent_steps = [*self.recent_steps[-(RECENT_STEPS - 1) :], step_seconds]
        save = (self.save_every_steps > 0 and step % self.save_every_steps == 0) or (
            self.save_every_seconds > 0
            and time.monotonic() - self.last_save >= self.save_every_seconds
        )
        votes = self._votes()
        summed = dist_utils.all_reduce_host_sum([*votes, float(save and self.is_main), *add])
        return Decision(
            stop=_agreed(summed),
            save=summed[len(REASONS)] > 0,
            sums=summed[len(REASONS) + 1 :],
        )

    def requested(self) -> str | None:
        """Collective, between pieces of the work before the first step: the reason of a stop
        that any rank sees (stop file, signal, the job's end within the margin), or None. One
        all-reduce of host scalars, as `poll`'s."""
        return _agreed(dist_utils.all_reduce_host_sum(self._votes()))

    def requested_at_start(self) -> str | None:
        """Collective, as the run starts: `requested`, but for a request (the stop file, a
        signal) only. A run that starts inside its time-limit margin goes on to its first step
        and saves it: stopping at once would requeue a leg that did nothing, again and again
        when the job's limit is short."""
        return _agreed(dist_utils.all_reduce_host_sum(self._votes(end_time=False)))

    def requested_here(self) -> str | None:
        """This rank's own view, without a collective: for work rank 0 does alone while the
        others wait (data preparation). Rank 0 sees every source: the stop file, the end time,
        a signal (torchrun forwards none; the sbatch script writes the stop file)."""
        return REASONS.get(self._local_stop_code())

    def _votes(self, *, end_time: bool = True) -> list[float]:
        votes = [0.0] * len(REASONS)
        code = self._local_stop_code(end_time=end_time)
        if code:
            votes[code - 1] = 1.0
        return votes

    def interrupted(self) -> bool:
        """Collective, after the last step: whether Ctrl-C reached any rank, so that every
        rank skips the work after training (the benchmarks, themselves collective) or none."""
        return _agreed(dist_utils.all_reduce_host_sum(self._votes(end_time=False))) == INTERRUPT

    def close(self) -> None:
        """The run is over: signals go back to the handlers they had before it."""
        self.flag.uninstall()

    def consume_stop_file(self) -> None:
        """A stop request handled: the next run (the requeued leg) must not stop at once."""
        if self.is_main:
            self.stop_file.unlink(missing_ok=True)

    def saved(self, seconds: float) -> None:
        self.last_save = time.monotonic()
        self.save_seconds = max(self.save_seconds, seconds)


def _agreed(summed: Sequence[float]) -> str | None:
    """The highest-ranked reason any rank voted for (`REASONS` order), or None."""
    agreed = max((c for c in REASONS if summed[c - 1] > 0), default=0)
    return REASONS.get(agreed)
