"""GPU validation kit (`make gpu-check`): run the CUDA paths for real and measure them.

On one lent GPU from a fresh copy of the tree (docs/gpu-check.md has the exact device call), or
on a cluster's GPU node:

    python3 bench/gpu_check.py --wheels .whl --output $OUT          # the prepared call, ~9 min
    python3 bench/gpu_check.py --wheels .whl --output $OUT --quick  # the 5 most promising levers
    python3 bench/gpu_check.py --only 8b-lora-4k,8b-lora-auto --output DIR   # chosen rows
    python bench/gpu_check.py                                       # make gpu-check (cluster node)
    python bench/gpu_check.py --allow-cpu --shapes tiny --budget 0 --output DIR   # CPU dry run
    python bench/gpu_check.py --predict h200 --output DIR           # the predictions alone, here

1. `--wheels DIR`: installs the carried wheels this Python lacks into `--site` (bench/device_stack.py
   decides which), then runs again with them first on PYTHONPATH; then checks the versions with
   the toolkit's own check (`python -m fsdp_utils.versions`) and stops there if it fails.
2. Builds Llama-architecture models with random weights (safetensors, a chess tokenizer, a few
   thousand random legal games): the 1.1B shape (TinyLlama's) and the 8B one (Llama 3's); times
   a bare matrix product on the GPU (what the profile's matrix products are measured against).
3. Runs the rows of bench/gpu_rows.py in order (issue 63's: the quick rows, the 1.1B step
   profiled, issue 60's A/B rows, the best combination, `--auto`'s choices, GRPO and
   distillation, the first call's rows), each a real command of the toolkit (`chess_finetune.py`,
   `python -m fsdp_utils.evaluate`) or a probe. Before a training row starts, the memory
   planner's peak and the step-time model's tokens/s for exactly that configuration (planned
   on the CPU beside the runs) are written into the results; then the row runs: tokens/s per GPU
   and MFU (the last 15 of 25 steps timed, or medians), peak allocated and reserved CUDA memory
   and the peak nvidia-smi memory.used, each against its prediction. `--budget` seconds in all
   (550 by default): a row starts only when it and the more important rows after it still fit
   by their estimates, else it is skipped and says so; each row has a time limit of its own.
4. Writes into `--output` after every row: gpu_check.json (everything), gpu_check.md (the
   tables), gpu_check.log (this output), versions.txt (the versions found, the wheels installed),
   logs.tar.gz (each run's log, metrics.jsonl and plan) and the profiled rows' Chrome traces
   (profile-<row>.trace.json.gz): at most 8 files, what a device call brings back.

Without a CUDA device it prints one line and exits 2. `--allow-cpu --shapes tiny` runs the same
rows on CPU (gloo) with a tiny model and short sequences, every lever in its CPU form (float8 in
torchao's emulation, compile through aot_eager): that is how its logic is tested.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import gzip
import io
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for _path in (str(REPO), str(BENCH)):  # the device runs the checkout, not an installed package
    if _path not in sys.path:
        sys.path.insert(0, _path)

import gpu_rows  # noqa: E402
from gpu_rows import (  # noqa: E402  (the rows: what to measure, what it costs, what first)
    AC,
    BF16,
    GRPO,
    GRPO_COMPLETION,
    LORA,
    NF4_ELEMENTS,
    QLORA,
    ROWS,
    SHAPES,
    TINY_SEQ_DIVISOR,
    Budget,
    Row,
    Shape,
    best_combination,
    estimate_s,
    gain,
    nf4_holds,
    scaled,
    select_rows,
    static_skip,
)

from fsdp_utils.atomic import file_written_atomically, write_text_atomic  # noqa: E402  (the standard library's alone)

__all__ = [  # what the tests and bench/speed_rows.py read from the kit
    "AC",
    "BF16",
    "GRPO",
    "GRPO_COMPLETION",
    "LORA",
    "NF4_ELEMENTS",
    "QLORA",
    "ROWS",
    "SHAPES",
    "TINY_SEQ_DIVISOR",
    "Budget",
    "Row",
    "Shape",
    "best_combination",
    "estimate_s",
    "gain",
    "gpu_rows",
    "nf4_holds",
    "scaled",
    "select_rows",
    "static_skip",
]  # fmt: skip

EXIT_NO_GPU = 2
GIB = 1024**3
DEFAULT_BUDGET_S = gpu_rows.DEFAULT_BUDGET_S  # of the prepared call's timeout_s 570, 20 s kept
STARTED_ENV = "GPU_CHECK_STARTED"  # the first start's clock, kept across the re-run with wheels
EVAL_TASK = "arc_easy"
EVAL_DOCUMENTS = 400  # 1,600 requests (four answers each) on a GPU
PLANNED_KINDS = ("train", "best", "grpo", "distill")  # the planner's prediction before each
MEASURED_KINDS = (*PLANNED_KINDS, "auto")  # tokens/s against a prediction
COMPILE_CACHE = "compile-cache"  # in the work folder; per attention kernel (compile_cache)
PLAN_WAIT_S = 120.0  # the longest a row waits for its prediction (a 1.1B plan: 9-14 s)
# What a device call brings back: 8 files of at most 16 MiB; the five result files and one
# trace per profiled row (two rows).
TRACE_MAX_BYTES = 15 * 1024**2
# The bare matrix product the profile's are measured against (KINDS.md: 769-798 TFLOP/s for
# bf16 8192^3 on the lent H200s); a CPU's: fp32 1024^3.
BARE_MATMUL = {"cuda": (8192, "bfloat16"), "cpu": (1024, "float32")}


def model_config(shape: Shape, tokenizer: Any, seq_length: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=max(shape.vocab, len(tokenizer)),
        max_position_embeddings=max(4096, seq_length),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def write_config_only(folder: Path, shape: Shape, tokenizer: Any, seq_length: int) -> Path:
    """config.json + tokenizer without weights: all the planner reads."""
    folder.mkdir(parents=True, exist_ok=True)
    model_config(shape, tokenizer, seq_length).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_model(folder: Path, shape: Shape, tokenizer: Any, seq_length: int, device: str) -> Path:
    """Random bf16 weights (initialised on the GPU: an 8B init on the host takes minutes)."""
    import torch
    from transformers import AutoModelForCausalLM

    if (folder / "model.safetensors.index.json").is_file() or (
        folder / "model.safetensors"
    ).is_file():
        return folder
    torch.manual_seed(0)
    config = model_config(shape, tokenizer, seq_length)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def build_data(folder: Path, games: int) -> tuple[Path, Any]:
    from fsdp_utils.synthetic import (
        iter_rendered,
        random_games,
        train_chess_tokenizer,
        write_chess_shards,
    )

    played = random_games(games, seed=0)
    write_chess_shards(played, folder / "data", num_shards=1)
    tokenizer = train_chess_tokenizer(list(iter_rendered(played)), vocab_size=512)
    return folder / "data", tokenizer


def build_prompts(games: Path, out: Path) -> Path:
    """The GRPO row's prompts: positions of the games after at most 8 plies (short enough for
    the dry run's 64 tokens), in the default template (fsdp_utils.chess_eval.prompt_set)."""
    from fsdp_utils.chess_eval.prompt_set import positions, read_games
    from fsdp_utils.config.train_config import DEFAULT_TEMPLATE

    rows = positions(read_games(games), template=DEFAULT_TEMPLATE, per_game=2, seed=0, max_plies=8)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


class MemoryWatch:
    """Peak nvidia-smi memory.used (MiB) per GPU while a run goes: what the job really takes,
    CUDA context and NCCL buffers included, which torch's allocator statistics cannot see."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.peak_mib: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.available = shutil.which("nvidia-smi") is not None

    def __enter__(self) -> MemoryWatch:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.available:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            out = _smi("--query-gpu=index,memory.used")
            for line in out.splitlines():
                cells = [c.strip() for c in line.split(",")]
                try:
                    index, used = int(cells[0]), float(cells[1])
                except (IndexError, ValueError):
                    continue
                self.peak_mib[index] = max(self.peak_mib.get(index, 0.0), used)
            self._stop.wait(self.interval)


def _smi(query: str) -> str:
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        return subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def run_records(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl through the project's one reader; [] for a run that never started."""
    from fsdp_utils.metrics.logger import read_metrics

    try:
        return read_metrics(run_dir)
    except ValueError:
        return []


