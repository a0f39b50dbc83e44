"""The teacher as the step reads it, live or cached, per micro-batch: for each target token of
the batch, what the chunks of `loss.py` need beside the student's hidden state.

- `LiveTeacher`: the teacher model (built by the model stage, `fsdp_utils.model.teacher`,
  sharded by FSDP2 over the student's mesh, frozen). Its forward runs under no_grad before the
  student's, stopping before its output layer as the chunked loss does
  (`train.step.forward_target_chunks`), and keeps its last hidden states at the target positions
  only ([targets, hidden]); each chunk of the student's loss turns its rows into the teacher's
  logits ([chunk, vocabulary], never the whole batch's). For that the teacher's root shard group
  (its embeddings, final norm and output layer) stays gathered from its forward to the end of
  the student's backward, which recomputes the chunks (`release`); its decoder layers are
  resharded as soon as its forward ends.
- `CachedTeacher`: the rows of `--teacher_cache` the batch carries (`cache.CachedBlocks`),
  picked at the target positions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.fsdp import FSDPModule

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import next_token_labels
from fsdp_utils.model.build import materialize
from fsdp_utils.model.qlora import describe as describe_nf4
from fsdp_utils.model.qlora import is_nf4, local_bytes
from fsdp_utils.model.teacher import meta_teacher
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.parallel.materialize import build_model
from fsdp_utils.parallel.parallelize import parallelize_model, reshard
from fsdp_utils.train.loss import LogitTransform, LossChunking, Targets, output_layer
from fsdp_utils.train.step import Batch, forward_target_chunks

from .cache import CACHE_KEYS
from .loss import DistillSettings, cached_terms, live_terms, teacher_top_k

ChunkTerms = Callable[..., torch.Tensor]


class TeacherSource(Protocol):
    def per_target(self, batch: Batch, targets: Targets) -> tuple[torch.Tensor, ...]:
        """What the chunks read beside each target's hidden state, [targets, ...] each."""
        ...

    def terms(self, settings: DistillSettings, student: tuple[nn.Module, Any]) -> ChunkTerms:
        """The chunk function: (hidden, tokens, *per_target) -> [chunk, TERMS]."""
        ...

    def release(self) -> None:
        """After the student's backward (or an evaluation batch): free what `per_target` kept."""
        ...


def pick_targets(values: torch.Tensor, targets: Targets) -> torch.Tensor:
    """The rows of a [batch, positions, ...] tensor of `next_token_labels`' shape at the target
    positions ([targets, ...]); `targets` found on the host."""
    return values.flatten(0, 1).index_select(0, targets.shifted)


def host_targets(batch: Batch) -> Targets:
    return Targets.of(next_token_labels(batch), batch["input_ids"].shape[1])


