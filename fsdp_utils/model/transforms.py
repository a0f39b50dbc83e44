"""The model as it will train, still on the meta device, and its first weights.

`transform_model` finds the decoder layers of a freshly built meta model, describes it
(`ModelInfo`) and applies the model transforms the run asks for, before parallelisation, as
torchtitan's model converters run before its parallelize function: LoRA adapters (`lora`), over
a 4-bit base with --quantize nf4 (`qlora`), or frozen bottom layers (`freeze`); float8 linear
layers (`float8`). The Trainer, the memory planner, the storage check, the
preflight's LoRA check and the export of a checkpoint all start from it, so they see the same
trainable parameters.

`load_initial_weights` fills the materialised (sharded) model as the run starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.model import lora, qlora
from fsdp_utils.model.build import active_parameters, count_parameters, find_decoder_layers
from fsdp_utils.model.float8 import convert_to_float8
from fsdp_utils.model.freeze import freeze_layers, trains_a_subset
from fsdp_utils.model.weights import WeightSource, load_pretrained_weights


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

    def describe(self) -> str:
        """'llama, 6,738.42M parameters (6,607.34M non-embedding), 32 x LlamaDecoderLayer'."""
        active = (
            f", {self.active_parameters / 1e6:,.2f}M active per token"
            if self.active_non_embedding_parameters is not None
            else ""
        )
        return (
            f"{self.model_type}, {self.parameters / 1e6:,.2f}M parameters "
            f"({self.non_embedding_parameters / 1e6:,.2f}M non-embedding{active}), "
            f"{self.decoder_layers} x {self.decoder_layer_class}"
        )


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
    apply_transforms(model, layers, hf_config, config)
    return MetaModel(model, layers, info)


def apply_transforms(
    model: nn.Module, layers: list[nn.Module], hf_config: Any, config: TrainConfig
) -> None:
    """LoRA (over a 4-bit base with --quantize) or --freeze_layers (never both:
    `validate_config`), and float8's linear layers (--float8, never with LoRA), in place, on
    meta."""
    if config.float8 != "none":
        convert_to_float8(layers, config.float8)
    if config.quantize != "none":  # before LoRA, which wraps the NF4 linears as they are
        qlora.quantize_base(model, layers, config)
    if config.lora:
        lora.apply_lora(model, layers, config)
    if config.freeze_layers:
        freeze_layers(model, layers, hf_config, config)


def load_initial_weights(
    model: nn.Module,
    model_dir: Path,
    key_map: dict[str, WeightSource],
    config: TrainConfig,
    *,
    resuming: bool,
) -> None:
    """After `materialize`. The pretrained weights load unless a full fine-tune resumes (its
    checkpoint holds every weight); a run that trains a subset always loads them, since its
    checkpoints hold only what trains. LoRA adapters start from the seed (peft's init, the same
    on any world size), DoRA's magnitudes from the loaded base, or everything from --lora_from's
    adapter."""
    if config.lora:
        key_map = lora.init_adapters_and_key_map(model, key_map, seed=config.seed)
    if not resuming or trains_a_subset(config):
        # The NF4 base first, one tensor at a time (`qlora`); the rest slice by slice.
        key_map = qlora.load_quantized_weights(model, model_dir, key_map)
        load_pretrained_weights(model, model_dir, key_map)
    if config.lora:
        lora.finish_adapters(model, config)
