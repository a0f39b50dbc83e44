"""`--profile_steps A:B` and `--flop_counter` (fsdp_utils/metrics/profile.py, flop_count.py): the
window arithmetic, and one real 2-process FSDP2 run that profiles steps 2-3, counts the first
step's FLOPs and runs eager attention (`--attn_implementation`, logged and recorded)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fsdp_utils.config.parse import parse_config
from fsdp_utils.metrics.profile import profile_window
from tests.train_helpers import check_ok, read_metrics, run_finetune, tiny_args

# torch-tb-profiler's pattern for the files it lists as workers of a run (pytorch/kineto,
# tb_plugin/torch_tb_profiler/consts.py: WORKER_PATTERN): worker name, a timestamp, the suffix.
TENSORBOARD_WORKER = re.compile(r"^(.*?)(\.\d+)?\.pt\.trace\.json(?:\.gz)?$")


def test_the_window_and_its_warm_up_step():
    assert profile_window(3, 5, start=0) == (2, 1, 3)  # step 2 warms up, 3-5 recorded
    assert profile_window(1, 2, start=0) == (1, 0, 2)  # nothing before step 1 to warm up with
    assert profile_window(3, 5, start=2) == (3, 0, 3)  # resumed after step 2: no warm-up
    assert profile_window(3, 5, start=3) == (4, 0, 2)  # resumed inside: what is left
    assert profile_window(3, 5, start=5) == (6, 0, 0)  # resumed after it: nothing


def test_malformed_step_ranges_name_the_fix():
    assert parse_config(["--profile_steps", "4"])[0].profile_step_range == (4, 4)
    assert parse_config(["--profile_steps", "2:6"])[0].profile_step_range == (2, 6)
    for text in ("0:2", "5:3", "a:b", "3:"):
        with pytest.raises(ValueError, match=r"A:B with 1 <= A <= B, e\.g\. --profile_steps 3:5"):
            parse_config(["--profile_steps", text])


@pytest.fixture(scope="module")
def profiled_run(tiny_assets, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("profiled") / "run"
    data_cache = tmp_path_factory.mktemp("data_cache")
    args = tiny_args(
        tiny_assets, out, data_cache, profile_steps="2:3", flop_counter=True,
        attn_implementation="eager", no_final_save=True,
    )  # fmt: skip
    result = run_finetune(2, args)
    check_ok(result)
    return {"out": out, "stdout": result.stdout}


@pytest.mark.slow
def test_every_rank_writes_a_trace_of_the_window(profiled_run):
    folder = profiled_run["out"] / "profile"
    traces = sorted(folder.glob("*.pt.trace.json"))
    workers = sorted(TENSORBOARD_WORKER.match(p.name).group(1) for p in traces)  # type: ignore[union-attr]
    assert workers == ["rank0", "rank1"]
    for path in traces:
        trace = json.loads(path.read_text())  # Chrome trace format: what Perfetto opens
        names = {event.get("name") for event in trace["traceEvents"]}
        assert {"optimizer step 2", "optimizer step 3"} <= names
        assert not names & {"optimizer step 1", "optimizer step 4"}  # step 1 only warmed up
        assert trace["distributedInfo"]["world_size"] == 2
    (record,) = read_metrics(profiled_run["out"], "profile")
    assert [Path(p).name for p in record["traces"]] == [traces[0].name]  # rank 0's, logged


@pytest.mark.slow
def test_the_first_steps_flops_are_counted_beside_the_estimate(profiled_run):
    """Eager attention and no activation checkpointing: what torch counts on rank 0 (its 2
    micro-batches of 2 x 64 tokens) is the estimate MFU uses, within the 5% of tests/test_flops.py."""
    (record,) = read_metrics(profiled_run["out"], "flop_count")
    assert record["step"] == 1
    assert record["counted"] == pytest.approx(record["estimated"], rel=0.05)
    config = json.loads((profiled_run["out"] / "config.json").read_text())
    tokens_per_rank = 8 * 64 / 2
    assert record["estimated"] == pytest.approx(
        config["resolved"]["flops_per_token"] * tokens_per_rank
    )
    assert "counted / estimated = " in profiled_run["stdout"]
    assert "attention eager" in profiled_run["stdout"]
    assert config["config"]["attn_implementation"] == "eager"
