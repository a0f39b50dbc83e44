"""`plan_memory`: will this run fit, and if not, what is the cheapest change that makes it fit;
`find_max_batch`: the largest batch per device that fits."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from fsdp_utils.config.batch import divisors, plan_batch
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.methods.registry import method_class
from fsdp_utils.plan.estimate import Cluster, estimate
from fsdp_utils.plan.hardware import Gpu
from fsdp_utils.plan.report import Fix, Margin, MemoryPlan
from fsdp_utils.plan.search import batch_candidates, largest_fitting, resolved_total_batch
from fsdp_utils.plan.speed import SpeedModel
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


def with_step_time(plan: MemoryPlan, speed: SpeedModel) -> MemoryPlan:
    """`plan` with the step-time model's prediction of its configuration, and what it rests on."""
    return dataclasses.replace(
        plan, step_time=speed.predict(plan.config, plan.cluster), speed_note=speed.describe()
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
    speed: SpeedModel | None = None,
) -> MemoryPlan:
    """Plan the per-GPU memory of `config` on `nodes` x `gpus_per_node` GPUs.

    If it does not fit and `suggest_fixes`, single changes are planned too (each one trace) and
    returned in `MemoryPlan.fixes`: those that fit first, fastest first by `speed`'s step-time
    model (without one, in `_fixes`' documented order), offload last. Raises ValueError for
    anything the user can fix (unknown model, impossible batch arithmetic, an architecture that
    cannot be traced). `full_trace` traces every decoder layer instead of extrapolating.
    """
    cluster, gpu = Cluster(nodes, gpus_per_node), _gpu(gpu_memory_bytes, gpu_name)
    margin = margin or Margin()
    plan = evaluate(config, cluster, gpu, margin, full_trace=full_trace)
    progress(f"planned {config.model} in {plan.trace_seconds:.1f} s ({plan.trace_method})")
    if speed is not None:
        plan = with_step_time(plan, speed)
    if plan.fits is False and suggest_fixes:
        fixes, skipped = _fixes(plan, progress, full_trace, speed)
        plan = dataclasses.replace(plan, fixes=tuple(fixes), skipped=tuple(skipped))
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


# --- the changes that make it fit ---------------------------------------------------------
#
# Each candidate is a single change of the command line. Before one is traced, what cannot work
# is skipped with one line: a --sequence_parallel that does not divide the heads or the
# processes, a node count the batch does not divide, a sharding whose state alone (parameters,
# gradients, optimizer state: 16 bytes per parameter with AdamW) exceeds the GPU, and changes
# that only cut activations when the state is what does not fit. Those that fit are ordered by
# the step-time model's tokens/s (without a GPU kind: the order they are tried in, below: the
# batch, sharding, checkpointing, sequence parallelism, more nodes), and --cpu_offload, an
# order of magnitude slower (1/15 of the eager speed on the H100), comes last. --optimizer sgd,
# which changes the optimizer, is tried only when no other change fits.


@dataclass
class _Attempts:
    plan: MemoryPlan
    progress: Progress
    full_trace: bool
    speed: SpeedModel | None
    fixes: list[Fix] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def state_bound(self) -> bool:
        """The state alone (and the margin on it) does not fit: no activation saving helps."""
        plan = self.plan
        assert plan.gpu is not None
        need = plan.state_bytes + plan.margin.bytes_for(plan.state_bytes)
        return need > plan.gpu.memory_bytes

    def skip(self, flags: str, why: str) -> None:
        self.skipped.append(f"{flags}: {why}")
        self.progress(f"skipping {flags}: {why}")

    def attempt(
        self, flags: str, cost: str, trial: TrainConfig, where: Cluster | None = None
    ) -> bool:
        where = where or self.plan.cluster
        self.progress(f"trying {flags} ...")
        try:
            result = evaluate(
                trial, where, self.plan.gpu, self.plan.margin, full_trace=self.full_trace
            )
        except ValueError as err:  # e.g. an architecture that cannot split as asked
            self.skip(flags, str(err).splitlines()[0])
            return False
        if trial.cpu_offload:
            host = result.state_bytes * where.gpus_per_node / 1024**3
            cost = cost.replace("host RAM", f"host RAM ({host:.0f} GiB per node)")
        self.fixes.append(
            Fix(flags, cost, result.required_bytes, bool(result.fits), self._speed(trial, where))
        )
        return bool(result.fits)

    def _speed(self, trial: TrainConfig, where: Cluster) -> float | None:
        if self.speed is None:
            return None
        try:
            return self.speed.predict(trial, where).tokens_per_s_per_gpu
        except ValueError:
            return None


