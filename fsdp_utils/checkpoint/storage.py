"""Will the run's checkpoints fit on the disk of its run folder? Checked before training.

A checkpoint holds what `Checkpointer.save` writes: the model's state dict in its storage dtype
(fp32 master weights for bf16-mixed/fp16-mixed/fp32, bf16 for bf16-true; with --lora or
--freeze_layers only what trains), the optimizer state (AdamW: two tensors per trainable
parameter in the same dtype; SGD: one with momentum, none without), and `hf/` (model config
and tokenizer files). For CodeLlama-7B with bf16-mixed AdamW
that is 6.74 G parameters x (4 + 8) bytes = 81 GB. At the peak of a save the folder holds
`--keep_last` complete checkpoints and the one being written (older ones are deleted only after
it is complete), so the run needs up to `keep_last + 1` of them, plus the final model.

The free space is what the file system reports to this user (statvfs: `shutil.disk_usage`). A
per-user or per-group quota (common on $HOME and project storage) is not visible there: check
it with your site's quota command.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_utils.checkpoint.hf_folder import TOKENIZER_FILES, resolve_export_dtype
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.hub.cache import format_bytes, free_bytes, nearest_existing
from fsdp_utils.model.freeze import trains_a_subset

OPTIMIZER_STATES = {"adamw": 2}  # state tensors per trainable parameter (exp_avg, exp_avg_sq)


def optimizer_states_per_parameter(config: TrainConfig) -> int:
    if config.optimizer in OPTIMIZER_STATES:
        return OPTIMIZER_STATES[config.optimizer]
    return 1 if config.momentum > 0 else 0  # SGD: a momentum buffer, or stateless


# torch.distributed.checkpoint stores each tensor (each rank's shard of it) with ~1.5 kB of
# framing in its .distcp file and ~0.3 kB in .metadata (measured here with torch 2.13: 97 entries
# of a 2-layer Llama with AdamW on 1 process, 1.82 MB of data files for 1.68 MB of tensors; 160
# entries on 2), plus a dozen entries for the optimizer's param groups. Negligible for a 7B
# model (a few MB), not for a tiny one.
ENTRY_OVERHEAD_BYTES = 1800
PARAM_GROUP_ENTRIES = 16


@dataclass(frozen=True)
class CheckpointSize:
    parameters: int  # elements of the model's state dict
    model_bytes: int  # tied weights count twice: DCP saves them under both names
    trainable_bytes: int  # each trainable parameter once: what optimizer state is made of
    optimizer_states: int  # state tensors per trainable parameter
    other_bytes: int  # config/tokenizer files (hf/) and DCP's per-tensor framing
    optimizer: str

    @property
    def optimizer_bytes(self) -> int:
        return self.optimizer_states * self.trainable_bytes

    @property
    def total(self) -> int:
        return self.model_bytes + self.optimizer_bytes + self.other_bytes

    def describe(self) -> str:
        per_param = self.model_bytes / max(self.parameters, 1)
        optim = (
            f"{self.optimizer} state {format_bytes(self.optimizer_bytes)} "
            f"({self.optimizer_states} x the trainable parameters)"
            if self.optimizer_states
            else f"no {self.optimizer} state"
        )
        return (
            f"{format_bytes(self.total)} = model {format_bytes(self.model_bytes)} "
            f"({self.parameters / 1e6:,.1f}M parameters x {per_param:.0f} B) + {optim} + "
            f"config, tokenizer and index {format_bytes(self.other_bytes)}"
        )


def checkpoint_size(
    model: nn.Module, config: TrainConfig, model_dir: Path, world_size: int = 1
) -> CheckpointSize:
    """What one checkpoint of this model holds on disk; a meta model is enough (no memory)."""
    parameters = model_bytes = entries = 0
    trainable: dict[int, int] = {}
    subset = trains_a_subset(config)
    for tensor in model.state_dict(keep_vars=True).values():
        frozen = isinstance(tensor, nn.Parameter) and not tensor.requires_grad
        if subset and frozen:  # LoRA, --freeze_layers: what trains, not the pretrained rest
            continue
        size = tensor.numel() * tensor.element_size()
        parameters += tensor.numel()
        model_bytes += size
        entries += 1
        if isinstance(tensor, nn.Parameter) and tensor.requires_grad:
            trainable[id(tensor)] = size
    states = optimizer_states_per_parameter(config)
    # Sharded tensors (weights, optimizer states) are written by every rank, each its shard;
    # replicated ones (AdamW's step counters, the param groups) once.
    shards = 1 if config.no_fsdp else world_size
    entries = (entries + states * len(trainable)) * shards
    entries += (1 if config.optimizer == "adamw" else 0) * len(trainable) + PARAM_GROUP_ENTRIES
    hf_bytes = sum(
        (model_dir / name).stat().st_size
        for name in ("config.json", *TOKENIZER_FILES)  # generation_config.json is among them
        if (model_dir / name).is_file()
    )
    return CheckpointSize(
        parameters=parameters,
        model_bytes=model_bytes,
        trainable_bytes=sum(trainable.values()),
        optimizer_states=states,
        other_bytes=hf_bytes + entries * ENTRY_OVERHEAD_BYTES,
        optimizer=config.optimizer,
    )


def model_export_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """The Hugging Face model the run writes at the end: floating-point tensors in `dtype`, tied
    weights once (export keeps one name per tied group), no LoRA adapters (merged in)."""
    unique = {
        id(t): t for name, t in model.state_dict(keep_vars=True).items() if ".lora_" not in name
    }
    return sum(
        t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
        for t in unique.values()
    )


@dataclass(frozen=True)
class StoragePlan:
    size: CheckpointSize
    keep_last: int
    existing: int  # complete checkpoints already in the folder (pruning replaces them)
    final_bytes: int  # the Hugging Face model written at the end (0: --no_final_save)
    free: int
    folder: Path

    @property
    def checkpoints_to_write(self) -> int:
        """At the peak of a save: keep_last complete + the one being written, less those
        already on disk."""
        keep = max(self.keep_last, 1)
        return keep + 1 - min(self.existing, keep)

    @property
    def needed(self) -> int:
        return self.checkpoints_to_write * self.size.total + self.final_bytes

    def check(self) -> str:
        """One log line; raises ValueError when not even one checkpoint fits."""
        where = f"{format_bytes(self.free)} free on the file system of {self.folder}"
        if self.free < self.size.total:
            raise ValueError(
                f"Not even one checkpoint of this run fits: a checkpoint is "
                f"{self.size.describe()}, and there are only {where}. Put the run folder on "
                "project or scratch storage (not a small $HOME quota): --output_dir "
                "/scratch/<you>/runs/chess (OUTPUT_DIR=... for sbatch), or free some space."
            )
        extra = f" + the final model {format_bytes(self.final_bytes)}" if self.final_bytes else ""
        need = (
            f"{self.checkpoints_to_write} more checkpoint(s) (--keep_last {self.keep_last} + "
            f"the one being written){extra} need {format_bytes(self.needed)}"
        )
        line = f"storage: a checkpoint is {self.size.describe()}; {need}; {where}"
        if self.free < self.needed:
            return (
                f"warning: {line}. Saves will fail once the disk is full (the previous "
                "checkpoint is always kept): lower --keep_last, or use a run folder on project "
                "or scratch storage."
            )
        return line


def plan_storage(
    model: nn.Module,
    config: TrainConfig,
    hf_config: Any,
    model_dir: Path,
    *,
    existing: int,
    world_size: int = 1,
) -> StoragePlan:
    """The storage plan of this run, from its model on the meta device with its transforms
    applied (`fsdp_utils.model.transforms.transform_model`: no memory)."""
    size = checkpoint_size(model, config, model_dir, world_size)
    # The end of the run writes the model in the export dtype (--export_dtype), tied weights
    # once; a LoRA run writes its adapters, and with --merge the merged model too.
    export = resolve_export_dtype(config.export_dtype, hf_config)
    if config.lora:
        final = size.model_bytes + (model_export_bytes(model, export) if config.merge else 0)
    else:
        final = model_export_bytes(model, export)
    folder = nearest_existing(RunLayout.of(config.output_dir).checkpoints)
    return StoragePlan(
        size=size,
        keep_last=config.keep_last,
        existing=existing,
        final_bytes=0 if config.no_final_save else final,
        free=free_bytes(folder),
        folder=folder,
    )
