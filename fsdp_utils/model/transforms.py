"""The run's model transforms, in one place: which ones, in which order, and how the
transformed model gets its first weights.

`apply_transforms` runs on the meta model, after the decoder layers are found and before
activation checkpointing and FSDP2 (as torchtitan's model converters run before its parallelize
function): LoRA adapters (`lora`) or frozen bottom layers (`freeze`). Everyone who builds a run's
model goes through it: the trainer and the memory planner (`build_parallel_model`), the storage
check, the preflight's LoRA check and the export of a checkpoint.

`load_initial_weights` fills the materialised (sharded) model as the run starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.model import lora
from fsdp_utils.model.freeze import freeze_layers, trains_a_subset
from fsdp_utils.model.weights import load_pretrained_weights


def apply_transforms(
    model: nn.Module, layers: list[nn.Module], hf_config: Any, config: TrainConfig
) -> None:
    """LoRA or --freeze_layers (never both: `validate_config`), in place, on meta."""
    if config.lora:
        lora.apply_lora(model, layers, config)
    if config.freeze_layers:
        freeze_layers(model, layers, hf_config, config)


def load_initial_weights(
    model: nn.Module,
    model_dir: Path,
    key_map: dict[str, str],
    config: TrainConfig,
    *,
    resuming: bool,
) -> None:
    """After `materialize`. The pretrained weights load unless a full fine-tune resumes (its
    checkpoint holds every weight); a run that trains a subset always loads them, since its
    checkpoints hold only what trains. LoRA adapters start from the seed (peft's init), DoRA's
    magnitudes from the loaded base, or everything from --lora_from's adapter."""
    if config.lora:
        key_map = lora.init_adapters_and_key_map(model, key_map, seed=config.seed)
    if not resuming or trains_a_subset(config):
        load_pretrained_weights(model, model_dir, key_map)
    if config.lora:
        lora.finish_adapters(model, config)
