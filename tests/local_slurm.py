"""The `local_slurm` fixture: a real one-node Slurm (slurmctld + slurmd + munge) for the session.

    from tests.local_slurm import local_slurm  # noqa: F401  (in a test module)

    def test_something(local_slurm):
        job = local_slurm.sbatch("--wrap", "hostname", cwd=tmp_path)
        info = local_slurm.wait(job)          # {"JobState": "COMPLETED", "ExitCode": "0:0", ...}

The cluster comes up once per test session (in `slurm/local/state/`, ~1 s when already
configured) and goes down at the end unless someone else still uses it: another pytest session
or a person who ran `slurm/local/up.sh`. While the fixture is active `SLURM_CONF` is set in
`os.environ`, so plain `squeue`/`srun`/`scontrol` subprocesses reach the local cluster.
The node advertises the machine's real CPUs and memory and 4 emulated GPUs (`--gpus-per-node`
works and sets CUDA_VISIBLE_DEVICES; nothing runs on them).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from fsdp_utils.slurm.local_cluster import acquire, default_cluster, release
from fsdp_utils.slurm.local_conf import LocalCluster, MultiNodeCluster
from fsdp_utils.slurm.local_daemons import DEFAULT_MULTI_STATE_DIR, LocalClusterError, which
from fsdp_utils.slurm.local_multinode import default_multi_cluster

REPO = Path(__file__).resolve().parent.parent
# The checkout's git-ignored state folder, shared with `slurm/local/up.sh`.
STATE_DIR = REPO / "slurm" / "local" / "state"


def finetune_env(model: Path, dataset: Path, total_batch_size: int) -> dict[str, str]:
    """slurm/finetune.sh's environment in a test: the checkout's venv, a model and its data."""
    return {
        **os.environ,
        "SETUP": f"source {REPO / '.venv' / 'bin' / 'activate'}",
        "MODEL": str(model),
        "DATASET": str(dataset),
        "TOTAL_BATCH_SIZE": str(total_batch_size),
    }


FINISHED_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "OUT_OF_MEMORY",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
    }
)


def parse_scontrol_record(line: str) -> dict[str, str]:
    """`scontrol show job -o` prints one `Key=Value Key=Value ...` line per job. Values never
    contain spaces except the last keys (Command, WorkDir, StdOut may hold paths with spaces),
    which is good enough for the fields tests look at."""
    record: dict[str, str] = {}
    for item in line.split():
        if "=" in item:
            key, value = item.split("=", 1)
            record[key] = value
    return record


@dataclass(frozen=True)
class LocalSlurm:
    """Handle on the running local cluster, with small helpers for tests."""

    cluster: LocalCluster | MultiNodeCluster

    @property
    def env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF (and /usr/sbin on PATH)."""
        return self.cluster.env()

    @property
    def conf_file(self) -> Path:
        return self.cluster.conf_file

    @property
    def node_name(self) -> str:
        assert isinstance(self.cluster, LocalCluster), "one-node cluster only: see node_names"
        return self.cluster.node.name

    @property
    def node_names(self) -> list[str]:
        if isinstance(self.cluster, MultiNodeCluster):
            return self.cluster.node_names
        return [self.cluster.node.name]

    @property
    def cpus(self) -> int:
        assert isinstance(self.cluster, LocalCluster), "one-node cluster only"
        return self.cluster.node.cpus

    @property
    def gpus(self) -> int:
        return self.cluster.gpus

    def run(
        self,
        *command: str,
        check: bool = True,
        cwd: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command (`run("squeue", "-h")`) against the local cluster."""
        return subprocess.run(
            [which(command[0]), *command[1:]],
            capture_output=True,
            text=True,
            check=check,
            cwd=cwd,
            env=self.cluster.env(env),
            timeout=timeout,
        )

    def sbatch(
        self, *args: str, cwd: str | Path | None = None, env: Mapping[str, str] | None = None
    ) -> str:
        """Submit and return the job id. `env` replaces os.environ as the job's environment
        (sbatch exports the submitting environment to the job)."""
        result = self.run("sbatch", "--parsable", *args, cwd=cwd, env=env, check=False)
        if result.returncode != 0:
            raise AssertionError(f"sbatch {' '.join(args)} failed:\n{result.stderr}")
        return result.stdout.strip().split(";")[0]

    def job_info(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (finished jobs stay visible for MinJobAge = 10 min)."""
        result = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        if result.returncode != 0 or not result.stdout.strip():
            return {}
        return parse_scontrol_record(result.stdout.splitlines()[0])

    def wait_until(
        self, job_id: str, predicate: Callable[[dict[str, str]], bool], timeout: float = 180
    ) -> dict[str, str]:
        """Poll `scontrol show job` until `predicate(record)` holds; return the record. On
        timeout the job is cancelled and the test fails with its last record."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if info and predicate(info):
                return info
            time.sleep(0.5)
        self.run("scancel", job_id, check=False)
        raise AssertionError(f"job {job_id}: condition not met after {timeout} s: {info}")

    def wait(
        self, job_id: str, timeout: float = 180, states: frozenset[str] = FINISHED_STATES
    ) -> dict[str, str]:
        """Poll until the job reaches one of `states` (default: finished)."""
        return self.wait_until(job_id, lambda info: info.get("JobState") in states, timeout)

    def wait_for_requeue(
        self, job_id: str, log: Path, timeout: float = 150, *, then_minutes: int = 5
    ) -> dict[str, str]:
        """Wait for the job's first leg to end in a requeue (failing with the job's log if it
        finished instead), then give the second leg `then_minutes` so it can complete."""
        requeued = self.wait_until(
            job_id,
            lambda info: info.get("Restarts") == "1" or info.get("JobState") in FINISHED_STATES,
            timeout,
        )
        assert requeued.get("Restarts") == "1", (requeued, log.read_text())
        self.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={then_minutes}")
        return requeued


@pytest.fixture(scope="session")
def local_slurm() -> Iterator[LocalSlurm]:
    """A running one-node Slurm for the whole test session (see the module docstring)."""
    if os.geteuid() != 0:
        pytest.fail("The local Slurm tests need root (slurmd starts jobs): run them as root.")
    try:
        cluster = default_cluster(STATE_DIR)
        lease = acquire(cluster)
    except (LocalClusterError, OSError, subprocess.CalledProcessError) as error:
        pytest.fail(f"Could not bring up the local Slurm: {error}\nTry: make setup-system")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", str(cluster.conf_file))
        yield LocalSlurm(cluster)
    release(cluster, lease)


@pytest.fixture(scope="module")
def multinode_slurm() -> Iterator[LocalSlurm]:
    """A running 2-node Slurm for one test module: node1 and node2, each in its own network,
    UTS and mount namespace with a private /tmp (see fsdp_utils.slurm.local_multinode). It has
    its own ports, munged and state folder (slurm/local/state-multi), so the one-node cluster
    of other test sessions is never touched. Shared storage for jobs: `cluster.scratch_dir`."""
    if os.geteuid() != 0:
        pytest.fail("The local Slurm tests need root (namespaces, slurmd): run them as root.")
    try:
        cluster = default_multi_cluster(DEFAULT_MULTI_STATE_DIR, nodes=2)
        lease = acquire(cluster)
    except (LocalClusterError, OSError, subprocess.CalledProcessError) as error:
        pytest.fail(
            f"Could not bring up the local 2-node Slurm: {error}\nIt needs root, Debian's "
            "slurm-wlm and munge (make setup-system), iproute2 and util-linux (ip, nsenter, "
            "unshare), and a kernel that allows network, UTS and mount namespaces."
        )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", str(cluster.conf_file))
        yield LocalSlurm(cluster)
    release(cluster, lease)
