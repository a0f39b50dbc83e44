"""`plan_memory`: will this run fit, and if not, what is the cheapest change that makes it fit;
`find_max_batch`: the largest batch per device that fits."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fsdp_utils.config.batch import divisors
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.methods.registry import method_class
from fsdp_utils.plan.estimate import Cluster, estimate
from fsdp_utils.plan.hardware import Gpu
from fsdp_utils.plan.report import Fix, Margin, MemoryPlan
from fsdp_utils.plan.search import batch_candidates, largest_fitting, resolved_total_batch
from fsdp_utils.plan.tracking import TOTAL

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def _gpu(gpu_memory_bytes: int | None, gpu_name: str | None) -> Gpu | None:
    if gpu_memory_bytes is None:
        return None
    return Gpu(gpu_name or "", gpu_memory_bytes)


def evaluate(
    config: TrainConfig,
    cluster: Cluster,
    gpu: Gpu | None,
    margin: Margin,
    *,
    full_trace: bool = False,
) -> MemoryPlan:
    """Trace `config` on `cluster` and compare with the GPU; no fixes."""
    result = estimate(config, cluster, full_trace=full_trace)
    breakdown = result.memory.breakdown(offloaded=config.cpu_offload)
    return MemoryPlan(
        config=config,
        cluster=cluster,
        batch=result.batch,
        model=result.model,
        breakdown=breakdown,
        state_bytes=result.memory.state_bytes,
        # With CPU offload the optimizer step runs on the CPU: the GPU's peak is before it.
        forward_backward_peak_bytes=(
            breakdown.total
            if config.cpu_offload
            else result.memory.peak_before_optimizer.get(TOTAL, 0)
        ),
        margin=margin,
        gpu=gpu,
        trace_seconds=result.seconds,
        trace_method=result.method,
        frozen_bytes=int(result.memory.extra.get("frozen_bytes", 0)),
        rollout=result.rollout,
    )


def plan_memory(
    config: TrainConfig,
    *,
    nodes: int,
    gpus_per_node: int,
    gpu_memory_bytes: int | None,
    gpu_name: str | None = None,
    margin: Margin | None = None,
    suggest_fixes: bool = True,
    progress: Progress = _quiet,
    full_trace: bool = False,
) -> MemoryPlan:
    """Plan the per-GPU memory of `config` on `nodes` x `gpus_per_node` GPUs.

    If it does not fit and `suggest_fixes`, single changes are planned too (each one trace) and
    returned in `MemoryPlan.fixes`, cheapest first. Raises ValueError for anything the user can
    fix (unknown model, impossible batch arithmetic, an architecture that cannot be traced).
    `full_trace` traces every decoder layer instead of extrapolating from shallow copies.
    """
    cluster, gpu = Cluster(nodes, gpus_per_node), _gpu(gpu_memory_bytes, gpu_name)
    margin = margin or Margin()
    plan = evaluate(config, cluster, gpu, margin, full_trace=full_trace)
    progress(f"planned {config.model} in {plan.trace_seconds:.1f} s ({plan.trace_method})")
    if plan.fits is False and suggest_fixes:
        plan = dataclasses.replace(plan, fixes=tuple(_fixes(plan, progress, full_trace)))
    return plan


def find_max_batch(
    config: TrainConfig,
    *,
    nodes: int,
    gpus_per_node: int,
    gpu_memory_bytes: int,
    margin: Margin | None = None,
    progress: Progress = _quiet,
    full_trace: bool = False,
) -> int | None:
    """The largest `batch_size_per_device` that fits, holding the total batch fixed (so only
    sizes that divide it per GPU are candidates); None if not even 1 fits."""
    best = max_batch_plan(
        config,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        gpu_memory_bytes=gpu_memory_bytes,
        margin=margin,
        progress=progress,
        full_trace=full_trace,
    )
    return None if best is None else best.batch.batch_size_per_device


def max_batch_plan(
    config: TrainConfig,
    *,
    nodes: int,
    gpus_per_node: int,
    gpu_memory_bytes: int,
    gpu_name: str | None = None,
    margin: Margin | None = None,
    progress: Progress = _quiet,
    full_trace: bool = False,
) -> MemoryPlan | None:
    """`find_max_batch`, returning the plan of the batch it found."""
    return _max_batch_plan(
        config,
        Cluster(nodes, gpus_per_node),
        _gpu(gpu_memory_bytes, gpu_name),
        margin or Margin(),
        progress,
        full_trace=full_trace,
    )


def _max_batch_plan(
    config: TrainConfig,
    cluster: Cluster,
    gpu: Gpu | None,
    margin: Margin,
    progress: Progress,
    below: int | None = None,
    *,
    full_trace: bool = False,
) -> MemoryPlan | None:
    """The plan of the largest fitting batch per device (only sizes under `below` if given)."""
    if gpu is None:
        raise ValueError("--find_max_batch needs the GPU's memory: give --gpu_memory (e.g. 80GiB).")
    total = resolved_total_batch(config, cluster.world_size)
    candidates = [
        b for b in batch_candidates(total, cluster.world_size) if below is None or b < below
    ]
    plans: dict[int, MemoryPlan] = {}

    def fits(batch_size: int) -> bool:
        trial = config.replace(
            batch_size_per_device=batch_size,
            total_batch_size=total,
            gradient_accumulation_steps=None,
        )
        plans[batch_size] = evaluate(trial, cluster, gpu, margin, full_trace=full_trace)
        needed = plans[batch_size].required_bytes / 1024**3
        progress(f"batch per device {batch_size}: needs {needed:.1f} GiB")
        return bool(plans[batch_size].fits)

    best = largest_fitting(candidates, fits)
    return None if best is None else plans[best]


# --- cheapest changes --------------------------------------------------------------------------


def _fixes(plan: MemoryPlan, progress: Progress, full_trace: bool) -> list[Fix]:
    """Single changes, cheapest first (for the run's speed and its results), each planned."""
    config, cluster, batch = plan.config, plan.cluster, plan.batch
    fixes: list[Fix] = []

    def attempt(flags: str, cost: str, trial: TrainConfig, where: Cluster = cluster) -> bool:
        progress(f"trying {flags} ...")
        try:
            result = evaluate(trial, where, plan.gpu, plan.margin, full_trace=full_trace)
        except ValueError as err:  # e.g. the batch does not divide over more GPUs
            progress(f"  not possible: {str(err).splitlines()[0]}")
            return False
        if trial.cpu_offload:
            host = result.state_bytes * where.gpus_per_node / 1024**3
            cost = cost.replace("host RAM", f"host RAM ({host:.0f} GiB per node)")
        fixes.append(Fix(flags, cost, result.required_bytes, bool(result.fits)))
        return bool(result.fits)

    for flags, cost, trial in method_class(config.method).memory_fixes(config):
        attempt(flags, cost, trial)  # the method's own (a distillation teacher in 4 bits, ...)
    smaller = _max_batch_plan(
        config,
        cluster,
        plan.gpu,
        plan.margin,
        progress,
        below=batch.batch_size_per_device,
        full_trace=full_trace,
    )
    if smaller is not None:
        b = smaller.batch
        fixes.append(
            Fix(
                f"--batch_size_per_device {b.batch_size_per_device}",
                f"same total batch and results, {b.gradient_accumulation_steps} accumulation "
                f"steps instead of {batch.gradient_accumulation_steps}: less work per GPU pass",
                smaller.required_bytes,
                True,
            )
        )
    if not config.gradient_checkpointing:
        attempt(
            "--gradient_checkpointing",
            "recomputes each layer's forward in backward: about 1/3 more compute",
            config.replace(gradient_checkpointing=True),
        )
    _sequence_parallel(config, cluster, attempt)
    _more_gpus(config, cluster, attempt)
    if config.optimizer == "adamw":
        attempt(
            "--optimizer sgd",
            "no AdamW moments, but a different optimizer: retune the learning rate",
            config.replace(optimizer="sgd", momentum=0.0),
        )
    if not config.cpu_offload:
        attempt(
            "--cpu_offload",
            "state in host RAM, optimizer step on the CPU: much slower",
            config.replace(cpu_offload=True),
        )
    return sorted(fixes, key=lambda f: not f.fits)  # stable: cheapest first among each kind


def _sequence_parallel(config: TrainConfig, cluster: Cluster, attempt: Callable[..., bool]) -> None:
    """The smallest --sequence_parallel above the run's that fits: each GPU holds 1/N of every
    sequence's activations. N must divide the GPUs and the attention heads (a plan that cannot
    split says why and the next N is tried). Not for GRPO, whose completions are sampled and
    scored whole on each rank."""
    if config.trains_on_prompts:
        return
    for size in divisors(cluster.world_size):
        if size <= config.sequence_parallel:
            continue
        cost = (
            f"each sequence split over {size} GPUs: two all-to-alls around every attention, "
            f"{size}x the accumulation steps of 1/{size} of a sequence each"
        )
        if attempt(f"--sequence_parallel {size}", cost, config.replace(sequence_parallel=size)):
            return


def _more_gpus(config: TrainConfig, cluster: Cluster, attempt: Callable[..., bool]) -> None:
    """Twice, then four times the nodes (a node's GPUs are what the hardware has)."""
    for factor in (2, 4):
        bigger = Cluster(cluster.nodes * factor, cluster.gpus_per_node)
        cost = f"{bigger.world_size} GPUs instead of {cluster.world_size}, same total batch"
        if attempt(f"--nodes {bigger.nodes}", cost, config, bigger):
            return
