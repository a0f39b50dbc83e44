"""Measure one training step (`fsdp_utils.train.step.TrainStep`) with PyTorch's FSDP memory
tracker.

The planner (fake tensors, `estimate.py`) and the validation run (real tensors under torchrun,
`measure.py`) both call `track_train_step`, so what is compared is measured the same way.

`FSDPMemTracker` (torch.distributed._tools) is a dispatch mode: it sees every tensor created or
freed, and files each storage under a category (sharded/unsharded parameters and gradients,
activations, backward temporaries, all-gather/reduce-scatter buffers, optimizer state). It counts
tensor bytes, not what the CUDA caching allocator reserves around them (`report.Margin`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fsdp_utils.train.step import Batch, TrainStep

TOTAL = "Total"
# The tracker's categories (torch.distributed._tools.fsdp2_mem_tracker._FSDPRefType values),
# grouped as the plan reports them.
PARAMETERS = ("Sharded Param", "Buffer")
GRADIENTS = ("Sharded Grad", "Unsharded Grad")
OPTIMIZER = ("OptState",)
ACTIVATIONS = ("Activation", "Inputs")
# All-gathered copies of the layers being computed, the collectives' buffers, and what backward
# and the optimizer step allocate and free again.
TEMPORARIES = ("Temp", "Unsharded Param", "All Gather", "Reduce Scatter")
# What CPU offload keeps in host RAM instead of on the GPU.
HOST_WHEN_OFFLOADED = ("Sharded Param", "Sharded Grad", "OptState")

Snapshot = dict[str, int]


def _sum(snapshot: Snapshot, keys: tuple[str, ...]) -> int:
    return sum(snapshot.get(key, 0) for key in keys)


@dataclass(frozen=True)
class Breakdown:
    """Bytes on one device, by what they hold; the five parts sum to `total`."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    temporaries: int

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer_state
            + self.activations
            + self.temporaries
        )


@dataclass(frozen=True)
class Segment:
    """The peak of one stretch of a training step: from a boundary (a decoder layer's forward
    starts or ends, its backward starts or ends, a micro-batch or the optimizer step starts)
    to the next one. `layer` is the decoder layer's index (None: the model's ends, such as the
    embeddings, or the lm_head and loss after the last layer's forward)."""

    micro_batch: int  # 1, 2, ...; 0 for the optimizer step
    event: str  # "start", "forward", "after forward", "backward", "after backward", "optimizer"
    layer: int | None
    peak: Snapshot


def peak_of(segments: Sequence[Segment]) -> Snapshot:
    """The highest of the segments' peaks (the first of equal ones, as the tracker keeps)."""
    best: Snapshot = {TOTAL: 0}
    for segment in segments:
        if segment.peak.get(TOTAL, 0) > best.get(TOTAL, 0):
            best = segment.peak
    return best


