"""The scheduler job a training process runs in, and which leg of it: a requeued Slurm job keeps
its id and counts its restarts, so "this job's own checkpoints" and "a requeued leg" are facts
the trainer can read instead of guess.

The launchers say it explicitly where the scheduler does not: `slurm/submit.py`'s tasks set
`FSDP_UTILS_JOB_ID` / `FSDP_UTILS_RESTART_COUNT` (submitit's local executor has no restart
counter); under `sbatch slurm/finetune.sh` Slurm's own `SLURM_JOB_ID` / `SLURM_RESTART_COUNT`
reach every process (srun and torchrun pass the environment on).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

JOB_ID_ENV = "FSDP_UTILS_JOB_ID"
RESTART_COUNT_ENV = "FSDP_UTILS_RESTART_COUNT"


@dataclass(frozen=True)
class JobLeg:
    job_id: str | None  # None outside a scheduler job (a plain process or torchrun)
    restarts: int = 0  # 0: the job's first leg; k: its k-th requeue

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> JobLeg:
        env = os.environ if environ is None else environ
        job_id = env.get(JOB_ID_ENV) or env.get("SLURM_JOB_ID") or None
        restarts = env.get(RESTART_COUNT_ENV) or env.get("SLURM_RESTART_COUNT") or "0"
        return cls(job_id, int(restarts) if restarts.strip().isdigit() else 0)

    @property
    def requeued(self) -> bool:
        """A later leg of a job that was requeued (not a new job, nor a rerun by hand)."""
        return self.job_id is not None and self.restarts > 0

    def describe(self) -> str:
        return f"job {self.job_id}, restart {self.restarts}" if self.job_id else "no job"

    def to_dict(self) -> dict[str, object]:
        return {"id": self.job_id, "restarts": self.restarts}
