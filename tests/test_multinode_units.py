"""The multi-node pieces that need no cluster: the 2-node cluster's files (golden), the node
failure summary read from srun's lines, and the node-local path message.

Goldens: regenerate with UPDATE_GOLDEN=1 after an intended change, then review the diff."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_utils.run.shared_paths import SharedPath, describe_mismatch
from fsdp_utils.slurm.local_conf import (
    MultiNodeCluster,
    NodeHardware,
    node_boot_script,
    render_hosts,
    render_multi_gres_conf,
    render_multi_slurm_conf,
    render_nsswitch,
)
from fsdp_utils.slurm.node_failure import (
    COLLECTIVE_TIMEOUT_NOTE,
    collective_timed_out,
    describe,
    parse_failures,
)
from tests.test_slurm_conf import SLURMD_C, check_golden


def example_cluster(nodes: int = 2) -> MultiNodeCluster:
    machine = NodeHardware.from_slurmd_c(SLURMD_C.splitlines()[0])
    return MultiNodeCluster(
        state_dir=Path("/srv/fsdp-local/state-multi"), machine=machine, nodes=nodes
    )


def test_multinode_slurm_conf_golden() -> None:
    """Own ports and munged socket (beside the one-node cluster), one NodeAddr/NodeHostname per
    node, the machine's memory shared out, %n in the per-node paths."""
    check_golden("multinode/slurm.conf", render_multi_slurm_conf(example_cluster()))


def test_multinode_gres_conf_golden() -> None:
    check_golden("multinode/gres.conf", render_multi_gres_conf(example_cluster()))


def test_multinode_hosts_golden() -> None:
    check_golden("multinode/hosts", render_hosts(example_cluster()))


def test_node_boot_script_golden() -> None:
    """What runs in node2's fresh namespaces before slurmd: host name, sysfs with the cgroup
    tree kept, hosts and nsswitch, and a private /tmp into which a checkout living under /tmp
    is bound back (shared)."""
    script = node_boot_script(
        example_cluster(),
        "node2",
        shared_under_tmp=[Path("/tmp/ci/fsdp-utils")],
        slurmd="/usr/sbin/slurmd",
    )
    check_golden("multinode/boot-node2.sh", script)


def test_cluster_shape() -> None:
    cluster = example_cluster(3)
    assert cluster.node_names == ["node1", "node2", "node3"]
    assert [cluster.address(n) for n in cluster.node_names] == [
        "192.168.213.11",
        "192.168.213.12",
        "192.168.213.13",
    ]
    assert cluster.nodelist == "node[1-3]" and cluster.real_memory_per_node_mb == 24105 // 3
    assert "DefMemPerCPU=4017\n" in render_multi_slurm_conf(cluster)
    with pytest.raises(ValueError, match="2 to 9 nodes"):
        example_cluster(1)


def test_nsswitch_resolves_hosts_from_files_only() -> None:
    debian = "passwd:         files\nhosts:          files dns\nnetworks:       files\n"
    assert render_nsswitch(debian) == (
        "passwd:         files\nnetworks:       files\nhosts:          files\n"
    )
    assert render_nsswitch("") == "hosts:          files\n"


# What srun printed into the job log when node2's training processes were killed (SIGKILL) in
# a 2-node job on the local cluster (slurm/finetune.sh, job 4), copied from the log.
KILLED_LOG = """\
step     3/40 | loss 6.2065 | lr 3.00e-03 | grad norm 0.578 | 8,702 tok/s (2,175/device)
srun: error: node2: task 1: Killed
srun: launch/slurm: _step_signal: Terminating StepId=4.0
slurmstepd-node1: error: *** STEP 4.0 ON node1 CANCELLED AT 2026-11-23T10:36:06 ***
W1123 10:36:06.452000 29566 torch/distributed/elastic/agent/server/api.py:753] Received 15 death signal, shutting down workers
torch.distributed.elastic.multiprocessing.api.SignalException: Process 29566 got signal: 15
srun: error: node1: task 0: Exited with exit code 1
srun: Force Terminated StepId=4.0
"""


