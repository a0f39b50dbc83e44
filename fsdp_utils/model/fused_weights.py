"""Checkpoint tensors that transformers fuses on load: mixture-of-experts experts, read shard by
shard, and written back in the checkpoint's layout on export.

Every mixture-of-experts checkpoint on the Hub (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek, ...)
stores one tensor per expert (`mlp.experts.3.gate_proj.weight`), while transformers 5 holds all
experts of a layer in one tensor (`mlp.experts.gate_up_proj`, [experts, 2 x intermediate,
hidden]). Its conversion mapping (`transformers.conversion_mapping`) says how: a
`WeightConverter` whose source patterns (`mlp.experts.*.gate_proj.weight`,
`mlp.experts.*.up_proj.weight`) are stacked by `MergeModulelist(dim=0)` (one list per pattern,
in expert order) and then joined by `Concatenate(dim=1)` (in the order the patterns are listed:
gate before up).

transformers applies those operations to whole tensors. Under FSDP2 each rank holds only rows
of dim 0 of the fused tensor (whole experts; FSDP2 pads when the expert count does not divide by
the world size, and a rank may hold none), so here the operations are read instead of run:
`plan_fused_tensor` executes them on shapes, which gives for every checkpoint tensor the box it
fills in the fused tensor (its expert's row of the merge dim, its offset along the concat dim).
`load_fused_tensors` intersects those boxes with each rank's DTensor shard and reads, through
safetensors' memory-mapped `get_slice`, only the part of each checkpoint tensor that lands in
it: a rank reads its own experts, never a whole layer. Boxes work for any placement, so a shard
that splits inside an expert (a shard of dim 1, or of a single expert) reads the matching
rows of each expert tensor.

Supported operations: `MergeModulelist` and `Concatenate` (every MoE mapping of transformers
5.23: mixtral, qwen2_moe and the ~30 model types that reuse them). Anything else raises
`UnsupportedConversionError`, naming the rule.

Export goes the other way with transformers' own reverse operations (`SplitModulelist`,
`Chunk`, the renamings reversed): `hub_layout` is what `save_pretrained` writes, so the result
loads in `from_pretrained` and in vLLM.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


class UnsupportedConversionError(ValueError):
    """A checkpoint needs a transformers conversion that cannot be read slice by slice."""


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor's place in a fused tensor.

    `start` and `size` are its box in the fused tensor's coordinates; `merged_dim` is the fused
    dim the checkpoint tensor does not have (the expert index, size 1 in the box), or None if it
    has them all.
    """

    key: str
    start: tuple[int, ...]
    size: tuple[int, ...]
    merged_dim: int | None


@dataclass(frozen=True)
class FusedTensor:
    """A model tensor assembled from several checkpoint tensors: where each one goes."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


# --- the plan: transformers' operations run on shapes ------------------------------------------


@dataclass(frozen=True)
class _Symbolic:
    """A tensor the operations produce: its shape and the checkpoint pieces it is made of."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def _leaf(key: str, shape: tuple[int, ...]) -> _Symbolic:
    return _Symbolic(shape, (Piece(key, (0,) * len(shape), shape, None),))


def _stack(items: list[_Symbolic], dim: int) -> _Symbolic:
    """torch.stack(items, dim) on shapes: item i becomes row i of the new dim."""
    shapes = {item.shape for item in items}
    if len(shapes) != 1:
        raise UnsupportedConversionError(f"stacked tensors differ in shape: {sorted(shapes)}")
    (shape,) = shapes
    pieces = []
    for index, item in enumerate(items):
        for piece in item.pieces:
            if piece.merged_dim is not None:
                raise UnsupportedConversionError("a tensor is stacked twice")
            start = (*piece.start[:dim], index, *piece.start[dim:])
            size = (*piece.size[:dim], 1, *piece.size[dim:])
            pieces.append(Piece(piece.key, start, size, dim))
    return _Symbolic((*shape[:dim], len(items), *shape[dim:]), tuple(pieces))


def _concatenate(items: list[_Symbolic], dim: int) -> _Symbolic:
    """torch.cat(items, dim) on shapes: item i is shifted by the sizes of those before it."""
    others = {item.shape[:dim] + item.shape[dim + 1 :] for item in items}
    if len(others) != 1:
        raise UnsupportedConversionError(f"concatenated tensors differ off dim {dim}")
    offset, pieces = 0, []
    for item in items:
        for piece in item.pieces:
            start = list(piece.start)
            start[dim] += offset
            pieces.append(Piece(piece.key, tuple(start), piece.size, piece.merged_dim))
        offset += item.shape[dim]
    shape = list(items[0].shape)
    shape[dim] = offset
    return _Symbolic(tuple(shape), tuple(pieces))


