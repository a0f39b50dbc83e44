"""A one-node Slurm on localhost: try `sbatch slurm/finetune.sh` on a workstation, test against it.
(`--nodes N` brings up the multi-node cluster of `local_multinode` instead, beside this one.)

Debian's slurm-wlm and munge run a real slurmctld and slurmd (as root: slurmd starts jobs as
their users). The node advertises exactly the CPUs and memory `slurmd -C` detects, plus GPUs
emulated for scheduling only: jobs that ask for them get `SLURM_GPUS_ON_NODE` and
`CUDA_VISIBLE_DEVICES` as on a GPU node, while the training itself runs on CPU (gloo).

Everything lives in one git-ignored state folder (config, spool, logs, pid files):

    <state>/etc/slurm.conf, <state>/etc/gres.conf   from the pure functions in `local_conf`
    <state>/gpus/nvidia0 ...                         the emulated GPU devices
    <state>/spool/, <state>/log/, <state>/leases/    daemon state, logs, who uses the cluster

Bringing it up and down is idempotent and serialised by a file lock. Each user of the cluster (a
pytest session, or `up.sh` for a person) holds a lease, and the daemons stop only when the last
lease is released, so concurrent test sessions share one cluster safely; leases of sessions that
died are ignored.

Only the standard library is used, so `slurm/local/up.sh` also works with the system python3.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from fsdp_utils.slurm.local_conf import (
    LocalCluster,
    MultiNodeCluster,
    NodeHardware,
    render_gres_conf,
    render_multi_gres_conf,
    render_multi_slurm_conf,
    render_slurm_conf,
)

# Leases, locks and the command line serve both clusters; starting and stopping differ.
AnyCluster = LocalCluster | MultiNodeCluster

DEFAULT_STATE_DIR = Path(__file__).resolve().parents[2] / "slurm" / "local" / "state"
MANUAL_LEASE = "manual"
# /dev/null's device numbers: slurmd accepts only character or block devices in gres.conf.
NULL_DEVICE = (1, 3)
# Daemons live in /usr/sbin, which is not on an ordinary user's PATH.
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
INSTALL_HINT = "Install them with: bash slurm/local/install.sh (or: make setup-system)"


class LocalClusterError(RuntimeError):
    """The local cluster could not be brought up or down; the message says why and what to do."""


# --- running it ------------------------------------------------------------------------------


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


def default_cluster(state_dir: Path | None = None, gpus: int = 4) -> LocalCluster:
    return LocalCluster(
        state_dir=(state_dir or DEFAULT_STATE_DIR).resolve(),
        node=detect_node_hardware(),
        gpus=gpus,
    )


def write_config(cluster: LocalCluster) -> None:
    for folder in (
        cluster.conf_file.parent,
        cluster.ctld_spool,
        cluster.slurmd_spool,
        cluster.log_dir,
        cluster.ctld_pid_file.parent,
        cluster.lease_dir,
    ):
        folder.mkdir(parents=True, exist_ok=True)
    cluster.conf_file.write_text(render_slurm_conf(cluster))
    cluster.gres_conf_file.write_text(render_gres_conf(cluster))
    make_gpu_files(cluster.gpu_files)


def make_gpu_files(paths: list[Path]) -> None:
    """The emulated GPUs: character devices with /dev/null's numbers."""
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and not stat.S_ISCHR(path.stat().st_mode):
            path.unlink()
        if not path.exists():
            os.mknod(path, 0o644 | stat.S_IFCHR, os.makedev(*NULL_DEVICE))


def _running(pid: int) -> bool:
    """True while `pid` runs. A daemon's orphaned zombie counts as gone: in containers pid 1
    does not always reap them."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat_line.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _pid_alive(pid_file: Path) -> int | None:
    """The pid in `pid_file` if that process runs."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if _running(pid) else None


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


def start_munge(cluster: LocalCluster) -> None:
    """Start munged as user munge unless one already answers (a system service, say)."""
    if munge_works():
        return
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        raise LocalClusterError(f"{key} is missing. {INSTALL_HINT}")
    run_dir = Path("/run/munge")
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.chown(run_dir, "munge", "munge")
    # munged forks into the background itself; its first process exits at once.
    subprocess.run([which("munged")], user="munge", check=True, start_new_session=True)
    cluster.munged_marker.write_text("munged was started by fsdp_utils.slurm.local_cluster\n")
    _wait_for(munge_works, timeout=10, what="munged to answer")


