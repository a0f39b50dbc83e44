"""The GPU kit's rows (bench/gpu_check.py): what each measures, what it costs, what comes first.

Pure data and arithmetic, no torch: the rows in issue 63's order, each row's estimate from the
first H100 call's wall times (docs/gpu-check.md), the budget that runs the most important rows
first and skips a row whose estimate no longer fits (saying so), and the best combination of
the faster-step levers (issue 60), chosen from the measured A/B rows at run time.

The order (issue 63): the quick training rows, the 1.1B row with its step profiled; issue 60's
A/B rows, each 25 steps with the last 15 timed, against the compiled 1.1B row (micro-batch 8 and
16, fused AdamW, the attention kernels, the loss chunk, the world-size-1 path and the last
layer's reshard, sync-free steps, float8, whole-model compile, liger-kernel, op-level
checkpointing); the best combination; `--auto`'s choice for the 1.1B and 8B LoRA rows beside the
hand rows; GRPO and distillation; then the rows the first H100 call measured.

Priorities: 1 the rows that settle issue 63 (the profiled eager row, the A/B base, the best
combination, `1b-auto`), 2 the quick rows and the five most promising levers (`--quick`), 3 the
other levers, the 8B pair, GRPO and distillation, 4 the first call's rows. A row runs only when
its estimate and those of every more important row after it still fit the budget: the levers
cannot eat the time of the best combination, and what is skipped is named.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama-architecture shape (vocabulary 32,000 as Llama 2 / TinyLlama)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 32000

    def parameters(self) -> int:
        head_dim = self.hidden // self.heads
        attention = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attention + mlp + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden


SHAPES = {
    # 256 wide: the smallest whose every decoder linear NF4 can hold (nf4_holds), so that the CPU
    # dry run runs the QLoRA row too (1.4M parameters)
    "tiny": Shape("tiny", hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=512),
    "1b": Shape("1b", hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632),  # TinyLlama
    "3b": Shape("3b", hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192),
    "8b": Shape("8b", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
    "13b": Shape("13b", hidden=5120, layers=40, heads=40, kv_heads=40, intermediate=13824),
}
TINY_SEQ_DIVISOR = 32  # --shapes tiny: 2,048 tokens -> 64, 32k -> 1,024

# torchao's NF4 quantizes in blocks of 64 weights with one 8-bit scale per 256 blocks: a weight it
# can hold has a multiple of this many elements (one process: FSDP2 splits nothing).
NF4_ELEMENTS = 16_384


def nf4_holds(shape: Shape) -> bool:
    """Whether every linear weight of the shape's decoder layers can be stored as NF4."""
    head_dim = shape.hidden // shape.heads
    sizes = (
        shape.hidden * shape.heads * head_dim,  # q_proj, o_proj
        shape.hidden * shape.kv_heads * head_dim,  # k_proj, v_proj
        shape.hidden * shape.intermediate,  # gate, up, down
    )
    return all(size % NF4_ELEMENTS == 0 for size in sizes)


BF16 = ("--precision", "bf16-mixed")
AC = ("--gradient_checkpointing",)
COMPILE = ("--compile",)
LORA = ("--lora",)
# The QLoRA row's flags (issue 40).
QLORA = ("--lora", "--quantize", "nf4")
# GRPO (issue 50): G = 8 completions of up to GRPO_COMPLETION tokens per prompt, the chess
# legality reward (no file, no engine), on prompts made from the kit's games.
GRPO_COMPLETION = 128
GRPO = ("--method", "grpo", "--reward_funcs", "chess_legal", "--num_generations", "8",
        "--log_completions_every", "0")  # fmt: skip
# Distillation (issue 63): the 1.1B student from the 8B shape as its teacher in NF4, live.
DISTILL = ("--method", "distill", "--teacher_quantize", "nf4")

