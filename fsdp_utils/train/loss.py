"""The causal-LM loss, summed over target tokens (normalised by the caller)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fsdp_utils.data.blocks import IGNORE_INDEX


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies: position t predicts labels[t + 1]. In fp32, whatever
    the compute dtype, so that bf16 logits do not cost accuracy in the loss."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(),
        labels[:, 1:].flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def count_targets(labels: torch.Tensor) -> int:
    """Target tokens in a batch of labels, as `token_loss_sum` counts them."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())