def summarize(
    records: list[dict[str, Any]], *, warmup: int = 3, timed_steps: int = 0, gpus: int = 1
) -> dict[str, Any]:
    """Throughput and memory of a run from its metrics.jsonl. With `timed_steps`, tokens/s over
    the last that many steps, from the log records' wall-clock `time` and `tokens_seen` at both
    ends (what a step costs, read-backs of the logged steps included; compilation and the
    profiled step fall before it), MFU at the same rate, and the tokens/s of each log interval
    inside (`interval_tokens_per_s`: the spread); otherwise medians over the steps after
    `warmup` (the first call's rule). Peaks over all steps (memory_snapshot resets the CUDA
    peak at every log)."""
    train = [r for r in records if r.get("kind") == "train"]
    steady = train[warmup:] or train
    out: dict[str, Any] = {"steps_logged": len(train)}

    def median(key: str) -> float | None:
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    def peak(key: str) -> float | None:
        values = [r[key] for r in train if r.get(key) is not None]
        return max(values) if values else None

    out["tokens_per_s_per_gpu"] = median("tokens_per_s_per_device")
    out["mfu_pct"] = median("mfu_pct")
    out["step_time_s"] = median("step_time_s")
    window = _timed_window(train, timed_steps)
    if window:
        first, last = window[0], window[-1]
        seconds = last["time"] - first["time"]
        per_gpu = (last["tokens_seen"] - first["tokens_seen"]) / seconds / gpus
        rates = [r for r in train if r.get("mfu_pct") and r.get("tokens_per_s_per_device")]
        out["timed"] = {"from_step": first["step"], "to_step": last["step"], "seconds": seconds}
        out["tokens_per_s_per_gpu"] = per_gpu
        out["mfu_pct"] = (
            per_gpu * rates[0]["mfu_pct"] / rates[0]["tokens_per_s_per_device"] if rates else None
        )
        out["step_time_s"] = seconds / (last["step"] - first["step"])
        out["interval_tokens_per_s"] = [
            (b["tokens_seen"] - a["tokens_seen"]) / (b["time"] - a["time"]) / gpus
            for a, b in itertools.pairwise(window)
            if b["time"] > a["time"]
        ]
    out["peak_allocated_gib"] = peak("cuda_peak_allocated_gib")
    out["peak_reserved_gib"] = peak("cuda_peak_reserved_gib")
    out["final_loss"] = train[-1]["loss"] if train else None
    saves = [r["seconds"] for r in records if r.get("kind") == "checkpoint"]
    loads = [r for r in records if r.get("kind") == "resumed"]
    out["checkpoint_save_s"] = max(saves) if saves else None
    out["resumed"] = bool(loads)
    finals = [r for r in records if r.get("kind") == "final_model"]
    out["final_model"] = finals[-1].get("path") if finals else None
    out["export_s"] = finals[-1].get("seconds") if finals else None
    kernels = [r for r in records if r.get("kind") == "attention_kernels"]
    if kernels:  # the SDPA kernel(s) torch ran (fsdp_utils/metrics/profile.py)
        out["attention_kernels"] = sorted(kernels[-1].get("kernels", {}))
    compiles = [r for r in records if r.get("kind") == "compile"]
    if compiles:  # graphs, graph breaks, recompiles (--compile's log)
        keep = ("graphs", "graph_breaks", "eager_frames", "recompiles", "scope")
        out["compile"] = {k: compiles[-1].get(k) for k in keep}
    return out


def _timed_window(train: list[dict[str, Any]], timed_steps: int) -> list[dict[str, Any]]:
    """The log records from the one that ends the step before the last `timed_steps` to the
    last ([] when the run logged too few, or without times)."""
    if not timed_steps or not train:
        return []
    start = train[-1]["step"] - timed_steps
    window = [r for r in train if r["step"] >= start]
    if len(window) < 2 or window[0]["step"] != start:
        return []
    if any(r.get("time") is None or r.get("tokens_seen") is None for r in window):
        return []
    return window if window[-1]["time"] > window[0]["time"] else []


def prediction_of(plan: dict[str, Any] | None) -> dict[str, Any]:
    """The planner's answer for a row, as the results keep it: the peak and what the run needs
    with its margin (GiB), and the step-time model's tokens/s per GPU, step and MFU; or the
    reason there is none."""
    if plan is None:
        return {"error": f"the planner had not answered in {PLAN_WAIT_S:.0f} s"}
    if "error" in plan:
        return {"error": plan["error"]}
    step = plan.get("step_time") or {}
    mfu = step.get("mfu")
    return {
        "peak_gib": plan["peak_bytes"] / GIB,
        "required_gib": plan["required_bytes"] / GIB,
        "fits": plan.get("fits"),
        "tokens_per_s_per_gpu": step.get("tokens_per_s_per_gpu"),
        "step_s": step.get("step_seconds"),
        "mfu_pct": 100.0 * mfu if mfu is not None else None,
        "terms_s": step.get("terms"),
        "speed_basis": plan.get("speed_basis")
        or "no step-time prediction (a GPU kind the model has no figures for)",
    }


def auto_prediction(answer: dict[str, Any] | None) -> dict[str, Any]:
    """An `*-auto` row's prediction: --auto's choice (its flags, predicted tokens/s, step and
    peak), and the planner's plan of exactly the chosen configuration (its peak)."""
    if answer is None:
        return {"error": f"--auto had not answered in {PLAN_WAIT_S:.0f} s"}
    choice = answer.get("choice") or {}
    if "error" in choice or not choice.get("flags"):
        return {"error": f"--auto: {choice.get('error', 'no choice')}"}
    predicted = choice["predicted"]
    planned = prediction_of(answer.get("plan"))
    return {
        **planned,
        "flags": choice["flags"],
        "tokens_per_s_per_gpu": predicted["tokens_per_s_per_gpu"],
        "step_s": predicted["step_seconds"],
        "mfu_pct": 100.0 * predicted["mfu"],
        "auto_peak_gib": predicted["peak_bytes"] / GIB,
        "auto_required_gib": predicted["required_bytes"] / GIB,
        "terms_s": predicted.get("terms"),
    }


def against_prediction(entry: dict[str, Any]) -> dict[str, float | None]:
    """The measurement over the prediction: tokens/s (less one: the prediction's error) and
    the memory ratios of the first call's table."""
    predicted = entry.get("prediction") or {}
    planned = predicted.get("peak_gib")
    required = predicted.get("required_gib")
    tokens = ratio(entry.get("tokens_per_s_per_gpu"), predicted.get("tokens_per_s_per_gpu"))
    return {
        "planned_peak_gib": planned,
        "planned_required_gib": required,
        "predicted_tokens_error": tokens - 1.0 if tokens is not None else None,
        "allocated_over_plan": ratio(entry.get("peak_allocated_gib"), planned),
        "reserved_over_plan": ratio(entry.get("peak_reserved_gib"), planned),
        "used_over_required": ratio(entry.get("smi_peak_gib"), required),
    }


def exact_plan(flags: list[str]) -> bool:
    """Whether the planner traces what the row runs: it plans --compile, liger-kernel and float8
    as the eager layers and the direct path as FSDP2 (fsdp_utils/plan/estimate.py), the safe
    side; the allocator's share is refitted on the exact rows only."""
    inexact = {"--compile", "--liger_kernels", "--float8", "direct"}
    return not inexact & set(flags)


def profile_entry(
    run_dir: Path, row_name: str, bare: dict[str, Any] | None, output: Path
) -> dict[str, Any]:
    """The profiled step of a run (`--profile_steps`): device time by bucket, idle time, host
    syncs and reads, the matrix products' TFLOP/s against the bare product
    (fsdp_utils/metrics/step_profile.py, as bench/profile_step.py --buckets prints it), and its
    Chrome trace copied into the results (gzipped; cut to the step's events if still larger
    than a device call brings back)."""
    from fsdp_utils.metrics.step_profile import breakdown, describe, read_trace, trim

    traces = sorted((run_dir / "profile").glob("rank0.*.pt.trace.json"))
    if not traces:
        return {"error": "no trace written"}
    trace = read_trace(traces[-1])
    result = breakdown(trace)
    tflops = (bare or {}).get("tflops")
    out: dict[str, Any] = {
        **result.to_dict(),
        "bare_matmul": bare,
        "matmul_of_bare": ratio(result.matmul_tflops, tflops),
        "table": describe(result, bare_tflops=tflops),
    }
    target = output / f"profile-{row_name}.trace.json.gz"
    with (
        file_written_atomically(target) as tmp,
        traces[-1].open("rb") as source,
        gzip.open(tmp, "wb", compresslevel=4) as file,
    ):
        shutil.copyfileobj(source, file)  # as torch wrote it (not gzipped: the trainer's)
    if target.stat().st_size > TRACE_MAX_BYTES:
        with file_written_atomically(target) as tmp, gzip.open(tmp, "wt", compresslevel=9) as file:
            json.dump(trim(trace), file)
        out["trace_trimmed"] = True
    if target.stat().st_size > TRACE_MAX_BYTES:
        target.unlink()
        out["trace"] = None
        out["trace_note"] = "over the 15 MiB a device call brings back, even cut to the step"
    else:
        out["trace"] = target.name
    return out


def bare_matmul(device: str) -> dict[str, Any]:
    """TFLOP/s of a bare matrix product on `device` (bench/profile_step.py's, 3 warm-ups)."""
    from profile_step import bare_matmul_tflops

    size, dtype = BARE_MATMUL[device]
    return {
        "size": size,
        "dtype": dtype,
        "tflops": bare_matmul_tflops(device, dtype, size, repeats=20, warmups=3),
    }


