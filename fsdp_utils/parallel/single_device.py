"""`--single_device_path direct`: one process without FSDP2, with FSDP2's numerics.

On one GPU FSDP2 still wraps every decoder layer: before each layer's forward (and again before
its backward, the layer having been resharded) it copies the fp32 shard into an all-gather
buffer in the compute dtype, runs a one-rank all-gather, and copies the result out into the
layer's unsharded parameters; after its backward it copies the gradients into a reduce-scatter
buffer in fp32, runs a one-rank reduce-scatter and copies the result into the sharded
gradients. pytorch #152710 lists a fast path for this as future work. The direct path keeps
what those copies compute and drops the copies: each shard group of FSDP2 (each decoder layer,
and the root with what is outside the layers) casts its own fp32 parameters to the compute
dtype as its forward begins, and autograd takes the gradients back through the cast.

Exactly FSDP2's numbers (MixedPrecisionPolicy(param_dtype=bf16 or fp16, reduce_dtype=fp32),
`fsdp_utils.parallel.parallelize.mixed_precision_policy`), operation for operation:

- the forward computes with the parameters rounded once to the compute dtype (FSDP2's copy-in
  casts the same way) and with the layer's floating-point inputs cast to it
  (`cast_forward_inputs`, FSDP2's `_cast_fp_tensor`);
- a parameter's gradient is computed in the compute dtype (a weight used twice, as tied
  embeddings, summed there first, as FSDP2's unsharded parameter sums it), then cast to fp32
  (the cast's backward; FSDP2 casts to reduce_dtype before its reduce-scatter) and summed into
  the fp32 gradient over micro-batches (AccumulateGrad; FSDP2 adds each micro-batch's reduced
  gradient to the sharded one). A one-rank reduce-scatter changes nothing and FSDP2 divides by
  the world size, 1;
- the master weights, the gradients and the optimizer state stay fp32 tensors of the same names
  and shapes, so checkpoints (torch.distributed.checkpoint stores global tensors) load on any
  number of processes, and FSDP2's checkpoints here.

What differs is memory and time: a layer's compute-dtype copy lives from its forward to its
backward (FSDP2 at one rank frees it after the forward and gathers it again: --reshard_last_layer
aside), 2 bytes per parameter of the layers that activation checkpointing does not recompute;
the cast runs inside a checkpointed layer, so there it is recomputed in backward and freed.
Forwards without gradients keep their casts until the parameters change (decoding casts once,
not per token: `_cast_for_forward`), 2 bytes per parameter while they last, as FSDP2's groups
kept gathered for decoding. The memory planner traces the training step as the FSDP2 run that
holds the same bytes (fsdp_utils/plan/estimate.py, `_direct_to_trace`).

fp32 and bf16-true have nothing to cast (FSDP2 runs them with its default policy): the model
runs as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.model.build import compute_dtype
from fsdp_utils.model.qlora import is_nf4


def uses_direct_path(config: TrainConfig, world_size: int) -> bool:
    """--single_device_path direct on one process (on more it means nothing: FSDP2 runs)."""
    return config.single_device_path == "direct" and world_size == 1 and not config.no_fsdp


def apply_direct_path(model: nn.Module, layers: list[nn.Module], config: TrainConfig) -> None:
    """Hooks that cast each group's parameters (each decoder layer's, and the root's: what is
    outside the layers) and each layer's inputs to the compute dtype for its forward, in place
    of FSDP2. `layers`: the decoder layers as `parallelize` left them (checkpoint wrappers:
    the cast goes inside, so that the recompute casts again)."""
    if config.precision not in ("bf16-mixed", "fp16-mixed"):
        return
    dtype = compute_dtype(config.precision)
    inner = [getattr(layer, "_checkpoint_wrapped_module", layer) for layer in layers]
    in_layers = {id(m) for layer in inner for m in layer.modules()}
    for layer in inner:
        _cast_for_forward(layer, list(layer.modules()), dtype, cast_inputs=True)
    outside = [m for m in model.modules() if id(m) not in in_layers]
    _cast_for_forward(model, outside, dtype, cast_inputs=False)


def _cast_for_forward(
    owner: nn.Module, modules: list[nn.Module], dtype: torch.dtype, *, cast_inputs: bool
) -> None:
    """On `owner`'s forward: the floating-point parameters of `modules` replaced by their casts
    to `dtype` (and, with `cast_inputs`, its floating-point inputs cast) until the forward ends.
    The root's hooks run outside the loss's: that hook is prepended at each forward
    (fsdp_utils.train.step.forward_target_chunks), so the chunks see the cast output layer.

    Forwards without gradients (an evaluation, decoding token by token: GRPO's rollouts, the
    chess evaluation) reuse their casts while the parameter is unchanged (its version counter:
    the optimizer's and the loader's in-place writes move it), as FSDP2 keeps its groups
    gathered for decoding (`parallelize.gathered_parameters`): one cast per optimizer step,
    not one per token. The first forward with gradients drops them."""
    swapped: list[list[tuple[dict[str, Any], str, nn.Parameter]]] = []
    kept: dict[int, tuple[int, torch.Tensor]] = {}  # id(parameter): (its version, its cast)

    def cast_of(param: nn.Parameter, grad: bool) -> torch.Tensor:
        if grad:
            return param.to(dtype)  # differentiable: the gradient comes back through it
        hit = kept.get(id(param))
        if hit is None or hit[0] != param._version:
            hit = kept[id(param)] = (param._version, param.detach().to(dtype))
        return hit[1]

    @torch._dynamo.disable  # eager around a compiled layer, as FSDP2's hooks are
    def before(module: nn.Module, args: Any, kwargs: Any) -> Any:
        grad = torch.is_grad_enabled()
        if grad:
            kept.clear()
        casts: dict[int, torch.Tensor] = {}  # a weight shared by two modules is cast once
        done: list[tuple[dict[str, Any], str, nn.Parameter]] = []
        for sub in modules:
            for name, param in list(sub._parameters.items()):
                if not _castable(param, dtype):
                    continue
                assert param is not None
                if id(param) not in casts:
                    casts[id(param)] = cast_of(param, grad)
                done.append((sub._parameters, name, param))
                # a plain tensor where the parameter was, as torch.func.functional_call and
                # FSDP2's unsharded parameters do: the module's forward reads it as its weight
                sub._parameters[name] = casts[id(param)]  # type: ignore[assignment]
        swapped.append(done)
        if not cast_inputs:
            return None
        return tree_map_only(torch.Tensor, _floating_to(dtype), (args, kwargs))

    @torch._dynamo.disable
    def after(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        for parameters, name, param in swapped.pop():
            parameters[name] = param
        return None

    owner.register_forward_pre_hook(before, with_kwargs=True)
    owner.register_forward_hook(after, with_kwargs=True, always_call=True)


def _castable(param: nn.Parameter | None, dtype: torch.dtype) -> bool:
    """A parameter FSDP2 would cast: floating point, in another dtype, not a 4-bit weight
    (--quantize's NF4 weights dequantize themselves per matmul; FSDP2 leaves them to it too)."""
    return (
        param is not None
        and not is_nf4(param)
        and torch.is_floating_point(param)
        and param.dtype != dtype
    )


def _floating_to(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def cast(x: torch.Tensor) -> torch.Tensor:  # FSDP2's _cast_fp_tensor
        return x.to(dtype) if torch.is_floating_point(x) and x.dtype != dtype else x

    return cast


def describe_direct_path(config: TrainConfig) -> str:
    """The log's words for the path."""
    if config.precision in ("bf16-mixed", "fp16-mixed"):
        dtype = str(compute_dtype(config.precision)).removeprefix("torch.")
        return (
            f"one device, direct (no FSDP2; fp32 master weights, {dtype} compute copies cast by "
            "each layer)"
        )
    return f"one device, direct (no FSDP2; {config.precision}: nothing to cast)"
