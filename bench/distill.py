"""Distillation's memory (docs/distillation.md): the planner's rows for an 8B student with a
70B teacher on 8 x 80 GB, and on CPU the peak host memory per process of real runs with the
teacher resident, from its cache, and of the teacher's own job, against the plan; and the
cache's disk per token.

    python bench/distill.py --plans      # the planner's rows (fake tensors; ~25 min on 2 cores)
    python bench/distill.py --measured   # the CPU runs (~10 min on 2 cores)
    python bench/distill.py              # both

**Plans**: Llama-3-8B and Llama-3-70B shapes (their config.json's values, bench/plan_table.py),
full fine-tuning of the student in bf16-mixed, activation checkpointing, 1 sequence per GPU,
total batch 8, AdamW; each row one `plan_memory`: the student alone (SFT), with the teacher live
in bf16 or NF4, from the cache (top 64), and the teacher's own job (--teacher_cache_only).

**Measured** (CPU, gloo, 2 processes, fp32): the student a Llama of 4 layers of 256 (5.5M
parameters), the teacher bench/qlora.py's Llama of 24 layers of 1024 (283.6M parameters, stored
in fp32 under --precision fp32: 1.13 GB, 0.57 GB per process), the chess tokenizer (512 words),
50 games, 128 tokens per sequence, 1 per device, 4 per step, 6 steps. Every 5 ms a sampler
reads each worker's VmRSS (bench/qlora.py's `Sampler`); the table gives the highest of any
worker from the model's build on (the data's preparation, in the first run, is left out). The plan of the same configuration (tensor bytes on a device, no
CUDA context) is set beside it: on CPU the process also holds the interpreter, torch and the
data, so the runs are compared by their differences from the student alone.

Writes bench/results/distill.json and prints markdown tables, with the load average.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.plan import plan_memory

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
GIB, MIB = 2**30, 2**20


def _bench(name: str) -> Any:
    """A sibling benchmark's module (bench/ is not a package): the shapes of plan_table.py,
    the sampler and the 284M model of qlora.py."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# --- the planner's rows ---------------------------------------------------------------------


def plan_rows(lengths: tuple[int, ...] = (4096, 8192)) -> tuple[str, list[dict[str, Any]]]:
    shapes = _bench("plan_table")
    student = shapes.config_folder("Llama-3-8B", shapes.LLAMA_3_8B)
    teacher = str(shapes.config_folder("Llama-3-70B", shapes.LLAMA_3_70B))
    setups: dict[str, dict[str, Any]] = {
        "SFT (no teacher)": {},
        "teacher live, bf16": {"method": "distill", "teacher": teacher},
        "teacher live, NF4": {"method": "distill", "teacher": teacher, "teacher_quantize": "nf4"},
        "teacher from the cache (top 64)": {"method": "distill", "teacher_cache": "DIR"},
        "the teacher's own job (bf16)": {
            "method": "distill", "teacher": teacher, "teacher_cache": "DIR",
            "teacher_cache_only": True,
        },
    }  # fmt: skip
    rows = [
        "| tokens | run | params (frozen) | grads | optimizer | activations | temporaries "
        "| peak | + margin | fits 80 GB? | plan (wall) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|:---:|---:|",
    ]
    records = []
    for seq in lengths:
        for name, options in setups.items():
            if seq != lengths[0] and ("NF4" in name or "own job" in name):
                continue  # at the longer length, the three runs whose activations grow
            config = TrainConfig(
                model=str(student), max_seq_length=seq, total_batch_size=8,
                batch_size_per_device=1, gradient_checkpointing=True, **options,
            )  # fmt: skip
            wall = time.perf_counter()
            plan = plan_memory(
                config, nodes=1, gpus_per_node=8, gpu_memory_bytes=80 * GIB,
                gpu_name="A100/H100-80GB", suggest_fixes=False,
            )  # fmt: skip
            wall = time.perf_counter() - wall
            parts = plan.parts_gib()
            parts[0] = f"{parts[0]} ({plan.frozen_bytes / GIB:.1f})"
            rows.append(
                f"| {seq:,} | {name} | {' | '.join(parts)} | {plan.required_bytes / GIB:.1f} | "
                f"{'yes' if plan.fits else '**no**'} | {wall:.0f} s |"
            )
            records.append({"tokens": seq, "run": name, **plan.to_dict()})
            print(rows[-1], flush=True)
    rows += [
        "",
        f"GiB per GPU at the peak (its parts sum to it). Margin: {plan.margin.describe()}.",
    ]
    return "\n".join(rows), records


# --- measured on CPU ------------------------------------------------------------------------

SEQ, TOTAL, STEPS, GAMES, K = 128, 4, 6, 50, 64


