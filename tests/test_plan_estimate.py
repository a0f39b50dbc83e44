"""The planner on tiny models: real fake-tensor traces of the trainer's step, from config.json
only (no weights), with what users get wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.hub.resolve import load_model_config
from fsdp_utils.plan import find_max_batch, main, plan_memory, planner
from fsdp_utils.plan.estimate import Cluster, Estimate, estimate, model_config_dir
from fsdp_utils.plan.report import Margin
from fsdp_utils.synthetic import TINY_ARCHITECTURES, tiny_model_config
from tests.train_helpers import run_module

REPO_ROOT = Path(__file__).resolve().parent.parent
NO_MARGIN = Margin(runtime_bytes=0, allocator_fraction=0.0)


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    """A folder holding only config.json per tiny architecture."""
    folders = {}
    for arch in TINY_ARCHITECTURES:
        folder = tmp_path_factory.mktemp(arch)
        tiny_model_config(arch, vocab_size=512).save_pretrained(folder)
        assert [p.name for p in folder.iterdir()] == ["config.json"]
        folders[arch] = folder
    return folders


_TRACES: dict[tuple[str, str, Cluster, bool], Estimate] = {}


def _traced_once(config: TrainConfig, cluster: Cluster, *, full_trace: bool = False) -> Estimate:
    """The planner's `estimate`, each configuration traced once in this module: a trace on fake
    tensors has no randomness, so tracing the same configuration of the same config.json again
    gives the same bytes. The base Llama plan alone was traced by seven tests, and the search
    for the largest batch and the fixes retraced the batch sizes the test had planned."""
    try:
        content = (model_config_dir(config) / "config.json").read_text()
    except (OSError, ValueError):  # a model it cannot find: its own error, from `estimate`
        return estimate(config, cluster, full_trace=full_trace)
    key = (config.to_json(), content, cluster, full_trace)
    if key not in _TRACES:
        _TRACES[key] = estimate(config, cluster, full_trace=full_trace)
    return _TRACES[key]


@pytest.fixture(autouse=True)
def _trace_each_configuration_once(monkeypatch) -> None:
    """`plan_memory`, `find_max_batch` and the fixes they plan trace through `_traced_once`; the
    tests that call `estimate` themselves still trace."""
    monkeypatch.setattr(planner, "estimate", _traced_once)


def _config(folder: Path, **overrides) -> TrainConfig:
    values = {"model": str(folder), "total_batch_size": 8, "batch_size_per_device": 2}
    return TrainConfig(**{**values, "max_seq_length": 64, **overrides})


def _plan(folder: Path, nodes: int = 1, gpus: int = 2, gpu_bytes: int | None = None, **overrides):
    return plan_memory(
        _config(folder, **overrides),
        nodes=nodes,
        gpus_per_node=gpus,
        gpu_memory_bytes=gpu_bytes,
        margin=NO_MARGIN,
    )


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_every_architecture_plans_with_16_bytes_per_parameter_of_state(configs, arch):
    plan = _plan(configs[arch])
    assert plan.model.decoder_layers == 2
    # fp32 master weights + gradients + two AdamW moments, halved over 2 GPUs; FSDP pads the
    # shards of odd-sized tensors and rotary buffers are not parameters: within 0.5%.
    assert plan.state_bytes_per_parameter == pytest.approx(16.0, rel=5e-3)
    assert plan.peak_bytes > plan.state_bytes
    parts = plan.breakdown
    assert parts.activations > 0 and parts.temporaries > 0
    assert plan.peak_bytes == parts.total


@pytest.mark.parametrize(
    ("precision", "optimizer", "bytes_per_parameter"),
    [("bf16-mixed", "sgd", 8.0), ("bf16-true", "adamw", 8.0), ("bf16-true", "sgd", 4.0)],
)
def test_less_state_with_sgd_or_bf16_true(configs, precision, optimizer, bytes_per_parameter):
    plan = _plan(configs["llama"], precision=precision, optimizer=optimizer)
    assert plan.state_bytes_per_parameter == pytest.approx(bytes_per_parameter, rel=5e-3)


def test_the_knobs_move_memory_the_way_they_should(configs):
    folder = configs["llama"]
    base = _plan(folder)
    bigger_batch = _plan(folder, batch_size_per_device=4)
    checkpointed = _plan(folder, gradient_checkpointing=True)
    deferred = _plan(folder, batch_size_per_device=1, defer_grad_sync=True)
    synced = _plan(folder, batch_size_per_device=1)
    more_gpus = _plan(folder, gpus=4)
    offloaded = _plan(folder, cpu_offload=True)

    # 4 times the rows: the saved activations grow 4 times, the loss's chunk of logits (the same
    # number of tokens at any batch) not at all.
    assert bigger_batch.activation_bytes > 1.6 * base.activation_bytes
    assert checkpointed.activation_bytes < base.activation_bytes
    # With deferred sync the full (unsharded) gradients stay between micro-batches.
    assert deferred.gradient_bytes > 1.5 * synced.gradient_bytes
    assert more_gpus.state_bytes < 0.51 * base.state_bytes
    assert offloaded.optimizer_bytes == offloaded.gradient_bytes == 0
    assert offloaded.peak_bytes < base.peak_bytes


def test_compile_is_planned_as_its_eager_layers(configs):
    """--compile: the planner traces the eager layers (tracing compiled ones ran dynamo on the
    planner's CPU and gave no answer in 60 s on the first H100 run) and says so; a compiled
    step held 0.84x the eager peak there, so the eager plan is the safe side."""
    eager = _plan(configs["llama"])
    compiled = _plan(configs["llama"], compile=True)
    assert compiled.peak_bytes == eager.peak_bytes
    assert "--compile traced eager" in compiled.trace_method
    assert "--compile" not in eager.trace_method


def test_find_max_batch_and_cheapest_fixes(configs):
    """A GPU size between what batch 2 and batch 4 need: 2 is the largest that fits, and a
    plan at batch 4 suggests going back to 2 (or other changes), each one planned."""
    folder = configs["llama"]
    need = {b: _plan(folder, batch_size_per_device=b).required_bytes for b in (2, 4)}
    gpu = (need[2] + need[4]) // 2
    config = _config(folder)
    found = find_max_batch(config, nodes=1, gpus_per_node=2, gpu_memory_bytes=gpu, margin=NO_MARGIN)
    assert found == 2

    plan = _plan(folder, gpu_bytes=gpu, batch_size_per_device=4)
    assert plan.fits is False
    flags = {fix.flags: fix for fix in plan.fixes}
    assert flags["--batch_size_per_device 2"].fits
    assert flags["--batch_size_per_device 2"].required_bytes == need[2]
    assert "--gradient_checkpointing" in flags and "--cpu_offload" in flags
    assert all(fix.fits for fix in plan.fixes[: sum(f.fits for f in plan.fixes)])


def test_plans_from_a_hub_cache_holding_only_config_json(configs, tmp_path):
    """Planning before downloading the weights: huggingface_hub's cache layout, no manifest."""
    repo = tmp_path / "hub" / "models--someorg--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((configs["llama"] / "config.json").read_text())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    config = _config(configs["llama"]).replace(
        model="someorg/tiny", cache_dir=str(tmp_path / "hub")
    )
    plan = plan_memory(config, nodes=1, gpus_per_node=2, gpu_memory_bytes=None)
    assert plan.model.parameters == _plan(configs["llama"]).model.parameters


