"""`--auto`: the fastest configuration that fits, chosen before the queue.

Searched (each unless the user set it: `--auto_keep`, and any flag given): the sharding (full,
shard_grad_op, hybrid on several nodes, no_shard), how many decoder layers are checkpointed
(0..L, the first ones: --checkpoint_layers), the micro-batch (the divisors of the total batch
per data-parallel rank: the total batch, and so the results, stay the same), the
sequence-parallel degree (those dividing the heads and the processes), --compile on GPUs, and
--cpu_offload only when nothing else fits. None of these changes what the run computes.

Time from the step-time model (fsdp_utils/plan/step_time.py: microseconds a candidate), memory
from the planner (seconds a trace), so the search is best-first: every candidate is timed, and
the fastest are checked for memory in order until the best few that fit are found. A trace is
made only when a candidate needs it, and reused:

- a family (sharding, sequence parallelism, offload) whose state alone (parameters, gradients,
  optimizer state, and for shard_grad_op the parameters kept gathered) exceeds the GPU is
  skipped before any trace, with one line;
- for one family and micro-batch, the plans with no layer and with every layer checkpointed
  are traced (exactly, extrapolated from 3-5 layers); in between, the forward/backward peak is
  taken on the straight line between them: the peak is the highest of moments whose memory
  falls linearly with each checkpointed layer, so it is convex in their number and the line
  is an upper bound (tests/test_speed_auto.py checks it against full traces);
- memory grows with the micro-batch and falls with the checkpointed layers: a candidate that
  does not fit rules out those with a larger micro-batch and no more checkpointed layers,
  without a trace.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsdp_utils.config.batch import divisors
from fsdp_utils.config.options.parallelism import AUTO_SETTINGS, auto_kept
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.plan.estimate import Cluster
from fsdp_utils.plan.hardware import GIB, Gpu
from fsdp_utils.plan.planner import evaluate
from fsdp_utils.plan.report import Margin, MemoryPlan
from fsdp_utils.plan.search import batch_candidates, resolved_total_batch
from fsdp_utils.plan.speed import SpeedModel
from fsdp_utils.plan.step_time import StepTime
from fsdp_utils.plan.workload import checkpointed_layers, model_facts

Progress = Callable[[str], None]
TOP = 5  # candidates that fit, shown (each the best of its settings but the checkpointed layers)
MAX_TRACES = 16  # memory plans a round of the search may trace (the first, then offload's)


def _quiet(_: str) -> None:
    pass


@dataclass(frozen=True)
class Candidate:
    config: TrainConfig  # the resolved configuration
    step: StepTime
    peak_bytes: int | None = None
    required_bytes: int | None = None
    fits: bool | None = None
    memory_basis: str = ""  # "traced", or the bound between two traced plans

    def settings(self) -> dict[str, Any]:
        return resolved_settings(self.config)

    def flags(self) -> list[str]:
        return settings_flags(self.settings())

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings(),
            "flags": " ".join(self.flags()),
            "peak_bytes": self.peak_bytes,
            "required_bytes": self.required_bytes,
            "fits": self.fits,
            "memory_basis": self.memory_basis,
            "tokens_per_s_per_gpu": self.step.tokens_per_s_per_gpu,
            "step_seconds": self.step.seconds,
            "mfu": self.step.mfu,
            "terms": {t.name: t.seconds for t in self.step.terms},
        }


def resolved_settings(config: TrainConfig) -> dict[str, Any]:
    """The values --auto chooses, as the run will have them."""
    layers = model_facts(config).layers
    return {
        "sharding": config.sharding,
        "checkpoint_layers": checkpointed_layers(config, layers),
        "batch_size_per_device": config.batch_size_per_device,
        "sequence_parallel": config.sequence_parallel,
        "compile": config.compile,
        "cpu_offload": config.cpu_offload,
    }


def settings_flags(settings: dict[str, Any]) -> list[str]:
    flags = [
        "--sharding", str(settings["sharding"]),
        "--checkpoint_layers", str(settings["checkpoint_layers"]),
        "--batch_size_per_device", str(settings["batch_size_per_device"]),
        "--sequence_parallel", str(settings["sequence_parallel"]),
    ]  # fmt: skip
    flags += ["--compile"] if settings["compile"] else []
    flags += ["--cpu_offload"] if settings["cpu_offload"] else []
    return flags


def apply_settings(config: TrainConfig, settings: dict[str, Any]) -> TrainConfig:
    """`config` with --auto's values (the total batch held; accumulation derived again)."""
    c = int(settings["checkpoint_layers"])
    return config.replace(
        sharding=settings["sharding"],
        checkpoint_layers=c,
        gradient_checkpointing=c > 0,
        checkpoint_every_n_layers=1,
        batch_size_per_device=int(settings["batch_size_per_device"]),
        gradient_accumulation_steps=None,
        sequence_parallel=int(settings["sequence_parallel"]),
        compile=bool(settings["compile"]),
        cpu_offload=bool(settings["cpu_offload"]),
    )


