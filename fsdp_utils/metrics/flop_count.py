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

torch 2.13's registry lacks two kernels this trainer runs, which would count as zero: the CPU's
SDPA kernel (`_scaled_dot_product_flash_attention_for_cpu`, pytorch#195460; counted here with
torch's own SDPA formulas, as pytorch#195801 registers them) and `_grouped_mm`, with which
transformers 5 runs the experts of mixture-of-experts layers. Both go in through
FlopCounterMode's `custom_mapping`; torch's own formulas win once it has them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _cpu_sdpa_forward(
    query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any
) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return int(sdpa_flop_count(query_shape, key_shape, value_shape))


def _cpu_sdpa_backward(
    grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *a: Any, **k: Any
) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

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


def missing_formulas() -> dict[Any, Any]:
    """Formulas for the ops torch's registry lacks (none once torch counts them itself)."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    ours = {
        aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
        aten._grouped_mm: _grouped_mm,
    }
    return {op: formula for op, formula in ours.items() if op not in flop_registry}


class FlopCount:
    """Counts the FLOPs of whatever runs inside `counting()`."""

    total: int = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        from torch.utils.flop_counter import FlopCounterMode

        mode = FlopCounterMode(display=False, custom_mapping=missing_formulas())
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
