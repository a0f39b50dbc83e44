"""The training step and what surrounds it: the process-group backend, the fused per-step
all-reduce, non-finite gradients, what a resume takes from the current config, --compile."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.distributed_c10d as c10d
from transformers import AutoModelForCausalLM

from fsdp_utils.checkpoint.sharded import list_checkpoints
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.model.build import find_decoder_layers
from fsdp_utils.parallel.distributed import process_group_backend
from fsdp_utils.parallel.parallelize import parallelize
from fsdp_utils.synthetic import tiny_model_config
from fsdp_utils.train.optim import (
    apply_settings,
    build_optimizer,
    build_scheduler,
    describe_changes,
    lr_multiplier,
    optimizer_settings,
    settings_in_optimizer,
)
from fsdp_utils.train.timelimit import StopController
from tests.prefork import launch
from tests.train_helpers import check_ok, read_metrics, run_finetune, tiny_args

# --- the process-group backend (issue: --cpu_offload on GPUs) --------------------------------


def test_cuda_backend_routes_cpu_tensors_to_gloo():
    """With --cpu_offload the gradient-norm all-reduce meets CPU tensors; nccl alone has no
    backend for them. torch's own parser reads our string as cuda -> nccl, cpu -> gloo."""
    backend = process_group_backend("cuda")
    assert c10d.BackendConfig(c10d.Backend(backend)).get_device_backend_map() == {
        "cuda": "nccl",
        "cpu": "gloo",
    }
    assert process_group_backend("cpu") == "gloo"
    with pytest.raises(ValueError, match="use cuda or cpu"):
        process_group_backend("mps")


# --- one all-reduce per step: the stop vote and the next step's counts ------------------------


def test_stop_decision_carries_the_next_steps_counts(tmp_path):
    stop_file = tmp_path / "STOP"
    controller = StopController(
        stop_file, save_every_steps=2, save_every_minutes=0, stop_after_steps=None,
        margin_minutes=None, is_main=True,
    )  # fmt: skip
    decision = controller.poll(1, 0.1, add=[120.0, 128.0])
    assert (decision.stop, decision.save, decision.sums) == (None, False, [120.0, 128.0])
    stop_file.touch()
    decision = controller.poll(2, 0.1, add=[7.0, 8.0])
    assert (decision.stop, decision.save, decision.sums) == ("stop file", True, [7.0, 8.0])
    controller.flag.received = 10  # a signal outranks the stop file, as the MAX vote did
    assert controller.poll(3, 0.1).stop == "signal"


# --- resume: the current config decides ------------------------------------------------------


def _sgd_config(**changes) -> TrainConfig:
    base = TrainConfig(optimizer="sgd", learning_rate=1e-3, momentum=0.9, weight_decay=0.0,
                       max_training_steps=10, warmup_steps=2, lr_schedule="cosine")  # fmt: skip
    return base.replace(**changes)


def test_resumed_optimizer_takes_lr_momentum_and_schedule_from_the_config():
    torch.manual_seed(0)
    saved_config = _sgd_config()
    model = torch.nn.Linear(4, 4)
    optimizer = build_optimizer(model, saved_config)
    scheduler = build_scheduler(optimizer, saved_config)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
    state = optimizer.state_dict()

    current = _sgd_config(learning_rate=1e-4, momentum=0.5, weight_decay=0.01,
                          max_training_steps=20)  # fmt: skip
    resumed = build_optimizer(model, current)
    resumed.load_state_dict(state)  # the checkpoint's param groups: lr 1e-3, momentum 0.9
    saved = settings_in_optimizer(resumed)
    assert saved["learning_rate"] == 1e-3 and saved["momentum"] == 0.9
    apply_settings(resumed, current)
    build_scheduler(resumed, current, start_step=3)
    group = resumed.param_groups[0]
    assert group["lr"] == pytest.approx(1e-4 * lr_multiplier(3, current))
    assert (group["momentum"], group["weight_decay"]) == (0.5, 0.01)

    lines = describe_changes(optimizer_settings(saved_config), current, 3)
    text = "\n".join(lines)
    for change in ("learning_rate: 0.001 -> 0.0001", "momentum: 0.9 -> 0.5",
                   "max_training_steps: 10 -> 20", "weight_decay: 0.0 -> 0.01"):  # fmt: skip
        assert change in text, text
    assert "schedule is the new one from step 4 on" in text
    assert describe_changes(optimizer_settings(current), current, 3) == []


