"""Shared fixtures: tiny local assets built once per test session (nothing from the Hub)."""

from __future__ import annotations

import gc
import json
import os
import sys
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
# Nor the user's speed site (fsdp_utils/plan/site.py): no calibration read, no finished run's
# row appended; a test that wants one writes it here.
os.environ["FSDP_UTILS_SITE_DIR"] = tempfile.mkdtemp(prefix="fsdp-utils-tests-site-")
# Python caches each module's compiled code (__pycache__, as for any user) unless told not to;
# this project's machines set PYTHONDONTWRITEBYTECODE, and each of the suite's ~150 fresh
# processes (torchrun's workers, Slurm jobs) then compiled this package again: ~0.3-0.5 s each.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

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


@pytest.fixture
def own_site(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A speed site (fsdp_utils/plan/site.py) of the test's own, with the fits another test's
    rows made forgotten: a calibration or a run's row a test writes moves no other prediction.
    A module of such tests: `pytestmark = pytest.mark.usefixtures("own_site")`."""
    from fsdp_utils.plan import site

    folder = tmp_path_factory.mktemp("site")
    monkeypatch.setenv(site.SITE_ENV, str(folder))
    site._FITS.clear()
    return folder


# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`). A unit of
# work goes whole to one worker:
# - every module with a test on the one-node local Slurm (fixture `local_slurm`): one unit, its
#   tests one after another. Its node has the machine's 2 CPUs, and a job asks for both: a job
#   queued behind another test's would spend its test's timeout waiting;
# - the two-node cluster's modules (fixture `multinode_slurm`): one unit too. That cluster has its
#   own daemons, ports and state, so it runs beside the other (each thinks it has the 2 CPUs);
# - every other module: its shared runs (module-scoped fixtures) are made once, on one worker.
# Units start longest first (tests/durations.json, seconds per unit as last measured; a unit
# not in it counts as DEFAULT_UNIT_S), so that neither worker waits at the end for the other.
# `PYTEST_ARGS=--update-durations make test` writes the file anew from the run.
SLURM_GROUPS = {"local_slurm": "local-slurm", "multinode_slurm": "multinode-slurm"}
DURATIONS = Path(__file__).with_name("durations.json")
DEFAULT_UNIT_S = 30.0


def pytest_collection_finish(session: pytest.Session) -> None:
    """In each test process, once collection imported torch and the test modules:

    - one compute thread: `make test` runs two workers on two cores, each starting processes
      of its own, and torch's default (a thread per core) made each thread of a tiny model's
      matmul wait for busy cores, spinning. Measured at load 7: four in-process modules took
      102 s of CPU and 386 s with the default, 46 s and 135 s with one thread. Set here, not
      as OMP_NUM_THREADS: the processes and Slurm jobs the tests start see the environment a
      user's would (the job's launch plan derives its threads from its CPUs);
    - what collection imported is never garbage: it leaves the garbage collector's passes. A
      run in the test's own process ends in `gc.collect()` (fsdp_utils.cli, run_command),
      which otherwise walked the ~400,000 objects of those imports each time: 1 s per run at
      load 7. (tests/prefork.py's server does the same before it forks.)
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    gc.freeze()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-durations",
        action="store_true",
        help="write tests/durations.json: the seconds of each unit of work (a module, or a "
        "Slurm group) in this run, by which the next runs order them (longest first)",
    )


def work_units(items: list[pytest.Item]) -> dict[str, str]:
    """Each module's unit of work: the group of the Slurm cluster one of its tests uses (the
    whole module: its other tests may bring that cluster up and down themselves), or itself."""
    units: dict[str, str] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        names = set(getattr(item, "fixturenames", ()))
        group = next((g for f, g in SLURM_GROUPS.items() if f in names), None)
        if group is not None or module not in units:
            units[module] = group or units.get(module, module)
    return units


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the Slurm groups, and order the units of work longest first."""
    units = work_units(items)
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    unit = {id(item): units[item.nodeid.split("::", 1)[0]] for item in items}
    for item in items:
        if unit[id(item)] in SLURM_GROUPS.values():
            item.add_marker(pytest.mark.xdist_group(unit[id(item)]))
            # xdist turns the marker into this suffix of the test's id, by which its scheduler
            # groups tests, but in a hook that comes before this one: without this line every
            # Slurm module was a unit of its own, and two of them ran at once.
            if getattr(config.option, "loadgroup", False) and "@" not in item.nodeid:
                _suffix_nodeid(item, unit[id(item)])
    items.sort(key=lambda item: -known.get(unit[id(item)], DEFAULT_UNIT_S))  # stable


def _suffix_nodeid(item: pytest.Item, group: str) -> None:
    """`nodeid@group`, as xdist writes it for its scheduler. pytest 9.2 derives `nodeid` from
    a structured `_id` (xdist 3.8 still sets `_nodeid`, which 9.2 no longer reads: its
    `xdist_group` marker then groups nothing, and two Slurm modules' jobs queued behind each
    other in CI); older pytest keeps the string in `_nodeid`."""
    nodeid = f"{item.nodeid}@{group}"
    if hasattr(item, "_id"):
        from _pytest.nodeid import NodeId  # pytest >= 9.2

        item._id = NodeId.parse(nodeid)
    else:
        item._nodeid = nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadgroup`, but an unmarked test is scheduled with its module (xdist's own
    loadgroup sends each unmarked test alone, which would repeat a module's shared run on
    both workers), in collection order: the longest unit first, each next unit to the first
    worker that is free."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ModuleOrGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            group = super()._split_scope(nodeid)  # xdist's rule; an unmarked test: its nodeid
            return nodeid.split("::", 1)[0] if group == nodeid else group

    config.option.loadscopereorder = False
    return ModuleOrGroupScheduling(config, log)


_unit_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Sum each unit's seconds (setup, call and teardown), on the process that reports."""
    nodeid = report.nodeid
    unit = nodeid.rsplit("@", 1)[1] if "@" in nodeid.rsplit("]", 1)[-1] else None
    unit = unit or nodeid.split("::", 1)[0]
    _unit_seconds[unit] = _unit_seconds.get(unit, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """--update-durations: the units' seconds, on the process that saw every report (the
    xdist controller, or the only process)."""
    config = session.config
    if not config.getoption("update_durations") or hasattr(config, "workerinput"):
        return
    rounded = {unit: round(seconds, 1) for unit, seconds in sorted(_unit_seconds.items())}
    DURATIONS.write_text(json.dumps(rounded, indent=1) + "\n")