def resume_seconds(log_text: str) -> float | None:
    """`checkpoint: resumed from step N (...) in 1.2s`: the load time the trainer logs. From the
    log line, not the `resumed` record: that record's step precedes the trackers' current step,
    so a number there could not become a W&B scalar."""
    import re

    match = re.search(r"checkpoint: resumed from step \d+ .* in ([0-9.]+)s", log_text)
    return float(match.group(1)) if match else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def margin_suggestion(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """What the planner's margin (fsdp_utils.plan.report.Margin) should be, from the measured
    runs: the allocator's share is reserved over allocated peak, the runtime part is what
    nvidia-smi saw beyond torch's reserved memory (CUDA context, cuBLAS workspaces, NCCL).
    `fitted_fraction`: the allocator share that brings the planner's reserved peak (its
    predicted peak x (1 + share)) nearest to every measured one, the largest relative miss
    being `fitted_error`: the margin the planner uses is this one, not the largest share,
    since a caching allocator with room to spare keeps blocks it would free under pressure."""
    fractions = [
        r["peak_reserved_gib"] / r["peak_allocated_gib"] - 1.0
        for r in rows
        if r.get("peak_reserved_gib") and r.get("peak_allocated_gib")
    ]
    runtime = [
        r["smi_peak_gib"] - r["peak_reserved_gib"]
        for r in rows
        if r.get("smi_peak_gib") and r.get("peak_reserved_gib")
    ]
    if not fractions or not runtime:
        return None
    suggestion = {
        "allocator_fraction": max(fractions),
        "runtime_gib": max(runtime),
        "runs": float(len(fractions)),
    }
    planned = [
        (r["planned_peak_gib"], r["peak_reserved_gib"])
        for r in rows
        if r.get("planned_peak_gib") and r.get("peak_reserved_gib")
    ]
    if planned:

        def worst(share: float) -> float:
            return max(abs(plan * (1 + share) - got) / got for plan, got in planned)

        fitted = min((i / 200 for i in range(101)), key=worst)  # 0 to 50% by 0.5%
        suggestion.update(fitted_fraction=fitted, fitted_error=worst(fitted))
    return suggestion


def parameters(count: float) -> str:
    """1.10B, 0.14M: the table's model sizes."""
    return f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def render_table(result: dict[str, Any]) -> str:
    """The markdown to paste into docs/gpu-check.md: the training rows, each measured against
    the prediction written before it ran; the A/B rows against their references; the best
    combination and --auto's choices; the profiled steps; one line for each other row; the
    planner's margin refitted."""
    fmt = _fmt
    env = result.get("environment", {})
    lines = [
        f"GPU: {result['gpu']} x {result['gpus']}, driver {env.get('driver', '-')}; torch "
        f"{result['torch']}, transformers {env.get('transformers', '-')}; "
        f"{result.get('seconds', 0):.0f} s in all",
        "",
        "| row | model | seq x batch | tokens/s/GPU | predicted | error | MFU % | peak alloc GiB "
        "| peak reserved GiB | nvidia-smi GiB | planner peak GiB | alloc/plan | reserved/plan "
        "| used/required |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    others, levers, rows = [], [], result["rows"]
    by_name = {r["name"]: r for r in rows}
    for row in rows:
        status = row.get("status", "ok")
        if status != "ok":
            others.append(
                f"- {row['name']}: {status}{': ' + row['reason'] if row.get('reason') else ''}"
            )
            continue
        if row["kind"] not in MEASURED_KINDS:
            others.append(f"- {row['name']}: {row.get('summary', 'ok')}")
            continue
        predicted = (row.get("prediction") or {}).get("tokens_per_s_per_gpu")
        batch = (
            row["batch"]
            if row.get("total", row["batch"]) == row["batch"]
            else (f"{row['batch']} (of {row['total']})")
        )
        lines.append(
            f"| {row['name']} | {row['shape']} ({parameters(row['parameters'])}) "
            f"| {row['seq']} x {batch} "
            f"| {fmt(row.get('tokens_per_s_per_gpu'), ',.0f')} | {fmt(predicted, ',.0f')} "
            f"| {_pct(row.get('predicted_tokens_error'))} | {fmt(row.get('mfu_pct'), '.1f')} "
            f"| {fmt(row.get('peak_allocated_gib'), '.2f')} "
            f"| {fmt(row.get('peak_reserved_gib'), '.2f')} "
            f"| {fmt(row.get('smi_peak_gib'), '.2f')} | {fmt(row.get('planned_peak_gib'), '.2f')} "
            f"| {fmt(row.get('allocated_over_plan'), '.3f')} "
            f"| {fmt(row.get('reserved_over_plan'), '.3f')} "
            f"| {fmt(row.get('used_over_required'), '.3f')} |"
        )
        if row.get("summary"):
            others.append(f"- {row['name']}: {row['summary']}")
        if row.get("ref") and row.get("lever") and by_name.get(row["ref"]):
            spread = row.get("interval_tokens_per_s") or []
            levers.append(
                f"| {row['name']} | {row['lever']} | {' '.join(row.get('adds', [])) or '-'} "
                f"| {row['ref']} | {fmt(by_name[row['ref']].get('tokens_per_s_per_gpu'), ',.0f')} "
                f"| {fmt(row.get('tokens_per_s_per_gpu'), ',.0f')} | {_pct(row.get('gain'))} "
                f"| {', '.join(f'{v:,.0f}' for v in spread) or '-'} |"
            )
    if levers:
        lines += [
            "",
            "| A/B row | lever | flags changed | against | its tokens/s | tokens/s | gain "
            "| per log interval |",
            "|---|---|---|---|---:|---:|---:|---|",
            *levers,
        ]
    lines += _choices(result, by_name)
    for row in rows:
        profile = row.get("profile")
        if row.get("status") == "ok" and profile and "table" in profile:
            trace = profile.get("trace") or profile.get("trace_note", "no trace")
            lines += ["", f"Profiled step of {row['name']} (trace: {trace}):", "", profile["table"]]
    lines += ["", *others]
    margin = result.get("margin_suggestion")
    if margin:
        lines += [
            "",
            f"planner margin from these runs: allocator +{margin['allocator_fraction']:.1%} "
            f"(reserved over allocated), runtime {margin['runtime_gib']:.2f} GiB "
            "(nvidia-smi over reserved)",
        ]
        if "fitted_fraction" in margin:
            lines.append(
                f"the allocator share nearest every reserved peak: "
                f"+{margin['fitted_fraction']:.1%} (planned x (1 + share) within "
                f"{margin['fitted_error']:.1%} of each)"
            )
    return "\n".join(lines) + "\n"


def _choices(result: dict[str, Any], by_name: dict[str, dict[str, Any]]) -> list[str]:
    """The best combination and --auto's choices, against the goals of issue 63."""
    lines: list[str] = []
    best = by_name.get("1b-best")
    if best and best.get("combination"):
        lines += ["", f"Best combination ({best.get('status', '-')}): `{' '.join(best['flags'])}` "
                  f"at micro-batch {best['batch']}"]  # fmt: skip
        lines += [f"- {note}" for note in best["combination"]]
        if best.get("status") == "ok":
            mfu = best.get("mfu_pct")
            goal = "met" if mfu is not None and mfu >= 40 else "not met"
            lines.append(f"- MFU {_fmt(mfu, '.1f')}% (goal 40%: {goal})")
    for row in by_name.values():
        if row.get("kind") != "auto" or row.get("status") != "ok":
            continue
        flags = (row.get("prediction") or {}).get("flags", "-")
        against = result.get("auto_against", {}).get(row["name"], {})
        lines += [
            "",
            f"{row['name']}: --auto chose `{flags}`: {_fmt(row.get('tokens_per_s_per_gpu'), ',.0f')} "
            f"tokens/s per GPU, predicted {_fmt(row['prediction'].get('tokens_per_s_per_gpu'), ',.0f')} "
            f"({_pct(row.get('predicted_tokens_error'))}); the best hand row "
            f"{against.get('best_hand', '-')}: {_fmt(against.get('best_hand_tokens_per_s'), ',.0f')} "
            f"({_pct(against.get('auto_over_best_hand'))}: goal at least as fast)",
        ]
    return lines


class Tee(io.TextIOBase):
    """This process's output to the terminal and to gpu_check.log as it goes."""

    def __init__(self, stream: TextIO, path: Path) -> None:
        self.stream = stream
        self.file = path.open("a", encoding="utf-8")

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.file.write(text)
        self.stream.flush()
        self.file.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()


def run_process(
    command: list[str],
    *,
    env: dict[str, str],
    timeout: float,
    log: Path,
    errors: Path | None = None,
) -> int:
    """`command` in its own process group, killed whole at `timeout`: its exit code, 124 for a
    timeout (as `timeout(1)` says it). Its output goes to `log` as it runs (a command cut off
    leaves what it printed), its errors to `errors` or there too. Every process the kit starts
    starts here: the CPU test (tests/test_gpu_check.py) swaps it for its forking launcher."""
    with contextlib.ExitStack() as files:
        out = files.enter_context(log.open("w"))
        err = files.enter_context(errors.open("w")) if errors else subprocess.STDOUT
        with STARTING:  # started and in LIVE before Kit.shutdown looks, or never started
            if STOPPING.is_set():
                out.write("gpu-check: not started: the kit is shutting down\n")
                return 124
            process = subprocess.Popen(
                command, stdout=out, stderr=err, env=env, cwd=REPO, start_new_session=True
            )
            LIVE.add(process)
        try:
            return process.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            stop_group(process)
            return 124
        finally:
            LIVE.discard(process)


LIVE: set[subprocess.Popen[bytes]] = set()  # run_process's commands still running
# Kit.shutdown sets STOPPING: a planner thread still running after it (an --auto choice about to
# plan its configuration) starts nothing the interpreter's exit would then wait for.
STOPPING = threading.Event()
STARTING = threading.Lock()


def sdpa_backend(command: list[str]) -> str:
    """The `--sdpa_backend` a command asks for (the last one given; "auto" without one)."""
    backend = "auto"
    for flag, value in itertools.pairwise(command):
        if flag == "--sdpa_backend":
            backend = value
    return backend


def compile_cache(work: Path, command: list[str]) -> Path:
    """The command's compile cache: the shared one, or `sdpa-<backend>` inside it for a run
    restricted to one attention kernel. torch's compile-cache keys leave the SDPA backend
    setting out (pytorch #185449): a flash-only run would otherwise load the graphs a default
    run compiled, and run their kernel (cuDNN's, say) under the flash row's name."""
    backend = sdpa_backend(command)
    folder = work / COMPILE_CACHE
    return folder if backend == "auto" else folder / f"sdpa-{backend}"


def kernel_mismatch(asked: str, ran: list[str]) -> str | None:
    """Why a row's measurement is not its attention kernel's (None: it is, or the run asked
    for none): the kernels its log names (`attention_kernels`; "flash (CPU)" is flash) against
    `--sdpa_backend`."""
    kernels = sorted({kernel.split(" (")[0] for kernel in ran})
    if asked == "auto" or kernels == [asked]:
        return None
    return f"--sdpa_backend {asked}, but the run ran {' and '.join(kernels)}: not {asked}'s figure"


def stop_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


class Kit:
    """The rows' commands, run one after another on the GPU(s), the planner beside them."""

    def __init__(
        self, args: argparse.Namespace, work: Path, device: str, gpus: int, gpu_memory: str
    ) -> None:
        self.args = args
        self.work = work
        self.device = device
        self.gpus = gpus
        self.gpu_memory = gpu_memory  # the planner's --gpu_memory: the GPU's kind where known
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "4",
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "HF_HOME": str(work / "hf"),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(
                p for p in (os.environ.get("PYTHONPATH", ""), str(REPO)) if p
            ),
            # A run that adds its measurement to the site's rows (fsdp_utils/run/speed.py) adds
            # it to a folder of the kit's own (logs.tar.gz), not the one the plans read: each
            # prediction rests on the shipped rows alone, never on a row this call measured
            # before it (docs/plan.md, "--calibrate and the site files").
            "FSDP_UTILS_SITE_DIR": str(work / "site-runs"),
            # One compile cache for the rows of one attention kernel: a row whose graphs an
            # earlier one compiled finds them there (inductor's FX graph and AOTAutograd
            # caches). A row of another --sdpa_backend gets a folder of its own (compile_cache).
            "TORCHINDUCTOR_CACHE_DIR": str(work / COMPILE_CACHE),
        }
        # Each process caches the bytecode of what it imports (the carried wheels come without).
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)
        if device == "cpu":  # the levers' CPU forms (docs/levers.md, "Tested here")
            self.env.setdefault("FSDP_UTILS_COMPILE_BACKEND", "aot_eager")
            self.env.setdefault("FSDP_UTILS_FLOAT8_EMULATE", "1")
        # The planner on the CPU: the GPU stays the runs' (CUDA_VISIBLE_DEVICES empty).
        self.plan_env = {
            **self.env, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "2",
            "FSDP_UTILS_SITE_DIR": str(work / "site-plan"),
        }  # fmt: skip
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        STOPPING.clear()  # a new call (the tests run several in one process)
        self.planner = concurrent.futures.ThreadPoolExecutor(max_workers=3)
        self.urgent = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # planned at run time
        self.plans: dict[str, concurrent.futures.Future[dict[str, Any]]] = {}
        self.final_model: Path | None = None
        self.data = work / "data"  # build_data writes it
        self.prompts = work / "prompts.jsonl"  # build_prompts writes it (the GRPO row)
        self.bare: dict[str, Any] | None = None  # the bare matrix product (with the weights)

    def shutdown(self) -> None:
        """No plan left to start, and the ones running stopped: the call ends when its rows
        do (the interpreter would wait for the planner's threads at exit, and they for their
        commands). No command starts after this (STOPPING), so none is left to wait for."""
        for pool in (self.planner, self.urgent):
            pool.shutdown(wait=False, cancel_futures=True)
        with STARTING:
            STOPPING.set()
            running = list(LIVE)
        for process in running:
            stop_group(process)

    # --- commands -----------------------------------------------------------------------------

    def common_flags(
        self, model: Path, out: Path, row: Row, *, teacher: Path | None = None,
        extra: tuple[str, ...] = (),
    ) -> list[str]:  # fmt: skip
        """The row's training command line (the planner's and --auto's too)."""
        data = self.data
        if row.kind == "grpo":  # its prompts, a completion's share of the sequence
            completion = min(GRPO_COMPLETION, row.seq // 4)
            data = self.prompts
            row = dataclasses.replace(
                row, flags=(*row.flags, "--max_completion_length", str(completion))
            )
        flags = [
            "--model", str(model), "--dataset", str(data), "--dataset_include", "",
            "--data_cache_dir", str(self.work / "prepared"), "--output_dir", str(out),
            "--max_seq_length", str(row.seq),
            "--total_batch_size", str(row.total_batch * self.gpus),
            "--max_training_steps", str(row.steps), "--learning_rate", "1e-4",
            "--warmup_steps", "0", "--eval_every", "0", "--eval_examples", "0",
            "--save_every_minutes", "0", "--log_every", str(row.log_every),
            "--device", self.device,
        ]  # fmt: skip
        if row.batch:  # an *-auto row leaves it to the choice
            flags += ["--batch_size_per_device", str(row.batch)]
        if row.profile_step:
            flags += ["--profile_steps", f"{row.profile_step}:{row.profile_step}"]
        if teacher is not None:
            flags += ["--teacher", str(teacher)]
        return [*flags, *row.flags, *extra]

    def run(self, command: list[str], log: Path, timeout: float) -> tuple[int, str, float]:
        """A command (`run_process`), its output into `log`; (exit code, output, seconds). Its
        compile cache is its attention kernel's (compile_cache)."""
        started = time.perf_counter()
        env = {**self.env, "TORCHINDUCTOR_CACHE_DIR": str(compile_cache(self.work, command))}
        code = run_process(command, env=env, timeout=timeout, log=log)
        return code, log.read_text(errors="replace"), time.perf_counter() - started

    def write_weights(
        self, folder: Path, shape: str, tokenizer_dir: Path, seq: int, timeout: float,
        bare: Path | None = None,
    ) -> tuple[int, str]:  # fmt: skip
        """A model's random weights, written by a process of its own (see parse_args); with
        `bare`, that process (which holds the GPU already) also times the bare product."""
        command = [sys.executable, str(Path(__file__).resolve()), "--probe-write", str(folder)]
        command += ["--probe-shape", shape, "--probe-data", str(tokenizer_dir)]
        command += ["--probe-seq", str(seq), "--probe-device", self.device]
        if bare is not None:
            command += ["--probe-bare", str(bare)]
        code, log, _ = self.run(command, self.logs / f"{folder.name}-weights.log", timeout)
        return code, log

    # --- the predictions, before each row -----------------------------------------------------

    def plan(
        self, model: Path, row: Row, *, teacher: Path | None = None, extra: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """The planner's prediction for exactly this configuration, on the CPU: its JSON (peak,
        required, the step-time model's step), or {"error": why}."""
        flags = self.common_flags(
            model, self.work / "plan-unused", row, teacher=teacher, extra=extra
        )
        command = [sys.executable, "-m", "fsdp_utils.plan", *flags, "--json"]
        command += ["--gpus_per_node", str(self.gpus), "--no_fixes"]
        command += ["--gpu_memory", self.gpu_memory]
        out, err = self.logs / f"{row.name}.plan.json", self.logs / f"{row.name}.plan.log"
        code = run_process(command, env=self.plan_env, timeout=600, log=out, errors=err)
        try:
            return dict(json.loads(out.read_text()))
        except json.JSONDecodeError:
            lines = err.read_text(errors="replace").strip().splitlines() or ["no output"]
            return {"error": f"the planner exited {code}: {lines[-1]}"}

    def auto(self, model: Path, row: Row, *, teacher: Path | None = None) -> dict[str, Any]:
        """--auto's choice for the row's command (fsdp_utils.plan.cli.auto_choice, in a process
        of its own on the CPU), then the plan of exactly the chosen configuration."""
        argv = self.common_flags(model, self.work / "plan-unused", row, teacher=teacher)
        argv += ["--gpus_per_node", str(self.gpus), "--gpu_memory", self.gpu_memory]
        out = self.logs / f"{row.name}.auto.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--probe-auto", str(out)]
        command += ["--probe-argv", json.dumps(argv)]
        log = self.logs / f"{row.name}.auto.log"
        code = run_process(command, env=self.plan_env, timeout=900, log=log)
        try:
            choice = json.loads(out.read_text())
        except (OSError, json.JSONDecodeError):
            tail = log.read_text(errors="replace").strip().splitlines() or ["no output"]
            return {"choice": {"error": f"exit {code}: {tail[-1]}"}}
        if "error" in choice or not choice.get("flags"):
            return {"choice": choice}
        flags = tuple(choice["flags"].split())
        return {"choice": choice, "plan": self.plan(model, row, extra=flags)}

    def plan_later(self, key: str, task: Any, *args: Any, urgent: bool = False, **kw: Any) -> None:
        pool = self.urgent if urgent else self.planner
        self.plans[key] = pool.submit(task, *args, **kw)

    def planned(self, key: str, timeout: float) -> dict[str, Any] | None:
        future = self.plans.get(key)
        if future is None:
            return None
        try:
            return future.result(timeout=max(timeout, 1.0))
        except (concurrent.futures.TimeoutError, subprocess.TimeoutExpired):
            return None

    # --- runs ---------------------------------------------------------------------------------

    def train(
        self, model: Path, out: Path, row: Row, *extra: str, timeout: float,
        teacher: Path | None = None, chosen: tuple[str, ...] = (),
    ) -> tuple[int, str, dict[int, float], float]:  # fmt: skip
        """chess_finetune.py on the row's flags: one process as `python chess_finetune.py` (no
        torchrun agent to start; the run makes its own process group of one), several under
        torchrun."""
        script = [str(REPO / "chess_finetune.py")]
        if self.gpus == 1:
            command = [sys.executable, *script]
        else:
            torchrun = str(Path(sys.executable).with_name("torchrun"))
            if not Path(torchrun).exists():
                torchrun = shutil.which("torchrun") or torchrun
            command = [torchrun, "--standalone", f"--nproc_per_node={self.gpus}", *script]
        command += self.common_flags(model, out, row, teacher=teacher, extra=chosen)
        command += list(extra)
        log = self.logs / f"{out.name}.log"
        with MemoryWatch() as watch:
            code, text, seconds = self.run(command, log, timeout)
        return code, text, watch.peak_mib, seconds

    def train_row(
        self, model: Path, row: Row, timeout: float, *, teacher: Path | None = None,
        chosen: tuple[str, ...] = (),
    ) -> dict[str, Any]:  # fmt: skip
        """One training run: its measurement (summarize), nvidia-smi's peak, the profiled
        step's breakdown when it has one."""
        out = self.work / "runs" / row.name
        code, log, smi, seconds = self.train(
            model, out, row, "--no_final_save", "--resume", "never", timeout=timeout,
            teacher=teacher, chosen=chosen,
        )  # fmt: skip
        result: dict[str, Any] = {"wall_s": seconds}
        (self.logs / f"{row.name}.metrics.jsonl").write_bytes(
            (out / "metrics.jsonl").read_bytes() if (out / "metrics.jsonl").is_file() else b""
        )
        if code != 0 and code != 124:
            return {**result, **failure(code, log)}
        records = run_records(out)
        result.update(summarize(records, timed_steps=row.timed_steps, gpus=self.gpus))
        result["smi_peak_gib"] = max(smi.values()) / 1024 if smi else None
        if code == 124:  # killed at its limit: what it logged so far, never a figure to compare
            steps = [r["step"] for r in records if r.get("kind") == "train"]
            last = f"up to step {steps[-1]} of {row.steps}" if steps else "none"
            return {
                **result, **failure(code, log), "status": "timed out", "partial": True,
                "reason": f"timed out at its limit of {timeout:.0f} s; partial: the records "
                f"{last} summarised (metrics.jsonl in logs.tar.gz)",
            }  # fmt: skip
        asked = sdpa_backend([*row.flags, *chosen])
        if asked != "auto" and not result.get("attention_kernels"):
            result["kernel_check"] = f"--sdpa_backend {asked}: no attention kernel logged to check"
        wrong = kernel_mismatch(asked, result.get("attention_kernels") or [asked])
        if wrong:
            return {**result, "status": "failed", "reason": wrong, "log_tail": log[-3000:]}
        if row.profile_step:
            try:
                result["profile"] = profile_entry(out, row.name, self.bare, self.args.output)
            except Exception as error:  # a trace the reader did not expect: the figures count
                result["profile"] = {
                    "error": f"{type(error).__name__}: {error}",
                    "traceback": traceback.format_exc()[-3000:],
                }
        return result

    def grpo_row(self, model: Path, row: Row, timeout: float) -> dict[str, Any]:
        """GRPO: rollout and update tokens/s (medians after the first step, metrics.jsonl's
        rollout/* and update/*) and the peak memory against the plan of both phases."""
        result = self.train_row(model, row, timeout)
        if result.get("status") == "failed" or "reason" in result:
            return result
        train = [r for r in run_records(self.work / "runs" / row.name) if r.get("kind") == "train"]
        steady = [r for r in train[1:] if "rollout/tokens_per_s" in r] or train

        def median(key: str) -> float | None:
            values = [r[key] for r in steady if r.get(key) is not None]
            return statistics.median(values) if values else None

        plan = self.planned(row.name, timeout=60) or {}
        rollout = plan.get("rollout") or {}
        result.update(
            rollout_tokens_per_s=median("rollout/tokens_per_s"),
            update_tokens_per_s=median("update/tokens_per_s"),
            rollout_s=median("rollout/seconds"),
            update_s=median("update/seconds"),
            planned_rollout_gib=rollout["total"] / GIB if rollout else None,
            planned_update_gib=plan["update_peak_bytes"] / GIB
            if "update_peak_bytes" in plan
            else None,
            dominating_phase=plan.get("dominating_phase"),
        )
        result["summary"] = (
            f"rollout {_fmt(result['rollout_tokens_per_s'], ',.0f')} new tokens/s "
            f"({_fmt(result['rollout_s'], '.2f')} s), update "
            f"{_fmt(result['update_tokens_per_s'], ',.0f')} tokens/s ({_fmt(result['update_s'], '.2f')} s); "
            f"peak alloc {_fmt(result.get('peak_allocated_gib'), '.2f')} GiB against the plan's "
            f"rollout {_fmt(result['planned_rollout_gib'], '.2f')}, update "
            f"{_fmt(result['planned_update_gib'], '.2f')} (the {result['dominating_phase']} dominates)"
        )
        return result

    def checkpoint_row(self, model: Path, row: Row, timeout: float) -> dict[str, Any]:
        """Save at half way (stop as if the time limit came), resume, finish, export."""
        out = self.work / "runs" / row.name
        half = max(1, row.steps // 2)
        stop = ("--save_every_steps", str(half), "--stop_after_steps", str(half))
        started = time.perf_counter()
        code1, log1, _, _ = self.train(model, out, row, *stop, "--resume", "never", timeout=timeout)
        if code1 != 0:
            return failure(code1, log1, "first leg")
        left = timeout - (time.perf_counter() - started)
        code2, log2, _, _ = self.train(model, out, row, "--resume", "auto", timeout=left)
        if code2 != 0:
            return failure(code2, log2, "resumed leg")
        summary = summarize(run_records(out))
        final = summary["final_model"]
        if final and Path(final, "config.json").is_file():
            self.final_model = Path(final)
        result = {
            "wall_s": time.perf_counter() - started,
            "save_s": summary["checkpoint_save_s"],
            "load_s": resume_seconds(log2),
            "export_s": summary["export_s"],
            "resumed": summary["resumed"],
            "final_model": final,
        }
        ok = result["resumed"] and self.final_model is not None
        result["summary"] = (
            f"save {_s(result['save_s'])}, load (resume) {_s(result['load_s'])}, "
            f"HF export {_s(result['export_s'])}; resumed: {result['resumed']}"
        )
        return result if ok else {**result, "status": "failed", "reason": "no resume or export"}

    def masking_row(self, model: Path, row: Row, timeout: float) -> dict[str, Any]:
        """The document-masking probe in a process of its own (its CUDA memory goes with it)."""
        out = self.work / "masking.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--probe-masking", str(out)]
        command += ["--probe-model", str(model), "--probe-data", str(self.data)]
        command += ["--probe-seq", str(row.seq), "--probe-device", self.device]
        command += ["--work", str(self.work)]
        code, log, seconds = self.run(command, self.logs / f"{row.name}.log", timeout)
        if code != 0 or not out.is_file():
            return failure(code, log)
        probe = json.loads(out.read_text())
        result: dict[str, Any] = {"wall_s": seconds, **probe}
        result["summary"] = f"{probe['documents']} documents in {probe['rows']} rows; " + "; ".join(
            f"{c['dtype']} ({c['attention']}): loss {c['loss_packed_vs_alone']:.1e} off, logits "
            f"{c['logits_packed_vs_alone']:.1e} off (unmasked {c['logits_unmasked_vs_alone']:.1e})"
            f" -> {c['verdict']}"
            for c in probe["cases"]
        )
        if any(c["verdict"] == "FAIL" for c in probe["cases"]):
            result.update(status="failed", reason="packed documents see each other")
        return result

    def evaluate_row(self, row: Row, timeout: float) -> dict[str, Any]:
        """`python -m fsdp_utils.evaluate` on the checkpoint row's export, one small task whose
        data is a copy in its Hub layout (tests/lm_eval_data.py) in an offline cache: requests
        per second of the model calls (the sharded model's own log line), and the whole
        command's time (start-up, loading, the batch plan)."""
        if self.final_model is None:
            return {"status": "skipped", "reason": "no export: the checkpoint row did not finish"}
        from tests.lm_eval_data import cache_arc_easy

        cache = self.work / "hf" / "hub"
        documents = EVAL_DOCUMENTS if self.device == "cuda" else 8
        cache_arc_easy(cache, documents)
        out = self.work / "lm_eval"
        command = [sys.executable, "-m", "fsdp_utils.evaluate", "--model", str(self.final_model)]
        command += ["--tasks", EVAL_TASK, "--limit", str(documents), "--cache_dir", str(cache)]
        command += ["--output_dir", str(out), "--bootstrap_iters", "0", "--device", self.device]
        code, log, seconds = self.run(command, self.logs / f"{row.name}.log", timeout)
        if code != 0:
            return failure(code, log)
        requests, model_s = request_times(log)
        results = sorted(out.glob("results_*.json"))
        if not results or not requests:
            return {
                "status": "failed",
                "reason": "no results or no timed requests",
                "log_tail": log[-3000:],
            }
        report = json.loads(results[-1].read_text())
        result = {
            "wall_s": seconds,
            "requests": requests,
            "model_s": model_s,
            "requests_per_s": requests / model_s if model_s else None,
            "accuracy": report["results"].get(EVAL_TASK, {}).get("acc,none"),
        }
        result["summary"] = (
            f"{EVAL_TASK}: {requests} requests in {model_s:.3f} s of model calls "
            f"({_fmt(result['requests_per_s'], ',.0f')} requests/s); the command {seconds:.0f} s"
        )
        return result


def request_times(log: str) -> tuple[int, float]:
    """Requests and seconds of the sharded model's calls, from its log lines
    (`loglikelihood: 400 requests as 400 distinct inputs on 1 rank(s), 1.2s`)."""
    import re

    pattern = (
        r"^(?:loglikelihood|loglikelihood_rolling|generate_until): (\d+) requests .*, ([0-9.]+)s$"
    )
    found = re.findall(pattern, log, flags=re.M)
    return sum(int(n) for n, _ in found), sum(float(s) for _, s in found)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def failure(code: int, log: str, where: str = "") -> dict[str, Any]:
    what = "timed out" if code == 124 else f"exit {code}"
    return {
        "status": "failed",
        "reason": f"{where + ': ' if where else ''}{what}",
        "log_tail": log[-3000:],
    }


# --- the document-masking probe ------------------------------------------------------------------


def masking_probe(model_dir: Path, data: Path, work: Path, seq: int, device: str) -> dict[str, Any]:
    """A packed batch through the trainer's forward (`model_forward`: per-document position ids,
    no mask) against each document run alone, in fp32 and bf16, with the attention the model
    trains with. The logits must agree far better (10x) than those of the same block without
    the position ids (plain causal attention: documents see the ones before them) do, and the
    loss sums within `tolerance`; packed logits as far from the lone ones as the unmasked ones
    are means documents see each other (FAIL)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_utils.config.train_config import TrainConfig
    from fsdp_utils.data.prepare import PreparedData, prepare_dataset
    from fsdp_utils.train.loss import token_loss_sum
    from fsdp_utils.train.step import model_forward

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
    config = TrainConfig(
        model=str(model_dir), dataset=str(data), dataset_include="",
        data_cache_dir=str(work / "prepared"), max_seq_length=seq, eval_examples=0,
    )  # fmt: skip
    prepared = PreparedData.load(prepare_dataset(config, log=lambda _: None))
    rows = 2
    batch = prepared.split("train", document_masking=True).batch(np.arange(rows))
    eos = int(prepared.meta["stats"]["eos_token_id"])
    target = torch.device(device)
    ids, labels = batch["input_ids"].to(target), batch["labels"].to(target)
    cases = []
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        model = model.to(target).eval()
        with torch.no_grad():
            packed = model_forward(model, batch, target, contextlib.nullcontext).logits.float()
            pieces, documents = [], 0
            for row in ids:
                starts = [0, *[int(i) + 1 for i in torch.nonzero(row[:-1] == eos).flatten()]]
                bounds = [*starts, len(row)]
                logits = [
                    model(input_ids=row[None, a:b], use_cache=False).logits[0]
                    for a, b in itertools.pairwise(bounds)
                ]
                pieces.append(torch.cat(logits).float())
                documents += len(logits)
            alone = torch.stack(pieces)
            unmasked = model(input_ids=ids, use_cache=False).logits.float()
            loss_alone = float(token_loss_sum(alone, labels))
            loss_packed = float(token_loss_sum(packed, labels))
        packed_off = float((packed - alone).abs().max())
        unmasked_off = float((unmasked - alone).abs().max())
        like_unmasked = float((packed - unmasked).abs().max())
        loss_off = abs(loss_packed - loss_alone) / abs(loss_alone)
        if documents <= rows:
            verdict = "inconclusive (one document a row: a longer sequence)"
        elif loss_off <= tolerance and 10 * packed_off <= unmasked_off:
            verdict = "pass"
        elif loss_off > tolerance or 10 * like_unmasked <= unmasked_off:
            verdict = "FAIL"
        else:
            verdict = "inconclusive (masking's effect within the rounding)"
        cases.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "attention": model.config._attn_implementation,
                "documents": documents,
                "loss_alone": loss_alone,
                "loss_packed_vs_alone": loss_off,
                "logits_packed_vs_alone": packed_off,
                "logits_unmasked_vs_alone": unmasked_off,
                "tolerance": tolerance,
                "verdict": verdict,
            }
        )
        del model, packed, alone, unmasked, pieces
        if target.type == "cuda":
            torch.cuda.empty_cache()
    return {"seq": seq, "rows": rows, "documents": cases[0]["documents"], "cases": cases}


# --- the whole run -------------------------------------------------------------------------------


class Report:
    """gpu_check.json, gpu_check.md and logs.tar.gz, rewritten after every row, so that a call
    cut off at its time limit still brings back what it measured."""

    def __init__(self, output: Path, logs: Path, result: dict[str, Any]) -> None:
        self.output, self.logs, self.result = output, logs, result

    def write(self, started: float) -> None:
        """Each file written whole or not at all (a temporary file renamed over it): a call
        killed at its timeout in the middle of a write brings back the previous whole one."""
        self.result["seconds"] = time.time() - started
        text = json.dumps(self.result, indent=2, default=str)
        write_text_atomic(self.output / "gpu_check.json", text)
        write_text_atomic(self.output / "gpu_check.md", render(self.result))
        # the runs' own rows for the step-time model (FSDP_UTILS_SITE_DIR: Kit's environment)
        runs = self.logs.parent / "site-runs" / "runs.jsonl"
        with (
            file_written_atomically(self.output / "logs.tar.gz") as tmp,
            tarfile.open(tmp, "w:gz") as archive,
        ):
            for path in sorted(self.logs.glob("*")):
                archive.add(path, arcname=f"logs/{path.name}")
            if runs.is_file():
                archive.add(runs, arcname="logs/site-runs.jsonl")


def render(result: dict[str, Any]) -> str:
    """render_table, or why it could not be drawn: the results file still holds every row."""
    try:
        return render_table(result)
    except Exception:
        return f"The table could not be drawn (gpu_check.json holds every row):\n\n```\n{traceback.format_exc()}```\n"


def install_wheels(args: argparse.Namespace, started: float) -> None:
    """Install the carried wheels this Python lacks, then run this script again with them first
    on PYTHONPATH (so that this process and every command it starts import the same versions)."""
    import device_stack

    lines = device_stack.install(args.wheels, args.site)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "versions.txt").write_text("\n".join(["# carried wheels", *lines, ""]))
    print("\n".join(lines), flush=True)
    env = {**os.environ, STARTED_ENV: repr(started)}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(args.site), str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    argv = [a for a in sys.argv[1:]]
    index = argv.index("--wheels")
    del argv[index : index + 2]
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)


def check_versions(output: Path, env: dict[str, str]) -> tuple[int, str]:
    """The toolkit's own start-up check, as every command runs it; its table into versions.txt."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        log = Path(folder, "versions.log")
        code = run_process(
            [sys.executable, "-m", "fsdp_utils.versions"], env=env, timeout=600, log=log
        )
        text = log.read_text(errors="replace")
    with (output / "versions.txt").open("a") as file:
        file.write(f"# python -m fsdp_utils.versions (exit {code})\n{text}")
    return code, text


def cuda_devices() -> tuple[int, str, str]:
    """(count, name, memory of the first) of the visible GPUs, from nvidia-smi where it answers:
    asking torch would start a CUDA context in this process, which nvidia-smi would then count
    in every run's memory."""
    lines = _smi("--query-gpu=name,memory.total").strip().splitlines()
    if lines:
        name, mib = (c.strip() for c in lines[0].split(","))
        return len(lines), name, f"{mib}MiB"
    import torch

    properties = torch.cuda.get_device_properties(0)
    return torch.cuda.device_count(), properties.name, f"{properties.total_memory}B"


def environment(device: str) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "transformers_path": str(Path(transformers.__file__).parent),
    }
    smi = _smi("--query-gpu=name,driver_version,memory.total").strip().splitlines()
    if smi:
        name, driver, memory = (c.strip() for c in smi[0].split(","))
        info.update(driver=driver, smi_gpu=name, smi_memory_mib=memory)
    return info


