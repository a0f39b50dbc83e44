"""Apply activation checkpointing and FSDP2 (or DDP) to a model, in torchtitan's fixed order:

0. split attention (`--sequence_parallel`: fsdp_utils/parallel/ulysses.py), registered with
   transformers and named in the model's config, so that the layers below call it;
1. activation checkpointing on decoder layers (non-reentrant; every Nth layer if asked; whole
   layers or op-level, `--checkpoint_mode`: fsdp_utils/parallel/selective_checkpoint.py);
2. `torch.compile` on each decoder layer, or on the decoder stack (`--compile`,
   `--compile_scope`: fsdp_utils/parallel/compile.py): identical layers share one compiled
   graph, and FSDP2's hooks stay outside it;
3. `fully_shard` on each decoder layer: one shard group per layer, so only one layer's full
   parameters exist at a time;
4. `fully_shard` on the root, which takes everything else (embeddings, final norm, lm_head).
   Tied input/output embeddings must stay in one group (torch 2.13 fails at the first forward
   if they are split), and the root holds both.

On one process with `--single_device_path direct`, 3 and 4 are the direct path's casts
instead (fsdp_utils/parallel/single_device.py).

The model is still on the meta device here; `fsdp_utils.model.build.materialize` allocates the shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.nn.parallel import DistributedDataParallel

from fsdp_utils.config.train_config import Precision, TrainConfig
from fsdp_utils.model.build import build_meta_model, compute_dtype
from fsdp_utils.model.qlora import (
    check_shardable,
    quantized_parameters,
    quantized_shapes,
    shard_group_size,
)
from fsdp_utils.model.transforms import MetaModel, ModelInfo, transform_model
from fsdp_utils.parallel.compile import apply_compile
from fsdp_utils.parallel.distributed import DistEnv, build_mesh
from fsdp_utils.parallel.selective_checkpoint import wrap_layer
from fsdp_utils.parallel.single_device import (
    apply_direct_path,
    describe_direct_path,
    uses_direct_path,
)
from fsdp_utils.parallel.ulysses import use_split_attention


def mixed_precision_policy(precision: Precision) -> MixedPrecisionPolicy:
    """Compute dtype for FSDP2. Gradients are reduced in fp32 for the mixed modes so that the
    sum over ranks loses nothing; bf16-true keeps everything (and so its traffic) in bf16."""
    if precision in ("bf16-mixed", "fp16-mixed"):
        return MixedPrecisionPolicy(
            param_dtype=compute_dtype(precision), reduce_dtype=torch.float32
        )
    return MixedPrecisionPolicy()


def apply_activation_checkpointing(
    model: nn.Module,
    layers: list[nn.Module],
    every_n: int = 1,
    *,
    first_n: int | None = None,
    mode: str = "layer",
) -> list[nn.Module]:
    """Wrap every `every_n`-th decoder layer in a non-reentrant checkpoint wrapper, in place:
    whole-layer or op-level (`mode`, `selective_checkpoint.wrap_layer`); with `first_n`
    (--checkpoint_layers), only the first `first_n` layers, whose activations are held longest:
    their backward comes last.

    Returns the decoder layers as they now are in the model (wrapped or not), in order.
    """
    parents: dict[int, tuple[nn.Module, str]] = {}
    for module in model.modules():
        for child_name, child in module.named_children():
            parents[id(child)] = (module, child_name)
    result = []
    for index, layer in enumerate(layers):
        if index % every_n != 0 or (first_n is not None and index >= first_n):
            result.append(layer)
            continue
        parent, child_name = parents[id(layer)]
        wrapped = wrap_layer(layer, mode)
        parent.register_module(child_name, wrapped)
        result.append(wrapped)
    return result


def parallelize(
    model: nn.Module,
    layers: list[nn.Module],
    mesh: DeviceMesh | None,
    config: TrainConfig,
    *,
    direct: bool = False,
) -> nn.Module:
    """Split attention, activation checkpointing, compilation, then FSDP2 per decoder layer,
    then the root (or DDP, or the direct path). FSDP2's mesh is every rank, with or without
    sequence parallelism.

    For DDP (`--no_fsdp`) only checkpointing is applied here; `wrap_ddp` runs after the
    weights are loaded, because DDP needs real parameters. `direct`: one process without
    FSDP2 (`single_device.uses_direct_path`).
    """
    if config.sequence_parallel > 1:
        use_split_attention(model)
    if config.gradient_checkpointing or config.checkpoint_layers:
        layers = apply_activation_checkpointing(
            model,
            layers,
            config.checkpoint_every_n_layers,
            first_n=config.checkpoint_layers,
            mode=config.checkpoint_mode,
        )
    if config.compile:
        apply_compile(model, layers, config.compile_scope)
    if config.no_fsdp:
        return model
    if direct:
        apply_direct_path(model, layers, config)
        return model
    assert mesh is not None
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        if config.cpu_offload
        else OffloadPolicy()
    )
    fsdp_kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mixed_precision_policy(config.precision),
        "offload_policy": offload,
        "ignored_params": _unsplit_nf4(model, mesh),
    }
    reshard = config.sharding != "shard_grad_op"
    if not config.no_layer_wrap_policy:
        for index, layer in enumerate(layers):
            # The last layer's parameters are needed again right at the start of backward:
            # resharding them after forward would only all-gather them again (torchtitan),
            # unless --reshard_last_layer trades that all-gather for their memory.
            keep = index == len(layers) - 1 and not config.reshard_last_layer
            fully_shard(layer, reshard_after_forward=reshard and not keep, **fsdp_kwargs)
        # The root's (embeddings, final norm, output layer) likewise: the loss's backward needs
        # them first. Kept gathered (FSDP2's default for a root), they take one all-gather per
        # micro-batch instead of two; a state dict still reads them sharded (FSDP's hook).
        fully_shard(model, reshard_after_forward=False, **fsdp_kwargs)
    else:  # the root holds every layer: resharding after forward frees them all
        fully_shard(model, reshard_after_forward=reshard, **fsdp_kwargs)
    return model


def _unsplit_nf4(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter] | None:
    """The NF4 weights (--quantize nf4) when FSDP2 splits nothing (one rank per shard group:
    one process, --sharding no_shard): left out of FSDP2, each rank holding them whole as it
    would anyway. Its one-rank shortcut copies only the first tensor an all-gather extension
    gives (pytorch#197999, open in torch 2.13): NF4 gives three (codes, scales, factors)."""
    if mesh.size(mesh.ndim - 1) > 1:
        return None
    return set(quantized_parameters(model).values()) or None


def parallelize_model(meta: MetaModel, config: TrainConfig, env: DistEnv) -> nn.Module:
    """Activation checkpointing, torch.compile and FSDP2 (or DDP's part) on a transformed meta
    model, over a device mesh of `env`'s world. Still on meta: `materialize` next."""
    direct = uses_direct_path(config, env.world_size)
    mesh = None if config.no_fsdp or direct else build_mesh(env, config.sharding)
    if config.quantize != "none" and not direct:  # NF4 splits by whole groups of scales only
        shards = shard_group_size(config, env.world_size, env.local_world_size)
        check_shardable(quantized_shapes(meta.model), shards)
    return parallelize(meta.model, meta.layers, mesh, config, direct=direct)


def build_parallel_model(
    hf_config: Any, config: TrainConfig, env: DistEnv
) -> tuple[nn.Module, ModelInfo]:
    """Build on meta, transform (`fsdp_utils.model.transforms`), parallelize: the model as the
    trainer runs it, still on meta. The memory planner (which materialises on fake tensors)
    uses this; the Trainer takes the same steps one by one, to map checkpoint keys and check
    the storage on the meta model first."""
    model = build_meta_model(
        hf_config, config.precision, attn_implementation=config.attn_implementation
    )
    meta = transform_model(model, config)
    return parallelize_model(meta, config, env), meta.info


def describe_parallelism(config: TrainConfig, world_size: int) -> str:
    """One line for the start of the log: how the model is spread and what saves memory."""
    if config.no_fsdp:
        kind = "DDP"
    elif uses_direct_path(config, world_size):
        kind = describe_direct_path(config)
    elif config.no_layer_wrap_policy:
        kind = f"FSDP2 ({config.sharding}) at the root only"
    else:
        kind = f"FSDP2 ({config.sharding}) per decoder layer"
    extras = []
    if config.sequence_parallel > 1:
        extras.append(f"sequence parallel {config.sequence_parallel} (Ulysses)")
    if (checkpointing := describe_checkpointing(config)) is not None:
        extras.append(checkpointing)
    if config.cpu_offload:
        extras.append("CPU offload")
    if config.reshard_last_layer:
        extras.append("the last layer resharded after forward")
    if config.compile:
        extras.append(f"compiled ({config.compile_scope})")
    if config.float8 != "none":
        extras.append(f"float8 {config.float8}")
    sync = "on last micro-batch" if config.defer_grad_sync else "every micro-batch"
    return ", ".join([kind, *extras, f"grad sync {sync}"])


def describe_checkpointing(config: TrainConfig) -> str | None:
    """'activation checkpointing', '... every 2 layers', '... of the first 12 layers', with
    '(op-level: ...)' under --checkpoint_mode op; None when no layer is checkpointed."""
    op = " (op-level: attention and every second matmul saved)"
    mode = op if config.checkpoint_mode == "op" else ""
    if config.checkpoint_layers is not None:
        if config.checkpoint_layers == 0:
            return None
        return f"activation checkpointing of the first {config.checkpoint_layers} layers{mode}"
    if not config.gradient_checkpointing:
        return None
    every = config.checkpoint_every_n_layers
    return "activation checkpointing" + (f" every {every} layers" if every > 1 else "") + mode


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def fsdp_group_names(model: nn.Module) -> list[str]:
    """Names of the modules that are FSDP2 shard groups ("" is the root)."""
    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def autocast_context(config: TrainConfig, device: torch.device) -> Callable[[], Any]:
    """Autocast for DDP mixed precision; FSDP2 casts through its policy, so nothing there."""
    if config.no_fsdp and config.precision in ("bf16-mixed", "fp16-mixed"):
        dtype = compute_dtype(config.precision)
        return lambda: torch.autocast(device_type=device.type, dtype=dtype)
    return contextlib.nullcontext


def gradient_sync_context(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
    """Skip (or do) the gradient reduction of the coming backward.

    FSDP2: without sync the unsharded gradients accumulate locally (more memory) and are
    reduce-scattered on the last micro-batch. DDP: `no_sync()`.
    """
    if isinstance(model, FSDPModule):
        FSDPModule.set_requires_gradient_sync(model, sync)
        return contextlib.nullcontext()
    if not sync and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


@contextlib.contextmanager
def no_grad_pass(model: nn.Module) -> Iterator[None]:
    """Forwards without gradients (an evaluation, generation, a reference's log-probabilities):
    the model in eval mode (no dropout) under no_grad, then back in the mode it was in, with
    every FSDP2 shard group resharded (`reshard`). Every no-grad pass over the trained model goes
    through here, so none leaves gathered parameters behind for the next step or optimizer."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
        reshard(model)


@contextlib.contextmanager
def gathered_parameters(model: nn.Module) -> Iterator[None]:
    """Within: every FSDP2 shard group keeps its parameters gathered after its forward, so the
    many small forwards of token-by-token decoding all-gather each group once (at the first
    forward) rather than once per token, as torchtune's GRPO recipe generates with
    `reshard_after_forward=False`. The price is the whole model's parameters, unsharded in
    the compute dtype, on every rank for as long as it lasts (the memory planner counts them
    for a rollout phase). On leaving, each group gets back its own setting and is resharded.
    No-op for DDP and single-device models."""
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    before = [_reshards_after_forward(m) for m in groups]
    for module in groups:
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for module, setting in zip(groups, before, strict=True):
            module.set_reshard_after_forward(setting, recurse=False)
        reshard(model)


def _reshards_after_forward(module: FSDPModule) -> bool:
    """A shard group's reshard_after_forward as `parallelize` set it. FSDP2 has a setter and no
    getter: its parameter groups keep a post-forward mesh exactly when they reshard. torch
    2.11 (our floor, the lent GPUs' image) holds one group per state (`_fsdp_param_group`,
    None without parameters); later releases a list (`_fsdp_param_groups`)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return any(group.post_forward_mesh_info is not None for group in groups)


def reshard(model: nn.Module) -> None:
    """Free every FSDP2 shard group's gathered parameters now. A forward under no_grad leaves
    the groups that do not reshard after forward (the root, the last decoder layer) gathered,
    as no backward comes to free them, and while they are, `model.parameters()` yields their
    gathered tensors, not the sharded parameters: an optimizer built then steps copies (found
    with DPO's reference pass, which runs before the optimizer is built: the last layer never
    trained on 2 processes). No-op for DDP and single-device models."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