@dataclass
class AutoResult:
    ranked: list[Candidate]  # those that fit, fastest first (the first is the choice)
    kept: list[str]
    considered: int
    traced: int
    seconds: float
    skipped: list[str] = field(default_factory=list)
    closest: Candidate | None = None  # when nothing fits: the one that came nearest
    speed_note: str = ""

    @property
    def winner(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "winner": 0 if self.ranked else None,
            "candidates": [c.to_dict() for c in self.ranked],
            "kept": self.kept,
            "considered": self.considered,
            "traced": self.traced,
            "seconds": self.seconds,
            "skipped": self.skipped,
            "speed_basis": self.speed_note,
        }


def _family(config: TrainConfig) -> tuple[str, int, bool]:
    return (config.sharding, config.sequence_parallel, config.cpu_offload)


class _Memory:
    """Memory of candidates from traced plans: exact at no and at every checkpointed layer, the
    line between them in between (an upper bound), each plan traced once."""

    def __init__(
        self, cluster: Cluster, gpu: Gpu, margin: Margin, progress: Progress, full_trace: bool
    ) -> None:
        self.cluster, self.gpu, self.margin = cluster, gpu, margin
        self.progress, self.full_trace = progress, full_trace
        self.plans: dict[tuple[Any, ...], MemoryPlan] = {}
        self.traced = 0

    def _plan(self, config: TrainConfig, key: tuple[Any, ...]) -> MemoryPlan:
        if key not in self.plans:
            self.traced += 1
            started = time.perf_counter()
            self.plans[key] = evaluate(
                config, self.cluster, self.gpu, self.margin, full_trace=self.full_trace
            )
            self.progress(
                f"  traced {describe(config)}: {self.plans[key].required_bytes / GIB:.1f} GiB "
                f"needed ({time.perf_counter() - started:.1f} s)"
            )
        return self.plans[key]

    def of(
        self, candidate: TrainConfig, layers: int, pinned_checkpointing: bool
    ) -> tuple[int, str]:
        """(peak bytes, basis) of `candidate`."""
        if pinned_checkpointing:  # the user's own checkpointing: traced as it is
            key = ("as given", *_family(candidate), candidate.batch_size_per_device)
            return self._plan(candidate, key).peak_bytes, "traced"
        c = checkpointed_layers(candidate, layers)
        family = (*_family(candidate), candidate.batch_size_per_device)
        none = candidate.replace(gradient_checkpointing=False, checkpoint_layers=None)
        every = candidate.replace(
            gradient_checkpointing=True, checkpoint_layers=None, checkpoint_every_n_layers=1
        )
        if c == 0:
            return self._plan(none, (*family, 0)).peak_bytes, "traced"
        high = self._plan(every, (*family, layers))
        if c == layers:
            return high.peak_bytes, "traced"
        low = self._plan(none, (*family, 0))
        share = c / layers
        line = low.forward_backward_peak_bytes + share * (
            high.forward_backward_peak_bytes - low.forward_backward_peak_bytes
        )
        rest = [p.update_peak_bytes for p in (low, high) if p.peak_in_optimizer_step] + [
            p.rollout.total for p in (low, high) if p.rollout is not None
        ]
        peak = math.ceil(max([line, *rest]))
        return peak, f"bound between 0 and {layers} checkpointed layers"


def describe(config: TrainConfig) -> str:
    parts = [
        f"--sharding {config.sharding}",
        f"--batch_size_per_device {config.batch_size_per_device}",
    ]
    if config.checkpoint_layers is not None:
        parts.append(f"--checkpoint_layers {config.checkpoint_layers}")
    elif config.gradient_checkpointing:
        parts.append("--gradient_checkpointing")
    if config.sequence_parallel > 1:
        parts.append(f"--sequence_parallel {config.sequence_parallel}")
    if config.compile:
        parts.append("--compile")
    if config.cpu_offload:
        parts.append("--cpu_offload")
    return " ".join(parts)