class LiveTeacher:
    """The teacher model, sharded and frozen (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        transform: LogitTransform | None,
        *,
        device: torch.device,
        autocast: Callable[[], Any],
    ) -> None:
        self.model: nn.Module | None = model
        self.transform = transform
        self.device = device
        self.autocast = autocast

    @classmethod
    def build(
        cls,
        config: TrainConfig,
        env: DistEnv,
        *,
        model_dir: Path | None,
        hf_config: Any,
        autocast: Callable[[], Any],
        log: Callable[[str], None],
    ) -> LiveTeacher:
        """Collective: the teacher on meta, sharded, materialised and (`model_dir`) loaded;
        without `model_dir` (the memory planner, on fake tensors) nothing is loaded."""
        if model_dir is None:
            # The planner traces in a fake mode; the meta model and the mesh are built outside
            # it, as the planner builds the trained model's, and materialised in it.
            with unset_fake_temporarily():
                built = meta_teacher(hf_config, model_dir, config)
                model = parallelize_model(built.meta, built.config, env)
            materialize(model, env.device, offload=config.cpu_offload)
            model.requires_grad_(False)
            model.eval()
        else:
            built = meta_teacher(hf_config, model_dir, config)
            model = build_model(
                built.meta, built.config, env, model_dir, built.key_map, load_weights=True,
                frozen=True,
            )  # fmt: skip
            dense = (p for p in model.parameters() if not is_nf4(p))
            stored = local_bytes(model)[0] + sum(_local_bytes(p) for p in dense)
            how = (
                describe_nf4(model)
                if config.teacher_quantize == "nf4"
                else f"stored in {built.config.precision.removesuffix('-true')}"
            )
            log(
                f"distill: teacher {config.teacher}: {built.meta.info.describe()}; {how}; "
                f"{stored / 2**30:,.2f} GiB of it on this process; frozen, no gradients, no "
                "optimizer state"
            )
        transform = LossChunking.build(None, hf_config).transform
        return cls(model, transform, device=env.device, autocast=autocast)

    @property
    def loaded(self) -> nn.Module:
        assert self.model is not None, "the teacher was released"
        return self.model

    def hidden_states(self, batch: Batch) -> torch.Tensor:
        """[targets, hidden] the teacher's last hidden states at the batch's target positions
        (collective: an FSDP forward). Its root group stays gathered until `release`."""
        model = self.loaded

        def pick(head: nn.Module, hidden: torch.Tensor, targets: Targets) -> torch.Tensor:
            return hidden.flatten(0, 1).index_select(0, targets.rows)

        with torch.no_grad():
            _, picked, _ = forward_target_chunks(model, batch, self.device, self.autocast, pick)
        for module in model.modules():  # the decoder layers (the last one stays gathered)
            if isinstance(module, FSDPModule) and module is not model:
                module.reshard()
        return picked

    def per_target(self, batch: Batch, targets: Targets) -> tuple[torch.Tensor, ...]:
        return (self.hidden_states(batch),)

    def top_k_entries(
        self, batch: Batch, *, k: int, temperature: float, vocab: int | None, chunk_size: int
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Collective: the teacher's top K at the batch's target positions, chunk by chunk of
        them (`loss.teacher_top_k`), on the device."""
        hidden = self.hidden_states(batch)
        head = (output_layer(self.loaded), self.transform)
        try:
            return [
                teacher_top_k(head, hidden[s : s + chunk_size], k=k, temperature=temperature,
                              vocab=vocab)
                for s in range(0, hidden.shape[0], chunk_size)
            ]  # fmt: skip
        finally:
            self.release()

    def cache_entries(
        self, batch: Batch, *, k: int, temperature: float, vocab: int | None, chunk_size: int
    ) -> dict[str, np.ndarray]:
        """Collective: the teacher cache's rows of a batch (`cache.CACHE_KEYS`: [rows,
        positions, K] ids and log-probabilities, [rows, positions] the rest's), zeros where
        there is no target."""
        targets = host_targets(batch)
        pieces = self.top_k_entries(
            batch, k=k, temperature=temperature, vocab=vocab, chunk_size=chunk_size
        )
        rows, positions = next_token_labels(batch).shape
        out = {}
        for index, (key, tail) in enumerate(zip(CACHE_KEYS, ((k,), (k,), ()), strict=True)):
            dtype = torch.int32 if index == 0 else torch.float32
            dense = torch.zeros((rows * positions, *tail), dtype=dtype)
            if pieces:
                dense[targets.shifted] = torch.cat([p[index] for p in pieces]).cpu()
            out[key] = dense.view(rows, positions, *tail).numpy()
        return out

    def terms(self, settings: DistillSettings, student: tuple[nn.Module, Any]) -> ChunkTerms:
        teacher = (output_layer(self.loaded), self.transform)
        return functools.partial(live_terms, settings, student, teacher)

    def release(self) -> None:
        if self.model is not None:
            reshard(self.model)

    def close(self) -> None:
        """Let the teacher's shards go (before the final model is gathered, or once the cache
        is written)."""
        self.release()
        self.model = None


class CachedTeacher:
    """The teacher's cached top-K at the batch's targets (`cache.CachedBlocks` put them in the
    batch), moved to the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def per_target(self, batch: Batch, targets: Targets) -> tuple[torch.Tensor, ...]:
        missing = [key for key in CACHE_KEYS if key not in batch]
        assert not missing, f"a batch without the teacher cache's {missing}"
        return tuple(
            pick_targets(batch[key], targets).to(self.device, non_blocking=True)
            for key in CACHE_KEYS
        )

    def terms(self, settings: DistillSettings, student: tuple[nn.Module, Any]) -> ChunkTerms:
        return functools.partial(cached_terms, settings, student)

    def release(self) -> None:
        pass


class CachedStandIn(CachedTeacher):
    """The cache in the memory planner's traced step: top-K tensors of the cache's shapes on
    the device for every target (what a real step moves there), nothing read."""

    def __init__(self, device: torch.device, k: int) -> None:
        super().__init__(device)
        self.k = k

    def per_target(self, batch: Batch, targets: Targets) -> tuple[torch.Tensor, ...]:
        n = targets.rows.numel()
        return (
            torch.zeros((n, self.k), dtype=torch.int32, device=self.device),
            torch.zeros((n, self.k), device=self.device),
            torch.zeros(n, device=self.device),
        )


def _local_bytes(param: torch.Tensor) -> int:
    local: Any = getattr(param, "_local_tensor", param)
    return int(local.numel() * local.element_size())
