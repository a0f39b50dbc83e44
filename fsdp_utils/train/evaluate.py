"""The held-out loss: every rank runs its share of the eval split through the same forward as
training (`step.forward_loss_sum`, in chunks as training's), and the token-summed loss is reduced over all ranks."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdp_utils.data.blocks import TokenBlocks, eval_batches
from fsdp_utils.data.sequence_slices import slice_batch
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.parallel.parallelize import no_grad_pass
from fsdp_utils.parallel.sequence import SequenceParallel
from fsdp_utils.train.loss import LossChunking, batch_targets
from fsdp_utils.train.step import forward_loss_sum


def evaluate(
    model: nn.Module,
    blocks: TokenBlocks,
    *,
    env: DistEnv,
    batch_size: int,
    max_batches: int,
    autocast: Callable[[], Any],
    chunking: LossChunking,
    sequence_parallel: SequenceParallel | None = None,
) -> dict[str, Any] | None:
    """Collective. The eval loss, perplexity and target tokens; None without eval data.

    Every rank runs the same number of forward passes (FSDP's collectives would hang
    otherwise: `eval_batches`), and the model is back in training mode afterwards. With
    `sequence_parallel` the split is the data-parallel ranks', and each rank runs its slices."""
    if len(blocks) == 0:
        return None
    sp = sequence_parallel or SequenceParallel.off(env)
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)
    with no_grad_pass(model):
        for indices in eval_batches(
            len(blocks), batch_size, sp.data_rank, sp.data_size, max_batches
        ):
            batch = slice_batch(blocks.batch(indices), rank=sp.rank, size=sp.size)
            extra = sp.forward_kwargs()
            totals[0] += forward_loss_sum(model, batch, env.device, autocast, chunking, **extra)[1]
            totals[1] += batch_targets(batch)
    loss_sum, tokens = dist_utils.all_reduce_sum(totals).tolist()
    if tokens == 0:
        return None
    loss = loss_sum / tokens
    return {
        "eval_loss": loss,
        "eval_perplexity": math.exp(min(loss, 50.0)),
        "eval_tokens": int(tokens),
    }
