"""GRPO's objective, as TRL's GRPOTrainer defines it (trl 1.16.0, trl/trainer/grpo_trainer.py),
in small functions of plain tensors, apart from the step that calls them (step.py), so that each
can be checked against TRL's arithmetic (tests/test_grpo_loss.py).

    rewards     the reward functions' outputs [completions, functions], weighted and summed
                (`combine_rewards`; a completion every function skipped, None, is NaN)
    advantages  each reward minus its group's mean (the G completions of one prompt), divided
                by the group's standard deviation, the step's (--scale_rewards batch) or not at
                all (none), + 1e-4 (`group_advantages`; TRL L2762-2800)
    ratio       exp(log p - log p_old) per token, or per completion: exp of the mean of its
                tokens' log-ratios (--importance_sampling_level sequence, GSPO; TRL L3076-3094)
    loss        per token: -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)
                + beta * KL, KL = exp(ref - logp) - (ref - logp) - 1 (k3), times the ratio unless
                --no_bias_correction_kl (`per_token_terms`; TRL L3096-3150)
    aggregate   per --loss_type (`objective` / `normalizer`; TRL L3153-3172):
                  grpo     mean over completions of each one's token mean
                  dapo     sum over the step's completion tokens / their count (the default)
                  dr_grpo  sum over tokens / (completions x --max_completion_length)
                  bnpo     each micro-batch's token mean, averaged over micro-batches

TRL divides each micro-batch's loss by the gradient accumulation steps and lets the data-parallel
gradient average divide by the processes. Here a micro-batch contributes `objective` (a sum) and
the step divides by `normalizer`, counted over all micro-batches and ranks: the same gradients
for grpo, dapo and dr_grpo whatever the split (TRL's grpo is exact for equal micro-batches,
which the sampler gives), and for bnpo the per-micro-batch mean TRL documents, split-dependent
by its definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# trl 1.16.0 grpo_trainer.py L2786: advantages / (std + 1e-4)
STD_EPSILON = 1e-4


@dataclass(frozen=True)
class GrpoSettings:
    """The options the objective reads (TRL's GRPOConfig names)."""

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    importance_sampling_level: str = "token"
    beta: float = 0.0
    bias_correction_kl: bool = True
    max_completion_length: int = 512
    scale_rewards: str = "group"
    num_generations: int = 8

    @classmethod
    def of(cls, config: Any) -> GrpoSettings:
        high = config.epsilon_high if config.epsilon_high is not None else config.epsilon
        return cls(
            loss_type=config.loss_type,
            epsilon_low=config.epsilon,
            epsilon_high=high,
            importance_sampling_level=config.importance_sampling_level,
            beta=config.beta,
            bias_correction_kl=not config.no_bias_correction_kl,
            max_completion_length=config.max_completion_length,
            scale_rewards=config.scale_rewards,
            num_generations=config.num_generations,
        )


# --- rewards and advantages ------------------------------------------------------------------


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation ignoring NaNs, with Bessel's correction (NaN below 2 values):
    trl 1.16.0 trl/trainer/utils.py `nanstd` (L1021-1048)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(values), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, torch.nan))
    std = torch.sqrt(variance * correction)
    return std.squeeze(dim) if dim is not None else std.squeeze()


def combine_rewards(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[completions] the weighted sum of [completions, functions] rewards, a function's None
    (NaN) counted as nothing, a completion whose every function said None left NaN
    (unscorable: it joins no baseline and gets no advantage). TRL L2757-2764."""
    rewards = (per_function * weights.to(per_function).unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(per_function).all(dim=1), torch.nan)


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [completions], whether each one's std is zero [completions]) of the step's
    rewards, grouped by prompt (G consecutive completions each). TRL L2765-2800."""
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards in ("group", "none"):  # "none" uses the group's std for the metric only
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    elif scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else rewards * 0
    else:
        raise ValueError(f"scale_rewards must be group, batch or none, not {scale_rewards!r}")
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    std_is_zero = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), std_is_zero


# --- the per-token loss ----------------------------------------------------------------------


@dataclass
class PerToken:
    """What `per_token_terms` gives: the loss per token ([rows, tokens], or [rows, 1] at the
    sequence level without a KL term, broadcast by the aggregation), the ratio (coef_1 in TRL),
    the KL per token (None at beta 0)."""

    loss: torch.Tensor
    ratio: torch.Tensor
    kl: torch.Tensor | None


