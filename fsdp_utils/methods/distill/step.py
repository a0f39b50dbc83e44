"""The distillation step and evaluation: TrainStep's loop (micro-batches, gradient sync,
clipping, the non-finite checks, the optimizer) with distillation's loss per target token in
place of the cross-entropy alone.

The loss of a micro-batch is summed over its target tokens and normalised by the step's
target tokens (all micro-batches, all ranks), as the token loss is, so any split of the same
total batch gives the same update. Its terms (`loss.TERMS`) are logged as means over the
step's target tokens: distill/ce, distill/divergence, distill/teacher_kl,
distill/top1_agreement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import eval_batches
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.parallel.parallelize import no_grad_pass
from fsdp_utils.train.loss import LossChunking, Targets, chunked_over_targets
from fsdp_utils.train.step import Batch, TrainStep, build_train_step, forward_target_chunks

from .loss import TERMS, DistillSettings
from .teacher import TeacherSource, host_targets

# Batches the student sampled (--lmbda) carry this key: their loss is the divergence alone.
ON_POLICY = "on_policy"


class DistillLoss:
    """Distillation's loss of one micro-batch and the sums of its terms."""

    def __init__(
        self,
        teacher: TeacherSource,
        settings: DistillSettings,
        *,
        chunking: LossChunking,
        device: torch.device,
        autocast: Callable[[], Any],
    ) -> None:
        self.teacher = teacher
        self.settings = settings
        self.chunking = chunking
        self.device = device
        self.autocast = autocast

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the summed loss of the batch's targets, differentiable; the sums of `TERMS` [4]
        fp64). The teacher first: under no_grad, its activations are freed before the
        student's. Call `teacher.release()` after the backward."""
        per_target = self.teacher.per_target(batch, host_targets(batch))
        settings = self.settings

        def loss_of_hidden(head: nn.Module, hidden: torch.Tensor, targets: Targets) -> torch.Tensor:
            compute = self.teacher.terms(settings, (head, self.chunking.transform))
            return chunked_over_targets(
                compute, hidden, targets, chunk_size=self.chunking.chunk_size,
                per_target=per_target,
            )  # fmt: skip

        _, terms, _ = forward_target_chunks(
            model, batch, self.device, self.autocast, loss_of_hidden
        )
        ce_weight = 0.0 if ON_POLICY in batch else 1.0 - settings.alpha
        objective = (settings.alpha * terms[:, 1] + ce_weight * terms[:, 0]).sum()
        return objective, terms.detach().sum(dim=0).to(torch.float64)


class DistillStep(TrainStep):
    """TrainStep with distillation's loss: `forward_backward` returns the summed loss of its
    targets, normalised by the step's targets as TrainStep's, and the step's metrics carry
    the terms' means over them (on checked steps: one more all-reduce)."""

    def __init__(self, *args: Any, distill_loss: DistillLoss, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.distill_loss = distill_loss
        self._sums = torch.zeros(len(TERMS), dtype=torch.float64, device=self.device)

    def __call__(self, micro_batches: list[Batch], **kwargs: Any) -> dict[str, Any]:
        self._sums.zero_()
        targets = self.local_counts(micro_batches)[0]
        metrics = super().__call__(micro_batches, **kwargs)
        if kwargs.get("check", True):
            reduced = torch.cat([self._sums, self._sums.new_tensor([targets])])
            *sums, total = dist_utils.all_reduce_sum(reduced).tolist()
            metrics["logged"] = term_means(sums, total)
        return metrics

    def forward_backward(self, batch: Batch, global_targets: float) -> torch.Tensor:
        try:
            objective, sums = self.distill_loss(self.model, batch)
            self._sums += sums
            # FSDP averages gradients over ranks: times the world size, the sum over all
            # ranks' targets, divided by the step's targets.
            loss = objective * (self.world_size / max(global_targets, 1.0))
            if self.scaler is not None:
                loss = self.scaler.scale(loss)
            loss.backward()
        finally:
            self.distill_loss.teacher.release()
        return objective.detach().to(torch.float64)


def term_means(sums: list[float], targets: float, prefix: str = "") -> dict[str, float]:
    return {
        f"{prefix}distill/{name}": value / max(targets, 1.0)
        for name, value in zip(TERMS, sums, strict=True)
    }


def build_distill_step(
    model: nn.Module,
    config: TrainConfig,
    *,
    world_size: int,
    device: torch.device,
    hf_config: Any,
    chunking: LossChunking,
    distill_loss: DistillLoss,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    grad_scaler: bool = True,
) -> DistillStep:
    """`train.step.build_train_step` for --method distill (no router loss: the load-balancing
    term of mixture-of-experts students is left out of the objective, as with DPO)."""
    step = build_train_step(
        model, config, world_size=world_size, device=device, hf_config=hf_config,
        autocast=autocast, grad_scaler=grad_scaler, step_class=DistillStep, router_loss=None,
        chunking=chunking, distill_loss=distill_loss,
    )  # fmt: skip
    assert isinstance(step, DistillStep)
    return step


def evaluate_distill(
    model: nn.Module,
    examples: Any,
    distill_loss: DistillLoss,
    *,
    env: DistEnv,
    batch_size: int,
    max_batches: int,
) -> dict[str, Any] | None:
    """Collective: the held-out loss and terms (eval_loss, eval_distill/ce, ...,
    eval_distill/teacher_kl, eval_distill/top1_agreement), means over the held-out target
    tokens; None without held-out blocks. Every rank runs the same number of forwards."""
    if len(examples) == 0:
        return None
    totals = torch.zeros(len(TERMS) + 2, dtype=torch.float64, device=env.device)
    with no_grad_pass(model):
        for indices in eval_batches(len(examples), batch_size, env.rank, env.world_size,
                                    max_batches):  # fmt: skip
            batch = examples.batch(indices)
            try:
                objective, sums = distill_loss(model, batch)
            finally:
                distill_loss.teacher.release()
            totals[0] += objective.to(torch.float64)
            totals[1:-1] += sums
            totals[-1] += float(host_targets(batch).rows.numel())
    loss_sum, *term_sums, count = dist_utils.all_reduce_sum(totals).tolist()
    if count == 0:
        return None
    return {
        "eval_loss": loss_sum / count,
        **term_means(term_sums, count, prefix="eval_"),
        "eval_tokens": int(count),
    }
