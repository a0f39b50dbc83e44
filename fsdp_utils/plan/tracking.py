"""Measure one `Trainer.train_step` with PyTorch's FSDP memory tracker.

The planner (fake tensors, `estimate.py`) and the validation run (real tensors under torchrun,
`measure.py`) both call `track_train_step`, so what is compared is measured the same way.

`FSDPMemTracker` (torch.distributed._tools) is a dispatch mode: it sees every tensor created or
freed, and files each storage under a category (sharded/unsharded parameters and gradients,
activations, backward temporaries, all-gather/reduce-scatter buffers, optimizer state). It counts
tensor bytes, not what the CUDA caching allocator reserves around them (`report.Margin`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fsdp_utils.trainer import Trainer

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
class StepMemory:
    """Tracker snapshots of one training step on one device, in bytes by tracker category.

    peak: at the step's highest total. peak_before_optimizer: the highest total during the
    micro-batches' forward and backward passes. before_optimizer: what is alive when the optimizer
    step starts (parameters, gradients and optimizer state: the "state" of the textbook figures).
    """

    peak: Snapshot
    peak_before_optimizer: Snapshot
    before_optimizer: Snapshot
    micro_batches: int = 0
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
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepMemory:
        return cls(
            peak=dict(data["peak"]),
            peak_before_optimizer=dict(data["peak_before_optimizer"]),
            before_optimizer=dict(data["before_optimizer"]),
            micro_batches=int(data.get("micro_batches", 0)),
            extra=dict(data.get("extra", {})),
        )


def _device_snapshot(
    snapshots: dict[torch.device, dict[Any, int]], device: torch.device
) -> Snapshot:
    """One device's snapshot with plain string keys (the tracker keys categories by enum)."""
    for dev, snap in snapshots.items():
        if dev.type == device.type and (device.index is None or dev.index == device.index):
            return {getattr(key, "value", str(key)): int(value) for key, value in snap.items()}
    return {TOTAL: 0}


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


def track_train_step(trainer: Trainer) -> StepMemory:
    """Run `trainer.train_step()` once under `FSDPMemTracker` and return its snapshots.

    Call it after an untracked warm-up step: the first step creates the optimizer state lazily,
    inside `optimizer.step()`, so a first tracked step would count AdamW's moments as scratch
    and misplace its peak. The tracker refuses a second forward of the root module in one
    tracking context (it takes it for the next iteration), so its per-module statistics are reset
    before every micro-batch; its overall peak is kept. Gradients accumulated without sync are
    filed as gradients there too.
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

    model, optimizer, device = trainer.model, trainer.optimizer, trainer.env.device
    tracker = FSDPMemTracker(model, optimizer)
    seen: dict[str, Any] = {"micro_batches": 0}

    def before_micro_batch(*_: Any) -> None:
        tracker.reset_mod_stats()
        seen["micro_batches"] += 1
        for grad in _accumulated_gradients(model):
            tracker._update_and_maybe_create_winfos(grad, _FSDPRefType.UNSHARDED_GRAD)

    def before_optimizer_step(*_: Any) -> None:
        seen["peak_before_optimizer"] = _device_snapshot(
            tracker.get_tracker_snapshot("peak"), device
        )
        seen["before_optimizer"] = _device_snapshot(tracker.get_tracker_snapshot("current"), device)

    with tracker:
        # Registered after the tracker's own hooks, and prepended, so that the reset runs first.
        handles = [
            model.register_forward_pre_hook(before_micro_batch, prepend=True),
            optimizer.register_step_pre_hook(before_optimizer_step),
        ]
        try:
            trainer.train_step()
        finally:
            for handle in handles:
                handle.remove()
    assert "before_optimizer" in seen, "train_step did not call optimizer.step()"
    return StepMemory(
        peak=_device_snapshot(tracker.get_tracker_snapshot("peak"), device),
        peak_before_optimizer=seen["peak_before_optimizer"],
        before_optimizer=seen["before_optimizer"],
        micro_batches=seen["micro_batches"],
    )
