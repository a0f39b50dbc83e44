"""gpu_report end to end on the one-node Slurm of slurm/local/ (4 emulated GPUs, no real ones).

The nvidia-smi on the node's PATH is the clearly marked test stand-in tests/fake_bin/nvidia-smi
(replaying a real 8 x H200 recording); everything else is real: sbatch, scontrol, the
`srun --jobid=<id> --overlap` probe step, the sampler inside a batch job, the run folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from monitoring.parse import parse_scontrol_job
from tests.local_slurm import LocalSlurm, local_slurm  # noqa: F401  (session fixture)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
FAKE_BIN = REPO / "tests" / "fake_bin"
SCRIPT = REPO / "monitoring" / "gpu_report.py"
SMALL = ("--mem=100M", "--time=5")  # leave room for other tests' jobs on the 2-CPU node


def report_env(slurm: LocalSlurm, fake: bool = True, **extra: str) -> dict[str, str]:
    env = slurm.env
    if fake:
        env["PATH"] = f"{FAKE_BIN}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def gpu_report(
    *args: str, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def running_job(
    local_slurm: LocalSlurm,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    work = tmp_path_factory.mktemp("running_job")
    job_id = local_slurm.sbatch(*SMALL, "--gres=gpu:2", "--wrap", "sleep 240", cwd=work)
    local_slurm.wait(job_id, states=frozenset({"RUNNING"}))
    yield job_id
    local_slurm.run("scancel", job_id, check=False)


def test_live_report_through_srun_overlap(
    local_slurm: LocalSlurm,  # noqa: F811
    running_job: str,
    tmp_path: Path,
) -> None:
    calls = tmp_path / "nvidia-smi-calls.jsonl"
    env = report_env(local_slurm, FAKE_NVIDIA_SMI_LOG=str(calls))
    result = gpu_report(running_job, "--json", "--samples", "3", "--interval", "0.5", env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["job"]["state"] == "RUNNING" and report["job"]["gpus"] == 2
    (live,) = report["measurements"]
    assert live["title"] == "Live"
    # The node shows the recording's 8 GPUs; only the job's two (IDX:0-1 here) are reported.
    allocated = report["job"]["gpu_indices"][local_slurm.node_name]
    assert [(g["host"], g["index"]) for g in live["gpus"]] == [
        (local_slurm.node_name, i) for i in allocated
    ]
    assert all(g["samples"] == 3 and g["util_mean"] == 100.0 for g in live["gpus"])
    assert all(len(g["processes"]) == 1 for g in live["gpus"])
    # bsc_load (its stand-in, replaying seed 004) is run on the login node and shown too.
    assert [g["utilization_pct"] for g in report["bsc_load"][0]["gpus"]] == [56, 99, 100, 74]
    # nvidia-smi really ran inside a step of that job (not the batch step) on the node.
    records = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(records) == 3 + 1  # three samples, one process query
    assert {r["SLURM_JOB_ID"] for r in records} == {running_job}
    assert all(r["SLURM_STEP_ID"] not in (None, "batch") for r in records)


def test_live_report_without_nvidia_smi(
    local_slurm: LocalSlurm,  # noqa: F811
    running_job: str,
    tmp_path: Path,
) -> None:
    result = gpu_report(running_job, "--samples", "1", env=report_env(local_slurm, fake=False))
    assert result.returncode == 1  # nothing measured at all
    flat = " ".join(result.stdout.split())
    assert f"{local_slurm.node_name}: nvidia-smi is not on PATH there" in flat
    assert "module load cuda" in flat
    # Where bsc_load exists (only its stand-in on PATH here), its GPU% columns stand in.
    only_bsc = tmp_path / "bin"
    only_bsc.mkdir()
    (only_bsc / "bsc_load").symlink_to(FAKE_BIN / "bsc_load")
    env = report_env(local_slurm, fake=False)
    env["PATH"] = f"{only_bsc}{os.pathsep}{env['PATH']}"
    result = gpu_report(running_job, "--samples", "1", "--json", env=env)
    assert result.returncode == 0, result.stderr
    (live,) = json.loads(result.stdout)["measurements"]
    assert live["source"] == "bsc_load"
    assert [g["util_mean"] for g in live["gpus"]] == [56.0, 99.0, 100.0, 74.0]


def test_live_report_on_a_node_with_a_lost_gpu(
    local_slurm: LocalSlurm,  # noqa: F811
    running_job: str,
    tmp_path: Path,
) -> None:
    # The H200 recording with GPU 1's row replaced by the lost-GPU line of the errors fixture.
    fixtures = REPO / "tests" / "fixtures"
    rows = (fixtures / "nvidia_smi_query_gpu_8xH200.csv").read_text().splitlines()
    lost = (fixtures / "nvidia_smi_missing_and_errors.txt").read_text().splitlines()[2]
    recording = tmp_path / "lost.csv"
    recording.write_text("\n".join([rows[0], rows[1], lost, *rows[3:]]) + "\n")
    env = report_env(local_slurm, FAKE_NVIDIA_SMI_GPUS=str(recording), FAKE_NVIDIA_SMI_EXIT="15")
    result = gpu_report(running_job, "--samples", "2", "--interval", "0.2", env=env)
    assert result.returncode == 0, result.stderr
    flat = " ".join(result.stdout.split())
    assert "GPU has fallen off the bus" in flat and "(seen 2 times)" in flat
    assert f"sbatch --exclude={local_slurm.node_name}" in flat


def test_scontrol_fixture_matches_the_live_cluster(
    local_slurm: LocalSlurm,  # noqa: F811
    running_job: str,
) -> None:
    live = local_slurm.run("scontrol", "-d", "show", "job", "-o", running_job).stdout
    recorded = (REPO / "tests" / "fixtures" / "scontrol_show_job_running_2gpu.txt").read_text()
    for text in (live, recorded):
        job = parse_scontrol_job(text)
        assert (job.state, job.gpus, job.user) == ("RUNNING", 2, "root")
        assert len(job.gpu_indices) == 1 and len(next(iter(job.gpu_indices.values()))) == 2


def test_another_users_job_is_refused(
    local_slurm: LocalSlurm,  # noqa: F811
    running_job: str,
) -> None:
    # The venv's interpreter lives under /root; `nobody` runs Debian's Python 3.11 with the
    # venv's packages instead.
    system_python = Path("/usr/bin/python3")
    site = next((REPO / ".venv" / "lib").glob("python3.*/site-packages"), None)
    if not (system_python.exists() and shutil.which("runuser") and site):
        pytest.skip("needs /usr/bin/python3 and runuser to act as another user")
    result = subprocess.run(
        ["runuser", "-u", "nobody", "--", "env", f"SLURM_CONF={local_slurm.conf_file}",
         f"PYTHONPATH={site}", str(system_python), str(SCRIPT), running_job],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert f"Job {running_job} belongs to root, not to you (nobody)" in result.stderr
    assert "Traceback" not in result.stderr


def test_pending_and_unknown_jobs(
    local_slurm: LocalSlurm,  # noqa: F811
    tmp_path: Path,
) -> None:
    held = local_slurm.sbatch(*SMALL, "--hold", "--wrap", "true", cwd=tmp_path)
    try:
        result = gpu_report(held, env=report_env(local_slurm))
        assert result.returncode == 1
        assert f"Job {held} is pending (JobHeldUser)" in result.stderr
        assert f"squeue -j {held}" in result.stderr
    finally:
        local_slurm.run("scancel", held, check=False)
    result = gpu_report("987654321", env=report_env(local_slurm))
    assert result.returncode == 1
    assert "Job 987654321 is unknown" in result.stderr and "--run_dir" in result.stderr


def test_finished_job_without_samples(
    local_slurm: LocalSlurm,  # noqa: F811
    tmp_path: Path,
) -> None:
    job_id = local_slurm.sbatch(*SMALL, "--wrap", "true", cwd=tmp_path)
    local_slurm.wait(job_id)
    result = gpu_report(job_id, env=report_env(local_slurm))
    assert result.returncode == 1
    flat = " ".join(result.stderr.split())
    assert f"Job {job_id} has ended (COMPLETED) and no GPU samples of it were found" in flat
    assert str(tmp_path / "gpu_samples") in flat  # where it looked: the job's WorkDir
    assert "python -m monitoring.sampler" in flat
    assert "accounting" in flat  # and why Slurm accounting cannot stand in here


SAMPLED_JOB = """#!/bin/bash
#SBATCH --gres=gpu:2
#SBATCH --output={run}/logs/slurm-%j.out
# What slurm/finetune.sh does around training: one sampler per node in the background.
srun --overlap --ntasks-per-node=1 -N "$SLURM_NNODES" {python} -m monitoring.sampler \\
    --output {run}/gpu_samples --interval 0.5 &
