"""`--freeze_layers N`: train only the top of the model (llama-recipes' freeze_layers).

A model transform applied on the meta model (`fsdp_utils.model.transforms.transform_model`),
before activation checkpointing and FSDP2, as LoRA is, so the trainer, the preflight, the
storage check and the memory planner all see the same frozen model:

- The embeddings (every `nn.Embedding` outside the decoder layers: tokens, and learned
  positions for GPT-2) and the first N decoder layers stop requiring gradients. A `lm_head` tied
  to the token embeddings (Qwen2, Gemma, GPT-2) is the same tensor and is frozen with them.
- A frozen weight is stored in the compute dtype when that holds the pretrained values exactly
  (the checkpoint's own dtype is the compute dtype: a bf16 model trained bf16-mixed), else in the
  storage dtype: no fp32 master copy where none is needed, and the exported model holds exactly
  the pretrained values either way.
- FSDP2: a frozen decoder layer's group holds no trainable parameter, and the root group holds
  the frozen embeddings beside the trainable final norm and lm_head, whose one dtype is the
  storage dtype (FSDP2 asks for one original dtype among a group's *trainable* parameters only,
  torch 2.13 `FSDPParamGroup._init_mp_dtypes`). No group changes from frozen to trainable
  during the run, which FSDP2 mishandles (pytorch 186998; see `fsdp_utils.model.lora`).
- Nothing below layer N needs a gradient, so autograd stops there: the frozen layers run
  forward only, save no activations and are not gathered again in backward (FSDP2 finishes
  their groups in its final backward callback).

Optimizer state exists for trainable parameters only (`build_optimizer` takes those), and
checkpoints hold only what trains (`state_dict_options`): every run, a resumed one too, loads the
frozen part from the pretrained model first (`trains_a_subset`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.model.build import compute_dtype, config_dtype, param_dtype_for


def trains_a_subset(config: TrainConfig) -> bool:
    """LoRA or --freeze_layers: part of the model keeps its pretrained values. Checkpoints then
    hold only what trains, and every run loads the pretrained weights first, a resume too."""
    return config.lora or config.freeze_layers > 0


def frozen_dtype(hf_config: Any, config: TrainConfig) -> torch.dtype:
    """The dtype of a frozen weight: the compute dtype when the pretrained checkpoint is in it
    (no value changes), else the storage dtype (fp32 holds fp16 and bf16 values exactly)."""
    compute = compute_dtype(config.precision)
    return compute if config_dtype(hf_config) == compute else param_dtype_for(config.precision)


def embeddings(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """The embedding lookups outside the decoder layers."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and id(m) not in inside
    ]


def check_freeze_layers(count: int, layers: int) -> None:
    if count > layers:
        raise ValueError(
            f"--freeze_layers {count}: the model has {layers} decoder layers. Freeze at most "
            f"{layers} (then only the final norm and an untied lm_head train)."
        )


def freeze_layers(
    model: nn.Module, layers: list[nn.Module], hf_config: Any, config: TrainConfig
) -> None:
    """Freeze the embeddings and the first `config.freeze_layers` decoder layers and store them
    in `frozen_dtype`. In place, on the meta model (a dtype change costs nothing there)."""
    check_freeze_layers(config.freeze_layers, len(layers))
    frozen = [*embeddings(model, layers), *layers[: config.freeze_layers]]
    dtype = frozen_dtype(hf_config, config)
    for module in frozen:
        for param in module.parameters():
            param.requires_grad_(False)
            if param.dtype != dtype:
                param.data = param.data.to(dtype)


def frozen_layer_parameters(model: nn.Module) -> int:
    """Parameters of the frozen decoder layers: every frozen parameter but the embeddings'."""
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    lookups = {
        id(m.weight): m.weight.numel()
        for m in model.modules()
        if isinstance(m, nn.Embedding | nn.EmbeddingBag)
    }
    return frozen - sum(lookups.values())


def tied_output_frozen(model: nn.Module) -> bool:
    """Whether the output projection is the frozen token embedding (tied weights)."""
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    weight = getattr(output, "weight", None)
    return weight is not None and not weight.requires_grad


def identity(config: TrainConfig) -> dict[str, Any]:
    """What the checkpoint identity adds (nothing without --freeze_layers, so that existing
    checkpoints keep the identity they had)."""
    return {"freeze_layers": config.freeze_layers} if config.freeze_layers else {}


def describe(config: TrainConfig, model: nn.Module) -> str:
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    count = config.freeze_layers
    text = (
        f"the embeddings and decoder layer{'s' if count > 1 else ''} "
        f"{'0' if count == 1 else f'0-{count - 1}'} frozen: {frozen / 1e6:,.3f}M parameters "
        f"frozen, {trainable / 1e6:,.3f}M trainable"
    )
    if tied_output_frozen(model):
        text += "; lm_head is tied to the token embeddings, so it is frozen too"
    return text
