"""The optimizer, the learning-rate schedule, and what a resume takes from the current config
(`fsdp_utils.train.optim`). Units on a small nn.Linear; the resume of a real run is in
test_step.py."""

from __future__ import annotations

import math

import pytest
import torch

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.train.optim import (
    ADAMW_BETAS,
    apply_settings,
    build_optimizer,
    build_scheduler,
    describe_changes,
    lr_multiplier,
    optimizer_settings,
    settings_in_optimizer,
)

# 10 warmup steps, then 100 steps of decay to 10% of the peak.
SCHEDULE = TrainConfig(max_training_steps=110, warmup_steps=10, min_lr_ratio=0.1)


def _cosine(progress: float) -> float:
    return 0.1 + 0.9 * (1 + math.cos(math.pi * progress)) / 2


@pytest.mark.parametrize(
    ("schedule", "step", "expected"),
    [
        ("cosine", 0, 1 / 11),  # the first update already has a learning rate
        ("cosine", 9, 10 / 11),  # the last warmup step
        ("cosine", 10, 1.0),  # warmup ends at the peak
        ("cosine", 35, _cosine(0.25)),
        ("cosine", 60, 0.55),  # halfway: halfway between the peak and the floor
        ("cosine", 110, 0.1),  # the end: min_lr_ratio
        ("cosine", 500, 0.1),  # past the end (more steps on resume): stays at the floor
        ("linear", 35, 0.1 + 0.9 * 0.75),
        ("linear", 110, 0.1),
        ("constant", 9, 10 / 11),  # constant after the same warmup
        ("constant", 110, 1.0),
    ],
)
def test_schedule_values(schedule, step, expected):
    assert lr_multiplier(step, SCHEDULE.replace(lr_schedule=schedule)) == pytest.approx(expected)


def test_default_warmup_is_five_percent_of_the_steps():
    config = TrainConfig(max_training_steps=200)
    assert optimizer_settings(config)["warmup_steps"] == 10
    assert lr_multiplier(9, config) == pytest.approx(10 / 11)
    assert lr_multiplier(10, config) == pytest.approx(1.0)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)  # frozen parameters get no optimizer state
    return model


def test_optimizer_takes_only_trainable_parameters_and_the_configs_settings():
    model = _model()
    adamw = build_optimizer(model, TrainConfig(learning_rate=3e-4, weight_decay=0.05))
    (group,) = adamw.param_groups
    assert isinstance(adamw, torch.optim.AdamW)
    assert [p.shape for p in group["params"]] == [(4, 4), (2, 4), (2,)]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (3e-4, 0.05, ADAMW_BETAS)
    assert group["foreach"]  # also for CPU parameters: what the planner traces is what runs

    sgd = build_optimizer(model, TrainConfig(optimizer="sgd", momentum=0.8))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.8


def test_a_scheduler_built_at_a_step_is_where_one_stepped_there_is():
    config = SCHEDULE.replace(learning_rate=2e-3)
    model = _model()
    stepped = build_optimizer(model, config)
    scheduler = build_scheduler(stepped, config)
    for _ in range(37):
        stepped.step()
        scheduler.step()
    resumed = build_optimizer(model, config)
    resumed.param_groups[0]["initial_lr"] = 1.0  # a checkpoint's: the config's peak wins
    build_scheduler(resumed, config, start_step=37)
    assert resumed.param_groups[0]["lr"] == pytest.approx(stepped.param_groups[0]["lr"])
    assert resumed.param_groups[0]["lr"] == pytest.approx(2e-3 * _cosine(27 / 100))


def test_resume_applies_the_current_settings_over_the_checkpoints():
    model = _model()
    saved = build_optimizer(model, TrainConfig(weight_decay=0.1))
    saved.param_groups[0]["betas"] = (0.5, 0.5)  # whatever the checkpoint holds
    current = TrainConfig(weight_decay=0.01)
    resumed = build_optimizer(model, current)
    resumed.load_state_dict(saved.state_dict())
    assert settings_in_optimizer(resumed)["weight_decay"] == 0.1
    assert settings_in_optimizer(resumed)["betas"] == [0.5, 0.5]
    apply_settings(resumed, current)
    found = settings_in_optimizer(resumed)
    assert (found["weight_decay"], found["betas"]) == (0.01, list(ADAMW_BETAS))


def test_describe_changes_says_what_a_resume_changes_and_only_that():
    config = SCHEDULE.replace(learning_rate=1e-3)
    assert describe_changes(optimizer_settings(config), config, 40) == []
    # A value that only differs in its last bits (read back from JSON) is not a change.
    noisy = {**optimizer_settings(config), "learning_rate": 1e-3 * (1 + 1e-15)}
    assert describe_changes(noisy, config, 40) == []

    decay = describe_changes(optimizer_settings(config.replace(weight_decay=0.3)), config, 40)
    assert decay == [
        "weight_decay: 0.3 -> 0.0",
        "the new optimizer settings apply to every update from step 41 on",
    ]

    lr = describe_changes(optimizer_settings(config.replace(learning_rate=2e-3)), config, 40)
    assert lr[0] == "learning_rate: 0.002 -> 0.001"
    now, before = 1e-3 * _cosine(0.3), 2e-3 * _cosine(0.3)
    assert f"lr {now:.3g} there (the saved settings would give {before:.3g})" in lr[1]
    assert len(lr) == 2
