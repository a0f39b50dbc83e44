"""`make bench` and `make bench-full`: every benchmark in turn, then how long each one took.

    python bench/run_all.py           # make bench: the short set (6.5 min on a quiet 2-core machine)
    python bench/run_all.py --full    # make bench-full: more rounds, every row

Each benchmark runs as its own process and prints as it goes; its results land in
bench/results/. At the end: the wall time of each and of all, the CPU time of all their
processes (steadier than the wall time on a shared machine), and the load average, so that a
slow run on a busy machine can be told from a slow benchmark. Stops at the first failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
GPU_TABLE = RESULTS / "gpu_check" / "gpu_check.md"
# (name, script, whether it has a long set behind --full)
BENCHMARKS = [
    ("throughput", "throughput.py", True),
    ("memory planner", "plan_table.py", True),
    ("LoRA", "lora.py", True),
    ("LoRA memory plans", "lora_plan_table.py", False),
    ("long sequences", "long_context.py", True),
    ("sequence parallelism", "sequence_parallel.py", True),
    ("GRPO", "grpo.py", True),
]


@dataclasses.dataclass
class Timed:
    benchmark: str
    command: list[str]
    wall_s: float
    cpu_s: float
    exit_code: int


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:02.0f} s"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="the long set (make bench-full)")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    name_of_set = "make bench-full" if args.full else "make bench"
    load_before = os.getloadavg()
    times: list[Timed] = []
    started, cpu_started = time.perf_counter(), _children_cpu()
    status = 0
    for name, script, has_full in BENCHMARKS:
        command = [
            sys.executable,
            str(BENCH / script),
            *(["--full"] if args.full and has_full else []),
        ]
        print(f"\n=== {name}: {' '.join(command[1:])}", flush=True)
        wall, cpu = time.perf_counter(), _children_cpu()
        status = subprocess.run(command).returncode
        times.append(
            Timed(name, command[1:], time.perf_counter() - wall, _children_cpu() - cpu, status)
        )
        if status != 0:
            print(f"\nerror: {name} failed (exit code {status}); stopping.", file=sys.stderr)
            break
    wall, cpu = time.perf_counter() - started, _children_cpu() - cpu_started
    load_after = os.getloadavg()
    if status == 0:
        print(
            f"\n{GPU_TABLE.read_text()}"
            if GPU_TABLE.is_file()
            else "\nGPU table: none measured here (make gpu-check on a GPU node writes "
            "bench/results/gpu_check/)"
        )
    summary = {
        "set": name_of_set,
        "wall_s": wall,
        "cpu_s": cpu,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "cpus": os.cpu_count(),
        "benchmarks": [dataclasses.asdict(t) for t in times],
    }
    (RESULTS / "run_all.json").write_text(json.dumps(summary, indent=2))
    print(f"\n| {name_of_set} | wall | CPU, all its processes |\n|---|---:|---:|")
    for row in times:
        print(f"| {row.benchmark} | {minutes(row.wall_s)} | {minutes(row.cpu_s)} |")
    load = " -> ".join(f"{a[0]:.1f}" for a in (load_before, load_after))
    print(
        f"\n{name_of_set}: {minutes(wall)} in all (CPU {minutes(cpu)}; load average {load} on "
        f"{os.cpu_count()} cores)"
    )
    return status


if __name__ == "__main__":
    raise SystemExit(main())
