"""Batch arithmetic: the total batch is held fixed; what does not divide fails with numbers."""

from __future__ import annotations

import pytest

from fsdp_utils.config.batch import plan_batch
from fsdp_utils.config.train_config import DEFAULT_TOTAL_BATCH_SIZE, TrainConfig


@pytest.mark.parametrize(
    ("total", "per_device", "world", "accum"),
    [(32, 1, 4, 8), (32, 2, 4, 4), (32, 8, 4, 1), (64, 2, 16, 2), (8, 2, 1, 4)],
)
def test_accumulation_is_derived(total, per_device, world, accum):
    config = TrainConfig(total_batch_size=total, batch_size_per_device=per_device)
    plan = plan_batch(config, world)
    assert plan.gradient_accumulation_steps == accum
    assert plan.batch_size_per_device * plan.world_size * accum == total
    assert plan.tokens_per_step == total * config.seq_length


def test_seed_style_accumulation_gives_the_total():
    config = TrainConfig(gradient_accumulation_steps=3, batch_size_per_device=2)
    assert plan_batch(config, 4).total_batch_size == 24


def test_default_total():
    assert plan_batch(TrainConfig(), 4).total_batch_size == DEFAULT_TOTAL_BATCH_SIZE


def test_non_dividing_total_shows_all_numbers_and_fixes():
    config = TrainConfig(total_batch_size=30, batch_size_per_device=4)
    with pytest.raises(ValueError) as err:
        plan_batch(config, 4)
    message = str(err.value)
    for number in ("total_batch_size=30", "4 x 4 = 16", "1.88"):
        assert number in message
    assert "--total_batch_size 32" in message  # nearest valid total
    assert "--total_batch_size 16" in message


def test_non_dividing_world_suggests_a_device_count():
    config = TrainConfig(total_batch_size=30, batch_size_per_device=1)
    with pytest.raises(ValueError, match=r"3 devices in all \(= 1 x 3 x 10 accumulation\)"):
        plan_batch(config, 4)


def test_suggested_per_device_batch_divides():
    config = TrainConfig(total_batch_size=24, batch_size_per_device=4)
    with pytest.raises(ValueError, match=r"--batch_size_per_device 3 \(= 3 x 4 x 2"):
        plan_batch(config, 4)


def test_contradicting_accumulation():
    config = TrainConfig(
        total_batch_size=32, batch_size_per_device=2, gradient_accumulation_steps=2
    )
    with pytest.raises(ValueError, match="needs 32 / \\(2 x 4\\) = 4 accumulation steps"):
        plan_batch(config, 4)