def stop_munge(cluster: LocalCluster) -> None:
    if not cluster.munged_marker.exists():
        return  # not ours: leave the system's munged alone
    pid = _pid_alive(Path("/run/munge/munged.pid"))
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
    cluster.munged_marker.unlink()


def _wait_for(predicate: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise LocalClusterError(f"Timed out after {timeout:.0f} s waiting for {what}.")


def node_state(cluster: LocalCluster) -> str | None:
    """The node's state as sinfo prints it (idle, mixed, allocated, down*, drained...)."""
    try:
        result = subprocess.run(
            [which("sinfo"), "-h", "-N", "-n", cluster.node.name, "-o", "%T"],
            capture_output=True,
            text=True,
            env=cluster.env(),
            timeout=15,
        )
    except subprocess.TimeoutExpired:
        return None
    state = result.stdout.strip()
    return state if result.returncode == 0 and state else None


def _usable(state: str | None) -> bool:
    return state is not None and state.rstrip("*~#") in ("idle", "mixed", "allocated", "completing")


def is_up(cluster: LocalCluster) -> bool:
    """Both of our daemons run and the node accepts jobs."""
    ours = _pid_alive(cluster.ctld_pid_file) and _pid_alive(cluster.slurmd_pid_file)
    return bool(ours) and _usable(node_state(cluster))


def _log_tail(cluster: LocalCluster, lines: int = 15) -> str:
    parts = []
    for name in ("slurmctld.log", "slurmd.log"):
        path = cluster.log_dir / name
        if path.exists():
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path}\n" + "\n".join(tail))
    return "\n".join(parts)


def start(cluster: LocalCluster) -> None:
    """Write the config and start munged (if needed), slurmctld and slurmd; wait until the
    node is idle."""
    if os.geteuid() != 0:
        raise LocalClusterError(
            "The local Slurm needs root (slurmd starts jobs as their users): "
            "run `sudo slurm/local/up.sh`."
        )
    write_config(cluster)
    start_munge(cluster)
    env = cluster.env()
    conf = str(cluster.conf_file)
    if _pid_alive(cluster.ctld_pid_file) is None:
        refuse_foreign_daemon(
            cluster.slurmctld_port, cluster.state_dir, down_command="slurm/local/down.sh"
        )
        subprocess.run(
            [which("slurmctld"), "-f", conf], env=env, check=True, start_new_session=True
        )
    if _pid_alive(cluster.slurmd_pid_file) is None:
        subprocess.run(
            [which("slurmd"), "-f", conf, "-N", cluster.node.name],
            env=env,
            check=True,
            start_new_session=True,
        )
    try:
        _wait_for(lambda: _usable(node_state(cluster)), timeout=30, what="the node to be idle")
    except LocalClusterError as error:
        raise LocalClusterError(
            f"{error} Node state: {node_state(cluster)}.\n{_log_tail(cluster)}"
        ) from None


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
    if _pid_alive(ctld_pid_file) is None:
        return
    jobs = subprocess.run(
        [which("squeue"), "-h", "-o", "%A"], capture_output=True, text=True, env=env
    ).stdout.split()
    if jobs:
        subprocess.run([which("scancel"), *jobs], env=env, capture_output=True)
        # Give slurmstepd a moment to kill the job processes (KillWait is 5 s).
        with contextlib.suppress(LocalClusterError):
            _wait_for(lambda: no_job_steps(env), timeout=15, what="jobs to end")


def stop(cluster: LocalCluster) -> None:
    """Cancel every job, stop slurmd and slurmctld, and munged if we started it."""
    env = cluster.env()
    cancel_all_jobs(env, cluster.ctld_pid_file)
    _terminate(cluster.slurmd_pid_file)
    _terminate(cluster.ctld_pid_file)
    stop_munge(cluster)


def _terminate(pid_file: Path, timeout: float = 15) -> None:
    """SIGTERM the daemon and wait for the process itself: daemons delete their pid file
    before they finish shutting down."""
    pid = _pid_alive(pid_file)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    _wait_for(lambda: not _running(pid), timeout=timeout, what=f"pid {pid} ({pid_file.stem})")


