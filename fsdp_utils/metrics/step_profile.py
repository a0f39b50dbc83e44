"""Where one training step's time goes, from a torch profiler trace (`--profile_steps`): the
device time by bucket, the idle time between kernels, host syncs, and the matrix products'
achieved FLOP/s. `bench/profile_step.py --buckets` runs a configuration and prints this.

The trace is the Chrome trace `tensorboard_trace_handler` writes (fsdp_utils/metrics/profile.py).
Its device activities are the GPU's kernels, copies and memsets (`cat` kernel, gpu_memcpy,
gpu_memset); on a CPU run, which has none, the CPU operators stand in for them, each with its
own time (without the operators it calls: `aten::mm`'s work, not `aten::linear`'s around it),
and gloo's collectives, so the same arithmetic runs, and is tested, on the CPU
(tests/test_step_profile.py, on a recorded trace).

Each activity gets one bucket, from its own name and the names of the CPU operators and
annotations around the operator that launched it (a kernel's `External id` is its launching
operator's), first match wins:

| bucket | what | found by |
| --- | --- | --- |
| collectives | all-gathers, reduce-scatters, all-reduces | NCCL kernels (`ncclDevKernel_*`); gloo's and c10d's operators |
| FSDP copies | FSDP2's copy-in/copy-out around its collectives, casts to the compute dtype, gradient reduction's division | anything inside an `FSDP::` annotation |
| optimizer | the AdamW step and gradient clipping | inside `Optimizer.step#...`; `_foreach_*` / fused Adam operators; `multi_tensor_apply_kernel` |
| loss | the output layer and cross-entropy of the loss where they are fused (train/loss.py's `_LinearNLLSum`, liger's FLCE), softmax, NLL | operators and kernels named so |
| attention | SDPA's kernels, flex attention, and what the math path runs inside | `scaled_dot_product` operators; flash, cutlass FMHA and cuDNN SDPA kernels |
| matrix products | the linear layers (and an unfused output layer) | `mm`, `addmm`, `bmm`, ... operators; cuBLAS (`gemm`, `nvjet`, `xmma`), CUTLASS kernels |
| fused kernels | what the compiler generated (`--compile`) and liger-kernel's | Triton kernels: `triton_*`, liger's names |
| memory copies | other copies and memsets (the batch to the GPU, values to the host) | gpu_memcpy, gpu_memset |
| elementwise and reductions | the rest: norms, rotary, activations, residual adds, ... | |

The idle time is the step's wall time (its `ProfilerStep#k` annotation, extended to the end of
the last activity launched inside it) minus the union of the activities' intervals: the time
the device had nothing to run (launch overhead, host work, syncs). Host syncs are the CUDA
runtime's synchronising calls; device-to-host copies are the DtoH memcpys; host reads are the
operators that read a tensor's value on the host (`aten::_local_scalar_dense`: `.item()`,
`float()`), each a sync on a GPU. The matrix products' FLOPs are 2 M K N per product, from
the recorded input shapes (`record_shapes`).
"""

from __future__ import annotations