def cpu_assets() -> dict[str, Path]:
    """bench/qlora.py's demo data and 284M Llama (the teacher), and a small student of the
    same tokenizer (built once)."""
    from transformers import AutoTokenizer

    from fsdp_utils.synthetic import save_tiny_model

    paths = _bench("qlora").assets()
    student = RESULTS / "distill_assets" / "student"
    if not (student / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(paths["model"])
        save_tiny_model(student, tokenizer, hidden_size=256, num_layers=4, num_heads=8)
    return {"teacher": paths["model"], "data": paths["data"], "student": student}


def _flags(paths: dict[str, Path], name: str, extra: list[str]) -> list[str]:
    return [
        "--model", str(paths["student"]), "--dataset", str(paths["data"]),
        "--data_cache_dir", str(RESULTS / "distill_prepared"),
        "--output_dir", str(RESULTS / "distill_runs" / name), "--max_examples", str(GAMES),
        "--eval_examples", "10", "--max_seq_length", str(SEQ), "--batch_size_per_device", "1",
        "--total_batch_size", str(TOTAL), "--max_training_steps", str(STEPS),
        "--precision", "fp32", "--eval_every", "0", "--eval_batches", "1",
        "--save_every_minutes", "0", "--no_final_save", "--resume", "never", "--log_every", "1",
        *extra,
    ]  # fmt: skip


def measured_run(paths: dict[str, Path], name: str, extra: list[str]) -> dict[str, Any]:
    """One 2-process run under the sampler: the highest VmRSS of any worker from the model's
    build on (the data is prepared by then: its preparation's peak is not the run's), its time."""
    shutil.rmtree(RESULTS / "distill_runs" / name, ignore_errors=True)
    command = [TORCHRUN, "--standalone", "--nproc_per_node=2", str(REPO / "chess_finetune.py")]
    command += _flags(paths, name, extra)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    sampler = _bench("qlora").Sampler(proc.pid)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    assert proc.stdout is not None
    lines, built = [], float("inf")
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(("model:", "distill:")):
            built = min(built, time.monotonic())
    proc.wait()
    sampler.stop()
    thread.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{''.join(lines[-40:])}")
    after = [s for s in sampler.samples if "VmRSS" in s.kib and s.t >= built]
    top = max(after, key=lambda s: s.kib["VmRSS"])
    return {
        "run": name,
        "peak_rss_mib": top.kib["VmRSS"] / 1024,
        "peak_anon_mib": top.kib.get("RssAnon", 0) / 1024,
        "seconds": time.monotonic() - started,
        "log": [line.rstrip() for line in lines if line.startswith(("distill:", "step"))],
    }


def _plan(paths: dict[str, Path], extra: list[str]) -> Any:
    from fsdp_utils.config.parse import build_parser, parse_config

    config, _ = parse_config(_flags(paths, "plan", extra), build_parser())
    return plan_memory(config, nodes=1, gpus_per_node=2, gpu_memory_bytes=None, suggest_fixes=False)


def measured(paths: dict[str, Path]) -> tuple[str, list[dict[str, Any]]]:
    cache = RESULTS / "distill_runs" / "teacher_cache"
    shutil.rmtree(cache, ignore_errors=True)
    teacher = ["--method", "distill", "--teacher", str(paths["teacher"])]
    runs = {
        "student alone (SFT)": [],
        "teacher live (fp32, sharded)": teacher,
        "the teacher's own job (top 64)": [
            *teacher, "--teacher_cache", str(cache), "--teacher_cache_only", "--teacher_top_k",
            str(K),
        ],
        "teacher from the cache": ["--method", "distill", "--teacher_cache", str(cache)],
    }  # fmt: skip
    rows = [
        "| run | peak RSS per process (MiB) | over the student alone | plan: peak tensor bytes "
        "(MiB) | over the student alone | wall |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    # The data prepared first, in a process of its own: the memory a preparation leaves
    # resident would otherwise count in the first run's peak only.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    prepare = [sys.executable, "-m", "fsdp_utils.data", *_flags(paths, "prepare", [])]
    subprocess.run(prepare, cwd=REPO, env=env, check=True, capture_output=True)
    records: list[dict[str, Any]] = []
    base_rss = base_plan = 0.0
    for name, extra in runs.items():
        record = measured_run(paths, re.sub(r"[^a-z0-9]+", "_", name.split(" (")[0]), extra)
        plan = _plan(paths, extra)
        record["plan_peak_mib"] = plan.peak_bytes / MIB
        record["plan_frozen_mib"] = plan.frozen_bytes / MIB
        if not records:
            base_rss, base_plan = record["peak_rss_mib"], record["plan_peak_mib"]
        rows.append(
            f"| {name} | {record['peak_rss_mib']:,.0f} | "
            f"{record['peak_rss_mib'] - base_rss:+,.0f} | {record['plan_peak_mib']:,.0f} | "
            f"{record['plan_peak_mib'] - base_plan:+,.0f} | {record['seconds']:.0f} s |"
        )
        records.append(record)
        print(rows[-1], flush=True)
    rows += ["", disk_line(cache)]
    return "\n".join(rows), records


def disk_line(cache: Path) -> str:
    """The cache's bytes per token, measured, against 8 K + 4."""
    meta = json.loads((cache / "meta.json").read_text())
    positions = sum(s["blocks"] * s["positions"] for s in meta["splits"].values())
    size = sum(p.stat().st_size for p in cache.glob("*.npy"))
    k = meta["top_k"]
    return (
        f"The cache: {size / MIB:,.1f} MiB for {positions:,} positions = "
        f"{size / positions:,.1f} bytes per token at K = {k} (8 K + 4 = {8 * k + 4}, and "
        "the .npy headers and one done flag per block)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--plans", action="store_true", help="only the planner's rows")
    parser.add_argument("--measured", action="store_true", help="only the CPU runs")
    args = parser.parse_args()
    both = not (args.plans or args.measured)
    results: dict[str, Any] = {"load_average": os.getloadavg()}
    if args.plans or both:
        text, results["plans"] = plan_rows()
        print(f"\n{text}\n")
    if args.measured or both:
        text, results["measured"] = measured(cpu_assets())
        print(f"\n{text}\n")
    results["load_average_end"] = os.getloadavg()
    print(f"load average: {results['load_average']} -> {results['load_average_end']}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "distill.json"  # the other part's results, from an earlier run, are kept
    kept = json.loads(out.read_text()) if out.is_file() else {}
    out.write_text(json.dumps({**kept, **results}, indent=2, default=str))


if __name__ == "__main__":
    main()
