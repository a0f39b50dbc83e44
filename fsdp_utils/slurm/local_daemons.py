"""What both local clusters (`local_cluster`: one node; `local_multinode`: N nodes) do with
their daemons: find the Slurm and munge commands, follow processes by pid file, wait, probe
munged, cancel the jobs, refuse a foreign slurmctld on our port, emulate GPU devices.

Processes are tracked by pid, never by name: other clusters' daemons of the same names may run
beside ours. Only the standard library is used (`slurm/local/up.sh` may run the system python3).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from fsdp_utils.slurm.local_conf import NodeHardware

# Git-ignored state folders (config, spool, logs, pid files, leases) of the two clusters.
DEFAULT_STATE_DIR = Path(__file__).resolve().parents[2] / "slurm" / "local" / "state"
DEFAULT_MULTI_STATE_DIR = DEFAULT_STATE_DIR.with_name("state-multi")
# /dev/null's device numbers: slurmd accepts only character or block devices in gres.conf.
NULL_DEVICE = (1, 3)
# Daemons live in /usr/sbin, which is not on an ordinary user's PATH.
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
INSTALL_HINT = "Install them with: bash slurm/local/install.sh (or: make setup-system)"


class LocalClusterError(RuntimeError):
    """A local cluster could not be brought up or down; the message says why and what to do."""


def which(command: str) -> str:
    """Full path of a Slurm or munge command, or an error saying how to install them."""
    path = shutil.which(command, path=SBIN_PATH)
    if path is None:
        raise LocalClusterError(f"`{command}` is not installed. {INSTALL_HINT}")
    return path


def detect_node_hardware() -> NodeHardware:
    """The hardware as slurmd sees it (and the short host name it will register as)."""
    out = subprocess.run([which("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    return NodeHardware.from_slurmd_c(out.splitlines()[0])


def make_gpu_files(paths: list[Path]) -> None:
    """The emulated GPUs: character devices with /dev/null's numbers."""
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and not stat.S_ISCHR(path.stat().st_mode):
            path.unlink()
        if not path.exists():
            os.mknod(path, 0o644 | stat.S_IFCHR, os.makedev(*NULL_DEVICE))


def running(pid: int) -> bool:
    """True while `pid` runs. A daemon's orphaned zombie counts as gone: in containers pid 1
    does not always reap them."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat_line.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def pid_alive(pid_file: Path) -> int | None:
    """The pid in `pid_file` if that process runs."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if running(pid) else None


def wait_for(predicate: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise LocalClusterError(f"Timed out after {timeout:.0f} s waiting for {what}.")


def terminate(pid_file: Path, timeout: float = 15) -> None:
    """SIGTERM the daemon and wait for the process itself: daemons delete their pid file
    before they finish shutting down."""
    pid = pid_alive(pid_file)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not running(pid), timeout=timeout, what=f"pid {pid} ({pid_file.stem})")


def munge_works(socket_path: Path | None = None) -> bool:
    """True if a munged answers on `socket_path` (default: the default socket, ours or the
    system's): a credential made there decodes there."""
    socket_arg = [] if socket_path is None else [f"--socket={socket_path}"]
    try:
        cred = subprocess.run(
            [which("munge"), "-n", *socket_arg], capture_output=True, check=True, timeout=10
        ).stdout
        subprocess.run(
            [which("unmunge"), *socket_arg], input=cred, capture_output=True, check=True, timeout=10
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, LocalClusterError):
        return False
    return True


def usable(state: str | None) -> bool:
    """A node state as sinfo prints it (idle, mixed, down*, drained...) that accepts jobs."""
    return state is not None and state.rstrip("*~#") in ("idle", "mixed", "allocated", "completing")


def refuse_foreign_daemon(port: int, state_dir: Path, *, down_command: str) -> None:
    """Another slurmctld on our port (another checkout's local cluster) would take our jobs."""
    with socket.socket() as probe:
        probe.settimeout(1)
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise LocalClusterError(
                f"Port {port} is taken by another slurmctld (not started from {state_dir}): "
                f"stop it with its checkout's `{down_command}`."
            )


def cancel_all_jobs(env: dict[str, str], ctld_pid_file: Path) -> None:
    """Cancel every job of a running controller and wait (a little) for their steps to end:
    the first thing to stop, before the daemons the job steps talk to."""
    if pid_alive(ctld_pid_file) is None:
        return
    jobs = subprocess.run(
        [which("squeue"), "-h", "-o", "%A"], capture_output=True, text=True, env=env
    ).stdout.split()
    if jobs:
        subprocess.run([which("scancel"), *jobs], env=env, capture_output=True)
        # Give slurmstepd a moment to kill the job processes (KillWait is 5 s).
        with contextlib.suppress(LocalClusterError):
            wait_for(lambda: no_job_steps(env), timeout=15, what="jobs to end")


def no_job_steps(env: dict[str, str]) -> bool:
    """No job runs or completes on the cluster `env` (its SLURM_CONF) points at."""
    out = subprocess.run(
        [which("squeue"), "-h", "-t", "RUNNING,COMPLETING", "-o", "%A"],
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    return not out.strip()
