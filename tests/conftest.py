"""Shared fixtures: tiny local assets built once per test session (nothing from the Hub)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests must never reach the Hub, nor read or fill the user's cache: set before any Hugging
# Face import (subprocesses and Slurm jobs inherit it).
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="fsdp-utils-tests-hf-")
os.environ.pop("HF_HUB_CACHE", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(autouse=True)
def _process_group_address_stays_with_its_test() -> Iterator[None]:
    """A run in the test's own process (`cli.main`, `cli.run`) picks a free port for its
    process group and sets MASTER_ADDR/MASTER_PORT in os.environ; left there, every later
    plain-process run of the same pytest worker inherited that port, and failed with
    EADDRINUSE once something else held it. Restored after each test."""
    names = ("MASTER_ADDR", "MASTER_PORT")
    before = {name: os.environ.get(name) for name in names}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2-layer Llama with a chess BPE tokenizer, and 400 random games in 2 parquet shards.

    Returns {"model": folder, "data": folder}.
    """
    from fsdp_utils.synthetic import build_demo_assets

    return build_demo_assets(tmp_path_factory.mktemp("tiny_assets"), num_games=400, num_shards=2)


# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`): on the
# 2-core CI machine one process alone left ~40% of the CPU idle, mostly while Slurm jobs
# start, requeue and end. Two rules keep that safe and cheap:
# - every module with a test that uses a local Slurm cluster runs on one worker, one test
#   after another: the one-node cluster has 2 emulated GPUs, and a job queued behind another
#   job's would spend its test's timeout waiting (the 2-node cluster's jobs take the same 2
#   CPUs); whole modules, because a module's other tests may bring a cluster up and down
#   themselves (test_multinode.py checks the teardown, which a lease held elsewhere stops);
# - every other module runs whole on one worker, so its module-scoped runs (one short
#   training shared by several checks) are made once, as without xdist.
SLURM_FIXTURES = frozenset({"local_slurm", "multinode_slurm"})
SLURM_GROUP = "local-slurm"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the modules of the Slurm tests as one xdist group and collect them first, so that
    the longest unit of work starts at once while the other worker takes the other modules."""
    slurm_modules = {
        item.path for item in items if SLURM_FIXTURES & set(getattr(item, "fixturenames", ()))
    }
    for item in items:
        if item.path in slurm_modules:
            item.add_marker(pytest.mark.xdist_group(SLURM_GROUP))
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)  # stable


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadgroup`, but an unmarked test is scheduled with its module (xdist's own
    loadgroup sends each unmarked test alone, which would repeat a module's shared run on
    both workers), in collection order."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ModuleOrGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            group = super()._split_scope(nodeid)  # xdist's rule; an unmarked test: its nodeid
            return nodeid.split("::", 1)[0] if group == nodeid else group

    config.option.loadscopereorder = False
    return ModuleOrGroupScheduling(config, log)
