"""Split attention for sequence parallelism (DeepSpeed-Ulysses), as a transformers attention
implementation: no family's code is touched.

A rank holds a contiguous slice of every sequence, [batch, heads, slice, head_dim] after the
projections and rotary embeddings. An all-to-all over the sequence-parallel group trades the
slice of the sequence for a slice of the heads, [batch, heads / N, sequence, head_dim]: each
rank now sees whole sequences for its heads, runs the inner kernel on them (sdpa, or the
family's own eager function with its soft-capping or sinks), and a second all-to-all trades
back. Both all-to-alls are `torch.distributed._functional_collectives`' differentiable ones: the
backward sends each head's gradient back to the rank of its tokens.

The mask is built after the all-to-all, on the whole sequence, by transformers' own functions
(`create_causal_mask`, `create_sliding_window_causal_mask`) from the whole sequence's position
ids (gathered over the group): the unsplit model's mask, packed documents (`--document_masking`)
and sliding windows included. The model's own mask of the slice is not used.

Key-value heads: a rank takes heads / N query heads and the key-value heads they read. With
fewer key-value heads than N, or a number N does not divide, each is repeated
N / gcd(kv_heads, N) times first: query head i reads key-value head i // (heads / kv_heads)
before and after, so grouped-query attention computes the same.

Only a forward called with the `sequence_parallel` keyword (`SequenceParallel.forward_kwargs`)
splits; any other forward of the same model (generation, scoring of whole sequences) runs the
inner kernel with the model's own mask, as if nothing was registered.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from fsdp_utils.data.document_masking import SPLIT_PREFIX
from fsdp_utils.parallel.sequence import FORWARD_KEYWORD, SequenceParallel

# Keywords of the attention interface, and attributes of the attention module the eager
# functions read, with one entry per query head: gpt-oss's attention sinks. A rank passes its
# heads' entries.
PER_HEAD_KEYWORDS = ("s_aux",)
PER_HEAD_ATTRIBUTES = ("sinks",)
# The gather of the position ids: torch 2.13 renamed all_gather_tensor to all_gather_single (the
# old name warns there); our floor, 2.11 (the lent GPUs' torch), has only the old name.
_all_gather: Callable[..., torch.Tensor] = (
    getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
)


def split_implementation(inner: str) -> str:
    """The name under which split attention around `inner` is registered with transformers."""
    return f"{SPLIT_PREFIX}{inner}"


def register(inner: str) -> str:
    """Register split attention around `inner` (sdpa or eager) with transformers' attention
    and mask interfaces; returns its name. The mask interface gets the inner kernel's own, so a
    forward without the keyword builds the masks it would build anyway."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = split_implementation(inner)

    def attention(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        return split_attention(module, *args, inner=inner, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name


def use_split_attention(model: nn.Module) -> str:
    """Make `model` (a transformers causal LM, on meta or not; PEFT-wrapped or not) run split
    attention around the implementation transformers settled on for it; returns that inner
    implementation."""
    config: Any = model.config
    inner = str(config._attn_implementation or "sdpa")
    model.set_attn_implementation(register(inner))  # type: ignore[operator]
    return inner


def split_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    inner: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention interface's function: [batch, slice, heads, head_dim] out, for
    [batch, heads, slice, head_dim] queries and [batch, kv_heads, slice, head_dim] keys and
    values; attention weights are not returned."""
    attend = _inner_function(module, inner)
    sp: SequenceParallel | None = kwargs.pop(FORWARD_KEYWORD, None)
    if sp is None or not sp.enabled:
        return attend(module, query, key, value, attention_mask, **kwargs)
    positions = kwargs.get("position_ids")
    assert positions is not None, "a sliced forward passes its global position ids"
    heads, kv_heads = query.shape[1], key.shape[1]
    repeat = sp.size // math.gcd(kv_heads, sp.size)
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    query, key, value = (heads_for_sequence(x, sp) for x in (query, key, value))
    kwargs["position_ids"], mask = _whole_sequence(
        positions, sp, module.config, inner, query, kwargs.get("sliding_window")
    )
    mine = slice(sp.rank * (heads // sp.size), (sp.rank + 1) * (heads // sp.size))
    for name in PER_HEAD_KEYWORDS:
        if kwargs.get(name) is not None:
            kwargs[name] = kwargs[name][mine]
    output, _ = attend(
        _LocalHeads(module, key_value_groups=query.shape[1] // key.shape[1], heads=mine),
        query,
        key,
        value,
        mask,
        **kwargs,
    )
    return sequence_for_heads(output, sp), None


def heads_for_sequence(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[batch, heads, slice, d] -> [batch, heads / N, N x slice, d]: block j of the heads goes
    to rank j, and rank i's slice arrives as block i of the sequence."""
    batch, heads, length, dim = x.shape
    n = sp.size
    send = x.reshape(batch, n, heads // n, length, dim).transpose(0, 1).contiguous()
    got = _all_to_all(send, sp)  # [N, batch, heads / N, slice, d], block i from rank i
    return got.permute(1, 2, 0, 3, 4).reshape(batch, heads // n, n * length, dim)


def sequence_for_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[batch, N x slice, heads / N, d] (an attention output) -> [batch, slice, heads, d]: slice j
    of the sequence goes to rank j, and rank i's heads arrive as block i of the heads."""
    batch, length, heads, dim = x.shape
    n = sp.size
    send = x.reshape(batch, n, length // n, heads, dim).transpose(0, 1).contiguous()
    got = _all_to_all(send, sp)  # [N, batch, slice, heads / N, d], block i from rank i
    return got.permute(1, 2, 0, 3, 4).reshape(batch, length // n, n * heads, dim)


def _all_to_all(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    out = funcol.all_to_all_single_autograd(x, None, None, sp.group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


def _inner_function(module: nn.Module, inner: str) -> Callable[..., Any]:
    """sdpa from transformers' interface; eager is each family's own function, defined in its
    modeling module (Gemma 2's soft-caps its logits, gpt-oss's adds its sinks)."""
    if inner == "eager":
        family: Any = sys.modules[type(module).__module__]
        return family.eager_attention_forward  # type: ignore[no-any-return]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[inner]  # type: ignore[no-any-return]


class _LocalHeads:
    """The attention module as the inner kernel sees it on this rank's heads: the same but for
    `num_key_value_groups` (query heads per key-value head, fewer after repeated key-value
    heads) and the per-head attributes (`PER_HEAD_ATTRIBUTES`), sliced to `heads`."""

    def __init__(self, module: nn.Module, *, key_value_groups: int, heads: slice) -> None:
        self._module = module
        if hasattr(module, "num_key_value_groups"):  # sdpa repeats key-value heads only then
            self.num_key_value_groups = key_value_groups
        for name in PER_HEAD_ATTRIBUTES:
            if isinstance(getattr(module, name, None), torch.Tensor):
                setattr(self, name, getattr(module, name)[heads])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class _WholeSequence:
    """The whole sequence's position ids, and its masks, made once per forward (every layer of
    a forward gets the same position ids tensor; activation checkpointing's recompute too) and
    kind of mask (sliding window or not, the kernel and dtype they are made for). Kept until
    the slice's position ids are freed (after the backward), no longer: a packed sequence's
    mask is [sequence, sequence]."""

    def __init__(self, key: torch.Tensor, positions: torch.Tensor) -> None:
        self.key = weakref.ref(key)  # the slice's position ids
        self.positions = positions
        self.masks: dict[tuple[Any, ...], torch.Tensor | None] = {}
        weakref.finalize(key, _forget, self)


_last: list[_WholeSequence] = []


def _forget(whole: _WholeSequence) -> None:
    if _last and _last[0] is whole:
        _last.clear()


def _whole_sequence(
    positions: torch.Tensor,
    sp: SequenceParallel,
    config: Any,
    inner: str,
    query: torch.Tensor,
    sliding_window: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole sequence's position ids (gathered over the group: every rank of it calls this
    for the same layers in the same order) and transformers' mask for them, as the unsplit model
    builds it for this layer's kind (sliding window or not): None for plain causal attention
    under sdpa (its kernel's own causal flag), a boolean or additive tensor otherwise."""
    if _last and _last[0].key() is positions:
        whole = _last[0]
    else:
        batch = positions.shape[0]
        gathered = _all_gather(positions.contiguous(), 0, sp.group)
        gathered = (
            gathered.wait() if isinstance(gathered, funcol.AsyncCollectiveTensor) else gathered
        )
        # [N x batch, slice] in rank order -> [batch, N x slice]
        full = gathered.reshape(sp.size, batch, -1).transpose(0, 1).reshape(batch, -1)
        whole = _WholeSequence(positions, full)
        _last[:] = [whole]
    kind = (sliding_window, inner, query.dtype, id(config))
    if kind not in whole.masks:
        whole.masks[kind] = _mask(config, inner, query, whole.positions, sliding_window)
    return whole.positions, whole.masks[kind]


def _mask(
    config: Any,
    inner: str,
    query: torch.Tensor,
    positions: torch.Tensor,
    sliding_window: int | None,
) -> torch.Tensor | None:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    if sliding_window is not None and getattr(config, "sliding_window", None) != sliding_window:
        raise AssertionError(
            f"a layer's sliding window ({sliding_window}) is not the config's "
            f"({getattr(config, 'sliding_window', None)}), which transformers' mask reads"
        )
    create = create_sliding_window_causal_mask if sliding_window else create_causal_mask
    # Only the shape (batch, sequence), dtype and device of the embeddings are read.
    like = query.new_empty((query.shape[0], query.shape[2], 0))
    return create(_InnerConfig(config, inner), like, None, None, position_ids=positions)  # type: ignore[no-any-return]


class _InnerConfig:
    """The model config as the mask functions read it: with the inner kernel's name."""

    def __init__(self, config: Any, inner: str) -> None:
        self._config = config
        self._attn_implementation = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)
