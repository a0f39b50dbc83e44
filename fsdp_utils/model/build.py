"""Model construction: build on the meta device, find the decoder layers, materialise shards.

The flow (torchtitan's): `build_meta_model` -> `parallelize` (`fsdp_utils.parallel.parallelize`)
-> `materialize` (to_empty on the real device) -> `load_pretrained_weights`
(`fsdp_utils.model.weights`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fsdp_utils.config.train_config import Precision


def param_dtype_for(precision: Precision) -> torch.dtype:
    """dtype in which parameters (and so optimizer state) are stored."""
    return torch.bfloat16 if precision == "bf16-true" else torch.float32


def compute_dtype(precision: Precision) -> torch.dtype:
    """dtype in which the forward and backward compute (FSDP2's param_dtype, DDP's autocast,
    LoRA's frozen base)."""
    if precision == "fp16-mixed":
        return torch.float16
    return torch.float32 if precision == "fp32" else torch.bfloat16


def config_dtype(hf_config: Any) -> torch.dtype | None:
    """The dtype a model config declares (`dtype`, or `torch_dtype` in transformers 4): the
    dtype of its checkpoint's weights."""
    for key in ("dtype", "torch_dtype"):
        value = getattr(hf_config, key, None)
        if isinstance(value, str):
            value = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(value, torch.dtype):
            return value
    return None


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device but buffers for real (on CPU).

    Non-persistent buffers (rotary `inv_freq`, causal masks) are computed in `__init__` and are
    not in the checkpoint; building them for real here means we can restore them after
    `to_empty`, for any architecture, without knowing how each one computes them.
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        # A parameter already on meta is being shared (tied embeddings): keep the same object.
        if param is not None and param.device.type != "meta":
            # Parameters are created with torch.empty (pages never touched) and initialised
            # only after registration, so the initialisation runs on meta: no time, no RAM.
            registered = module._parameters[name]
            assert registered is not None
            module._parameters[name] = type(registered)(
                registered.to(torch.device("meta")), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_meta_model(
    hf_config: Any, precision: Precision, *, attn_implementation: str = "sdpa"
) -> nn.Module:
    """Instantiate the architecture with parameters on `meta` (no memory) in the storage dtype,
    with the attention implementation `attn_implementation` (see fsdp_utils.model.attention)."""
    from transformers import AutoModelForCausalLM

    dtype = param_dtype_for(precision)
    previous = torch.get_default_dtype()
    source_dtype = getattr(hf_config, "dtype", None)
    # sdpa goes as transformers' default (None), which falls back to eager for the models that
    # cannot run SDPA (Gemma 2's soft-capping), as from_pretrained does. Always passed: the
    # config remembers the last one it was given.
    requested = None if attn_implementation == "sdpa" else attn_implementation
    torch.set_default_dtype(dtype)
    try:
        with _parameters_on_meta():
            model = AutoModelForCausalLM.from_config(
                hf_config, dtype=dtype, attn_implementation=requested
            )
    except ValueError as err:
        raise ValueError(
            f"transformers cannot build a causal LM from this config ({hf_config.model_type}): "
            f"{err}"
        ) from err
    finally:
        torch.set_default_dtype(previous)
    # from_config writes the storage dtype into the config it was given, which checkpoints
    # save: keep the model's own dtype there, the one the final model is exported in.
    model.config.dtype = source_dtype
    # The KV cache is useless in training and costs memory.
    model.config.use_cache = False
    return model


# --- decoder layers ----------------------------------------------------------------------


def _module_lists(model: nn.Module) -> Iterator[tuple[str, nn.ModuleList]]:
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            yield name, module


def find_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks, in order, found from the model itself.

    1. `_no_split_modules`: transformers lists there the block classes that must not be split
       across devices, which are exactly the decoder layers (LlamaDecoderLayer, GPT2Block,
       GPTNeoXLayer, ...).
    2. Otherwise the longest `nn.ModuleList` whose children all have one class (the repeated
       block).
    """
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    if no_split:
        layers = [m for m in model.modules() if type(m).__name__ in no_split]
        if layers:
            return layers
    best: list[nn.Module] = []
    for _, modules in _module_lists(model):
        classes = Counter(type(m) for m in modules)
        if len(classes) == 1 and len(modules) > len(best):
            best = list(modules)
    if not best:
        raise ValueError(
            f"Cannot find the decoder layers of {type(model).__name__}: it declares no "
            "_no_split_modules and has no list of identical blocks. Use --no_layer_wrap_policy "
            "to shard the whole model as one unit."
        )
    return best


def _all_named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Every (name, parameter), shared ones under each of their names, named as in the
    checkpoint: without the activation-checkpointing wrapper's prefix."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    for name, param in model.named_parameters(remove_duplicate=False):
        yield name.replace(_CHECKPOINT_PREFIX, ""), param


def tied_parameter_names(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share storage (e.g. embed_tokens and lm_head)."""
    by_id: dict[int, list[str]] = {}
    for name, param in _all_named_parameters(model):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(all parameters, parameters outside the embeddings), counting tied weights once."""
    total = sum(p.numel() for p in model.parameters())
    embedding = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)
    )
    return total, total - embedding


def routed_expert_parameters(model: nn.Module) -> int:
    """Parameters of the routed experts of a mixture-of-experts model, of which each token uses
    only its top-k: transformers names that module `experts` in every MoE family (a shared
    expert, which every token uses, is `shared_expert`). 0 for dense models."""
    seen: set[int] = set()
    total = 0
    for name, module in model.named_modules():
        if name.rpartition(".")[2] == "experts":
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    total += param.numel()
    return total


def experts_per_token(hf_config: Any) -> tuple[int, int] | None:
    """(experts a token is routed to, routed experts per layer) from a transformers MoE config:
    `num_experts_per_tok` of `num_local_experts` (Mixtral, gpt-oss) or `num_experts` (Qwen-MoE,
    OLMoE, DeepSeek's `n_routed_experts`); None for dense models."""
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        experts = getattr(hf_config, name, None)
        if isinstance(top_k, int) and isinstance(experts, int) and experts > 0:
            return top_k, experts
    return None


def active_parameters(model: nn.Module, hf_config: Any, non_embedding: int) -> int:
    """Non-embedding parameters one token passes through: all of a dense model's; for a
    mixture of experts top-k / experts of the routed experts' and all the rest (attention,
    routers, shared experts, norms)."""
    routing = experts_per_token(hf_config)
    routed = routed_expert_parameters(model)
    if routing is None or routed == 0:
        return non_embedding
    top_k, experts = routing
    return non_embedding - routed + round(routed * top_k / experts)


# --- materialisation and weight loading -----------------------------------------------------


def materialize(model: nn.Module, device: torch.device, *, offload: bool = False) -> None:
    """Allocate the (sharded) parameters on `device`; restore the real non-persistent buffers.

    `to_empty` keeps FSDP2's DTensor sharding, so each rank allocates only its shard.
    `offload` (--cpu_offload): FSDP2's CPUOffloadPolicy keeps the sharded parameters in host
    memory and copies them to the GPU per layer, so they must be created on the CPU; a shard
    created on the GPU fails at the first state_dict ("Attempted to set the storage of a tensor
    on device cpu to a storage on different device cuda:0", the first H100 run). Buffers and
    the parameters FSDP2 does not manage (an NF4 weight left unsplit) stay on `device`: the
    forward reads them there (torchtitan: init_device "cpu", buffer_device the GPU).
    """
    buffers = {
        name: buf.detach().clone() for name, buf in model.named_buffers(remove_duplicate=False)
    }
    for name, buf in buffers.items():
        assert buf.device.type != "meta", f"buffer {name} was built on meta"
    tied = tied_parameter_names(model)
    params_on = parameter_device(device, offload=offload)
    model.to_empty(device=params_on)
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    saved = buffers[f"{module_name}.{name}" if module_name else name]
                    module._buffers[name] = saved.to(device=device, dtype=buf.dtype)
            if params_on != device:
                for name, param in module._parameters.items():
                    if param is not None and not _is_dtensor(param):
                        module._parameters[name] = nn.Parameter(
                            param.to(device), requires_grad=param.requires_grad
                        )
    _retie(model, tied)
    for param in model.parameters():
        _materialize_inner_tensors(param, params_on if _is_dtensor(param) else device)


def parameter_device(device: torch.device, *, offload: bool) -> torch.device:
    """Where `materialize` creates the parameters FSDP2 shards: the host under CPU offload."""
    return torch.device("cpu") if offload else device


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _materialize_inner_tensors(param: torch.Tensor, device: torch.device) -> None:
    """A tensor subclass's `empty_like` may move only some of its inner tensors: torchao's
    NF4Tensor (`--quantize nf4`) moves those FSDP2 shards and leaves its per-tensor constants
    (the scale mean, the 16 code values) on meta. Give those storage on `device` too; loading
    fills them."""
    local = getattr(param, "_local_tensor", param)  # the DTensor's own, not a view of it
    flatten = getattr(local, "__tensor_flatten__", None)
    if flatten is None:  # a plain tensor
        return
    names, _ = flatten()
    for name in names:
        inner = getattr(local, name)
        if inner.is_meta:
            setattr(local, name, torch.empty_like(inner, device=device))


def _retie(model: nn.Module, tied: list[list[str]]) -> None:
    """`to_empty` gives each module its own new tensor, untying shared weights of plain
    modules (FSDP2 keeps them shared). Point the followers back at the leader."""
    params = dict(_all_named_parameters(model))
    for leader, *followers in tied:
        for follower in followers:
            if params[follower] is not params[leader]:
                module_name, _, attr = follower.rpartition(".")
                owner = model.get_submodule(module_name) if module_name else model
                setattr(owner, attr, params[leader])
