"""`python -m fsdp_utils.plan --calibrate`: this node's rates, measured in about a minute, for the
step-time model (fsdp_utils/plan/step_time.py), written to the site file the next plan reads
(fsdp_utils/plan/site.py).

    srun -N 1 --gpus-per-node 4 python -m fsdp_utils.plan --calibrate --gpus_per_node 4
    python -m fsdp_utils.plan --calibrate --device cpu --gpus_per_node 2      # 2 CPU processes

It starts --gpus_per_node processes (one per GPU, NCCL; with --device cpu, gloo, each with the
threads a run's process gets: $OMP_NUM_THREADS, else the cores shared), all measuring at once
as a run's processes compute at once, and records rank 0's figures:

- matrix products, forward and backward, (tokens x width) @ (width x width) over a grid of
  tokens per micro-batch and widths: the curve the model reads at the run's shapes (bf16 on a
  GPU, fp32 on a CPU);
- causal attention (SDPA, forward and backward) at one length: its executed FLOP/s;
- memory bandwidth: a large copy (bytes read and written per second);
- an operator's launch: a chain of small autograd operators, forward and backward, per op;
- the optimizer on the host: torch's foreach AdamW step and the gradient clipping on CPU
  tensors (what --cpu_offload runs, and on a CPU the optimizer itself), as bytes/s of its
  traffic; and on a GPU node the PCIe copies between pinned host memory and the GPU;
- collectives between the processes: all-gather, reduce-scatter, all-reduce, all-to-all at a
  small and a large size: the latency and the bus bandwidth (nccl-tests' definition).

Between nodes nothing is measured (one node); the fabric is the plan's --interconnect or
--fabric_gbps, else the GPU kind's data sheet's, else InfiniBand NDR (`DEFAULT_FABRIC`, said).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.plan.efficiency import SpeedRow, fit
from fsdp_utils.plan.hardware import (
    DEFAULT_FABRIC,
    FABRIC_LATENCY_S,
    GPU_SPECS,
    Gpu,
    fabric_bandwidth,
    spec_key,
)
from fsdp_utils.plan.site import cpu_key, write_calibration
from fsdp_utils.plan.step_time import (
    CALIBRATED_PRIOR,
    CAUSAL_SHARE,
    Device,
    RunShape,
    optimizer_accesses,
)

Progress = Callable[[str], None]

CPU_GRID = {
    "tokens": (64, 256, 1024, 4096),
    "widths": (64, 256, 1024),
    "lengths": (256, 1024, 2048),
    "head_dims": (32, 64),
    "attention_width": 256,
    "layer": (256, 8, 4, 1024),  # hidden, heads, key-value heads, tokens
}
GPU_GRID = {
    "tokens": (256, 1024, 4096, 16384), "widths": (1024, 2048, 4096, 8192),
    "lengths": (1024, 4096, 16384), "head_dims": (64, 128), "attention_width": 4096,
    "layer": (4096, 32, 8, 4096),
}  # fmt: skip
MALLOC_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
MIN_SECONDS = 0.15  # each measurement repeats until it has run this long (and at least twice)


# On a CPU the process's own CPU seconds: what a step costs on a machine that other work does
# not share (a loaded node's wall clock would put its neighbours' work into the figures).
# A GPU's work is not the process's CPU time: the wall clock there.
_clock = time.perf_counter


def _synchronizer(device: torch.device) -> Callable[[], Any]:
    """What waits for `device`'s queued work: a GPU's synchronize; nothing on a CPU."""
    if device.type == "cuda":
        return functools.partial(torch.cuda.synchronize, device)
    return lambda: None


def _timed(
    work: Callable[[], Any], sync: Callable[[], Any], min_seconds: float = MIN_SECONDS
) -> float:
    """Seconds per call of `work` (after one warm-up call), the median of a few rounds."""
    work()
    sync()
    rounds = []
    for _ in range(3):
        calls, started = 0, _clock()
        while True:
            work()
            calls += 1
            sync()
            elapsed = _clock() - started
            if elapsed >= min_seconds / 3 and calls >= 2:
                break
        rounds.append(elapsed / calls)
    return statistics.median(rounds)


def measure_compute(
    device: torch.device, dtype: torch.dtype, grid: dict[str, Any]
) -> dict[str, Any]:
    """The single-process rates (see the module's docstring)."""

    sync = _synchronizer(device)

    table = []
    for width in grid["widths"]:
        weight = torch.randn(width, width, device=device, dtype=dtype, requires_grad=True)
        for tokens in grid["tokens"]:
            x = torch.randn(tokens, width, device=device, dtype=dtype, requires_grad=True)

            def product(x: torch.Tensor = x, weight: torch.Tensor = weight) -> None:
                torch.nn.functional.linear(x, weight).sum().backward()

            seconds = _timed(product, sync)
            table.append((float(tokens), float(width), 6.0 * tokens * width * width / seconds))

    attention_table = []
    for head_dim in grid["head_dims"]:
        for length in grid["lengths"]:
            heads = grid["attention_width"] // head_dim
            q, k, v = (
                torch.randn(1, heads, length, head_dim, device=device, dtype=dtype,
                            requires_grad=True)
                for _ in range(3)
            )  # fmt: skip

            def attention(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.sum().backward()

            executed = CAUSAL_SHARE * 12.0 * heads * head_dim * length * length
            attention_table.append(
                (float(length), float(head_dim), executed / _timed(attention, sync))
            )
    attention_flops = max(rate for _, _, rate in attention_table)

    size = (512 if device.type == "cuda" else 64) * 2**20
    source = torch.empty(size // 4, device=device, dtype=torch.float32)
    target = torch.empty_like(source)
    memory = 2 * size / _timed(lambda: target.copy_(source), sync)

    x = torch.randn(8, device=device, requires_grad=True)
    chain = 50

    def operators() -> None:
        y = x
        for _ in range(chain):
            y = y * 1.0001 + 0.0001
        y.sum().backward()

    # forward: 2 ops a link, backward about as many
    dispatch = _timed(operators, lambda: None) / (4 * chain)
    if device.type == "cuda":
        sync()

    params = [torch.randn(1 << 20, requires_grad=True) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()

    accesses = optimizer_accesses(RunShape(micro_batch=1, accumulation=1))
    host_optimizer = 16 * (1 << 20) * accesses * 4 / _timed(step, lambda: None)
    host = None
    if device.type == "cuda":
        pinned = torch.empty(size // 4, dtype=torch.float32, pin_memory=True)
        up = size / _timed(lambda: source.copy_(pinned, non_blocking=True), sync)
        down = size / _timed(lambda: pinned.copy_(source, non_blocking=True), sync)
        host = min(up, down)
    return {
        "matmul_table": table,
        "attention_table": attention_table,
        "attention_flops": attention_flops,
        "elementwise_bandwidth": measure_elementwise(device, dtype, grid),
        "memory_bandwidth": memory,
        "dispatch_s": dispatch,
        "host_optimizer_bandwidth": host_optimizer,
        "host_bandwidth": host,
    }


# Operators of a decoder layer that are its products or its attention (what the profiler
# names them); everything else is its elementwise work.
_PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")
_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


def measure_elementwise(device: torch.device, dtype: torch.dtype, grid: dict[str, Any]) -> float:
    """A Llama decoder layer of transformers, forward and backward, timed, and profiled once to
    split its time by operator: what is not its products or its attention is its elementwise
    work (the norms with their fp32 upcast, rotary, the copies for SDPA and grouped-query
    attention, SiLU and the gate's product, the residual adds, autograd's own), returned as
    bytes/s of the step-time model's count of them (`layer_elementwise_bytes`)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from fsdp_utils.plan.step_time import layer_elementwise_bytes

    hidden, heads, kv_heads, tokens = grid["layer"]
    head_dim, intermediate = hidden // heads, hidden * 11 // 4
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
        num_key_value_heads=kv_heads, num_hidden_layers=1, max_position_embeddings=tokens,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, 0).to(device=device, dtype=dtype)
    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    positions = torch.arange(tokens, device=device)[None]
    cos_sin = LlamaRotaryEmbedding(config).to(device)(x, positions)

    def run() -> None:
        out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    gpu = device.type == "cuda"
    sync = _synchronizer(device)
    seconds = _timed(run, sync)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        run()
        sync()
    products = attention = total = 0.0
    for event in prof.key_averages():
        spent = float(event.self_device_time_total if gpu else event.self_cpu_time_total)
        total += spent
        if event.key in _PRODUCTS:
            products += spent
        elif any(name in event.key for name in _ATTENTION):
            attention += spent
    share = max(1.0 - (products + attention) / total, 0.02) if total else 0.5
    moved = 3 * tokens * layer_elementwise_bytes(hidden, heads, kv_heads, head_dim, intermediate)
    return moved / (share * seconds)


def measure_fsdp_hooks(device: torch.device) -> tuple[float, float]:
    """CPU seconds of FSDP2's hooks per shard group and micro-batch: stacks of 2 and 8 tiny
    layers, each a shard group, against the same stacks unsharded."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    x = torch.randn(2, 16, device=device)
    sync = _synchronizer(device)

    def layer_like() -> (
        torch.nn.Module
    ):  # a decoder layer's nine tensors: seven projections, two norms
        parts = [torch.nn.RMSNorm(16), *[torch.nn.Linear(16, 16, bias=False) for _ in range(7)]]
        return torch.nn.Sequential(*parts, torch.nn.RMSNorm(16))

    seconds = {}
    for sharded in (False, True):
        for depth in (2, 8):
            stack = torch.nn.Sequential(*[layer_like() for _ in range(depth)]).to(device)
            if sharded:
                for block in stack:
                    fully_shard(block, mesh=mesh)
                fully_shard(stack, mesh=mesh)

            def step(stack: torch.nn.Module = stack) -> None:
                stack(x).sum().backward()

            seconds[sharded, depth] = _timed_together(step, sync, calls=20)
    hooks = (seconds[True, 8] - seconds[True, 2]) - (seconds[False, 8] - seconds[False, 2])
    # the optimizer on the deepest sharded stack: AdamW and the clipping, per tensor (DTensor's
    # dispatch of each foreach operator)
    params = list(stack.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()

    per_tensor = _timed_together(update, sync, calls=10) / len(params)
    return max(hooks / 6, 0.0), per_tensor


def measure_toolkit_steps(
    rank: int, world: int, device: torch.device, grid: dict[str, Any]
) -> list[dict[str, Any]]:
    """The toolkit's own training step (`TrainStep`: FSDP2 over these processes, the loss in
    chunks, AdamW, the clipping) on small Llamas of the calibration layer's width, 2 and 4
    layers deep, at a short and a long micro-batch, one and two micro-batches a step: measured
    rows for the shares' fit on this device (fsdp_utils/plan/efficiency.py), so that what the
    rates above leave out of a real step (the trainer's loss, autograd, memory mapping) is
    learned where it is measured."""
    from transformers import LlamaConfig

    from fsdp_utils.config.batch import plan_batch
    from fsdp_utils.config.options.parallelism import DeviceName, Precision
    from fsdp_utils.config.train_config import TrainConfig
    from fsdp_utils.model.build import build_meta_model, materialize
    from fsdp_utils.model.transforms import transform_model
    from fsdp_utils.parallel.distributed import DistEnv
    from fsdp_utils.parallel.parallelize import build_parallel_model
    from fsdp_utils.plan.estimate import placeholder_micro_batches, traced_step
    from fsdp_utils.plan.workload import facts_from_meta, run_shape

    hidden, heads, kv_heads, tokens = grid["layer"]
    env = DistEnv(rank, rank, world, world, device, "calibration")
    precision: Precision = "bf16-mixed" if device.type == "cuda" else "fp32"
    device_name: DeviceName = "cuda" if device.type == "cuda" else "cpu"
    sync = _synchronizer(device)
    rows = []
    for layers in (2, 4):
        hf_config = LlamaConfig(
            hidden_size=hidden, intermediate_size=hidden * 2, num_attention_heads=heads,
            num_key_value_heads=kv_heads, num_hidden_layers=layers, vocab_size=512,
            max_position_embeddings=tokens, tie_word_embeddings=False,
        )  # fmt: skip
        for length, accumulation in ((tokens // 4, 2), (tokens, 1)):
            config = TrainConfig(
                model=f"calibration: {layers} layers of {hidden}", max_seq_length=length,
                batch_size_per_device=1, total_batch_size=world * accumulation,
                precision=precision, device=device_name,
            )  # fmt: skip
            batch = plan_batch(config, world)
            model, _ = build_parallel_model(hf_config, config, env)
            materialize(model, device)
            with torch.no_grad():
                for param in model.parameters():
                    local = param.to_local() if hasattr(param, "to_local") else param
                    local.normal_(0.0, 0.02)
            step, _ = traced_step(model, config, env, batch)
            micro = placeholder_micro_batches(batch, accumulation, 0)
            number = iter(range(1, 1000))

            def run(step: Any = step, micro: Any = micro, number: Any = number) -> None:
                step(micro, step=next(number), check=False)

            seconds = _timed_together(run, sync, calls=3)
            meta = transform_model(build_meta_model(hf_config, precision), config)
            facts = facts_from_meta(meta, hf_config, config, name=config.model)
            rows.append(
                {
                    "name": f"{config.model}, {accumulation} x {length} tokens",
                    "cluster": {"nodes": 1, "gpus_per_node": world},
                    "facts": facts.__dict__,
                    "shape": run_shape(config, batch, layers).__dict__,
                    "step_seconds": seconds,
                    "source": "--calibrate: the toolkit's own step",
                }
            )
    return rows


def _timed_together(work: Callable[[], Any], sync: Callable[[], Any], *, calls: int) -> float:
    """Seconds per call of a collective: every rank makes the same calls (a rank that made more
    would wait for a partner that never comes), after a warm-up and a barrier."""
    import torch.distributed as dist

    work()
    sync()
    dist.barrier()
    rounds = []
    for _ in range(3):
        started = _clock()
        for _ in range(calls):
            work()
        sync()
        rounds.append((_clock() - started) / calls)
    return statistics.median(rounds)


def measure_collectives(rank: int, world: int, device: torch.device) -> dict[str, float]:
    """Latency (a 4 KiB collective) and bus bandwidth (a large one, nccl-tests' busbw: the
    bytes x (n - 1) / n each rank moves, per second) of the collectives FSDP2 and Ulysses run."""
    import torch.distributed as dist

    sync = _synchronizer(device)

    # torch 2.13 renamed them (the old names warn); 2.11 has only the old ones
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    large = (256 if device.type == "cuda" else 16) * 2**20
    results: dict[str, float] = {}
    latencies, bandwidths = [], []
    for name in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        times = {}
        for size in (4096, large):
            n = size // 4 // world * world
            full = torch.ones(n, device=device)
            part = torch.ones(n // world, device=device)
            out = torch.empty_like(full)
            calls = {
                "all_gather": functools.partial(gather, out, part),
                "reduce_scatter": functools.partial(scatter, part, full),
                "all_reduce": functools.partial(dist.all_reduce, full),
                "all_to_all": functools.partial(dist.all_to_all_single, out, full),
            }
            call = calls[name]
            times[size] = _timed_together(call, sync, calls=20 if size == 4096 else 5)
        factor = 2.0 if name == "all_reduce" else 1.0
        moved = factor * large * (world - 1) / world
        latency = times[4096]
        bandwidth = moved / max(times[large] - latency, 1e-9)
        results[f"{name}_latency_s"] = latency
        results[f"{name}_busbw"] = bandwidth
        latencies.append(latency)
        bandwidths.append(bandwidth)
    results["latency_s"] = statistics.median(latencies)
    results["busbw"] = statistics.median(bandwidths)
    return results


def _worker(rank: int, world: int, init: str, use_cuda: bool, threads: int, out: str) -> None:
    import torch.distributed as dist

    global _clock
    _clock = time.perf_counter if use_cuda else time.process_time
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if use_cuda else "gloo", init_method=init, rank=rank, world_size=world
    )
    try:
        grid = GPU_GRID if use_cuda else CPU_GRID
        dtype = torch.bfloat16 if use_cuda else torch.float32
        compute = measure_compute(device, dtype, grid)
        collectives = measure_collectives(rank, world, device) if world > 1 else {}
        compute["fsdp_group_s"], compute["optimizer_tensor_s"] = measure_fsdp_hooks(device)
        compute["steps"] = measure_toolkit_steps(rank, world, device, grid)
        if rank == 0:
            Path(out).write_text(json.dumps({"compute": compute, "collectives": collectives}))
    finally:
        dist.destroy_process_group()


def measure(processes: int, *, use_cuda: bool) -> dict[str, Any]:
    """Start `processes` processes that measure at once; rank 0's figures."""
    import torch.multiprocessing as mp

    cores = os.cpu_count() or 1
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or max(1, cores // processes)
    # The processes' malloc as a training process has it (fsdp_utils/run/host_memory.py fixes
    # the mmap threshold: every large block mapped and zeroed afresh, 1.1-1.3x a CPU step's
    # time): glibc reads this before they start. A threshold of the user's own is kept.
    saved = os.environ.get(MALLOC_THRESHOLD)
    os.environ.setdefault(MALLOC_THRESHOLD, str(128 * 1024))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rates.json"
            init = f"file://{Path(tmp) / 'store'}"
            mp.start_processes(
                _worker,
                args=(processes, init, use_cuda, threads, str(out)),
                nprocs=processes,
                start_method="spawn",
            )
            data = json.loads(out.read_text())
    finally:
        if saved is None:
            os.environ.pop(MALLOC_THRESHOLD, None)
    data["threads"] = threads
    return data


def calibrate_node(config: TrainConfig, processes: int, *, progress: Progress) -> str:
    """Measure, write the site's calibration of this node's device, and say what was measured."""
    use_cuda = config.device != "cpu" and torch.cuda.is_available()
    if config.device == "cuda" and not use_cuda:
        raise ValueError("--calibrate --device cuda: this node has no CUDA device.")
    if use_cuda and processes > torch.cuda.device_count():
        raise ValueError(
            f"--calibrate --gpus_per_node {processes}: this node has "
            f"{torch.cuda.device_count()} GPU(s)."
        )
    progress(f"calibrating: {processes} process(es) on {'GPUs' if use_cuda else 'the CPU'} ...")
    started = time.perf_counter()
    data = measure(processes, use_cuda=use_cuda)
    compute, comm = data["compute"], data["collectives"]
    if use_cuda:
        props = torch.cuda.get_device_properties(0)
        gpu = Gpu(props.name, int(props.total_memory))
        key = spec_key(gpu) or f"gpu:{props.name}"
        spec = GPU_SPECS.get(key)
        # the products are measured in bf16 (an fp32 plan takes the data sheet: plan/speed.py)
        peak = spec.bf16_flops if spec else 0.0
        # not measured (one node): the flags, the data sheet's, or DEFAULT_FABRIC (said below)
        fabric = fabric_bandwidth(config.interconnect, config.fabric_gbps, spec)
        name, kind = props.name, "gpu"
    else:
        key, spec, peak, fabric = cpu_key(), None, 0.0, 0.0
        name, kind = f"{key.removeprefix('cpu:')} ({data['threads']} thread(s) a process)", "cpu"
    measured_peak = max(rate for _, _, rate in compute["matmul_table"])
    link = comm.get("busbw", compute["memory_bandwidth"])
    latency = comm.get("latency_s", 0.0)
    device = Device(
        name=name,
        kind=kind,
        matmul_flops=peak or measured_peak,
        memory_bandwidth=compute["memory_bandwidth"],
        link_bandwidth=link,
        fabric_bandwidth=fabric or link,
        host_bandwidth=compute["host_bandwidth"] or compute["memory_bandwidth"],
        link_latency=latency,
        fabric_latency=max(latency, FABRIC_LATENCY_S) if fabric else latency,
        host_optimizer_bandwidth=compute["host_optimizer_bandwidth"],
        dispatch_s=compute["dispatch_s"],
        matmul_table=tuple(tuple(row) for row in compute["matmul_table"]),
        attention_flops=compute["attention_flops"],
        attention_table=tuple(tuple(row) for row in compute["attention_table"]),
        elementwise_bandwidth=compute["elementwise_bandwidth"],
        fsdp_group_s=compute["fsdp_group_s"],
        optimizer_tensor_s=compute["optimizer_tensor_s"],
        source=f"calibrated {time.strftime('%Y-%m-%d')}",
    )
    steps = [{**row, "device": device.to_dict()} for row in compute["steps"]]
    path = write_calibration(
        key, device, {"processes": processes, "collectives": comm, "rows": steps}
    )
    fitted = fit([SpeedRow.from_dict(row) for row in steps], CALIBRATED_PRIOR)
    lines = [
        f"calibrated {name} ({key}) in {time.perf_counter() - started:.0f} s, "
        f"{processes} process(es) at once; written to {path}:",
        f"  matrix products   {measured_peak / 1e9:,.1f} GFLOP/s at best "
        f"({min(r for _, _, r in compute['matmul_table']) / 1e9:,.1f} at the fewest tokens)",
        f"  causal attention  {compute['attention_flops'] / 1e9:,.1f} GFLOP/s",
        f"  memory            {compute['memory_bandwidth'] / 1e9:,.1f} GB/s (copy: read + write)",
        f"  operator launch   {compute['dispatch_s'] * 1e6:,.1f} us; FSDP2's hooks "
        f"{compute['fsdp_group_s'] * 1e3:,.2f} ms per shard group and micro-batch; the "
        f"optimizer {compute['optimizer_tensor_s'] * 1e6:,.0f} us per sharded tensor",
        f"  elementwise       {compute['elementwise_bandwidth'] / 1e9:,.1f} GB/s (a decoder "
        "layer's norms, rotary, activations, forward and backward)",
        f"  the toolkit's own step, {len(steps)} sizes ("
        + ", ".join(f"{r['step_seconds'] * 1e3:,.0f}" for r in steps)
        + " ms): the shares fitted to them: "
        + ", ".join(
            f"{n} {getattr(fitted, n):.3g}"
            for n in ("matmul", "attention", "elementwise", "dispatch", "step_overhead_s")
        ),
        f"  host optimizer    {compute['host_optimizer_bandwidth'] / 1e9:,.1f} GB/s of AdamW "
        "traffic",
    ]
    if compute["host_bandwidth"]:
        lines.append(f"  PCIe              {compute['host_bandwidth'] / 1e9:,.1f} GB/s")
    if comm:
        lines.append(
            f"  collectives       {comm['busbw'] / 1e9:,.2f} GB/s bus bandwidth, "
            f"{comm['latency_s'] * 1e6:,.0f} us latency (median of all-gather, reduce-scatter, "
            "all-reduce, all-to-all)"
        )
    if fabric:
        given = config.interconnect or config.fabric_gbps
        what = "as given" if given else f"{spec.fabric if spec else DEFAULT_FABRIC}, assumed"
        lines.append(
            f"  between nodes     {fabric * 8 / 1e9:,.0f} Gb/s per GPU ({what}; not measured: "
            "--interconnect, --fabric_gbps on the plan set it)"
        )
    if spec is not None and peak:
        lines.append(
            f"  against the data sheet: products at {measured_peak / peak:.0%} of "
            f"{peak / 1e12:,.0f} TFLOP/s, memory at "
            f"{compute['memory_bandwidth'] / spec.memory_bandwidth:.0%}"
        )
    return "\n".join(lines)
