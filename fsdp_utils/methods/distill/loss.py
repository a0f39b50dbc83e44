"""Distillation's losses, per target token, from a chunk of the student's logits and the
teacher's distribution over the same tokens: its logits (a live teacher) or its cached top-K
log-probabilities (`cache.py`).

With p the teacher's and q the student's softmax at temperature T (both logits divided by T),
TRL's `GKDTrainer.generalized_jsd_loss` definitions (trl v1.9.0,
trl/experimental/gkd/gkd_trainer.py lines 239-323, unchanged at its July 2026 main):

    forward_kl   KL(p || q) = sum_v p_v (log p_v - log q_v)                    (TRL's beta 0)
    reverse_kl   KL(q || p) = sum_v q_v (log q_v - log p_v)                    (TRL's beta 1)
    jsd          beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q

and the token's loss is alpha * divergence + (1 - alpha) * cross-entropy of the label (at
temperature 1, over the student's whole output layer). TRL's trainer passes no temperature to
the loss (its `temperature` samples the student's completions); GKD's paper and torchtune's
KD losses have none either, so the divergence is not multiplied by T^2 as in Hinton et al.

A cached teacher gives only its K most likely tokens and the log of the mass of all the
others. The divergence is then that of the two distributions over K + 1 outcomes (each of the
K tokens, and "any other token"): exact over the top K, and by the data-processing inequality
never above the divergence over the whole vocabulary, with which it agrees when the rest's
mass is 0 (K = vocabulary: tests/test_distill.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.train.loss import LogitTransform

# The per-token terms every chunk returns, in this order (their sums are the logged metrics):
# the label's cross-entropy, the training divergence, KL(teacher || student) at T (the
# divergence itself for forward_kl) and whether the two models' most likely tokens agree.
TERMS = ("ce", "divergence", "teacher_kl", "top1_agreement")
# The log of the mass an empty "other tokens" bucket is given: log 0 would make 0 * -inf.
_LOG_TINY = math.log(1e-30)
_FLOOR = -1e30


@dataclass(frozen=True)
class DistillSettings:
    loss: str = "forward_kl"  # forward_kl | reverse_kl | jsd
    beta: float = 0.5  # jsd's teacher weight
    temperature: float = 1.0
    alpha: float = 0.5  # the divergence's weight; the label's cross-entropy gets 1 - alpha
    vocab: int | None = None  # output columns both models read (None: all)

    @classmethod
    def of(cls, config: TrainConfig, vocab: int | None) -> DistillSettings:
        return cls(
            config.distill_loss,
            config.distill_beta,
            config.distill_temperature,
            config.distill_alpha,
            vocab,
        )

    @property
    def trl_beta(self) -> float:
        """The same loss as TRL's `beta`."""
        return {"forward_kl": 0.0, "reverse_kl": 1.0}.get(self.loss, self.beta)

    def describe(self) -> str:
        name = f"jsd (beta {self.beta:g})" if self.loss == "jsd" else self.loss
        return (
            f"{name} at temperature {self.temperature:g}, alpha {self.alpha:g} (loss = "
            f"{self.alpha:g} x divergence + {1 - self.alpha:g} x cross-entropy on the labels)"
        )


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dimension from log-probabilities, as TRL computes it
    (`F.kl_div(q, p, log_target=True)`)."""
    return F.kl_div(q_log, p_log, reduction="none", log_target=True).sum(-1)


def divergence(
    student_log: torch.Tensor, teacher_log: torch.Tensor, loss: str, beta: float
) -> torch.Tensor:
    """[tokens] the divergence `loss` between two log-distributions [tokens, outcomes]."""
    if loss == "forward_kl":
        return kl(teacher_log, student_log)
    if loss == "reverse_kl":
        return kl(student_log, teacher_log)
    assert loss == "jsd", loss
    mixture = torch.logsumexp(
        torch.stack([student_log + math.log1p(-beta), teacher_log + math.log(beta)]), dim=0
    )
    return beta * kl(teacher_log, mixture) + (1 - beta) * kl(student_log, mixture)


def _logits(
    head: nn.Module, transform: LogitTransform | None, hidden: torch.Tensor
) -> torch.Tensor:
    logits = head(hidden)
    logits = transform(logits) if transform is not None else logits
    # fp32 as the token loss (bf16 logits do not cost accuracy in the loss); fp64 stays
    return logits if logits.dtype == torch.float64 else logits.float()


def _terms(
    settings: DistillSettings,
    nll: torch.Tensor,
    student_log: torch.Tensor,
    teacher_log: torch.Tensor,
    agree: torch.Tensor,
) -> torch.Tensor:
    div = divergence(student_log, teacher_log, settings.loss, settings.beta)
    if settings.loss == "forward_kl":
        teacher_kl = div.detach()
    else:
        with torch.no_grad():
            teacher_kl = kl(teacher_log, student_log)
    return torch.stack([nll, div, teacher_kl, agree.to(nll.dtype)], dim=1)


def live_terms(
    settings: DistillSettings,
    student: tuple[nn.Module, LogitTransform | None],
    teacher: tuple[nn.Module, LogitTransform | None],
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    teacher_hidden: torch.Tensor,
) -> torch.Tensor:
    """[chunk, TERMS] from the student's and the teacher's last hidden states of the chunk's
    target positions, through each model's output layer (and logit transform)."""
    logits = _logits(*student, hidden)
    nll = F.cross_entropy(logits, tokens, reduction="none")
    shown = logits[:, : settings.vocab]
    with torch.no_grad():
        teacher_logits = _logits(*teacher, teacher_hidden)[:, : settings.vocab]
        teacher_log = torch.log_softmax(teacher_logits / settings.temperature, dim=-1)
        agree = shown.detach().argmax(-1) == teacher_logits.argmax(-1)
    student_log = torch.log_softmax(shown / settings.temperature, dim=-1)
    return _terms(settings, nll, student_log, teacher_log, agree)