def _fixes(
    plan: MemoryPlan, progress: Progress, full_trace: bool, speed: SpeedModel | None = None
) -> tuple[list[Fix], list[str]]:
    """Single changes that make `plan` fit (each planned), and the candidates skipped."""
    config, cluster, batch = plan.config, plan.cluster, plan.batch
    tries = _Attempts(plan, progress, full_trace, speed)
    for flags, cost, trial in method_class(config.method).memory_fixes(config):
        tries.attempt(
            flags, cost, trial
        )  # the method's own (a distillation teacher in 4 bits, ...)
    activations_only = "the state alone (parameters, gradients, optimizer state) does not fit"
    smaller = None
    if tries.state_bound:
        tries.skip("a smaller --batch_size_per_device", activations_only)
    else:
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
        trial = smaller.config
        tries.fixes.append(
            Fix(
                f"--batch_size_per_device {b.batch_size_per_device}",
                f"same total batch and results, {b.gradient_accumulation_steps} accumulation "
                f"steps instead of {batch.gradient_accumulation_steps}: less work per GPU pass",
                smaller.required_bytes,
                True,
                tries._speed(trial, cluster),
            )
        )
    _sharding(tries)
    if not (config.gradient_checkpointing or config.checkpoint_layers):
        if tries.state_bound:
            tries.skip("--gradient_checkpointing", activations_only)
        else:
            tries.attempt(
                "--gradient_checkpointing",
                "recomputes each layer's forward in backward: about 1/3 more compute",
                config.replace(gradient_checkpointing=True),
            )
    _sequence_parallel(config, cluster, tries)
    _more_gpus(config, cluster, tries)
    if not config.cpu_offload:
        tries.attempt(
            "--cpu_offload",
            "state in host RAM, optimizer step on the CPU: much slower",
            config.replace(cpu_offload=True),
        )
    if config.optimizer == "adamw":
        if any(fix.fits for fix in tries.fixes):
            tries.skip(
                "--optimizer sgd",
                "it changes the optimizer (retune the learning rate), and other changes fit",
            )
        else:
            tries.attempt(
                "--optimizer sgd",
                "no AdamW moments, but a different optimizer: retune the learning rate",
                config.replace(optimizer="sgd", momentum=0.0),
            )
    return _ordered(tries.fixes), tries.skipped


def _ordered(fixes: list[Fix]) -> list[Fix]:
    """Those that fit first, then those that do not; within each, fastest first when the step
    time is known (else as tried); --cpu_offload last among those that fit."""

    def key(fix: Fix) -> tuple[bool, bool, float]:
        offload = fix.flags == "--cpu_offload"
        speed = -(fix.tokens_per_s or 0.0)
        return (not fix.fits, offload and fix.fits, speed)

    return sorted(fixes, key=key)  # stable: without speeds, the order tried


def _sharded_state(plan: MemoryPlan, sharding: str) -> int:
    """The state per GPU under another sharding (what the parameters, gradients and optimizer
    state take when split over its shard group), and for shard_grad_op the parameters it keeps
    gathered between forward and backward."""
    degree = plan.cluster.shard_degree(sharding)
    state = plan.state_bytes * plan.shard_degree // degree
    if sharding == "shard_grad_op":
        element = 4 if plan.config.precision == "fp32" else 2
        state += plan.model.parameters * element
    return state


