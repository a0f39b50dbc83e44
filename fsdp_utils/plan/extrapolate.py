"""Plan a deep model from shallow copies of it: its decoder layers are alike, so what a step
holds grows linearly with their number.

A model of L alike decoder layers is its ends (embeddings, final norm, lm_head, the loss), a
first layer, L - 2 middle layers and a last one (FSDP2 keeps the last unsharded after forward,
see `parallelize.py`). The tracker cuts the step into segments at module boundaries (a layer's
forward or backward starts or ends, a micro-batch or the optimizer step starts; see
`tracking.Segment`), and what is alive at any moment of a segment (parameters, gradients,
optimizer state, saved activations, the layers being gathered) is `a + b * L` for the ends
and the layers near either end of the stack. So each segment's peak is traced at three depths
n, n + k, n + 2k (k: the activation checkpointing period, so that the first and last layers
are wrapped as in the full model), checked to grow by the same bytes at each step, and
extrapolated to L; the step's peak is the highest of them. A single peak would not do: which
moment holds it changes with L (a tied Qwen2 with checkpointing peaks in its first
micro-batch up to 5 layers, in its second from 6 on). When a figure does not grow linearly,
the depths move up by k. Layers that differ in a repeating pattern (Gemma 2's local and global
attention layers take turns) are alike a period apart: k is then also a whole number of periods,
so that every copy ends as the full stack does. Layers that do not repeat are traced whole.

`python -m fsdp_utils.plan --full_trace` traces every layer.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from fsdp_utils.plan.tracking import (
    TOTAL,
    Segment,
    Snapshot,
    StepMemory,
    higher_peak,
    parallelized_decoder_layers,
    peak_of,
    plain_class_name,
)

# The shallowest model traced: a first, a middle and a last layer (`_labelled` keys the layers
# after the first and before the last, which must be middle layers as in the full model).
SHALLOWEST = 3
# Attributes that differ between otherwise identical layers: their place in the stack.
_POSITION_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_number", "idx", "index"})


@dataclass(frozen=True)
class LayerCounts:
    """Trace `depths` (n, n + step, n + 2 step) decoder layers to plan `full` of them."""

    shallow: int
    step: int
    full: int

    @property
    def depths(self) -> tuple[int, int, int]:
        return (self.shallow, self.shallow + self.step, self.shallow + 2 * self.step)

    def deeper(self) -> LayerCounts | None:
        """The next three depths, or None if tracing them costs what the full model does."""
        return _counts(self.shallow + self.step, self.step, self.full)

    def at_full(self, values: tuple[int, int, int]) -> int | None:
        """The value at `full` layers of a figure measured at `depths`; None unless it grows
        by the same amount from each depth to the next (the depths are too shallow)."""
        first, second, third = values
        if third - second != second - first:
            return None
        steps, remainder = divmod(self.full - self.shallow, self.step)
        assert remainder == 0, "the depths are chosen so that the step divides evenly"
        return first + steps * (second - first)

    def describe(self) -> str:
        shown = ", ".join(map(str, self.depths))
        return f"extrapolated from {shown} of {self.full} layers"


def _counts(shallow: int, step: int, full: int) -> LayerCounts | None:
    counts = LayerCounts(shallow, step, full)
    return counts if sum(counts.depths) < full else None


def layer_counts(full: int, every_n: int, *, repeating: bool = False) -> LayerCounts | None:
    """The depths to trace for a model of `full` layers, checkpointing every `every_n`-th (1:
    all or none), or whose layers repeat every `every_n` (`repeating`: the two at once give
    their least common multiple); None when tracing them would cost what the model does."""
    # Layers 0, k, 2k, ... are checkpointed: the shallow models end on a layer wrapped as the
    # full model's last one is, and each depth adds a whole period of k layers. The k layers
    # after the first and before the last (keyed in `_labelled`) must be middle layers.
    shallowest = max(SHALLOWEST, every_n + 2)
    if repeating:
        # No layer keyed from both ends: with alike layers the shallowest copy grows linearly
        # from there in most runs (bench/plan_table.py --agreement), a pattern's seldom does.
        shallowest = 2 * (every_n + 1)
    return _counts(shallowest + (full - shallowest) % every_n, every_n, full)


def _simple(value: Any) -> bool:
    if isinstance(value, tuple | list):
        return all(_simple(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def layer_signature(layer: nn.Module) -> tuple[Any, ...]:
    """What makes two decoder layers cost the same: module classes, parameter and buffer
    shapes and dtypes, and the simple settings each submodule keeps (e.g. an attention's
    sliding window or type), but not its position in the stack."""
    parts: list[Any] = []
    for name, module in layer.named_modules():
        settings = sorted(
            (key, repr(value))
            for key, value in vars(module).items()
            if not key.startswith("_") and key not in _POSITION_ATTRIBUTES and _simple(value)
        )
        tensors = [
            (kind, tensor_name, tuple(t.shape), t.dtype, t.requires_grad)
            for kind, items in (
                ("parameter", module.named_parameters(recurse=False)),
                ("buffer", module.named_buffers(recurse=False)),
            )
            for tensor_name, t in items
            if t is not None
        ]
        parts.append((name, plain_class_name(module), tuple(settings), tuple(tensors)))
    return tuple(parts)


def layer_period(model: nn.Module) -> int | None:
    """After how many decoder layers the stack of `model` (parallelized) repeats itself: 1 when
    every layer is alike, 2 for Gemma 2's local and global attention taking turns, 6 for Gemma
    3's five local layers to one global. None when it does not repeat at least twice."""
    signatures = [layer_signature(layer) for layer in parallelized_decoder_layers(model)]
    for period in range(1, len(signatures) // 2 + 1):
        if all(s == signatures[i % period] for i, s in enumerate(signatures)):
            return period
    return None


def why_layers_differ(model: nn.Module) -> str | None:
    """None if every decoder layer of `model` (parallelized) is alike; otherwise which one
    differs."""
    layers = parallelized_decoder_layers(model)
    first = layer_signature(layers[0])
    for index, layer in enumerate(layers[1:], start=1):
        if layer_signature(layer) != first:
            return f"decoder layer {index} differs from layer 0"
    return None


def truncated_config(hf_config: Any, layers: int) -> Any:
    """A copy of the model config with only the first `layers` decoder layers."""
    shallow = copy.deepcopy(hf_config)
    shallow.num_hidden_layers = layers  # configs alias it (GPT-2's n_layer) via attribute_map
    for key in ("layer_types",):  # per-layer lists must keep their length
        per_layer = getattr(shallow, key, None)
        if isinstance(per_layer, list | tuple):
            setattr(shallow, key, type(per_layer)(per_layer[:layers]))
    return shallow


def _snapshot(counts: LayerCounts, snapshots: Sequence[Snapshot]) -> Snapshot | None:
    keys = sorted(set().union(*snapshots))
    result = {}
    for key in keys:
        first, second, third = (s.get(key, 0) for s in snapshots)
        value = counts.at_full((first, second, third))
        if value is None:
            return None
        result[key] = value
    return result


SegmentKey = tuple[int, str, int | None]


def _labelled(memory: StepMemory, depth: int, period: int) -> dict[SegmentKey, Snapshot]:
    """A trace's segments keyed by where they are in any model: the ends, and the first and
    last `period + 1` decoder layers counted from their end of the stack (-1: the last).

    The segments of the layers in between need no key: what is alive during layer i's
    forward or backward grows linearly with i (the activations saved below it, the gradients
    made above it), so within each phase of the checkpointing period the highest one is next
    to an end of the stack, and those are keyed. A layer near both ends gets both keys."""
    reach = period + 1
    keyed: dict[SegmentKey, Snapshot] = {}
    for segment in memory.segments:
        if segment.layer is None:
            labels: list[int | None] = [None]
        else:
            labels = [segment.layer] if segment.layer < reach else []
            if segment.layer >= depth - reach:
                labels.append(segment.layer - depth)
        for label in labels:
            key = (segment.micro_batch, segment.event, label)
            if key not in keyed or segment.peak.get(TOTAL, 0) > keyed[key].get(TOTAL, 0):
                keyed[key] = segment.peak
    return keyed


def extrapolate_memory(
    counts: LayerCounts, traced: Sequence[StepMemory], period: int
) -> StepMemory | None:
    """The step memory of `counts.full` layers from the traces at `counts.depths`; None if
    their segments differ or some figure does not grow linearly over them (trace deeper).

    Each segment's peak is extrapolated on its own, and the step's peak is the highest of
    them: which segment holds the peak can change with the depth (a 20-layer Qwen2 with
    activation checkpointing peaks in its second micro-batch, 3 to 5 layers in the first)."""
    assert len(traced) == len(counts.depths)
    keyed = [_labelled(m, d, period) for m, d in zip(traced, counts.depths, strict=True)]
    if any(k.keys() != keyed[-1].keys() for k in keyed):
        return None
    segments: list[Segment] = []
    for key in keyed[-1]:  # in the order they ran
        peak = _snapshot(counts, [k[key] for k in keyed])
        if peak is None:
            return None
        segments.append(Segment(*key, peak))
    before = _snapshot(counts, [m.before_optimizer for m in traced])
    if before is None:
        return None
    forward_backward = peak_of([s for s in segments if s.event != "optimizer"])
    optimizer = peak_of([s for s in segments if s.event == "optimizer"])
    return StepMemory(
        peak=higher_peak(forward_backward, optimizer),
        peak_before_optimizer=forward_backward,
        before_optimizer=before,
        micro_batches=traced[-1].micro_batches,
        peak_in_optimizer=optimizer,
        segments=tuple(segments),
        extra={**traced[-1].extra, "extrapolated": counts.describe()},
    )
