"""Supervised fine-tuning (`--method sft`, the default): the causal-LM loss on the target tokens
(every token of chess and text, the answers of the masked formats), normalised by the step's
target tokens: `fsdp_utils.train.step.TrainStep` as it is, with the router loss of
mixture-of-experts models."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from fsdp_utils.data.blocks import TokenBlocks
from fsdp_utils.data.prepare import PreparedData
from fsdp_utils.train.evaluate import evaluate
from fsdp_utils.train.step import TrainStep, build_train_step

from .base import Examples, Method, StepParts


class SFT(Method):
    name: ClassVar[str] = "sft"
    step: TrainStep  # set by build_step

    def use_data(self, prepared: PreparedData) -> tuple[Examples, Examples]:
        masking = self.config.document_masking
        splits = [prepared.split(name, document_masking=masking) for name in ("train", "eval")]
        assert all(isinstance(s, TokenBlocks) for s in splits), "SFT reads blocks, not pairs"
        return splits[0], splits[1]

    def identity(self) -> dict[str, Any]:
        return {}  # a fine-tune's identity stays as it was before there were methods

    def build_step(self, model: nn.Module, parts: StepParts) -> TrainStep:
        self.step = build_train_step(
            model, self.config, world_size=self.env.world_size, device=self.env.device,
            hf_config=self.context.hf_config, autocast=parts.autocast,
            grad_scaler=parts.grad_scaler, sequence_parallel=self.sequence_parallel,
        )  # fmt: skip
        return self.step

    def evaluate(
        self, model: nn.Module, examples: Examples, *, batch_size: int, max_batches: int
    ) -> dict[str, Any] | None:
        assert isinstance(examples, TokenBlocks)
        return evaluate(
            model, examples, env=self.env, batch_size=batch_size, max_batches=max_batches,
            autocast=self.step.autocast, chunking=self.step.chunking,
            sequence_parallel=self.sequence_parallel,
        )  # fmt: skip
