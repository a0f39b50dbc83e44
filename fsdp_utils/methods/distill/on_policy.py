"""`--lmbda`: on-policy distillation (GKD, arXiv 2306.13649; TRL GKDTrainer's `lmbda`): on a
share of the optimizer steps the student samples the completions of its micro-batches' prompts
itself, and the live teacher scores every sampled token (the loss is the divergence alone: the
cross-entropy of the student's own samples would only reinforce them).

The samples come from the rollout machinery the methods share (fsdp_utils/parallel/generate.py's
`PolicyEngine`: the sharded student with a KV cache, its shard groups gathered once for the
whole rollout phase), at --distill_temperature, at most --distill_max_new_tokens tokens, ended
by the data's stop tokens (EOS, the chat template's end of turn). Everything is a function of
the run's seed and the step, never of the world size or of which rank a block lands on:

- whether a step is on-policy: `row_seed(seed, "lmbda", step)` against lmbda (TRL draws
  `random.random() <= lmbda` per micro-batch and process; here every rank and every leg of a
  resumed run takes the same decision);
- each row's samples: a generator seeded with `row_seed(seed, "on_policy", step, block)`, so the
  same block samples the same completion on 1 process or 2 (`continue_prompts`).

A prompt is a block's tokens up to its first target (the answer's first token): the data must
be prompts and answers (prompt/completion, chat or instruction rows), one per block
(--no_packing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_utils.data.blocks import IGNORE_INDEX, next_token_labels
from fsdp_utils.parallel.generate import PolicyEngine, RolloutSettings, Sampling, row_seed
from fsdp_utils.train.step import Batch

from .cache import BLOCK_ROWS

# The key of a batch the student sampled: its loss is the divergence alone, from the live teacher.
ON_POLICY = "on_policy"


def on_policy_step(seed: int, step: int, lmbda: float) -> bool:
    """Whether optimizer step `step` (1-based) trains on the student's own samples."""
    if lmbda <= 0:
        return False
    return row_seed(seed, "lmbda", step) / 2**63 < lmbda


def prompts_of(batch: Batch) -> list[list[int]]:
    """Each row's tokens up to its first target (its prompt: the answer's first token next)."""
    following = next_token_labels(batch)
    prompts = []
    for row, labels in zip(batch["input_ids"].tolist(), following.tolist(), strict=True):
        first = next((t for t, label in enumerate(labels) if label != IGNORE_INDEX), None)
        assert first is not None, "a block without an answer token"
        prompts.append(row[: first + 1])
    return prompts


def describe_data_problem(spec: dict[str, Any]) -> str | None:
    """Why prepared data (its meta.json's spec) cannot give prompts, or None."""
    if "masked" not in spec:
        return (
            "its rows have no prompt: chess games and plain text carry a loss on every token. "
            "Use prompt/completion, chat or instruction rows"
        )
    if spec.get("packing", True):
        return "its blocks pack several rows: add --no_packing (one prompt and answer per block)"
    if spec["masked"].get("train_on_prompt"):
        return "--train_on_prompt puts the prompt among the targets: drop it"
    return None


class OnPolicy:
    """The on-policy steps of a run: which steps, and their micro-batches sampled."""

    def __init__(
        self,
        model: nn.Module,
        *,
        seed: int,
        lmbda: float,
        settings: RolloutSettings,
        device: torch.device,
        autocast: Callable[[], Any] | None,
    ) -> None:
        self.seed = seed
        self.lmbda = lmbda
        self.pad_token_id = settings.pad_token_id
        self.engine = PolicyEngine(model, settings, device=device, autocast=autocast)

    @classmethod
    def settings(
        cls, *, max_new_tokens: int, stop_token_ids: Sequence[int], pad_token_id: int,
        temperature: float,
    ) -> RolloutSettings:  # fmt: skip
        """Plain sampling at `temperature` (TRL GKD's: top_k 0, top_p 1)."""
        return RolloutSettings(
            max_new_tokens, tuple(stop_token_ids), pad_token_id, Sampling(temperature)
        )

    def takes(self, step: int) -> bool:
        return on_policy_step(self.seed, step, self.lmbda)

    def sample(self, micro_batches: list[Batch], step: int) -> list[Batch]:
        """Collective: each micro-batch's prompts with the student's completions, as batches
        the step trains on (labels on the completions only, `ON_POLICY` set)."""
        out = []
        with self.engine.rollout_phase():
            for batch in micro_batches:
                seeds = [row_seed(self.seed, "on_policy", step, int(b)) for b in batch[BLOCK_ROWS]]
                rollout = self.engine.generate(prompts_of(batch), seeds)
                sampled = rollout.training_batch(self.pad_token_id)
                sampled[ON_POLICY] = torch.ones(len(rollout))
                out.append(sampled)
        return out