sampler=$!
sleep {seconds}
# srun answers SIGTERM by cancelling the step: its exit status is not the job's.
kill "$sampler"
wait "$sampler" || true
"""


def test_watch_follows_a_sampled_job_to_its_post_mortem(
    local_slurm: LocalSlurm,  # noqa: F811
    tmp_path: Path,
) -> None:
    run = tmp_path / "runs" / "chess"
    (run / "logs").mkdir(parents=True)
    script = tmp_path / "job.sh"
    script.write_text(SAMPLED_JOB.format(run=run, python=sys.executable, seconds=10))
    env = report_env(local_slurm)
    job_id = local_slurm.sbatch(*SMALL, str(script), cwd=tmp_path, env=env)
    local_slurm.wait(job_id, states=frozenset({"RUNNING"}))
    deadline = time.monotonic() + 60  # the sampler's first rows, not a fixed sleep
    while sum(len(p.read_text().splitlines()) for p in (run / "gpu_samples").glob("*.csv")) < 5:
        assert time.monotonic() < deadline, "the sampler wrote nothing"
        time.sleep(0.1)
    watch = gpu_report(
        job_id, "--watch", "--json", "--refresh", "1", "--samples", "2", "--interval", "0.2",
        env=env, timeout=150,
    )  # fmt: skip
    assert watch.returncode == 0, watch.stderr
    reports = [json.loads(line) for line in watch.stdout.splitlines()]
    assert len(reports) >= 2
    first, last = reports[0], reports[-1]
    assert first["job"]["state"] == "RUNNING"
    assert [m["title"] for m in first["measurements"]] == ["Live", "Run so far"]
    assert last["job"]["state"] == "COMPLETED"
    (whole,) = last["measurements"]
    assert whole["title"] == "Whole run"
    # Found without --run-dir: next to the job's log (<run>/logs/slurm-<id>.out).
    assert str(run / "gpu_samples") in whole["source"]
    # Of the 8 GPUs the stand-in shows, the sampler kept the job's two (from SLURM_JOB_GPUS).
    allocated = first["job"]["gpu_indices"][local_slurm.node_name]
    assert [g["index"] for g in whole["gpus"]] == allocated and len(allocated) == 2
    per_gpu = whole["summary"]["samples_per_gpu"]
    assert per_gpu >= 10  # 0.5 s apart over ~10 s
    assert len(whole["gpus"][0]["timeline"]) == min(24, per_gpu)  # one bin per sample at most
    assert "accounting" in (last["accounting_note"] or "")
    assert any("has run for only" in n["text"] for n in last["notes"])  # < 5 minutes

    # And the plain post-mortem a user reads, after the job has ended.
    result = gpu_report(job_id, env=env)
    assert result.returncode == 0, result.stderr
    assert "Whole run: sampler files in" in result.stdout
    assert "Util over time" in result.stdout


REQUEUED_JOB = """#!/bin/bash
#SBATCH --gres=gpu:2
#SBATCH --output={run}/logs/slurm-%j.out
#SBATCH --open-mode=append
# Two legs, as slurm/finetune.sh runs them: the sampler beside the work, then a requeue.
# (--count ends the sampler by itself: srun would wait KillWait seconds after a kill.)
srun --overlap --ntasks-per-node=1 -N "$SLURM_NNODES" {python} -m monitoring.sampler \\
    --output {run}/gpu_samples --interval 0.25 --count 6
