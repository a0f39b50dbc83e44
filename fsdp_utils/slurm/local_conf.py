"""Configuration of the local Slurm clusters, as pure functions (pinned by golden files).

`render_slurm_conf` and `render_gres_conf` turn a `LocalCluster` (the node's hardware, the
emulated GPUs, ports and the state folder) into the text of slurm.conf and gres.conf; running
the daemons is `fsdp_utils.slurm.local_cluster`.

`MultiNodeCluster` describes N emulated nodes on the same machine, each in its own network, UTS
and mount namespace (`fsdp_utils.slurm.local_multinode` runs them); `render_multi_slurm_conf`,
`render_multi_gres_conf`, `render_hosts`, `render_nsswitch` and `node_boot_script` write its files.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# Not the default 6817/6818, so a site's own Slurm on the same machine is left alone.
DEFAULT_SLURMCTLD_PORT = 16817
DEFAULT_SLURMD_PORT = 16818
# The multi-node cluster has its own ports (and munged, and state folder), so it runs beside
# the one-node cluster without touching it.
DEFAULT_MULTI_SLURMCTLD_PORT = 16827
DEFAULT_MULTI_SLURMD_PORT = 16828


@dataclass(frozen=True)
class NodeHardware:
    """What `slurmd -C` reports. Advertising more than this drains the node (Low RealMemory...)."""

    name: str
    cpus: int
    boards: int
    sockets_per_board: int
    cores_per_socket: int
    threads_per_core: int
    real_memory_mb: int

    @classmethod
    def from_slurmd_c(cls, text: str) -> NodeHardware:
        """Parse the first line of `slurmd -C`, e.g.
        `NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1
        RealMemory=24105`."""
        fields = dict(item.split("=", 1) for item in text.split() if "=" in item)
        try:
            return cls(
                name=fields["NodeName"],
                cpus=int(fields["CPUs"]),
                boards=int(fields.get("Boards", 1)),
                sockets_per_board=int(fields["SocketsPerBoard"]),
                cores_per_socket=int(fields["CoresPerSocket"]),
                threads_per_core=int(fields["ThreadsPerCore"]),
                real_memory_mb=int(fields["RealMemory"]),
            )
        except (KeyError, ValueError) as error:
            raise ValueError(f"Cannot parse `slurmd -C` output {text!r}: {error}") from None


class _StateFolder:
    """Where a local cluster keeps its files (config, GPU devices, spool, logs, pid files,
    leases), and the environment that points Slurm's commands at it: the same layout for the
    one-node and the multi-node cluster."""

    state_dir: Path
    gpus: int

    @property
    def conf_file(self) -> Path:
        return self.state_dir / "etc" / "slurm.conf"

    @property
    def gres_conf_file(self) -> Path:
        return self.state_dir / "etc" / "gres.conf"

    @property
    def gpu_files(self) -> list[Path]:
        return [self.state_dir / "gpus" / f"nvidia{i}" for i in range(self.gpus)]

    @property
    def ctld_spool(self) -> Path:
        return self.state_dir / "spool" / "slurmctld"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "log"

    @property
    def ctld_pid_file(self) -> Path:
        return self.state_dir / "run" / "slurmctld.pid"

    @property
    def lease_dir(self) -> Path:
        return self.state_dir / "leases"

    @property
    def lock_file(self) -> Path:
        return self.state_dir / "lock"

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for Slurm commands talking to this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf_file)
        return env


@dataclass(frozen=True)
class LocalCluster(_StateFolder):
    """A one-node cluster: the node's hardware, emulated GPUs, ports and the state folder."""

    state_dir: Path
    node: NodeHardware
    gpus: int = 4
    cluster_name: str = "fsdp-local"
    partition: str = "local"
    slurmctld_port: int = DEFAULT_SLURMCTLD_PORT
    slurmd_port: int = DEFAULT_SLURMD_PORT
    # Slurm holds a requeued job for cred_expire + 1 seconds (121 s by default); 10 s keeps
    # the requeue tests short without racing credential checks on a one-node cluster.
    cred_expire_seconds: int = 10

    @property
    def slurmd_spool(self) -> Path:
        return self.state_dir / "spool" / "slurmd"

    @property
    def slurmd_pid_file(self) -> Path:
        return self.state_dir / "run" / "slurmd.pid"

    @property
    def munged_marker(self) -> Path:
        """Present while munged runs because we started it (so `down` stops it again)."""
        return self.state_dir / "run" / "munged.started-by-us"


