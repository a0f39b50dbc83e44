"""The memory plan: per-GPU figures, the margin, the verdict, and how they are printed."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from fsdp_utils.config.batch import BatchPlan
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.sequence_slices import padded_length
from fsdp_utils.model.transforms import ModelInfo
from fsdp_utils.parallel.parallelize import describe_checkpointing
from fsdp_utils.plan.estimate import Cluster
from fsdp_utils.plan.hardware import GIB, Gpu
from fsdp_utils.plan.rollout import RolloutPlan, largest_prompts
from fsdp_utils.plan.step_time import StepTime
from fsdp_utils.plan.tracking import Breakdown


@dataclass(frozen=True)
class Margin:
    """What a GPU needs beyond the tensor bytes the tracker counts (its peak is what
    `torch.cuda.max_memory_allocated` reports on a real run).

    runtime_bytes: memory outside PyTorch's allocator: the CUDA context with the cuBLAS/cuDNN
        kernels and workspaces, and NCCL's communication buffers. Measured on one H100
        (2026-11-27, docs/gpu-check.md): 1.30-1.32 GiB of nvidia-smi's memory.used beyond
        torch's reserved peak on eight configurations; 2 GiB leaves the rest for NCCL's
        buffers with peers, which one GPU could not measure.
    allocator_fraction: PyTorch's caching allocator reserves more than the tensors it holds:
        blocks are rounded up, split blocks fragment, and memory freed on one CUDA stream is
        reused by another (FSDP2's all-gather and reduce-scatter streams) only later. On that
        H100 the reserved peak was 3% (32k tokens) to 22% above the allocated one; 10% is the
        share that put the planner's peak x (1 + share) nearest every measured reserved peak
        (within 7.6% on all eight). Where the card is nearly full the allocator frees cached
        blocks before it fails, so the largest share measured on a roomy card overstates need.

    These defaults are the one place the margin is set (the command line's defaults are read
    from here): calibrate here, with `bench/gpu_check.py`'s fitted share.
    """

    runtime_bytes: int = 2 * GIB
    allocator_fraction: float = 0.10

    def __post_init__(self) -> None:
        if self.runtime_bytes < 0 or not 0.0 <= self.allocator_fraction < 1.0:
            raise ValueError(
                "The margin must be non-negative, with an allocator fraction below 1 "
                f"(got {self.runtime_bytes} bytes and {self.allocator_fraction})."
            )

    def bytes_for(self, peak_bytes: int) -> int:
        return self.runtime_bytes + round(peak_bytes * self.allocator_fraction)

    def describe(self) -> str:
        return (
            f"{self.runtime_bytes / GIB:.2f} GiB CUDA context + NCCL, "
            f"+{self.allocator_fraction:.0%} for the allocator"
        )


@dataclass(frozen=True)
class Fix:
    """One change to the command line, and what the run then needs per GPU (and, with the
    step-time model, its predicted tokens/s per GPU)."""

    flags: str
    cost: str
    required_bytes: int
    fits: bool
    tokens_per_s: float | None = None


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU memory of one training configuration (bytes), and whether it fits."""

    config: TrainConfig
    cluster: Cluster
    batch: BatchPlan
    model: ModelInfo
    breakdown: Breakdown  # at the predicted peak; its parts sum to peak_bytes
    state_bytes: int  # parameters + gradients + optimizer state when the optimizer step starts
    forward_backward_peak_bytes: int  # the highest point before the optimizer step
    margin: Margin
    gpu: Gpu | None
    trace_seconds: float
    trace_method: str = ""  # extrapolated from which depths, or every layer traced and why
    fixes: tuple[Fix, ...] = ()
    # Of the parameters: those of frozen models held beside the trained one (a distillation
    # teacher, DPO's --reference live copy), no gradients and no optimizer state
    frozen_bytes: int = 0
    # A method that samples its own completions (GRPO): its rollout phase, beside the update
    # (the breakdown above); the run's peak is the higher of the two.
    rollout: RolloutPlan | None = None
    # The step-time model's prediction (fsdp_utils/plan/step_time.py), and on what it rests
    step_time: StepTime | None = None
    speed_note: str = ""
    # Candidates the fixes skipped without tracing them, one line each
    skipped: tuple[str, ...] = ()

    @property
    def parameter_bytes(self) -> int:
        return self.breakdown.parameters

    @property
    def gradient_bytes(self) -> int:
        return self.breakdown.gradients

    @property
    def optimizer_bytes(self) -> int:
        return self.breakdown.optimizer_state

    @property
    def activation_bytes(self) -> int:
        return self.breakdown.activations

    @property
    def temporary_bytes(self) -> int:
        return self.breakdown.temporaries

    def parts_gib(self) -> list[str]:
        """Parameters, gradients, optimizer state, activations, temporaries and the peak they
        sum to, in GiB with one decimal: the columns of the plan tables in docs/plan.md and
        docs/lora.md."""
        parts = (
            self.parameter_bytes,
            self.gradient_bytes,
            self.optimizer_bytes,
            self.activation_bytes,
            self.temporary_bytes,
            self.peak_bytes,
        )
        return [f"{x / GIB:.1f}" for x in parts]

    @property
    def update_peak_bytes(self) -> int:
        """The traced training step's peak (the update, for a method with a rollout phase)."""
        return self.breakdown.total

    @property
    def peak_bytes(self) -> int:
        rollout = self.rollout.total if self.rollout is not None else 0
        return max(self.update_peak_bytes, rollout)

    @property
    def dominating_phase(self) -> str | None:
        """GRPO: "rollout" or "update", whichever needs more; None without a rollout phase."""
        if self.rollout is None:
            return None
        return "rollout" if self.rollout.total > self.update_peak_bytes else "update"

    @property
    def peak_in_optimizer_step(self) -> bool:
        """With activation checkpointing the optimizer step's scratch often sets the peak."""
        return self.update_peak_bytes > self.forward_backward_peak_bytes

    def largest_prompts_per_device(self) -> int | None:
        """GRPO: the most prompts per micro-batch (x G completions) that divide the total batch
        per GPU and whose rollout and update both fit the GPU, from the bytes of each phase
        that grow with the batch (see `plan.rollout.largest_prompts`); None without a GPU size
        or a rollout phase."""
        if self.rollout is None or self.gpu is None:
            return None
        per_rank = self.batch.total_batch_size // self.batch.world_size
        return largest_prompts(
            prompts=self.batch.batch_size_per_device,
            candidates=[b for b in range(1, per_rank + 1) if per_rank % b == 0],
            update_state=self.state_bytes,
            update_peak=self.update_peak_bytes,
            rollout=self.rollout,
            memory_bytes=self.gpu.memory_bytes,
            required=lambda peak: peak + self.margin.bytes_for(peak),
        )

    @property
    def margin_bytes(self) -> int:
        return self.margin.bytes_for(self.peak_bytes)

    @property
    def required_bytes(self) -> int:
        return self.peak_bytes + self.margin_bytes

    @property
    def fits(self) -> bool | None:
        """None when no GPU size is known."""
        return None if self.gpu is None else self.required_bytes <= self.gpu.memory_bytes

    @property
    def shard_degree(self) -> int:
        """Over how many GPUs parameters, gradients and optimizer state are split."""
        return self.cluster.shard_degree(self.config.sharding)

    @property
    def state_bytes_per_parameter(self) -> float:
        """The textbook figure: 16 for fp32 master weights + AdamW, 8 for SGD, ..."""
        return self.state_bytes * self.shard_degree / self.model.parameters

    @property
    def verdict(self) -> str:
        if self.gpu is None:
            return "no verdict: give --gpu_memory (e.g. 80GiB or a100-80gb)"
        have, need = self.gpu.memory_bytes, self.required_bytes
        if need <= have:
            return (
                f"FITS: needs {need / GIB:.1f} of {have / GIB:.1f} GiB "
                f"({need / have:.0%}), {(have - need) / GIB:.1f} GiB to spare"
            )
        return (
            f"DOES NOT FIT: needs {need / GIB:.1f} GiB, the GPU has {have / GIB:.1f} GiB "
            f"({(need - have) / GIB:.1f} GiB short)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.config.model,
            "parameters": self.model.parameters,
            "nodes": self.cluster.nodes,
            "gpus_per_node": self.cluster.gpus_per_node,
            "batch_size_per_device": self.batch.batch_size_per_device,
            "gradient_accumulation_steps": self.batch.gradient_accumulation_steps,
            "total_batch_size": self.batch.total_batch_size,
            "max_seq_length": self.batch.seq_length,
            "parameter_bytes": self.parameter_bytes,
            "gradient_bytes": self.gradient_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activation_bytes": self.activation_bytes,
            "temporary_bytes": self.temporary_bytes,
            "peak_bytes": self.peak_bytes,
            "forward_backward_peak_bytes": self.forward_backward_peak_bytes,
            "peak_in_optimizer_step": self.peak_in_optimizer_step,
            "state_bytes": self.state_bytes,
            "state_bytes_per_parameter": self.state_bytes_per_parameter,
            "margin_bytes": self.margin_bytes,
            "required_bytes": self.required_bytes,
            "gpu": dataclasses.asdict(self.gpu) if self.gpu else None,
            "fits": self.fits,
            "verdict": self.verdict,
            "fixes": [dataclasses.asdict(fix) for fix in self.fixes],
            "trace_seconds": self.trace_seconds,
            "trace_method": self.trace_method,
            "frozen_bytes": self.frozen_bytes,
            "skipped_fixes": list(self.skipped),
            **self._speed_dict(),
            **self._rollout_dict(),
            "config": self.config.to_dict(),
        }

    def _speed_dict(self) -> dict[str, Any]:
        if self.step_time is None:
            return {}
        return {"step_time": self.step_time.to_dict(), "speed_basis": self.speed_note}

    def _rollout_dict(self) -> dict[str, Any]:
        if self.rollout is None:
            return {}
        return {
            "rollout": dataclasses.asdict(self.rollout) | {"total": self.rollout.total},
            "update_peak_bytes": self.update_peak_bytes,
            "dominating_phase": self.dominating_phase,
            "largest_prompts_per_device": self.largest_prompts_per_device(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _count(parameters: int) -> str:
    """6.74B, 0.13M: a tiny model's count is not 0.00B."""
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:.2f}M"


def _gib(size: int) -> str:
    return f"{size / GIB:8.2f} GiB"


def describe_setup(config: TrainConfig, cluster: Cluster) -> str:
    if config.no_layer_wrap_policy:
        wrap = f"FSDP2 ({config.sharding}) at the root only"
    elif config.single_device_path == "direct" and cluster.world_size == 1:
        wrap = "one GPU, direct (no FSDP2)"
    else:
        wrap = f"FSDP2 ({config.sharding}) per decoder layer"
    optimizer = f"{config.optimizer} (fused)" if config.fused_optimizer else config.optimizer
    extras: list[str] = [config.precision, optimizer]
    if config.float8 != "none":
        extras.append(f"float8 {config.float8}")
    if config.reshard_last_layer:
        extras.append("the last layer resharded after forward")
    if config.sequence_parallel > 1:
        extras.append(f"sequence parallel {config.sequence_parallel} (Ulysses)")
    if config.lora:
        base = "4-bit NF4 base" if config.quantize == "nf4" else "frozen base"
        extras.append(
            f"{'QLoRA' if config.quantize == 'nf4' else 'LoRA'} r={config.lora_r} ({base})"
        )
    if (checkpointing := describe_checkpointing(config)) is not None:
        extras.append(checkpointing)
    if config.cpu_offload:
        extras.append("CPU offload")
    if config.defer_grad_sync:
        extras.append("grad sync on the last micro-batch")
    return f"{cluster.describe()}; {wrap}; {', '.join(extras)}"


def _ranks(batch: BatchPlan) -> str:
    if batch.sequence_parallel == 1:
        return f"{batch.world_size} devices"
    return f"{batch.world_size} data-parallel groups of {batch.sequence_parallel} devices"


def _slices(batch: BatchPlan) -> str:
    if batch.sequence_parallel == 1:
        return ""
    n = batch.sequence_parallel
    return f", each split into {n} slices of {padded_length(batch.seq_length, n) // n} tokens"


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a text table, the verdict, and the fixes if it does not fit."""
    m, b = plan.model, plan.batch
    where = "the optimizer step" if plan.peak_in_optimizer_step else "forward/backward"
    dtype = "bf16" if plan.config.precision == "bf16-true" else "fp32"
    if plan.config.lora:
        from fsdp_utils.model.build import compute_dtype
        from fsdp_utils.model.lora import dtype_name

        frozen = dtype_name(compute_dtype(plan.config.precision))
        base = f"{frozen} frozen base"
        if plan.config.quantize == "nf4":  # embeddings, norms and the output layer stay 16-bit
            base = f"NF4 frozen base ({frozen} embeddings and output layer)"
        dtype = f"{base} + {dtype} adapters"
    shards = plan.shard_degree
    share = f"1/{shards} of " if shards > 1 else ""
    held = "in host RAM (CPU offload)" if plan.config.cpu_offload else f"{dtype}, {share}the model"
    if plan.frozen_bytes:
        held += f" + {plan.frozen_bytes / GIB:.2f} GiB of a frozen model (teacher, reference)"
    lines = [
        f"Memory plan: {plan.config.model} ({m.model_type}, {_count(m.parameters)} parameters, "
        f"{m.decoder_layers} x {m.decoder_layer_class})",
        f"  {describe_setup(plan.config, plan.cluster)}",
        f"  batch: {b.batch_size_per_device} per device x {_ranks(b)} x "
        f"{b.gradient_accumulation_steps} accumulation = {b.total_batch_size} {b.example_name} of "
        f"{b.seq_length} tokens" + _slices(b),
        "",
        f"per GPU, at the predicted peak (in {where}):",
        f"  parameters       {_gib(plan.parameter_bytes)}   {held}",
        f"  gradients        {_gib(plan.gradient_bytes)}",
        f"  optimizer state  {_gib(plan.optimizer_bytes)}",
        f"  activations      {_gib(plan.activation_bytes)}   saved for backward, and the inputs",
        f"  temporaries      {_gib(plan.temporary_bytes)}   gathered layers, communication "
        "buffers, scratch",
        f"  predicted peak   {_gib(plan.peak_bytes)}   tensors (torch.cuda.max_memory_allocated)",
        *(
            [f"    (forward/backward peak {plan.forward_backward_peak_bytes / GIB:.2f} GiB)"]
            if plan.peak_in_optimizer_step
            else []
        ),
        f"  margin           {_gib(plan.margin_bytes)}   {plan.margin.describe()}",
        f"  needed           {_gib(plan.required_bytes)}",
    ]
    if plan.rollout is not None:  # the update's peak, then the rollout's, then the run's
        at = next(i for i, line in enumerate(lines) if line.startswith("  predicted peak"))
        lines[at : at + 1] = _rollout_lines(plan)
    if plan.gpu is not None:
        lines.append(f"  GPU memory       {_gib(plan.gpu.memory_bytes)}   {plan.gpu.name}".rstrip())
    if plan.config.cpu_offload:
        lines.append(
            f"  host RAM         {_gib(plan.state_bytes)}   per GPU process for the offloaded "
            "parameters, gradients and optimizer state"
        )
    lines += [
        "",
        f"verdict: {plan.verdict}",
        f"(state between steps: {plan.state_bytes / GIB:.2f} GiB = "
        f"{plan.state_bytes_per_parameter:.1f} bytes/parameter over {shards} GPU(s); "
        f"planned in {plan.trace_seconds:.1f} s, {plan.trace_method or 'traced'})",
    ]
    if plan.step_time is not None:
        lines += ["", f"step time, predicted per GPU ({plan.speed_note}):"]
        lines += plan.step_time.lines()
    if plan.fixes:
        lines += ["", *format_fixes(plan.fixes)]
    elif plan.fits is False:
        lines += ["", "No single change was tried (--no_fixes)."]
    if plan.skipped:
        lines += ["Not tried (they cannot help or cannot run):", *(f"  {s}" for s in plan.skipped)]
    return "\n".join(lines)


def _rollout_lines(plan: MemoryPlan) -> list[str]:
    """GRPO: the update's peak (the lines above), the rollout phase's parts, which dominates,
    and the largest batch that fits both."""
    r = plan.rollout
    assert r is not None
    g = plan.batch.sequences_per_example
    prompts = plan.batch.batch_size_per_device
    lines = [
        f"  update peak      {_gib(plan.update_peak_bytes)}   the step above: "
        f"{prompts} prompt(s) x {g} completions per micro-batch",
        f"  rollout phase    {_gib(r.total)}   sampling {r.rows} completions at once:",
        f"    state          {_gib(r.resident)}   sharded parameters and optimizer state (no "
        "gradients between steps)",
        f"    gathered       {_gib(r.gathered)}   every parameter, kept gathered for the phase",
        f"    KV cache       {_gib(r.kv_cache)}   {r.rows} rows x {plan.batch.seq_length} "
        "positions x every layer",
        f"    prefill        {_gib(r.prefill)}   one layer's intermediates over the prompts",
        f"    logits         {_gib(r.logits)}   the last position's, and the sampler's float64",
        f"  predicted peak   {_gib(plan.peak_bytes)}   the {plan.dominating_phase} phase dominates",
    ]
    largest = plan.largest_prompts_per_device()
    if largest is not None:
        lines.append(
            f"  largest batch    {largest} prompt(s) x {g} = {largest * g} completions per "
            "device fit both phases"
            + (" (none fits)" if largest == 0 else "")
            + " (from each phase's bytes per prompt; --find_max_batch traces it)"
        )
    return lines


def format_fixes(fixes: tuple[Fix, ...]) -> list[str]:
    fitting = [f for f in fixes if f.fits]
    others = [f for f in fixes if not f.fits]
    width = max(len(f.flags) for f in fixes)
    timed = any(f.tokens_per_s is not None for f in fixes)

    def line(f: Fix) -> str:
        speed = ""
        if timed:
            speed = f"  {f.tokens_per_s:>9,.0f} tok/s/GPU" if f.tokens_per_s else " " * 20
        return f"  {f.flags:<{width}}  needs {f.required_bytes / GIB:6.1f} GiB{speed}  ({f.cost})"

    lines: list[str] = []
    if fitting:
        order = "fastest first (predicted), offload last" if timed else "cheapest first"
        lines.append(f"Changes that make it fit, {order}:")
        lines += [line(f) for f in fitting]
    else:
        lines.append("No single change makes it fit; combine several of these:")
    if others:
        if fitting:
            lines.append("Not enough on their own:")
        lines += [line(f) for f in others]
    return lines
