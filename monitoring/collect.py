"""Everything that runs a command: Slurm's client tools, `bsc_load`, and the `srun` probe.

Each function turns tool failures into either data (a `NodeError` the report explains) or a
`ReportError` whose message says what to do; never a traceback.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from monitoring.parse import (
    accounting_gpu_tres,
    job_from_sacct,
    parse_bsc_load,
    parse_probe_output,
    parse_sacct,
    parse_scontrol_job,
    parse_slurm_version,
)
from monitoring.records import AccountingGpu, BscLoadNode, JobInfo, NodeError, Probe

REPO_ROOT = Path(__file__).resolve().parent.parent
SACCT_FIELDS: tuple[str, ...] = (
    "JobID",
    "JobName",
    "User",
    "State",
    "Elapsed",
    "Start",
    "End",
    "NNodes",
    "NodeList",
    "AllocTRES",
    "TRESUsageInAve",
    "TRESUsageInMax",
    "WorkDir",
)
GPU_TRES_SINCE = (23, 2, 0)
GPU_TRES_SUMMED_SINCE = (24, 5, 1)


class ReportError(ValueError):
    """A problem the user can act on; the message says how."""


class MissingCommandError(ReportError):
    def __init__(self, command: str) -> None:
        super().__init__(
            f"`{command}` is not on PATH: this machine has no Slurm client commands. Run "
            "gpu_report on the cluster's login node (where sbatch works), or summarise a run's "
            "saved samples without Slurm: python monitoring/gpu_report.py --run_dir <run folder>"
        )
        self.command = command


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def first_lines(text: str, count: int = 3) -> str:
    return " / ".join(line.strip() for line in text.strip().splitlines()[:count])


def run_command(
    argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None
) -> CommandResult:
    """Run a command; a missing executable is a ReportError, a timeout is returncode 124."""
    if shutil.which(argv[0]) is None:
        raise MissingCommandError(argv[0])
    proc = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(env) if env is not None else None,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGINT first: srun then cancels its step cleanly instead of leaving it behind.
        proc.send_signal(signal.SIGINT)
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        return CommandResult(tuple(argv), 124, stdout, stderr + f"\ntimed out after {timeout:g} s")
    return CommandResult(tuple(argv), proc.returncode, stdout, stderr)


_JOB_ID = re.compile(r"^\d+(_\d+)?$")


def validate_job_id(text: str) -> str:
    text = text.strip()
    if not _JOB_ID.match(text):
        raise ReportError(
            f"{text!r} is not a Slurm job id (a number such as 123456, or 123456_7 for an array "
            "task). List your jobs with: squeue --me   (or, for finished ones: sacct -X)"
        )
    return text


def sacct_rows(job_id: str, timeout: float = 60) -> tuple[list[dict[str, str]], str | None]:
    """sacct's rows for the job and its steps, or ([], why not)."""
    if shutil.which("sacct") is None:
        return [], "sacct is not available on this machine"
    result = run_command(
        ["sacct", "-j", job_id, "--noconvert", "-n", "-P", "-o", ",".join(SACCT_FIELDS)],
        timeout,
    )
    if not result.ok:
        return [], f"sacct failed: {first_lines(result.stderr or result.stdout)}"
    return parse_sacct(result.stdout, SACCT_FIELDS), None


def load_job(job_id: str, timeout: float = 30) -> tuple[JobInfo | None, str | None]:
    """What Slurm knows about the job: `scontrol` while it remembers it, then `sacct`.

    Returns (job, None) or (None, why it is unknown).
    """
    result = run_command(["scontrol", "-d", "show", "job", "-o", job_id], timeout)
    if result.ok and "JobId=" in result.stdout:
        return parse_scontrol_job(result.stdout), None
    text = result.stderr + result.stdout
    if "Invalid job id" not in text:
        raise ReportError(
            f"scontrol could not show job {job_id}: {first_lines(text)}. Is the Slurm "
            "controller reachable from here? Check with: scontrol ping"
        )
    rows, why = sacct_rows(job_id)
    job = job_from_sacct(rows, job_id) if rows else None
    if job is not None:
        return job, None
    reason = why or "accounting has no record of it"
    return None, f"scontrol does not know job {job_id} and {reason}"


@dataclass(frozen=True)
class Accounting:
    gpu: tuple[AccountingGpu, ...]
    note: str | None  # why there is nothing, or how to read what there is
    version: tuple[int, int, int] | None


def slurm_version(timeout: float = 20) -> tuple[int, int, int] | None:
    for tool in ("sacct", "sinfo", "srun"):
        if shutil.which(tool):
            return parse_slurm_version(run_command([tool, "--version"], timeout).stdout)
    return None


