"""The legs of a run: a requeued job restarts (same job id, `SLURM_RESTART_COUNT` + 1), and a
resumed run may continue under a new job id in the same run folder.

The sampler logs a start record each time it starts (monitoring.sampler); each sample belongs
to the latest start of its job at or before it. A job is judged by the time its samples cover,
summed over its legs (the queue waits between legs are not run time), not by its last leg.
Files from samplers that wrote no start records form one leg per job id.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from monitoring.records import GpuSample, SamplerStart

# Samplers of one multi-node leg start within seconds of each other; without a restart count
# (outside Slurm) starts this close together are one leg.
SAME_LEG_S = 60.0


@dataclass(frozen=True)
class Leg:
    number: int  # 1, 2, ... in time order
    job_id: str | None
    restart: int | None  # SLURM_RESTART_COUNT, when the sampler recorded it
    start: float  # first sample (epoch seconds)
    end: float  # last sample
    samples_per_gpu: int

    @property
    def seconds(self) -> float:
        return self.end - self.start


def _boundaries(starts: Iterable[SamplerStart]) -> dict[str, list[tuple[float, int | None]]]:
    """Per job id, the (time, restart) at which each leg began, in time order."""
    by_job: dict[str, list[SamplerStart]] = defaultdict(list)
    for start in starts:
        by_job[start.job_id].append(start)
    out: dict[str, list[tuple[float, int | None]]] = {}
    for job_id, records in by_job.items():
        legs: list[tuple[float, int | None]] = []
        for record in sorted(records, key=lambda r: r.time):
            if legs and (
                record.restart == legs[-1][1]
                if record.restart is not None
                else record.time - legs[-1][0] < SAME_LEG_S
            ):
                continue  # another node of the same leg
            legs.append((record.time, record.restart))
        out[job_id] = legs
    return out


def find_legs(samples: Sequence[GpuSample], starts: Iterable[SamplerStart] = ()) -> list[Leg]:
    """The legs the samples fall into (samples without a time are left out)."""
    boundaries = _boundaries(starts)
    groups: dict[tuple[str | None, int], list[GpuSample]] = defaultdict(list)
    restarts: dict[tuple[str | None, int], int | None] = {}
    for s in samples:
        if s.time is None:
            continue
        # Leg -1: before the first start record of its job (or none recorded at all).
        leg, restart = -1, None
        for i, (when, count) in enumerate(boundaries.get(s.job_id or "", [])):
            if s.time + 1.0 >= when:  # times are written to 0.1 s: a little slack
                leg, restart = i, count
        groups[(s.job_id, leg)].append(s)
        restarts[(s.job_id, leg)] = restart
    legs = []
    for key, group in groups.items():
        times = [s.time for s in group if s.time is not None]
        per_gpu: dict[tuple[str, int], int] = defaultdict(int)
        for s in group:
            per_gpu[(s.host, s.index)] += 1
        legs.append((min(times), max(times), key, max(per_gpu.values())))
    legs.sort(key=lambda leg: leg[0])
    return [
        Leg(i + 1, key[0], restarts[key], first, last, per_gpu)
        for i, (first, last, key, per_gpu) in enumerate(legs)
    ]


def covered_seconds(legs: Sequence[Leg]) -> float:
    return sum(leg.seconds for leg in legs)


def leg_of(sample: GpuSample, legs: Sequence[Leg]) -> int | None:
    """The number of the leg a sample belongs to (legs do not overlap in time)."""
    if sample.time is None:
        return None
    for leg in legs:
        if leg.job_id == sample.job_id and leg.start <= sample.time <= leg.end:
            return leg.number
    return None