def top_k_buckets(log_probs: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[tokens, K + 1] log-probabilities of the tokens `ids` [tokens, K] and of all the others
    together, from one model's log-softmax and its logits (the rest's mass is summed from the
    logits it leaves out, not as 1 - the top K's, which would cancel to noise)."""
    top = log_probs.gather(1, ids)
    # A finite floor rather than -inf: with K = vocabulary no token is left, and logsumexp's
    # gradient over only -inf entries is NaN (0 x NaN is still NaN after the clamp below)
    others = logits.scatter(1, ids, _FLOOR)
    rest = torch.logsumexp(others, dim=-1) - torch.logsumexp(logits, dim=-1)
    return torch.cat([top, rest.clamp_min(_LOG_TINY).unsqueeze(1)], dim=1)


def cached_terms(
    settings: DistillSettings,
    student: tuple[nn.Module, LogitTransform | None],
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    ids: torch.Tensor,
    top_log: torch.Tensor,
    rest_log: torch.Tensor,
) -> torch.Tensor:
    """[chunk, TERMS] from the student's last hidden states and the teacher's cached top-K
    (ids [chunk, K] sorted most likely first, their log-probabilities at the run's temperature,
    the log of the others' mass [chunk])."""
    logits = _logits(*student, hidden)
    nll = F.cross_entropy(logits, tokens, reduction="none")
    scaled = logits[:, : settings.vocab] / settings.temperature
    ids = ids.long()
    student_log = top_k_buckets(torch.log_softmax(scaled, dim=-1), scaled, ids)
    rest_log = rest_log.to(scaled.dtype).clamp_min(_LOG_TINY)
    teacher_log = torch.cat([top_log.to(scaled.dtype), rest_log[:, None]], dim=1)
    agree = scaled.detach().argmax(-1) == ids[:, 0]
    return _terms(settings, nll, student_log, teacher_log, agree)


@torch.no_grad()
def teacher_top_k(
    teacher: tuple[nn.Module, LogitTransform | None],
    hidden: torch.Tensor,
    *,
    k: int,
    temperature: float,
    vocab: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cache's entries of a chunk of target positions: the teacher's K most likely tokens
    (int32, most likely first), their log-probabilities at `temperature` and the log of the
    others' mass (float32)."""
    scaled = _logits(*teacher, hidden)[:, :vocab] / temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    top, ids = torch.topk(log_probs, min(k, scaled.shape[-1]), dim=-1)
    rest = top_k_buckets(log_probs, scaled, ids)[:, -1]
    return ids.int(), top, rest
