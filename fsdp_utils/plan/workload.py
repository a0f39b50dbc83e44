"""What the step-time model reads of a run: the model's counts (`ModelFacts`, from the model built
on meta with the run's transforms: LoRA, NF4, --freeze_layers) and the settings (`RunShape`,
from the config and its batch plan). Counts only: nothing is allocated, nothing traced."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_utils.config.batch import BatchPlan, plan_batch
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.metrics.throughput import attention_flops_per_token, training_flops_per_token
from fsdp_utils.model.build import build_meta_model, compute_dtype
from fsdp_utils.model.qlora import is_nf4, nf4_bits_per_weight
from fsdp_utils.model.transforms import MetaModel, transform_model
from fsdp_utils.plan.estimate import model_config_dir
from fsdp_utils.plan.step_time import ModelFacts, RunShape


def checkpointed_layers(config: TrainConfig, layers: int) -> int:
    """How many decoder layers the run checkpoints: --checkpoint_layers N (the first N), else
    every --checkpoint_every_n_layers-th with --gradient_checkpointing, else none."""
    if config.checkpoint_layers is not None:
        return min(config.checkpoint_layers, layers)
    if not config.gradient_checkpointing:
        return 0
    return len(range(0, layers, config.checkpoint_every_n_layers))


def run_shape(config: TrainConfig, batch: BatchPlan, layers: int) -> RunShape:
    """The settings of `config` the step time depends on, with its batch plan's arithmetic."""
    return RunShape(
        micro_batch=batch.batch_size_per_device,
        accumulation=batch.gradient_accumulation_steps,
        sequence_parallel=config.sequence_parallel,
        checkpointed_layers=checkpointed_layers(config, layers),
        sharding=config.sharding,
        compile=config.compile,
        cpu_offload=config.cpu_offload,
        precision=config.precision,
        optimizer=config.optimizer,
        momentum=config.momentum > 0,
        weight_decay=config.weight_decay > 0,
        fused_optimizer=config.fused_optimizer,
        defer_grad_sync=config.defer_grad_sync,
        checkpoint_ops=config.checkpoint_mode == "op",
        direct=config.single_device_path == "direct" and batch.devices == 1,
        sequences_per_example=batch.sequences_per_example,
    )


def _stored_bytes(param: torch.Tensor) -> float:
    if is_nf4(param):
        return param.numel() * nf4_bits_per_weight() / 8
    return float(param.numel() * param.element_size())


def _gathered_bytes(param: torch.Tensor, config: TrainConfig) -> float:
    """What FSDP2's all-gather outputs for this parameter: its mixed-precision policy's compute
    dtype for trained fp32 masters, a frozen (compute-dtype) or NF4 one as stored."""
    if is_nf4(param) or not param.requires_grad:
        return _stored_bytes(param)
    element = torch.empty((), dtype=compute_dtype(config.precision)).element_size()
    if config.precision in ("bf16-true", "fp32"):
        element = param.element_size()
    return float(param.numel() * element)


def _adapted_features(layer: nn.Module) -> int:
    """LoRA: the sum of in and out features of the projections adapted in this layer."""
    total = 0
    for module in layer.modules():
        features: Any = module  # peft's LoRA layers: in_features and out_features are ints
        if hasattr(module, "lora_A") and hasattr(module, "in_features"):
            total += int(features.in_features) + int(features.out_features)
    return total


def facts_from_meta(
    meta: MetaModel, hf_config: Any, config: TrainConfig, name: str = ""
) -> ModelFacts:
    """The counts of a model built on meta with the run's transforms (`transform_model`)."""
    model, info = meta.model, meta.info
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    hidden = int(getattr(text, "hidden_size", None) or text.n_embd)
    heads = int(getattr(text, "num_attention_heads", None) or text.n_head)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    vocab = int(text.vocab_size)
    layer = meta.layers[0]
    layer_ids = {id(p) for p in layer.parameters()}
    layer_params = list(layer.parameters())
    ends = [p for p in model.parameters() if id(p) not in layer_ids]
    layers = len(meta.layers)
    # the parameters outside the first layer, less the other layers (alike: `ends` holds them)
    other_layers = layers - 1
    layer_numel = sum(p.numel() for p in layer_params)
    layer_trainable = sum(p.numel() for p in layer_params if p.requires_grad)
    adapters = layer_trainable if config.lora else 0
    tied = bool(getattr(text, "tie_word_embeddings", False))
    untied_output = 0 if tied else vocab * hidden
    layer_matmul = round((info.active_parameters - untied_output) / layers) + adapters
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    layer_stored = sum(_stored_bytes(p) for p in layer_params)
    layer_gathered = sum(_gathered_bytes(p, config) for p in layer_params)
    ends_stored = sum(_stored_bytes(p) for p in ends) - other_layers * layer_stored
    ends_gathered = sum(_gathered_bytes(p, config) for p in ends) - other_layers * layer_gathered
    ends_trainable = trainable - layers * layer_trainable
    return ModelFacts(
        name=name or str(config.model),
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=vocab,
        parameters=sum(p.numel() for p in model.parameters()),
        trainable=trainable,
        layer_parameters=layer_numel,
        layer_trainable=layer_trainable,
        layer_quantized=sum(p.numel() for p in layer_params if is_nf4(p)),
        layer_matmul_parameters=layer_matmul,
        layer_stored_bytes=round(layer_stored),
        layer_gathered_bytes=round(layer_gathered),
        ends_stored_bytes=max(0, round(ends_stored)),
        ends_gathered_bytes=max(0, round(ends_gathered)),
        ends_trainable=max(0, ends_trainable),
        adapted_features=_adapted_features(layer) if config.lora else 0,
        seq_length=config.seq_length,
        useful_flops_per_token=training_flops_per_token(
            hf_config, model, info.active_parameters, config
        ),
        attention_flops_per_token=attention_flops_per_token(text, config.seq_length),
        trainable_tensors=sum(1 for p in model.parameters() if p.requires_grad),
    )


# The settings a model's counts do not depend on: the search varies them on one count.
_SEARCHED = {
    "batch_size_per_device": 1, "gradient_accumulation_steps": None, "sharding": "full",
    "gradient_checkpointing": False, "checkpoint_layers": None, "sequence_parallel": 1,
    "compile": False, "cpu_offload": False, "defer_grad_sync": False,
}  # fmt: skip
_FACTS: dict[tuple[str, str], ModelFacts] = {}


def model_facts(config: TrainConfig) -> ModelFacts:
    """`config`'s model built on meta (its config.json only) with the run's transforms, counted
    (once per model and transform: the search asks for it for every candidate)."""
    from fsdp_utils.hub.resolve import load_model_config

    folder = model_config_dir(config)
    key = ((folder / "config.json").read_text(), config.replace(**_SEARCHED).to_json())
    if key not in _FACTS:
        hf_config = load_model_config(folder)
        built = build_meta_model(
            hf_config, config.precision, attn_implementation=config.attn_implementation
        )
        _FACTS[key] = facts_from_meta(transform_model(built, config), hf_config, config)
    return _FACTS[key]


def workload(config: TrainConfig, world_size: int) -> tuple[ModelFacts, RunShape]:
    """What the step-time model reads of `config` on `world_size` GPUs: its model's counts and
    its settings with the batch plan's arithmetic (a prediction and a finished run's row)."""
    facts = model_facts(config)
    return facts, run_shape(config, plan_batch(config, world_size), facts.layers)