import gzip
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUCKETS = (
    "matrix products",
    "attention",
    "fused kernels",
    "elementwise and reductions",
    "optimizer",
    "FSDP copies",
    "collectives",
    "loss",
    "memory copies",
)
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# CUDA runtime calls that wait for the device (the host syncs)
SYNC_CALLS = frozenset(
    {"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
)
HOST_READS = frozenset({"aten::_local_scalar_dense"})


def _pattern(*parts: str) -> re.Pattern[str]:
    return re.compile("|".join(parts), re.IGNORECASE)


COLLECTIVE = _pattern(
    r"^nccl", r"nccldevkernel", r"^gloo:", r"^nccl:", r"^c10d::", r"^record_param_comms$"
)
OPTIMIZER = _pattern(
    r"^Optimizer\.(step|zero_grad)#", r"^aten::_foreach_", r"^aten::_fused_adam",
    r"multi_tensor_apply_kernel", r"FusedAdam",
)  # fmt: skip
LOSS = _pattern(
    r"_LinearNLLSum", r"cross_entropy", r"nll_loss", r"NllLoss", r"log_softmax", r"LogSoftmax",
    r"cunn_SoftMax", r"Liger.*CrossEntropy",
)  # fmt: skip
ATTENTION = _pattern(
    r"scaled_dot_product", r"ScaledDotProduct", r"flash_attention", r"flex_attention",
    r"flash_fwd", r"flash_bwd", r"pytorch_flash::", r"fmha", r"cudnn_generated_fort_native_sdpa",
    r"cudnn::fusion", r"sdpa",
)  # fmt: skip
MATMUL_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::_grouped_mm",
        "aten::_scaled_mm",
    }
)
# The matrix products' kernels (their operators: MATMUL_OPS)
MATMUL = _pattern(r"gemm", r"^nvjet", r"xmma", r"cutlass", r"cublas")
# Triton: the compiler's kernels, and liger-kernel 0.8.5's (liger_kernel/ops/*.py's @triton.jit
# functions; its cross-entropy kernels count as loss above)
FUSED = _pattern(
    r"^triton_", r"_rms_norm_(forward|backward)_kernel", r"_swiglu_", r"_geglu_", r"_triton_rope",
)  # fmt: skip


def classify(name: str, around: Sequence[str] = (), *, category: str = "kernel") -> str:
    """The bucket of a device activity named `name` (a kernel, or a CPU operator standing in
    for one), launched inside the CPU operators and annotations `around` (outermost first);
    `category`: the trace's (`gpu_memcpy`, `gpu_memset` for copies)."""
    names = [*around, name]
    if any(COLLECTIVE.search(n) for n in names):
        return "collectives"
    if any(n.startswith("FSDP::") or n.startswith("fsdp::") for n in names):
        return "FSDP copies"
    if any(OPTIMIZER.search(n) for n in names):
        return "optimizer"
    if category in ("gpu_memcpy", "gpu_memset"):
        return "memory copies"
    if any(LOSS.search(n) for n in names):
        return "loss"
    if any(ATTENTION.search(n) for n in names):
        return "attention"
    if MATMUL.search(name) or any(n in MATMUL_OPS for n in names):
        return "matrix products"
    if FUSED.search(name):
        return "fused kernels"
    return "elementwise and reductions"


# --- the trace ------------------------------------------------------------------------------


