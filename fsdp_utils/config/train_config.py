"""The training configuration: one typed dataclass, the single source of truth.

Its fields are the options of every stage of a run, each stage's in its own module
(`fsdp_utils/config/options/`: `DataOptions` in data.py, `LoraOptions` in lora.py, ...);
`TrainConfig` gathers them into one flat dataclass, so code reads `config.learning_rate`, and
the command line, config files and the run folder's config.json see one set of names.

The command line and config files (YAML or JSON) are thin layers over `TrainConfig`:
defaults < `--config FILE` < explicit command-line flags. The resolved config is written
to the run folder (`config.json`) so every run can be reproduced.

Adding an option: a field in its stage's class, with its help text (`metadata=_opt(...)`);
a check of its value in that module's `check`, or in `validate_config` below when it reads
another stage's options too.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from .options import (
    assets,
    batch,
    checkpoints,
    data,
    evaluation,
    lora,
    method,
    metrics,
    optimizer,
    parallelism,
)
from .options.assets import (
    DEFAULT_DATASET,
    DEFAULT_DATASET_INCLUDE,
    DEFAULT_MODEL,
    AssetOptions,
    default_dataset_include,
)
from .options.batch import DEFAULT_TOTAL_BATCH_SIZE, BatchOptions
from .options.checkpoints import CheckpointOptions, ExportDtype
from .options.data import DEFAULT_TEMPLATE, DataOptions
from .options.evaluation import EvaluationOptions
from .options.lora import LoraOptions
from .options.method import REFERENCE_METHODS, MethodOptions
from .options.metrics import MetricsOptions
from .options.optimizer import OptimizerOptions
from .options.parallelism import AttnImplementation, ParallelismOptions, Precision, Sharding

__all__ = [
    "DEFAULT_DATASET",
    "DEFAULT_DATASET_INCLUDE",
    "DEFAULT_MODEL",
    "DEFAULT_TEMPLATE",
    "DEFAULT_TOTAL_BATCH_SIZE",
    "SECTIONS",
    "AttnImplementation",
    "ExportDtype",
    "Precision",
    "Sharding",
    "TrainConfig",
    "default_dataset_include",
    "validate_config",
]

# The stages, in the order of `--help`'s sections and of config.json's keys.
STAGES = (
    assets, batch, optimizer, parallelism, data, evaluation, checkpoints, lora, method, metrics
)  # fmt: skip
SECTIONS = {stage.SECTION.name: stage.SECTION.title for stage in STAGES}


# Python collects a dataclass's fields from its bases last to first: the bases are listed in
# the reverse order of STAGES so that the fields come in STAGES' order.
@dataclass
class TrainConfig(
    MetricsOptions,
    MethodOptions,
    LoraOptions,
    CheckpointOptions,
    EvaluationOptions,
    DataOptions,
    ParallelismOptions,
    OptimizerOptions,
    BatchOptions,
    AssetOptions,
):
    """Every option of a run (the stages' classes in fsdp_utils/config/options/, gathered)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    @property
    def reference_adapter(self) -> bool:
        """A reference method continuing an adapter (`--method dpo --lora --lora_from A`): the
        model carries a frozen copy of A beside the trained adapter (`fsdp_utils.model.lora`),
        and the reference is the model with that copy active: the model the user fine-tuned,
        not the base with the adapters off."""
        return self.method in REFERENCE_METHODS and self.lora and self.lora_from is not None


def validate_config(config: TrainConfig) -> None:
    """Checks that need no model, data or world size (those come in the batch plan): each
    stage's own (its module's `check`), then those across stages."""
    for stage in STAGES:
        stage.check(config)
    _check_quantize(config)
    _check_float8(config)
    if config.freeze_layers and config.lora:
        raise ValueError(
            "--freeze_layers with --lora: LoRA already freezes every pretrained weight. To "
            "adapt only some layers' projections use --lora_target_modules; to train the top "
            "layers fully, drop --lora."
        )
    if config.method == "dpo" and config.reference == "live" and config.lora:
        raise ValueError(
            "--reference live keeps a frozen copy of the model as the DPO reference, but with "
            "--lora the reference is already the same model with its adapters off (no second "
            "model in memory). Drop --reference live."
        )
    if config.method == "distill" and config.teacher_quantize != "none" and config.no_fsdp:
        raise ValueError(
            f"--teacher_quantize {config.teacher_quantize} with --no_fsdp: the 4-bit teacher is "
            "sharded and gathered by FSDP2 (torchao's NF4Tensor implements its hooks), which DDP "
            "does not have. Drop --no_fsdp (FSDP2 on one GPU works too), or drop "
            "--teacher_quantize."
        )
    if config.method == "grpo":
        _check_grpo(config)
    if config.auto_keep and not config.auto:
        raise ValueError(
            "--auto_keep says what --auto must not change, and --auto is not given: add "
            "--auto, or drop --auto_keep."
        )
    if config.auto and config.no_fsdp:
        raise ValueError(
            "--auto chooses among FSDP2's settings; --no_fsdp (DDP) has none to choose. Drop "
            "one of them."
        )
    if config.method == "dpo" and config.train_on_prompt:
        raise ValueError(
            "--train_on_prompt with --method dpo: DPO compares the answers given the same "
            "prompt, so the prompt's tokens carry no loss. Drop --train_on_prompt."
        )


def _check_grpo(config: TrainConfig) -> None:
    """GRPO's options against the other stages'."""
    if config.max_completion_length >= config.seq_length:
        raise ValueError(
            f"--max_completion_length {config.max_completion_length} leaves no room for the "
            f"prompt in --max_seq_length {config.seq_length} (a prompt and its completion "
            "share it): raise --max_seq_length, e.g. to "
            f"{config.max_completion_length + 256}, or lower --max_completion_length."
        )
    if config.sequence_parallel > 1:
        raise ValueError(
            "--sequence_parallel with --method grpo: the completions are sampled and scored "
            "whole on each rank (as in TRL, which refuses sequence parallelism for GRPO too). "
            "Drop --sequence_parallel."
        )
    if config.train_on_prompt:
        raise ValueError(
            "--train_on_prompt with --method grpo: GRPO's loss is on the completions the "
            "model sampled; the prompts carry none. Drop --train_on_prompt."
        )


def _check_float8(config: TrainConfig) -> None:
    """--float8 converts the linear layers that train (fsdp_utils/model/float8.py): not LoRA's."""
    if config.float8 == "none" or not (config.lora or config.quantize != "none"):
        return
    what = "--qlora / --quantize" if config.quantize != "none" else "--lora"
    raise ValueError(
        f"--float8 {config.float8} with {what}: float8 training converts the linear layers "
        "that train, and with LoRA those are the small adapters beside a frozen base (bf16, "
        "or NF4 codes with --quantize), where float8's casts would cost more than they save. "
        f"Drop --float8 for LoRA, or drop {what} to fine-tune the whole model in float8."
    )


def _check_quantize(config: TrainConfig) -> None:
    """The tutorials' traps with a 4-bit base (tutorial 000, llama-recipes with
    load_in_4bit=True): fully fine-tuned, the loss does not decrease, and in half precision
    the gradient scaler meets no gradient at all; and DDP, which cannot hold it."""
    if config.quantize == "none":
        return
    if not config.lora:
        scaler = (
            " With --precision fp16-mixed it would also stop at the gradient scaler's "
            '"AssertionError: No inf checks were recorded for this optimizer": no parameter '
            "would have a gradient to check."
            if config.precision == "fp16-mixed"
            else ""
        )
        raise ValueError(
            f"--quantize {config.quantize} without --lora: a 4-bit base cannot be fine-tuned "
            "itself (its weights are frozen codes, so a full fine-tune of a quantized model "
            f"trains nothing and its loss does not decrease).{scaler} Train LoRA adapters on "
            f"it: add --lora (or use --qlora, short for --lora --quantize {config.quantize}); "
            "or drop --quantize to fine-tune the whole model in 16 bits."
        )
    if config.no_fsdp:
        raise ValueError(
            f"--quantize {config.quantize} with --no_fsdp: the 4-bit base is sharded and "
            "gathered by FSDP2 (torchao's NF4Tensor implements its hooks), which DDP does not "
            "have. Drop --no_fsdp (FSDP2 on one GPU works too), or drop --quantize for LoRA on "
            "a 16-bit base."
        )
