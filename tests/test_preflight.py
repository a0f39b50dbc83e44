"""`chess_finetune.py --preflight` and `--plan`: the checks before the expensive part."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fsdp_utils.run.preflight import read_plan
from tests.prefork import launch

REPO = Path(__file__).resolve().parent.parent
CODELLAMA_7B = REPO / "tests" / "fixtures" / "configs" / "codellama-7b"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return launch(1, "chess_finetune.py", list(args), cwd=REPO, timeout=300)


def _assets(tiny_assets) -> list[str]:
    return [
        "--model",
        str(tiny_assets["model"]),
        "--dataset",
        str(tiny_assets["data"]),
        "--dataset_include",
        "",
    ]


def test_preflight_ok_and_memory_plan(tiny_assets):
    result = _run("--preflight", "--world_size", "2", "--gpu_memory", "8GiB", *_assets(tiny_assets))
    assert result.returncode == 0, result.stderr
    assert "preflight OK: total batch 32 sequences = 1 per device x 2 devices x 16" in result.stdout
    assert "memory plan: FITS: needs 2.0 of 8.0 GiB" in result.stdout


def test_preflight_without_gpu_skips_the_plan(tiny_assets):
    result = _run("--preflight", "--world_size", "2", *_assets(tiny_assets))
    assert result.returncode == 0, result.stderr
    assert "memory plan: skipped (no GPU on this node" in result.stdout


def test_preflight_fails_on_non_dividing_batch_without_planning(tiny_assets):
    result = _run("--preflight", "--world_size", "3", "--gpu_memory", "8GiB", *_assets(tiny_assets))
    assert result.returncode == 2
    assert "does not divide" in result.stderr and "memory plan" not in result.stdout


@pytest.mark.slow
def test_preflight_refuses_a_run_that_does_not_fit(tiny_assets):
    result = _run(
        "--preflight", "--world_size", "4", "--gpu_memory", "30GiB",
        "--model", str(CODELLAMA_7B), "--dataset", str(tiny_assets["data"]), "--dataset_include", "",
    )  # fmt: skip
    assert result.returncode == 2
    assert "The run does not fit in GPU memory" in result.stderr
    assert "the GPU has 30.0 GiB" in result.stderr
    assert "Traceback" not in result.stderr


def test_plan_flag_is_the_planner(tiny_assets):
    result = _run("--plan", "--gpus_per_node", "2", "--gpu_memory", "4GiB", *_assets(tiny_assets))
    assert result.returncode == 0, result.stderr
    assert "Memory plan:" in result.stdout and "verdict: FITS" in result.stdout


RERUN = "python chess_finetune.py --plan --nodes 1 --gpus_per_node 4 --gpu_memory 80GiB ..."
CRASH = """Traceback (most recent call last):
  File "fsdp_utils/plan/cli.py", line 177, in main
KeyError: 'no-such-activation'

error: the memory planner crashed (KeyError: 'no-such-activation'). This is a bug ...
"""


def test_only_a_real_does_not_fit_stops_the_job():
    assert read_plan(0, "verdict: FITS: needs 2.0 of 8.0 GiB\n", "", rerun=RERUN) == (
        "memory plan: FITS: needs 2.0 of 8.0 GiB"
    )
    plan = "Memory plan: ...\nverdict: DOES NOT FIT: needs 84.1 GiB, the GPU has 80.0 GiB\n"
    with pytest.raises(ValueError, match="does not fit in GPU memory") as error:
        read_plan(1, plan, "", rerun=RERUN)
    assert RERUN in str(error.value)

    skip = "; GPU_MEMORY=off skips it"
    cannot = read_plan(
        2, "", "\nerror: This model cannot be traced on fake tensors.\n", rerun=RERUN
    )
    assert cannot == (
        f"memory plan skipped: the planner cannot plan this run: This model cannot be traced on "
        f"fake tensors.{skip}"
    )
    crashed = read_plan(3, "", CRASH, rerun=RERUN).splitlines()
    assert (
        crashed[0]
        == f"memory plan skipped: the planner crashed (KeyError: 'no-such-activation'){skip}"
    )
    assert "    Traceback (most recent call last):" in crashed  # kept for the bug report
    # Python itself exits 1 on an uncaught exception (e.g. before main): no verdict, no stop.
    died = read_plan(1, "", "Traceback (most recent call last):\nImportError: boom\n", rerun=RERUN)
    assert died.startswith(f"memory plan skipped: the planner exited with status 1{skip}")
    assert "ImportError: boom" in died
    killed = read_plan(-9, "", "", rerun=RERUN)
    assert (
        killed
        == f"memory plan skipped: the planner was killed by SIGKILL (often: out of host memory){skip}"
    )


def test_a_planner_crash_is_a_warning_and_the_job_goes_on(tiny_assets, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_assets["model"], model)
    config = json.loads((model / "config.json").read_text())
    config["hidden_act"] = "no-such-activation"  # the planner's build raises KeyError
    (model / "config.json").write_text(json.dumps(config))
    args = ["--model", str(model), "--dataset", str(tiny_assets["data"]), "--dataset_include", ""]
    result = _run("--preflight", "--world_size", "2", "--gpu_memory", "8GiB", *args)
    assert result.returncode == 0, result.stderr
    assert "memory plan skipped: the planner crashed (KeyError: 'no-such-activation')" in (
        result.stdout
    )
    assert "Traceback (most recent call last):" in result.stdout


@pytest.mark.parametrize(
    "name, mib, kind",
    [("NVIDIA H100 NVL", 95830, "h100-80gb"), ("NVIDIA GH200 480GB", 97871, None)],
)
def test_the_plan_has_the_nodes_own_memory_and_kind(tmp_path, monkeypatch, name, mib, kind):
    """nvidia-smi's name and memory.total reach the planner as they are: an H100 NVL is planned
    with its 93.6 GiB (not the h100-80gb preset's 79.6) and timed as an H100; a GH200 with its
    95.6 GiB, and not as an H200 (140 GiB): a kind of its own, without a data sheet."""
    from fsdp_utils.plan.cli import Target, make_parser
    from fsdp_utils.plan.hardware import MIB, spec_key
    from fsdp_utils.run.preflight import detect_gpu_memory

    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{name}, {mib}'\necho '{name}, {mib}'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    flags = detect_gpu_memory()
    assert flags is not None
    target = Target.from_args(make_parser().parse_args(["--gpus_per_node", "2", *flags]))
    assert target.gpu is not None and target.gpu.memory_bytes == mib * MIB
    assert target.gpu.name == name and spec_key(target.gpu) == kind