def _run_operations(
    converter: Any, collected: dict[str, list[_Symbolic]]
) -> dict[str, list[_Symbolic]]:
    """The converter's operations, as transformers' `WeightConverter.convert` chains them, on
    `collected` (source pattern -> its tensors in list order)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    for op in converter.operations:
        if isinstance(op, MergeModulelist):
            # One stacked tensor per source pattern (transformers keeps the pattern as its name
            # when a later op follows, and names a lone result after the target).
            collected = {pattern: [_stack(items, op.dim)] for pattern, items in collected.items()}
        elif isinstance(op, Concatenate) and op.num_shards_attribute is None:
            # In the order of the source patterns (gate before up), as transformers does.
            ordered = [
                item for pattern in converter.source_patterns for item in collected.get(pattern, [])
            ]
            collected = {converter.target_patterns[0]: [_concatenate(ordered, op.dim)]}
        else:
            raise UnsupportedConversionError(f"operation {op!r} is not a stack or a concatenation")
    return collected


def _expert_number(key: str, pattern: str) -> int | None:
    """The number that stands for the pattern's `*` in `key` (`experts.*.w1` -> 3 in
    `...experts.3.w1.weight`), or None if the pattern has no `*`."""
    if "*" not in pattern:
        return None
    regex = re.escape(pattern.lstrip("^")).replace(r"\*", r"(\d+)")
    found = re.search(regex, key)
    if found is None:
        raise UnsupportedConversionError(f"cannot find the index of {key!r} in {pattern!r}")
    return int(found.group(1))


def plan_fused_tensor(
    converter: Any,
    sources: list[tuple[str, str, str | None, tuple[int, ...]]],
    expected_shape: tuple[int, ...],
) -> FusedTensor:
    """Where each checkpoint tensor goes in one fused model tensor.

    converter: the transformers `WeightConverter` that makes it.
    sources: (checkpoint key, the key after transformers' renamings, the source pattern it
    matched, its shape), any order; per-expert tensors are put in expert order (transformers
    sorts the keys naturally, which is the same when every expert is there).
    """
    collected: dict[str, list[tuple[int, str, tuple[int, ...]]]] = {}
    for key, renamed, pattern, shape in sources:
        assert pattern is not None, key
        number = _expert_number(renamed, pattern)
        collected.setdefault(pattern, []).append((-1 if number is None else number, key, shape))
    leaves: dict[str, list[_Symbolic]] = {}
    for pattern, items in collected.items():
        items.sort()
        numbers = [number for number, _, _ in items]
        if "*" in pattern and numbers != list(range(len(items))):
            raise UnsupportedConversionError(
                f"the checkpoint's tensors for {pattern!r} are numbered {numbers}, not 0 to "
                f"{len(items) - 1}"
            )
        leaves[pattern] = [_leaf(key, shape) for _, key, shape in items]
    results = [item for items in _run_operations(converter, leaves).values() for item in items]
    if len(results) != 1:
        raise UnsupportedConversionError(f"it makes {len(results)} tensors, not one")
    (result,) = results
    if result.shape != tuple(expected_shape):
        raise UnsupportedConversionError(
            f"it makes a {list(result.shape)} tensor where the model has {list(expected_shape)}"
        )
    return FusedTensor(result.shape, result.pieces)


# --- reading: each rank its own rows ---------------------------------------------------------


class SafetensorsFolder:
    """The safetensors files of a model folder, opened lazily (memory-mapped), by tensor name."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self.files = {key: self.folder / name for key, name in weight_map.items()}
        else:
            from safetensors import safe_open

            self.files = {}
            for path in sorted(self.folder.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as f:
                    self.files.update(dict.fromkeys(f.keys(), path))
        self._open: dict[Path, Any] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> SafetensorsFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._open.clear()

    def slice(self, key: str) -> Any:
        """safetensors' lazy slice of `key`: `.get_shape()` reads the header only, indexing
        reads just the rows asked for."""
        from safetensors import safe_open

        path = self.files[key]
        if path not in self._open:
            self._open[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._open[path].get_slice(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.slice(key).get_shape())


def local_block(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The tensor this rank holds of `param` and where it starts in the full tensor.

    For an FSDP2 DTensor that is the unpadded local shard (a view into FSDP's padded storage, so
    writing it fills the parameter); a plain tensor is all of itself.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        # The function DCP and transformers' shard-on-read use for the same question.
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        local = param.to_local()
        assert tuple(local.shape) == tuple(shape), (local.shape, shape)
        return local, tuple(offset)
    return param, (0,) * param.dim()


@torch.no_grad()
def fill_local_block(
    local: torch.Tensor, offset: tuple[int, ...], fused: FusedTensor, files: SafetensorsFolder
) -> int:
    """Fill `local` (the block of the fused tensor starting at `offset`) from the checkpoint,
    reading only the part of each piece that falls in it. Returns the elements read."""
    read = 0
    for piece in fused.pieces:
        lows = [max(s, o) for s, o in zip(piece.start, offset, strict=True)]
        highs = [
            min(s + n, o + m)
            for s, n, o, m in zip(piece.start, piece.size, offset, local.shape, strict=True)
        ]
        if any(low >= high for low, high in zip(lows, highs, strict=True)):
            continue
        source = [
            slice(low - s, high - s)
            for dim, (low, high, s) in enumerate(zip(lows, highs, piece.start, strict=True))
            if dim != piece.merged_dim
        ]
        target = tuple(
            slice(low - o, high - o) for low, high, o in zip(lows, highs, offset, strict=True)
        )
        data = files.slice(piece.key)[tuple(source)]
        block = local[target]
        block.copy_(data.reshape(block.shape))
        read += data.numel()
    return read


def load_fused_tensors(model: nn.Module, model_dir: Path, fused: dict[str, FusedTensor]) -> int:
    """Fill the model's fused tensors (model key -> plan) from `model_dir`, each rank its own
    shard. No collective: every rank reads its own slices of the memory-mapped files. Returns
    the number of elements this rank read: what its shards hold, nothing twice."""
    from fsdp_utils.model.build import _all_named_parameters

    params = dict(_all_named_parameters(model))
    read = 0
    with SafetensorsFolder(model_dir) as files:
        for key, plan in fused.items():
            local, offset = local_block(params[key])
            read += fill_local_block(local, offset, plan, files)
    return read


# --- export: back to the checkpoint's layout ---------------------------------------------------


def conversion_rules(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """transformers' (renamings, converters) for `model`, as `from_pretrained` uses them.

    Call it on a model as transformers built it (not FSDP-wrapped: FSDP2 swaps the classes that
    some rules are registered by).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    transforms: list[Any] = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    return renamings, converters


def fuses_weights(model: nn.Module) -> bool:
    """Does transformers fuse some checkpoint tensors of this architecture (MoE experts)?"""
    return bool(conversion_rules(model)[1])


def hub_layout(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """`state` (the model's names and fused tensors) in the layout `save_pretrained` writes:
    one tensor per expert under the checkpoint's names, with transformers' own reverse
    operations. `state` is emptied as it goes, so that only one fused tensor's pieces exist
    twice at a time. Models whose weights transformers does not fuse are returned as they are.

    `model`: the architecture as transformers builds it (a meta build is enough).
    """
    if not fuses_weights(model):
        return state
    from transformers.core_model_loading import revert_weight_conversion

    _, converters = conversion_rules(model)
    patterns = [re.compile(p) for c in converters for p in _target_regexes(c)]
    out: dict[str, torch.Tensor] = {}
    plain = {}
    for key in list(state):
        if not any(p.search(key) for p in patterns):
            plain[key] = state.pop(key)
            continue
        # One fused tensor at a time; its pieces are views of it: copy them so each is a
        # tensor of its own (safetensors refuses tensors that share memory).
        pieces = revert_weight_conversion(model, {key: state.pop(key)})  # type: ignore[arg-type]
        out.update({name: piece.clone() for name, piece in pieces.items()})
    out.update(revert_weight_conversion(model, plain))  # type: ignore[arg-type]
    return out


def _target_regexes(converter: Any) -> Iterator[str]:
    for pattern in converter.target_patterns:
        body = pattern.lstrip("^").replace("*", r"\d+")
        yield body + r"$" if re.search(r"\w$", body) else body
