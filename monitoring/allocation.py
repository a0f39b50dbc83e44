"""Which of the GPUs that `nvidia-smi` shows belong to the job, and by which rule.

With Slurm's device cgroups (`ConstrainDevices=yes`) a job sees only its own GPUs, renumbered
from 0, and there is nothing to choose. Without them `nvidia-smi` lists every GPU of the node,
including other jobs' GPUs, under their node-wide indices, which are the indices Slurm reports
(`SLURM_JOB_GPUS`, `scontrol -d show job` -> `GRES=gpu:2(IDX:0-1)`). So the allocation is applied
only when the node shows more GPUs than the job was given.

Where the allocation comes from, first found wins:
  * on the node (the sampler): `SLURM_STEP_GPUS`, `SLURM_JOB_GPUS`, then `CUDA_VISIBLE_DEVICES`
    (indices, or `GPU-...` UUIDs), as Slurm sets them in the job's steps;
  * at report time, for samples the sampler could not choose among: scontrol's GRES indices
    (known while the job runs) and, failing those, only the GPU count (a warning, no choice).
Every choice is described in words, so the report can say which rule was used.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from monitoring.records import GpuSample, JobInfo, SamplerStart

ENV_RULES: tuple[str, ...] = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True)
class Allocation:
    """The job's GPUs on one node: node-wide indices, or UUIDs (CUDA_VISIBLE_DEVICES=GPU-...)."""

    indices: tuple[int, ...]
    uuids: tuple[str, ...]
    rule: str  # where it came from, e.g. "SLURM_JOB_GPUS=0,1"


def _indices(value: str) -> tuple[int, ...] | None:
    """`0,1` or `0-1,3` -> (0, 1, 3); None for anything else (`NoDevFiles`, UUIDs)."""
    out: list[int] = []
    for item in value.split(","):
        low, _, high = item.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            return None
        out.extend(range(int(low), int(high or low) + 1))
    return tuple(out)


def allocation_from_env(env: Mapping[str, str]) -> Allocation | None:
    """The GPUs Slurm gave this step/job, from the environment it sets in a step."""
    for name in ENV_RULES:
        value = env.get(name, "").strip()
        if not value:
            continue
        indices = _indices(value)
        if indices is not None:
            return Allocation(indices, (), f"{name}={value}")
        items = tuple(item.strip() for item in value.split(","))
        if name == "CUDA_VISIBLE_DEVICES" and all(i.startswith(("GPU-", "MIG-")) for i in items):
            return Allocation((), items, f"{name}={value}")
    return None


def job_gpu_indices(seen: Collection[int], allocated: Collection[int] | None) -> set[int]:
    """The indices among `seen` to keep for the job (all of them unless the node shows more)."""
    if not allocated or len(set(seen)) <= len(set(allocated)):
        return set(seen)
    return set(seen) & set(allocated)


def _listed(indices: Collection[int]) -> str:
    return ",".join(str(i) for i in sorted(indices))


def choose(
    gpus: Sequence[tuple[int, str | None]], allocation: Allocation | None
) -> tuple[set[int], str]:
    """(indices to keep, why) among the (index, uuid) pairs nvidia-smi listed on a node."""
    seen = {index for index, _ in gpus}
    shown = f"the {len(seen)} GPU{'s' if len(seen) != 1 else ''} nvidia-smi lists"
    if allocation is None:
        return seen, (
            f"all {len(seen)}: no allocation known (no {', '.join(ENV_RULES)} in the "
            "sampler's environment)"
        )
    if allocation.uuids:
        wanted = set(allocation.uuids)
        keep = {index for index, uuid in gpus if uuid in wanted}
        if not keep:
            return seen, f"all of {shown}: none has a UUID of {allocation.rule}"
    else:
        keep = job_gpu_indices(seen, allocation.indices)
        if keep == seen:
            return seen, f"all of {shown} ({allocation.rule}: the node shows only the job's GPUs)"
        if not keep:
            return seen, f"all of {shown}: none is in {allocation.rule}"
    return keep, f"GPUs {_listed(keep)} of {shown} ({allocation.rule})"


@dataclass(frozen=True)
class Selection:
    """The samples kept for the job, how their GPUs were chosen per node, and any doubt left."""

    samples: list[GpuSample]
    rules: tuple[str, ...]  # "node: GPUs 0,1 of the 4 nvidia-smi lists (SLURM_JOB_GPUS=0,1)"
    warnings: tuple[str, ...]


def _per_node(job: JobInfo) -> int | None:
    if job.gpus is None or not job.nodes:
        return None
    return job.gpus // len(job.nodes)


def select_job_gpus(
    samples: Iterable[GpuSample], starts: Iterable[SamplerStart], job: JobInfo | None
) -> Selection:
    """Keep only the job's GPUs, node by node, and say which rule chose them.

    Where the sampler chose (its start record has `gpus`), its choice stands: Slurm's indices
    are only known to scontrol while the job runs, and describe its last leg only. Elsewhere
    (files from older samplers, a sampler that found no allocation, the live probe): scontrol's
    GRES indices when known, else a warning if the samples hold more GPUs than the job had.
    """
    samples = list(samples)
    by_host: dict[str, list[SamplerStart]] = defaultdict(list)
    for start in starts:
        by_host[start.host].append(start)
    seen: dict[str, set[int]] = defaultdict(set)
    for s in samples:
        seen[s.host].add(s.index)
    keep: dict[str, set[int]] = {}
    rules: list[str] = []
    warnings: list[str] = []
    for host in sorted(seen):
        chosen = [s for s in by_host.get(host, []) if s.gpus is not None]
        indices = job.gpu_indices.get(host) if job is not None else None
        per_node = _per_node(job) if job is not None else None
        keep[host] = seen[host]
        if chosen:
            for rule in dict.fromkeys(s.rule for s in chosen):
                rules.append(f"{host}: {rule}, chosen by the sampler")
        elif indices:
            rule = f"scontrol GRES IDX:{_listed(indices)}"
            chosen_here = job_gpu_indices(seen[host], indices)
            if chosen_here and chosen_here != seen[host]:
                keep[host] = chosen_here
                rules.append(
                    f"{host}: GPUs {_listed(chosen_here)} of the {len(seen[host])} in the "
                    f"samples ({rule})"
                )
            else:
                rules.append(f"{host}: all {len(seen[host])} in the samples ({rule})")
        elif job is not None and per_node is not None and len(seen[host]) > per_node:
            warnings.append(
                f"The samples of {host} hold {len(seen[host])} GPUs but job {job.job_id} had "
                f"{per_node} per node, and which ones was not recorded (the sampler found no "
                f"{', '.join(ENV_RULES)}; Slurm keeps GRES indices only while the job runs): all "
                f"{len(seen[host])} are shown and counted, other jobs' GPUs possibly among them. "
                "Start the sampler inside the job (srun --overlap, as slurm/finetune.sh does) "
                "so it reads the allocation."
            )
        else:
            unchosen = [s.rule for s in by_host.get(host, [])]
            rules.append(
                f"{host}: {unchosen[0] if unchosen else f'all {len(seen[host])} in the samples'}"
            )
    kept = [s for s in samples if s.index in keep[s.host]]
    return Selection(kept, tuple(rules), tuple(warnings))
