"""The DPO loss from sequence log-probabilities, as TRL's DPOTrainer computes it
(`dpo_loss`, loss_type "sigmoid" with label smoothing, and "ipo"), and the sequence
log-probabilities themselves, through the training loss's forward (chunked or not).

With policy log-probabilities pi_c, pi_r of the chosen and rejected answers and the
reference's ref_c, ref_r:

    logits   = (pi_c - pi_r) - (ref_c - ref_r)
    sigmoid  = -log sigmoid(beta logits) (1 - eps) - log sigmoid(-beta logits) eps
    ipo      = (logits - 1 / (2 beta))^2       (on length-averaged log-probabilities)
    rewards  = beta (pi - ref), per side

At the first step the policy is the reference, logits = 0 and the sigmoid loss is ln 2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import IGNORE_INDEX, next_token_labels
from fsdp_utils.parallel.sequence import SequenceParallel
from fsdp_utils.train.loss import LossChunking
from fsdp_utils.train.step import Batch, token_logprobs


@dataclass(frozen=True)
class DpoSettings:
    beta: float = 0.1
    loss_type: str = "sigmoid"  # sigmoid | ipo
    label_smoothing: float = 0.0

    @classmethod
    def of(cls, config: TrainConfig) -> DpoSettings:
        return cls(config.dpo_beta, config.dpo_loss, config.dpo_label_smoothing)

    @property
    def averaged(self) -> bool:
        """IPO compares length-averaged log-probabilities (TRL does the same)."""
        return self.loss_type == "ipo"


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    settings: DpoSettings,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss of each pair, chosen rewards, rejected rewards), [pairs] each; rewards detached."""
    logits = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)
    beta = settings.beta
    if settings.loss_type == "sigmoid":
        eps = settings.label_smoothing
        losses = -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
    elif settings.loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        raise AssertionError(f"unknown DPO loss {settings.loss_type}")
    chosen_rewards = beta * (policy_chosen - reference_chosen).detach()
    rejected_rewards = beta * (policy_rejected - reference_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def answer_tokens(batch: Batch, sequence_parallel: SequenceParallel | None = None) -> torch.Tensor:
    """[sequences] the tokens each sequence's log-probability sums (its answer's): of the
    whole sequences, also when the batch holds sequence-parallel slices of them."""
    sp = sequence_parallel or SequenceParallel()
    return sp.sum_over_slices((next_token_labels(batch) != IGNORE_INDEX).sum(dim=1))


def sequence_logps(
    model: nn.Module,
    batch: Batch,
    *,
    chunking: LossChunking,
    device: torch.device,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    averaged: bool = False,
    sequence_parallel: SequenceParallel | None = None,
) -> torch.Tensor:
    """[sequences] fp32: the summed log-probabilities of each sequence's answer tokens (the
    loss mask's), through the training loss's forward (train/loss.py: in chunks of target
    tokens, the output layer's logits never whole); `averaged`: divided by their number.
    `sequence_parallel`: the batch holds this rank's slices; every rank of the group gets the
    whole sequences' sums (`SequenceParallel.sum_over_slices`: a loss made from them belongs on
    the group's leader)."""
    sp = sequence_parallel or SequenceParallel()
    logps = token_logprobs(
        model, batch, chunking=chunking, device=device, autocast=autocast, **sp.forward_kwargs()
    )
    summed = sp.sum_over_slices(logps.sum(dim=1))
    if averaged:
        summed = summed / answer_tokens(batch, sp).to(device).clamp_min(1)
    return summed
