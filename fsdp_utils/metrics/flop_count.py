"""`--flop_counter`: the FLOPs of a training step as torch counts them, beside the estimate.

`torch.utils.flop_counter.FlopCounterMode` counts every matmul, convolution and attention kernel
by formula from its shapes, in forward and backward (autograd runs inside the mode), with what
activation checkpointing recomputes; elementwise work (norms, activations, softmax, the loss) is
not counted. Under FSDP2 each rank counts what it computes: its own micro-batches on whole
(gathered) layers.

What to expect beside the estimate `metrics.throughput.flops_per_token` x tokens (MFU's
numerator, which counts useful work only):

- matmuls: equal within a few percent (tests/test_flops.py checks every tiny family);
- attention under sdpa: torch's SDPA backward formula counts the scores recomputed by the
  flash kernels, 5 matmuls where the estimate's 12·L·H·Q·T counts 4, so attention reads 7/6 of
  the estimate (eager counts exactly 12);
- with --gradient_checkpointing every checkpointed layer's forward again (about 8N instead of
  6N), and LoRA's frozen weights as the estimate counts them.

Given to FlopCounterMode beside torch's registry (`custom_mapping`, nothing global changed):
- the SDPA kernels, counted with torch's own formulas but with grouped-query attention (the
  kernels broadcast the key/value heads; torch's formula asserts equal heads before 2.13, which
  stopped a GQA model's first step on an H100 with torch 2.11), and the CPU's kernel
  (`_scaled_dot_product_flash_attention_for_cpu`), which torch 2.11 and 2.13 do not count at all
  (pytorch#195460; torch 2.15 counts it, registered by pytorch#195801, with the same formula);
- `_grouped_mm`, with which transformers 5 runs the experts of mixture-of-experts layers, where
  torch has no formula for it.
Every formula is guarded: one that fails counts 0 and is named in the log line, never stopping
the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_SDPA_FORWARD = (  # (query, key, value, ...)
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
_SDPA_BACKWARD = tuple(f"{name}_backward" for name in _SDPA_FORWARD)  # (grad_out, q, k, v, ...)


def _with_query_heads(query_shape: Any, *shapes: Any) -> list[Any]:
    """Grouped-query attention: the kernels broadcast the key/value heads to the query's, and
    so does the count (torch's own SDPA formulas assert equal heads before torch 2.13)."""
    heads = query_shape[1]
    return [(shape[0], heads, *shape[2:]) for shape in shapes]


def _sdpa_forward(query_shape: Any, key_shape: Any, value_shape: Any, *_: Any, **__: Any) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    key_shape, value_shape = _with_query_heads(query_shape, key_shape, value_shape)
    return int(sdpa_flop_count(query_shape, key_shape, value_shape))


def _sdpa_backward(
    grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *_: Any, **__: Any
) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    key_shape, value_shape = _with_query_heads(query_shape, key_shape, value_shape)
    return int(sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape))


def _grouped_mm(a_shape: Any, b_shape: Any, *args: Any, **kwargs: Any) -> int:
    """`torch._grouped_mm`: one matmul per group (mixture-of-experts layers run their experts
    with it, in forward and in backward). 2 x the sum over groups of m x k x n, from the shapes
    alone: a group's share of the split dimension is what its offsets give it, and the sum of
    the shares is that dimension's length."""
    if len(a_shape) == 2 and len(b_shape) == 3:  # tokens (m, k) split by offs; (g, k, n)
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 3 and len(b_shape) == 2:  # (g, m, k); (k, n) split by offs
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    if len(a_shape) == 2 and len(b_shape) == 2:  # (m, k) and (k, n), k split by offs
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]  # (g, m, k) @ (g, k, n)


def _addmm(self_shape: Any, a_shape: Any, b_shape: Any, *args: Any, **kwargs: Any) -> int:
    """`addmm` as torch counts it: the matmul's 2 x m x k x n (the addition is not counted)."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def our_formulas() -> dict[Any, Any]:
    """The formulas given to FlopCounterMode beside (or instead of) torch's: SDPA's kernels
    counted with grouped-query attention whatever torch's version, and `_grouped_mm` and
    `addmm_` where torch has no formula for them. Ops this torch does not have are left out."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    ours: dict[Any, Any] = {}
    for names, formula in ((_SDPA_FORWARD, _sdpa_forward), (_SDPA_BACKWARD, _sdpa_backward)):
        for name in names:
            if hasattr(aten, name):
                ours[getattr(aten, name)] = formula
    if hasattr(aten, "_grouped_mm") and aten._grouped_mm not in flop_registry:
        ours[aten._grouped_mm] = _grouped_mm
    # The fused chunked loss adds each chunk's weight gradient in place (train/loss.py); torch
    # counts `addmm` but not `addmm_`, whose arguments and work are the same.
    if aten.addmm_ not in flop_registry:
        ours[aten.addmm_] = _addmm
    return ours


def missing_formulas() -> dict[Any, Any]:
    """The ops of `our_formulas` that torch's registry lacks (none once torch counts them)."""
    from torch.utils.flop_counter import flop_registry

    return {op: f for op, f in our_formulas().items() if op not in flop_registry}


class FlopCount:
    """Counts the FLOPs of whatever runs inside `counting()`. A formula that fails (an op whose
    shapes a torch version's formula does not expect) counts 0 and is named in `skipped`, so
    that a diagnostic never stops a training run."""

    total: int = 0

    def __init__(self) -> None:
        self.skipped: set[str] = set()

    def _safe(self, op: Any, formula: Any, *, raw: bool) -> Any:
        def count(*args: Any, **kwargs: Any) -> int:
            try:
                return int(formula(*args, **kwargs))
            except Exception:  # any failure: count nothing, and say so
                self.skipped.add(str(op))
                return 0

        count._get_raw = raw  # type: ignore[attr-defined]  # FlopCounterMode: args as given
        return count

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        from torch.utils.flop_counter import FlopCounterMode, flop_registry

        # torch's registered formulas take the op's arguments (they turn them into shapes
        # themselves); ours take shapes, which FlopCounterMode makes for them.
        mapping = {op: self._safe(op, f, raw=True) for op, f in flop_registry.items()}
        mapping.update({op: self._safe(op, f, raw=False) for op, f in our_formulas().items()})
        mode = FlopCounterMode(display=False, custom_mapping=mapping)
        with mode:
            yield
        self.total = int(mode.get_total_flops())


def format_flops(value: float) -> str:
    """1.23e14 -> '123.0 TFLOP'."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if value >= scale:
            return f"{value / scale:,.1f} {unit}"
    return f"{value:,.0f} FLOP"


def describe_step_flops(
    measured: float, estimated: float, *, step: int, world_size: int, rank: int = 0
) -> str:
    """One log line: the counted FLOPs of a step on one rank beside MFU's estimate."""
    ratio = measured / estimated if estimated else float("nan")
    return (
        f"flops: step {step}, rank {rank}: {format_flops(measured)} counted by torch's "
        f"FlopCounterMode (matmuls and attention, forward and backward, recomputation "
        f"included), {format_flops(estimated)} estimated for MFU (FLOPs per token x this "
        f"rank's tokens, 1/{world_size} of the step's): counted / estimated = {ratio:.3f}"
    )
