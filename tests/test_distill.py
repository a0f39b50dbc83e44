"""Distillation (fsdp_utils/methods/distill/): the losses against TRL's formula and a direct
computation on full logits, in chunks and not, from a cached top K and live; then real runs
(2 processes, FSDP2, gloo): live against cached, 1 against 2 processes, a resume, a teacher
cache stopped half-way, a student that learns the teacher's pattern better than SFT does, and
the user's mistakes (exit 2, one paragraph).

One torchrun of 2 processes (`runs`, through tests/trainer_runs.py) and one single process
feed the end-to-end checks.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdp_utils.data.blocks import IGNORE_INDEX
from fsdp_utils.methods.distill.loss import (
    TERMS,
    DistillSettings,
    cached_terms,
    divergence,
    live_terms,
    teacher_top_k,
)
from fsdp_utils.train.loss import Targets, chunked_over_targets

# --- TRL's generalized JSD, copied as the independent reference ------------------------------
# From https://github.com/huggingface/trl/blob/v1.9.0/trl/experimental/gkd/gkd_trainer.py
# (commit a785283c0ea7395092fc5bd60fc38e7f4d972003, lines 239-323: the static method
# GKDTrainer.generalized_jsd_loss; unchanged on main as of July 2026), its arithmetic unchanged,
# the reductions but "sum" left out. TRL itself is not a test dependency: its datasets>=4.7
# cannot install beside the datasets floor (3.0) that `make test-floor` tests.


def trl_generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> torch.Tensor:
    student_logits = student_logits / temperature
    teacher_logits = teacher_logits / temperature
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta_t = torch.tensor(beta, dtype=student_log_probs.dtype, device=student_log_probs.device)
        mixture_log_probs = torch.logsumexp(
            torch.stack(
                [student_log_probs + torch.log1p(-beta_t), teacher_log_probs + torch.log(beta_t)]
            ),
            dim=0,
        )
        kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
        jsd = beta_t * kl_teacher + (1 - beta_t) * kl_student
    if labels is not None:
        mask = labels != -100
        jsd = jsd[mask]
    return jsd.sum()  # reduction="sum"


def _direct(student: torch.Tensor, teacher: torch.Tensor, loss: str, beta: float, t: float) -> torch.Tensor:
    """[tokens] the divergence written out from the softmaxes, no library KL."""
    q, p = torch.softmax(student / t, -1), torch.softmax(teacher / t, -1)
    if loss == "forward_kl":
        return (p * (p.log() - q.log())).sum(-1)
    if loss == "reverse_kl":
        return (q * (q.log() - p.log())).sum(-1)
    m = beta * p + (1 - beta) * q
    return beta * (p * (p.log() - m.log())).sum(-1) + (1 - beta) * (q * (q.log() - m.log())).sum(-1)


LOSSES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.2)]


@pytest.mark.parametrize(("loss", "beta"), LOSSES)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_each_divergence_equals_trls_and_the_direct_formula(loss, beta, temperature):
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(3, 7, 50, generator=gen, dtype=torch.float64) * 2
    teacher = torch.randn(3, 7, 50, generator=gen, dtype=torch.float64) * 3
    labels = torch.randint(0, 50, (3, 7), generator=gen)
    labels[0, :3] = IGNORE_INDEX
    settings = DistillSettings(loss, beta, temperature)
    expected = trl_generalized_jsd_loss(student, teacher, labels, settings.trl_beta, temperature)
    mask = labels != IGNORE_INDEX
    s_log = torch.log_softmax(student[mask] / temperature, -1)
    t_log = torch.log_softmax(teacher[mask] / temperature, -1)
    ours = divergence(s_log, t_log, loss, beta)
    assert ours.sum().item() == pytest.approx(expected.item(), rel=1e-12)
    direct = _direct(student[mask], teacher[mask], loss, beta, temperature)
    torch.testing.assert_close(ours, direct, rtol=1e-10, atol=1e-12)
    assert (ours > 0).all()


class _Heads:
    """A student and a teacher output layer over a shared vocabulary of 40 (the teacher's
    wider: 44 rows, as Qwen2.5's 7B beside its 0.5B), and hidden states of 13 targets."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.student = nn.Linear(8, 40, bias=False).double()
        self.teacher = nn.Linear(12, 44, bias=False).double()
        with torch.no_grad():
            self.student.weight.copy_(torch.randn(40, 8, generator=gen, dtype=torch.float64))
            self.teacher.weight.copy_(2 * torch.randn(44, 12, generator=gen, dtype=torch.float64))
        self.teacher.requires_grad_(False)  # frozen, as the run's teacher
        self.hidden = torch.randn(13, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        self.teacher_hidden = torch.randn(13, 12, generator=gen, dtype=torch.float64)
        self.tokens = torch.randint(0, 40, (13,), generator=gen)


def _full_logits_terms(h: _Heads, settings: DistillSettings) -> torch.Tensor:
    """[13, TERMS] straight from the full logits: the test's own unchunked computation."""
    logits = h.student(h.hidden)
    teacher = h.teacher(h.teacher_hidden)[:, :40]
    ce = F.cross_entropy(logits, h.tokens, reduction="none")
    div = _direct(logits, teacher, settings.loss, settings.beta, settings.temperature)
    kl = _direct(logits, teacher, "forward_kl", 0.5, settings.temperature)
    agree = (logits.argmax(-1) == teacher.argmax(-1)).double()
    return torch.stack([ce, div, kl, agree], dim=1)


def _chunked(h: _Heads, compute: Any, chunk: int, per_target: tuple[torch.Tensor, ...]) -> torch.Tensor:
    # All 13 rows of a [1, 13, hidden] batch are targets, in order.
    targets = Targets(rows=torch.arange(13), shifted=torch.arange(13), tokens=h.tokens)
    return chunked_over_targets(
        compute, h.hidden.unsqueeze(0), targets, chunk_size=chunk, per_target=per_target
    )


@pytest.mark.parametrize(("loss", "beta"), LOSSES)
def test_chunked_live_terms_and_gradients_equal_the_full_logits(loss, beta):
    h = _Heads()
    settings = DistillSettings(loss, beta, temperature=1.5, alpha=0.3, vocab=40)
    expected = _full_logits_terms(h, settings)
    weights = torch.tensor([0.7, 0.3, 0.0, 0.0], dtype=torch.float64)
    (expected * weights).sum().backward()
    grads = (h.hidden.grad.clone(), h.student.weight.grad.clone())
    compute = functools.partial(live_terms, settings, (h.student, None), (h.teacher, None))
    for chunk in (1, 4, 13):  # checkpointed chunks recomputed in backward, and one chunk
        h.hidden.grad = h.student.weight.grad = None
        terms = _chunked(h, compute, chunk, (h.teacher_hidden,))
        torch.testing.assert_close(terms, expected, rtol=1e-10, atol=1e-12)
        (terms * weights).sum().backward()
        torch.testing.assert_close(h.hidden.grad, grads[0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(h.student.weight.grad, grads[1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("loss", "beta"), LOSSES)
def test_a_cache_of_the_whole_vocabulary_equals_the_live_teacher(loss, beta):
    """K = vocabulary: the cached terms (and gradients) are the live ones; a smaller K is exact
    over its tokens and never above the whole vocabulary's divergence (data processing)."""
    h = _Heads()
    settings = DistillSettings(loss, beta, temperature=1.5, alpha=0.3, vocab=40)
    live = functools.partial(live_terms, settings, (h.student, None), (h.teacher, None))
    expected = _chunked(h, live, 5, (h.teacher_hidden,))
    expected[:, :2].sum().backward()
    grad = h.hidden.grad.clone()
    h.hidden.grad = None
    cached = functools.partial(cached_terms, settings, (h.student, None))
    for k in (40, 6):
        entries = teacher_top_k(
            (h.teacher, None), h.teacher_hidden, k=k, temperature=1.5, vocab=40
        )
        terms = _chunked(h, cached, 5, entries)
        if k == 40:
            torch.testing.assert_close(terms, expected, rtol=1e-9, atol=1e-9)
            terms[:, :2].sum().backward()
            torch.testing.assert_close(h.hidden.grad, grad, rtol=1e-9, atol=1e-9)
        else:
            assert (terms[:, 1] <= expected[:, 1] + 1e-12).all()
            assert (terms[:, 1] < expected[:, 1] - 1e-6).any()
            torch.testing.assert_close(terms[:, 0], expected[:, 0])  # the labels' CE
            ids, top, rest = entries
            assert (top[:, :-1] >= top[:, 1:]).all()  # most likely first
            total = torch.logsumexp(torch.cat([top, rest[:, None]], 1), dim=1)
            torch.testing.assert_close(total, torch.zeros(13, dtype=torch.float64))


def test_the_terms_are_named_in_the_order_the_chunks_return_them():
    assert TERMS == ("ce", "divergence", "teacher_kl", "top1_agreement")
