"""Optimizer and learning-rate schedule, and what a resume takes from the current config."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_utils.config.train_config import TrainConfig

ADAMW_BETAS = (0.9, 0.95)


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW keeps two states per parameter (8 bytes/param in fp32); SGD without momentum none.

    With FSDP2 the parameters are DTensor shards, so the state is sharded too. The
    implementation is explicit (`implementation`): foreach, or with --fused_optimizer the fused
    kernel where torch has one. torch.optim would pick foreach for CUDA parameters but a
    per-tensor loop for CPU ones (CPU runs, --cpu_offload), and the memory planner must trace
    what the GPUs will run: foreach's update makes a temporary the size of the parameters
    (the square root of the second moments), the fused kernel none.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    fused = implementation(params, config).fused
    kernel: dict[str, bool] = {"fused": True} if fused else {"foreach": True}
    if config.optimizer == "adamw":
        return torch.optim.AdamW(
            params,
            lr=config.learning_rate,
            weight_decay=config.weight_decay,
            betas=ADAMW_BETAS,
            **kernel,
        )
    return torch.optim.SGD(
        params,
        lr=config.learning_rate,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        **kernel,
    )


@dataclass(frozen=True)
class Implementation:
    """Which kernel updates the parameters, and why: the log's `optimizer:` line."""

    fused: bool
    note: str


def implementation(params: Sequence[torch.Tensor], config: TrainConfig) -> Implementation:
    """Fused with --fused_optimizer when torch's own test accepts every parameter (its
    `_device_dtype_check_for_fused`: a floating-point tensor on a device with fused kernels,
    CUDA and CPU among them), else foreach. The same parameters give the same answer in the
    run and in the planner's trace (fake tensors on the CPU stand for the GPU's: both have the
    kernel)."""
    name = "AdamW" if config.optimizer == "adamw" else "SGD"
    if not config.fused_optimizer:
        return Implementation(
            False, f"optimizer: {name}, foreach (--fused_optimizer: torch's fused kernel)"
        )
    refused = _fused_refusal(params)
    if refused is not None:
        return Implementation(
            False, f"optimizer: {name}, foreach (--fused_optimizer: no fused kernel: {refused})"
        )
    where = ", ".join(sorted({f"{p.device.type} {_dtype_name(p)}" for p in params})) or "none"
    return Implementation(True, f"optimizer: {name}, fused (torch's kernel for {where} parameters)")


def _fused_refusal(params: Sequence[torch.Tensor]) -> str | None:
    """Why torch would refuse `fused=True` for these parameters, in its own words; None: it
    takes them."""
    from torch.optim import optimizer as torch_optimizer

    check = getattr(torch_optimizer, "_device_dtype_check_for_fused", None)
    if check is None:  # a torch without the test (older than our floor): foreach is safe
        return "this torch has no fused-kernel test"
    for param in params:
        try:
            check(param)
        except RuntimeError as err:
            return " ".join(str(err).split())
    return None


def optimizer_note(optimizer: torch.optim.Optimizer, config: TrainConfig) -> str:
    """The log's line on the optimizer's kernel (`implementation`)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return implementation(params, config).note


def _dtype_name(param: torch.Tensor) -> str:
    return str(param.dtype).removeprefix("torch.")


def lr_multiplier(step: int, config: TrainConfig) -> float:
    """Linear warmup to the peak, then cosine/linear decay to `min_lr_ratio` (or constant).

    `step` counts completed optimizer steps: the first update uses step 0.
    """
    warmup = config.resolved_warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if config.lr_schedule == "constant":
        return 1.0
    decay_steps = max(config.max_training_steps - warmup, 1)
    progress = min((step - warmup) / decay_steps, 1.0)
    if config.lr_schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: TrainConfig, *, start_step: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule of `config`, positioned at `start_step` (completed steps).

    The peak is set from the config, never taken over from the optimizer: after a resume the
    param groups hold the checkpoint's `initial_lr`, which the scheduler would otherwise keep.
    The learning rate is a function of the step and the current config only, like the data order.
    """
    for group in optimizer.param_groups:
        group["initial_lr"] = config.learning_rate
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, config), last_epoch=start_step - 1
    )


# --- resume: the current config decides ------------------------------------------------------

# What the optimizer and the schedule take from the config. Saved with every checkpoint, so that
# a resume can say what changed.
SCHEDULE_FIELDS = ("lr_schedule", "warmup_steps", "min_lr_ratio", "max_training_steps")


def optimizer_settings(config: TrainConfig) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "learning_rate": config.learning_rate,
        "weight_decay": config.weight_decay,
    }
    if config.optimizer == "adamw":
        settings["betas"] = list(ADAMW_BETAS)
    else:
        settings["momentum"] = config.momentum
    settings.update({name: getattr(config, name) for name in SCHEDULE_FIELDS})
    settings["warmup_steps"] = config.resolved_warmup_steps
    return settings


def settings_in_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The settings a loaded optimizer state carries (checkpoints written before the settings
    were saved beside it): no schedule, only the param groups' values."""
    group = optimizer.param_groups[0]
    found: dict[str, Any] = {
        "learning_rate": group.get("initial_lr", group["lr"]),
        "weight_decay": group["weight_decay"],
    }
    if "betas" in group:
        found["betas"] = list(group["betas"])
    if "momentum" in group:
        found["momentum"] = group["momentum"]
    return found


def apply_settings(optimizer: torch.optim.Optimizer, config: TrainConfig) -> None:
    """Weight decay and betas/momentum of the current config, in every param group (a loaded
    optimizer state brings the checkpoint's), and the kernel this optimizer was built with
    (torch's `load_state_dict` takes `fused` and `foreach` from the checkpoint too: a run
    saved with --fused_optimizer would resume fused without it). The learning rate is set by
    `build_scheduler`."""
    for group in optimizer.param_groups:
        for kernel in ("fused", "foreach"):
            group[kernel] = optimizer.defaults.get(kernel)
        group["weight_decay"] = config.weight_decay
        if "betas" in group:
            group["betas"] = ADAMW_BETAS
        if "momentum" in group:
            group["momentum"] = config.momentum


def describe_changes(saved: dict[str, Any], config: TrainConfig, step: int) -> list[str]:
    """One line per setting that differs from the checkpoint's, with what it means."""
    current = optimizer_settings(config)
    changed = [k for k in current if k in saved and _differs(saved[k], current[k])]
    lines = [f"{k}: {saved[k]} -> {current[k]}" for k in changed]
    if not changed:
        return []
    lr_now = config.learning_rate * lr_multiplier(step, config)
    if any(k == "learning_rate" or k in SCHEDULE_FIELDS for k in changed):
        before = _config_with(config, saved)
        lr_before = before.learning_rate * lr_multiplier(step, before)
        lines.append(
            f"the learning-rate schedule is the new one from step {step + 1} on: lr "
            f"{lr_now:.3g} there (the saved settings would give {lr_before:.3g}); the "
            f"steps already done keep the lr they had"
        )
    if any(k in ("weight_decay", "betas", "momentum") for k in changed):
        lines.append(f"the new optimizer settings apply to every update from step {step + 1} on")
    return lines


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float):
        return not math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return bool(a != b)


def _config_with(config: TrainConfig, saved: dict[str, Any]) -> TrainConfig:
    known = {"learning_rate", *SCHEDULE_FIELDS}
    return config.replace(**{k: v for k, v in saved.items() if k in known})