def gpu_kind(name: str, memory: str) -> str:
    """The planner's --gpu_memory for this GPU: its kind (h200, h100-80gb, ...) where the
    step-time model has figures for it, so that every plan predicts tokens/s too; else its size."""
    from fsdp_utils.plan.hardware import Gpu, parse_size, spec_key

    try:
        size = parse_size(memory, "--gpu-memory")
    except ValueError:
        return memory
    return spec_key(Gpu(name, size)) or memory


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "gpu_check")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: temp)")
    parser.add_argument("--wheels", type=Path, help="carried wheels to install first (.whl)")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"), help="where they go")
    parser.add_argument("--quick", action="store_true",
                        help="the A/B base, the 5 most promising levers, their best combination")  # fmt: skip
    parser.add_argument("--only", default="", help="comma-separated row names (see ROWS)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds in all, from the first start (0: no limit)")  # fmt: skip
    parser.add_argument("--games", type=int, default=800, help="random games for the data")
    parser.add_argument(
        "--shapes",
        default="1b,8b",
        help="the small and large shapes (tiny, 1b, 3b, 8b, 13b); 'tiny' alone for the dry run",
    )
    parser.add_argument("--gpu-memory", default=None, help="for the planner (default: detected)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU (tests only)")
    parser.add_argument(
        "--predict",
        metavar="KIND",
        help="no runs: the predictions for a GPU kind (h200, h100-80gb, ...) of every row that "
        "has one, on this machine's CPU, into --output (predictions.json, predictions.md)",
    )
    # The probes' own processes (the masking check; writing a model's random weights and timing
    # the bare product; --auto's choice): whatever they hold on the GPU goes with them, so
    # nvidia-smi sees each run's memory alone, and the kit's own process never starts CUDA.
    for name in ("masking", "write", "bare", "auto", "argv", "shape", "model", "data", "seq",
                 "device"):  # fmt: skip
        parser.add_argument(f"--probe-{name}", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def probe(args: argparse.Namespace) -> int | None:
    """The probes' processes (parse_args); None when this is not one."""
    if args.probe_masking:
        found = masking_probe(
            Path(args.probe_model), Path(args.probe_data), args.work, int(args.probe_seq),
            args.probe_device,
        )  # fmt: skip
        Path(args.probe_masking).write_text(json.dumps(found, indent=2))
        return 0
    if args.probe_write:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.probe_data)
        shape = SHAPES[args.probe_shape]
        write_model(
            Path(args.probe_write), shape, tokenizer, int(args.probe_seq), args.probe_device
        )
        if args.probe_bare:
            Path(args.probe_bare).write_text(json.dumps(bare_matmul(args.probe_device)))
        return 0
    if args.probe_auto:
        from fsdp_utils.plan.cli import auto_choice

        try:
            record = auto_choice(json.loads(args.probe_argv))
        except ValueError as error:
            record = {"error": str(error)}
        Path(args.probe_auto).write_text(json.dumps(record, indent=2))
        return 0
    return None


