"""GRPO's objective (fsdp_utils/methods/grpo/loss.py) against TRL's GRPOTrainer (trl 1.16.0,
copied line for line in tests/trl_grpo_reference.py): the same loss and gradients on the same
log-probabilities, advantages and masks, for every loss type, both importance-sampling levels,
with and without the KL term, on- and off-policy, in one micro-batch and split over two; the
same advantages for every reward scaling; the same clip fractions and KL. Plain tensors, no
model: milliseconds."""

from __future__ import annotations

import itertools

import pytest
import torch

from fsdp_utils.methods.grpo.loss import (
    METRIC_SUMS,
    GrpoSettings,
    combine_rewards,
    group_advantages,
    metric_sums,
    normalizer,
    objective,
    per_token_terms,
)
from tests import trl_grpo_reference as trl

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
LEVELS = ("token", "sequence")
ROWS, TOKENS, MAX_COMPLETION = 6, 7, 9


def _inputs(seed: int, *, off_policy: bool, beta: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 1, 6, 0])  # one completion masked out whole
    mask = (torch.arange(TOKENS)[None, :] < lengths[:, None]).float()
    logps = -torch.rand(ROWS, TOKENS, generator=g, dtype=torch.float64) * 3
    inputs = {
        "logps": logps,
        "completion_mask": mask,
        "advantages": torch.randn(ROWS, generator=g, dtype=torch.float64),
    }
    if off_policy:  # log-ratios of about +-0.4 per token and per row: some clipped low, some high
        noise = torch.randn(ROWS, TOKENS, generator=g) + torch.randn(ROWS, 1, generator=g)
        inputs["old_per_token_logps"] = logps + noise * 0.3
    if beta:
        inputs["ref_per_token_logps"] = logps + torch.randn(ROWS, TOKENS, generator=g) * 0.3
    return inputs


def _ours(settings: GrpoSettings, logps: torch.Tensor, inputs: dict, parts: int) -> torch.Tensor:
    """The step's loss as step.py sums it: each micro-batch's objective, over the normalizer
    counted across all of them."""
    rows = torch.arange(ROWS).chunk(parts)
    mask = inputs["completion_mask"]
    old = inputs.get("old_per_token_logps")
    ref = inputs.get("ref_per_token_logps")
    total = sum(
        objective(
            per_token_terms(
                logps[r],
                None if old is None else old[r],
                inputs["advantages"][r],
                mask[r],
                settings,
                ref_logps=None if ref is None else ref[r],
            ).loss,
            mask[r],
            settings,
        )
        for r in rows
    )
    count = normalizer(settings, completions=ROWS, tokens=float(mask.sum()), micro_batches=parts)
    return total / count


def _trl(args, logps: torch.Tensor, inputs: dict, parts: int) -> torch.Tensor:
    """TRL's: each micro-batch's `_compute_loss` (divided by the accumulation steps), summed
    as the accumulated gradients sum them; dapo's count spans the generation batch."""
    total = torch.zeros((), dtype=torch.float64)
    for r in torch.arange(ROWS).chunk(parts):
        micro = {k: v[r] for k, v in inputs.items() if k != "logps"}
        micro["num_items_in_batch"] = inputs["completion_mask"].sum()
        loss, _ = trl.compute_loss(args, logps[r], micro)
        total = total + loss
    return total


# (beta, bias correction of the KL): the correction only changes the KL term
KL = ((0.0, True), (0.04, True), (0.04, False))
CASES = [
    (loss_type, level, beta, bias_kl, off_policy)
    for loss_type, level, (beta, bias_kl), off_policy in itertools.product(
        LOSS_TYPES, LEVELS, KL, (False, True)
    )
]


@pytest.mark.parametrize("loss_type,level,beta,bias_kl,off_policy", CASES)
def test_loss_and_gradients_equal_trls(loss_type, level, beta, bias_kl, off_policy):
    settings = GrpoSettings(
        loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, importance_sampling_level=level,
        beta=beta, bias_correction_kl=bias_kl, max_completion_length=MAX_COMPLETION,
    )  # fmt: skip
    inputs = _inputs(hash((loss_type, level)) % 1000, off_policy=off_policy, beta=beta)
    for parts in (1, 2, 3):  # one micro-batch, or the rows split into equal ones
        args = trl.trl_args(
            loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, beta=beta,
            importance_sampling_level=level, max_completion_length=MAX_COMPLETION,
            use_bias_correction_kl=bias_kl, gradient_accumulation_steps=parts,
        )  # fmt: skip
        ours_logps = inputs["logps"].clone().requires_grad_(True)
        trl_logps = inputs["logps"].clone().requires_grad_(True)
        ours = _ours(settings, ours_logps, inputs, parts)
        reference = _trl(args, trl_logps, inputs, parts)
        ours.backward()
        reference.backward()
        assert ours.item() == pytest.approx(reference.item(), rel=1e-12, abs=1e-15), parts
        assert torch.allclose(ours_logps.grad, trl_logps.grad, rtol=1e-10, atol=1e-15), parts
        assert ours_logps.grad.abs().sum() > 0  # the case trains something


