"""`--liger_kernels`: liger-kernel's Triton kernels in the model and the loss (CUDA only).

liger-kernel (github.com/linkedin/Liger-Kernel, BSD-2) replaces a transformers family's eager
RMSNorm, SwiGLU (GeGLU for Gemma) and rotary embedding with fused Triton kernels, through one
function per family (`apply_liger_kernel_to_llama`, ...), and computes the output layer and the
cross-entropy chunk by chunk with the gradients in the forward (its fused linear cross-entropy,
FLCE). How it meets this toolkit:

- **The layers**: the family's function is called on the built model, on the meta device before
  FSDP2 (`apply_liger_kernels`, from `fsdp_utils.parallel.materialize.build_model`), with
  `model=`: it rebinds the norm and MLP modules' `forward` (no parameter changes, so FSDP2
  shards them as before, and checkpointing and `--compile` wrap them as they are); it also
  replaces the family module's `apply_rotary_pos_emb` and its norm and MLP classes, for the
  process (a model of the family built later in it, a distillation teacher, gets them too).
- **The loss**: its own cross-entropy patches stay off (`cross_entropy`,
  `fused_linear_cross_entropy` False): the trainer computes its loss itself, over the target
  tokens only (train/loss.py). Where that loss already fuses the output layer and the
  cross-entropy (`_LinearNLLSum`: a plain bias-free output layer, a summed loss; Llama, Qwen,
  Mistral), liger's FLCE function takes its place (`FUSED_NLL_ATTRIBUTE` on the output layer):
  the same computation, in Triton. It runs inside the root module's forward, where FSDP2 holds
  the output layer's weight gathered, as ours does.

On the CPU there is no Triton backend: refused in the preflight with one line. The families
follow liger-kernel 0.8.5's `MODEL_TYPE_TO_APPLY_LIGER_FN` (liger_kernel/transformers/
monkey_patch.py), restricted to those this toolkit trains (fsdp_utils.synthetic); GPT-2,
GPT-NeoX, Qwen2-MoE and OLMoE have no liger function and are refused with the list.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from fsdp_utils.config.train_config import TrainConfig

# model_type -> liger-kernel's function for it (0.8.5: liger_kernel/transformers/monkey_patch.py)
FUNCTIONS = {
    "llama": "apply_liger_kernel_to_llama",
    "mistral": "apply_liger_kernel_to_mistral",
    "qwen2": "apply_liger_kernel_to_qwen2",
    "qwen3": "apply_liger_kernel_to_qwen3",
    "gemma": "apply_liger_kernel_to_gemma",
    "gemma2": "apply_liger_kernel_to_gemma2",
    "gemma3_text": "apply_liger_kernel_to_gemma3_text",
    "phi3": "apply_liger_kernel_to_phi3",
    "olmo2": "apply_liger_kernel_to_olmo2",
    "granite": "apply_liger_kernel_to_granite",
    "mixtral": "apply_liger_kernel_to_mixtral",
    "qwen3_moe": "apply_liger_kernel_to_qwen3_moe",
    "gpt_oss": "apply_liger_kernel_to_gpt_oss",
}
# The kernels asked of a family's function, where it takes them (Gemma's MLP is GeGLU, so its
# function takes `geglu`, not `swiglu`); its own loss patches off: the trainer's loss is ours.
KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "geglu": True}
LOSS_PATCHES = {"cross_entropy": False, "fused_linear_cross_entropy": False}
# The output layer's attribute that train/loss.py's fused sum calls instead of its own
FUSED_NLL_ATTRIBUTE = "fused_linear_nll_sum"
INSTALL = "pip install 'liger-kernel>=0.8.5' (on the login node, into the job's environment)"


def function_name(model_type: str) -> str:
    """liger-kernel's function for a family; ValueError (one paragraph) for one it lacks."""
    name = FUNCTIONS.get(model_type)
    if name is None:
        raise ValueError(
            f"--liger_kernels: liger-kernel has no kernels for {model_type} models (it patches "
            f"{', '.join(sorted(FUNCTIONS))}). Drop --liger_kernels; --compile fuses the same "
            "elementwise work for any family."
        )
    return name


def check_liger_kernels(hf_config: Any, config: TrainConfig, *, device_type: str | None) -> None:
    """The preflight's check: CUDA, a family liger-kernel patches, the package importable
    (`device_type` None: the run's GPUs are elsewhere; the rest is checked all the same)."""
    if not config.liger_kernels:
        return
    if device_type == "cpu":
        raise ValueError(
            "--liger_kernels needs a CUDA GPU (its kernels are Triton's), and this run is on the "
            "CPU: drop --liger_kernels."
        )
    function_name(hf_config.model_type)
    _monkey_patch()


def _monkey_patch() -> Any:
    try:
        from liger_kernel.transformers import monkey_patch
    except ImportError as err:
        raise ValueError(
            f"--liger_kernels: liger-kernel is not usable in this environment ({err}). "
            f"{INSTALL}, or drop --liger_kernels."
        ) from err
    return monkey_patch


def _family_function(model_type: str) -> tuple[str, Any, dict[str, bool]]:
    """(name, liger's function, the keywords it is called with) for a family."""
    name = function_name(model_type)
    apply = getattr(_monkey_patch(), name)
    accepted = inspect.signature(apply).parameters
    return name, apply, {k: v for k, v in {**KERNELS, **LOSS_PATCHES}.items() if k in accepted}


def apply_liger_kernels(model: nn.Module) -> None:
    """Patch `model` (a transformers causal LM, PEFT-wrapped or not, on meta) with its family's
    liger kernels, and give its output layer liger's fused linear cross-entropy for the loss."""
    base = getattr(model, "get_base_model", None)  # peft's wrapper (LoRA)
    inner: Any = base() if base is not None else model
    _, apply, options = _family_function(inner.config.model_type)
    apply(model=inner, **options)
    head: Any = inner.get_output_embeddings()
    setattr(head, FUSED_NLL_ATTRIBUTE, _liger_nll_sum())


def describe(model_type: str) -> str:
    """The log's line: 'liger: apply_liger_kernel_to_llama (rope, rms_norm, swiglu); ...'."""
    name, _, options = _family_function(model_type)
    kernels = ", ".join(k for k, on in options.items() if on)
    return (
        f"liger: {name} ({kernels}); the loss's fused output layer and cross-entropy in "
        "liger's FLCE where the loss fuses them"
    )


def _liger_nll_sum() -> Any:
    """sum(-log p(target)) of a plain linear output layer through liger's FLCE, accumulating
    its weight gradient in fp32 (as `_LinearNLLSum` does); the same arguments as it."""
    from liger_kernel.transformers.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyLoss,
    )

    loss = LigerFusedLinearCrossEntropyLoss(reduction="sum", accum_dtype=torch.float32)

    def nll_sum(
        hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        return loss(weight, hidden, tokens).float()  # its own chunks

    return nll_sum