if [ "${{SLURM_RESTART_COUNT:-0}}" -lt 1 ]; then scontrol requeue "$SLURM_JOB_ID"; fi
"""


def test_requeued_job_report_lists_its_legs_and_plots(
    local_slurm: LocalSlurm,  # noqa: F811
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    script = tmp_path / "job.sh"
    script.write_text(REQUEUED_JOB.format(run=run, python=sys.executable))
    env = report_env(local_slurm)
    job_id = local_slurm.sbatch(*SMALL, str(script), cwd=tmp_path, env=env)
    local_slurm.wait_until(
        job_id, lambda i: i.get("Restarts") == "1" and i.get("JobState") == "COMPLETED"
    )
    png = tmp_path / "gpu.png"
    result = gpu_report(job_id, "--json", "--plot", str(png), env=env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    (whole,) = data["measurements"]
    legs = whole["summary"]["legs"]
    assert [leg["restart"] for leg in legs] == [0, 1]
    assert all(leg["job_id"] == job_id and leg["samples_per_gpu"] == 6 for leg in legs)
    assert legs[0]["end"] < legs[1]["start"]
    # The stand-in lists 8 GPUs; the sampler kept the job's 2, and the report says by which rule.
    node = local_slurm.node_name
    assert len(whole["gpus"]) == 2
    (rule,) = whole["gpu_selection"]
    assert rule.startswith(f"{node}: GPUs ") and "of the 8 GPUs nvidia-smi lists" in rule
    assert "SLURM_STEP_GPUS=" in rule and rule.endswith("chosen by the sampler")
    assert data["plot"] == str(png) and png.stat().st_size > 10_000