@pytest.mark.parametrize(
    ("overrides", "cluster", "message"),
    [
        (
            {"model": "nobody/missing-model"},
            (1, 2),
            "download_models.py --model nobody/missing-model",
        ),
        ({"total_batch_size": 8, "batch_size_per_device": 3}, (1, 2), "does not divide"),
        ({"total_batch_size": 4, "batch_size_per_device": 1}, (2, 4), "does not divide"),
        ({"max_seq_length": 4096}, (1, 2), "context length of 1024"),
        ({"no_fsdp": True}, (1, 2), "drop --no_fsdp"),
        ({}, (0, 2), "at least 1"),
    ],
)
def test_bad_input_gets_a_clear_message(configs, tmp_path, overrides, cluster, message):
    config = _config(configs["llama"], cache_dir=str(tmp_path / "empty-cache"), **overrides)
    with pytest.raises(ValueError, match=message):
        estimate(config, Cluster(*cluster))


def test_a_config_transformers_cannot_build(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(ValueError, match="Cannot read the model config"):
        estimate(_config(tmp_path), Cluster(1, 2))


def test_command_line(configs, capsys):
    common = ["--model", str(configs["llama"]), "--gpus_per_node", "2", "--max_seq_length", "64"]
    fits = run_module("fsdp_utils.plan", *common, "--gpu_memory", "a100-80gb", "--json")
    assert fits.returncode == 0, fits.stderr
    result = json.loads(fits.stdout)
    assert result["fits"] is True and result["gpu"]["name"] == "A100-80GB"
    assert result["required_bytes"] == result["peak_bytes"] + result["margin_bytes"]

    # The 2 GiB runtime margin alone does not fit in a 1 GiB GPU: exit 1, and a readable table.
    assert main([*common, "--gpu_memory", "1GiB", "--no_fixes"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "predicted peak" in out

    assert main([*common, "--gpu_memory", "80"]) == 2
    assert "80GiB" in capsys.readouterr().err


# --- the fast planner: shallow traces, extrapolated ------------------------------------------

# Each case once exposed a way to extrapolate wrongly: a tied Qwen2 with checkpointing peaks in
# its first micro-batch up to 5 layers and in its second from 6 on; checkpointing every 2nd
# layer with deferred sync needs whole periods and both ends of the stack. (bench/plan_table.py
# --agreement compares more architectures and settings.)
EXTRAPOLATED = {
    "qwen2-checkpointing": ("qwen2", 14, {"gradient_checkpointing": True}),
    "llama-every-2nd-deferred": (
        "llama",
        20,
        {
            "gradient_checkpointing": True,
            "checkpoint_every_n_layers": 2,
            "defer_grad_sync": True,
            "batch_size_per_device": 1,
        },
    ),
    # Local and global attention layers take turns: copies of whole pairs of layers.
    "gemma2-alternating-deferred": (
        "gemma2",
        26,
        {"gradient_checkpointing": True, "defer_grad_sync": True, "batch_size_per_device": 1},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(EXTRAPOLATED))
def test_extrapolated_plan_equals_the_full_trace(tmp_path, case):
    arch, layers, overrides = EXTRAPOLATED[case]
    tiny_model_config(arch, vocab_size=512, num_layers=layers).save_pretrained(tmp_path)
    config = _config(tmp_path, max_seq_length=32, **overrides)
    fast = estimate(config, Cluster(2, 2))
    full = estimate(config, Cluster(2, 2), full_trace=True)
    assert fast.method.startswith("extrapolated from") and f"of {layers} layers" in fast.method
    assert full.method == f"all {layers} layers traced (--full_trace)"
    assert fast.model == full.model
    # Byte for byte, every figure the plan reports; the issue asked for 1%.
    for name in ("peak", "peak_before_optimizer", "peak_in_optimizer", "before_optimizer"):
        assert getattr(fast.memory, name) == getattr(full.memory, name), name
    assert fast.memory.peak_bytes == pytest.approx(full.memory.peak_bytes, rel=0.01)


def test_models_too_shallow_or_with_unlike_layers_are_traced_whole(configs, tmp_path):
    from fsdp_utils.model.build import build_meta_model, find_decoder_layers
    from fsdp_utils.plan.extrapolate import layer_period, why_layers_differ

    shallow = estimate(_config(configs["llama"]), Cluster(1, 2))
    assert shallow.method == "all 2 layers traced (too few layers to gain from extrapolating)"

    tiny_model_config("llama", vocab_size=512, num_layers=4).save_pretrained(tmp_path)
    model = build_meta_model(load_model_config(tmp_path), "bf16-mixed")
    assert why_layers_differ(model) is None
    layers = find_decoder_layers(model)
    layers[2].mlp = type(layers[0].mlp)(tiny_model_config("llama", 512, hidden_size=32))
    assert why_layers_differ(model) == "decoder layer 2 differs from layer 0"
    assert layer_period(model) is None  # nor do they repeat


def test_a_planner_crash_is_exit_3_with_its_traceback(tmp_path, capsys):
    """Not "does not fit" (1), nor a mistake in the command (2): the preflight tells them apart."""
    config = tiny_model_config("llama", vocab_size=512).to_dict()
    config["hidden_act"] = "no-such-activation"  # transformers raises KeyError, not ValueError
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["--model", str(tmp_path), "--gpus_per_node", "2", "--gpu_memory", "8GiB"]
    assert main([*args, "--max_seq_length", "64"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'no-such-activation'" in err
    assert "the memory planner crashed" in err


def test_dtensors_sharding_propagation_is_not_counted(configs, monkeypatch):
    """AdamW's foreach step on sharded parameters allocates one scratch tensor per parameter
    shard at most. On torch 2.11 DTensor's sharding propagation made fake copies of the arguments
    in the planner's fake mode at every step, which the tracker counted as six times that; the
    shim (`tracking.memory_tracker`, torch < 2.13) leaves them out. On 2.13 the shim, forced on,
    changes nothing."""
    from fsdp_utils.plan import tracking

    def optimizer_scratch(memory) -> tuple[int, int]:
        (step,) = [s for s in memory.segments if s.event == "optimizer"]
        scratch = step.peak["OptState"] - memory.before_optimizer["OptState"]
        return scratch, memory.before_optimizer["Sharded Param"]

    config = _config(configs["llama"])
    plain = estimate(config, Cluster(nodes=1, gpus_per_node=2)).memory
    scratch, shards = optimizer_scratch(plain)
    assert 0 < scratch <= shards
    monkeypatch.setattr(tracking, "torch_release", lambda: (2, 11))
    shimmed = estimate(config, Cluster(nodes=1, gpus_per_node=2)).memory
    assert optimizer_scratch(shimmed) == (scratch, shards)
    assert shimmed.peak == plain.peak
