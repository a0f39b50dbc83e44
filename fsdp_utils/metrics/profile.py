"""What the training loop measures around its optimizer steps: `--profile_steps A:B` (the torch
profiler) and `--flop_counter` (FLOPs counted on the first step). One hook in the loop:

    probes = StepProbes.from_config(config, layout, env, log, ...)
    with probes.around(step):      # step: the optimizer step about to run, counted from 1
        train_step(...)
    probes.close()                 # at the end of training, or when a leg stops early

`--profile_steps A:B` records steps A to B with `torch.profiler.profile` on every rank: CPU
activity, and CUDA kernels on GPUs, with tensor shapes and memory events. The profiler starts
one step early (A - 1, if that step runs in this job) as a warm-up whose events are dropped,
as torch's schedule recommends. Each rank writes `<run>/profile/rank<R>.<time>.pt.trace.json`
(`tensorboard_trace_handler`): a Chrome trace, which ui.perfetto.dev opens directly and which
TensorBoard's trace viewer (the torch-tb-profiler plugin) lists as worker `rank<R>` when given
`--logdir <run>/profile`. On CUDA the window also records the allocator's history
(`torch.cuda.memory._record_memory_history`) and dumps `rank<R>.memory_snapshot.pickle`, which
pytorch.org/memory_viz opens; a CPU run has no allocator history to record.

The job's first step outside such a window is profiled on the CPU side only (no shapes, no
kernels: a few percent of one step) to name the SDPA kernel that ran (`attention_kernels`):
torch chooses it per call (`--sdpa_backend`, fsdp_utils/model/sdpa.py), and the log says which.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.metrics.flop_count import FlopCount, describe_step_flops
from fsdp_utils.model.sdpa import KERNEL_OPS

PROFILE_DIR = "profile"
MEMORY_HISTORY_ENTRIES = 100_000  # torch's example value: a few steps of a large model


def profile_dir(run_root: Path) -> Path:
    return run_root / PROFILE_DIR


def profile_window(first: int, last: int, *, start: int) -> tuple[int, int, int]:
    """(the step the profiler starts before, warm-up steps, recorded steps) for steps `first`
    to `last` in a job whose first step is `start + 1`. The warm-up is the step before the
    window when this job runs it; a resumed job inside the window records what is left of it,
    and one past it nothing (0 recorded steps)."""
    begin = first - 1 if first > start + 1 else start + 1
    return begin, first - begin if first > begin else 0, max(last - max(first, start + 1) + 1, 0)


class StepProfiler:
    """The torch profiler over optimizer steps `first` to `last` (counted from 1) of a run
    whose first step in this job is `start + 1` (`start`: steps completed before, on resume)."""

    def __init__(
        self, first: int, last: int, *, start: int, folder: Path, rank: int, device: torch.device
    ) -> None:
        self.first, self.last = first, last
        self.folder, self.rank, self.device = folder, rank, device
        self.begin, self.warmup, self.active = profile_window(first, last, start=start)
        self.profiler: torch.profiler.profile | None = None
        self.traces: list[Path] = []
        self.snapshot: Path | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def before(self, step: int) -> None:
        if self.profiler is not None or step != self.begin or self.active < 1:
            return
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        self.folder.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        handler = tensorboard_trace_handler(str(self.folder), worker_name=f"rank{self.rank}")

        def on_trace_ready(prof: Any) -> None:
            before = set(self.folder.glob(f"rank{self.rank}.*.pt.trace.json"))
            handler(prof)
            self.traces += sorted(
                set(self.folder.glob(f"rank{self.rank}.*.pt.trace.json")) - before
            )

        with warnings.catch_warnings():  # a window at the job's first step has no warm-up
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            self.profiler = profile(
                activities=activities,
                schedule=schedule(wait=0, warmup=self.warmup, active=self.active, repeat=1),
                on_trace_ready=on_trace_ready,
                record_shapes=True,
                profile_memory=True,
            )
        if self.cuda:  # the allocator's history, for pytorch.org/memory_viz
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self.profiler.start()

    def after(self, step: int) -> None:
        if self.profiler is None:
            return
        self.profiler.step()  # marks the step boundary; the last active step writes the trace
        if step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop (idempotent); a window cut short by the end of the job is written as it is."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        if self.cuda:
            self.snapshot = self.folder / f"rank{self.rank}.memory_snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(self.snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)


def attention_kernels(events: Any) -> dict[str, int]:
    """{kernel: calls} of the SDPA kernels among a profile's events (`KERNEL_OPS`), recomputes
    included."""
    counts: dict[str, int] = {}
    for event in events:
        kernel = KERNEL_OPS.get(event.name.removeprefix("aten::"))
        if kernel is not None:
            counts[kernel] = counts.get(kernel, 0) + 1
    return counts


def describe_attention_kernels(counts: dict[str, int], step: int, backend: str) -> str:
    """'attention: SDPA ran flash (CPU) in step 1 (--sdpa_backend auto, torch's choice)'. (The
    counts of calls are in the record: the profiler counts a call that selective checkpointing
    answers from what it saved too.)"""
    how = "torch's choice" if backend == "auto" else "the only kernel allowed"
    ran = " and ".join(counts)
    return f"attention: SDPA ran {ran} in step {step} (--sdpa_backend {backend}, {how})"


class StepProbes:
    """The loop's one hook for the profiler, the FLOP counter and the attention kernel probe
    (each may be off)."""

    def __init__(
        self,
        profiler: StepProfiler | None,
        flops_estimate: float | None,
        *,
        log: Any,
        world_size: int,
        sdpa_backend: str | None = None,
    ) -> None:
        self.profiler = profiler
        self.flops_estimate = flops_estimate  # None: --flop_counter off, or already counted
        self.log = log
        self.world_size = world_size
        self._reported = False
        self.sdpa_backend = sdpa_backend  # None: no sdpa attention, or its kernel named

    @classmethod
    def from_config(
        cls,
        config: TrainConfig,
        run_root: Path,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        start: int,
        flops_per_rank_step: float,
        log: Any,
    ) -> StepProbes:
        window = config.profile_step_range
        profiler = None
        if window is not None:
            first, last = window
            folder = profile_dir(run_root)
            profiler = StepProfiler(
                first, last, start=start, folder=folder, rank=rank, device=device
            )
            if profiler.active >= 1:
                where = "traces and CUDA memory snapshots" if device.type == "cuda" else "traces"
                log.info(f"profile: steps {first}-{last}, {where} per rank in {folder}")
        estimate = flops_per_rank_step if config.flop_counter else None
        sdpa = config.sdpa_backend if config.attn_implementation == "sdpa" else None
        return cls(profiler, estimate, log=log, world_size=world_size, sdpa_backend=sdpa)

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        """Around optimizer step `step` (counted from 1)."""
        label: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        kernels: torch.profiler.profile | None = None
        if self.profiler is not None:
            self.profiler.before(step)
        if self.profiler is not None and self.profiler.profiler is not None:
            # the trace names the run's step numbers
            label = torch.profiler.record_function(f"optimizer step {step}")
        elif self.sdpa_backend is not None:  # one profiler at a time: outside the window
            label = kernels = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]
            )
        with label:
            if self.flops_estimate is not None:
                count = FlopCount()
                with count.counting():
                    yield
                self._report_flops(count, step)
            else:
                yield
        if kernels is not None:
            self._report_attention(kernels, step)
        if self.profiler is not None:
            self.profiler.after(step)
            if self.profiler.profiler is None and not self._reported:
                self._report_profile()

    def _report_attention(self, kernels: torch.profiler.profile, step: int) -> None:
        assert self.sdpa_backend is not None
        counts = attention_kernels(kernels.events())
        if counts:  # none: the model fell back to eager (Gemma 2)
            line = describe_attention_kernels(counts, step, self.sdpa_backend)
            self.log.event("attention_kernels", line, step=step, kernels=counts)
        self.sdpa_backend = None  # once, on this job's first step outside a profile window

    def _report_flops(self, count: FlopCount, step: int) -> None:
        assert self.flops_estimate is not None
        line = describe_step_flops(
            count.total, self.flops_estimate, step=step, world_size=self.world_size
        )
        if count.skipped:
            line += f" (not counted, their formulas failed: {', '.join(sorted(count.skipped))})"
        self.log.event(
            "flop_count",
            line,
            step=step,
            counted=count.total,
            estimated=self.flops_estimate,
            skipped=sorted(count.skipped),
        )
        self.flops_estimate = None  # once, on this job's first step

    def _report_profile(self) -> None:
        profiler = self.profiler
        assert profiler is not None
        if not profiler.traces:
            return
        self._reported = True
        files = ", ".join(p.name for p in profiler.traces)
        extra = f" and {profiler.snapshot.name}" if profiler.snapshot else ""
        self.log.event(
            "profile",
            f"profile: wrote {files}{extra} (rank 0's; every rank writes its own) to "
            f"{profiler.folder}: open in ui.perfetto.dev, or tensorboard --logdir {profiler.folder}",
            traces=[str(p) for p in profiler.traces],
        )

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
            if not self._reported:
                self._report_profile()