def no_job_steps(env: dict[str, str]) -> bool:
    """No job runs or completes on the cluster `env` (its SLURM_CONF) points at."""
    out = subprocess.run(
        [which("squeue"), "-h", "-t", "RUNNING,COMPLETING", "-o", "%A"],
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    return not out.strip()


# --- sharing: leases under a lock ------------------------------------------------------------


@contextlib.contextmanager
def _locked(cluster: AnyCluster) -> Iterator[None]:
    cluster.state_dir.mkdir(parents=True, exist_ok=True)
    with cluster.lock_file.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _live_leases(cluster: AnyCluster) -> list[Path]:
    """Leases whose owner still runs (a crashed test session leaves a stale one behind)."""
    live = []
    for lease in sorted(cluster.lease_dir.glob("*")):
        if lease.name == MANUAL_LEASE:
            live.append(lease)
            continue
        pid = lease.name.split("-", 1)[0]
        if pid.isdigit() and _running(int(pid)):
            live.append(lease)
        else:
            lease.unlink(missing_ok=True)
    return live


def acquire(cluster: AnyCluster, owner: str | None = None) -> Path:
    """Bring the cluster up if needed and register `owner` as a user. Returns the lease."""
    with _locked(cluster):
        if isinstance(cluster, MultiNodeCluster):
            from fsdp_utils.slurm import local_multinode

            # Before the try: a refused start must not stop the cluster that runs.
            local_multinode.refuse_other_sizes(cluster)
        if not _is_up(cluster):
            try:
                _start(cluster)
            except BaseException:
                _stop(cluster)  # leave nothing half-started behind
                raise
        cluster.lease_dir.mkdir(parents=True, exist_ok=True)
        lease = cluster.lease_dir / (owner or f"{os.getpid()}-{time.time_ns()}")
        lease.touch()
        return lease


def release(cluster: AnyCluster, lease: Path) -> bool:
    """Drop a lease; stop the cluster if nobody else uses it. Returns True if it was stopped."""
    with _locked(cluster):
        lease.unlink(missing_ok=True)
        if _live_leases(cluster):
            return False
        _stop(cluster)
        return True


def up(cluster: AnyCluster) -> None:
    """For a person: bring the cluster up and keep it up until `down`."""
    acquire(cluster, owner=MANUAL_LEASE)


def down(cluster: AnyCluster, force: bool = False) -> list[str]:
    """For a person: drop the `up` lease and stop the cluster, unless a running test session
    still uses it (`force` stops it anyway). Returns the leases that kept it running."""
    with _locked(cluster):
        (cluster.lease_dir / MANUAL_LEASE).unlink(missing_ok=True)
        if cluster.lease_dir.exists():
            others = [lease.name for lease in _live_leases(cluster)]
        else:
            others = []
        if others and not force:
            return others
        for lease in cluster.lease_dir.glob("*"):
            lease.unlink()
        _stop(cluster)
        return []


def _is_up(cluster: AnyCluster) -> bool:
    if isinstance(cluster, MultiNodeCluster):
        from fsdp_utils.slurm import local_multinode

        return local_multinode.is_up(cluster)
    return is_up(cluster)


def _start(cluster: AnyCluster) -> None:
    if isinstance(cluster, MultiNodeCluster):
        from fsdp_utils.slurm import local_multinode

        local_multinode.start(cluster)
    else:
        start(cluster)


def _stop(cluster: AnyCluster) -> None:
    if isinstance(cluster, MultiNodeCluster):
        from fsdp_utils.slurm import local_multinode

        local_multinode.stop(cluster)
    else:
        stop(cluster)


# --- command line ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_utils.slurm.local_cluster",
        description="A local Slurm with emulated GPUs (needs root): one node on localhost, or "
        "with --nodes N (2-9) N nodes in their own network namespaces, beside the one-node "
        "cluster (own ports, munged and state folder).",
    )
    parser.add_argument("command", choices=["up", "down", "status", "env", "config"])
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="1: the one-node cluster (slurm/local/state); 2 or more: the multi-node cluster "
        "(slurm/local/state-multi); down/status/env: any number above 1 means the multi-node one",
    )
    parser.add_argument("--state-dir", type=Path, default=None)
    parser.add_argument("--gpus", type=int, default=4, help="emulated GPUs per node")
    parser.add_argument(
        "--force", action="store_true", help="down: stop even while test sessions use it"
    )
    args = parser.parse_args(argv)
    if args.nodes > 1:
        return _main_multi(args)
    state_dir = (args.state_dir or DEFAULT_STATE_DIR).resolve()
    conf = state_dir / "etc" / "slurm.conf"
    if args.command == "env":
        # `eval "$(python -m fsdp_utils.slurm.local_cluster env)"`
        print(f"export SLURM_CONF={conf}")
        return 0
    try:
        cluster = default_cluster(state_dir, gpus=args.gpus)
        if args.command == "config":
            print(render_slurm_conf(cluster) + "\n# gres.conf\n" + render_gres_conf(cluster))
        elif args.command == "up":
            up(cluster)
            node = cluster.node
            print(
                f"Slurm is up: node {node.name} with {node.cpus} CPUs, "
                f"{node.real_memory_mb} MB, {cluster.gpus} emulated GPUs "
                f"(partition {cluster.partition}).\n"
                f"Use it from this shell with:  export SLURM_CONF={conf}"
            )
        elif args.command == "down":
            _print_down(down(cluster, force=args.force), "")
        else:
            state = node_state(cluster) if is_up(cluster) else None
            print(f"up: node {cluster.node.name} {state}" if state else "down")
            return 0 if state else 1
    except (LocalClusterError, subprocess.CalledProcessError, PermissionError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def _print_down(users: list[str], option: str) -> None:
    if users:
        print(
            f"Slurm left running: still used by test session(s) {', '.join(users)}; "
            f"it stops when they end (or: down.sh{option} --force)."
        )
    else:
        print("Slurm is down.")


def _main_multi(args: argparse.Namespace) -> int:
    from fsdp_utils.slurm import local_multinode as multi

    state_dir = (args.state_dir or multi.DEFAULT_MULTI_STATE_DIR).resolve()
    conf = state_dir / "etc" / "slurm.conf"
    if args.command == "env":
        print(f"export SLURM_CONF={conf}")
        return 0
    # down and status act on the cluster as it was brought up, whatever --nodes says.
    nodes = args.nodes
    if args.command in ("down", "status"):
        nodes = multi.recorded_nodes(state_dir) or nodes
    try:
        cluster = multi.default_multi_cluster(state_dir, nodes=nodes, gpus=args.gpus)
        if args.command == "config":
            print(
                render_multi_slurm_conf(cluster)
                + "\n# gres.conf\n"
                + render_multi_gres_conf(cluster)
            )
        elif args.command == "up":
            up(cluster)
            print(
                f"Slurm is up: {cluster.nodes} nodes {cluster.nodelist} "
                f"({', '.join(map(cluster.address, cluster.node_names))}), each with "
                f"{cluster.machine.cpus} CPUs (shared), {cluster.real_memory_per_node_mb} MB, "
                f"{cluster.gpus} emulated GPUs and a private /tmp (partition {cluster.partition}).\n"
                f"Shared scratch for runs and caches: {cluster.scratch_dir}\n"
                f"Use it from this shell with:  export SLURM_CONF={conf}\n"
                f"Stop it with:  slurm/local/down.sh --nodes {cluster.nodes}"
            )
        elif args.command == "down":
            _print_down(down(cluster, force=args.force), f" --nodes {cluster.nodes}")
            left = multi.leftovers(cluster)
            if left:
                print(f"warning: still there: {', '.join(left)}", file=sys.stderr)
                return 1
        else:
            if not multi.is_up(cluster):
                print("down")
                return 1
            states = multi.node_states(cluster)
            print("up: " + ", ".join(f"{n} {states.get(n)}" for n in cluster.node_names))
    except (LocalClusterError, subprocess.CalledProcessError, PermissionError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # Run the imported module's main, not this `__main__` copy's: local_multinode imports
    # fsdp_utils.slurm.local_cluster, and its errors must be the classes main() catches.
    from fsdp_utils.slurm.local_cluster import main as imported_main

    sys.exit(imported_main())
