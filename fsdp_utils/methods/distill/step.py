"""The distillation step and evaluation: TrainStep's loop (micro-batches, gradient sync,
clipping, the non-finite checks, the optimizer) with distillation's loss per target token in
place of the cross-entropy alone.

The loss of a micro-batch is summed over its target tokens and normalised by the step's
target tokens (all micro-batches, all ranks), as the token loss is, so any split of the same
total batch gives the same update. Its terms (`loss.TERMS`) are logged as means over the
step's target tokens: distill/ce, distill/divergence, distill/teacher_kl,
distill/top1_agreement; with a cached teacher, distill/teacher_top_k (its K: the divergences
are then lower bounds of the whole vocabulary's).
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
from .on_policy import ON_POLICY, OnPolicy
from .teacher import LiveTeacher, TeacherSource, host_targets


class DistillLoss:
    """Distillation's loss of one micro-batch and the sums of its terms. `teacher` scores the
    data's batches (live or cached), `live` the student's own samples (--lmbda)."""

    def __init__(
        self,
        teacher: TeacherSource,
        settings: DistillSettings,
        *,
        chunking: LossChunking,
        device: torch.device,
        autocast: Callable[[], Any],
        live: TeacherSource | None = None,
        cached_top_k: int | None = None,
    ) -> None:
        self.teacher = teacher
        self.live = live
        # The cached teacher's K: its divergences are over K + 1 outcomes, a lower bound of the
        # whole vocabulary's (loss.py), and the log says so beside them.
        self.cached_top_k = cached_top_k
        self.settings = settings
        self.chunking = chunking
        self.device = device
        self.autocast = autocast

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the summed loss of the batch's targets, differentiable; the sums of `TERMS` [4]
        fp64). The teacher first: under no_grad, its activations are freed before the
        student's. Call `release` after the backward."""
        sampled = ON_POLICY in batch
        teacher = self.live if sampled else self.teacher
        assert teacher is not None, "the student's own samples need the live teacher"
        per_target = teacher.per_target(batch, host_targets(batch))
        settings = self.settings

        def loss_of_hidden(head: nn.Module, hidden: torch.Tensor, targets: Targets) -> torch.Tensor:
            compute = teacher.terms(settings, (head, self.chunking.transform))
            return chunked_over_targets(
                compute, hidden, targets, chunk_size=self.chunking.chunk_size,
                per_target=per_target,
            )  # fmt: skip

        _, terms, _ = forward_target_chunks(
            model, batch, self.device, self.autocast, loss_of_hidden
        )
        # The student's own samples: the divergence alone, at its full weight (TRL's GKD)
        weights = (1.0, 0.0) if sampled else (settings.alpha, 1.0 - settings.alpha)
        objective = (weights[0] * terms[:, 1] + weights[1] * terms[:, 0]).sum()
        return objective, terms.detach().sum(dim=0).to(torch.float64)

    def release(self) -> None:
        """After the backward (or an evaluation batch): the live teacher's gathered root."""
        for teacher in (self.teacher, self.live):
            if teacher is not None:
                teacher.release()


class DistillStep(TrainStep):
    """TrainStep with distillation's loss: `forward_backward` returns the summed loss of its
    targets, normalised by the step's targets as TrainStep's, and the step's metrics carry
    the terms' means over them (on checked steps: one more all-reduce)."""

    def __init__(
        self,
        *args: Any,
        distill_loss: DistillLoss,
        on_policy: OnPolicy | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.distill_loss = distill_loss
        self.on_policy = on_policy
        self._sums = torch.zeros(len(TERMS), dtype=torch.float64, device=self.device)

    def __call__(
        self,
        micro_batches: list[Batch],
        *,
        step: int,
        global_counts: list[float] | None = None,
        check: bool = True,
    ) -> dict[str, Any]:
        sampled = self.on_policy is not None and self.on_policy.takes(step)
        if sampled:  # the student's completions of the batches' prompts (--lmbda)
            assert self.on_policy is not None
            micro_batches = self.on_policy.sample(micro_batches, step)
            global_counts = None  # the completions' targets, reduced anew
        self._sums.zero_()
        targets = self.local_counts(micro_batches)[0]
        metrics = super().__call__(
            micro_batches, step=step, global_counts=global_counts, check=check
        )
        if check:
            reduced = torch.cat([self._sums, self._sums.new_tensor([targets])])
            *sums, total = dist_utils.all_reduce_sum(reduced).tolist()
            metrics["logged"] = term_means(sums, total)
            if self.on_policy is not None:
                metrics["logged"]["distill/on_policy"] = float(sampled)
            if self.distill_loss.cached_top_k and not sampled:
                metrics["logged"]["distill/teacher_top_k"] = self.distill_loss.cached_top_k
        return metrics

    def forward_backward(self, batch: Batch, global_targets: float) -> torch.Tensor:
        try:
            objective, sums = self.distill_loss(self.model, batch)
            self._sums += sums
            self.backward(objective, global_targets)
        finally:
            self.distill_loss.release()
        return objective.detach().to(torch.float64)


class TeacherPassStep(TrainStep):
    """The step the memory planner traces for the teacher's job of its own
    (--teacher_cache_only): per micro-batch the teacher's forward and the top K of each chunk,
    as the cache pass computes them; nothing trained, so the optimizer creates no state."""

    def __init__(
        self, *args: Any, teacher: LiveTeacher, top_k: Callable[..., Any], **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.teacher = teacher
        self.top_k = top_k

    def forward_backward(self, batch: Batch, global_targets: float) -> torch.Tensor:
        self.top_k(batch)
        return torch.zeros((), dtype=torch.float64, device=self.device)


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
    on_policy: OnPolicy | None = None,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    grad_scaler: bool = True,
) -> DistillStep:
    """`train.step.build_train_step` for --method distill (no router loss: the load-balancing
    term of mixture-of-experts students is left out of the objective, as with DPO)."""
    step = build_train_step(
        model, config, world_size=world_size, device=device, hf_config=hf_config,
        autocast=autocast, grad_scaler=grad_scaler, step_class=DistillStep, router_loss=None,
        chunking=chunking, distill_loss=distill_loss, on_policy=on_policy,
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
                distill_loss.release()
            totals[0] += objective.to(torch.float64)
            totals[1:-1] += sums
            totals[-1] += float(host_targets(batch).rows.numel())
    loss_sum, *term_sums, count = dist_utils.all_reduce_sum(totals).tolist()
    if count == 0:
        return None
    bound = distill_loss.cached_top_k
    return {
        "eval_loss": loss_sum / count,
        **term_means(term_sums, count, prefix="eval_"),
        **({"eval_distill/teacher_top_k": bound} if bound else {}),
        "eval_tokens": int(count),
    }
