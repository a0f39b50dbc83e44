"""The step-time model: predicted seconds per optimizer step and tokens/s per GPU, from terms a
reader can check (docs/plan.md, "Choosing a configuration").

Per GPU and per optimizer step of `m` micro-batches of `t` positions each (t = sequences x
length / --sequence_parallel):

    compute       the matrix products' FLOPs at the device's matmul rate for t tokens, times the
                  fitted share it reaches; attention's (causal kernels skip the upper triangle:
                  half of 12·L·H·d·s) at its own rate; the forward of every checkpointed layer
                  again (recompute)
    elementwise   norms, rotary, activations, residual adds, LoRA's dropout and additions:
                  bytes counted per token and layer from the shapes, at the memory bandwidth
    dispatch      the operators' launches (a CPU issues them one by one): on a GPU only what
                  exceeds the GPU's own work shows, on a CPU all of it
    FSDP2 copies  copy-in and copy-out around every all-gather and reduce-scatter, the casts to
                  the compute and reduce dtypes (memory traffic, even on one GPU)
    collectives   all-gathers (forward, and backward unless shard_grad_op) and reduce-scatters
                  per layer, hybrid's all-reduce between nodes, no_shard's all-reduce, at the
                  link's bandwidth (NVLink within a node, the fabric between nodes): only what
                  exceeds the compute of the layer it overlaps
    all-to-all    Ulysses' four per layer and pass (not overlapped)
    optimizer     AdamW or SGD as memory traffic over the local trainable parameters, and the
                  gradient clipping
    offload       --cpu_offload: the shards over PCIe (overlapped as the collectives are) and the
                  optimizer on the host (not)
    dequantize    QLoRA's NF4 weights dequantized in every forward, backward and recompute
    step overhead the trainer's per-step work (scheduler, stop decision, bookkeeping)
    stragglers    a synchronous step waits for its slowest GPU: the spread of one GPU's step
                  times times the expected largest of that many draws

The model's inputs are counts (`ModelFacts`, `RunShape`, `Cluster`), rates (`Device`: a data
sheet or `--calibrate`'s measurements) and a few fitted shares (`Efficiency`), all plain data:
a site's measured rows keep them, so that the fit can be redone (fsdp_utils/plan/efficiency.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

from fsdp_utils.plan.estimate import Cluster

# Causal attention kernels (flash, cuDNN, memory-efficient, CPU flash) skip the masked half of
# the scores; the FLOP convention of MFU (12·L·H·d·s) does not.
CAUSAL_SHARE = 0.5
GIB = 1024**3


@dataclass(frozen=True)
class ModelFacts:
    """The counts of a model as the run trains it (after LoRA, NF4, --freeze_layers), from its
    meta build (`facts_from_meta`): one decoder layer's, the rest's ("ends": embeddings, final
    norm, output layer), and the FLOPs per token at the run's sequence length."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    parameters: int  # every parameter (tied counted once, LoRA's adapters included)
    trainable: int  # with gradients and optimizer state
    layer_parameters: int  # one decoder layer's
    layer_trainable: int
    layer_quantized: int  # NF4 weights of one layer (QLoRA)
    layer_matmul_parameters: int  # weights one token multiplies in a layer (MoE: its top-k)
    layer_stored_bytes: int  # a layer's parameters as stored (fp32 masters, bf16 frozen, NF4)
    layer_gathered_bytes: int  # ... as all-gathered (the compute dtype; NF4 packed)
    ends_stored_bytes: int
    ends_gathered_bytes: int
    ends_trainable: int
    adapted_features: int  # LoRA: the sum over a layer's adapted projections of in + out
    seq_length: int  # the length the FLOPs below are for
    useful_flops_per_token: float  # MFU's numerator (fsdp_utils/metrics/flop_count.py)
    attention_flops_per_token: float  # its attention part, 12·L·H·d·s (forward and backward)
    trainable_tensors: int = 0  # parameter tensors with gradients (the optimizer's per-tensor work)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelFacts:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})

    def at_length(self, seq_length: int) -> ModelFacts:
        """The same model at another sequence length (attention's FLOPs scale with it)."""
        scale = seq_length / self.seq_length
        attention = self.attention_flops_per_token * scale
        useful = self.useful_flops_per_token - self.attention_flops_per_token + attention
        return dataclasses.replace(
            self,
            seq_length=seq_length,
            useful_flops_per_token=useful,
            attention_flops_per_token=attention,
        )


