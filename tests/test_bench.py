"""The benchmark's own machinery (bench/throughput.py): a failing run shows why and is rerun
once; bench/suite_profile.py puts each sample of a py-spy profile in its row and column.
(bench/gpu_check.py's logic is tested in test_gpu_check.py.)"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.train_helpers import REPO_ROOT


def _bench_module(name: str = "throughput"):
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", REPO_ROOT / "bench" / f"{name}.py"
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


def test_rounds_are_interleaved_the_warm_up_dropped_and_the_order_reversed(capsys):
    bench = _bench_module()
    calls: list[str] = []

    def run(name: str):
        def measure() -> dict[str, float]:
            calls.append(name)
            return {"useful_tokens_per_s": float(len(calls))}

        return measure

    rounds = bench.interleaved_rounds({"a": run("a"), "b": run("b"), "c": run("c")}, pairs=2)
    # A warm-up round, then 2 measured ones, every other one in the reverse order.
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert rounds == [
        {
            "c": {"useful_tokens_per_s": 4.0},
            "b": {"useful_tokens_per_s": 5.0},
            "a": {"useful_tokens_per_s": 6.0},
        },
        {
            "a": {"useful_tokens_per_s": 7.0},
            "b": {"useful_tokens_per_s": 8.0},
            "c": {"useful_tokens_per_s": 9.0},
        },
    ]
    assert "warm-up round (discarded): a -> b -> c" in capsys.readouterr().out
    assert bench.spread([3.0, 1.0, 2.0], ".1f") == "2.0 (1.0 - 3.0)"


def test_suite_profile_classes_each_sample_by_process_and_activity(tmp_path, capsys):
    profile = _bench_module("suite_profile")
    importing = "_find_and_load (<frozen importlib._bootstrap>:1176)"
    raw = tmp_path / "suite.raw"
    raw.write_text("\n".join([
        # a run forked by the prefork server, in its backward
        'process 1:"python tests/prefork.py --serve";_child (tests/prefork.py:124);'
        "TrainStep.__call__ (fsdp_utils/train/step.py:350);"
        "_engine_run_backward (torch/autograd/graph.py:979) 40",
        # an xdist worker, whose command line holds the separator, tracing the planner
        'process 2:"python -u -c import sys;exec(eval(sys.stdin.readline()))";'
        "test_plan (tests/test_plan_estimate.py:9);estimate (fsdp_utils/plan/estimate.py:10);"
        "FakeTensorMode.__torch_dispatch__ (torch/_subclasses/fake_tensor.py:1606) 20",
        # a fresh process (its arguments name a pytest folder) importing scipy via transformers
        'process 3:"python chess_finetune.py --model /tmp/pytest-of-root/model";'
        f"<module> (chess_finetune.py:20);{importing};<module> (transformers/loss/x.py:3);"
        f"{importing};<module> (scipy/optimize/__init__.py:1) 10",
        "",
    ]))  # fmt: skip
    json_out = tmp_path / "profile.json"
    assert profile.main([str(raw), "--rate", "10", "--json", str(json_out)]) == 0
    result = json.loads(json_out.read_text())
    assert result["training steps"]["forked runs"] == 4.0
    assert result["planner traces"]["pytest workers"] == 2.0
    assert result["imports"]["fresh processes"] == 1.0
    assert sum(sum(result[row].values()) for row in profile.ACTIVITY_ROWS) == 7.0
    assert result["within those"] == {
        "backward (autograd engine)": 4.0,
        "fake-tensor dispatch": 2.0,
    }
    assert result["imports by package"] == {"scipy": 1.0}
    out = capsys.readouterr().out
    assert "training steps" in out and "57%" in out  # 4 of 7 seconds