def accounting_note(
    gpu: Sequence[AccountingGpu], version: tuple[int, int, int] | None, why: str | None
) -> str | None:
    shown = ".".join(map(str, version)) if version else "unknown"
    if why:
        return f"No accounting data: {why}."
    if not gpu:
        if version is not None and version < GPU_TRES_SINCE:
            return (
                f"Slurm accounting here (Slurm {shown}) has no GPU TRES: gres/gpuutil and "
                "gres/gpumem exist only from Slurm 23.02 (with AutoDetect=nvml in gres.conf and "
                "gres/gpu in AccountingStorageTRES)."
            )
        return (
            f"Slurm accounting (Slurm {shown}) recorded no GPU TRES (gres/gpuutil, gres/gpumem) "
            "for this job: that needs AutoDetect=nvml in gres.conf and gres/gpu in "
            "AccountingStorageTRES; ask your cluster's support."
        )
    if version is not None and version >= GPU_TRES_SUMMED_SINCE:
        return (
            f"Slurm {shown} sums gres/gpuutil over a step's GPUs (400 = 4 busy GPUs); the "
            "per-GPU column divides by the step's GPU count."
        )
    return None


def load_accounting(job_id: str) -> Accounting:
    rows, why = sacct_rows(job_id)
    gpu = accounting_gpu_tres(rows)
    version = slurm_version()
    return Accounting(tuple(gpu), accounting_note(gpu, version, why), version)


@dataclass(frozen=True)
class ProbeOptions:
    samples: int = 5
    interval: float = 1.0  # seconds between samples
    processes: bool = True
    margin: float = 60.0  # srun start-up and nvidia-smi latency on top of samples * interval

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ReportError(f"--samples must be >= 1, got {self.samples}")
        if self.interval <= 0:
            raise ReportError(f"--interval must be > 0 seconds, got {self.interval}")


def probe_command(job: JobInfo, options: ProbeOptions, python: str) -> list[str]:
    """One overlapping step, one task per node, each running the sampler for a few seconds.

    `--overlap` is required since Slurm 20.11 to share the job's resources with its running
    steps (else "step creation temporarily disabled"); the step sees the job's GPUs.
    """
    nodes = max(1, len(job.nodes))
    argv = [
        "srun",
        f"--jobid={job.job_id}",
        "--overlap",
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        "--label",
        "--kill-on-bad-exit=0",
        "--job-name=gpu_report",
        python,
        "-m",
        "monitoring.sampler",
        "--output",
        "-",
        "--count",
        str(options.samples),
        "--interval",
        f"{options.interval:g}",
    ]
    return [*argv, "--processes"] if options.processes else argv


class JobEndedError(ReportError):
    """The job finished between looking it up and probing it."""


def probe_job(
    job: JobInfo, options: ProbeOptions, python: str = sys.executable, root: Path = REPO_ROOT
) -> Probe:
    """Measure a running job's GPUs on all its nodes (see `probe_command`)."""
    # The node runs this package from the same checkout (shared file system, as for training).
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    timeout = options.samples * options.interval + options.margin
    result = run_command(probe_command(job, options, python), timeout, env)
    probe = parse_probe_output(result.stdout)
    if result.ok:
        return probe
    stderr = result.stderr
    if "Access/permission denied" in stderr:
        raise ReportError(
            f"Slurm refused to attach to job {job.job_id} (owner: {job.user or 'another user'}):"
            " only the job's owner or an admin can measure its GPUs. Ask the owner to run: "
            f"python monitoring/gpu_report.py {job.job_id}"
        )
    if any(
        marker in stderr
        for marker in ("already completing or completed", "Invalid job id", "has already ended")
    ):
        raise JobEndedError(f"job {job.job_id} ended while it was being measured")
    if not probe.samples:
        problem = "timed out" if result.returncode == 124 else f"failed (exit {result.returncode})"
        message = f"srun --overlap probe {problem}: {first_lines(stderr) or 'no output'}"
        return Probe(probe.samples, probe.processes, (*probe.errors, NodeError("srun", message)))
    return probe


def run_bsc_load(job_id: str, timeout: float = 60) -> tuple[list[BscLoadNode], str | None]:
    """MareNostrum's `bsc_load <jobid>` where it exists: ([], None) elsewhere."""
    if shutil.which("bsc_load") is None:
        return [], None
    result = run_command(["bsc_load", job_id], timeout)
    nodes = parse_bsc_load(result.stdout)
    if not nodes:
        return [], f"bsc_load printed no table: {first_lines(result.stderr or result.stdout)}"
    return nodes, None
