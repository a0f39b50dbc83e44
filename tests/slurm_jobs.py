"""Jobs on the one-node local Slurm that checks in several test modules read, run once per
test session (issue 47: a `slurm/finetune.sh` leg is ~20-40 s of the Slurm worker's time, most
of it processes importing torch, so two modules do not each run the same job).

    from tests.slurm_jobs import finetune_job  # noqa: F401  (in a test module)

    def test_something(finetune_job: FinishedJob):
        assert "memory plan: FITS" in finetune_job.text

A fixture imported into two modules is registered once per module, so a session-scoped one
would still run once per module: the job is kept here, per pytest process, instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.local_slurm import LocalSlurm

REPO = Path(__file__).resolve().parent.parent
# Two emulated GPUs, the node's two CPUs, a little memory: the job fits the 2-core test machine.
RESOURCES = ("--gpus-per-node=2", "--cpus-per-task=2", "--mem=6G", "--time=10")
TINY_RUN = (
    "--dataset_include", "",
    "--max_seq_length", "128",
    "--eval_examples", "16",
    "--eval_every", "0",
    "--precision", "fp32",
)  # fmt: skip


@dataclass(frozen=True)
class FinishedJob:
    job: str
    info: dict[str, str]  # `scontrol show job` once it finished
    log: Path
    run_dir: Path
    # `python monitoring/gpu_report.py <job> --plain` from the submitting shell, as the job
    # ended: scontrol forgets a finished job after MinJobAge (10 min), and the session's other
    # Slurm tests may take longer than that before a reader's turn.
    report: subprocess.CompletedProcess[str]

    @property
    def text(self) -> str:
        return self.log.read_text()


_jobs: dict[str, FinishedJob] = {}


def newcomer_shell(slurm: LocalSlurm) -> dict[str, str]:
    """A shell as docs/local-slurm.md has a newcomer open it: this machine's PATH (no
    nvidia-smi on it), then `source slurm/local/env.sh`, which puts the replay
    (slurm/local/bin/nvidia-smi) on PATH since the machine has none."""
    shell = slurm.env
    shell["PATH"] = os.pathsep.join(
        p for p in shell["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()
    )
    sourced = subprocess.run(
        ["bash", "-c", 'source slurm/local/env.sh >/dev/null && printf %s "$PATH"'],
        cwd=REPO, env=shell, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return {**shell, "PATH": sourced.stdout}


@pytest.fixture(scope="session")
def finetune_job(
    local_slurm: LocalSlurm, tiny_assets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> FinishedJob:
    """`sbatch slurm/finetune.sh` from a newcomer's shell (`newcomer_shell`), 4 steps of the
    tiny model on the job's 2 emulated GPUs (2 CPU processes, gloo), every override through the
    environment, the GPU sampler every second, then its GPU report: read by
    tests/test_slurm_finetune.py (the job, the run folder) and
    tests/test_slurm_gpu_report_local.py (the report)."""
    if "finetune" not in _jobs:
        work = tmp_path_factory.mktemp("finetune_job")
        run_dir, log = work / "run", work / "slurm.out"
        shell = newcomer_shell(local_slurm)
        env = {
            **shell,
            "SETUP": f"source {Path(sys.executable).parent / 'activate'}",  # this venv
            "MODEL": str(tiny_assets["model"]),
            "DATASET": str(tiny_assets["data"]),
            "OUTPUT_DIR": str(run_dir),
            "TOTAL_BATCH_SIZE": "8",
            "BATCH_SIZE_PER_DEVICE": "2",
            "GPU_SAMPLE_INTERVAL": "1",
        }
        job = local_slurm.sbatch(
            *RESOURCES, f"--output={log}", "slurm/finetune.sh", *TINY_RUN,
            "--max_training_steps", "4",
            cwd=REPO, env=env,
        )  # fmt: skip
        info = local_slurm.wait(job, timeout=240)
        report = subprocess.run(
            [sys.executable, "monitoring/gpu_report.py", job, "--plain"],
            cwd=REPO, env=shell, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        _jobs["finetune"] = FinishedJob(job, info, log, run_dir, report)
    return _jobs["finetune"]