def _daemon_settings(auth_info: str) -> str:
    return f"""\
# Both daemons run as root: slurmd must, to start jobs as their users.
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo={auth_info}
"""


def _policy_settings(mem_per_cpu: int, what: str) -> str:
    """Scheduling, accounting and process tracking: the same on both local clusters."""
    return f"""\
# No cgroups: containers and workstations rarely delegate a cgroup tree to Slurm.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU={mem_per_cpu}
GresTypes=gpu
# No accounting database (slurmdbd): sacct has nothing to read; `scontrol show job` keeps
# finished jobs for MinJobAge seconds instead. Per-step CPU/memory usage (sstat) still works.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
MinJobAge=600
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
# A node that was down (e.g. after a restart) returns to service by itself.
ReturnToService=2
# Short turnarounds for trying things out: schedule every 2 s, SIGKILL 5 s after SIGTERM.
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=5
KillWait=5
# Refuse at submission a job {what} can never run, instead of leaving it pending forever.
EnforcePartLimits=ALL
InactiveLimit=0
"""


def _node_hardware(node: NodeHardware, real_memory_mb: int) -> str:
    return (
        f"CPUs={node.cpus} Boards={node.boards} SocketsPerBoard={node.sockets_per_board} "
        f"CoresPerSocket={node.cores_per_socket} ThreadsPerCore={node.threads_per_core} "
        f"RealMemory={real_memory_mb}"
    )


def render_slurm_conf(cluster: LocalCluster) -> str:
    """slurm.conf for the one-node cluster (pinned by tests/golden/slurm.conf)."""
    node = cluster.node
    gres = f" Gres=gpu:{cluster.gpus}" if cluster.gpus else ""
    # Without an explicit default, a job that does not ask for memory gets the whole node and
    # blocks every other job: give each CPU its share.
    mem_per_cpu = node.real_memory_mb // node.cpus
    return f"""\
# One-node Slurm on localhost, written by `python -m fsdp_utils.slurm.local_cluster up`
# (slurm/local/up.sh). Edits are overwritten at the next `up`.
ClusterName={cluster.cluster_name}
SlurmctldHost={node.name}(127.0.0.1)
SlurmctldPort={cluster.slurmctld_port}
SlurmdPort={cluster.slurmd_port}
{_daemon_settings(f"cred_expire={cluster.cred_expire_seconds}")}\
{_policy_settings(mem_per_cpu, "this node")}\
StateSaveLocation={cluster.ctld_spool}
SlurmdSpoolDir={cluster.slurmd_spool}
SlurmctldPidFile={cluster.ctld_pid_file}
SlurmdPidFile={cluster.slurmd_pid_file}
SlurmctldLogFile={cluster.log_dir / "slurmctld.log"}
SlurmdLogFile={cluster.log_dir / "slurmd.log"}
SlurmctldDebug=info
SlurmdDebug=info
NodeName={node.name} NodeAddr=127.0.0.1 {_node_hardware(node, node.real_memory_mb)}{gres} \
State=UNKNOWN
PartitionName={cluster.partition} Nodes={node.name} Default=YES MaxTime=INFINITE State=UP
"""


def _gres_conf(state_dir: Path, gpus: int, nodes: str) -> str:
    header = """\
# Emulated GPUs for scheduling only: character devices with /dev/null's numbers. slurmd rejects
# plain files, but with device files it sets CUDA_VISIBLE_DEVICES and SLURM_GPUS_ON_NODE for
# jobs exactly as on a GPU node. Nothing can run on them: training falls back to CPU (gloo).
AutoDetect=off
"""
    if not gpus:
        return header
    files = state_dir / "gpus" / f"nvidia[0-{gpus - 1}]"
    return header + f"NodeName={nodes} Name=gpu File={files}\n"


def render_gres_conf(cluster: LocalCluster) -> str:
    """gres.conf: emulated GPUs (pinned by tests/golden/gres.conf)."""
    return _gres_conf(cluster.state_dir, cluster.gpus, cluster.node.name)


# --- many nodes on one machine ------------------------------------------------------------------


