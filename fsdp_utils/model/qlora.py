"""QLoRA's 4-bit base (`--quantize nf4`, `--qlora`): torchao's `NF4Tensor`, as a model transform
on the meta model and a loader that quantizes one tensor at a time.

- **The transform** (`quantize_base`, inside `fsdp_utils.model.transforms.apply_transforms`,
  before LoRA and before `parallelize`, as torchtune puts `FrozenNF4Linear` before
  `fully_shard`): every `nn.Linear` weight of the decoder layers becomes an NF4 placeholder on
  meta (no memory, no quantization: the inner tensors are empty meta tensors of the right
  shapes), frozen, in the compute dtype it dequantizes to. NF4 is QLoRA's NormalFloat4: 4-bit
  codes in blocks of 64 values, each block's scale stored in 8 bits with one scale per 256
  blocks (double quantization): 4.126 bits per weight in bf16, plus a per-tensor mean. Embeddings,
  norms and the output layer are not touched (LoRA keeps them in the compute dtype). PEFT
  wraps the NF4 linears unchanged: `F.linear` on an NF4 weight dequantizes it (torchao's
  `LinearNF4`), backward too.
- **Sharding**: `NF4Tensor` implements FSDP2's all-gather hooks, so `fully_shard` splits its
  codes, scales and scale factors by rows and all-gathers them (4 bits over the wire). Each
  rank's rows must hold whole scale groups: a weight's rows divisible by the shard group's size
  and its elements by 16,384 x that size (`check_shardable`, a user error naming the sizes
  that work).
- **Loading** (`load_quantized_weights`, after `to_empty`): for each NF4 weight the whole
  tensor is read from the safetensors file (opened for that tensor only, so its mapped pages
  are released with it), quantized on the device (the scale statistics need the whole tensor:
  one mean per tensor), and this rank's rows of codes and scales copied into its shard; then the
  next. The peak is one tensor's temporaries, never a model's. torch's `set_model_state_dict`
  is not used for them (it recursed on NF4 parameters; torchtune loads NF4 by hand for the
  same reason).

Kept in the compute dtype, and said so in the log: linear weights whose element count is not
a multiple of 16,384 (small gates), GPT-2's `Conv1D` projections (torchao has no NF4 kernel for
them), the mixture-of-experts fused expert tensors (3-D; `NF4Tensor` holds and shards 2-D weights
only) and routers (their own modules, not `nn.Linear`: tiny, and rounding them would move the
routing).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fsdp_utils.model.build import _all_named_parameters, compute_dtype, find_decoder_layers

if TYPE_CHECKING:
    from fsdp_utils.config.train_config import TrainConfig

BLOCK_SIZE = 64  # values per 4-bit block, each with its own scale (QLoRA's, torchao's default)
SCALER_BLOCK_SIZE = 256  # block scales per 8-bit group (double quantization)
GRANULE = BLOCK_SIZE * SCALER_BLOCK_SIZE  # 16,384 values: the smallest whole unit of scales
# Bits per weight: 4 for the code, 8 per 64 for the block's scale, and per 16,384 one scale
# factor of the block scales in the compute dtype (16 bits; 32 with fp32).
_INNER_SHARDED = ("quantized_data", "quantized_scalers", "quantization_factor")


def nf4_bits_per_weight(dtype: torch.dtype = torch.bfloat16) -> float:
    """4 + 8/64 + bits(dtype)/16,384: 4.126 in bf16 (QLoRA's paper counts 32-bit factors:
    4.127)."""
    return 4 + 8 / BLOCK_SIZE + torch.finfo(dtype).bits / GRANULE


def torchao_nf4() -> Any:
    """The module of torchao's `NF4Tensor` (with `to_nf4`, `SubclassTensorArgs`), found from
    its public name: `torchao.quantization.NF4Tensor` since torchao 0.18 (0.17 had it in
    `torchao.dtypes.nf4tensor`). Imported quietly (`fsdp_utils._quiet_torchao`)."""
    import importlib

    from torchao.quantization import NF4Tensor

    return importlib.import_module(NF4Tensor.__module__)


def is_nf4(tensor: Any) -> bool:
    """An NF4 weight, plain or as the local tensor of a (sharded) DTensor. Does not import
    torchao: a run without --quantize never loads it."""
    local = getattr(tensor, "_local_tensor", tensor)
    return type(local).__name__ == "NF4Tensor"


# --- the transform, on meta ------------------------------------------------------------------


_SMALL = f"linear weights not a multiple of {GRANULE:,} elements (NF4's unit of scales)"
_CONV1D = "Conv1D projections (torchao has no NF4 kernel for them)"
_EXPERTS = "fused expert tensors (3-D; torchao's NF4Tensor holds 2-D weights)"
_OTHER = "weights of other modules (routers: not nn.Linear, whose forward NF4 replaces)"


def _placeholder(shape: torch.Size, dtype: torch.dtype) -> Any:
    """An NF4 weight of `shape` on meta: the inner tensors' shapes without data or work."""
    nf4 = torchao_nf4()
    rows, cols = shape
    numel = rows * cols
    blocks = numel // BLOCK_SIZE
    meta = torch.device("meta")
    args = nf4.SubclassTensorArgs(shape, (cols, 1), 0, dtype, meta, False)
    return nf4.NF4Tensor(
        args,
        BLOCK_SIZE,
        blocks,
        SCALER_BLOCK_SIZE,
        torch.empty(blocks, dtype=torch.int8, device=meta),  # quantized_scalers
        torch.empty(blocks // SCALER_BLOCK_SIZE, dtype=dtype, device=meta),  # quantization_factor
        torch.empty((), dtype=dtype, device=meta),  # scaler_mean
        torch.empty(numel // 2, dtype=torch.uint8, device=meta),  # quantized_data
        torch.empty(16, dtype=dtype, device=meta),  # nf4: the 16 code values
    )


def _unquantized_reason(module: nn.Module, param: torch.Tensor) -> str | None:
    """Why a frozen weight of a decoder layer is not NF4, or None if it should be."""
    if param.dim() == 3:
        return _EXPERTS
    if type(module).__name__ == "Conv1D":
        return _CONV1D
    if isinstance(module, nn.Linear):
        return _SMALL if param.numel() % GRANULE else None
    return _OTHER if param.dim() == 2 else None


def quantize_base(model: nn.Module, layers: list[nn.Module], config: TrainConfig) -> None:
    """Turn every linear weight of the decoder layers that NF4 can hold into a frozen NF4
    placeholder (on meta, in the compute dtype), in place. A ValueError if there is none."""
    quantizable = [
        module
        for layer in layers
        for module in layer.modules()
        if isinstance(module, nn.Linear) and _unquantized_reason(module, module.weight) is None
    ]
    if not quantizable:
        raise ValueError(
            f"--quantize {config.quantize}: no linear weight of the decoder layers "
            f"({type(layers[0]).__name__}) can be stored in NF4, which needs 2-D nn.Linear "
            f"weights of a multiple of {GRANULE:,} elements (hidden size 256 and up; GPT-2's "
            "Conv1D layers are not nn.Linear). Drop --quantize to train LoRA on the 16-bit base."
        )
    dtype = compute_dtype(config.precision)
    for module in quantizable:
        module.weight = nn.Parameter(_placeholder(module.weight.shape, dtype), requires_grad=False)


def unquantized_weights(model: nn.Module) -> dict[str, list[tuple[str, int]]]:
    """The frozen weights of the decoder layers left in the compute dtype, by reason: [(name in
    the layer, parameters)]. Embeddings, norms and the output layer are outside the layers."""
    kept: dict[str, list[tuple[str, int]]] = {}
    inside = [item for layer in find_decoder_layers(model) for item in layer.named_modules()]
    for module_name, module in inside:
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad or is_nf4(param):
                continue
            reason = _unquantized_reason(module, param)
            if reason is not None:
                kept.setdefault(reason, []).append((f"{module_name}.{name}", param.numel()))
    return kept


def quantized_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The NF4 weights by name (as in the checkpoint: no activation-checkpoint prefix)."""
    return {name: p for name, p in _all_named_parameters(model) if is_nf4(p)}


# --- shapes FSDP2 can shard ------------------------------------------------------------------


def shard_group_size(config: TrainConfig, world_size: int, local_world_size: int) -> int:
    """Over how many ranks FSDP2 splits each weight (`fsdp_utils.parallel.distributed.build_mesh`):
    all of them, the node's for --sharding hybrid, none for no_shard."""
    if config.sharding == "hybrid":
        return local_world_size
    return 1 if config.sharding == "no_shard" else world_size


def shards_evenly(shape: tuple[int, ...], shards: int) -> bool:
    """Each of `shards` ranks holds whole rows and whole groups of scales."""
    rows, cols = shape
    return rows % shards == 0 and rows * cols % (GRANULE * shards) == 0


def check_shardable(shapes: dict[str, tuple[int, ...]], shards: int) -> None:
    """A ValueError naming the weights NF4 cannot split over `shards` ranks and the shard
    counts (up to 64) that split them all."""
    bad = {name: shape for name, shape in shapes.items() if not shards_evenly(shape, shards)}
    if not bad:
        return
    working = [n for n in range(1, 65) if all(shards_evenly(s, n) for s in shapes.values())]
    shown = ", ".join(
        f"{name} {list(shape)} ({shape[0] * shape[1]:,} elements)"
        for name, shape in list(bad.items())[:3]
    )
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    counts = ", ".join(map(str, working))
    raise ValueError(
        f"--quantize nf4: FSDP2 splits each NF4 weight over {shards} ranks by rows, "
        f"and each rank must hold whole rows and whole groups of {GRANULE:,} values (one group "
        f"of 8-bit scales): {shown}{more} cannot be split so. These weights split over "
        f"{counts} ranks. Run on that many processes (with --sharding hybrid: processes per "
        "node), or use --sharding no_shard (each rank keeps the whole 4-bit base), or drop "
        "--quantize for LoRA on the 16-bit base."
    )


def quantized_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in quantized_parameters(model).items()}


# --- materialising and loading -----------------------------------------------------------------


def _row_slices(local: Any, first_row: int) -> dict[str, slice]:
    """Where rows [first_row, first_row + local rows) are in each flat inner tensor of the whole
    tensor's quantization (codes: 2 per byte; one scale per 64 values; one factor per 16,384)."""
    rows, cols = local.shape
    start, stop = first_row * cols, (first_row + rows) * cols
    per_element = {
        "quantized_data": 2,
        "quantized_scalers": BLOCK_SIZE,
        "quantization_factor": GRANULE,
    }
    return {name: slice(start // n, stop // n) for name, n in per_element.items()}


@torch.no_grad()
def copy_quantized_rows(local: Any, whole: Any, first_row: int) -> None:
    """Copy this rank's rows of a whole NF4 tensor into its shard `local`, in place."""
    for name, rows in _row_slices(local, first_row).items():
        getattr(local, name).copy_(getattr(whole, name)[rows])
    local.scaler_mean.copy_(whole.scaler_mean)
    local.nf4.copy_(whole.nf4)


def _read_tensor(path: Path, key: str) -> torch.Tensor:
    """One tensor of a safetensors file, the file mapped for this read only: its pages leave
    the process's memory with it (a file kept open would keep every page read resident)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(key)


@torch.no_grad()
def load_quantized_weights(
    model: nn.Module, model_dir: Path, key_map: dict[str, Any]
) -> dict[str, Any]:
    """Fill every NF4 weight from `model_dir` (see the module docstring); return `key_map`
    without them, for `load_pretrained_weights` to load the rest. Every rank reads each NF4
    weight whole (from the page cache after the first rank on a node) and quantizes it whole."""
    from fsdp_utils.model.fused_weights import SafetensorsFolder, local_block

    quantized = quantized_parameters(model)
    if not quantized:
        return key_map
    to_nf4 = torchao_nf4().to_nf4
    files = SafetensorsFolder(model_dir).files
    for name, param in quantized.items():
        source = key_map[name]
        assert isinstance(source, str), f"{name}: an NF4 weight is one checkpoint tensor"
        local, offset = local_block(param)
        full = _read_tensor(files[source], source).to(device=local.device, dtype=local.dtype)
        whole = to_nf4(full, BLOCK_SIZE, SCALER_BLOCK_SIZE)
        del full  # before the next tensor: one tensor's temporaries at a time
        copy_quantized_rows(local, whole, offset[0])
        del whole
    return {key: source for key, source in key_map.items() if key not in quantized}


def dequantized(value: Any) -> Any:
    """An NF4 tensor (not sharded) as a plain tensor in its compute dtype; anything else as is."""
    return value.get_original_weight() if is_nf4(value) else value


# What --merge (and `python -m fsdp_utils.export --merge`) of a QLoRA run writes, said where it does.
NF4_MERGE_NOTE = (
    "the merged model is the 4-bit base dequantized with the adapters merged in, in the source "
    "dtype: it carries the NF4 rounding the adapters were trained on (its base weights are not "
    "the original ones; the adapter folder over the original base computes nearly the same)"
)


def full_weight(param: Any) -> torch.Tensor:
    """The whole weight, dequantized if NF4 (collective for a sharded parameter: every rank
    calls it). Each rank dequantizes its own rows (they carry their own scales) and the dense
    rows are gathered: `DTensor.full_tensor` on an NF4 DTensor leaves torchao's inner
    all-gathers unwaited (torch warns of "unwaited collective calls" at exit), which on
    NCCL could read the codes before they arrive."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return dequantized(param)
    local: Any = param._local_tensor
    if not is_nf4(local):
        return param.full_tensor()
    rows = DTensor.from_local(
        local.get_original_weight(),
        param.device_mesh,
        param.placements,
        shape=param.shape,
        stride=param.stride(),
    )
    return rows.full_tensor()


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the model's whole state dict on rank 0's CPU with every NF4 weight
    dequantized (in its compute dtype); `{}` on the other ranks. One tensor gathered at a time,
    in the same order on every rank."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    keep = not dist.is_initialized() or dist.get_rank() == 0
    state: dict[str, torch.Tensor] = {}
    for key, value in get_model_state_dict(model).items():  # sharded: no copy, no traffic
        full = full_weight(value)
        if keep:
            state[key] = full.detach().cpu()
    return state


# --- what the log says -----------------------------------------------------------------------


def local_bytes(model: nn.Module) -> tuple[int, int]:
    """(this rank's bytes of the NF4 weights: codes, scales and constants; the same weights'
    bytes in their compute dtype)."""
    stored = dense = 0
    for param in quantized_parameters(model).values():
        local: Any = getattr(param, "_local_tensor", param)
        inner, _ = local.__tensor_flatten__()
        stored += sum(getattr(local, n).numel() * getattr(local, n).element_size() for n in inner)
        dense += local.numel() * local.element_size()
    return stored, dense


def unsharded_bytes(model: nn.Module) -> int:
    """Bytes of the NF4 weights FSDP2 does not manage (one rank per shard group: each rank holds
    them whole, `fsdp_utils.parallel.parallelize`), which its memory tracker does not see."""
    total = 0
    for param in quantized_parameters(model).values():
        if not hasattr(param, "_local_tensor"):
            local: Any = param
            inner, _ = local.__tensor_flatten__()
            total += sum(
                getattr(local, n).numel() * getattr(local, n).element_size() for n in inner
            )
    return total


def describe(model: nn.Module) -> str:
    """'NF4 base: 14 linear weights of the decoder layers (1.31M parameters) in 4 bits ...:
    0.66 MiB on this process (2.50 MiB in bf16) ...; kept in bf16: ...'."""
    quantized = quantized_parameters(model)
    count = sum(p.numel() for p in quantized.values())
    stored, dense = local_bytes(model)
    dtype = next(iter(quantized.values())).dtype
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    text = (
        f"NF4 base: {len(quantized)} linear weights of the decoder layers ({count / 1e6:,.2f}M "
        f"parameters) in 4 bits with double-quantized scales ({nf4_bits_per_weight(dtype):.3f} "
        f"bits each): {stored / 2**20:,.2f} MiB on this process ({dense / 2**20:,.2f} MiB in "
        f"{name}), each dequantized when its layer runs"
    )
    for reason, found in unquantized_weights(model).items():
        short = list(dict.fromkeys(n.removesuffix(".weight") for n, _ in found))
        text += (
            f"; kept in {name}: {len(found)} {reason} ({', '.join(short[:3])}"
            f"{', ...' if len(short) > 3 else ''}: {sum(c for _, c in found) / 1e6:,.2f}M "
            "parameters)"
        )
    return text
