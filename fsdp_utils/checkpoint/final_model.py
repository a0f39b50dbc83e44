"""The model a run leaves at its end, in the folder users load it from:

    <output_dir>/final/          full fine-tune: a Hugging Face model folder (from_pretrained);
                                 LoRA: a PEFT adapter folder (PeftModel.from_pretrained)
    <output_dir>/final_merged/   LoRA with --merge: the base with the adapters merged in

Collective: every rank takes part in gathering the (sharded) state; rank 0 writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fsdp_utils.checkpoint.hf_folder import save_hf_model
from fsdp_utils.checkpoint.lora_adapters import save_lora_model
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig


def save_final_model(
    model: nn.Module,
    config: TrainConfig,
    hf_config: Any,
    layout: RunLayout,
    tokenizer_source: Path,
    *,
    is_main: bool,
) -> Path:
    """Write the run's final model (see the module docstring); returns the folder users load."""
    if isinstance(model, DistributedDataParallel):  # --no_fsdp: the wrapped model's names
        model = cast(nn.Module, model.module)
    if config.lora:
        return save_lora_model(model, config, hf_config, layout, tokenizer_source, is_main)
    return save_hf_model(
        model, hf_config, layout.final_model, tokenizer_source, is_main,
        export_dtype=config.export_dtype,
    )  # fmt: skip
