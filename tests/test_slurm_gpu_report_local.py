"""The GPU report on the local Slurm, as docs/local-slurm.md has a newcomer run it (issue 48):
a job submitted from a shell that sourced `slurm/local/env.sh` runs `slurm/finetune.sh`; the
node has no nvidia-smi, so env.sh put the replay (`slurm/local/bin/nvidia-smi`) on PATH; the
job's sampler records it, and `python monitoring/gpu_report.py <jobid>` reports the job, with
its numbers named a replay. The job and its report are the session's `finetune_job`
(tests/slurm_jobs.py), which tests/test_slurm_finetune.py checks too."""

from __future__ import annotations

import pytest

from tests import local_slurm as slurm_fixture
from tests import slurm_jobs
from tests.slurm_jobs import FinishedJob

local_slurm = slurm_fixture.local_slurm  # the session fixture, under its own name
finetune_job = slurm_jobs.finetune_job  # the session's completed job, read by two modules

pytestmark = pytest.mark.slow


def test_a_local_jobs_gpu_report_is_a_replay_named_as_such(finetune_job: FinishedJob) -> None:
    job, run_dir, info = finetune_job.job, finetune_job.run_dir, finetune_job.info
    text = finetune_job.text
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "nvidia-smi not found" not in text

    report = finetune_job.report  # `gpu_report.py <job> --plain`, run as the job ended
    assert report.args[-2:] == [job, "--plain"]
    assert report.returncode == 0, report.stdout + report.stderr
    flat = " ".join(report.stdout.split())
    assert f"sampler files in {run_dir / 'gpu_samples'}" in flat, flat
    assert "REPLAY, not measured: recorded nvidia-smi output of 8 x H200" in flat
    assert "These GPU numbers are a replay, not a measurement of this job" in flat
    # The job's 2 GPUs of the recording (Slurm gave it GPUs 0 and 1), not all 8.
    assert "Job summary: 2 GPUs measured" in flat
    assert "GPUs 0,1 of the 8 GPUs nvidia-smi lists (SLURM_STEP_GPUS=0,1)" in flat