# --- --compile --------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compile_compiles_each_decoder_layer_in_place(checkpointing):
    """torchtitan's order: activation checkpointing, then compile per block (the wrapper when
    there is one), parameter names unchanged. (Equal losses with inductor: README, measured;
    a cold compile takes minutes here, too long for the suite.)"""
    config = TrainConfig(compile=True, no_fsdp=True, gradient_checkpointing=checkpointing)
    model = AutoModelForCausalLM.from_config(tiny_model_config("llama", 100, num_layers=3))
    names = [name for name, _ in model.named_parameters()]
    parallelize(model, find_decoder_layers(model), None, config)
    blocks = list(model.model.layers)
    assert all(block._compiled_call_impl is not None for block in blocks)
    expected = "CheckpointWrapper" if checkpointing else "LlamaDecoderLayer"
    assert {type(block).__name__ for block in blocks} == {expected}
    assert model.lm_head._compiled_call_impl is None and model._compiled_call_impl is None
    unwrapped = [n.replace("._checkpoint_wrapped_module", "") for n, _ in model.named_parameters()]
    assert unwrapped == names

    plain = AutoModelForCausalLM.from_config(tiny_model_config("llama", 100, num_layers=3))
    parallelize(plain, find_decoder_layers(plain), None, config.replace(compile=False))
    assert all(block._compiled_call_impl is None for block in plain.model.layers)


# --- real runs: non-finite gradients, resume with changed settings ---------------------------


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


def _poisoned(args: list[str], step: int) -> subprocess.CompletedProcess[str]:
    env = {"POISON_GRADIENT_AT_STEP": str(step), "OMP_NUM_THREADS": "1"}
    return launch(1, "tests/poison_gradient.py", args, env={**os.environ, **env}, timeout=300)


RUN = {"max_training_steps": 6, "learning_rate": 1e-3, "warmup_steps": 1, "batch_size_per_device": 4,
       "save_every_steps": 1, "keep_last": 3, "no_final_save": True}  # fmt: skip


@pytest.fixture(scope="module")
def poisoned_at_3(tiny_assets, data_cache, tmp_path_factory):
    """Step 3's gradient is infinite (its loss finite); every step is a checked log step."""
    out = tmp_path_factory.mktemp("poisoned") / "run"
    result = _poisoned(tiny_args(tiny_assets, out, data_cache, **RUN), step=3)
    return out, result


@pytest.mark.slow
def test_a_non_finite_gradient_norm_stops_before_the_update(poisoned_at_3):
    out, result = poisoned_at_3
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(r"The gradient norm is (nan|inf) at step 3, with a finite loss", result.stderr)
    assert "the last checkpoint (step 2) is good" in result.stderr
    assert "Traceback" not in result.stderr
    assert [c.step for c in list_checkpoints(out / "checkpoints")] == [1, 2]
    assert json.loads((out / "status.json").read_text())["status"] == "failed"


@pytest.mark.slow
def test_unchecked_steps_never_save_non_finite_weights(tiny_assets, data_cache, tmp_path):
    """--log_every 4: steps 1-3 are not read on the host. Step 2's infinite gradient steps
    NaN into the weights; the save due at step 3 finds it and refuses."""
    out = tmp_path / "run"
    args = tiny_args(tiny_assets, out, data_cache, **{**RUN, "log_every": 4, "save_every_steps": 3})
    result = _poisoned(args, step=2)
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        "The gradient norm was not finite at step 2 (found before saving a checkpoint at step 3"
        in result.stderr
    )
    assert list_checkpoints(out / "checkpoints") == []
    assert read_metrics(out) == []  # no step was logged: none was a log step


@pytest.mark.slow
def test_resume_takes_the_learning_rate_and_schedule_from_the_current_config(
    poisoned_at_3, tiny_assets, data_cache
):
    """Resume the poisoned run's step-2 checkpoint with another learning rate and more steps:
    the lr actually used follows the new config, and the log says what changed."""
    out, _ = poisoned_at_3
    changed = {**RUN, "learning_rate": 3e-4, "max_training_steps": 5, "save_every_steps": 0}
    result = run_finetune(1, tiny_args(tiny_assets, out, data_cache, **changed))
    check_ok(result)
    assert "resumed from step 2" in result.stdout
    assert "learning_rate: 0.001 -> 0.0003" in result.stdout
    assert "max_training_steps: 6 -> 5" in result.stdout
    records = read_metrics(out)[-3:]
    assert [r["step"] for r in records] == [3, 4, 5]
    new = TrainConfig(learning_rate=3e-4, max_training_steps=5, warmup_steps=1)
    expected = [3e-4 * lr_multiplier(r["step"] - 1, new) for r in records]
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-9)
    assert all(r["loss"] < 7 for r in records)  # finite: the poisoned update was never saved