# --- estimates ---------------------------------------------------------------------------------
#
# From the first H100 call (2026-11-27, docs/gpu-check-results/2026-11-27-h100/): a 1.1B row's
# wall time beyond its steps was 27.1 s (call 1: 30.1 s for 12 steps of 0.246 s) and 20.6 s
# (call 4, with the paused garbage collector this tree has); the 8B LoRA row's 30.4 s (34.1 s
# for 6 steps of 0.61 s). --compile added 14.4 s on the 1.1B shape (43.7 s for 12 steps of
# 0.20 s, call 3); the compiled loss adds its own graphs. Not measured: a compile that finds
# its graphs in the shared cache ("warm", a guess), whole-model compile ("model", a guess:
# inductor over one graph of 22 layers), float8's and the 8B's graphs.
START_S = 24.0
LARGE_START_S = 31.0
COMPILE_S = {"": 0.0, "warm": 6.0, "cold": 16.0, "float8": 20.0, "model": 60.0, "large": 22.0}
# One step's trace written and the CUDA memory snapshot dumped in the run, then read back and
# compressed by the kit (a guess: torch's trace export takes seconds for a 1.1B step).
PROFILE_S = 12.0
# Seconds per step on the H100: measured (1.1B eager 0.245, checkpointed 0.31, compiled 0.20;
# 8B LoRA checkpointed 0.61), or scaled from those by the tokens per step (micro-batch 8 and
# 16) and by the checkpointing's measured 24% (the 8B without it).
STEP_S = {
    "eager": 0.245, "ac": 0.31, "compiled": 0.20, "mb8": 0.37, "mb16": 0.72,
    "8b-ac": 0.61, "8b-compiled": 0.47, "distill": 0.8,
}  # fmt: skip
# The call's fixed costs: the wheels, the versions check and the data (19-26 s on the H100
# calls 2-4); the 1.1B weights (17-20 s) and a bare matrix product; the 8B weights (31-36 s).
SETUP_S = 30.0
SMALL_WEIGHTS_S = 22.0
LARGE_WEIGHTS_S = 36.0
BEST_PLAN_WAIT_S = 15.0  # the best combination is planned once it is chosen (1.1B: 9-14 s)
# The prepared device call: timeout_s 570. The budget runs from the script's first start (the
# wheels' installation in SETUP_S); the rest is the interpreter's start and exit, the last writes
# (the results, logs.tar.gz) and the shutdown of the planner beside the rows: at least 15 s.
# By the estimates the default rows end 18 s before the budget: 1b-auto's slack.
CALL_TIMEOUT_S = 570.0
CALL_MARGIN_S = 20.0
DEFAULT_BUDGET_S = CALL_TIMEOUT_S - CALL_MARGIN_S


def train_s(
    steps: int, step_s: float, *, compile: str = "", start: float = START_S, profile: bool = False
) -> float:
    """A training row's estimated wall time on one H100: start-up, compilation, steps, profile."""
    return round(start + COMPILE_S[compile] + steps * step_s + (PROFILE_S if profile else 0.0))


