"""The one-node local Slurm: real hardware advertised, emulated GPUs, overlapping steps, sharing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from fsdp_utils.slurm.local_cluster import acquire, is_up, release
from tests import local_slurm as slurm_fixture
from tests.local_slurm import LocalSlurm

local_slurm = slurm_fixture.local_slurm  # the session fixture, under its own name

pytestmark = pytest.mark.slow


def meminfo_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def test_node_advertises_the_real_hardware(local_slurm: LocalSlurm) -> None:
    out = local_slurm.run("scontrol", "show", "node", "-o", local_slurm.node_name).stdout
    fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
    assert int(fields["CPUTot"]) == len(os.sched_getaffinity(0))
    assert int(fields["RealMemory"]) == meminfo_mb()
    assert fields["Gres"] == f"gpu:{local_slurm.gpus}"
    # Asking for more CPUs than the machine has is refused at submission.
    too_many = local_slurm.run(
        "sbatch", f"-c{int(fields['CPUTot']) + 1}", "--wrap=true", check=False
    )
    assert too_many.returncode != 0
    assert "More processors requested than permitted" in too_many.stderr


def test_gpu_job_and_overlapping_step(local_slurm: LocalSlurm, tmp_path: Path) -> None:
    """A job asking for 2 GPUs sees them as on a GPU node, and `srun --jobid --overlap` attaches
    a second step to the running job (how the GPU sampler and the monitoring probe run)."""
    job = local_slurm.sbatch(
        "--gpus-per-node=2",
        "-c1",
        "--mem=500M",
        "-o",
        "job.out",
        "--wrap",
        'echo "gpus=$SLURM_GPUS_ON_NODE visible=$CUDA_VISIBLE_DEVICES"; '
        "while [ ! -e release ]; do sleep 0.2; done",
        cwd=tmp_path,
    )
    local_slurm.wait(job, timeout=60, states=frozenset({"RUNNING"}))
    probe = local_slurm.run(
        "srun", f"--jobid={job}", "--overlap", "bash", "-c", "echo step $CUDA_VISIBLE_DEVICES"
    )
    (tmp_path / "release").touch()
    info = local_slurm.wait(job, timeout=60)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0")
    assert probe.stdout.strip() == "step 0,1"
    assert (tmp_path / "job.out").read_text().strip() == "gpus=2 visible=0,1"


def test_a_second_user_shares_the_cluster(local_slurm: LocalSlurm) -> None:
    """Another session's lease reuses the running daemons and its release leaves them up."""
    pid_before = local_slurm.cluster.ctld_pid_file.read_text()
    lease = acquire(local_slurm.cluster)
    assert local_slurm.cluster.ctld_pid_file.read_text() == pid_before
    assert release(local_slurm.cluster, lease) is False
    assert is_up(local_slurm.cluster)


def test_scripts_are_idempotent_and_respect_running_sessions(local_slurm: LocalSlurm) -> None:
    """install.sh changes nothing when the packages are there; up.sh on a running cluster keeps
    it; down.sh leaves it up while this test session still holds its lease."""
    scripts = Path(__file__).resolve().parent.parent / "slurm" / "local"
    install = subprocess.run(["bash", scripts / "install.sh"], capture_output=True, text=True)
    assert install.returncode == 0 and "Installing" not in install.stdout
    assert "and munge are installed" in install.stdout
    pid = local_slurm.cluster.ctld_pid_file.read_text()
    up = subprocess.run([scripts / "up.sh"], capture_output=True, text=True)
    assert up.returncode == 0 and "Slurm is up: node" in up.stdout
    assert local_slurm.cluster.ctld_pid_file.read_text() == pid
    down = subprocess.run([scripts / "down.sh"], capture_output=True, text=True)
    assert "Slurm left running: still used by test session(s)" in down.stdout
    assert is_up(local_slurm.cluster)
