"""What a `--method dpo` run adds to the Trainer (train/trainer.py calls it at three points):
which weights the model starts from, the reference and the step, and the evaluation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.preference import PreferencePairs
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.train.loss import LossChunking

from .reference import (
    AdaptersOff,
    CachedReference,
    ForwardSettings,
    LiveReference,
    Reference,
    cache_folder,
    compute_reference_cache,
    is_cached,
)
from .step import PreferenceStep, build_preference_step, evaluate_pairs


class PreferenceRun:
    """The reference and the DPO step of a run, set up collectively (every rank the same)."""

    step: PreferenceStep

    def __init__(
        self,
        config: TrainConfig,
        env: DistEnv,
        *,
        data_folder: Path,
        model_dir: Path,
        hf_config: Any,
        log: Callable[[str], None],
    ) -> None:
        self.config = config
        self.env = env
        self.log = log
        self.hf_config = hf_config
        self.chunking = LossChunking.build(config.loss_chunk_size, hf_config)
        self.cache: Path | None = None
        if not config.lora and config.reference == "cached":
            self.cache = cache_folder(config, model_dir, data_folder, self.chunking.chunk_size)
        # Rank 0's view of the shared file system decides, for every rank.
        self.cached = dist_utils.broadcast_object(self.cache is not None and is_cached(self.cache))

    @property
    def needs_starting_weights(self) -> bool:
        """The reference cache is computed from the starting weights: a resumed run whose cache
        is gone (deleted, another data cache) loads them before the checkpoint's."""
        return self.cache is not None and not self.cached

    def describe(self) -> str:
        c = self.config
        if c.lora:
            reference = "the model with its LoRA adapters off (no second model)"
        elif c.reference == "live":
            reference = "a frozen sharded copy of the starting model (--reference live)"
        else:
            reference = f"log-probabilities cached in {self.cache}"
        return (
            f"dpo: loss {c.dpo_loss}, beta {c.dpo_beta:g}"
            + (f", label smoothing {c.dpo_label_smoothing:g}" if c.dpo_label_smoothing else "")
            + f"; batch sizes count pairs (2 sequences each); reference: {reference}"
        )

    def build_step(
        self,
        model: nn.Module,
        *,
        splits: list[PreferencePairs],
        frozen_copy: Callable[[], nn.Module],
        autocast: Callable[[], Any],
        batch_size: int,
    ) -> PreferenceStep:
        """Collective: the reference (the cache computed now if missing) and the step. `splits`:
        the pairs whose reference log-probabilities the cache holds (train and eval);
        `frozen_copy`: builds the starting model again, sharded (--reference live)."""
        forward = ForwardSettings(self.chunking, self.env.device, autocast)
        reference: Reference
        if self.config.lora:
            reference = AdaptersOff(model, forward)
        elif self.cache is None:
            copy = frozen_copy()
            copy.requires_grad_(False)
            reference = LiveReference(copy, forward)
        else:
            if not self.cached:
                pairs = sum(len(s) for s in splits)
                self.log(f"dpo: computing the reference log-probabilities of {pairs:,} pairs")
                compute_reference_cache(
                    model, splits, self.cache, env=self.env, batch_size=batch_size,
                    forward=forward, log=self.log,
                )  # fmt: skip
            else:
                self.log(f"dpo: reference log-probabilities from {self.cache}")
            reference = CachedReference.load(self.cache, self.env.device)
        self.step = build_preference_step(
            model, self.config, world_size=self.env.world_size, device=self.env.device,
            hf_config=self.hf_config, chunking=self.chunking, reference=reference,
            autocast=autocast,
        )  # fmt: skip
        return self.step

    def evaluate(
        self, model: nn.Module, pairs: PreferencePairs, *, batch_size: int, max_batches: int
    ) -> dict[str, Any] | None:
        return evaluate_pairs(
            model, pairs, self.step.pair_loss, env=self.env, batch_size=batch_size,
            max_batches=max_batches,
        )  # fmt: skip
