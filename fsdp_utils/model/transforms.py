"""The model as it will train, still on the meta device: its decoder layers found, what the log
reports about it (`ModelInfo`), and the model transforms applied (LoRA adapters) before
parallelisation, as torchtitan's model converters run before its parallelize function.

The Trainer, the memory planner and the storage check all start from `transform_model`, so
they see the same trainable parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.model.build import active_parameters, count_parameters, find_decoder_layers
from fsdp_utils.model.lora import apply_lora


@dataclass(frozen=True)
class ModelInfo:
    """What the log, the run config and the planner report about the architecture."""

    model_type: str
    parameters: int  # tied weights counted once, before any transform (LoRA adds its own)
    non_embedding_parameters: int
    decoder_layers: int
    decoder_layer_class: str
    # Mixture of experts: the non-embedding parameters one token passes through (its top-k
    # routed experts and everything else); None for a dense model, where that is all of them.
    active_non_embedding_parameters: int | None = None

    @property
    def active_parameters(self) -> int:
        """What a token computes with: the N of 6N in the FLOPs per token."""
        if self.active_non_embedding_parameters is None:
            return self.non_embedding_parameters
        return self.active_non_embedding_parameters


@dataclass(frozen=True)
class MetaModel:
    """A model on the meta device with its transforms applied, ready for `parallelize`."""

    model: nn.Module
    layers: list[nn.Module]  # the decoder layers, in order
    info: ModelInfo


def transform_model(model: nn.Module, config: TrainConfig) -> MetaModel:
    """Find the decoder layers of a freshly built meta model (`build_meta_model`), describe it,
    and apply the model transforms the config asks for (in place)."""
    layers = find_decoder_layers(model)
    total, non_embedding = count_parameters(model)
    hf_config: Any = model.config
    active = active_parameters(model, hf_config, non_embedding)
    info = ModelInfo(
        hf_config.model_type,
        total,
        non_embedding,
        len(layers),
        type(layers[0]).__name__,
        active_non_embedding_parameters=active if active != non_embedding else None,
    )
    if config.lora:
        apply_lora(model, layers, config)
    return MetaModel(model, layers, info)