def _sharding(tries: _Attempts) -> None:
    """Sharding over more GPUs: full (over every GPU) first, then shard_grad_op and no_shard
    where they fit (each skipped when its state alone cannot)."""
    plan = tries.plan
    config, cluster = plan.config, plan.cluster
    order = ["full", "shard_grad_op", "hybrid", "no_shard"]
    for sharding in order:
        if sharding == config.sharding:
            continue
        flags = f"--sharding {sharding}"
        if sharding == "hybrid" and cluster.nodes == 1:
            continue  # one node: hybrid is full sharding
        state = _sharded_state(plan, sharding)
        assert plan.gpu is not None
        if state + plan.margin.bytes_for(state) > plan.gpu.memory_bytes:
            tries.skip(flags, f"its state alone needs {state / 1024**3:,.1f} GiB per GPU")
            continue
        if state >= plan.state_bytes:
            continue  # holds as much as today or more: no help
        cost = {
            "full": f"parameters, gradients and optimizer state split over all "
            f"{cluster.world_size} GPUs (all-gathers between nodes)",
            "shard_grad_op": "parameters kept gathered between forward and backward: one "
            "all-gather fewer per layer",
            "hybrid": f"state split within each node of {cluster.gpus_per_node}, replicated "
            "across nodes (fewer transfers between nodes)",
            "no_shard": "every GPU holds everything: no all-gathers",
        }[sharding]
        tries.attempt(flags, cost, config.replace(sharding=sharding))


def _sequence_parallel(config: TrainConfig, cluster: Cluster, tries: _Attempts) -> None:
    """The smallest --sequence_parallel above the run's that fits: each GPU holds 1/N of every
    sequence's activations. N must divide the GPUs and the attention heads: the others are
    skipped before any trace, in one line. Not for GRPO, whose completions are sampled and
    scored whole on each rank, nor when the state alone does not fit."""
    if config.trains_on_prompts:
        return
    sizes = [n for n in divisors(cluster.world_size) if n > config.sequence_parallel]
    if not sizes:
        return
    if tries.state_bound:
        tries.skip("--sequence_parallel", "it splits activations, and the state alone does not fit")
        return
    heads = _attention_heads(config)
    if heads is not None:
        invalid = [n for n in sizes if heads % n]
        if invalid:
            shown = ", ".join(map(str, invalid))
            tries.skip(f"--sequence_parallel {shown}", f"they do not divide the {heads} heads")
        sizes = [n for n in sizes if n not in invalid]
    for size in sizes:
        cost = (
            f"each sequence split over {size} GPUs: two all-to-alls around every attention, "
            f"{size}x the accumulation steps of 1/{size} of a sequence each"
        )
        if tries.attempt(
            f"--sequence_parallel {size}", cost, config.replace(sequence_parallel=size)
        ):
            return


def _attention_heads(config: TrainConfig) -> int | None:
    from fsdp_utils.hub.resolve import load_model_config
    from fsdp_utils.plan.estimate import model_config_dir

    try:
        hf_config = load_model_config(model_config_dir(config))
    except (OSError, ValueError):
        return None
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    return int(heads) if heads else None


def _more_gpus(config: TrainConfig, cluster: Cluster, tries: _Attempts) -> None:
    """Twice, then four times the nodes (a node's GPUs are what the hardware has). Skipped with
    hybrid sharding (its state is split within a node: more nodes do not reduce it) and for
    node counts the total batch does not divide."""
    if config.sharding == "hybrid" and tries.state_bound:
        tries.skip("more --nodes", "hybrid sharding splits the state within a node only")
        return
    for factor in (2, 4):
        bigger = Cluster(cluster.nodes * factor, cluster.gpus_per_node)
        flags = f"--nodes {bigger.nodes}"
        try:
            plan_batch(config, bigger.world_size)
        except ValueError:
            tries.skip(flags, f"the total batch does not divide over {bigger.world_size} GPUs")
            continue
        cost = f"{bigger.world_size} GPUs instead of {cluster.world_size}, same total batch"
        if tries.attempt(flags, cost, config, bigger):
            return