@dataclass(frozen=True)
class MultiNodeCluster(_StateFolder):
    """N Slurm nodes on one machine: slurmctld and munged in the root namespace (the "login
    node"), and one slurmd per node in its own network, UTS and mount namespace, with its own
    address and host name, a private /tmp and /dev/shm (node-local, as on real clusters) and the
    rest of the file system shared (the checkout, the venv, this state folder)."""

    state_dir: Path
    machine: NodeHardware  # `slurmd -C` of this machine: the login node's name, CPUs, memory
    nodes: int = 2
    gpus: int = 4  # emulated GPUs per node
    subnet: str = "192.168.213"  # a /24 on a private bridge; nodes are .11, .12, ...
    cluster_name: str = "fsdp-multi"
    partition: str = "multi"
    slurmctld_port: int = DEFAULT_MULTI_SLURMCTLD_PORT
    slurmd_port: int = DEFAULT_MULTI_SLURMD_PORT
    cred_expire_seconds: int = 10  # requeued jobs restart after 11 s, as on the one-node cluster
    bridge: str = "fsdpbr0"

    def __post_init__(self) -> None:
        if not 2 <= self.nodes <= 9:
            raise ValueError(f"A multi-node cluster has 2 to 9 nodes, not {self.nodes}.")

    # --- names and addresses

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    @property
    def nodelist(self) -> str:
        """Slurm's hostlist form: node[1-2]."""
        return f"node[1-{self.nodes}]"

    @property
    def controller_address(self) -> str:
        """The bridge's address in the root namespace, where slurmctld listens."""
        return f"{self.subnet}.1"

    def address(self, node: str) -> str:
        return f"{self.subnet}.{10 + self._index(node)}"

    def netns(self, node: str) -> str:
        """The node's network namespace (`ip netns`)."""
        return f"fsdp-{node}"

    def veth(self, node: str) -> str:
        """The root-namespace end of the node's virtual cable (the node's end is eth0)."""
        return f"fsdp-veth{self._index(node)}"

    def _index(self, node: str) -> int:
        return self.node_names.index(node) + 1

    # --- files

    @property
    def hosts_file(self) -> Path:
        return self.state_dir / "etc" / "hosts"

    @property
    def nsswitch_file(self) -> Path:
        return self.state_dir / "etc" / "nsswitch.conf"

    @property
    def munge_key(self) -> Path:
        return self.state_dir / "etc" / "munge.key"

    @property
    def munge_dir(self) -> Path:
        return self.state_dir / "run" / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket"

    @property
    def munged_pid_file(self) -> Path:
        return self.munge_dir / "munged.pid"

    def slurmd_spool(self, node: str) -> Path:
        return self.state_dir / "spool" / node

    def slurmd_pid_file(self, node: str) -> Path:
        return self.state_dir / "run" / f"slurmd-{node}.pid"

    def mount_dir(self, node: str) -> Path:
        """Empty folders the node's boot script mounts on before moving the mounts into place."""
        return self.state_dir / "mnt" / node

    @property
    def scratch_dir(self) -> Path:
        """Shared storage for runs and caches, like /scratch or /projects on a real cluster
        (every node sees it; /tmp is node-local)."""
        return self.state_dir / "scratch"

    @property
    def real_memory_per_node_mb(self) -> int:
        """The machine's memory shared out: together the nodes never promise more than it has."""
        return self.machine.real_memory_mb // self.nodes


def render_multi_slurm_conf(cluster: MultiNodeCluster) -> str:
    """slurm.conf for the multi-node cluster (pinned by tests/golden/multinode/slurm.conf)."""
    machine = cluster.machine
    memory = cluster.real_memory_per_node_mb
    gres = f" Gres=gpu:{cluster.gpus}" if cluster.gpus else ""
    node_lines = "".join(
        f"NodeName={node} NodeAddr={cluster.address(node)} NodeHostname={node} "
        f"{_node_hardware(machine, memory)}{gres} State=UNKNOWN\n"
        for node in cluster.node_names
    )
    state = cluster.state_dir
    return f"""\
# {cluster.nodes}-node Slurm on one machine, written by `slurm/local/up.sh --nodes {cluster.nodes}`
# (python -m fsdp_utils.slurm.local_cluster up --nodes {cluster.nodes}). Edits are overwritten at the next `up`.
# slurmctld runs in the root namespace on the bridge address; each slurmd runs in its node's
# network, UTS and mount namespace. Every node advertises the machine's CPUs (shared, not
# enforced) and an equal share of its memory.
ClusterName={cluster.cluster_name}
SlurmctldHost={machine.name}({cluster.controller_address})
SlurmctldPort={cluster.slurmctld_port}
SlurmdPort={cluster.slurmd_port}
{_daemon_settings(f"socket={cluster.munge_socket},cred_expire={cluster.cred_expire_seconds}")}\
{_policy_settings(memory // machine.cpus, "these nodes")}\
StateSaveLocation={cluster.ctld_spool}
SlurmdSpoolDir={state / "spool" / "%n"}
SlurmctldPidFile={cluster.ctld_pid_file}
SlurmdPidFile={state / "run" / "slurmd-%n.pid"}
SlurmctldLogFile={cluster.log_dir / "slurmctld.log"}
SlurmdLogFile={cluster.log_dir / "slurmd-%n.log"}
SlurmctldDebug=info
SlurmdDebug=info
{node_lines}\
PartitionName={cluster.partition} Nodes={cluster.nodelist} Default=YES MaxTime=INFINITE State=UP
"""