# Of a checkpointed layer's matrix-product FLOPs, what --checkpoint_mode op recomputes (above).
OP_RECOMPUTE_SHARE = 0.5


@dataclass(frozen=True)
class RunShape:
    """The settings of a run the step time depends on (the search varies the first six)."""

    micro_batch: int  # sequences (DPO: pairs, GRPO: prompts) per micro-batch and GPU group
    accumulation: int  # micro-batches per optimizer step
    sequence_parallel: int = 1
    checkpointed_layers: int = 0
    sharding: str = "full"
    compile: bool = False
    cpu_offload: bool = False
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    momentum: bool = False
    weight_decay: bool = False
    fused_optimizer: bool = False
    defer_grad_sync: bool = False
    checkpoint_ops: bool = False  # --checkpoint_mode op: the checkpointed layers recompute less
    direct: bool = False  # --single_device_path direct on one process: no FSDP2 copies or hooks
    sequences_per_example: int = 1  # 2 for DPO's pairs, G for GRPO's prompts

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunShape:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class Device:
    """One device's rates. From a data sheet (`fsdp_utils.plan.hardware.GPU_SPECS`) or from
    `--calibrate` (`matmul_table`, `attention_flops`, `dispatch_s`, ... measured on the node).

    matmul_table: measured matrix-product rates, (tokens, width, FLOP/s) rows: (tokens x
        width) @ (width x width) forward and backward; empty: `matmul_flops` at the fitted
        share, on a curve of tokens per micro-batch (`Efficiency.matmul_half_tokens`).
    """

    name: str
    kind: str  # "gpu" or "cpu"
    matmul_flops: float  # peak FLOP/s of the run's compute dtype
    memory_bandwidth: float  # bytes/s
    link_bandwidth: float  # within a node, per GPU and direction, bytes/s
    fabric_bandwidth: float  # between nodes, per GPU, bytes/s
    host_bandwidth: float  # GPU <-> host (PCIe), bytes/s
    link_latency: float  # seconds per collective within a node
    fabric_latency: float  # ... between nodes
    host_optimizer_bandwidth: float  # bytes/s of optimizer traffic the host sustains (offload)
    dispatch_s: float  # seconds to launch one operator (its share of the CPU)
    matmul_table: tuple[tuple[float, float, float], ...] = ()
    attention_flops: float | None = None  # measured causal SDPA rate (executed FLOPs/s)
    # ... and over (length, head dim, FLOP/s): attention's kernels depend on both
    attention_table: tuple[tuple[float, float, float], ...] = ()
    # the counted elementwise bytes per second a real decoder layer reaches (measured: a CPU's
    # single-threaded operators are far from its memory bandwidth); None: memory_bandwidth
    elementwise_bandwidth: float | None = None
    # CPU seconds of FSDP2's hooks around one shard group, per micro-batch (forward and
    # backward: the all-gathers' and reduce-scatter's bookkeeping and launches)
    fsdp_group_s: float = 0.0
    # seconds per sharded parameter tensor of an optimizer step and its clipping beyond their
    # traffic (DTensor's dispatch of each foreach operator)
    optimizer_tensor_s: float = 0.0
    source: str = "data sheet"

    @property
    def serial_dispatch(self) -> bool:
        """On a CPU the operators' launch and their work share the core; a GPU runs its queue
        while the CPU issues the next operators."""
        return self.kind == "cpu"

    def matmul_rate(self, tokens: float, width: float, eff: Efficiency) -> float:
        """FLOP/s of the model's matrix products at `tokens` per micro-batch and this width."""
        if self.matmul_table:
            return eff.matmul * _interpolate_rate(self.matmul_table, tokens, width)
        tokens_share = tokens / (tokens + eff.matmul_half_tokens)
        width_share = width / (width + eff.matmul_half_width)
        return self.matmul_flops * eff.matmul * tokens_share * width_share

    def attention_rate(self, eff: Efficiency, length: float = 0, head_dim: float = 0) -> float:
        """FLOP/s (causal, executed) of attention's kernels for sequences of `length`."""
        if self.attention_table:
            return eff.attention * _interpolate_rate(self.attention_table, length, head_dim)
        if self.attention_flops is not None:
            return eff.attention * self.attention_flops
        return eff.attention * self.matmul_flops

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Device:
        values = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        for table in ("matmul_table", "attention_table"):
            values[table] = tuple(tuple(row) for row in values.get(table, ()))
        return cls(**values)