# --- the rows ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    """One measurement. `kind`: train (one chess_finetune.py run), best (the best combination of
    the levers, chosen at run time), auto (the configuration --auto picks, its prediction
    written first), grpo, distill, checkpoint (save at half way, resume, export), masking (the
    probe), evaluate (python -m fsdp_utils.evaluate on the checkpoint row's export). `role`:
    the small (1B) or large (8B) shape. `estimate_s`: its wall time on one H100, start-up
    included. `priority`: 1 first, 4 last (the module's docstring). `total`: the total batch
    per GPU (0: the micro-batch, no accumulation). `log_every`, `timed_steps`: the records
    every N steps, the last `timed_steps` steps timed from them (0: medians of the steps after
    the third, the first call's rule). `profile_step`: the step whose trace is recorded. A/B
    rows: `ref` the row they are measured against, `lever` the group of the best combination,
    `adds`/`drops` the flags they change on `ref`'s. `gpu_only`: why the row cannot run on a
    CPU. `skip_if_auto`: an attention kernel; the row repeats `ref` when `ref` ran it."""

    name: str
    kind: str
    role: str
    seq: int
    batch: int
    steps: int
    flags: tuple[str, ...] = ()
    estimate_s: float = 30.0
    quick: bool = False
    needs_cuda: bool = False
    tiny_seq: int = 64  # the shortest sequence with --shapes tiny (masking: several games a row)
    priority: int = 4
    total: int = 0
    log_every: int = 1
    timed_steps: int = 0
    profile_step: int = 0
    ref: str = ""
    lever: str = ""
    adds: tuple[str, ...] = ()
    drops: tuple[str, ...] = ()
    gpu_only: str = ""
    skip_if_auto: str = ""

    @property
    def total_batch(self) -> int:
        return self.total or self.batch

    @property
    def roles(self) -> tuple[str, ...]:
        """The shapes whose weights the row needs (distillation: the teacher's too)."""
        return ("small", "large") if self.kind == "distill" else (self.role,)


AB_STEPS, AB_TIMED, AB_LOG = 25, 15, 5  # issue 60: ~25 steps, the last 15 timed
PROFILED_STEP = 7  # outside the timed window, not a log step: no read-back in the trace
BASE = "1b-bf16-compile"  # the A/B rows' reference: 2,048 x 4 tokens, bf16-mixed, compiled
BASE_FLAGS = (*BF16, *COMPILE)


def ab_row(
    name: str, adds: tuple[str, ...], estimate: float, *, lever: str, priority: int = 3,
    quick: bool = False, drops: tuple[str, ...] = (), ref: str = BASE,
    ref_flags: tuple[str, ...] = BASE_FLAGS, batch: int = 4, gpu_only: str = "",
    skip_if_auto: str = "",
) -> Row:  # fmt: skip
    """An A/B row: `ref`'s flags without `drops`, with `adds`."""
    flags = (*[f for f in ref_flags if f not in drops], *adds)
    return Row(
        name, "train", "small", 2048, batch, AB_STEPS, flags, estimate, quick=quick,
        priority=priority, log_every=AB_LOG, timed_steps=AB_TIMED, ref=ref, lever=lever,
        adds=adds, drops=drops, gpu_only=gpu_only, skip_if_auto=skip_if_auto,
    )  # fmt: skip


_CUDA_KERNEL = "{} is a CUDA kernel (the CPU has flash and math)"
_COMPILED = STEP_S["compiled"]
# In issue 63's order. The estimates: train_s from the H100's figures above; --quick: the A/B
# base, the five levers the anchors promise most on Hopper (micro-batch 16: llm-foundry's 41.8%
# at 14 x 2,048; fused AdamW: +1.5-2 MFU points, torchtitan; cuDNN attention: 631 against 329
# TFLOP/s, pytorch #142132; FSDP2's copies at world size 1; no sync per step) and their best
# combination.
ROWS: tuple[Row, ...] = (
    # 1. the quick rows, each planned and predicted before it runs; the first profiled
    Row("1b-bf16", "train", "small", 2048, 4, AB_STEPS, BF16,
        train_s(AB_STEPS, STEP_S["eager"], profile=True), priority=1, log_every=AB_LOG,
        timed_steps=AB_TIMED, profile_step=PROFILED_STEP),
    Row("1b-bf16-ac", "train", "small", 2048, 4, AB_STEPS, (*BF16, *AC),
        train_s(AB_STEPS, STEP_S["ac"]), priority=2, log_every=AB_LOG, timed_steps=AB_TIMED),
    # 3. issue 60's A/B rows, against the compiled row
    Row(BASE, "train", "small", 2048, 4, AB_STEPS, BASE_FLAGS,
        train_s(AB_STEPS, _COMPILED, compile="cold"), quick=True, priority=1,
        log_every=AB_LOG, timed_steps=AB_TIMED, lever="micro-batch"),
    ab_row("1b-mb8-compile", (), train_s(AB_STEPS, STEP_S["mb8"], compile="cold"),
           lever="micro-batch", batch=8),
    ab_row("1b-mb16-compile", (), train_s(AB_STEPS, STEP_S["mb16"], compile="cold"),
           lever="micro-batch", batch=16, priority=2, quick=True),
    ab_row("1b-fused-adamw", ("--fused_optimizer",), train_s(AB_STEPS, _COMPILED, compile="warm"),
           lever="optimizer", priority=2, quick=True),
    ab_row("1b-sdpa-cudnn", ("--sdpa_backend", "cudnn"),
           train_s(AB_STEPS, _COMPILED, compile="cold"), lever="attention", priority=2,
           quick=True, gpu_only=_CUDA_KERNEL.format("cuDNN's attention"), skip_if_auto="cudnn"),
    ab_row("1b-sdpa-flash", ("--sdpa_backend", "flash"),
           train_s(AB_STEPS, _COMPILED, compile="cold"), lever="attention", skip_if_auto="flash"),
    ab_row("1b-sdpa-efficient", ("--sdpa_backend", "efficient"),
           train_s(AB_STEPS, _COMPILED, compile="cold"), lever="attention",
           gpu_only=_CUDA_KERNEL.format("the memory-efficient attention"),
           skip_if_auto="efficient"),
    # the former default chunk (64 Mi logits at 32,000 words) against the GPU's 8,192 tokens
    ab_row("1b-loss-2097", ("--loss_chunk_size", "2097"),
           train_s(AB_STEPS, _COMPILED, compile="warm") + 4, lever="loss chunk"),
    ab_row("1b-direct", ("--single_device_path", "direct"),
           train_s(AB_STEPS, _COMPILED, compile="cold"), lever="world size 1", priority=2,
           quick=True),
    ab_row("1b-reshard-last", ("--reshard_last_layer",),
           train_s(AB_STEPS, _COMPILED, compile="warm"), lever="world size 1"),
    ab_row("1b-sync-free", ("--sync_free_steps",), train_s(AB_STEPS, _COMPILED, compile="warm"),
           lever="sync-free", priority=2, quick=True),
    ab_row("1b-float8-rowwise", ("--float8", "rowwise"),
           train_s(AB_STEPS, _COMPILED, compile="float8"), lever="float8"),
    ab_row("1b-float8-tensorwise", ("--float8", "tensorwise"),
           train_s(AB_STEPS, _COMPILED, compile="float8"), lever="float8"),
    ab_row("1b-compile-model", ("--compile_scope", "model"),
           train_s(AB_STEPS, _COMPILED, compile="model"), lever="compile scope"),
    # liger-kernel's Triton kernels in place of the compiler (issue 60: "beside compile's")
    ab_row("1b-liger", ("--liger_kernels",), train_s(AB_STEPS, _COMPILED) + 8, lever="liger",
           drops=COMPILE, gpu_only="liger-kernel's Triton kernels need a GPU"),
    ab_row("1b-ac-op", ("--checkpoint_mode", "op"), train_s(AB_STEPS, STEP_S["ac"] * 0.95),
           lever="checkpointing", ref="1b-bf16-ac", ref_flags=(*BF16, *AC)),
    # the best combination: flags chosen from the rows above when it comes
    Row("1b-best", "best", "small", 2048, 16, AB_STEPS, BASE_FLAGS,
        train_s(AB_STEPS, STEP_S["mb16"], compile="cold", profile=True) + BEST_PLAN_WAIT_S,
        quick=True, priority=1, log_every=AB_LOG, timed_steps=AB_TIMED,
        profile_step=PROFILED_STEP, ref=BASE),
    # 4. --auto's choice (sharding, checkpointed layers, micro-batch, compile) for the total
    # batch of the largest hand micro-batch, and for the 8B LoRA row's
    Row("1b-auto", "auto", "small", 2048, 0, AB_STEPS, BF16,
        train_s(AB_STEPS, STEP_S["mb16"], compile="cold"), priority=1, total=16,
        log_every=AB_LOG, timed_steps=AB_TIMED, ref="1b-mb16-compile"),
    Row("8b-lora-4k", "train", "large", 4096, 1, 15, (*BF16, *AC, *LORA),
        train_s(15, STEP_S["8b-ac"], start=LARGE_START_S), priority=3, log_every=AB_LOG,
        timed_steps=10),
    Row("8b-lora-auto", "auto", "large", 4096, 0, 15, (*BF16, *LORA),
        train_s(15, STEP_S["8b-compiled"], compile="large", start=LARGE_START_S), priority=3,
        total=1, log_every=AB_LOG, timed_steps=10, ref="8b-lora-4k"),
    # 5. GRPO (its estimate a guess: never run on a GPU) and distillation
    Row("1b-grpo", "grpo", "small", 1024, 2, 5, (*BF16, *GRPO), 45, priority=3),
    Row("1b-distill", "distill", "small", 2048, 2, 10, (*BF16, *DISTILL),
        train_s(10, STEP_S["distill"], compile="large"), priority=3, log_every=AB_LOG,
        timed_steps=5),
    # the first H100 call's rows: what works on a new GPU kind, if the budget holds
    Row("1b-checkpoint", "checkpoint", "small", 2048, 4, 4, BF16, 92),
    Row("1b-masking", "masking", "small", 2048, 2, 1, (), 24, tiny_seq=1024),
    Row("1b-evaluate", "evaluate", "small", 2048, 0, 0, (), 36),
    Row("8b-lora-32k", "train", "large", 32768, 1, 2, (*BF16, *AC, *LORA), 42),
    Row("8b-qlora-4k", "train", "large", 4096, 1, 6, (*BF16, *AC, *QLORA), 40),
    Row("1b-fp16", "train", "small", 2048, 4, 12, ("--precision", "fp16-mixed"), 32),
    Row("1b-bf16-offload", "train", "small", 2048, 4, 4, (*BF16, "--cpu_offload"), 45,
        needs_cuda=True),
)  # fmt: skip
ROW_NAMES = {r.name: r for r in ROWS}
# The levers' groups in the order the best combination takes them; micro-batch first (it sets
# the batch), checkpointing never (the best combination checkpoints nothing).
LEVER_GROUPS = (
    "micro-batch", "optimizer", "attention", "loss chunk", "world size 1", "sync-free",
    "float8", "compile scope", "liger",
)  # fmt: skip
NEEDS_COMPILE = ("float8", "compile scope")  # measured compiled: they leave with --compile
GAIN_TO_JOIN = 0.02  # a lever joins the best combination when it is at least 2% faster


def static_skip(row: Row, *, device: str, shapes: Mapping[str, str] | None = None) -> str | None:
    """Why a row cannot run here at all, whatever the budget (None: it can)."""
    if row.needs_cuda and device != "cuda":
        return "needs a CUDA device (pinned host memory for the offloaded state)"
    if row.gpu_only and device != "cuda":
        return f"GPU only: {row.gpu_only}"
    shape = SHAPES.get((shapes or {}).get(row.role, ""))
    if "--quantize" in row.flags and shape is not None and not nf4_holds(shape):
        return (
            f"the {shape.name} shape has a decoder weight NF4 cannot hold (not a multiple of "
            f"{NF4_ELEMENTS:,} elements)"
        )
    return None


def select_rows(rows: Sequence[Row], *, quick: bool = False, only: str = "") -> list[Row]:
    """The rows to run: all, the --quick ones, or those --only names (in ROWS' order)."""
    chosen = [r for r in rows if r.quick] if quick else list(rows)
    if only:
        wanted = [n.strip() for n in only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {r.name for r in rows})
        if unknown:
            raise ValueError(f"unknown row(s) {unknown}; the rows: {[r.name for r in rows]}")
        chosen = [r for r in rows if r.name in wanted]
    return chosen


def scaled(row: Row, shapes: Mapping[str, str]) -> Row:
    """The row for the shapes in use: --shapes tiny divides the sequence lengths too."""
    if shapes["small"] != "tiny":
        return row
    return dataclasses.replace(row, seq=max(row.tiny_seq, row.seq // TINY_SEQ_DIVISOR))


def weights_s(roles: Iterable[str]) -> float:
    return sum(SMALL_WEIGHTS_S if role == "small" else LARGE_WEIGHTS_S for role in set(roles))


def estimate_s(rows: Sequence[Row]) -> float:
    """The rows' planned seconds on one H100: the setup and every shape's weights included."""
    return (
        SETUP_S + weights_s(r for row in rows for r in row.roles) + sum(r.estimate_s for r in rows)
    )


# --- the budget ----------------------------------------------------------------------------------


class Budget:
    """Seconds left, and which row may still start. A row starts when its estimate, with its
    shapes' weights not yet written, and the estimates of every more important row after it
    (lower priority number) fit in what is left; the estimates are scaled by how the rows so
    far ran against theirs (the median ratio of measured to estimated wall time, within 0.5 and
    1.5), so that a GPU faster than the H100, or slower, moves the line."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds or float("inf")
        self.ratios: list[float] = []

    @property
    def scale(self) -> float:
        if not self.ratios:
            return 1.0
        return min(1.5, max(0.5, statistics.median(self.ratios)))

    def ran(self, row: Row, wall_s: float | None) -> None:
        """A row that ran to its end: its wall time against its estimate."""
        if wall_s and row.estimate_s > 0:
            self.ratios.append(wall_s / row.estimate_s)

    def skip_reason(
        self, row: Row, later: Sequence[Row], *, elapsed: float, written: set[str]
    ) -> str | None:
        """Why `row` does not start now (None: it starts). `later`: the rows after it that
        will still run (not skipped for another reason); `written`: the roles whose weights
        exist."""
        left = self.seconds - elapsed
        own = self.scale * row.estimate_s + weights_s(set(row.roles) - written)
        if own > left:
            return f"the budget: {left:.0f} s left, the row takes about {own:.0f} s"
        kept = [r for r in later if r.priority < row.priority]
        reserved = self.reserved_s(row, kept, written=written)
        if own + reserved > left:
            names = ", ".join(r.name for r in kept)
            return (
                f"the budget: {left:.0f} s left, the row takes about {own:.0f} s and "
                f"{reserved:.0f} s are kept for the more important rows after it ({names})"
            )
        return None

    def reserved_s(self, row: Row, kept: Sequence[Row], *, written: set[str]) -> float:
        """The seconds `kept` (rows after `row`) take by their estimates, with their shapes'
        weights that neither `row` nor an earlier row writes."""
        roles = set(row.roles) | written
        return self.scale * sum(r.estimate_s for r in kept) + weights_s(
            {x for r in kept for x in r.roles} - roles
        )

    def time_limit(
        self, row: Row, later: Sequence[Row], *, elapsed: float, written: set[str]
    ) -> float:
        """The seconds a row that started may run (its weights written): three times its
        estimate (a minute at least), cut to what the rows more important than it after it
        leave (for a row of priority 1, the other rows of priority 1 after it too: a lever
        that overruns is killed in time for the best combination and `1b-auto`), never below
        its own estimate (a row that started was given that), never beyond the budget."""
        left = self.seconds - elapsed
        own = self.scale * row.estimate_s
        kept = [r for r in later if r.priority < row.priority or r.priority == row.priority == 1]
        spare = left - self.reserved_s(row, kept, written=written)
        return min(left, max(own, min(max(3 * own, 60.0), spare)))


# --- the best combination ------------------------------------------------------------------------


def tokens_per_s(entry: Mapping[str, Any] | None) -> float | None:
    if not entry or entry.get("status") != "ok":
        return None
    value = entry.get("tokens_per_s_per_gpu")
    return float(value) if value else None


def gain(row: Row, measured: Mapping[str, Mapping[str, Any]]) -> float | None:
    """The row's tokens/s over its reference's, less one (None: either did not run)."""
    mine, ref = tokens_per_s(measured.get(row.name)), tokens_per_s(measured.get(row.ref))
    return mine / ref - 1.0 if mine is not None and ref else None


@dataclasses.dataclass(frozen=True)
class Combination:
    """The best combination: its micro-batch, its flags, and one line per lever group."""

    batch: int
    flags: tuple[str, ...]
    notes: tuple[str, ...]


def best_combination(rows: Sequence[Row], measured: Mapping[str, Mapping[str, Any]]) -> Combination:
    """From the measured A/B rows: the fastest micro-batch among the compiled rows, then, per
    lever group, the row with the largest gain over its reference when that gain is at least
    GAIN_TO_JOIN (one per group: cuDNN or flash, rowwise or tensorwise, the direct path or the
    last layer's reshard). liger-kernel joins in place of --compile, and the levers measured
    only with --compile leave with it. `measured`: the kit's entries by row name."""
    levers = [r for r in rows if r.lever]
    sizes = [r for r in levers if r.lever == "micro-batch" and tokens_per_s(measured.get(r.name))]
    notes: list[str] = []
    base = ROW_NAMES[BASE]
    if sizes:
        base = max(sizes, key=lambda r: tokens_per_s(measured[r.name]) or 0.0)
        shown = ", ".join(f"{r.batch}: {tokens_per_s(measured[r.name]):,.0f}" for r in sizes)
        notes.append(f"micro-batch {base.batch} (tokens/s per GPU by micro-batch: {shown})")
    else:
        notes.append(f"micro-batch {base.batch} (no micro-batch row measured)")
    flags = list(base.flags)
    chosen: dict[str, Row] = {}
    for group in LEVER_GROUPS[1:]:
        members = [r for r in levers if r.lever == group]
        gains = {r.name: gain(r, measured) for r in members}
        tried = [r for r in members if gains[r.name] is not None]
        if not members:
            continue
        if not tried:
            why = "; ".join(
                f"{r.name} {measured.get(r.name, {}).get('status', 'not run')}" for r in members
            )
            notes.append(f"{group}: not measured ({why})")
            continue
        best = max(tried, key=lambda r: gains[r.name] or 0.0)
        figures = ", ".join(f"{r.name} {gains[r.name]:+.1%}" for r in tried)
        if (gains[best.name] or 0.0) >= GAIN_TO_JOIN:
            chosen[group] = best
            notes.append(f"{group}: {best.name} joins ({figures})")
        else:
            notes.append(f"{group}: none joins, under +{GAIN_TO_JOIN:.0%} ({figures})")
    if "liger" in chosen:
        for group in NEEDS_COMPILE:
            if chosen.pop(group, None) is not None:
                notes.append(f"{group}: leaves with --compile (liger-kernel replaces it)")
    for row in chosen.values():
        flags = [f for f in flags if f not in row.drops] + list(row.adds)
    return Combination(base.batch, tuple(flags), tuple(notes))


def schedule(
    rows: Sequence[Row], seconds: float, *, device: str = "cuda"
) -> list[tuple[Row, float | None, str]]:
    """What the kit decides when every row takes exactly its estimate: each row, the second it
    starts (None: skipped) and why it is skipped ("" when it runs). The setup comes first;
    attention rows that repeat their reference's kernel are taken to run."""
    budget = Budget(seconds)
    statics = {r.name: static_skip(r, device=device) for r in rows}
    clock, written = SETUP_S, set[str]()
    out: list[tuple[Row, float | None, str]] = []
    for index, row in enumerate(rows):
        later = [r for r in rows[index + 1 :] if not statics[r.name]]
        reason = statics[row.name] or budget.skip_reason(row, later, elapsed=clock, written=written)
        if reason:
            out.append((row, None, reason))
            continue
        clock += weights_s(set(row.roles) - written)
        written |= set(row.roles)
        out.append((row, clock, ""))
        clock += row.estimate_s
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python bench/gpu_rows.py [--quick] [--only ROWS] [--budget S]`: the rows in order with
    their estimates and what a call of that budget runs, by the estimates."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S)
    args = parser.parse_args(argv)
    rows = select_rows(ROWS, quick=args.quick, only=args.only)
    print("| # | row | priority | estimate s | starts at s | |")
    print("|---:|---|---:|---:|---:|---|")
    end = SETUP_S
    for number, (row, start, reason) in enumerate(schedule(rows, args.budget), 1):
        when = "-" if start is None else f"{start:.0f}"
        print(f"| {number} | {row.name} | {row.priority} | {row.estimate_s:.0f} | {when} | "
              f"{reason or 'runs'} |")  # fmt: skip
        if start is not None:
            end = start + row.estimate_s
    print(f"\nsetup {SETUP_S:.0f} s, weights {SMALL_WEIGHTS_S:.0f} s (1.1B) and "
          f"{LARGE_WEIGHTS_S:.0f} s (8B) when first needed; the call ends at about {end:.0f} s "
          f"of its {args.budget:.0f}; every row: {estimate_s(rows):.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
