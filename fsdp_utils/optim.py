"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from fsdp_utils.config import TrainConfig


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW keeps two states per parameter (8 bytes/param in fp32); SGD without momentum none.

    With FSDP2 the parameters are DTensor shards, so the state is sharded too. `foreach` is
    explicit: torch.optim picks it for CUDA parameters but a per-tensor loop for CPU ones (CPU
    runs, --cpu_offload), and the memory planner must trace what the GPUs will run.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "adamw":
        return torch.optim.AdamW(
            params,
            lr=config.learning_rate,
            weight_decay=config.weight_decay,
            betas=(0.9, 0.95),
            foreach=True,
        )
    return torch.optim.SGD(
        params,
        lr=config.learning_rate,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        foreach=True,
    )


def lr_multiplier(step: int, config: TrainConfig) -> float:
    """Linear warmup to the peak, then cosine/linear decay to `min_lr_ratio` (or constant).

    `step` counts completed optimizer steps: the first update uses step 0.
    """
    warmup = config.resolved_warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if config.lr_schedule == "constant":
        return 1.0
    decay_steps = max(config.max_training_steps - warmup, 1)
    progress = min((step - warmup) / decay_steps, 1.0)
    if config.lr_schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: TrainConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s, config))