def main(argv: list[str] | None = None) -> int:
    # the budget's clock: from the first start, before the wheels' installation (kept across
    # the run again with them, STARTED_ENV), as the budget's setup estimate counts it
    started = float(os.environ.get(STARTED_ENV, time.time()))
    args = parse_args(argv)
    probed = probe(args)
    if probed is not None:
        return probed
    if args.wheels:
        install_wheels(args, started)  # does not return: runs this script again
    try:
        rows = select_rows(ROWS, quick=args.quick, only=args.only)
    except ValueError as error:
        print(f"gpu-check: {error}", file=sys.stderr)
        return 2
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if not names or any(n not in SHAPES for n in names) or len(names) > 2:
        print(f"gpu-check: --shapes takes one or two of {sorted(SHAPES)}", file=sys.stderr)
        return 2
    shapes = {"small": names[0], "large": names[-1]}
    if args.predict:
        return predict_only(args, rows, shapes)

    import torch

    if torch.cuda.is_available():
        device, gpus, gpu_name, memory = "cuda", *cuda_devices()
        args.gpu_memory = args.gpu_memory or gpu_kind(gpu_name, memory)
    elif args.allow_cpu:
        device, gpus, gpu_name = "cpu", 1, "cpu"
        args.gpu_memory = args.gpu_memory or "80GiB"
    else:
        print(
            "gpu-check: no CUDA device is visible (torch.cuda.is_available() is False): run it "
            "on a GPU node, e.g. `srun -p <gpu-partition> --gpus-per-node 4 -t 30 make gpu-check`.",
            file=sys.stderr,
        )
        return EXIT_NO_GPU
    args.output.mkdir(parents=True, exist_ok=True)
    sys.stdout = Tee(sys.stdout, args.output / "gpu_check.log")  # type: ignore[assignment]
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    kit = Kit(args, work, device, gpus, args.gpu_memory)
    code, versions = check_versions(args.output, kit.env)
    print(versions, end="", flush=True)
    result: dict[str, Any] = {
        "gpu": gpu_name,
        "gpus": gpus,
        "torch": torch.__version__,
        "environment": environment(device),
        "budget_s": args.budget,
        "planned_for": args.gpu_memory,
        "rows": [],
    }
    report = Report(args.output, kit.logs, result)
    if code != 0:
        result["error"] = "the versions check failed: " + versions.strip().splitlines()[-1]
        report.write(started)
        print(f"gpu-check: {result['error']}", file=sys.stderr)
        return 2
    try:
        return run_rows(kit, rows, shapes, report, started)
    finally:
        kit.shutdown()


