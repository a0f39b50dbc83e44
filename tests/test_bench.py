"""The benchmark's own machinery (bench/throughput.py): a failing run shows why and is rerun
once. (bench/gpu_check.py's logic is tested in test_gpu_check.py.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.train_helpers import REPO_ROOT


def _bench_module():
    spec = importlib.util.spec_from_file_location(
        "bench_throughput", REPO_ROOT / "bench" / "throughput.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_shows_a_failing_run_and_reruns_it_once(tmp_path, capsys):
    bench = _bench_module()
    bench.RESULTS = tmp_path  # where the full stderr of a failure is kept
    marker = tmp_path / "failed-once"
    flaky = [sys.executable, "-c",
             "import pathlib, sys; m = pathlib.Path(sys.argv[1])\n"
             "if not m.exists(): m.touch(); sys.exit('address already in use')\n"
             "print('42')", str(marker)]  # fmt: skip
    reruns: list[dict] = []
    assert bench.run_child(flaky, "flaky run", reruns).strip() == "42"
    captured = capsys.readouterr()
    assert "exit code 1" in captured.err and str(marker) in captured.err  # the command
    assert "address already in use" in captured.err and "passed on the rerun" in captured.out
    assert len(reruns) == 1 and reruns[0]["rerun_passed"]
    assert (reruns[0]["run"], reruns[0]["exit_code"]) == ("flaky run", 1)
    assert "address already in use" in Path(reruns[0]["log"]).read_text()

    broken = [sys.executable, "-c", "import sys; sys.exit('no such model')"]
    with pytest.raises(bench.ChildFailed, match="failed twice"):
        bench.run_child(broken, "broken run", [])
    err = capsys.readouterr().err
    assert "attempt 1 of 2" in err and "attempt 2 of 2" in err