def render_multi_gres_conf(cluster: MultiNodeCluster) -> str:
    """gres.conf: the same emulated GPUs on every node (pinned by a golden file)."""
    return _gres_conf(cluster.state_dir, cluster.gpus, cluster.nodelist)


def render_hosts(cluster: MultiNodeCluster) -> str:
    """/etc/hosts inside every node: each node's own name resolves to its bridge address, never
    to loopback, because gloo, NCCL and torchrun bind to what gethostname() resolves to."""
    lines = [
        "# /etc/hosts of the emulated nodes (bind-mounted in each node's mount namespace)",
        "127.0.0.1\tlocalhost",
        f"{cluster.controller_address}\t{cluster.machine.name}",
        *(f"{cluster.address(node)}\t{node}" for node in cluster.node_names),
    ]
    return "\n".join(lines) + "\n"


def render_nsswitch(host_nsswitch: str) -> str:
    """The machine's nsswitch.conf with host names from /etc/hosts only: with `dns` and no
    reachable name server, lookups wait and fail with EAI_AGAIN (torch's TCPStore then warns
    "hostname of the client socket cannot be retrieved")."""
    lines = [line for line in host_nsswitch.splitlines() if not line.startswith("hosts:")]
    return "\n".join([*lines, "hosts:          files"]) + "\n"


def node_boot_script(
    cluster: MultiNodeCluster,
    node: str,
    *,
    shared_under_tmp: Sequence[Path] = (),
    slurmd: str = "slurmd",
) -> str:
    """Shell run inside the node's fresh UTS and mount namespaces (and its network namespace)
    before slurmd replaces it. `shared_under_tmp`: folders below /tmp that must stay shared
    (a checkout or venv in /tmp); they are bound back into the node's private /tmp."""
    q = shlex.quote
    mnt = cluster.mount_dir(node)
    lines = [
        "set -eu",
        f"hostname {q(node)}",
        # `ip netns exec` would mount a fresh /sys without /sys/fs/cgroup, which slurmd needs
        # even with proctrack/linuxproc: keep the cgroup tree aside, mount a sysfs that shows
        # this namespace's network devices, and move the cgroup tree back onto it.
        f"mount --rbind /sys/fs/cgroup {q(str(mnt / 'cgroup'))}",
        "mount -t sysfs sysfs /sys",
        f"mount --move {q(str(mnt / 'cgroup'))} /sys/fs/cgroup",
        f"mount --bind {q(str(cluster.hosts_file))} /etc/hosts",
        f"mount --bind {q(str(cluster.nsswitch_file))} /etc/nsswitch.conf",
        # Node-local /tmp and /dev/shm, as on a real cluster.
        f"mount -t tmpfs -o mode=1777 tmpfs-{q(node)} {q(str(mnt / 'tmp'))}",
    ]
    for path in shared_under_tmp:
        inside = mnt / "tmp" / path.relative_to("/tmp")
        lines += [f"mkdir -p {q(str(inside))}", f"mount --rbind {q(str(path))} {q(str(inside))}"]
    lines += [
        f"mount --move {q(str(mnt / 'tmp'))} /tmp",
        f"mount -t tmpfs -o mode=1777 shm-{q(node)} /dev/shm",
        f"exec {q(slurmd)} -f {q(str(cluster.conf_file))} -N {q(node)}",
    ]
    return "\n".join(lines) + "\n"
