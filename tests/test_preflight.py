"""`chess_finetune.py --preflight` and `--plan`: the checks before the expensive part."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CODELLAMA_7B = REPO / "tests" / "fixtures" / "configs" / "codellama-7b"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "chess_finetune.py", *args],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip


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
    result = _run("--plan", "--gpus-per-node", "2", "--gpu-memory", "4GiB", *_assets(tiny_assets))
    assert result.returncode == 0, result.stderr
    assert "Memory plan:" in result.stdout and "verdict: FITS" in result.stdout
