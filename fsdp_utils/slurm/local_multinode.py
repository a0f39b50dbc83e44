"""N Slurm nodes on one machine: try and test multi-node jobs without a cluster (needs root).

    sudo slurm/local/up.sh --nodes 2        # node1, node2 (python -m fsdp_utils.slurm.local_cluster)
    export SLURM_CONF=$PWD/slurm/local/state-multi/etc/slurm.conf
    sudo slurm/local/down.sh --nodes 2      # nothing left behind

Layout (the files come from the pure functions in `local_conf`):

- the root namespace is the login node: slurmctld and a munged of our own (own key, socket and
  pid file, so the machine's munged and the one-node cluster are left alone), and a bridge
  (`fsdpbr0`, 192.168.213.1/24) with no route anywhere else;
- each node is a network namespace (`ip netns`: fsdp-node1, ...) joined to the bridge by a veth
  pair (address .11, .12, ...), plus its own UTS namespace (host name node1, ...) and mount
  namespace, in which its slurmd runs: every job step on the node inherits all three. In the mount
  namespace, /etc/hosts lists every node (a node's own name must not resolve to loopback),
  nsswitch.conf resolves host names from files only, and /tmp and /dev/shm are private tmpfs
  mounts (node-local, as on real clusters), while the rest of the file system (the checkout,
  the venv, `<state>/scratch`) is shared.

Bringing it up and down is idempotent and serialised by the same leases as the one-node cluster
(`local_cluster.acquire/release`, the only importer of this module; the daemon helpers both
use are in `local_daemons`). Processes are tracked by pid file and by `ip netns pids`,
never by name: other clusters' daemons of the same names may run beside ours.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fsdp_utils.slurm.local_conf import (
    MultiNodeCluster,
    node_boot_script,
    render_hosts,
    render_multi_gres_conf,
    render_multi_slurm_conf,
    render_nsswitch,
)
from fsdp_utils.slurm.local_daemons import (
    DEFAULT_MULTI_STATE_DIR,
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

REPO_ROOT = Path(__file__).resolve().parents[2]


def default_multi_cluster(
    state_dir: Path | None = None, nodes: int = 2, gpus: int = 4
) -> MultiNodeCluster:
    return MultiNodeCluster(
        state_dir=(state_dir or DEFAULT_MULTI_STATE_DIR).resolve(),
        machine=detect_node_hardware(),
        nodes=nodes,
        gpus=gpus,
    )


def nodes_file(state_dir: Path) -> Path:
    """The node count of the running cluster (so `down` and `status` need not be told)."""
    return state_dir / "run" / "nodes"


def recorded_nodes(state_dir: Path) -> int | None:
    try:
        return int(nodes_file(state_dir).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [which(command[0]), *command[1:]], capture_output=True, text=True, check=False
    )
    if check and result.returncode != 0:
        raise LocalClusterError(f"`{' '.join(command)}` failed: {result.stderr.strip()}")
    return result


# --- files -------------------------------------------------------------------------------------


def write_config(cluster: MultiNodeCluster) -> None:
    for folder in (
        cluster.conf_file.parent,
        cluster.ctld_spool,
        cluster.log_dir,
        cluster.ctld_pid_file.parent,
        cluster.lease_dir,
        cluster.scratch_dir,
        *(cluster.slurmd_spool(node) for node in cluster.node_names),
        *(
            cluster.mount_dir(node) / sub
            for node in cluster.node_names
            for sub in ("cgroup", "tmp")
        ),
    ):
        folder.mkdir(parents=True, exist_ok=True)
    cluster.scratch_dir.chmod(0o1777)  # like /scratch: every user may make a folder there
    cluster.conf_file.write_text(render_multi_slurm_conf(cluster))
    cluster.gres_conf_file.write_text(render_multi_gres_conf(cluster))
    cluster.hosts_file.write_text(render_hosts(cluster))
    cluster.nsswitch_file.write_text(render_nsswitch(_read("/etc/nsswitch.conf")))
    make_gpu_files(cluster.gpu_files)
    nodes_file(cluster.state_dir).write_text(f"{cluster.nodes}\n")


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def shared_under_tmp(cluster: MultiNodeCluster) -> list[Path]:
    """Folders the nodes must share that lie under /tmp, which each node replaces by its own:
    the checkout, the venv, the state folder (a CI clone in /tmp, say)."""
    candidates = {REPO_ROOT, Path(sys.prefix).resolve(), cluster.state_dir.resolve()}
    with contextlib.suppress(OSError):
        candidates.add((REPO_ROOT / ".venv").resolve())
    under = sorted(p for p in candidates if p.is_relative_to("/tmp") and p != Path("/tmp"))
    # A folder inside another one is shared with it.
    return [p for p in under if not any(p != q and p.is_relative_to(q) for q in under)]


# --- munged of our own --------------------------------------------------------------------------


def munge_answers(cluster: MultiNodeCluster) -> bool:
    """Test the socket itself: another munged (the machine's, the one-node cluster's) may run."""
    return munge_works(cluster.munge_socket)


def start_munge(cluster: MultiNodeCluster) -> None:
    if munge_answers(cluster):
        return
    if not cluster.munge_key.exists():
        # The key only has to be shared by our own daemons and clients, all on this machine.
        fd = os.open(cluster.munge_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(os.urandom(1024))
    cluster.munge_dir.mkdir(parents=True, exist_ok=True)
    cluster.munge_dir.chmod(0o755)  # clients of any user reach the socket
    cluster.munge_socket.unlink(missing_ok=True)  # a stale socket of a killed munged
    # --force: munged as root (its default user, munge, could not read a key in a checkout).
    subprocess.run(
        [
            which("munged"),
            "--force",
            f"--socket={cluster.munge_socket}",
            f"--key-file={cluster.munge_key}",
            f"--pid-file={cluster.munged_pid_file}",
            f"--seed-file={cluster.munge_dir / 'munged.seed'}",
            f"--log-file={cluster.log_dir / 'munged.log'}",
        ],
        check=True,
        start_new_session=True,
    )
    wait_for(lambda: munge_answers(cluster), timeout=10, what="our munged to answer")


# --- network ------------------------------------------------------------------------------------


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def _netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def bridge_owner(cluster: MultiNodeCluster) -> str | None:
    """The state folder of the cluster that made the bridge (kept as the bridge's alias)."""
    try:
        return Path("/sys/class/net", cluster.bridge, "ifalias").read_text().strip() or None
    except OSError:
        return None


def network_up(cluster: MultiNodeCluster) -> None:
    owner = bridge_owner(cluster)
    if _link_exists(cluster.bridge) and owner != str(cluster.state_dir):
        raise LocalClusterError(
            f"The bridge {cluster.bridge} belongs to another multi-node cluster ({owner}): "
            "one per machine. Stop it with that checkout's `slurm/local/down.sh --nodes 2`."
        )
    prefix = f"{cluster.controller_address}/24"
    if not _link_exists(cluster.bridge):
        _run("ip", "link", "add", cluster.bridge, "type", "bridge")
        _run("ip", "link", "set", cluster.bridge, "alias", str(cluster.state_dir))
    _run("ip", "addr", "replace", prefix, "dev", cluster.bridge)
    _run("ip", "link", "set", cluster.bridge, "up")
    for node in cluster.node_names:
        netns, veth = cluster.netns(node), cluster.veth(node)
        if not _netns_exists(netns):
            _run("ip", "netns", "add", netns)
        if not _link_exists(veth):
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _run("ip", "link", "set", veth, "master", cluster.bridge, "up")
        # No default route: a node reaches the other nodes and the login node, nothing else.
        address = f"{cluster.address(node)}/24"
        _run("ip", "-n", netns, "addr", "replace", address, "dev", "eth0")
        _run("ip", "-n", netns, "link", "set", "eth0", "up")
        _run("ip", "-n", netns, "link", "set", "lo", "up")


def network_down(cluster: MultiNodeCluster) -> None:
    """Remove namespaces, cables and bridge; each may be gone already (a deleted namespace takes
    its veth pair with it, asynchronously)."""
    for node in cluster.node_names:
        if _netns_exists(cluster.netns(node)):
            _run("ip", "netns", "del", cluster.netns(node), check=False)
        if _link_exists(cluster.veth(node)):
            _run("ip", "link", "del", cluster.veth(node), check=False)
    if _link_exists(cluster.bridge) and bridge_owner(cluster) == str(cluster.state_dir):
        _run("ip", "link", "del", cluster.bridge, check=False)


def node_pids(cluster: MultiNodeCluster, node: str) -> list[int]:
    """Every process in the node's network namespace: its slurmd, job steps, training."""
    if not _netns_exists(cluster.netns(node)):
        return []
    out = _run("ip", "netns", "pids", cluster.netns(node), check=False).stdout
    return [int(pid) for pid in out.split() if pid.isdigit()]


# --- daemons ------------------------------------------------------------------------------------


def start_node(cluster: MultiNodeCluster, node: str) -> None:
    """slurmd in the node's network namespace and fresh UTS and mount namespaces (nsenter +
    unshare rather than `ip netns exec`, whose fresh /sys hides the cgroup tree)."""
    script = node_boot_script(
        cluster, node, shared_under_tmp=shared_under_tmp(cluster), slurmd=which("slurmd")
    )
    result = subprocess.run(
        [
            which("nsenter"),
            f"--net=/run/netns/{cluster.netns(node)}",
            which("unshare"),
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "/bin/sh",
            "-c",
            script,
        ],
        env=cluster.env(),
        capture_output=True,
        text=True,
        start_new_session=True,
        check=False,
    )
    if result.returncode != 0:
        raise LocalClusterError(
            f"Could not start {node} (a namespace or mount was refused?): "
            f"{result.stderr.strip()}\nThe kernel must allow network, UTS and mount namespaces "
            "for root (unshare, nsenter, ip netns)."
        )


def node_states(cluster: MultiNodeCluster) -> dict[str, str]:
    """Each node's state as sinfo prints it (idle, mixed, allocated, down*, ...)."""
    try:
        result = subprocess.run(
            [which("sinfo"), "-h", "-N", "-o", "%N %T"],
            capture_output=True,
            text=True,
            env=cluster.env(),
            timeout=15,
        )
    except subprocess.TimeoutExpired:
        return {}
    if result.returncode != 0:
        return {}
    return dict(line.split(None, 1) for line in result.stdout.splitlines() if " " in line)


def is_up(cluster: MultiNodeCluster) -> bool:
    if pid_alive(cluster.ctld_pid_file) is None or not munge_answers(cluster):
        return False
    if any(pid_alive(cluster.slurmd_pid_file(node)) is None for node in cluster.node_names):
        return False
    states = node_states(cluster)
    return all(usable(states.get(node)) for node in cluster.node_names)


def _log_tail(cluster: MultiNodeCluster, lines: int = 12) -> str:
    parts = []
    for path in sorted(cluster.log_dir.glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {path}\n" + "\n".join(tail))
    return "\n".join(parts)


def refuse_other_sizes(cluster: MultiNodeCluster) -> None:
    """One size at a time: the running cluster's node count is in its state folder."""
    up_nodes = recorded_nodes(cluster.state_dir)
    if (
        up_nodes is not None
        and up_nodes != cluster.nodes
        and pid_alive(cluster.ctld_pid_file) is not None
    ):
        raise LocalClusterError(
            f"The multi-node cluster in {cluster.state_dir} is up with {up_nodes} nodes; bring it "
            f"down first to use {cluster.nodes}: sudo slurm/local/down.sh --nodes {up_nodes}"
        )


def start(cluster: MultiNodeCluster) -> None:
    if os.geteuid() != 0:
        raise LocalClusterError(
            "The local multi-node Slurm needs root (namespaces, and slurmd starts jobs as their "
            f"users): run `sudo slurm/local/up.sh --nodes {cluster.nodes}`."
        )
    write_config(cluster)
    start_munge(cluster)
    network_up(cluster)
    if pid_alive(cluster.ctld_pid_file) is None:
        refuse_foreign_daemon(
            cluster.slurmctld_port, cluster.state_dir, down_command="slurm/local/down.sh --nodes 2"
        )
        subprocess.run(
            [which("slurmctld"), "-f", str(cluster.conf_file)],
            env=cluster.env(),
            check=True,
            start_new_session=True,
        )
    for node in cluster.node_names:
        if pid_alive(cluster.slurmd_pid_file(node)) is None:
            start_node(cluster, node)

    def all_usable() -> bool:
        states = node_states(cluster)
        return all(usable(states.get(node)) for node in cluster.node_names)

    try:
        wait_for(all_usable, timeout=30, what="the nodes to be idle")
    except LocalClusterError as error:
        raise LocalClusterError(
            f"{error} Node states: {node_states(cluster)}.\n{_log_tail(cluster)}"
        ) from None


def stop(cluster: MultiNodeCluster) -> None:
    """In the order that lets every daemon finish: jobs, slurmds (and whatever still runs in a
    node), slurmctld, munged, then the network. slurmstepd hangs if munged or slurmctld go
    first."""
    env = cluster.env()
    cancel_all_jobs(env, cluster.ctld_pid_file)
    for node in cluster.node_names:
        with contextlib.suppress(LocalClusterError):
            terminate(cluster.slurmd_pid_file(node))
    for node in cluster.node_names:
        _kill_all(node_pids(cluster, node))
    terminate(cluster.ctld_pid_file)
    terminate(cluster.munged_pid_file)
    network_down(cluster)
    nodes_file(cluster.state_dir).unlink(missing_ok=True)


def _kill_all(pids: list[int], timeout: float = 10) -> None:
    """SIGKILL what a node still runs once its slurmd is gone (orphaned job processes)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def leftovers(cluster: MultiNodeCluster) -> list[str]:
    """What a stopped cluster must not leave behind: namespaces, links, daemons, mounts."""
    found = [
        f"netns {cluster.netns(n)}" for n in cluster.node_names if _netns_exists(cluster.netns(n))
    ]
    found += [f"link {name}" for name in (cluster.bridge, *map(cluster.veth, cluster.node_names))
              if _link_exists(name)]  # fmt: skip
    pid_files = [cluster.ctld_pid_file, cluster.munged_pid_file]
    pid_files += [cluster.slurmd_pid_file(node) for node in cluster.node_names]
    found += [f"daemon {p.stem} (pid {pid_alive(p)})" for p in pid_files if pid_alive(p)]
    state = str(cluster.state_dir)
    found += [
        f"mount {line.split()[1]}"
        for line in _read("/proc/mounts").splitlines()
        if len(line.split()) > 1 and line.split()[1].startswith(state)
    ]
    return found