def prepare(
    kit: Kit, rows: list[Row], shapes: dict[str, str], *, runnable: set[str]
) -> tuple[dict[str, Path], dict[str, int]]:
    """The data, the prompts and the config-only models; every runnable row's plan (and the
    *-auto rows' choices) started on the CPU at once, in the rows' order. The config folders
    and each shape's longest sequence, by role."""
    t = time.perf_counter()
    kit.data, tokenizer = build_data(kit.work, kit.args.games)
    build_prompts(kit.data, kit.prompts)
    print(f"gpu-check: data ({time.perf_counter() - t:.0f}s)", flush=True)
    longest = {role: max((r.seq for r in rows if r.role == role), default=2048) for role in shapes}
    configs = {
        role: write_config_only(kit.work / f"config-{role}", SHAPES[name], tokenizer, longest[role])
        for role, name in shapes.items()
    }
    for row in rows:
        if row.name not in runnable:
            continue
        teacher = configs["large"] if row.kind == "distill" else None
        if row.kind in ("train", "grpo", "distill"):
            kit.plan_later(row.name, kit.plan, configs[row.role], row, teacher=teacher)
        elif row.kind == "auto":
            kit.plan_later(row.name, kit.auto, configs[row.role], row)
    return configs, longest


def predict_only(args: argparse.Namespace, rows: list[Row], shapes: dict[str, str]) -> int:
    """--predict KIND: every row's prediction for that GPU kind (its memory plan and step-time
    model, --auto's choices), on this machine, as the device call will compute them before each
    row; nothing runs. The best combination is chosen from measurements: not predicted here."""
    args.output.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-predict-"))
    kit = Kit(args, work, "cuda", 1, args.predict)
    rows = [scaled(r, shapes) for r in rows]
    started = time.time()
    try:
        prepare(kit, rows, shapes, runnable={r.name for r in rows})
        predictions = []
        for row in rows:
            if row.kind == "auto":
                found = auto_prediction(kit.planned(row.name, timeout=1800))
            elif row.kind in ("train", "grpo", "distill"):
                found = prediction_of(kit.planned(row.name, timeout=1800))
            else:
                continue
            predictions.append({"name": row.name, "flags": list(row.flags), **found})
            print(f"gpu-check: {row.name}: {describe_prediction(found)}", flush=True)
    finally:
        kit.shutdown()
    record = {"gpu_kind": args.predict, "seconds": time.time() - started, "rows": predictions}
    (args.output / "predictions.json").write_text(json.dumps(record, indent=2))
    lines = [
        f"Predictions for one {args.predict} (python bench/gpu_check.py --predict {args.predict})",
        "",
        "| row | planner peak GiB | needs GiB | tokens/s/GPU | MFU % | step s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for found in predictions:
        lines.append(
            f"| {found['name']} | {_fmt(found.get('peak_gib'), '.2f')} "
            f"| {_fmt(found.get('required_gib'), '.2f')} "
            f"| {_fmt(found.get('tokens_per_s_per_gpu'), ',.0f')} "
            f"| {_fmt(found.get('mfu_pct'), '.1f')} | {_fmt(found.get('step_s'), '.3f')} |"
        )
    (args.output / "predictions.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def describe_prediction(found: dict[str, Any]) -> str:
    if "error" in found and found.get("peak_gib") is None:
        return f"no prediction ({found['error']})"
    text = (
        f"planned peak {_fmt(found.get('peak_gib'), '.2f')} GiB, predicted "
        f"{_fmt(found.get('tokens_per_s_per_gpu'), ',.0f')} tokens/s/GPU (MFU "
        f"{_fmt(found.get('mfu_pct'), '.1f')}%)"
    )
    return text + (f"; --auto: {found['flags']}" if found.get("flags") else "")


def run_rows(
    kit: Kit, rows: list[Row], shapes: dict[str, str], report: Report, started: float
) -> int:
    args, device = kit.args, kit.device
    budget = Budget(args.budget)

    def elapsed() -> float:
        return time.time() - started

    statics = {r.name: static_skip(r, device=device, shapes=shapes) for r in rows}
    runnable = [r for r in rows if not statics[r.name]]
    print(
        f"gpu-check: {len(rows)} rows ({len(runnable)} runnable here), about "
        f"{estimate_s(runnable):.0f} s on one H100; budget {args.budget or 'none'}; "
        f"planned for {kit.gpu_memory}",
        flush=True,
    )
    print(f"gpu-check: {kit.gpus} x {report.result['gpu']}", flush=True)
    rows = [scaled(r, shapes) for r in rows]
    configs, longest = prepare(kit, rows, shapes, runnable={r.name for r in runnable})
    models: dict[str, Path] = {}
    unwritten: set[str] = set()
    measured: dict[str, dict[str, Any]] = {}

    def run_row(index: int, row: Row, entry: dict[str, Any]) -> None:
        """One row: skipped (saying why), or run and measured into `entry`."""
        later = [r for r in rows[index + 1 :] if not statics[r.name]]
        skip = statics[row.name] or budget.skip_reason(
            row, later, elapsed=elapsed(), written=set(models)
        )
        if not skip and set(row.roles) & unwritten:
            skip = "a shape's weights could not be written (above)"
        if not skip and row.skip_if_auto:
            ran = measured.get(row.ref, {}).get("attention_kernels")
            if ran == [row.skip_if_auto]:
                skip = f"{row.ref} ran {row.skip_if_auto} under --sdpa_backend auto: it is this row"
        if skip:
            entry.update(status="skipped", reason=skip)
            print(f"gpu-check: {row.name}: skipped ({skip})", flush=True)
            return
        print(
            f"gpu-check: {row.name} ({row.kind}, {entry['shape']}, seq {row.seq}) ...", flush=True
        )
        for role in row.roles:
            if role in models:
                continue
            t = time.perf_counter()
            folder = kit.work / f"model-{role}"
            bare = kit.work / "bare_matmul.json" if kit.bare is None else None
            code, log = kit.write_weights(
                folder, shapes[role], configs[role], longest[role],
                timeout=min(600.0, budget.seconds - elapsed()), bare=bare,
            )  # fmt: skip
            entry[f"weights_written_s_{role}"] = time.perf_counter() - t
            if code != 0:
                entry.update(failure(code, log, f"writing the {shapes[role]} weights"))
                unwritten.add(role)
                break
            models[role] = folder
            if bare is not None and bare.is_file():
                kit.bare = json.loads(bare.read_text())
                report.result["bare_matmul"] = kit.bare
        if entry.get("status") == "failed":
            print(f"  {describe_row(entry)}", flush=True)
            return
        teacher = models.get("large") if row.kind == "distill" else None
        chosen: tuple[str, ...] = ()
        # The prediction, on disk before the row starts: it can never be written after.
        if row.kind == "best":
            combination = best_combination(rows, measured)
            row = dataclasses.replace(row, batch=combination.batch, flags=combination.flags)
            entry.update(
                batch=row.batch, total=row.total_batch, flags=list(row.flags),
                combination=list(combination.notes),
            )  # fmt: skip
            kit.plan_later(row.name, kit.plan, configs[row.role], row, urgent=True)
        if row.kind == "auto":
            entry["prediction"] = auto_prediction(kit.planned(row.name, timeout=PLAN_WAIT_S))
            chosen = tuple(entry["prediction"].get("flags", "").split())
            if not chosen:
                entry.update(status="failed", reason=entry["prediction"]["error"])
                print(f"  {describe_row(entry)}", flush=True)
                return
            batch = chosen[chosen.index("--batch_size_per_device") + 1]
            entry.update(batch=int(batch), flags=[*row.flags, *chosen])
        elif row.kind in PLANNED_KINDS:
            entry["prediction"] = prediction_of(kit.planned(row.name, timeout=PLAN_WAIT_S))
        if "prediction" in entry:
            entry["prediction"]["written_at"] = time.time()
            print(f"  predicted: {describe_prediction(entry['prediction'])}", flush=True)
        report.write(started)
        entry["started_at"] = time.time()
        # Three times its estimate on a GPU, within what the more important rows after it
        # leave (Budget.time_limit); without a budget (--budget 0, the CPU dry run on a loaded
        # machine) only a stop for a hung command.
        if args.budget:
            timeout = budget.time_limit(row, later, elapsed=elapsed(), written=set(models))
        else:
            timeout = 1800.0
        model = models[row.role]
        if row.kind in ("train", "best", "auto", "distill"):
            outcome = kit.train_row(model, row, timeout, teacher=teacher, chosen=chosen)
        elif row.kind == "checkpoint":
            outcome = kit.checkpoint_row(model, row, timeout)
        elif row.kind == "grpo":
            outcome = kit.grpo_row(model, row, timeout)
        elif row.kind == "masking":
            outcome = kit.masking_row(model, row, timeout)
        else:
            outcome = kit.evaluate_row(row, timeout)
        entry.update(outcome)
        entry.setdefault("status", "ok")
        entry["finished_at"] = time.time()
        if "prediction" in entry:
            if entry["prediction"].get("peak_gib") is None and row.kind in PLANNED_KINDS:
                # no plan in time: the one that came later kept apart, never as the prediction
                late = prediction_of(kit.planned(row.name, timeout=60))
                entry["plan_after_run"] = {k: late.get(k) for k in ("peak_gib", "required_gib")}
            entry.update(against_prediction(entry))
        if entry["status"] == "ok":
            budget.ran(row, entry.get("wall_s"))
            if row.ref:
                entry["gain"] = gain(row, measured)
        print(f"  {describe_row(entry)}", flush=True)

    for index, row in enumerate(rows):
        entry: dict[str, Any] = {
            "name": row.name, "kind": row.kind, "shape": shapes[row.role],
            "parameters": SHAPES[shapes[row.role]].parameters(), "seq": row.seq,
            "batch": row.batch, "total": row.total_batch, "steps": row.steps,
            "flags": list(row.flags), "priority": row.priority,
            "estimate_s": round(row.estimate_s * budget.scale),
        }  # fmt: skip
        if row.ref:
            entry.update(ref=row.ref, lever=row.lever, adds=list(row.adds), drops=list(row.drops))
        report.result["rows"].append(entry)
        measured[row.name] = entry
        try:
            run_row(index, row, entry)
        except Exception as error:  # the kit's own fault (reading a trace, a summary): the
            # row says so with its traceback, and the next row goes on
            entry.update(
                status="failed", reason=f"the kit's own error: {type(error).__name__}: {error}",
                traceback=traceback.format_exc()[-6000:],
            )  # fmt: skip
            print(f"  {describe_row(entry)}\n{entry['traceback']}", flush=True)
        report.write(started)
    try:
        finish(report.result)
    except Exception:  # the rows' own figures are written whatever the summary meets
        report.result["finish_error"] = traceback.format_exc()[-3000:]
    report.write(started)
    print("\n" + render(report.result), flush=True)
    failed = [r["name"] for r in report.result["rows"] if r["status"] in ("failed", "timed out")]
    if failed:
        print(f"gpu-check: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def finish(result: dict[str, Any]) -> None:
    """What the rows say together: the planner's margin refitted on the rows it plans exactly,
    the prediction errors, and each *-auto row against the fastest hand row of its shape."""
    rows = [r for r in result["rows"] if r.get("status") == "ok"]
    train = [r for r in rows if r["kind"] in MEASURED_KINDS]
    result["margin_suggestion"] = margin_suggestion(
        [r for r in train if r["kind"] == "train" and exact_plan(r["flags"])]
    )
    errors = [abs(r["predicted_tokens_error"]) for r in train if r.get("predicted_tokens_error")]
    if errors:
        result["prediction_error"] = {
            "rows": len(errors), "median_abs": statistics.median(errors), "max_abs": max(errors)
        }  # fmt: skip
    against: dict[str, dict[str, Any]] = {}
    for auto in (r for r in train if r["kind"] == "auto"):

        def same(r: dict[str, Any], auto: dict[str, Any] = auto) -> bool:  # the same training
            keys = ("--lora", "--quantize")
            return (r["shape"], r["seq"]) == (auto["shape"], auto["seq"]) and all(
                (k in r["flags"]) == (k in auto["flags"]) for k in keys
            )

        hand = [r for r in train if r["kind"] in ("train", "best") and same(r)]
        best = max(hand, key=lambda r: r.get("tokens_per_s_per_gpu") or 0.0, default=None)
        if best is not None and best.get("tokens_per_s_per_gpu"):
            over = ratio(auto.get("tokens_per_s_per_gpu"), best["tokens_per_s_per_gpu"])
            against[auto["name"]] = {
                "best_hand": best["name"],
                "best_hand_tokens_per_s": best["tokens_per_s_per_gpu"],
                "auto_over_best_hand": over - 1.0 if over is not None else None,
            }
    result["auto_against"] = against


def describe_row(entry: dict[str, Any]) -> str:
    if entry["status"] != "ok":
        tail = entry.get("log_tail", "")
        return f"{entry['status'].upper()}: {entry.get('reason', '')}\n{tail}"
    if entry["kind"] in MEASURED_KINDS:
        line = (
            f"{_fmt(entry.get('tokens_per_s_per_gpu'), ',.0f')} tokens/s/GPU (predicted "
            f"{_fmt((entry.get('prediction') or {}).get('tokens_per_s_per_gpu'), ',.0f')}), MFU "
            f"{_fmt(entry.get('mfu_pct'), '.1f')}%, peak alloc "
            f"{_fmt(entry.get('peak_allocated_gib'), '.2f')} GiB, reserved "
            f"{_fmt(entry.get('peak_reserved_gib'), '.2f')} GiB, planned "
            f"{_fmt(entry.get('planned_peak_gib'), '.2f')} GiB ({entry['wall_s']:.0f} s)"
        )
        if entry.get("gain") is not None:
            line += f"; {entry['gain']:+.1%} against {entry['ref']}"
        if entry.get("summary"):
            line += f"\n  {entry['summary']}"
        if (entry.get("profile") or {}).get("table"):
            line += "\n" + entry["profile"]["table"]
        return line
    return f"{entry.get('summary', 'ok')} ({entry.get('wall_s', 0):.0f} s)"


if __name__ == "__main__":
    raise SystemExit(main())