@pytest.mark.parametrize("level", LEVELS)
def test_clip_fractions_and_kl_equal_trls(level):
    settings = GrpoSettings(
        epsilon_low=0.2, epsilon_high=0.28, importance_sampling_level=level, beta=0.04
    )
    inputs = _inputs(4, off_policy=True, beta=0.04)
    mask, adv = inputs["completion_mask"], inputs["advantages"]
    terms = per_token_terms(
        inputs["logps"], inputs["old_per_token_logps"], adv, mask, settings,
        ref_logps=inputs["ref_per_token_logps"],
    )  # fmt: skip
    sums = dict(
        zip(
            METRIC_SUMS,
            metric_sums(terms, adv, mask, torch.zeros_like(mask), settings).tolist(),
            strict=True,
        )
    )
    _, expected = trl.compute_loss(
        trl.trl_args(epsilon_high=0.28, beta=0.04, importance_sampling_level=level),
        inputs["logps"], {**inputs, "num_items_in_batch": mask.sum()},
    )  # fmt: skip
    # TRL's mask is float32 (its sums too); ours are summed in float64
    assert sums["kl"] / sums["tokens"] == pytest.approx(expected["kl"], rel=1e-6)
    for name in ("low", "high", "region"):
        mean = sums[f"clip_{name}"] / sums["ratio_count"]
        assert mean == pytest.approx(expected[f"clip_ratio/{name}_mean"], rel=1e-6), name
    assert sums["clip_low"] > 0 and sums["clip_high"] > 0  # both kinds occur in this case


@pytest.mark.parametrize("scale", ("group", "batch", "none"))
def test_advantages_equal_trls(scale):
    g = torch.Generator().manual_seed(0)
    per_function = torch.randn(12, 2, generator=g)  # 3 prompts x 4 completions, 2 functions
    per_function[1, 0] = torch.nan  # one function skipped one completion
    per_function[5] = torch.nan  # every function skipped this one: no advantage
    per_function[8:12, :] = torch.tensor([1.0, 0.5])  # one group all alike: std 0
    weights = torch.tensor([1.0, 0.5])
    ours, zero = group_advantages(combine_rewards(per_function, weights), 4, scale)
    expected, expected_zero = trl.advantages(per_function, weights, 4, scale)
    assert torch.allclose(ours, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(zero, expected_zero)
    assert ours[5] == 0 and torch.all(ours[8:12] == 0)
    if scale != "batch":
        assert zero[8:12].all() and not zero[:8].any()


def test_a_constant_reward_has_no_advantage_and_no_gradient_at_beta_0():
    rewards = torch.full((8,), 1.0)
    for scale in ("group", "batch", "none"):
        advantages, zero = group_advantages(rewards, 4, scale)
        assert torch.all(advantages == 0) and zero.all()
    logps = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(8, 5)
    for loss_type in LOSS_TYPES:
        settings = GrpoSettings(loss_type=loss_type)
        loss = objective(
            per_token_terms(logps, None, advantages, mask, settings).loss, mask, settings
        )
        (grad,) = torch.autograd.grad(loss, logps)
        assert loss.item() == 0 and torch.all(grad == 0), loss_type


def test_normalizers_count_what_each_loss_type_averages_over():
    s = {t: GrpoSettings(loss_type=t, max_completion_length=100) for t in LOSS_TYPES}
    counts = {"completions": 16.0, "tokens": 700.0, "micro_batches": 4.0}
    assert normalizer(s["grpo"], **counts) == 16
    assert normalizer(s["dr_grpo"], **counts) == 1600
    assert normalizer(s["dapo"], **counts) == 700
    assert normalizer(s["bnpo"], **counts) == 4
    assert normalizer(s["dapo"], completions=4, tokens=0, micro_batches=1) == 1  # all masked
