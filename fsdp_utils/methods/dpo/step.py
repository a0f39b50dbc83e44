"""The DPO optimizer step and evaluation: TrainStep's loop (micro-batches, gradient sync,
clipping, the non-finite checks, the optimizer) with DPO's loss per pair in place of the token
loss.

A micro-batch holds whole pairs ([chosen..., rejected...], fsdp_utils/data/preference.py). The
loss is the mean over the pairs of the whole step (all micro-batches, all ranks), as the token
loss is normalised by the step's target tokens, so any split of the same total batch of pairs
gives the same update. The metrics are TRL's: rewards/chosen, rewards/rejected,
rewards/margins, rewards/accuracies, logps/chosen, logps/rejected, means over the step's pairs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import IGNORE_INDEX, eval_batches
from fsdp_utils.data.preference import PAIR_ROWS, PreferencePairs
from fsdp_utils.data.sequence_slices import slice_batch
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.parallel.parallelize import no_grad_pass
from fsdp_utils.parallel.sequence import SequenceParallel
from fsdp_utils.train.loss import LossChunking
from fsdp_utils.train.step import Batch, TrainStep, build_train_step

from .loss import DpoSettings, answer_tokens, dpo_loss, sequence_logps
from .reference import Reference

# The per-pair sums a step accumulates, in this order; their means are the logged metrics.
SUMS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def pair_count(batch: Batch) -> int:
    return int(batch[PAIR_ROWS].numel())


def pair_counts(batches: list[Batch], share: float = 1.0) -> list[float]:
    """[pairs, non-pad tokens] of this rank's micro-batches: the step's loss is a mean over
    pairs, as the token loss's is over target tokens (`train.step.local_counts`). `share`: 0
    on the ranks of a sequence-parallel group but its leader, which counts the group's pairs
    (its tokens are each rank's slices')."""
    pairs = share * sum(pair_count(b) for b in batches)
    tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    return [float(pairs), float(tokens)]


class PairLoss:
    """DPO's loss of one micro-batch of pairs, and the per-pair sums of its metrics."""

    def __init__(
        self,
        reference: Reference,
        settings: DpoSettings,
        *,
        chunking: LossChunking,
        device: torch.device,
        autocast: Callable[[], Any],
        sequence_parallel: SequenceParallel | None = None,
    ) -> None:
        self.reference = reference
        self.settings = settings
        self.chunking = chunking
        self.device = device
        self.autocast = autocast
        self.sequence_parallel = sequence_parallel or SequenceParallel()
        # One rank of a sequence-parallel group carries its pairs' loss and metrics; the others'
        # log-probabilities reach it through the group's sum, whose backward brings their
        # slices the whole gradient (`SequenceParallel.sum_over_slices`).
        self.share = 1.0 if self.sequence_parallel.leader else 0.0

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the summed loss of the pairs, differentiable; the `SUMS` of the pairs [5] fp64)."""
        # The reference first: under no_grad, its activations are freed before the policy's.
        reference = self.reference.logps(batch).float()
        policy = sequence_logps(
            model, batch, chunking=self.chunking, device=self.device, autocast=self.autocast,
            sequence_parallel=self.sequence_parallel,
        )  # fmt: skip
        pairs = pair_count(batch)
        if self.settings.averaged:
            tokens = answer_tokens(batch, self.sequence_parallel).to(self.device).clamp_min(1)
            policy, reference = policy / tokens, reference / tokens
        losses, chosen, rejected = dpo_loss(
            policy[:pairs], policy[pairs:], reference[:pairs], reference[pairs:], self.settings
        )
        detached = policy.detach()
        sums = torch.stack(
            [
                chosen.sum(),
                rejected.sum(),
                (chosen > rejected).float().sum(),
                detached[:pairs].sum(),
                detached[pairs:].sum(),
            ]
        ).to(torch.float64)
        return losses.sum() * self.share, sums * self.share


class PreferenceStep(TrainStep):
    """TrainStep with DPO's loss: `forward_backward` returns the summed loss of its pairs, and
    the step's counts are pairs (`local_counts`), so TrainStep's normalisation and checks hold."""

    def __init__(self, *args: Any, pair_loss: PairLoss, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pair_loss = pair_loss
        self._sums = torch.zeros(len(SUMS), dtype=torch.float64, device=self.device)

    def local_counts(self, batches: list[Batch]) -> list[float]:
        return pair_counts(batches, self.pair_loss.share)

    def __call__(self, micro_batches: list[Batch], **kwargs: Any) -> dict[str, Any]:
        self._sums.zero_()
        pairs = self.pair_loss.share * sum(pair_count(b) for b in micro_batches)
        metrics = super().__call__(micro_batches, **kwargs)
        if kwargs.get("check", True):  # one more all-reduce, on checked (logged) steps only
            reduced = torch.cat([self._sums, self._sums.new_tensor([pairs])])
            *sums, total = dist_utils.all_reduce_sum(reduced).tolist()
            metrics["logged"] = step_metrics(sums, total)
        return metrics

    def forward_backward(self, batch: Batch, global_targets: float) -> torch.Tensor:
        loss_sum, sums = self.pair_loss(self.model, batch)
        self._sums += sums
        # FSDP averages gradients over ranks: times the world size, the sum over all ranks'
        # pairs, divided by the step's pairs (`global_targets` counts pairs here).
        loss = loss_sum * (self.world_size / max(global_targets, 1.0))
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()
        return loss_sum.detach().to(torch.float64)


def step_metrics(sums: list[float], pairs: float, prefix: str = "") -> dict[str, float]:
    """TRL's metric names, means over `pairs`; rewards/margins = chosen - rejected."""
    means = {name: value / max(pairs, 1.0) for name, value in zip(SUMS, sums, strict=True)}
    means["rewards/margins"] = means["rewards/chosen"] - means["rewards/rejected"]
    return {f"{prefix}{name}": value for name, value in means.items()}


