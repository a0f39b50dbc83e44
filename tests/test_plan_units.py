"""The planner's pure parts: sizes, batch candidates, the search, the margin, the breakdown and
the report (no tracing here; see test_plan_estimate.py)."""

from __future__ import annotations

import pytest
import torch

from fsdp_utils.config.batch import plan_batch
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.plan import Breakdown, Cluster, Fix, Margin, MemoryPlan, ModelInfo, StepMemory
from fsdp_utils.plan.cli import Target, make_parser
from fsdp_utils.plan.hardware import GIB, GPU_PRESETS, MIB, parse_gpu_memory, parse_size
from fsdp_utils.plan.report import format_plan
from fsdp_utils.plan.search import batch_candidates, largest_fitting


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * GIB),
        ("81920MiB", 80 * GIB),
        ("80 gib", 80 * GIB),
        ("80GB", 80 * 10**9),
        ("1.5TiB", int(1.5 * 1024 * GIB)),
        ("A100-80GB", 81920 * MIB),
        ("h100", GPU_PRESETS["h100-80gb"].memory_bytes),
        ("h100_64gb", 65247 * MIB),
    ],
)
def test_gpu_memory_sizes_and_presets(text, expected):
    assert parse_gpu_memory(text).memory_bytes == expected


@pytest.mark.parametrize(
    ("text", "hint"), [("80", "80GiB"), ("lots", "a100-80gb"), ("512MB", "did you mean 512GiB")]
)
def test_gpu_memory_mistakes_name_the_fix(text, hint):
    with pytest.raises(ValueError, match=hint):
        parse_gpu_memory(text)


def test_margin_size_needs_a_unit():
    assert parse_size("2GiB", "--margin_runtime") == 2 * GIB
    with pytest.raises(ValueError, match="--margin_runtime"):
        parse_size("2", "--margin_runtime")