def _interpolate_rate(
    table: Sequence[tuple[float, float, float]], tokens: float, width: float
) -> float:
    """A measured rate at (tokens, width) (or (length, head dim)): log-linear between the
    measured points (clamped at the ends), first along the first for each measured second,
    then across the second."""
    widths = sorted({w for _, w, _ in table})

    def along_tokens(w: float) -> float:
        points = sorted((t, r) for t, ww, r in table if ww == w)
        return _log_interp(points, tokens)

    return _log_interp([(w, along_tokens(w)) for w in widths], width)


def _log_interp(points: Sequence[tuple[float, float]], x: float) -> float:
    if len(points) == 1 or x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= x <= x1:
            share = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + share * (math.log(y1) - math.log(y0)))
    return points[-1][1]


@dataclass(frozen=True)
class Efficiency:
    """The fitted shares (fsdp_utils/plan/efficiency.py fits them to measured rows; these
    defaults are the priors the fit starts from, and what it falls back to without rows).

    matmul: the share of the device's matmul rate the model's products reach (of the data
        sheet's peak at many tokens per micro-batch; of the measured rate at the run's shapes
        after --calibrate).
    matmul_half_tokens, matmul_half_width: the tokens per micro-batch, and the model's width,
        at which a data-sheet device's products reach half of that share (GEMMs of few rows or
        a narrow model run further from the peak; unused after --calibrate, whose table is
        the curve).
    attention: the share of the peak (or of the measured SDPA rate) attention's kernels reach.
    elementwise: the counted elementwise bytes, times this.
    compiled_elementwise: the share of those bytes left with --compile (fused kernels).
    dispatch: the counted operators, times this.
    dequantize_bytes: bytes moved per NF4 weight and dequantization (torchao's eager
        dequantization counted: nibbles unpacked to int64 indices, a table lookup, the scales
        expanded and multiplied, the halves stacked: 32).
    host_optimizer: the share of the host's optimizer bandwidth an offloaded step reaches.
    step_overhead_s: the trainer's per-step work outside the model.
    jitter: the spread of one GPU's step time (its standard deviation over its mean): a
        synchronous step waits for the slowest of its GPUs, on average that many deviations
        above the mean as the largest of that many normal draws (`stragglers`). Assumed 2%: the
        lent H100's steady steps spread by 1-14% (median 5%) on a shared virtual machine,
        dedicated nodes less.
    """

    matmul: float = 0.75
    matmul_half_tokens: float = 256.0
    matmul_half_width: float = 1024.0
    attention: float = 0.45
    elementwise: float = 1.0
    compiled_elementwise: float = 0.5
    dispatch: float = 1.0
    dequantize_bytes: float = 32.0
    host_optimizer: float = 1.0
    step_overhead_s: float = 0.005
    jitter: float = 0.02
    rows: int = 0  # measured rows it was fitted to (0: the priors)
    site_rows: int = 0  # of those, this site's own (finished runs, fsdp_utils/plan/site.py)

    FITTED = (
        "matmul", "matmul_half_tokens", "matmul_half_width", "attention", "elementwise", "compiled_elementwise",
        "dispatch", "dequantize_bytes", "host_optimizer", "step_overhead_s", "jitter",
    )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Priors for a device measured by --calibrate: its tables have the shapes' own rates, and its
# toolkit step the overheads.
CALIBRATED_PRIOR = Efficiency(matmul=1.0, attention=1.0)


