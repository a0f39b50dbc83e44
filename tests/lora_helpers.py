"""A LoRA model on CPU in one process, built as the trainer builds it (meta, adapters,
`to_empty`, the base loaded, DoRA's magnitudes from it), for the tests that check its names,
its merge and its export without a process group."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.hub.resolve import load_model_config
from fsdp_utils.model.build import build_meta_model, find_decoder_layers, materialize
from fsdp_utils.model.lora import apply_lora, base_key_map, init_adapters, init_dora_magnitudes
from fsdp_utils.model.weights import checkpoint_key_map, load_pretrained_weights


def lora_model_on_cpu(
    model_dir: Path, config: TrainConfig
) -> tuple[torch.nn.Module, PretrainedConfig]:
    """The model with its adapters initialised (B at zero) and the base loaded, and its config."""
    hf_config = load_model_config(model_dir)
    key_map = checkpoint_key_map(build_meta_model(hf_config, "fp32"), model_dir)
    model = build_meta_model(hf_config, "fp32")
    apply_lora(model, find_decoder_layers(model), config)
    materialize(model, torch.device("cpu"))
    init_adapters(model, seed=0)
    load_pretrained_weights(model, model_dir, base_key_map(model, key_map))
    init_dora_magnitudes(model)
    return model, hf_config
