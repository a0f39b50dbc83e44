"""The planner against reality: the same tracker measuring a real 2-process CPU (gloo) run of the
trainer, and the textbook state memory of CodeLlama-7B and -13B."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_utils.config.parse import build_parser, parse_config
from fsdp_utils.plan import StepMemory, plan_memory
from fsdp_utils.plan.estimate import Cluster, estimate
from tests.train_helpers import REPO_ROOT, check_ok, run_script, tiny_args

pytestmark = pytest.mark.slow

CONFIGS = REPO_ROOT / "tests" / "fixtures" / "configs"


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


def _measure(args: list[str], out: Path) -> StepMemory:
    """`torchrun -m fsdp_utils.plan.measure`: the real Trainer, FSDP2 over gloo, 2 processes."""
    result = run_script(2, "-m", ["fsdp_utils.plan.measure", "--out", str(out), *args])
    check_ok(result)
    return StepMemory.from_dict(json.loads(out.read_text()))


@pytest.mark.parametrize(
    "overrides",
    [
        # bf16 compute over fp32 shards, 2 micro-batches, gradients reduced after each
        {"precision": "bf16-mixed", "total_batch_size": 8, "batch_size_per_device": 2},
        # 4 micro-batches of which the planner traces 3; activation checkpointing; the
        # unsharded gradients kept until the last micro-batch
        {
            "total_batch_size": 16,
            "batch_size_per_device": 2,
            "gradient_checkpointing": True,
            "defer_grad_sync": True,
        },
        # op-level selective checkpointing: attention and every second matmul saved
        {
            "precision": "bf16-mixed",
            "total_batch_size": 8,
            "batch_size_per_device": 2,
            "gradient_checkpointing": True,
            "checkpoint_mode": "op",
        },
    ],
    ids=["bf16-mixed", "fp32-checkpointing-deferred-sync", "bf16-mixed-op-checkpointing"],
)
def test_plan_matches_the_tracker_on_a_real_two_process_run(
    tiny_assets, data_cache, tmp_path, overrides
):
    args = tiny_args(tiny_assets, tmp_path / "run", data_cache, no_final_save=True, **overrides)
    real = _measure(args, tmp_path / "step.json")
    config, _ = parse_config(args, build_parser())
    planned = estimate(config, Cluster(nodes=1, gpus_per_node=2)).memory

    # The planner traces at most 3 micro-batches (the others repeat them) and so leaves out the
    # token ids of the rest: 16 bytes per token, the only difference expected.
    untraced = real.micro_batches - planned.micro_batches
    token_ids = untraced * 16 * config.batch_size_per_device * config.seq_length
    # Parameters, gradients and optimizer state before the update: byte for byte.
    assert planned.state_bytes == real.state_bytes
    # Totals: the same up to the untraced token ids, and up to a few scalars that the real
    # run's garbage collector had not freed yet (reference cycles through DTensor dispatch, e.g.
    # the 21 per-parameter norms of gradient clipping, 84 bytes, in about one run in six).
    gc_slack = 256
    extra = real.before_optimizer["Total"] - planned.before_optimizer["Total"] - token_ids
    assert 0 <= extra <= gc_slack
    assert 0 <= real.peak_bytes - planned.peak_bytes - token_ids <= gc_slack
    assert planned.peak_bytes == pytest.approx(real.peak_bytes, rel=1e-3)
    for category, measured in real.peak.items():
        planned_bytes = planned.peak.get(category, 0)
        assert planned_bytes == pytest.approx(measured, abs=token_ids + gc_slack), category


def _llama_parameters(config_json: Path) -> int:
    """Parameter count of a Llama config from its shapes (untied embeddings, no biases)."""
    c = json.loads(config_json.read_text())
    h, inter, layers, vocab = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_hidden_layers"],
        c["vocab_size"],
    )
    per_layer = 4 * h * h + 3 * h * inter + 2 * h  # attention, SwiGLU MLP, two RMSNorms
    return 2 * vocab * h + layers * per_layer + h


@pytest.mark.parametrize(
    ("name", "nodes", "precision", "optimizer", "bytes_per_parameter"),
    [
        ("codellama-7b", 1, "bf16-mixed", "adamw", 16),  # fp32 weights + grads + 2 moments
        ("codellama-7b", 1, "bf16-true", "sgd", 4),  # bf16 weights + grads, no state
        ("codellama-13b", 2, "bf16-mixed", "adamw", 16),
    ],
)
def test_textbook_state_memory_of_codellama(name, nodes, precision, optimizer, bytes_per_parameter):
    folder = CONFIGS / name
    world = nodes * 4
    config, _ = parse_config(
        [
            "--model", str(folder), "--precision", precision, "--optimizer", optimizer,
            "--total_batch_size", str(world), "--max_seq_length", "512",
        ],
        build_parser(),
    )  # fmt: skip
    plan = plan_memory(config, nodes=nodes, gpus_per_node=4, gpu_memory_bytes=None)
    parameters = _llama_parameters(folder / "config.json")
    assert plan.model.parameters == parameters
    # Sharded over all GPUs; the dimensions divide by the world size, so no padding.
    assert plan.state_bytes == pytest.approx(bytes_per_parameter * parameters / world, rel=1e-4)
