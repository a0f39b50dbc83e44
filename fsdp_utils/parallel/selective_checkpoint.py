"""`--checkpoint_mode op`: op-level selective activation checkpointing, torchtitan's policy.

Whole-layer checkpointing (`--checkpoint_mode layer`, the default) keeps a checkpointed decoder
layer's input and recomputes the whole layer in backward: its matrix products and attention
too, the most expensive part of the layer. Op-level checkpointing keeps the outputs of some
operators and recomputes only the rest, through torch's selective checkpointing
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`: a policy says, for every
operator the layer's forward runs, whether its output is saved or recomputed).

The policy is torchtitan's (`torchtitan/distributed/activation_checkpoint.py`, `_apply_op_sac`
and its save list): save the outputs of attention (every SDPA kernel, and flex attention),
of reduce-scatters and of every second matrix product, and recompute everything else: norms,
rotary embeddings, activations, the elementwise glue. In a Llama layer's forward the products
come in the order q, k, v, o, gate, up, down, so the outputs of q, v, gate and down are saved
(the 1st, 3rd, 5th and 7th) and k, o and up are recomputed: torchtitan saves every second one
to keep the memory between whole-layer checkpointing's and none. On Llama 3 8B (64 A100s) this
ran at 58.2% MFU against 56.8% for whole layers (torchtitan's performance notes).

Exact: a saved output is the tensor the forward computed, a recomputed one is computed again by
the same kernels from the same inputs, so backward sees the values it would see without any
checkpointing (tests/test_selective_checkpoint.py compares losses and final weights of 2-process
runs bit for bit).

Beside torchtitan's list: the CPU's flash kernel (`_scaled_dot_product_flash_attention_for_cpu`,
so that CPU runs and the memory planner, which traces on the CPU, save attention as the GPU
does), `addmm`, the matrix product with a bias (Qwen2's q, k, v projections, GPT-2's Conv1D),
and `_scaled_mm`, --float8's float8 product (torchao's Float8Linear), counted among the products. The count restarts at every checkpointed layer and is kept apart for
the forward and the recompute, so both pick the same products.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def _ops(*names: str, namespace: Any = torch.ops.aten) -> frozenset[Any]:
    """The default overloads of the named operators that this torch build has."""
    found = set()
    for name in names:
        packet = getattr(namespace, name, None)
        if packet is not None:
            found.add(packet.default)
    return frozenset(found)


# Matrix products, of which every second output is saved: `_scaled_mm` is how --float8's
# layers (torchao's Float8Linear) run theirs; a torch without it leaves it out (`_ops`).
MATMULS = _ops("mm", "addmm", "linear", "_scaled_mm")
# Saved whenever they run: attention (what it costs most to recompute, and what a fused kernel
# keeps for its own backward anyway: output and log-sum-exp), the reduce-scatter of a sharded
# collective, and the amax of float8 scaling (torchtitan's list).
ALWAYS_SAVED = (
    _ops(
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_scaled_dot_product_flash_attention_for_cpu",
        "max",
    )
    | _ops("reduce_scatter_tensor", namespace=torch.ops._c10d_functional)
    | frozenset({torch._higher_order_ops.flex_attention})
)

Policy = Callable[..., CheckpointPolicy]


def op_policy() -> Policy:
    """A fresh policy for one checkpointed region (one layer's forward and its recompute)."""
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in MATMULS:
            phase = "recompute" if ctx.is_recompute else "forward"
            counts[phase] += 1
            save = counts[phase] % 2 == 1
        else:
            save = func in ALWAYS_SAVED
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(op_policy())


def wrap_layer(layer: nn.Module, mode: str) -> nn.Module:
    """`layer` in a non-reentrant checkpoint wrapper: whole-layer (`layer`) or op-level
    (`op`). Non-reentrant checkpointing works with keyword arguments (HF layers take many) and
    with FSDP2's hooks; reentrant does neither well."""
    if mode == "op":
        return checkpoint_wrapper(
            layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=_op_contexts
        )
    assert mode == "layer", mode
    return checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
