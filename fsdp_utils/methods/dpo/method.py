"""`--method dpo`: the Method the trainer composes. Its examples are pairs; before the first
step it computes the reference's log-probabilities when they are to be cached and are not yet;
its step is a TrainStep whose loss of a micro-batch is DPO's (step.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from torch import nn

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.preference import PreferencePairs
from fsdp_utils.data.prepare import PreparedData
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.train.loss import run_chunking
from fsdp_utils.train.step import TrainStep

from ..base import Examples, Method, MethodContext, StepParts, StopCheck
from .reference import (
    AdaptersOff,
    CachedReference,
    CachedStandIn,
    ForwardSettings,
    LiveReference,
    Reference,
    Released,
    StartingAdapter,
    cache_folder,
    compute_reference_cache,
    is_cached,
)
from .step import PreferenceStep, build_preference_step, evaluate_pairs


def disable_dropout(model: nn.Module) -> None:
    """Every dropout of the model set to 0 (LoRA's --lora_dropout included), as TRL's DPOTrainer
    does by default (`DPOConfig.disable_dropout`, `trl.trainer.utils.disable_dropout_in_model`):
    the reference runs without dropout (eval mode), so a policy with it would not start at the
    reference, and the first loss would not be ln 2."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


class DPO(Method):
    """The reference and the DPO step of a run, set up collectively (every rank the same)."""

    name: ClassVar[str] = "dpo"
    step: PreferenceStep  # set by build_step

    def __init__(self, config: TrainConfig, context: MethodContext) -> None:
        super().__init__(config, context)
        self.chunking = run_chunking(config, context.hf_config, context.env.device)
        self.pairs: list[PreferencePairs] = []
        self.cache: Path | None = None  # the reference cache's folder (--reference cached)
        self.cached = False
        self.live: nn.Module | None = None  # the frozen copy of --reference live

    def use_data(self, prepared: PreparedData) -> tuple[Examples, Examples]:
        splits = [prepared.split(name) for name in ("train", "eval")]
        assert all(isinstance(s, PreferencePairs) for s in splits), "DPO reads pairs"
        self.pairs = [s for s in splits if isinstance(s, PreferencePairs)]
        if not self.config.lora and self.config.reference == "cached":
            self.cache = cache_folder(
                self.config, self.context.model_dir, prepared.folder, self.chunking.chunk_size
            )
        # Rank 0's view of the shared file system decides, for every rank.
        self.cached = dist_utils.broadcast_object(self.cache is not None and is_cached(self.cache))
        return splits[0], splits[1]

    def describe(self) -> str:
        c = self.config
        if c.reference_adapter:
            reference = (
                f"the starting adapter {c.lora_from}, a frozen copy beside the trained one "
                "(the model fine-tuned before DPO; TRL's ref_adapter_name)"
            )
        elif c.lora:
            reference = "the model with its LoRA adapters off (no second model)"
        elif c.reference == "live":
            reference = "a frozen sharded copy of the starting model (--reference live)"
        else:
            reference = f"log-probabilities cached in {self.cache}"
        return (
            f"dpo: loss {c.dpo_loss}, beta {c.dpo_beta:g}"
            + (f", label smoothing {c.dpo_label_smoothing:g}" if c.dpo_label_smoothing else "")
            + f"; batch sizes count pairs (2 sequences each); reference: {reference}; dropout "
            "off (TRL's disable_dropout: the policy starts where the reference is)"
        )

    def needs_starting_weights(self) -> bool:
        """The reference cache is computed from the starting weights: a resumed run whose cache
        is gone (deleted, another data cache) loads them before the checkpoint's."""
        return self.cache is not None and not self.cached

    @classmethod
    def needs_frozen_copy(cls, config: TrainConfig) -> bool:
        return not config.lora and config.reference == "live"

    def before_first_step(self, model: nn.Module, parts: StepParts, stop: StopCheck) -> str | None:
        """Collective: the reference log-probabilities of every pair (train and eval) into the
        cache, when it is to be cached and is not yet. A stop request between its batches keeps
        the pairs done (the cache is indexed by row), and the next leg computes the rest."""
        if self.cache is None:
            return None
        if self.cached:
            self.context.log(f"dpo: reference log-probabilities from {self.cache}")
            return None
        pairs = sum(len(s) for s in self.pairs)
        self.context.log(f"dpo: computing the reference log-probabilities of {pairs:,} pairs")
        stopped = compute_reference_cache(
            model, self.pairs, self.cache, env=self.env,
            batch_size=self.context.plan.batch_size_per_device,
            forward=self._forward(parts), log=self.context.log, stop=stop,
        )  # fmt: skip
        self.cached = stopped is None
        return stopped

    def _forward(self, parts: StepParts) -> ForwardSettings:
        return ForwardSettings(
            self.chunking, self.env.device, parts.autocast, self.sequence_parallel
        )

    def build_step(self, model: nn.Module, parts: StepParts) -> TrainStep:
        disable_dropout(model)
        forward = self._forward(parts)
        reference: Reference
        if self.config.reference_adapter:
            reference = StartingAdapter(model, forward)
        elif self.config.lora:
            reference = AdaptersOff(model, forward)
        elif self.needs_frozen_copy(self.config):
            self.live = parts.frozen_copy()
            self.live.requires_grad_(False)
            reference = LiveReference(self.live, forward)
        else:
            assert self.cache is not None and self.cached, "before_first_step fills the cache"
            reference = CachedReference.load(self.cache, self.env.device)
        return self._step(model, parts, reference)

    def planned_step(self, model: nn.Module, parts: StepParts) -> TrainStep:
        """The planner's: a cached reference is host numbers, nothing on the device to plan."""
        if self.config.lora or self.needs_frozen_copy(self.config):
            return self.build_step(model, parts)
        return self._step(model, parts, CachedStandIn(self.env.device))

    def _step(self, model: nn.Module, parts: StepParts, reference: Reference) -> TrainStep:
        self.step = build_preference_step(
            model, self.config, world_size=self.env.world_size, device=self.env.device,
            hf_config=self.context.hf_config, chunking=self.chunking, reference=reference,
            autocast=parts.autocast, grad_scaler=parts.grad_scaler,
            sequence_parallel=self.sequence_parallel,
        )  # fmt: skip
        return self.step

    def evaluate(
        self, model: nn.Module, examples: Examples, *, batch_size: int, max_batches: int
    ) -> dict[str, Any] | None:
        assert isinstance(examples, PreferencePairs)
        return evaluate_pairs(
            model, examples, self.step.pair_loss, env=self.env, batch_size=batch_size,
            max_batches=max_batches,
        )  # fmt: skip

    def before_export(self) -> None:
        if self.live is not None:  # the frozen copy's shards are not needed any more
            self.step.pair_loss.reference = Released()
            self.live = None