def test_node_failure_names_the_first_node_and_the_checkpoint() -> None:
    failures = parse_failures(KILLED_LOG)
    assert [(f.node, f.tasks, f.what) for f in failures] == [
        ("node2", "1", "Killed"),
        ("node1", "0", "Exited with exit code 1"),
    ]
    text = describe(failures, "step 3 (runs/x/checkpoints/step_00000003)")
    assert text is not None
    assert text.startswith("first failure: node2 (task 1) was killed (SIGKILL: the out-of-memory")
    assert "srun then stopped node1." in text
    assert "Newest complete checkpoint: step 3 (runs/x/checkpoints/step_00000003)" in text
    assert "No complete checkpoint" in (describe(failures, None) or "")
    assert describe(parse_failures("srun: Job step aborted\n"), None) is None
    lost = parse_failures(
        "srun: error: Node failure on node3\nsrun: error: node1: tasks 0-1: Killed"
    )
    assert lost[0].node == "node3" and "Slurm stopped hearing from the node" in lost[0].explain()
    assert lost[1].explain().startswith("node1 (tasks 0-1) was killed")


def test_node_local_message_names_paths_nodes_and_fix() -> None:
    checks = [
        (SharedPath("run folder (--output_dir)", Path("/tmp/run"), written=True), "token", "x"),
        (SharedPath("model folder (--model)", Path("/scratch/m"), written=False), "listing", []),
        (SharedPath("data cache (--data_cache_dir)", Path("/tmp/hf"), written=True), "token", "y"),
    ]
    views = [("node1", []), ("node1", []), ("node2", [0, 2]), ("node2", [0, 2]), ("node3", [0])]
    text = describe_mismatch(checks, "node1", views)
    assert text is not None
    assert text.startswith(
        "Node-local path: the run folder (--output_dir) /tmp/run is not shared between the "
        "nodes: node2 (ranks 2-3), node3 (rank 4) cannot see a file rank 0 wrote there on node1;"
    )
    assert "the data cache (--data_cache_dir) /tmp/hf is not shared" in text
    assert "/scratch/m" not in text
    assert "put them on shared project or scratch storage" in text
    assert describe_mismatch(checks, "node1", [("node1", []), ("node2", [])]) is None


# node2 frozen (SIGSTOP) in a 2-node job run with --collective_timeout_minutes 0.25 (job 25 on
# the local cluster): copied from its log.
GLOO_TIMEOUT = (
    "[rank1]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
    "unbound_buffer.cc:129] Timed out waiting 15000ms for send operation to complete\n"
    "srun: error: node1: task 0: Exited with exit code 1\n"
    "srun: error: node2: task 1: Exited with exit code 1\n"
)
# No GPU here: NCCL's watchdog line written in the format of ProcessGroupNCCL.cpp's message
# ("[Rank N] Watchdog caught collective operation timeout: <work> ran for <ms> milliseconds
# before timing out."), not a recording.
NCCL_TIMEOUT = (
    "[rank3]:[E0101 00:00:00.000000000 ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog caught "
    "collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=2, NumelOut=2, "
    "Timeout(ms)=1800000) ran for 1800042 milliseconds before timing out.\n"
)


def test_a_collective_timeout_points_at_another_node() -> None:
    """A frozen node makes the others time out in a collective and fail first: the summary says
    so instead of blaming the node that noticed."""
    assert collective_timed_out(GLOO_TIMEOUT) and collective_timed_out(NCCL_TIMEOUT)
    assert not collective_timed_out(KILLED_LOG)
    text = describe(parse_failures(GLOO_TIMEOUT), None, timed_out=True) or ""
    assert text.startswith("first failure: node1 (task 0) exited with code 1")
    assert COLLECTIVE_TIMEOUT_NOTE in text and "most likely on another node" in text