def _state_lower_bound(config: TrainConfig, cluster: Cluster) -> tuple[int, str]:
    """Bytes per GPU a family holds whatever the batch and checkpointing: its state (16 bytes
    per parameter with AdamW in bf16-mixed, ...) split over its shard group, and for
    shard_grad_op every parameter gathered between forward and backward."""
    facts = model_facts(config)
    state_per_param = {"adamw": 8, "sgd": 4 if config.momentum else 0}[config.optimizer]
    master = 2 if config.precision == "bf16-true" else 4
    trainable_state = facts.trainable * (master + master + state_per_param * master // 4)
    frozen_bytes = (facts.layer_stored_bytes * facts.layers + facts.ends_stored_bytes) - (
        facts.trainable * master
    )
    state = trainable_state + max(frozen_bytes, 0)
    if config.cpu_offload:
        return 0, ""
    bound = state // cluster.shard_degree(config.sharding)
    if config.sharding == "shard_grad_op":
        gathered = facts.layer_gathered_bytes * facts.layers + facts.ends_gathered_bytes
        return bound + gathered, "its state, and every parameter kept gathered between passes,"
    return bound, "its state alone"


def search(
    config: TrainConfig,
    cluster: Cluster,
    gpu: Gpu,
    speed: SpeedModel,
    *,
    margin: Margin | None = None,
    progress: Progress = _quiet,
    full_trace: bool = False,
    top: int = TOP,
) -> AutoResult:
    """The fastest configurations of `config` that fit `gpu` on `cluster`, fastest first."""
    started = time.perf_counter()
    margin = margin or Margin()
    kept = auto_kept(config.auto_keep)
    facts = model_facts(config)
    layers = facts.layers
    free = [name for name in AUTO_SETTINGS if name not in kept]
    memory = _Memory(cluster, gpu, margin, progress, full_trace)
    skipped: list[str] = []
    world = cluster.world_size
    total = resolved_total_batch(config, world)

    shardings = [config.sharding]
    if "sharding" in free:
        shardings = ["full", "shard_grad_op", "no_shard"]
        if cluster.nodes > 1:
            shardings.insert(1, "hybrid")
    sps = [config.sequence_parallel]
    if "sequence_parallel" in free and not config.trains_on_prompts:
        sps = [n for n in divisors(world) if facts.heads % n == 0 and total % (world // n) == 0]
    checkpoint_counts = [checkpointed_layers(config, layers)]
    pinned_checkpointing = "checkpoint_layers" not in free
    if not pinned_checkpointing:
        checkpoint_counts = list(range(layers + 1))
    compiles = [config.compile]
    if "compile" in free:
        compiles = [False, True] if speed.device.kind == "gpu" else [False]
    # offload only when nothing else fits: a second round
    offloads = [False, True] if "cpu_offload" in free else [config.cpu_offload]

    def candidates(offload: bool) -> list[TrainConfig]:
        out = []
        for sharding in shardings:
            trial = config.replace(sharding=sharding, cpu_offload=offload)
            bound, what = _state_lower_bound(trial, cluster)
            if bound + margin.bytes_for(bound) > gpu.memory_bytes:
                line = f"--sharding {sharding}" + (" --cpu_offload" if offload else "")
                reason = f"{what} needs {bound / GIB:,.1f} GiB per GPU"
                skipped.append(f"{line}: {reason}")
                progress(f"skipping {line}: {reason}")
                continue
            for sp in sps:
                batches = [config.batch_size_per_device]
                if "batch_size_per_device" in free:
                    batches = batch_candidates(total, world // sp)
                for b in batches:
                    for c in checkpoint_counts:
                        for compiled in compiles:
                            out.append(_with(trial, sp, b, c, compiled, pinned_checkpointing))
        return out

    ranked: list[Candidate] = []
    considered = 0
    closest: Candidate | None = None
    for offload in offloads:
        if offload and ranked:
            break  # offload only when nothing else fits
        configs = candidates(offload)
        timed = []
        for trial in configs:
            try:
                timed.append(Candidate(trial, speed.predict(trial, cluster)))
            except ValueError as err:  # a batch that does not divide, ...
                progress(f"  not possible: {describe(trial)}: {str(err).splitlines()[0]}")
        considered += len(timed)
        timed.sort(key=lambda cand: cand.step.seconds)
        ranked, closest = _best_first(
            timed, memory, layers, pinned_checkpointing, top, progress, ranked, closest
        )
    return AutoResult(
        ranked=ranked,
        kept=kept,
        considered=considered,
        traced=memory.traced,
        seconds=time.perf_counter() - started,
        skipped=skipped,
        closest=closest,
        speed_note=speed.describe(),
    )


def _with(
    config: TrainConfig, sp: int, b: int, c: int, compiled: bool, pinned: bool
) -> TrainConfig:
    trial = config.replace(
        sequence_parallel=sp,
        batch_size_per_device=b,
        gradient_accumulation_steps=None,
        compile=compiled,
    )
    if pinned:
        return trial
    return trial.replace(
        checkpoint_layers=c, gradient_checkpointing=c > 0, checkpoint_every_n_layers=1
    )


def _best_first(
    timed: list[Candidate],
    memory: _Memory,
    layers: int,
    pinned: bool,
    top: int,
    progress: Progress,
    ranked: list[Candidate],
    closest: Candidate | None,
) -> tuple[list[Candidate], Candidate | None]:
    """Check memory in order of predicted time until `top` settings (each but the checkpointed
    layers) fit; rule out by monotonicity what a failed check implies."""
    # (sharding, offload, tokens per GPU and micro-batch) -> the most checkpointed layers
    # known not to fit: a GPU's activations follow its tokens, with or without a sequence
    # split, so more tokens and no more checkpointed layers do not fit either
    too_big: dict[tuple[Any, ...], int] = {}
    impossible: set[tuple[Any, ...]] = set()  # plans that cannot be made (a split that fails)
    best_of: set[tuple[Any, ...]] = set()
    traced_before = memory.traced  # each round its own MAX_TRACES: offload's too
    for cand in timed:
        cfg = cand.config
        c = checkpointed_layers(cfg, layers)
        group = (*_family(cfg), cfg.batch_size_per_device, cfg.compile)
        if group in best_of:
            continue  # a faster one of these settings fits already
        family = _family(cfg)
        if (*family, cfg.batch_size_per_device) in impossible:
            continue
        tokens = cfg.batch_size_per_device / cfg.sequence_parallel
        ruled_out = any(
            key[:2] == (cfg.sharding, cfg.cpu_offload) and key[2] <= tokens and c <= worst
            for key, worst in too_big.items()
        )
        if ruled_out:
            continue
        if not _has_traces(memory, cfg, layers, pinned):
            if ranked:  # the choice is made: the runners-up come from plans already traced
                continue
            if memory.traced - traced_before >= MAX_TRACES:
                progress(f"  stopping: {MAX_TRACES} memory plans traced")
                break
        try:
            peak, basis = memory.of(cfg, layers, pinned)
        except ValueError as err:
            progress(f"  not possible: {describe(cfg)}: {str(err).splitlines()[0]}")
            impossible.add((*family, cfg.batch_size_per_device))
            continue
        required = peak + memory.margin.bytes_for(peak)
        fits = required <= memory.gpu.memory_bytes
        checked = dataclasses.replace(
            cand, peak_bytes=peak, required_bytes=required, fits=fits, memory_basis=basis
        )
        if not fits:
            key = (cfg.sharding, cfg.cpu_offload, tokens)
            too_big[key] = max(too_big.get(key, -1), c)
            if closest is None or (closest.required_bytes or 0) > required:
                closest = checked
            continue
        ranked.append(checked)
        best_of.add(group)
        if len(ranked) >= top:
            break
    return ranked, closest


def _has_traces(memory: _Memory, cfg: TrainConfig, layers: int, pinned: bool) -> bool:
    """Whether the memory of `cfg` needs no new trace."""
    family = (*_family(cfg), cfg.batch_size_per_device)
    if pinned:
        return ("as given", *family) in memory.plans
    c = checkpointed_layers(cfg, layers)
    needed = [0] if c == 0 else [layers] if c == layers else [0, layers]
    return all((*family, n) in memory.plans for n in needed)


# --- what the log and --plan --auto print -------------------------------------------------------


def why_slower(worse: Candidate, better: Candidate) -> str:
    """Why `worse` loses to `better`: the settings that differ and the terms that grow most."""
    a, b = better.settings(), worse.settings()
    changed = [
        f"{name.replace('_', ' ')} {b[name]} instead of {a[name]}"
        for name in AUTO_SETTINGS
        if a[name] != b[name]
    ]
    growth = sorted(
        ((t.seconds - better.step.term(t.name), t.name) for t in worse.step.terms),
        reverse=True,
    )
    terms = [f"{name} +{delta * 1e3:,.1f} ms" for delta, name in growth[:2] if delta > 0]
    return "; ".join(changed) + (f": {', '.join(terms)}" if terms else "")


def format_search(result: AutoResult, gpu: Gpu) -> str:
    lines = [
        f"--auto: the fastest configuration that fits {gpu.name or 'the GPU'} "
        f"({gpu.memory_bytes / GIB:.1f} GiB), step time from {result.speed_note}",
        f"  {result.considered:,} configurations timed, {result.traced} memory plans traced, "
        f"{result.seconds:.1f} s"
        + (f"; kept as given: {', '.join(result.kept)}" if result.kept else ""),
        "",
        f"  {'#':>2}  {'sharding':<13} {'ckpt':>5} {'micro':>5} {'sp':>3} {'compile':<7} "
        f"{'offload':<7} {'peak GiB':>8} {'needs':>6} {'tok/s/GPU':>10} {'MFU':>6} {'step':>9}",
    ]
    for rank, cand in enumerate(result.ranked, start=1):
        s = cand.settings()
        layers = model_facts(cand.config).layers
        lines.append(
            f"  {rank:>2}  {s['sharding']:<13} {s['checkpoint_layers']:>2}/{layers:<2} "
            f"{s['batch_size_per_device']:>5} {s['sequence_parallel']:>3} "
            f"{'yes' if s['compile'] else 'no':<7} {'yes' if s['cpu_offload'] else 'no':<7} "
            f"{(cand.peak_bytes or 0) / GIB:>8.1f} {(cand.required_bytes or 0) / GIB:>6.1f} "
            f"{cand.step.tokens_per_s_per_gpu:>10,.0f} {cand.step.mfu:>6.1%} "
            f"{cand.step.seconds * 1e3:>7,.0f} ms"
        )
        if rank > 1:
            lines.append(f"      loses to #{rank - 1}: {why_slower(cand, result.ranked[rank - 2])}")
    winner = result.winner
    if winner is not None:
        memory = winner.memory_basis
        lines += [
            "",
            f"chosen: {' '.join(winner.flags())}",
            f"  needs {(winner.required_bytes or 0) / GIB:.1f} of {gpu.memory_bytes / GIB:.1f} "
            f"GiB ({memory}); predicted step:",
            *winner.step.lines(),
        ]
    if result.skipped:
        lines += ["", "not traced (cannot fit):", *(f"  {s}" for s in result.skipped)]
    return "\n".join(lines)


# --- the choice, as the run and the GPU kit read it -----------------------------------------------

# Settings of the request that do not change what --auto chooses (a requeued leg, a new
# --output_dir for the same run).
_NOT_IN_REQUEST = ("output_dir", "resume")


def request_of(config: TrainConfig, cluster: Cluster, gpu_key: str) -> dict[str, Any]:
    """What a choice was made for: the run's settings as given, the cluster and the GPU kind.
    A requeued leg asks the same and reads the choice back instead of searching again."""
    settings = {k: v for k, v in config.to_dict().items() if k not in _NOT_IN_REQUEST}
    return {
        "config": settings,
        "nodes": cluster.nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "gpu": gpu_key,
    }


def choice_record(
    config: TrainConfig, result: AutoResult, cluster: Cluster, gpu: Gpu, speed: SpeedModel
) -> dict[str, Any]:
    """The choice as JSON: what was asked, the settings chosen, the predictions, and why."""
    winner = result.winner
    assert winner is not None
    return {
        "request": request_of(config, cluster, speed.key),
        "settings": winner.settings(),
        "flags": " ".join(winner.flags()),
        "predicted": {
            "tokens_per_s_per_gpu": winner.step.tokens_per_s_per_gpu,
            "step_seconds": winner.step.seconds,
            "mfu": winner.step.mfu,
            "peak_bytes": winner.peak_bytes,
            "required_bytes": winner.required_bytes,
            "memory_basis": winner.memory_basis,
            "terms": {t.name: t.seconds for t in winner.step.terms},
        },
        "gpu": {"name": gpu.name, "memory_bytes": gpu.memory_bytes, "kind": speed.key},
        "report": format_search(result, gpu),
        **result.to_dict(),
    }
