"""Which of the GPUs that `nvidia-smi` shows belong to the job.

With Slurm's device cgroups (`ConstrainDevices=yes`) a job sees only its own GPUs, renumbered
from 0, and there is nothing to choose. Without them `nvidia-smi` lists every GPU of the node,
including other jobs' GPUs, under their node-wide indices, which are the indices Slurm reports
(`SLURM_JOB_GPUS`, `scontrol -d show job` -> `GRES=gpu:2(IDX:0-1)`). So the allocation is applied
only when the node shows more GPUs than the job was given.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


def job_gpu_indices(seen: Collection[int], allocated: Collection[int] | None) -> set[int]:
    """The indices among `seen` to keep for the job (all of them unless the node shows more)."""
    if not allocated or len(set(seen)) <= len(set(allocated)):
        return set(seen)
    return set(seen) & set(allocated)


def allocated_from_env(env: Mapping[str, str]) -> list[int] | None:
    """GPU indices Slurm gave this step/job, from the environment it sets (`0,1` or `0-1`)."""
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        value = env.get(name, "").strip()
        if value:
            out: list[int] = []
            for item in value.split(","):
                low, _, high = item.partition("-")
                if not low.isdigit():
                    return None
                out.extend(range(int(low), int(high or low) + 1))
            return out
    return None