def read_trace(path: Path) -> dict[str, Any]:
    """A Chrome trace (`.pt.trace.json`, or gzipped)."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)  # type: ignore[no-any-return]


@dataclass
class _Op:
    name: str
    start: float
    end: float
    tid: Any
    args: dict[str, Any]
    category: str
    around: tuple[str, ...] = ()  # enclosing operators and annotations, outermost first
    inner: float = 0.0  # time of the CPU activities directly inside it
    outer: bool = True  # inside no other CPU activity

    @property
    def activity(self) -> bool:
        """What stands for a device activity in a CPU trace: an operator, or a collective's
        annotation (gloo's run on a thread of their own, as NCCL's kernels on a stream)."""
        return self.category == "cpu_op" or bool(COLLECTIVE.search(self.name))

    @property
    def self_time(self) -> float:
        return self.end - self.start - self.inner


def _host_events(events: Iterable[dict[str, Any]]) -> list[_Op]:
    """The CPU operators and annotations (every thread), each with what encloses it and the
    time of the activities directly inside it."""
    ops = [
        _Op(
            e["name"],
            float(e["ts"]),
            float(e["ts"]) + float(e.get("dur", 0)),
            e.get("tid"),
            e.get("args", {}),
            e["cat"],
        )
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function")
    ]
    by_thread: dict[Any, list[_Op]] = {}
    for op in ops:
        by_thread.setdefault(op.tid, []).append(op)
    for thread in by_thread.values():
        thread.sort(key=lambda o: (o.start, -o.end))
        stack: list[_Op] = []
        for op in thread:
            while stack and stack[-1].end <= op.start:
                stack.pop()
            op.around = tuple(o.name for o in stack)
            if op.activity:
                parent = next((o for o in reversed(stack) if o.activity), None)
                if parent is not None:
                    parent.inner += op.end - op.start
                    op.outer = False
            stack.append(op)
    return ops


def _matmul_flops(name: str, args: dict[str, Any]) -> float:
    """2 M K N (per batch entry) of a matrix product from its recorded input shapes."""
    dims = args.get("Input Dims") or []
    shapes = [d for d in dims if isinstance(d, list) and len(d) >= 2]
    if name in ("aten::addmm", "aten::baddbmm"):
        shapes = shapes[1:]  # the bias (or the added tensor) first
    if len(shapes) < 2:
        return 0.0
    a, b = shapes[0], shapes[1]
    return 2.0 * math.prod(a) * b[-1]


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


@dataclass
class StepBreakdown:
    """One step of a trace, times in microseconds."""

    step: str  # the trace's annotation: ProfilerStep#k
    device: str  # "cuda": GPU kernels; "cpu": innermost CPU operators stand in
    wall_us: float
    busy_us: float  # the union of the activities' intervals
    buckets: dict[str, float] = field(default_factory=dict)  # summed activity time
    activities: int = 0
    host_syncs: int = 0  # CUDA runtime calls that wait for the device
    device_to_host: int = 0  # DtoH copies
    host_reads: int = 0  # tensor values read on the host (`.item()`, `float()`)
    matmul_flops: float = 0.0
    matmul_us: float = 0.0

    @property
    def idle_us(self) -> float:
        return max(self.wall_us - self.busy_us, 0.0)

    @property
    def matmul_tflops(self) -> float | None:
        return self.matmul_flops / self.matmul_us / 1e6 if self.matmul_us else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "device": self.device, "wall_ms": self.wall_us / 1e3,
            "busy_ms": self.busy_us / 1e3, "idle_ms": self.idle_us / 1e3,
            "buckets_ms": {k: v / 1e3 for k, v in self.buckets.items()},
            "activities": self.activities, "host_syncs": self.host_syncs,
            "device_to_host_copies": self.device_to_host, "host_reads": self.host_reads,
            "matmul_gflop": self.matmul_flops / 1e9, "matmul_tflops": self.matmul_tflops,
        }  # fmt: skip


def breakdown(trace: dict[str, Any], step: int = -1) -> StepBreakdown:
    """The `step`-th step (`ProfilerStep#` annotations in order; -1: the last) of a trace."""
    events = trace["traceEvents"]
    host = _host_events(events)
    steps = sorted((o for o in host if o.name.startswith("ProfilerStep#")), key=lambda o: o.start)
    if not steps:
        raise ValueError("the trace has no ProfilerStep# annotation (torch.profiler's schedule)")
    window = steps[step]
    inside = [o for o in host if window.start <= o.start < window.end]
    launched = {
        o.args["External id"]: o
        for o in inside
        if o.args.get("External id") is not None and not o.name.startswith("ProfilerStep#")
    }
    kernels = [
        e for e in events
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES
        and (e.get("args", {}).get("External id") in launched
             or window.start <= float(e["ts"]) < window.end)
    ]  # fmt: skip
    result = StepBreakdown(window.name, "cuda" if kernels else "cpu", 0.0, 0.0)
    result.buckets = dict.fromkeys(BUCKETS, 0.0)
    intervals: list[tuple[float, float]] = []
    if kernels:
        for e in kernels:
            start, duration = float(e["ts"]), float(e.get("dur", 0))
            op = launched.get(e.get("args", {}).get("External id"))
            around = (*op.around, op.name) if op is not None else ()
            bucket = classify(e["name"], around, category=e["cat"])
            result.buckets[bucket] += duration
            intervals.append((start, start + duration))
            if bucket == "matrix products" and op is not None and op.name in MATMUL_OPS:
                result.matmul_us += duration
            if e["cat"] == "gpu_memcpy" and "DtoH" in e["name"]:
                result.device_to_host += 1
        for op in launched.values():  # the FLOPs once per product, however many kernels
            if op.name in MATMUL_OPS and classify(op.name, op.around) == "matrix products":
                result.matmul_flops += _matmul_flops(op.name, op.args)
        runtime = [
            e for e in events
            if e.get("cat") == "cuda_runtime" and window.start <= float(e["ts"]) < window.end
        ]  # fmt: skip
        result.host_syncs = sum(e["name"] in SYNC_CALLS for e in runtime)
    else:  # each CPU activity's own time (without what it calls) in its bucket
        for op in inside:
            if not op.activity:
                continue
            bucket = classify(op.name, op.around, category="cpu_op")
            result.buckets[bucket] += op.self_time
            if op.outer:
                intervals.append((op.start, op.end))
            if bucket == "matrix products":
                result.matmul_us += op.self_time
                if op.name in MATMUL_OPS:
                    result.matmul_flops += _matmul_flops(op.name, op.args)
    result.activities = len(kernels) or sum(o.activity for o in inside)
    result.host_reads = sum(o.name in HOST_READS for o in inside)
    end = max([window.end, *(stop for _, stop in intervals)])
    result.wall_us = end - window.start
    result.busy_us = _union([(max(a, window.start), b) for a, b in intervals])
    return result


def describe(result: StepBreakdown, *, bare_tflops: float | None = None) -> str:
    """The breakdown as a Markdown table and a few lines (docs/profiling.md)."""
    busy = sum(result.buckets.values()) or 1.0
    what = "GPU time" if result.device == "cuda" else "CPU time (each operator's own)"
    lines = [f"| bucket | {what}, ms | share |", "| --- | ---: | ---: |"]
    for bucket, micros in sorted(result.buckets.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {bucket} | {micros / 1e3:.2f} | {micros / busy:.1%} |")
    lines.append(
        f"\n{result.step}: wall {result.wall_us / 1e3:.2f} ms, busy {result.busy_us / 1e3:.2f} ms "
        f"(the union of {result.activities} activities), idle {result.idle_us / 1e3:.2f} ms "
        f"({result.idle_us / max(result.wall_us, 1e-9):.1%}); host syncs {result.host_syncs}, "
        f"device-to-host copies {result.device_to_host}, host reads of tensor values "
        f"{result.host_reads}"
    )
    achieved = result.matmul_tflops
    if achieved is not None:
        line = (
            f"matrix products: {result.matmul_flops / 1e9:.2f} GFLOP in "
            f"{result.matmul_us / 1e3:.2f} ms, {achieved:.2f} TFLOP/s"
        )
        if bare_tflops:
            line += f" ({achieved / bare_tflops:.0%} of a bare matmul's {bare_tflops:.1f})"
        lines.append(line)
    return "\n".join(lines)


def trim(trace: dict[str, Any], step: int = -1) -> dict[str, Any]:
    """The trace cut to one step's events, with only what `breakdown` reads (a test fixture of
    a real trace: tests/fixtures/step_profile/)."""
    events = trace["traceEvents"]
    window = breakdown(trace, step)
    starts = [o.start for o in _host_events(events) if o.name == window.step]
    start, end = starts[0], starts[0] + window.wall_us
    keep_args = ("External id", "Input Dims", "correlation")
    kept = [
        {**{k: e[k] for k in ("ph", "cat", "name", "ts", "dur", "tid", "pid") if k in e},
         "args": {k: v for k, v in e.get("args", {}).items() if k in keep_args}}
        for e in events
        if e.get("ph") == "X" and start <= float(e["ts"]) <= end
        and e.get("cat") in ("cpu_op", "user_annotation", "python_function", "cuda_runtime",
                             *DEVICE_CATEGORIES)
    ]  # fmt: skip
    return {"traceEvents": kept}
