"""From samples to per-GPU statistics, a job summary and advice. Pure functions.

Conventions follow Princeton's jobstats, which our users know: utilisation is the mean over the
samples, memory the peak; a mean <= 15% is "very low", 15-25% "low", a GPU at 0% throughout is
"not used"; utilisation advice waits until the job has run 5 minutes (start-up is idle time).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from monitoring.legs import Leg, covered_seconds
from monitoring.records import GpuProcess, GpuSample, JobInfo, NodeError


@dataclass(frozen=True)
class Thresholds:
    very_low_pct: float = 15.0
    low_pct: float = 25.0
    min_runtime_s: float = 300.0
    # Peak memory below this fraction of the GPU: a larger per-device batch very likely fits.
    headroom_fraction: float = 0.5
    # Mean utilisation of the busiest and idlest GPU further apart than this: ranks wait.
    imbalance_pct: float = 30.0


@dataclass(frozen=True)
class GpuStats:
    host: str
    index: int
    name: str | None
    uuid: str | None
    samples: int
    util_mean: float | None
    util_min: float | None
    util_peak: float | None
    mem_bus_mean: float | None  # utilization.memory: memory-bus busy time, not memory used
    mem_used_peak_mib: float | None
    mem_total_mib: float | None
    power_mean_w: float | None
    temp_peak_c: float | None
    timeline: tuple[float | None, ...] = ()  # mean utilisation per time bin
    processes: tuple[GpuProcess, ...] = ()
    # Samples in which the GPU read as faulted (ERR!, ...), which cells, and since when.
    fault_samples: int = 0
    faults: tuple[str, ...] = ()
    first_fault_time: float | None = None

    @property
    def faulted(self) -> bool:
        return self.fault_samples > 0

    @property
    def mem_peak_fraction(self) -> float | None:
        if self.mem_used_peak_mib is None or not self.mem_total_mib:
            return None
        return self.mem_used_peak_mib / self.mem_total_mib

    @property
    def label(self) -> str:
        return f"{self.host} GPU {self.index}"


@dataclass(frozen=True)
class JobSummary:
    gpus_measured: int
    gpus_allocated: int | None
    util_mean: float | None  # mean over GPUs of each GPU's mean
    util_lowest: float | None
    util_highest: float | None
    mem_peak_mib: float | None  # the fullest GPU
    mem_total_mib: float | None  # of that GPU
    first_time: float | None
    last_time: float | None
    samples_per_gpu: int
    gpus_faulted: int = 0  # left out of the utilisation figures above
    legs: tuple[Leg, ...] = ()  # more than one: a requeued (or resumed) run

    @property
    def span_s(self) -> float | None:
        if self.first_time is None or self.last_time is None:
            return None
        return self.last_time - self.first_time

    @property
    def covered_s(self) -> float | None:
        """Time the samples cover: summed over the legs (queue waits between legs left out)."""
        return covered_seconds(self.legs) if len(self.legs) > 1 else self.span_s


@dataclass(frozen=True)
class Note:
    level: Literal["error", "warning", "info"]
    text: str


def _values(samples: Iterable[GpuSample], attr: str) -> list[float]:
    return [v for s in samples if (v := getattr(s, attr)) is not None]


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _timeline(
    samples: Sequence[GpuSample], start: float | None, end: float | None, bins: int
) -> tuple[float | None, ...]:
    if bins <= 0 or start is None or end is None:
        return ()
    width = (end - start) / bins or 1.0
    slots: list[list[float]] = [[] for _ in range(bins)]
    for s in samples:
        if s.time is not None and s.utilization_gpu is not None:
            slots[min(bins - 1, int((s.time - start) / width))].append(s.utilization_gpu)
    return tuple(_mean(slot) for slot in slots)


def summarize_gpus(
    samples: Iterable[GpuSample], processes: Iterable[GpuProcess] = (), bins: int = 0
) -> list[GpuStats]:
    samples = list(samples)
    groups: dict[tuple[str, int], list[GpuSample]] = defaultdict(list)
    for s in samples:
        groups[(s.host, s.index)].append(s)
    times = [s.time for s in samples if s.time is not None]
    start, end = (min(times), max(times)) if times else (None, None)
    bins = min(bins, len(set(times)))  # no empty bins when there are few samples
    uuid_to_gpu: dict[tuple[str, str | None], int] = {
        (s.host, s.uuid): s.index for s in samples if s.uuid
    }
    by_gpu: dict[tuple[str, int], list[GpuProcess]] = defaultdict(list)
    for p in processes:
        index = p.gpu_index if p.gpu_index is not None else uuid_to_gpu.get((p.host, p.gpu_uuid))
        if index is not None:
            by_gpu[(p.host, index)].append(p)
    stats = []
    for (host, index), group in sorted(groups.items()):
        util = _values(group, "utilization_gpu")
        used = _values(group, "memory_used_mib")
        totals = _values(group, "memory_total_mib")
        temps = _values(group, "temperature_c")
        faulted = [s for s in group if s.faults]
        stats.append(
            GpuStats(
                host=host,
                index=index,
                name=next((s.name for s in group if s.name), None),
                uuid=next((s.uuid for s in group if s.uuid), None),
                samples=len(group),
                util_mean=_mean(util),
                util_min=min(util) if util else None,
                util_peak=max(util) if util else None,
                mem_bus_mean=_mean(_values(group, "utilization_memory")),
                mem_used_peak_mib=max(used) if used else None,
                mem_total_mib=max(totals) if totals else None,
                power_mean_w=_mean(_values(group, "power_w")),
                temp_peak_c=max(temps) if temps else None,
                timeline=_timeline(group, start, end, bins),
                processes=tuple(by_gpu.get((host, index), ())),
                fault_samples=len(faulted),
                faults=tuple(dict.fromkeys(f for s in faulted for f in s.faults)),
                first_fault_time=min((s.time for s in faulted if s.time is not None), default=None),
            )
        )
    return stats


def summarize_job(
    stats: Sequence[GpuStats],
    samples: Sequence[GpuSample],
    job: JobInfo | None,
    legs: Sequence[Leg] = (),
) -> JobSummary:
    # A faulted GPU's readings are not measurements of the job: they stay out of its figures.
    healthy = [g for g in stats if not g.faulted]
    means = [g.util_mean for g in healthy if g.util_mean is not None]
    fullest = max(
        (g for g in healthy if g.mem_used_peak_mib is not None),
        key=lambda g: g.mem_peak_fraction or 0.0,
        default=None,
    )
    times = [s.time for s in samples if s.time is not None]
    return JobSummary(
        gpus_measured=len(stats),
        gpus_allocated=job.gpus if job else None,
        util_mean=_mean(means),
        util_lowest=min(means) if means else None,
        util_highest=max(means) if means else None,
        mem_peak_mib=fullest.mem_used_peak_mib if fullest else None,
        mem_total_mib=fullest.mem_total_mib if fullest else None,
        first_time=min(times) if times else None,
        last_time=max(times) if times else None,
        samples_per_gpu=max((g.samples for g in stats), default=0),
        gpus_faulted=len(stats) - len(healthy),
        legs=tuple(legs),
    )


def group_errors(errors: Iterable[NodeError]) -> list[tuple[NodeError, int]]:
    """Distinct (host, message) pairs with how often each was seen, in order of appearance."""
    counts: dict[NodeError, int] = {}
    for error in errors:
        counts[error] = counts.get(error, 0) + 1
    return list(counts.items())


def format_duration(seconds: float) -> str:
    total = round(seconds)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
    return f"{days}-{clock}" if days else clock


_LOST_GPU = ("fallen off the bus", "GPU is lost", "Unable to determine the device handle")


def _error_notes(errors: Iterable[NodeError]) -> list[Note]:
    notes = []
    for error, count in group_errors(errors):
        seen = f" (seen {count} times)" if count > 1 else ""
        if any(marker in error.message for marker in _LOST_GPU):
            notes.append(
                Note(
                    "error",
                    f'{error.host}: nvidia-smi cannot reach a GPU: "{error.message}"{seen}. '
                    "This is a hardware or driver fault, not your code: report node "
                    f"{error.host} to your cluster's support and resubmit avoiding it: "
                    f"sbatch --exclude={error.host} slurm/finetune.sh",
                )
            )
        elif "nvidia-smi not found" in error.message:
            notes.append(
                Note(
                    "warning",
                    f"{error.host}: nvidia-smi is not on PATH there, so its GPUs were not "
                    "measured. Load the module that provides it (e.g. `module load cuda`) before "
                    "running gpu_report (the probe inherits your PATH), or ask your cluster's "
                    "support where it lives.",
                )
            )
        else:
            notes.append(Note("warning", f"{error.host}: {error.message}{seen}"))
    return notes


def _fault_notes(stats: Sequence[GpuStats]) -> list[Note]:
    notes = []
    for g in stats:
        if not g.faulted:
            continue
        when = ""
        if g.first_fault_time is not None:
            when = ", first at " + time.strftime(
                "%Y-%m-%d %H:%M", time.localtime(g.first_fault_time)
            )
        cells = "; ".join(g.faults)
        uuid = f" ({g.uuid})" if g.uuid else ""
        notes.append(
            Note(
                "error",
                f"{g.label}{uuid} is in an error state: nvidia-smi read {cells} in "
                f"{g.fault_samples} of {g.samples} sample{'s' if g.samples != 1 else ''}{when}. "
                "This is a GPU fault (a GSP timeout, an Xid error, a GPU falling off the bus), "
                "not your code, and its readings are left out of the job's figures. Resubmit "
                f"avoiding the node: sbatch --exclude={g.host} slurm/finetune.sh, and tell your "
                f"cluster's admins (node {g.host}, GPU {g.index}) so they can drain and reset it.",
            )
        )
    return notes


def _labels(gpus: Sequence[GpuStats]) -> str:
    return ", ".join(g.label for g in gpus)


def _listing(gpus: Sequence[GpuStats]) -> str:
    """`node1 GPU 0 (12%), node1 GPU 3 (9%)`: labels with mean utilisation."""
    return ", ".join(
        f"{g.label} ({g.util_mean:.0f}%)" if g.util_mean is not None else g.label for g in gpus
    )


def _utilisation_notes(
    stats: Sequence[GpuStats], t: Thresholds, *, snapshot: bool = False
) -> list[Note]:
    notes = []
    stats = [g for g in stats if not g.faulted]  # a fault has its own note
    unused = [g for g in stats if g.util_peak == 0]
    very_low = [
        g
        for g in stats
        if g not in unused and g.util_mean is not None and g.util_mean <= t.very_low_pct
    ]
    low = [
        g for g in stats if g.util_mean is not None and t.very_low_pct < g.util_mean <= t.low_pct
    ]
    fix = (
        "Each GPU needs its own process: check that torchrun's --nproc_per_node equals "
        "the GPUs per node (slurm/finetune.sh takes it from $SLURM_GPUS_ON_NODE), or "
        "request fewer GPUs."
    )
    if unused and snapshot:
        notes.append(
            Note(
                "warning",
                f"GPUs at 0% in this snapshot: {_labels(unused)}. One reading cannot tell an "
                "idle GPU from one between two steps; measure over time with "
                "python monitoring/gpu_report.py <jobid>. If a job's GPU stays at 0%: " + fix,
            )
        )
    elif unused:
        notes.append(
            Note(
                "error",
                f"GPUs allocated but not used (0% in every sample): {_labels(unused)}. " + fix,
            )
        )
    causes = (
        "The GPUs mostly wait: for data (on-the-fly tokenisation, too few --cpus-per-task), "
        "for communication, or because --batch_size_per_device is too small to fill them."
    )
    if very_low:
        notes.append(
            Note(
                "error",
                f"Very low GPU utilisation (<= {t.very_low_pct:.0f}%): {_listing(very_low)}. "
                + causes,
            )
        )
    if low:
        notes.append(
            Note(
                "warning",
                f"Low GPU utilisation ({t.very_low_pct:.0f}-{t.low_pct:.0f}%): {_listing(low)}. "
                + causes,
            )
        )
    busy = [g for g in stats if g.util_mean is not None and g not in unused]
    if len(busy) > 1:
        lowest = min(busy, key=lambda g: g.util_mean or 0.0)
        highest = max(busy, key=lambda g: g.util_mean or 0.0)
        assert lowest.util_mean is not None and highest.util_mean is not None
        if highest.util_mean - lowest.util_mean > t.imbalance_pct:
            notes.append(
                Note(
                    "warning",
                    f"Utilisation differs across GPUs: {_listing([lowest])} vs "
                    f"{_listing([highest])}. With FSDP every step waits for the slowest rank: "
                    "look for uneven work per rank (very different sequence lengths), another "
                    "process on the slow GPU, or a slow node.",
                )
            )
    return notes


def _memory_notes(stats: Sequence[GpuStats], t: Thresholds) -> list[Note]:
    stats = [g for g in stats if not g.faulted]
    if not any(g.util_peak for g in stats):
        return []  # nothing ran on these GPUs: their empty memory says nothing about the batch
    known = [g for g in stats if g.mem_peak_fraction is not None]
    if not known or len(known) < len(stats):
        return []
    fullest = max(known, key=lambda g: g.mem_peak_fraction or 0.0)
    fraction = fullest.mem_peak_fraction or 0.0
    if fraction >= t.headroom_fraction:
        return []
    assert fullest.mem_used_peak_mib is not None and fullest.mem_total_mib is not None
    return [
        Note(
            "info",
            f"GPU memory headroom: the fullest GPU ({fullest.label}) peaked at "
            f"{fullest.mem_used_peak_mib / 1024:.1f} of {fullest.mem_total_mib / 1024:.1f} GiB "
            f"({fraction:.0%}). A larger --batch_size_per_device very likely fits (try 2x): the "
            "total batch stays fixed, so there are fewer accumulation steps and the GPUs get "
            "bigger kernels. Check it first with chess_finetune.py --plan.",
        )
    ]


_REPORTED = {
    "utilization.gpu": "util_mean",
    "memory.used": "mem_used_peak_mib",
    "power.draw": "power_mean_w",
    "temperature.gpu": "temp_peak_c",
}


def _missing_notes(
    stats: Sequence[GpuStats], fields_read: Collection[str] | None = None
) -> list[Note]:
    parts = []
    absent = []
    for field, attr in _REPORTED.items():
        if fields_read is not None and field not in fields_read:
            absent.append(field)  # the saved output never had this column
            continue
        # A faulted cell is a fault (its own note), not a value the GPU cannot report.
        missing = [
            g
            for g in stats
            if getattr(g, attr) is None and not any(f.startswith(field) for f in g.faults)
        ]
        if missing:
            where = "all GPUs" if len(missing) == len(stats) else _labels(missing)
            parts.append(f"{field} on {where}")
    notes = []
    if parts:
        notes.append(
            Note(
                "info",
                "Not reported by the GPUs ([N/A]/[Not Supported]; shown as -, never as 0): "
                + "; ".join(parts)
                + ". MIG slices do not report utilisation; unified-memory GPUs (GB10) do not "
                "report their memory.",
            )
        )
    if absent:
        notes.append(
            Note(
                "info",
                f"Not in the saved output (its columns do not include them): {', '.join(absent)}.",
            )
        )
    return notes


def make_notes(
    stats: Sequence[GpuStats],
    summary: JobSummary,
    job: JobInfo | None,
    errors: Iterable[NodeError] = (),
    thresholds: Thresholds | None = None,
    *,
    fields_read: Collection[str] | None = None,
) -> list[Note]:
    """Advice in jobstats' style; errors first, then utilisation, memory, missing data."""
    t = thresholds or Thresholds()
    notes = _error_notes(errors) + _fault_notes(stats)
    if job and job.gpus is not None and 0 < summary.gpus_measured < job.gpus:
        notes.append(
            Note(
                "warning",
                f"Slurm allocated {job.gpus} GPUs but {summary.gpus_measured} were measured: "
                "the others' nodes did not answer (see the messages above).",
            )
        )
    # A requeued job's RunTime is its last leg's: judge it by all the time its samples cover.
    known = [x for x in (job.run_seconds if job else None, summary.covered_s) if x is not None]
    runtime = max(known) if known else None
    if runtime is not None and job is not None and runtime < t.min_runtime_s:
        notes.append(
            Note(
                "info",
                f"The job has run for only {format_duration(runtime)}. Start-up (loading the "
                "model, the first steps) leaves GPUs idle, so utilisation advice waits until it "
                f"has run {format_duration(t.min_runtime_s)}: run gpu_report again later, or "
                "use --watch.",
            )
        )
    else:
        # One saved reading outside a job (a pasted nvidia-smi) is not "every sample".
        snapshot = job is None and summary.samples_per_gpu == 1
        notes.extend(_utilisation_notes(stats, t, snapshot=snapshot))
    notes.extend(_memory_notes(stats, t))
    notes.extend(_missing_notes(stats, fields_read))
    return notes
