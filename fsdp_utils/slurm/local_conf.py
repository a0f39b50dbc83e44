"""Configuration of the one-node local Slurm, as pure functions (pinned by golden files).

`render_slurm_conf` and `render_gres_conf` turn a `LocalCluster` (the node's hardware, the
emulated GPUs, ports and the state folder) into the text of slurm.conf and gres.conf; running
the daemons is `fsdp_utils.slurm.local_cluster`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# Not the default 6817/6818, so a site's own Slurm on the same machine is left alone.
DEFAULT_SLURMCTLD_PORT = 16817
DEFAULT_SLURMD_PORT = 16818


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


@dataclass(frozen=True)
class LocalCluster:
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
    def slurmd_spool(self) -> Path:
        return self.state_dir / "spool" / "slurmd"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "log"

    @property
    def ctld_pid_file(self) -> Path:
        return self.state_dir / "run" / "slurmctld.pid"

    @property
    def slurmd_pid_file(self) -> Path:
        return self.state_dir / "run" / "slurmd.pid"

    @property
    def munged_marker(self) -> Path:
        """Present while munged runs because we started it (so `down` stops it again)."""
        return self.state_dir / "run" / "munged.started-by-us"

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
# Both daemons run as root: slurmd must, to start jobs as their users.
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire={cluster.cred_expire_seconds}
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
# Refuse at submission a job this node can never run, instead of leaving it pending forever.
EnforcePartLimits=ALL
InactiveLimit=0
StateSaveLocation={cluster.ctld_spool}
SlurmdSpoolDir={cluster.slurmd_spool}
SlurmctldPidFile={cluster.ctld_pid_file}
SlurmdPidFile={cluster.slurmd_pid_file}
SlurmctldLogFile={cluster.log_dir / "slurmctld.log"}
SlurmdLogFile={cluster.log_dir / "slurmd.log"}
SlurmctldDebug=info
SlurmdDebug=info
NodeName={node.name} NodeAddr=127.0.0.1 CPUs={node.cpus} Boards={node.boards} \
SocketsPerBoard={node.sockets_per_board} CoresPerSocket={node.cores_per_socket} \
ThreadsPerCore={node.threads_per_core} RealMemory={node.real_memory_mb}{gres} State=UNKNOWN
PartitionName={cluster.partition} Nodes={node.name} Default=YES MaxTime=INFINITE State=UP
"""


def render_gres_conf(cluster: LocalCluster) -> str:
    """gres.conf: emulated GPUs (pinned by tests/golden/gres.conf)."""
    header = """\
# Emulated GPUs for scheduling only: character devices with /dev/null's numbers. slurmd rejects
# plain files, but with device files it sets CUDA_VISIBLE_DEVICES and SLURM_GPUS_ON_NODE for
# jobs exactly as on a GPU node. Nothing can run on them: training falls back to CPU (gloo).
AutoDetect=off
"""
    if not cluster.gpus:
        return header
    files = cluster.state_dir / "gpus" / f"nvidia[0-{cluster.gpus - 1}]"
    return header + f"NodeName={cluster.node.name} Name=gpu File={files}\n"