@dataclass(frozen=True)
class Term:
    name: str
    seconds: float
    detail: str


@dataclass(frozen=True)
class StepTime:
    """A predicted step: its terms (seconds per optimizer step on one GPU), what they sum to,
    and the throughput that follows."""

    terms: tuple[Term, ...]
    tokens_per_gpu: float  # sequence positions one GPU processes per optimizer step
    useful_flops_per_token: float
    peak_flops: float
    device: str
    efficiency: Efficiency = field(default_factory=Efficiency)

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.terms)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_gpu / self.seconds

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation (MFU's definition: useful FLOPs over the data-sheet peak)."""
        return self.useful_flops_per_token * self.tokens_per_s_per_gpu / self.peak_flops

    def term(self, name: str) -> float:
        return sum(t.seconds for t in self.terms if t.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_seconds": self.seconds,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "device": self.device,
            "terms": {t.name: t.seconds for t in self.terms},
        }

    def lines(self) -> list[str]:
        """The terms, one per line, nanoGPT style: the derived numbers."""
        out = [f"  {t.name:<14} {_ms(t.seconds):>10}   {t.detail}" for t in self.terms]
        out.append(
            f"  {'step':<14} {_ms(self.seconds):>10}   {self.tokens_per_gpu:,.0f} tokens per "
            f"GPU -> {self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {self.mfu:.1%} "
            f"(of {self.peak_flops / 1e12:,.1f} TFLOP/s)"
        )
        return out


def expected_maximum(n: int) -> float:
    """The expected largest of n standard normal draws (Blom's approximation; 0 for one)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.2f} s"


def _bytes(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.2f} MB"


def _rate(n: float, unit: str) -> str:
    return f"{n / 1e12:,.1f} T{unit}" if n >= 1e12 else f"{n / 1e9:,.1f} G{unit}"


# --- counting -------------------------------------------------------------------------------


def elementwise_bytes_per_token(facts: ModelFacts) -> float:
    """Bytes one token moves through one decoder layer's forward outside the matrix products
    and attention, in an eager Hugging Face layer (16-bit activations): two RMSNorms with their
    fp32 upcast (~36 bytes per hidden unit each), rotary on queries and keys (~24 per head
    unit), the layout copies around SDPA (~4), two residual adds (~6 each), SiLU and the gate's
    product (~10 per intermediate unit); LoRA: dropout on each adapted input, the small
    products reading it and writing the output, the scaled addition (~12 per in and out
    feature). Backward moves about twice the forward."""
    return layer_elementwise_bytes(
        facts.hidden, facts.heads, facts.kv_heads, facts.head_dim, facts.intermediate,
        facts.adapted_features,
    )  # fmt: skip


def layer_elementwise_bytes(
    hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, adapted: int = 0
) -> float:
    """`elementwise_bytes_per_token` from the shapes (--calibrate measures a layer with it)."""
    kv, q = kv_heads * head_dim, heads * head_dim
    per_token = 84 * hidden + 24 * (q + kv) + 4 * (q + 2 * kv) + 10 * intermediate
    return per_token + 12 * adapted


def operators_per_layer(facts: ModelFacts) -> float:
    """Operators one decoder layer's forward launches in eager mode (a Llama layer: ~40, as a
    profiler counts them), LoRA's ~6 per adapted projection; FSDP2's hooks ~10."""
    adapted = facts.adapted_features / max(facts.hidden, 1) / 2  # ~ projections adapted
    return 50 + 6 * adapted


def optimizer_accesses(shape: RunShape) -> float:
    """Parameter-sized reads and writes of one optimizer step, per trainable parameter (torch's
    foreach AdamW: lerp_, mul_, addcmul_, sqrt, div_, add_, addcdiv_ = 18; fused: 7; the
    gradient clipping's norm and scaling: 3 more)."""
    if shape.optimizer == "adamw":
        accesses = 7.0 if shape.fused_optimizer else 18.0
    else:  # SGD: p -= lr g (3); with momentum the buffer's update too
        accesses = 9.0 if shape.momentum else 3.0
    return accesses + (2.0 if shape.weight_decay else 0.0) + 3.0


def _state_bytes(precision: str) -> int:
    return 2 if precision == "bf16-true" else 4


def _compute_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _reduce_bytes(precision: str) -> int:
    return 2 if precision == "bf16-true" else 4


@dataclass(frozen=True)
class _Collective:
    seconds: float
    bytes: float


def _collective(nbytes: float, ranks: int, bandwidth: float, latency: float, *, factor=1.0):
    """An all-gather or reduce-scatter (factor 1) or all-reduce (2) of `nbytes` (the gathered
    or reduced size) over `ranks`: bytes x (n - 1) / n / bus bandwidth (nccl-tests' formula)."""
    if ranks <= 1 or nbytes <= 0:
        return _Collective(0.0, 0.0)
    moved = factor * nbytes * (ranks - 1) / ranks
    return _Collective(latency + moved / bandwidth, moved)


def predict(
    facts: ModelFacts,
    shape: RunShape,
    cluster: Cluster,
    device: Device,
    eff: Efficiency,
) -> StepTime:
    """The predicted optimizer step of one GPU (see the module's docstring for the terms)."""
    L, world, sp = facts.layers, cluster.world_size, shape.sequence_parallel
    c = min(max(shape.checkpointed_layers, 0), L)
    m = shape.accumulation
    sequences = shape.micro_batch * shape.sequences_per_example
    t = sequences * facts.seq_length / sp  # positions per GPU and micro-batch
    tokens = t * m

    # --- compute: linear products and attention, recompute of the checkpointed layers -----
    attention = facts.attention_flops_per_token
    linear = facts.useful_flops_per_token - attention
    attention_layer_forward = attention / L / 3
    # Op-level checkpointing (torchtitan's policy) keeps attention's output and every second
    # matrix product: half the products by count are recomputed (in a Llama layer k, o and up:
    # 37% of the 1.1B shape's product FLOPs, so half is the slower side), attention none.
    op_share = OP_RECOMPUTE_SHARE if shape.checkpoint_ops else 1.0
    recompute_linear = c * 2.0 * facts.layer_matmul_parameters * op_share
    recompute_attention = 0.0 if shape.checkpoint_ops else c * attention_layer_forward
    linear_flops = t * (linear + recompute_linear)
    attention_flops = t * CAUSAL_SHARE * (attention + recompute_attention)
    matmul_rate = device.matmul_rate(t, facts.hidden, eff)
    attention_rate = device.attention_rate(eff, facts.seq_length, facts.head_dim)
    compute = m * (linear_flops / matmul_rate + attention_flops / attention_rate)

    # --- elementwise and dispatch: per layer and pass (forward 1, backward 2, recompute 1) ---
    passes = 3 * L + c
    share = eff.compiled_elementwise if shape.compile else 1.0
    element_bytes = m * t * passes * elementwise_bytes_per_token(facts) * eff.elementwise * share
    element_rate = device.elementwise_bandwidth or device.memory_bandwidth
    elementwise = element_bytes / element_rate
    ops = m * passes * operators_per_layer(facts) * eff.dispatch * (0.3 if shape.compile else 1.0)
    # every shard group, every micro-batch (none on the direct path: no FSDP2)
    hooks = 0.0 if shape.direct else m * (L + 1) * device.fsdp_group_s
    dispatch_cpu = ops * device.dispatch_s + hooks
    gpu_work = compute + elementwise
    dispatch = dispatch_cpu if device.serial_dispatch else max(0.0, dispatch_cpu - gpu_work)

    # --- FSDP2: what is gathered and reduced, over how many ranks, on which link -----------
    shard = cluster.shard_degree(shape.sharding)
    replicas = world // shard
    inside = shard <= cluster.gpus_per_node
    shard_bw = device.link_bandwidth if inside else device.fabric_bandwidth
    shard_lat = device.link_latency if inside else device.fabric_latency
    reshards = shape.sharding != "shard_grad_op"
    gathers = m * ((L + 1) + (L - 1 if reshards else 0))  # forward: every layer and the root
    syncs = 1 if shape.defer_grad_sync else m
    compute_b, reduce_b = _compute_bytes(shape.precision), _reduce_bytes(shape.precision)
    trainable = facts.trainable
    layer_reduce = facts.layer_trainable * reduce_b
    # copy-in (read the shard, write the gather's input), copy-out (read, write the unsharded
    # parameters); the gradients: cast to the reduce dtype, copy into the reduce-scatter's
    # input, accumulate the output into the sharded gradient
    per_gather = facts.layer_stored_bytes / shard + facts.layer_gathered_bytes * (1 / shard + 2)
    copies = gathers * per_gather
    reduce_copies = syncs * trainable * (compute_b + 3 * reduce_b + 3 * reduce_b / shard)
    if shape.defer_grad_sync:  # the unsharded gradients accumulate between syncs
        reduce_copies += (m - 1) * trainable * 3 * reduce_b
    if shape.direct:  # each layer casts its fp32 weights itself, once a forward (and a
        # recompute); the gradients are cast back and accumulated: no copy-in/out
        copies = (m * (L + 1) + m * c) * (facts.layer_stored_bytes + facts.layer_gathered_bytes)
        reduce_copies = syncs * trainable * (compute_b + 2 * reduce_b)
    fsdp_copies = (copies + reduce_copies) / device.memory_bandwidth

    gather = _collective(facts.layer_gathered_bytes, shard, shard_bw, shard_lat)
    scatter = _collective(layer_reduce, shard, shard_bw, shard_lat)
    between = _collective(
        layer_reduce / shard, replicas, device.fabric_bandwidth, device.fabric_latency, factor=2
    )
    if shape.sharding == "no_shard":  # FSDP2's replicate: an all-reduce of the whole gradients
        bw = device.link_bandwidth if cluster.nodes == 1 else device.fabric_bandwidth
        lat = device.link_latency if cluster.nodes == 1 else device.fabric_latency
        between = _collective(layer_reduce, world, bw, lat, factor=2)
    sync_share = syncs / m
    # offload: every gather brings the shard over PCIe, every sync takes the gradient back
    if shape.cpu_offload:
        up = facts.layer_stored_bytes / shard / device.host_bandwidth
        down = facts.layer_trainable * reduce_b / shard / device.host_bandwidth * sync_share
    else:
        up = down = 0.0
    # One layer's forward and backward, per micro-batch, without the recompute: the overlap
    # is not counted on a recompute (it may hide a collective; the model does not claim it,
    # so that checkpointing another layer never predicts a faster step).
    plain = m * t * (linear / matmul_rate + CAUSAL_SHARE * attention / attention_rate)
    plain += (
        m * t * 3 * L * elementwise_bytes_per_token(facts) * eff.elementwise * share / element_rate
    )
    forward_compute = plain / m / (3 * L)
    backward_compute = 2 * forward_compute
    forward_comm = gather.seconds + up
    backward_comm = (
        (gather.seconds + up if reshards else 0.0)
        + (scatter.seconds + between.seconds) * sync_share
        + down
    )
    exposed_layer = max(0.0, forward_comm - forward_compute) + max(
        0.0, backward_comm - backward_compute
    )
    # The first layer's and the root's all-gathers have nothing before them to hide behind.
    first = 2 * forward_comm
    collectives = m * (first + L * exposed_layer)
    if device.serial_dispatch:  # a CPU's cores do the collectives' copies as well: no overlap
        collectives = m * (L + 1) * (forward_comm + backward_comm)

    # --- Ulysses: all-to-all of q, k, v before attention and of its output after, per pass ---
    all_to_all = 0.0
    if sp > 1:
        q = facts.heads * facts.head_dim
        kv = facts.kv_heads * facts.head_dim
        per_pass = t * (2 * q + 2 * kv) * compute_b
        inside_sp = sp <= cluster.gpus_per_node
        bw = device.link_bandwidth if inside_sp else device.fabric_bandwidth
        lat = device.link_latency if inside_sp else device.fabric_latency
        one = _collective(per_pass, sp, bw, lat)
        # q, k, v and the output each their own all-to-all (parallel/ulysses.py): four a pass,
        # forward, backward and recompute alike; `one` carries one latency and all the bytes
        all_to_all = m * (2 * L + c) * (one.seconds + 3 * lat)

    # --- optimizer, offload's host step, QLoRA's dequantization, the trainer ---------------
    local = trainable / shard
    optimizer_bytes = local * optimizer_accesses(shape) * _state_bytes(shape.precision)
    host_optimizer = 0.0
    if shape.cpu_offload:
        host_optimizer = optimizer_bytes / (device.host_optimizer_bandwidth * eff.host_optimizer)
        optimizer = 0.0
    else:
        optimizer = optimizer_bytes / device.memory_bandwidth
    optimizer += facts.trainable_tensors * device.optimizer_tensor_s
    # NF4: dequantized once in the forward, once in the backward, once more in a recompute
    dequant_bytes = m * (2 * L + c) * facts.layer_quantized * eff.dequantize_bytes
    dequantize = dequant_bytes / device.memory_bandwidth
    overhead = eff.step_overhead_s
    before = compute + elementwise + dispatch + fsdp_copies + collectives + all_to_all
    before += optimizer + host_optimizer + dequantize + overhead
    stragglers = before * eff.jitter * expected_maximum(world)

    where = "measured" if device.matmul_table else f"{eff.matmul:.0%} of the peak x curve"
    terms = [
        Term(
            "compute",
            compute,
            f"{_rate(m * linear_flops, 'FLOP')} of products at "
            f"{_rate(matmul_rate, 'FLOP/s')} ({where}, {t:,.0f} tokens per micro-batch), "
            f"{_rate(m * attention_flops, 'FLOP')} of causal attention at "
            f"{_rate(attention_rate, 'FLOP/s')}"
            + (f"; {c} checkpointed layer(s) recomputed" if c else ""),
        ),
        Term(
            "elementwise",
            elementwise,
            f"norms, rotary, activations: {_bytes(element_bytes)} at "
            f"{_rate(element_rate, 'B/s')}" + (" (compiled)" if shape.compile else ""),
        ),
        Term(
            "dispatch",
            dispatch,
            f"{ops:,.0f} operator launches at {device.dispatch_s * 1e6:.1f} us, FSDP2's hooks "
            f"{hooks * 1e3:,.1f} ms"
            + ("" if device.serial_dispatch else ": the part the GPU's work does not hide"),
        ),
        Term(
            "FSDP2 copies",
            fsdp_copies,
            f"copy-in/out, casts: {_bytes(copies + reduce_copies)} "
            f"({gathers} all-gathers, {syncs} gradient sync(s) per step)",
        ),
        Term(
            "collectives",
            collectives,
            f"exposed of {_bytes(gather.bytes)} all-gathered and {_bytes(scatter.bytes)} "
            f"reduce-scattered per layer over {shard} rank(s)"
            + (f", {_bytes(between.bytes)} all-reduced over {replicas}" if between.bytes else "")
            + (" and PCIe (offload)" if shape.cpu_offload else ""),
        ),
    ]
    if sp > 1:
        terms.append(Term("all-to-all", all_to_all, f"Ulysses over {sp} GPUs, 4 per layer pass"))
    terms.append(
        Term(
            "optimizer",
            optimizer + host_optimizer,
            f"{shape.optimizer} over {local / 1e6:,.1f}M local parameters: "
            f"{_bytes(optimizer_bytes)}"
            + (" on the host (--cpu_offload)" if shape.cpu_offload else ""),
        )
    )
    if facts.layer_quantized:
        terms.append(Term("dequantize", dequantize, f"NF4 weights: {_bytes(dequant_bytes)}"))
    terms.append(Term("step overhead", overhead, "the trainer's per-step work"))
    if world > 1:
        terms.append(
            Term(
                "stragglers",
                stragglers,
                f"the slowest of {world} GPUs: {expected_maximum(world):.2f} x a "
                f"{eff.jitter:.0%} spread",
            )
        )
    return StepTime(
        tuple(terms),
        tokens,
        facts.useful_flops_per_token,
        device.matmul_flops,
        device.name,
        eff,
    )
