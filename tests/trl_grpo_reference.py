"""TRL's GRPO arithmetic, copied from trl 1.16.0 (the newest release, 2026) for the tests to
compare fsdp_utils/methods/grpo/loss.py with. TRL is not installed in the test environment: it
needs datasets >= 4.7, above our floor, and pulls accelerate, pandas and more. The statements
below are TRL's own, line for line, with `self.`/`self.args.` turned into a `trl` namespace of
the GRPOConfig values, the model's forward replaced by the given log-probabilities, and the
branches of the loss types not built here (cispo, sapo, luspo, vespo), vLLM's correction, the
off-policy mask, the entropy mask and bonus, and the auxiliary loss left out.

Sources (wheel trl-1.16.0-py3-none-any.whl from PyPI):
- trl/trainer/grpo_trainer.py `_compute_loss`, L3020-3184: the per-token loss and aggregation;
- trl/trainer/grpo_trainer.py `_generate_and_score_completions`, L2749-2800: rewards to
  advantages (multi_objective_aggregation "sum_then_normalize", the default);
- trl/trainer/utils.py `nanstd`, L1021-1048.

Checked once against the installed trl 1.16.0 itself (a throwaway environment: `GRPOTrainer.
_compute_loss` called with these inputs on a stand-in trainer; docs/grpo.md gives the result).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch


def nanstd(tensor: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    # trl/trainer/utils.py L1037-1050
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)  # count of non-NaN values
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    variance *= correction  # Bessel's correction
    std = torch.sqrt(variance)
    if keepdim:
        return std
    if dim is None:
        return std.squeeze()
    return std.squeeze(dim)


def advantages(
    rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, num_generations: int,
    scale_rewards: str,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(advantages, is_std_zero): grpo_trainer.py L2755-2800."""
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        if num_generations > 1:
            std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    elif scale_rewards == "batch":
        if rewards.numel() > 1:
            std_rewards = nanstd(rewards).expand_as(rewards)
        else:
            std_rewards = torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    advantages = torch.nan_to_num(advantages, nan=0.0)
    return advantages, is_std_zero


def trl_args(**values: Any) -> SimpleNamespace:
    """GRPOConfig's values the loss reads, with its defaults (grpo_config.py)."""
    defaults = {
        "loss_type": "dapo", "epsilon": 0.2, "epsilon_high": None, "beta": 0.0,
        "importance_sampling_level": "token", "max_completion_length": 512, "delta": None,
        "use_bias_correction_kl": True, "gradient_accumulation_steps": 1,
        "steps_per_generation": None, "num_processes": 1,
    }  # fmt: skip
    args = SimpleNamespace(**{**defaults, **values})
    args.epsilon_low = args.epsilon
    args.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    if args.steps_per_generation is None:  # grpo_config.py L1100: the default
        args.steps_per_generation = args.gradient_accumulation_steps
    return args


def compute_loss(
    trl: SimpleNamespace,
    per_token_logps: torch.Tensor,
    inputs: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, dict[str, Any]]:
    """`GRPOTrainer._compute_loss` in training mode (L3050-3172 and the metrics L3254-3282), the
    forward's `per_token_logps` given; returns (loss, metrics)."""
    mask = inputs["completion_mask"]
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old_per_token_logps = inputs.get("old_per_token_logps")
    old_per_token_logps = (
        per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    )
    log_ratio = per_token_logps - old_per_token_logps
    if trl.importance_sampling_level == "token":
        log_importance_weights = log_ratio
    elif trl.importance_sampling_level == "sequence":
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if trl.beta != 0.0:
        ref_per_token_logps = inputs["ref_per_token_logps"]
        per_token_kl = (
            torch.exp(ref_per_token_logps - per_token_logps)
            - (ref_per_token_logps - per_token_logps)
            - 1
        )
        if trl.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - trl.epsilon_low, 1 + trl.epsilon_high)
    if trl.delta is not None:
        coef_1 = torch.clamp(coef_1, max=trl.delta)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    if trl.beta != 0.0:
        per_token_loss = per_token_loss + trl.beta * per_token_kl
    current_gradient_accumulation_steps = trl.gradient_accumulation_steps
    if trl.loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        loss = loss / current_gradient_accumulation_steps
    elif trl.loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        loss = loss / current_gradient_accumulation_steps
    elif trl.loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * trl.max_completion_length)
        loss = loss / current_gradient_accumulation_steps
    elif trl.loss_type == "dapo":
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trl.num_processes
        normalizer = normalizer * current_gradient_accumulation_steps / trl.steps_per_generation
        loss = (per_token_loss * mask).sum() / normalizer

    def global_masked_mean(x: torch.Tensor) -> float:  # one process: no reduce
        if x.shape[1] == 1:
            local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]))
        else:
            local_sum, local_count = (x * mask).sum(), mask.sum().float()
        return (local_sum / local_count.clamp(min=1.0)).item()

    metrics: dict[str, Any] = {}
    if trl.beta != 0.0:
        metrics["kl"] = global_masked_mean(per_token_kl)
    is_low_clipped = (coef_1 < 1 - trl.epsilon_low) & (advantages < 0)
    is_high_clipped = (coef_1 > 1 + trl.epsilon_high) & (advantages > 0)
    is_region_clipped = is_low_clipped | is_high_clipped
    metrics["clip_ratio/low_mean"] = global_masked_mean(is_low_clipped.float())
    metrics["clip_ratio/high_mean"] = global_masked_mean(is_high_clipped.float())
    metrics["clip_ratio/region_mean"] = global_masked_mean(is_region_clipped.float())
    return loss, metrics
