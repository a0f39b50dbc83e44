"""Trace one training step of the exact configuration on fake tensors and measure its memory.

Nothing is allocated: the model is built on `meta` and materialised under `FakeTensorMode`,
whose tensors have shapes, dtypes and storages but no data, in a process group of the planned
world size whose collectives do nothing (`fake` backend). The step that runs is the trainer's
own `TrainStep` (same parallelize, mixed-precision policy, optimizer, loss scaling,
micro-batch loop and gradient sync), fed with the trainer's own batch code, and measured by
`tracking.track_train_step`, as the real run is in `measure.py`.

Why on the CPU: FSDP2 asks the CUDA runtime for streams and the current device as soon as its
mesh is on "cuda", which a login node (and this CPU-only build) does not have. Nothing in the
byte counts depends on the device: a tensor's storage is numel x element size wherever it lives,
and FSDP2's buffers (all-gather outputs, reduce-scatter inputs, when they are freed) are chosen by
the same Python code on either. What does differ is outside the tensors (allocator rounding and
fragmentation, CUDA context, NCCL buffers) and is covered by `report.Margin`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedFakeTensorException,
)

from fsdp_utils.config.batch import BatchPlan, plan_batch
from fsdp_utils.config.seq_length import fit_seq_length
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import StepSampler, TokenBlocks
from fsdp_utils.data.preference import PreferencePairs
from fsdp_utils.data.sequence_slices import slice_batch
from fsdp_utils.hub.resolve import config_folder, load_model_config
from fsdp_utils.methods.base import Method, MethodContext, StepParts
from fsdp_utils.methods.registry import build_method, method_class
from fsdp_utils.model.attention import planned_implementation
from fsdp_utils.model.build import materialize
from fsdp_utils.model.qlora import is_nf4, local_bytes, unsharded_bytes
from fsdp_utils.model.sdpa import sdpa_backend
from fsdp_utils.model.transforms import ModelInfo
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.parallel.parallelize import autocast_context, build_parallel_model
from fsdp_utils.parallel.sequence import (
    SequenceParallel,
    check_splittable,
    init_sequence_parallel,
)
from fsdp_utils.plan.extrapolate import (
    extrapolate_memory,
    layer_counts,
    layer_period,
    truncated_config,
    why_layers_differ,
)
from fsdp_utils.plan.rollout import RolloutPlan, gathered_parameter_bytes, plan_rollout
from fsdp_utils.plan.tracking import PARAMETERS, StepMemory, track_train_step, with_resident
from fsdp_utils.train.step import Batch, TrainStep


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(
                f"--nodes and --gpus_per_node must be at least 1, got {self.nodes} and "
                f"{self.gpus_per_node}."
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def shard_degree(self, sharding: str) -> int:
        """Over how many GPUs `sharding` splits parameters, gradients and optimizer state:
        every GPU (full, shard_grad_op), a node's (hybrid), one (no_shard)."""
        if sharding == "no_shard":
            return 1
        if sharding == "hybrid":
            return self.gpus_per_node
        return self.world_size

    def describe(self) -> str:
        gpus = "GPU" if self.world_size == 1 else "GPUs"
        nodes = "node" if self.nodes == 1 else "nodes"
        return f"{self.world_size} {gpus} ({self.nodes} {nodes} x {self.gpus_per_node})"


@dataclass(frozen=True)
class Estimate:
    memory: StepMemory
    model: ModelInfo
    batch: BatchPlan
    seconds: float
    method: str  # how it was traced: extrapolated from which depths, or every layer and why
    rollout: RolloutPlan | None = None  # a method that samples its completions (GRPO)


def traced_micro_batches(batch: BatchPlan, defer_grad_sync: bool) -> int:
    """How many micro-batches of the step to trace: the others repeat one of these exactly.

    The first has no gradients alive yet; from the second on, every micro-batch meets the
    previous one's gradients (sharded, or unsharded with --defer_grad_sync), and they are all
    alike; with --defer_grad_sync the last one differs again (it reduce-scatters).
    """
    return min(batch.gradient_accumulation_steps, 3 if defer_grad_sync else 2)


