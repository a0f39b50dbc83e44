"""The GRPO step: the rollout phase, then TrainStep's update (micro-batches, gradient sync,
clipping, the non-finite checks, the optimizer) with GRPO's loss in place of the token loss.

    __call__(prompt micro-batches, step)
        rollout     the step's prompts sampled and scored (`Rollouts.sample`), or reused
                    (--num_iterations: the same batch's later steps); a stop request between
                    its micro-batches, or after it, ends the step here (StepInterrupted)
        logps       at the rollout's weights, without gradients: the `old` log-probabilities
                    (--num_iterations > 1) and the reference's (--beta > 0), once per batch
        update      TrainStep's loop over the teacher-forced completions: `forward_backward`
                    is GRPO's loss (loss.py), normalised by the step's count (`normalizer`)
        metrics     TRL's names: reward, reward_std, rewards/<f>/mean|std,
                    frac_reward_zero_std, completions/*, kl, entropy, clip_ratio/*; and the
                    rollout's and the update's seconds and tokens/s
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.parallelize import no_grad_pass
from fsdp_utils.train.loss import LossChunking
from fsdp_utils.train.step import Batch, StepInterrupted, TrainStep, token_logprobs_and_entropy

from .loss import METRIC_SUMS, GrpoSettings, metric_sums, normalizer, objective, per_token_terms
from .rollouts import (
    ADVANTAGES,
    BUFFER_FILE,
    LOSS_MASK,
    OLD_LOGPS,
    REF_LOGPS,
    Rollouts,
    prompt_indices,
)

# The reference's log-probabilities of a batch ([rows, seq - 1], at the sampling temperature),
# without gradients; None: --beta 0, no reference.
ReferenceLogps = Callable[[Batch], torch.Tensor]


def _sequence_tokens(batch: Batch) -> int:
    """Prompt and completion tokens of a teacher-forced batch (right-padded: each row ends at
    its completion's last token, the last label that is not ignored)."""
    labelled = batch["labels"] != -100
    ends = labelled.shape[1] - labelled.flip(1).int().argmax(dim=1)
    return int(ends.sum())


def _logged_text(value: Any, width: int = 200) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else "..." + text[-width:]


class GrpoUpdate(TrainStep):
    """TrainStep with GRPO's loss: its micro-batches are teacher-forced completions with their
    advantages, loss mask and stored log-probabilities (`Rollouts.training_batches`)."""

    def __init__(
        self, *args: Any, settings: GrpoSettings, temperature: float, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.temperature = temperature
        self._sums = torch.zeros(len(METRIC_SUMS), dtype=torch.float64, device=self.device)

    def forward_backward(self, batch: Batch, global_targets: float) -> torch.Tensor:
        logps, entropy = token_logprobs_and_entropy(
            self.model, batch, chunking=self.chunking, device=self.device,
            autocast=self.autocast, temperature=self.temperature,
        )  # fmt: skip
        device = logps.device
        mask = batch[LOSS_MASK].to(device)
        advantages = batch[ADVANTAGES].to(device)
        old = batch[OLD_LOGPS].to(device) if OLD_LOGPS in batch else None
        ref = batch[REF_LOGPS].to(device) if REF_LOGPS in batch else None
        terms = per_token_terms(logps, old, advantages, mask, self.settings, ref_logps=ref)
        part = objective(terms.loss, mask, self.settings)
        self._sums += metric_sums(terms, advantages, mask, entropy, self.settings).to(self._sums)
        # As TrainStep's: the gradient average over ranks times the world size is their sum,
        # divided by the step's count (`global_targets` is GRPO's normalizer here).
        loss = part * (self.world_size / max(global_targets, 1.0))
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()
        return part.detach().to(torch.float64)

    def _update_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        tokens, ratios = max(sums["tokens"], 1.0), max(sums["ratio_count"], 1.0)
        out = {
            "entropy": sums["entropy"] / tokens,
            "clip_ratio/low_mean": sums["clip_low"] / ratios,
            "clip_ratio/high_mean": sums["clip_high"] / ratios,
            "clip_ratio/region_mean": sums["clip_region"] / ratios,
        }
        if self.settings.beta != 0.0:
            out["kl"] = sums["kl"] / tokens
        return out


class PlannedUpdate(GrpoUpdate):
    """The update the memory planner traces (fsdp_utils/plan/estimate.py): its placeholder
    micro-batches (G full-length sequences per prompt, every position a target: the most an
    update holds) get the fields a rollout would give them, on the planner's fake tensors."""

    def __call__(self, micro_batches: list[Batch], **kwargs: Any) -> dict[str, Any]:
        batches = []
        for batch in micro_batches:
            labels = batch["labels"]
            mask = labels[:, 1:] != -100
            full = {**batch, LOSS_MASK: mask, ADVANTAGES: torch.zeros(labels.shape[0])}
            shape = mask.shape
            if self.config.num_iterations > 1:
                full[OLD_LOGPS] = torch.zeros(shape)
            if self.settings.beta != 0.0:
                full[REF_LOGPS] = torch.zeros(shape)
            batches.append(full)
        return super().__call__(batches, **kwargs)


class GrpoStep(GrpoUpdate):
    """The run's step: GRPO's rollout phase, then the update with GRPO's loss."""

    def __init__(
        self,
        *args: Any,
        rollouts: Rollouts,
        reference: ReferenceLogps | None,
        completions_log: Path | None,
        log_completions_every: int,
        log: Callable[[str], None],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.rollouts = rollouts
        self.reference = reference
        self.completions_log = completions_log
        self.log_completions_every = log_completions_every
        self.log = log

    # --- the step ----------------------------------------------------------------------------

    def __call__(self, micro_batches: list[Batch], **kwargs: Any) -> dict[str, Any]:
        step = int(kwargs["step"])
        micro = prompt_indices(micro_batches)
        first = (step - 1) % self.rollouts.num_iterations == 0
        if not first and self.rollouts.buffer is None:
            raise RuntimeError(
                f"step {step} reuses its batch's rollouts (--num_iterations "
                f"{self.rollouts.num_iterations}), and none are held: a checkpoint saved between "
                "the iterations of a batch keeps them (grpo_rollouts.pt); was it removed?"
            )
        seconds = self.rollouts.sample(step, micro) if first else 0.0
        # Asked again between the rollout and the update (after the last micro-batch).
        if first and (reason := self.rollouts.stop()) is not None:
            raise StepInterrupted(reason, f"step {step}, between its rollout and its update")
        stats, advantages = self.rollouts.statistics(micro, seconds)
        for note in stats.engine_notes:  # every rank's restarts, said once
            self.log(f"step {step}: {note}")
        logps_started = time.perf_counter()
        self._fill_logps(micro, advantages)
        batches = self.rollouts.training_batches(micro, advantages)
        # The step's counts, over every rank: what the loss is normalised by, and its tokens.
        local = [
            float(sum(len(b[ADVANTAGES]) for b in batches)),
            float(sum(int(b[LOSS_MASK].sum()) for b in batches)),
            float(len(batches)),
            float(sum(_sequence_tokens(b) for b in batches)),
        ]
        completions, tokens, micro_count, trained = dist_utils.all_reduce_host_sum(local)
        count = normalizer(
            self.settings, completions=completions, tokens=tokens, micro_batches=micro_count
        )
        self._sums.zero_()
        update_started = time.perf_counter()
        metrics = super().__call__(
            batches, step=step, global_counts=[count, trained], check=kwargs.get("check", True)
        )
        update_seconds = time.perf_counter() - update_started
        logps_seconds = update_started - logps_started
        self.rollouts.finished(step)
        logged = stats.as_metrics(self.rollouts.names) if first else {}
        if kwargs.get("check", True):  # one more all-reduce, on checked (logged) steps only
            sums = dict(
                zip(
                    METRIC_SUMS, dist_utils.all_reduce_sum(self._sums.clone()).tolist(), strict=True
                )
            )
            logged.update(self._update_metrics(sums))
            logged["update/seconds"] = update_seconds + logps_seconds
            logged["update/tokens_per_s"] = trained / max(update_seconds + logps_seconds, 1e-9)
        metrics["logged"] = logged
        batch_number = (step - 1) // self.rollouts.num_iterations
        every = self.log_completions_every
        if first and every and batch_number % every == 0:
            self._log_completions(step, stats.as_metrics(self.rollouts.names))
        return metrics

    def _fill_logps(self, micro: list[list[int]], advantages: dict[int, list[float]]) -> None:
        """Collective: the log-probabilities the loss needs beside the policy's, at the weights
        the completions were sampled with, into the buffer once per batch: the old ones (only
        when the batch is trained on more than once: on one step they equal the policy's own,
        detached, as TRL takes them) and the reference's."""
        wanted: list[tuple[str, ReferenceLogps]] = []
        if self.rollouts.num_iterations > 1 and self.rollouts.lacks(micro, "old_logps"):
            wanted.append(("old_logps", self._policy_logps))
        if self.reference is not None and self.rollouts.lacks(micro, "ref_logps"):
            wanted.append(("ref_logps", self.reference))
        if not wanted:
            return
        batches = self.rollouts.training_batches(micro, advantages)
        for attr, logps in wanted:
            self.rollouts.store_logps(micro, attr, [logps(b).float().cpu() for b in batches])

    def _policy_logps(self, batch: Batch) -> torch.Tensor:
        with no_grad_pass(self.model):
            return token_logprobs_and_entropy(
                self.model, batch, chunking=self.chunking, device=self.device,
                autocast=self.autocast, temperature=self.temperature,
            )[0]  # fmt: skip

    def local_counts(self, batches: list[Batch]) -> list[float]:
        """The prompts and their tokens: the trainer's stop poll carries them, unused (the
        step counts its completions after the rollout)."""
        return [float(sum(len(b[next(iter(b))]) for b in batches)), 0.0]

    # --- the log of completions ----------------------------------------------------------------

    def _log_completions(self, step: int, metrics: dict[str, float]) -> None:
        """Rank 0's first completions of the step, with their rewards: completions.jsonl, and
        the first one in the log."""
        if self.completions_log is None or not self.rollouts.last_texts:
            return
        names = self.rollouts.names
        with open(self.completions_log, "a", encoding="utf-8") as f:
            for entry in self.rollouts.last_texts:
                scored = zip(names, entry["rewards"], strict=True)
                record = {"step": step, "prompt": entry["prompt"], "completion": entry["completion"],
                          "rewards": {k: (None if v != v else v) for k, v in scored}}  # fmt: skip
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        entry = self.rollouts.last_texts[0]
        shown = ", ".join(f"{n} {v:.3g}" for n, v in zip(names, entry["rewards"], strict=True))
        self.log(
            f"completion at step {step}: {_logged_text(entry['prompt'], 80)} -> "
            f"{_logged_text(entry['completion'])} [{shown}] (the step's reward mean "
            f"{metrics.get('reward', float('nan')):.3f})"
        )

    # --- the checkpoint ---------------------------------------------------------------------------

    def checkpoint_files(self) -> dict[str, Any]:
        state = self.rollouts.checkpoint_state()
        return {BUFFER_FILE: state} if state is not None else {}

    def resume(
        self, saved: dict[str, Any], start_step: int, *, folder: Path | None = None
    ) -> list[str]:
        changes = super().resume(saved, start_step, folder=folder)
        path = folder / BUFFER_FILE if folder is not None else None
        state = (
            torch.load(path, weights_only=False) if path is not None and path.is_file() else None
        )
        self.rollouts.restore(state)
        if state is not None:
            done = len(state["prompts"])
            self.log(
                f"grpo: the checkpoint holds the rollouts of {done} prompts of step "
                f"{start_step + 1}'s batch: they are not sampled again"
            )
        return changes


def reference_logps(
    model: nn.Module,
    *,
    chunking: LossChunking,
    device: torch.device,
    autocast: Callable[[], Any],
    temperature: float,
    context: Callable[[], Any],
) -> ReferenceLogps:
    """The reference's log-probabilities of a batch: `model` (the frozen copy, or the policy)
    inside `context` (its adapters off under LoRA), without gradients, in eval mode."""

    def logps(batch: Batch) -> torch.Tensor:
        with no_grad_pass(model), context():
            return token_logprobs_and_entropy(
                model, batch, chunking=chunking, device=device, autocast=autocast,
                temperature=temperature,
            )[0]  # fmt: skip

    return logps
