"""The GPU report on the local Slurm, as docs/local-slurm.md has a newcomer run it (issue 48):
a job submitted from a shell that sourced `slurm/local/env.sh` runs `slurm/finetune.sh`; the
node has no nvidia-smi, so env.sh put the replay (`slurm/local/bin/nvidia-smi`) on PATH; the
job's sampler records it, and `python monitoring/gpu_report.py <jobid>` reports the job, with
its numbers named a replay."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import local_slurm as slurm_fixture
from tests.local_slurm import LocalSlurm

local_slurm = slurm_fixture.local_slurm  # the session fixture, under its own name

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def test_a_local_jobs_gpu_report_is_a_replay_named_as_such(
    local_slurm: LocalSlurm, tiny_assets: dict[str, Path], tmp_path: Path
) -> None:
    shell = local_slurm.env
    shell["PATH"] = os.pathsep.join(  # this machine's PATH: no nvidia-smi on it
        p for p in shell["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()
    )
    sourced = subprocess.run(
        ["bash", "-c", 'source slurm/local/env.sh >/dev/null && printf %s "$PATH"'],
        cwd=REPO, env=shell, capture_output=True, text=True, check=True,
    )  # fmt: skip
    run_dir, log = tmp_path / "run", tmp_path / "slurm.out"
    env = {
        **shell,
        "PATH": sourced.stdout,
        "SETUP": f"source {Path(sys.executable).parent / 'activate'}",  # this venv
        "MODEL": str(tiny_assets["model"]),
        "DATASET": str(tiny_assets["data"]),
        "OUTPUT_DIR": str(run_dir),
        "TOTAL_BATCH_SIZE": "8",
        "BATCH_SIZE_PER_DEVICE": "2",
        "GPU_SAMPLE_INTERVAL": "1",
    }
    job = local_slurm.sbatch(
        "--gpus-per-node=2", "--cpus-per-task=2", "--mem=6G", "--time=10", f"--output={log}",
        "slurm/finetune.sh", "--dataset_include", "", "--max_seq_length", "128",
        "--eval_examples", "16", "--eval_every", "0", "--precision", "fp32",
        "--max_training_steps", "3",
        cwd=REPO, env=env,
    )  # fmt: skip
    info = local_slurm.wait(job, timeout=240)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "nvidia-smi not found" not in text

    report = subprocess.run(
        [sys.executable, "monitoring/gpu_report.py", job, "--plain"],
        cwd=REPO, env=shell, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert report.returncode == 0, report.stdout + report.stderr
    flat = " ".join(report.stdout.split())
    assert f"sampler files in {run_dir / 'gpu_samples'}" in flat, flat
    assert "REPLAY, not measured: recorded nvidia-smi output of 8 x H200" in flat
    assert "These GPU numbers are a replay, not a measurement of this job" in flat
    # The job's 2 GPUs of the recording (Slurm gave it GPUs 0 and 1), not all 8.
    assert "Job summary: 2 GPUs measured" in flat
    assert "GPUs 0,1 of the 8 GPUs nvidia-smi lists (SLURM_STEP_GPUS=0,1)" in flat