class _UnitScalarsFakeMode(FakeTensorMode):
    """`FakeTensorMode` in which reading a tensor's value (`.item()`, `.tolist()`, `float()`)
    gives 1.

    The step reads a few scalars that fake tensors do not have (token counts, the loss, the
    gradient norm, AdamW's step count for its bias correction); no allocation depends on them.
    1 is a value all of them can take in a healthy step (0 would divide by zero in AdamW).
    A subclass rather than a second dispatch mode on top: every operator of the trace passes
    through each mode on the stack in Python, and one mode less saves a tenth of a plan's time.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return True if dtype == torch.bool else 1.0 if dtype.is_floating_point else 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def _never_fake(x: Any) -> bool:
    return False


@contextlib.contextmanager
def _transformers_eager_paths() -> Iterator[None]:
    """Let transformers treat fake tensors as the eager tensors they stand for.

    transformers takes a fake tensor for a sign of compilation (`is_tracing`) and then builds
    an explicit causal mask that an eager run skips (it passes `is_causal` to SDPA instead): a
    (batch, 1, seq, seq) mask that every layer saves for backward. The run being planned is
    eager, so its checks take the eager path; the values they read come from
    `_UnitScalarsFakeMode` (True: no padding and no packed-sequence boundaries, as in the
    trainer's full blocks).
    """
    from transformers.utils import import_utils

    original = import_utils.is_fake_tensor
    import_utils.is_fake_tensor = _never_fake
    try:
        yield
    finally:
        import_utils.is_fake_tensor = original


def placeholder_micro_batches(
    plan: BatchPlan, count: int, seed: int, sequence_parallel: SequenceParallel | None = None
) -> list[Batch]:
    """Rank 0's `count` micro-batches of full-length sequences, through the trainer's own batch
    code (TokenBlocks, StepSampler, and with `sequence_parallel` its slice of them): packed
    data, every block full, every position a target."""
    step_plan = dataclasses.replace(
        plan,
        gradient_accumulation_steps=count,
        total_batch_size=plan.batch_size_per_device * plan.world_size * count,
    )
    blocks = step_plan.total_batch_size
    sequences = blocks * plan.sequences_per_example
    tokens = TokenBlocks(
        np.zeros((sequences, plan.seq_length), np.int32),
        np.full(sequences, plan.seq_length, np.int32),
    )
    # DPO: each example is a pair, both of its sequences in the micro-batch; GRPO: a prompt
    # and its G completions, each a full-length sequence
    source: Any = tokens
    if plan.prompts:
        source = _Completions(tokens, plan.sequences_per_example)
    elif plan.sequences_per_example != 1:
        source = PreferencePairs(tokens, np.arange(blocks))
    sampler = StepSampler(blocks, step_plan, seed)
    sp = sequence_parallel or SequenceParallel()
    return [
        slice_batch(source.batch(indices), rank=sp.rank, size=sp.size)
        for indices in sampler.micro_batches(0, rank=0)
    ]


@dataclass(frozen=True)
class _Completions:
    """GRPO's placeholder examples: example i is sequences i * G ... i * G + G - 1."""

    tokens: TokenBlocks
    per_example: int

    def batch(self, indices: np.ndarray) -> Batch:
        order = np.asarray(indices)[:, None] * self.per_example + np.arange(self.per_example)
        return self.tokens.batch(order.ravel())


def _local_bytes(model: Any) -> int:
    """This device's bytes of a model's (sharded) parameters, 4-bit weights as stored."""
    total = local_bytes(model)[0]
    for param in model.parameters():
        if is_nf4(param):
            continue
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total


def _no_frozen_copy() -> Any:
    raise AssertionError("the method asked for a frozen copy it did not declare")


def traced_step(
    model: Any,
    config: TrainConfig,
    env: DistEnv,
    batch: BatchPlan,
    reference_model: Any = None,
    sequence_parallel: SequenceParallel | None = None,
) -> tuple[TrainStep, Method]:
    """The trainer's step on a (fake) model: the run's method (`Method.planned_step`) with the
    same optimizer, schedule, loss scaling, router loss, micro-batch loop and gradient sync; and
    the method (its `frozen_models` are planned too). No gradient scaler for fp16-mixed: it
    holds two scalars and unscales in place (no memory to plan), and its inf check would read a
    fake value and could skip the step. `reference_model`: the frozen copy a method keeps
    (`Method.needs_frozen_copy`: DPO's --reference live), built and materialised by the caller.
    `sequence_parallel`: rank 0's place in the data x sequence mesh (--sequence_parallel)."""
    context = MethodContext(
        env, batch, model.config, Path(), log=lambda line: None,
        sequence_parallel=sequence_parallel,
    )  # fmt: skip
    method = build_method(config, context)
    copy = (lambda: reference_model) if reference_model is not None else _no_frozen_copy
    parts = StepParts(autocast_context(config, env.device), copy, grad_scaler=False)
    return method.planned_step(model, parts), method


@contextlib.contextmanager
def fake_world(cluster: Cluster) -> Iterator[DistEnv]:
    """A default process group of `cluster.world_size` ranks, this process being rank 0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    if dist.is_initialized():
        raise ValueError(
            "The memory planner needs a process without a process group: run it before "
            "torchrun / init_process_group (e.g. `python -m fsdp_utils.plan ...`)."
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cluster.world_size)
    try:
        yield DistEnv(
            rank=0,
            local_rank=0,
            world_size=cluster.world_size,
            local_world_size=cluster.gpus_per_node,
            device=torch.device("cpu"),
            backend="fake",
        )
    finally:
        dist.destroy_process_group()


def model_config_dir(config: TrainConfig) -> Path:
    """The folder with the model's config.json: all the planner reads (`config_folder`)."""
    return config_folder(config.model, config.revision, config.cache_dir)


def check_plannable(config: TrainConfig) -> None:
    if config.no_fsdp:
        raise ValueError(
            "The planner traces FSDP2 runs; --no_fsdp (DDP) keeps the full parameters, "
            "gradients and optimizer state on every GPU (16 bytes per parameter with AdamW and "
            "fp32 master weights, before activations). Plan the FSDP run instead: drop "
            "--no_fsdp, or use --sharding no_shard for FSDP's replicated mode."
        )


def _untraceable(err: Exception, hf_config: Any) -> ValueError:
    real_steps = "a run with a few real steps and read the peak memory in metrics.jsonl"
    experts = getattr(hf_config, "_experts_implementation", None)
    if experts not in (None, "grouped_mm"):
        # transformers' grouped_mm sorts the tokens by expert into buffers of fixed size; the
        # eager loop gathers each expert's tokens (`nonzero`), sized by the router's choices.
        return ValueError(
            f"This model cannot be traced on fake tensors ({type(err).__name__}: {err}): its "
            f"mixture-of-experts layers run the experts implementation {experts!r}, whose "
            "buffers are sized by the router's choices, which the planner cannot know without "
            "the weights. transformers' default, grouped_mm, has fixed sizes and plans: remove "
            f"experts_implementation from the model's config.json, or plan {real_steps}."
        )
    return ValueError(
        f"This model cannot be traced on fake tensors ({type(err).__name__}: {err}). Its "
        "forward pass reads tensor values (data-dependent control flow), which the planner "
        f"cannot follow without the weights. Plan {real_steps} instead."
    )


def estimate(config: TrainConfig, cluster: Cluster, *, full_trace: bool = False) -> Estimate:
    """Measure the per-GPU memory of one step of `config` on `cluster` (rank 0).

    The model is built as the trainer builds it (`build_parallel_model`, on meta: no memory).
    If its decoder layers are alike, shallow copies of it are traced and the result is
    extrapolated to its depth (extrapolate.py); otherwise, or with `full_trace`, every layer
    is traced.
    """
    started = time.perf_counter()
    check_plannable(config)
    method_class(config.method)  # clear errors before any model work
    plan_batch(config, cluster.world_size)  # the arithmetic's mistakes before the model's
    hf_config = load_model_config(model_config_dir(config))
    config = fit_seq_length(config, hf_config)[0]  # a default length fits the model's context
    batch = plan_batch(config, cluster.world_size)
    check_splittable(
        hf_config, config.sequence_parallel, attn_implementation=config.attn_implementation,
        max_seq_length=config.seq_length, world_size=cluster.world_size,
    )  # fmt: skip
    config, stand_in = _attention_to_trace(config)
    config, eager = _eager_to_trace(config)
    config, kernels = _kernels_to_trace(config)
    config, chunks = _loss_chunks_to_trace(config, hf_config, batch)
    config, direct = _direct_to_trace(config, cluster.world_size)
    stand_in += eager + kernels + chunks + direct

    with fake_world(cluster) as env, sdpa_backend(config.sdpa_backend):
        # The device meshes are built in here, outside FakeTensorMode, or it fails.
        sp = init_sequence_parallel(env, config.sequence_parallel)
        model, facts = build_parallel_model(hf_config, config, env)
        memory, method = None, "--full_trace"
        if not full_trace:
            memory, method = _extrapolated(model, facts, hf_config, config, env, batch, sp)
        if memory is None:
            method = f"all {facts.decoder_layers} layers traced ({method})"
            memory = _trace(model, hf_config, config, env, batch, sp)
        rollout = None
        if config.trains_on_prompts:  # the rollout phase, beside the traced update
            gathered = gathered_parameter_bytes(model, config)
            rollout = plan_rollout(hf_config, config, batch, gathered, memory)
    return Estimate(memory, facts, batch, time.perf_counter() - started, method + stand_in, rollout)


def _eager_to_trace(config: TrainConfig) -> tuple[TrainConfig, str]:
    """--compile is planned as the eager layers it compiles. Tracing a compiled layer on fake
    tensors runs dynamo and inductor on the planner's CPU (the first H100 run's planner gave
    no answer in 60 s), and the compiled step needs less, not more: its fused kernels keep
    fewer intermediates (23.98 GiB against the eager 28.62 GiB on the 1.1B row of
    docs/gpu-check.md), so the eager plan is on the safe side."""
    if not config.compile:
        return config, ""
    note = "; --compile traced eager (its fused layers held 0.84x the eager peak on an H100)"
    return config.replace(compile=False), note


def _kernels_to_trace(config: TrainConfig) -> tuple[TrainConfig, str]:
    """The config to trace for the run's kernel choices, which the planner's CPU cannot run
    as the GPU will, and a note. `--sdpa_backend math` is traced as math (it keeps the T x T
    scores, as on the GPU); cudnn, flash and efficient as the CPU's flash kernel, which saves
    what they save for backward (output and log-sum-exp, O(T) per head). `--liger_kernels` is
    planned without them: their fused kernels keep fewer intermediates than the eager layers
    (liger reports less memory), so the plan is on the safe side."""
    notes = []
    if config.sdpa_backend not in ("auto", "math"):
        notes.append(f"--sdpa_backend {config.sdpa_backend} traced as the CPU's flash kernel")
        config = config.replace(sdpa_backend="auto")
    if config.liger_kernels:
        notes.append("--liger_kernels planned as the eager layers (the safe side)")
        config = config.replace(liger_kernels=False)
    return config, "".join(f"; {note}" for note in notes)


def _direct_to_trace(config: TrainConfig, world_size: int) -> tuple[TrainConfig, str]:
    """--single_device_path direct (one GPU without FSDP2: fsdp_utils/parallel/single_device.py)
    planned as the FSDP2 run that holds the same bytes: the tracker follows FSDP2's shard groups
    only. Its casts are FSDP2's copies without the copying: a layer's compute-dtype copy lives
    from its forward to its backward unless activation checkpointing recomputes the layer, where
    it is freed after the forward. So: every layer checkpointed, FSDP2 resharding every layer
    (the last one too); none, --sharding shard_grad_op (every layer kept gathered); every Nth,
    shard_grad_op too, which counts the checkpointed layers' copies as well (the safe side)."""
    if config.single_device_path != "direct" or world_size != 1:
        return config, ""
    every_layer = config.gradient_checkpointing and config.checkpoint_every_n_layers == 1
    if every_layer:
        traced = config.replace(single_device_path="fsdp", reshard_last_layer=True)
        how = "FSDP2 resharding every layer (its checkpointed layers' copies are recomputed)"
    else:
        traced = config.replace(single_device_path="fsdp", sharding="shard_grad_op")
        how = "FSDP2 keeping every layer's compute copy from forward to backward"
        if config.gradient_checkpointing:
            how += " (the checkpointed layers' too: more than it holds)"
    return traced, f"; --single_device_path direct traced as {how}"


def planned_device_type(config: TrainConfig) -> str:
    """The device the planned run computes on: a GPU unless --device cpu (the trace itself
    runs on the CPU either way)."""
    return "cpu" if config.device == "cpu" else "cuda"


def _loss_chunks_to_trace(
    config: TrainConfig, hf_config: Any, batch: BatchPlan
) -> tuple[TrainConfig, str]:
    """The loss's chunk of the planned device when --loss_chunk_size is not given: its default
    depends on the device (`train.loss.default_chunk_size`: on a GPU 8,192 tokens, at most
    256 Mi logits), and the trace runs on the CPU, whose default would otherwise be traced.
    Noted when the chunks split a micro-batch's targets."""
    if config.loss_chunk_size is not None:
        return config, ""
    from fsdp_utils.train.loss import default_chunk_size

    device = planned_device_type(config)
    vocab = int(getattr(hf_config, "vocab_size", 0) or 1)
    tokens, _ = default_chunk_size(vocab, device)
    per_micro_batch = batch.batch_size_per_device * batch.sequences_per_example * batch.seq_length
    note = ""
    if tokens < per_micro_batch:
        note = f"; the loss in chunks of {tokens:,} tokens ({device}'s default)"
    return config.replace(loss_chunk_size=tokens), note


def _attention_to_trace(config: TrainConfig) -> tuple[TrainConfig, str]:
    """The config to trace, with a CPU stand-in for an attention implementation that cannot
    run on the planner's fake CPU tensors, and a note saying so (fsdp_utils.model.attention)."""
    planned = planned_implementation(config.attn_implementation)
    if planned == config.attn_implementation:
        return config, ""
    note = (
        f"; {config.attn_implementation} traced as {planned}: both save O(T) per head for "
        "backward (output and log-sum-exp), never the T x T scores"
    )
    return config.replace(attn_implementation=planned), note


def _extrapolated(
    model: Any,
    facts: ModelInfo,
    hf_config: Any,
    config: TrainConfig,
    env: DistEnv,
    batch: BatchPlan,
    sp: SequenceParallel,
) -> tuple[StepMemory | None, str]:
    """The step memory extrapolated from shallow copies of `model` and how; or None and why
    the model must be traced whole."""
    pattern = layer_period(model)
    if pattern is None:
        return None, why_layers_differ(model) or "its decoder layers do not repeat"
    # Copies grow by whole checkpointing periods and whole periods of the layers' pattern.
    # (--checkpoint_layers between 0 and all: the layers differ, `layer_period` said so above)
    checkpointing = config.checkpoint_every_n_layers if config.gradient_checkpointing else 1
    every_n = math.lcm(checkpointing, pattern)
    counts = layer_counts(facts.decoder_layers, every_n, repeating=pattern > 1)
    if counts is None:
        return None, "too few layers to gain from extrapolating"
    repeats = f", whose layers repeat every {pattern}" if pattern > 1 else ""
    traced: dict[int, StepMemory] = {}
    while counts is not None:
        for depth in counts.depths:
            if depth not in traced:
                shallow_config = truncated_config(hf_config, depth)
                shallow, shallow_facts = build_parallel_model(shallow_config, config, env)
                if shallow_facts.decoder_layers != depth:
                    return None, "its config does not set the number of layers"
                traced[depth] = _trace(shallow, shallow_config, config, env, batch, sp)
        memory = extrapolate_memory(counts, [traced[d] for d in counts.depths], every_n)
        if memory is not None:
            return memory, counts.describe() + repeats
        counts = counts.deeper()
    return None, "its memory does not grow linearly over shallow copies"


def _trace(
    model: Any,
    hf_config: Any,
    config: TrainConfig,
    env: DistEnv,
    batch: BatchPlan,
    sp: SequenceParallel,
) -> StepMemory:
    """Materialise `model` (from `build_parallel_model`, on meta) on fake tensors and trace
    one training step of it (with `sp`, of rank 0's slices: its activations, and the buffers of
    the all-to-alls around attention)."""
    reference_model = None
    if method_class(config.method).needs_frozen_copy(config):
        # a method's frozen copy (DPO's --reference live): its parameters and its forward (no
        # gradients) are planned too
        reference_model, _ = build_parallel_model(hf_config, config, env)
    try:
        with _UnitScalarsFakeMode(allow_non_fake_inputs=True), _transformers_eager_paths():
            materialize(model, env.device)
            model.train()
            if reference_model is not None:
                materialize(reference_model, env.device)
                reference_model.requires_grad_(False)
            step, method = traced_step(model, config, env, batch, reference_model, sp)
            # Warm-up: creates the optimizer state, untracked.
            step(placeholder_micro_batches(batch, 1, config.seed, sp), step=1)
            count = traced_micro_batches(batch, config.defer_grad_sync)
            memory = track_train_step(
                step, lambda: placeholder_micro_batches(batch, count, config.seed, sp), step=2
            )
            # The frozen models beside the trained one, which the tracker does not see: DPO's
            # --reference live copy, a distillation teacher (NF4 or not)
            frozen = [reference_model] if reference_model is not None else []
            frozen_bytes = sum(_local_bytes(m) for m in [*frozen, *method.frozen_models()])
            if frozen_bytes:
                memory = with_resident(memory, PARAMETERS[0], frozen_bytes)
                memory = dataclasses.replace(
                    memory, extra={**memory.extra, "frozen_bytes": frozen_bytes}
                )
            if unmanaged := unsharded_bytes(model):  # a 4-bit base FSDP2 leaves whole
                memory = with_resident(memory, PARAMETERS[0], unmanaged)
            return memory
    except (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedFakeTensorException,
    ) as err:
        raise _untraceable(err, hf_config) from err