def test_the_dashed_spellings_work_as_the_underscored_ones(capsys, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NUM_NODES", raising=False)
    renamed = {
        "--gpus-per-node": ("--gpus_per_node", "4"),
        "--gpu-memory": ("--gpu_memory", "a100-80gb"),
        "--margin-runtime": ("--margin_runtime", "3GiB"),
        "--margin-allocator": ("--margin_allocator", "0.2"),
        "--find-max-batch": ("--find_max_batch", None),
        "--no-fixes": ("--no_fixes", None),
        "--full-trace": ("--full_trace", None),
    }
    old = [a for flag, (_, value) in renamed.items() for a in (flag, value) if a is not None]
    new = [a for flag, value in renamed.values() for a in (flag, value) if a is not None]
    args = make_parser().parse_args(old)
    assert capsys.readouterr().err == ""  # a spelling, not a mistake (fsdp_utils.arguments)
    assert vars(args) == vars(make_parser().parse_args(new))
    assert Target.from_args(args) == Target(
        nodes=1, gpus_per_node=4, gpu=GPU_PRESETS["a100-80gb"], margin=Margin(3 * GIB, 0.2),
        full_trace=True,
    )  # fmt: skip
    assert (args.find_max_batch, args.no_fixes) == (True, True)
    assert not set(renamed) & set(make_parser().format_help().split())


def test_batch_candidates_divide_the_total_per_gpu():
    assert batch_candidates(32, 4) == [1, 2, 4, 8]
    assert batch_candidates(64, 4) == [1, 2, 4, 8, 16]
    assert batch_candidates(24, 2) == [1, 2, 3, 4, 6, 12]
    with pytest.raises(ValueError, match="multiple of 4"):
        batch_candidates(30, 4)


@pytest.mark.parametrize("limit", [0, 1, 3, 4, 7, 16, 100])
def test_largest_fitting_is_a_binary_search(limit):
    candidates = [1, 2, 4, 8, 16]
    calls: list[int] = []

    def fits(b: int) -> bool:
        calls.append(b)
        return b <= limit

    expected = max((c for c in candidates if c <= limit), default=None)
    assert largest_fitting(candidates, fits) == expected
    assert len(calls) <= 3  # log2(5) + 1, not 5


def test_margin():
    margin = Margin(runtime_bytes=2 * GIB, allocator_fraction=0.1)
    assert margin.bytes_for(10 * GIB) == 3 * GIB
    with pytest.raises(ValueError):
        Margin(allocator_fraction=1.5)


def _snapshot(**gib: float) -> dict[str, int]:
    names = {
        "sharded_param": "Sharded Param",
        "sharded_grad": "Sharded Grad",
        "unsharded_param": "Unsharded Param",
        "opt": "OptState",
        "act": "Activation",
        "temp": "Temp",
        "all_gather": "All Gather",
    }
    snap = {names[k]: int(v * GIB) for k, v in gib.items()}
    snap["Total"] = sum(snap.values())
    return snap


def _memory(peak_in_optimizer: bool) -> StepMemory:
    state = {"sharded_param": 1, "sharded_grad": 1, "opt": 2}
    forward_backward = _snapshot(**state, act=5, temp=1, unsharded_param=0.5, all_gather=0.25)
    # foreach AdamW's scratch is filed as optimizer state by the tracker
    optimizer_step = _snapshot(sharded_param=1, sharded_grad=1, opt=2 + 7)
    return StepMemory(
        peak=optimizer_step if peak_in_optimizer else forward_backward,
        peak_before_optimizer=forward_backward,
        before_optimizer=_snapshot(**state),
    )


def test_breakdown_parts_sum_to_the_peak_and_optimizer_scratch_is_temporary():
    memory = _memory(peak_in_optimizer=True)
    parts = memory.breakdown()
    assert memory.peak_in_optimizer_step
    assert parts.total == memory.peak_bytes
    assert parts.optimizer_state == 2 * GIB  # the moments, not the step's scratch
    assert parts.temporaries == 7 * GIB
    assert memory.state_bytes == 4 * GIB


def test_breakdown_with_cpu_offload_leaves_the_state_in_host_ram():
    memory = _memory(peak_in_optimizer=True)
    gpu = memory.breakdown(offloaded=True)
    fb = memory.peak_before_optimizer
    assert gpu.parameters == gpu.gradients == gpu.optimizer_state == 0
    assert gpu.total == fb["Total"] - 4 * GIB  # the forward/backward peak less the state


def test_step_memory_round_trips_through_json():
    memory = _memory(peak_in_optimizer=False)
    assert StepMemory.from_dict(memory.to_dict()) == memory


def _plan(gpu_gib: float | None, fixes: tuple[Fix, ...] = ()) -> MemoryPlan:
    from fsdp_utils.plan.hardware import Gpu

    config = TrainConfig(model="some/model", total_batch_size=32, batch_size_per_device=2)
    breakdown = Breakdown(
        parameters=3 * GIB, gradients=3 * GIB, optimizer_state=6 * GIB, activations=10 * GIB,
        temporaries=2 * GIB,
    )  # fmt: skip
    return MemoryPlan(
        config=config,
        cluster=Cluster(1, 4),
        batch=plan_batch(config, 4),
        model=ModelInfo("llama", 3 * 2**30, 2 * 2**30, 32, "LlamaDecoderLayer"),
        breakdown=breakdown,
        state_bytes=12 * GIB,
        forward_backward_peak_bytes=24 * GIB,
        margin=Margin(2 * GIB, 0.1),
        gpu=None if gpu_gib is None else Gpu("test GPU", int(gpu_gib * GIB)),
        trace_seconds=1.0,
        fixes=fixes,
    )


def test_plan_figures_verdict_and_textbook_bytes_per_parameter():
    plan = _plan(80)
    assert plan.peak_bytes == 24 * GIB
    assert plan.margin_bytes == round(2 * GIB + 2.4 * GIB)
    assert plan.required_bytes == plan.peak_bytes + plan.margin_bytes
    assert plan.fits is True
    assert plan.state_bytes_per_parameter == pytest.approx(16.0)  # 12 GiB x 4 GPUs / 3 Gi
    text = format_plan(plan)
    assert "FITS: needs 28.4 of 80.0 GiB" in text
    assert "16.0 bytes/parameter over 4 GPU(s)" in text
    assert plan.to_dict()["fits"] is True


def test_plan_without_gpu_size_has_no_verdict():
    plan = _plan(None)
    assert plan.fits is None
    assert "give --gpu_memory" in format_plan(plan)


def test_plan_that_does_not_fit_lists_fixes_that_fit_first():
    fixes = (
        Fix("--optimizer sgd", "different optimizer", 30 * GIB, False),
        Fix("--gradient_checkpointing", "more compute", 15 * GIB, True),
    )
    text = format_plan(_plan(20, fixes))
    assert "DOES NOT FIT: needs 28.4 GiB, the GPU has 20.0 GiB (8.4 GiB short)" in text
    fitting, rest = text.split("Not enough on their own:")
    assert "--gradient_checkpointing" in fitting and "--optimizer sgd" in rest


def test_the_header_counts_a_tiny_models_parameters_in_millions():
    """Issue 48: a 0.13M model was headed `0.00B parameters`."""
    import dataclasses

    tiny = dataclasses.replace(_plan(80), model=ModelInfo("llama", 131_584, 98_816, 2, "L"))
    assert "(llama, 0.13M parameters, 2 x L)" in format_plan(tiny)
    assert "(llama, 3.22B parameters, 32 x LlamaDecoderLayer)" in format_plan(_plan(80))


def test_layer_counts_for_extrapolation():
    from fsdp_utils.plan.extrapolate import layer_counts

    assert layer_counts(32, 1).depths == (3, 4, 5)
    # Checkpointing every 2nd layer: whole periods, and the shallow copies end on a layer
    # wrapped as the full model's last one is (layer 19 of 20 is not: 4 layers, not 3).
    assert layer_counts(20, 2).depths == (4, 6, 8)
    assert layer_counts(23, 2).depths == (5, 7, 9)
    assert layer_counts(12, 1) is None  # 3 + 4 + 5 layers cost what 12 do: trace them all
    counts = layer_counts(80, 1)
    assert counts.at_full((100, 130, 160)) == 100 + 77 * 30
    assert counts.at_full((100, 130, 170)) is None  # not linear yet: trace deeper copies
    assert counts.deeper().depths == (4, 5, 6)
    # Layers that repeat every 2 (Gemma 2): copies of whole periods, ending as the model does
    # (on a global layer: 42 is even), none shallow enough to key a layer from both ends.
    assert layer_counts(42, 2, repeating=True).depths == (6, 8, 10)
    assert layer_counts(43, 2, repeating=True).depths == (7, 9, 11)
    assert layer_counts(20, 2, repeating=True) is None  # 6 + 8 + 10 > 20


@pytest.mark.parametrize(
    ("arch", "layers", "period"), [("llama", 4, 1), ("gemma2", 6, 2), ("gemma3", 13, 6)]
)
def test_layer_period_is_where_the_stack_repeats(arch, layers, period):
    from transformers import AutoModelForCausalLM

    from fsdp_utils.plan.extrapolate import layer_period
    from fsdp_utils.synthetic import tiny_model_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_model_config(arch, 64, num_layers=layers))
    assert layer_period(model) == period