@dataclass(frozen=True)
class StepMemory:
    """Tracker snapshots of one training step on one device, in bytes by tracker category.

    peak: at the step's highest total. peak_before_optimizer: the highest total during the
    micro-batches' forward and backward passes. before_optimizer: what is alive when the optimizer
    step starts (parameters, gradients and optimizer state: the "state" of the textbook figures).
    peak_in_optimizer: the highest total from the optimizer step to the end of the step.
    segments: the peak of each stretch of the step between two module boundaries (see
    `Segment`), in the order they ran; the planner extrapolates each on its own.
    """

    peak: Snapshot
    peak_before_optimizer: Snapshot
    before_optimizer: Snapshot
    micro_batches: int = 0
    peak_in_optimizer: Snapshot = field(default_factory=dict)
    segments: tuple[Segment, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return self.peak.get(TOTAL, 0)

    @property
    def peak_in_optimizer_step(self) -> bool:
        return self.peak_bytes > self.peak_before_optimizer.get(TOTAL, 0)

    @property
    def optimizer_state_bytes(self) -> int:
        """The optimizer's own state (AdamW moments), without the step's scratch tensors."""
        return _sum(self.before_optimizer, OPTIMIZER)

    @property
    def state_bytes(self) -> int:
        """Parameters + gradients + optimizer state when the optimizer step starts."""
        return _sum(self.before_optimizer, PARAMETERS + GRADIENTS + OPTIMIZER)

    def breakdown(self, *, offloaded: bool = False) -> Breakdown:
        """The peak, split into the plan's five parts.

        Tensors the tracker files as optimizer state at the peak beyond the optimizer's own state
        are the step's scratch (foreach AdamW's intermediates): counted as temporaries. With CPU
        offload the sharded parameters, gradients and optimizer state live in host RAM and the
        optimizer step runs on the CPU, so the GPU's peak is the forward/backward peak less those.
        """
        snap = self.peak_before_optimizer if offloaded else self.peak
        host = HOST_WHEN_OFFLOADED if offloaded else ()
        optimizer = 0 if offloaded else min(_sum(snap, OPTIMIZER), self.optimizer_state_bytes)
        scratch = 0 if offloaded else _sum(snap, OPTIMIZER) - optimizer
        return Breakdown(
            parameters=_sum(snap, tuple(k for k in PARAMETERS if k not in host)),
            gradients=_sum(snap, tuple(k for k in GRADIENTS if k not in host)),
            optimizer_state=optimizer,
            activations=_sum(snap, ACTIVATIONS),
            temporaries=_sum(snap, TEMPORARIES) + scratch,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak": self.peak,
            "peak_before_optimizer": self.peak_before_optimizer,
            "before_optimizer": self.before_optimizer,
            "micro_batches": self.micro_batches,
            "peak_in_optimizer": self.peak_in_optimizer,
            "segments": [dataclasses.asdict(s) for s in self.segments],
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepMemory:
        return cls(
            peak=dict(data["peak"]),
            peak_before_optimizer=dict(data["peak_before_optimizer"]),
            before_optimizer=dict(data["before_optimizer"]),
            micro_batches=int(data.get("micro_batches", 0)),
            peak_in_optimizer=dict(data.get("peak_in_optimizer", {})),
            segments=tuple(Segment(**item) for item in data.get("segments", [])),
            extra=dict(data.get("extra", {})),
        )


def memory_tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
    """PyTorch's `FSDPMemTracker` for `model` (and `optimizer`); on torch 2.11 and 2.12 the one
    that leaves DTensor's sharding propagation out (`_tracker_without_sharding_propagation`)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    if torch_release() < (2, 13):
        return _tracker_without_sharding_propagation()(model, optimizer)
    return FSDPMemTracker(model, optimizer)


def torch_release() -> tuple[int, ...]:
    """(major, minor) of the torch that runs: 2.11.0+cu130 -> (2, 11)."""
    from packaging.version import Version

    return Version(torch.__version__).release[:2]


_PROPAGATING = threading.local()


def _tracker_without_sharding_propagation() -> type:
    """Shim for torch < 2.13: an FSDPMemTracker that does not count the tensors DTensor's sharding
    propagation makes to learn an operator's output shape.

    On 2.11 a foreach operator on DTensors (AdamW's step on FSDP2's sharded parameters) takes the
    uncached propagation path whenever a fake mode is active, as it always is in the planner, and
    `gen_fake_args` rebuilds every argument at its global shape in the planner's own fake mode:
    the tracker filed them as optimizer scratch (six times the parameter shards of a 2-rank
    plan), and the gradient norm's as activations. A real run makes them in a FakeTensorMode of
    DTensor's own, not on the GPU, and 2.13's tracked step has none of them. The 2.11 plans put
    the peak in the optimizer step, over twice 2.13's, and hid the activations there
    (tests/test_plan_estimate.py, tests/test_freeze.py failed); with the shim the tiny model's
    plan is 2.13's byte for byte. The operators still run; only their tensors go untracked."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    class Tracker(FSDPMemTracker):
        _original: Any = None

        def __enter__(self) -> Tracker:
            if self._depth == 0:
                self._original = ShardingPropagator._propagate_tensor_meta_non_cached
                original = self._original

                def propagate(propagator: Any, op_schema: Any) -> Any:
                    _PROPAGATING.depth = getattr(_PROPAGATING, "depth", 0) + 1
                    try:
                        return original(propagator, op_schema)
                    finally:
                        _PROPAGATING.depth -= 1

                ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign,assignment]
            super().__enter__()
            return self

        def __exit__(self, *args: Any) -> None:
            super().__exit__(*args)
            if self._depth == 0 and self._original is not None:
                ShardingPropagator._propagate_tensor_meta_non_cached = self._original  # type: ignore[method-assign]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if getattr(_PROPAGATING, "depth", 0):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    return Tracker


def _device_snapshot(
    snapshots: dict[torch.device, dict[Any, int]], device: torch.device
) -> Snapshot:
    """One device's snapshot with plain string keys (the tracker keys categories by enum)."""
    for dev, snap in snapshots.items():
        if dev.type == device.type and (device.index is None or dev.index == device.index):
            return {getattr(key, "value", str(key)): int(value) for key, value in snap.items()}
    return {TOTAL: 0}


def _keep_only_the_overall_peak(tracker: Any) -> None:
    """Make the tracker update only its overall peak after each operator, not every module's.

    `MemTracker._update_peak_stats` runs after every operator: it walks every module tracked so
    far and deep-copies a snapshot whenever one's peak rises, which in a forward pass is nearly
    every operator. Nothing here reads the per-module peaks (the segments come from the overall
    peak, see `_SegmentRecorder`), and that walk was a sixth of a plan's CPU time. The overall
    peak is updated as the tracker does it, so every figure stays the same byte for byte.
    """

    def update_overall_peak(_: Any) -> None:
        for device, snapshot in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(device, 0) < snapshot[TOTAL]:
                tracker._peak_mem[device] = snapshot[TOTAL]
                tracker._peak_mem_snap[device] = dict(snapshot)  # flat: {category: bytes}

    tracker._update_peak_stats = update_overall_peak


def _restart_peak(tracker: Any) -> None:
    """Make the tracker's peak start again from what is alive now, as entering it does
    (`MemTracker.__enter__`): each segment's peak is then measured apart."""
    tracker._peak_mem_snap = tracker.get_tracker_snapshot()
    tracker._peak_mem = {dev: snap[TOTAL] for dev, snap in tracker._peak_mem_snap.items()}


def _accumulated_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """The gradients FSDP2 accumulates unsharded between micro-batches that skip the sync
    (--defer_grad_sync), upcast to the reduce dtype: the tracker files them as backward
    temporaries, where they would hide the largest cost of deferring the sync."""
    from torch.distributed.fsdp import FSDPModule

    grads = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group else ():
                if param.unsharded_accumulated_grad is not None:
                    grads.append(param.unsharded_accumulated_grad)
    return grads


class _SegmentRecorder:
    """Cuts the tracked step into segments at module boundaries and keeps each one's peak.

    At each boundary the tracker's peak is read (the peak of the segment that ends) and
    restarted from what is alive (`_restart_peak`). Forward hooks on the decoder layers mark
    their forward; hooks on the gradients of their output and input mark their backward.
    Forwards re-run inside backward (activation checkpointing) are not boundaries.
    """

    def __init__(self, tracker: Any, device: torch.device) -> None:
        self.tracker, self.device = tracker, device
        self.micro_batch = 0
        self.current: tuple[int, str, int | None] = (0, "start", None)
        self.segments: list[Segment] = []

    def boundary(self, event: str, layer: int | None = None) -> None:
        peak = _device_snapshot(self.tracker.get_tracker_snapshot("peak"), self.device)
        self.segments.append(Segment(*self.current, peak))
        _restart_peak(self.tracker)
        micro_batch = 0 if event == "optimizer" else self.micro_batch
        self.current = (micro_batch, event, layer)

    def hook_layers(self, layers: Sequence[torch.nn.Module]) -> list[Any]:
        handles = []
        for index, layer in enumerate(layers):
            handles.append(
                layer.register_forward_pre_hook(self._before_layer(index), with_kwargs=True)
            )
            handles.append(layer.register_forward_hook(self._after_layer(index)))
        return handles

    def _on_gradient(self, tensor: Any, event: str, layer: int) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:

            def hook(grad: torch.Tensor) -> None:
                self.boundary(event, layer)

            tensor.register_hook(hook)

    def _before_layer(self, index: int) -> Any:
        def hook(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if _in_backward():
                return
            self.boundary("forward", index)
            hidden = args[0] if args else kwargs.get("hidden_states")
            self._on_gradient(hidden, "after backward", index)

        return hook

    def _after_layer(self, index: int) -> Any:
        def hook(_: Any, args: Any, output: Any) -> None:
            if _in_backward():
                return
            self.boundary("after forward", index)
            hidden = output[0] if isinstance(output, tuple | list) and output else output
            self._on_gradient(hidden, "backward", index)

        return hook


def parallelized_decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a model that went through `parallelize`, in order.

    `fully_shard` gives each sharded module a class of its own (FSDPLlamaDecoderLayer), and
    the layers that activation checkpointing wrapped keep theirs inside the wrapper, so the
    layer classes of `_no_split_modules` are looked for among each module's base classes."""
    from fsdp_utils.model.build import find_decoder_layers

    no_split = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if any(c.__name__ in no_split for c in type(m).__mro__)]
    return layers or find_decoder_layers(model)


def plain_class_name(module: torch.nn.Module) -> str:
    """The module's class without FSDP2's per-module subclass (LlamaDecoderLayer)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c.__name__ for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


def track_train_step(
    train_step: TrainStep, micro_batches: Callable[[], list[Batch]], *, step: int
) -> StepMemory:
    """Run optimizer step number `step` under `FSDPMemTracker` and return its snapshots. The
    step's micro-batches are read inside the tracked region (`micro_batches()`), so their token
    ids count, as the trainer holds them.

    Call it after an untracked warm-up step: the first step creates the optimizer state lazily,
    inside `optimizer.step()`, so a first tracked step would count AdamW's moments as scratch
    and misplace its peak. The tracker refuses a second forward of the root module in one
    tracking context (it takes it for the next iteration), so its per-module statistics are reset
    before every micro-batch; its overall peak is kept (and only that one is updated: see
    `_keep_only_the_overall_peak`). Gradients accumulated without sync are filed as gradients
    there too.
    """
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    model, optimizer, device = train_step.model, train_step.optimizer, train_step.device
    tracker = memory_tracker(model, optimizer)
    _keep_only_the_overall_peak(tracker)
    recorder = _SegmentRecorder(tracker, device)
    seen: dict[str, Any] = {}

    def before_micro_batch(*_: Any) -> None:
        tracker.reset_mod_stats()
        recorder.micro_batch += 1
        for grad in _accumulated_gradients(model):
            tracker._update_and_maybe_create_winfos(grad, _FSDPRefType.UNSHARDED_GRAD)
        recorder.boundary("start")

    def before_optimizer_step(*_: Any) -> None:
        seen["before_optimizer"] = _device_snapshot(tracker.get_tracker_snapshot("current"), device)
        recorder.boundary("optimizer")

    with tracker:
        # Registered after the tracker's own hooks, and prepended, so that the reset runs first.
        handles = [
            model.register_forward_pre_hook(before_micro_batch, prepend=True),
            optimizer.register_step_pre_hook(before_optimizer_step),
            *recorder.hook_layers(parallelized_decoder_layers(model)),
        ]
        try:
            train_step(micro_batches(), step=step)
            recorder.boundary("end")
        finally:
            for handle in handles:
                handle.remove()
    assert "before_optimizer" in seen, "train_step did not call optimizer.step()"
    segments = tuple(recorder.segments)
    before = peak_of([s for s in segments if s.event != "optimizer"])
    in_optimizer = peak_of([s for s in segments if s.event == "optimizer"])
    return StepMemory(
        peak=higher_peak(before, in_optimizer),
        peak_before_optimizer=before,
        before_optimizer=seen["before_optimizer"],
        micro_batches=recorder.micro_batch,
        peak_in_optimizer=in_optimizer,
        segments=segments,
    )


def higher_peak(forward_backward: Snapshot, optimizer: Snapshot) -> Snapshot:
    """The step's peak: the higher of its two phases' (forward/backward first on a tie, as the
    tracker keeps the first of equal peaks)."""
    return (
        optimizer if optimizer.get(TOTAL, 0) > forward_backward.get(TOTAL, 0) else forward_backward
    )


def with_resident(memory: StepMemory, category: str, nbytes: int) -> StepMemory:
    """`memory` with `nbytes` more in `category` at every snapshot: tensors alive through the
    whole step that the tracker did not see (DPO's frozen reference copy, --reference live,
    whose sharded parameters are not the tracked model's)."""

    def add(snapshot: Snapshot) -> Snapshot:
        if not snapshot:
            return snapshot
        return {
            **snapshot,
            category: snapshot.get(category, 0) + nbytes,
            TOTAL: snapshot.get(TOTAL, 0) + nbytes,
        }

    return dataclasses.replace(
        memory,
        peak=add(memory.peak),
        peak_before_optimizer=add(memory.peak_before_optimizer),
        before_optimizer=add(memory.before_optimizer),
        peak_in_optimizer=add(memory.peak_in_optimizer),
        segments=tuple(dataclasses.replace(s, peak=add(s.peak)) for s in memory.segments),
    )