def build_preference_step(
    model: nn.Module,
    config: TrainConfig,
    *,
    world_size: int,
    device: torch.device,
    hf_config: Any,
    chunking: LossChunking,
    reference: Reference,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    grad_scaler: bool = True,
    sequence_parallel: SequenceParallel | None = None,
) -> PreferenceStep:
    """`train.step.build_train_step` for --method dpo (no router loss: the load-balancing term
    of mixture-of-experts models is left out of DPO's objective). `sequence_parallel`: the
    micro-batches hold this rank's slices of the pairs' sequences (both sides split alike)."""
    pair_loss = PairLoss(
        reference, DpoSettings.of(config), chunking=chunking, device=device, autocast=autocast,
        sequence_parallel=sequence_parallel,
    )  # fmt: skip
    step = build_train_step(
        model, config, world_size=world_size, device=device, hf_config=hf_config,
        autocast=autocast, grad_scaler=grad_scaler, step_class=PreferenceStep,
        router_loss=None, chunking=chunking, pair_loss=pair_loss,
        sequence_parallel=sequence_parallel,
    )  # fmt: skip
    assert isinstance(step, PreferenceStep)
    return step


def evaluate_pairs(
    model: nn.Module,
    pairs: PreferencePairs,
    pair_loss: PairLoss,
    *,
    env: DistEnv,
    batch_size: int,
    max_batches: int,
) -> dict[str, Any] | None:
    """Collective: the DPO loss and metrics of the held-out pairs (eval_loss, eval_rewards/...);
    None without eval pairs. Every rank runs the same number of forwards (`eval_batches`); with
    sequence parallelism the split is the data-parallel ranks', each rank running its slices."""
    if len(pairs) == 0:
        return None
    sp = pair_loss.sequence_parallel
    ranks = (sp.data_rank, sp.data_size) if sp.enabled else (env.rank, env.world_size)
    totals = torch.zeros(len(SUMS) + 2, dtype=torch.float64, device=env.device)
    with no_grad_pass(model):
        for indices in eval_batches(len(pairs), batch_size, *ranks, max_batches):
            batch = slice_batch(pairs.batch(indices), rank=sp.rank, size=sp.size)
            batch_loss, batch_sums = pair_loss(model, batch)
            totals[0] += batch_loss.to(torch.float64)
            totals[1:-1] += batch_sums
            totals[-1] += pair_loss.share * pair_count(batch)
    reduced = dist_utils.all_reduce_sum(totals).tolist()
    loss_sum, sums, count = reduced[0], reduced[1:-1], reduced[-1]
    if count == 0:
        return None
    return {
        "eval_loss": loss_sum / count,
        **step_metrics(sums, count, prefix="eval_"),
        "eval_pairs": int(count),
    }