def per_token_terms(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: GrpoSettings,
    ref_logps: torch.Tensor | None = None,
) -> PerToken:
    """The clipped surrogate and the KL term per token (TRL L3073-3150, loss types grpo, bnpo,
    dr_grpo, dapo). `logps` [rows, tokens]: the policy's log-probabilities of the completion
    tokens (differentiable); `old_logps`: when they were sampled (None: `logps` detached, the
    on-policy ratio 1 with its gradient, as TRL does when num_iterations is 1); `advantages`
    [rows]; `mask` [rows, tokens]: which tokens count; `ref_logps`: the reference's (beta > 0)."""
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if settings.importance_sampling_level == "token":
        log_weights = log_ratio
    elif settings.importance_sampling_level == "sequence":
        mask = mask.to(log_ratio.dtype)
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        raise ValueError(
            f"importance_sampling_level must be token or sequence, not "
            f"{settings.importance_sampling_level!r}"
        )
    ratio = torch.exp(log_weights)
    kl = None
    if settings.beta != 0.0:
        assert ref_logps is not None, "beta > 0 needs the reference's log-probabilities"
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if settings.bias_correction_kl:
            kl = kl * ratio
    clipped = torch.clamp(ratio, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    if kl is not None:
        loss = loss + settings.beta * kl
    return PerToken(loss, ratio, kl)


def objective(
    per_token_loss: torch.Tensor, mask: torch.Tensor, settings: GrpoSettings
) -> torch.Tensor:
    """One micro-batch's share of the step's loss, before `normalizer` divides it: the sum
    TRL's aggregation of `--loss_type` takes over this micro-batch (TRL L3153-3172)."""
    mask = mask.to(per_token_loss.dtype)
    masked = per_token_loss * mask
    if settings.loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    if settings.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if settings.loss_type in ("dapo", "dr_grpo"):
        return masked.sum()
    raise ValueError(f"loss_type must be grpo, bnpo, dr_grpo or dapo, not {settings.loss_type!r}")


def normalizer(
    settings: GrpoSettings, *, completions: float, tokens: float, micro_batches: float
) -> float:
    """What the step's summed `objective` is divided by, counted over every micro-batch of
    every rank: completions (grpo), completions x max_completion_length (dr_grpo), completion
    tokens in the loss (dapo), micro-batches (bnpo)."""
    value = {
        "grpo": completions,
        "dr_grpo": completions * settings.max_completion_length,
        "dapo": tokens,
        "bnpo": micro_batches,
    }[settings.loss_type]
    return max(float(value), 1.0)


# --- the metrics TRL logs (L3254-3282), as sums the step adds up over ranks ------------------

# The sums each micro-batch adds, in this order; `step.py` turns them into the logged means.
METRIC_SUMS = ("tokens", "entropy", "kl", "clip_low", "clip_high", "clip_region", "ratio_count")


def metric_sums(
    terms: PerToken,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor,
    settings: GrpoSettings,
) -> torch.Tensor:
    """[len(METRIC_SUMS)] float64: the masked sums of the entropy and KL over tokens, and of the
    clipped ratios (low: below 1 - eps with A < 0; high: above 1 + eps_high with A > 0) over
    tokens, or over completions at the sequence level, with their counts."""
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    m = mask.to(torch.float64)
    ratio = terms.ratio.detach()
    low = (ratio < 1 - settings.epsilon_low) & (advantages < 0)
    high = (ratio > 1 + settings.epsilon_high) & (advantages > 0)
    region = low | high
    if ratio.shape[-1] == 1:  # one ratio per completion: counted per completion
        weight, count = torch.ones_like(ratio, dtype=torch.float64), m.new_tensor(ratio.shape[0])
    else:
        weight, count = m, m.sum()
    zero = m.new_zeros(())
    kl = zero if terms.kl is None else (terms.kl.detach().double() * m).sum()
    return torch.stack(
        [
            m.sum(),
            (entropy.detach().double() * m).sum(),
            kl,
            (low * weight).sum(),
            (high * weight).sum(),
            (region * weight).sum(),
            zero + count,
        ]
    )
