"""The local cluster's slurm.conf and gres.conf are pure functions of its description, pinned
by golden files (regenerate with UPDATE_GOLDEN=1 after an intended change, then review the diff)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fsdp_utils.slurm.local_conf import (
    LocalCluster,
    NodeHardware,
    render_gres_conf,
    render_slurm_conf,
)

GOLDEN = Path(__file__).parent / "golden"

# `slurmd -C` on the 2-core test machine.
SLURMD_C = (
    "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 "
    "RealMemory=24105\nUpTime=0-00:05:22\n"
)


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"{path} is missing: run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"{name} changed: rerun with UPDATE_GOLDEN=1 and review"


def example_cluster(gpus: int = 4) -> LocalCluster:
    node = NodeHardware.from_slurmd_c(SLURMD_C.splitlines()[0])
    return LocalCluster(state_dir=Path("/srv/fsdp-local/state"), node=node, gpus=gpus)


def test_parse_slurmd_c() -> None:
    node = NodeHardware.from_slurmd_c(SLURMD_C.splitlines()[0])
    assert (node.name, node.cpus, node.cores_per_socket, node.real_memory_mb) == ("vm", 2, 2, 24105)
    with pytest.raises(ValueError, match="slurmd -C"):
        NodeHardware.from_slurmd_c("NodeName=vm CPUs=two")


def test_slurm_conf_golden() -> None:
    check_golden("slurm.conf", render_slurm_conf(example_cluster()))


def test_gres_conf_golden() -> None:
    check_golden("gres.conf", render_gres_conf(example_cluster()))


def test_conf_follows_the_hardware() -> None:
    """Memory per CPU is the node's share, and a node without GPUs has no Gres at all."""
    text = render_slurm_conf(example_cluster(gpus=0))
    assert "DefMemPerCPU=12052\n" in text
    assert "Gres=" not in text and "RealMemory=24105 State=UNKNOWN" in text
    assert "File=" not in render_gres_conf(example_cluster(gpus=0))
