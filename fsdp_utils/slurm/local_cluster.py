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
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from fsdp_utils.arguments import ArgumentParser
from fsdp_utils.slurm import local_multinode
from fsdp_utils.slurm.local_conf import (
    LocalCluster,
    MultiNodeCluster,
    render_gres_conf,
    render_multi_gres_conf,
    render_multi_slurm_conf,
    render_slurm_conf,
)
from fsdp_utils.slurm.local_daemons import (
    DEFAULT_MULTI_STATE_DIR,
    DEFAULT_STATE_DIR,
    INSTALL_HINT,
    LocalClusterError,
    cancel_all_jobs,
    detect_node_hardware,
    make_gpu_files,
    munge_works,
    pid_alive,
    refuse_foreign_daemon,
    running,
    terminate,
    usable,
    wait_for,
    which,
)

# Leases, locks and the command line serve both clusters; starting and stopping differ.
AnyCluster = LocalCluster | MultiNodeCluster

MANUAL_LEASE = "manual"


# --- the one-node cluster --------------------------------------------------------------------


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
    wait_for(munge_works, timeout=10, what="munged to answer")


def stop_munge(cluster: LocalCluster) -> None:
    if not cluster.munged_marker.exists():
        return  # not ours: leave the system's munged alone
    pid = pid_alive(Path("/run/munge/munged.pid"))
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
    cluster.munged_marker.unlink()


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


def is_up(cluster: LocalCluster) -> bool:
    """Both of our daemons run and the node accepts jobs."""
    ours = pid_alive(cluster.ctld_pid_file) and pid_alive(cluster.slurmd_pid_file)
    return bool(ours) and usable(node_state(cluster))


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
    if pid_alive(cluster.ctld_pid_file) is None:
        refuse_foreign_daemon(
            cluster.slurmctld_port, cluster.state_dir, down_command="slurm/local/down.sh"
        )
        subprocess.run(
            [which("slurmctld"), "-f", conf], env=env, check=True, start_new_session=True
        )
    if pid_alive(cluster.slurmd_pid_file) is None:
        subprocess.run(
            [which("slurmd"), "-f", conf, "-N", cluster.node.name],
            env=env,
            check=True,
            start_new_session=True,
        )
    try:
        wait_for(lambda: usable(node_state(cluster)), timeout=30, what="the node to be idle")
    except LocalClusterError as error:
        raise LocalClusterError(
            f"{error} Node state: {node_state(cluster)}.\n{_log_tail(cluster)}"
        ) from None


def stop(cluster: LocalCluster) -> None:
    """Cancel every job, stop slurmd and slurmctld, and munged if we started it."""
    env = cluster.env()
    cancel_all_jobs(env, cluster.ctld_pid_file)
    terminate(cluster.slurmd_pid_file)
    terminate(cluster.ctld_pid_file)
    stop_munge(cluster)


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
        if pid.isdigit() and running(int(pid)):
            live.append(lease)
        else:
            lease.unlink(missing_ok=True)
    return live


def acquire(cluster: AnyCluster, owner: str | None = None) -> Path:
    """Bring the cluster up if needed and register `owner` as a user. Returns the lease."""
    with _locked(cluster):
        if isinstance(cluster, MultiNodeCluster):
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
        return local_multinode.is_up(cluster)
    return is_up(cluster)


def _start(cluster: AnyCluster) -> None:
    if isinstance(cluster, MultiNodeCluster):
        local_multinode.start(cluster)
    else:
        start(cluster)


def _stop(cluster: AnyCluster) -> None:
    if isinstance(cluster, MultiNodeCluster):
        local_multinode.stop(cluster)
    else:
        stop(cluster)


# --- command line ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
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
    state_dir = (args.state_dir or DEFAULT_MULTI_STATE_DIR).resolve()
    conf = state_dir / "etc" / "slurm.conf"
    if args.command == "env":
        print(f"export SLURM_CONF={conf}")
        return 0
    # down and status act on the cluster as it was brought up, whatever --nodes says.
    nodes = args.nodes
    if args.command in ("down", "status"):
        nodes = local_multinode.recorded_nodes(state_dir) or nodes
    try:
        cluster = local_multinode.default_multi_cluster(state_dir, nodes=nodes, gpus=args.gpus)
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
            left = local_multinode.leftovers(cluster)
            if left:
                print(f"warning: still there: {', '.join(left)}", file=sys.stderr)
                return 1
        else:
            if not local_multinode.is_up(cluster):
                print("down")
                return 1
            states = local_multinode.node_states(cluster)
            print("up: " + ", ".join(f"{n} {states.get(n)}" for n in cluster.node_names))
    except (LocalClusterError, subprocess.CalledProcessError, PermissionError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
