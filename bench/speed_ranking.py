"""Does the step-time model rank configurations as they run? On this CPU, 2 processes (gloo).

    python bench/speed_ranking.py             # calibrate, then 10 configurations, 2 rounds
    python bench/speed_ranking.py --rounds 1 --steps 4   # quicker

One small model (a Llama of hidden 256, 4 layers, 8 heads of which 4 key-value, on the chess
tokenizer, fp32), one total batch (8 sequences of 512 tokens a step), and configurations that
differ in what --auto chooses: the micro-batch, the checkpointed layers, the sharding, the
sequence-parallel degree. First `python -m fsdp_utils.plan --calibrate --device cpu
--gpus_per_node 2` measures this machine (into a site folder of the benchmark's own, so that
nothing of yours is read or written), then each configuration is predicted by the model
(`--plan --device cpu`'s step time, from those figures and the priors: no row of this
benchmark is fitted) and run with chess_finetune.py under torchrun for a few steps: its step
time is the median after the first two. The rounds are interleaved (the order reversed every
other round) and the calibration is repeated before each round, so a drifting background load
hits all alike; the load average is printed before and after.

It prints the table (predicted and measured tokens/s per process, the error), Spearman's rank
correlation of predicted against measured, and the median relative error. Goals (issue 59):
Spearman >= 0.8, median error <= 25%. A timing, not a test: results in
bench/results/speed_ranking.json and .md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
WORK = RESULTS / "speed_ranking"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
NPROC, SEQ, TOTAL = 2, 512, 8
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "FSDP_UTILS_SITE_DIR": str(WORK / "site")}

CONFIGURATIONS: dict[str, list[str]] = {
    "micro-batch 1": ["--batch_size_per_device", "1"],
    "micro-batch 2": ["--batch_size_per_device", "2"],
    "micro-batch 4": ["--batch_size_per_device", "4"],
    "micro-batch 4, 2 layers checkpointed": [
        "--batch_size_per_device",
        "4",
        "--checkpoint_layers",
        "2",
    ],
    "micro-batch 4, all checkpointed": ["--batch_size_per_device", "4", "--checkpoint_layers", "4"],
    "micro-batch 1, all checkpointed": ["--batch_size_per_device", "1", "--checkpoint_layers", "4"],
    "micro-batch 2, shard_grad_op": ["--batch_size_per_device", "2", "--sharding", "shard_grad_op"],
    "micro-batch 2, no_shard": ["--batch_size_per_device", "2", "--sharding", "no_shard"],
    "sequence parallel 2, micro-batch 1": [
        "--batch_size_per_device",
        "1",
        "--sequence_parallel",
        "2",
    ],
    "sequence parallel 2, micro-batch 4": [
        "--batch_size_per_device",
        "4",
        "--sequence_parallel",
        "2",
    ],
}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def assets() -> dict[str, Path]:
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from fsdp_utils.synthetic import build_demo_assets, save_tiny_model

    built = build_demo_assets(WORK / "assets", num_games=600, num_shards=2)
    tokenizer = AutoTokenizer.from_pretrained(built["model"])
    model = save_tiny_model(
        WORK / "model", tokenizer, arch="llama", hidden_size=256, num_layers=4, num_heads=8,
        max_positions=SEQ,
    )  # fmt: skip
    return {"model": model, "data": built["data"]}


def common(paths: dict[str, Path]) -> list[str]:
    return [
        "--model", str(paths["model"]), "--dataset", str(paths["data"]), "--dataset_include", "",
        "--data_cache_dir", str(WORK / "prepared"), "--max_seq_length", str(SEQ),
        "--total_batch_size", str(TOTAL), "--precision", "fp32", "--device", "cpu",
    ]  # fmt: skip


def calibrate() -> str:
    command = [sys.executable, "-m", "fsdp_utils.plan", "--calibrate", "--device", "cpu",
               "--gpus_per_node", str(NPROC)]  # fmt: skip
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, cwd=REPO)
    if result.returncode:
        raise SystemExit(f"calibration failed:\n{result.stderr}")
    return result.stdout.strip()


def predict(paths: dict[str, Path], flags: list[str]) -> dict[str, Any]:
    # The model from the calibration alone: the rows the runs add to the site are not fitted.
    (WORK / "site" / "runs.jsonl").unlink(missing_ok=True)
    command = [sys.executable, "-m", "fsdp_utils.plan", *common(paths), *flags,
               "--gpus_per_node", str(NPROC), "--json"]  # fmt: skip
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, cwd=REPO)
    if result.returncode:
        raise SystemExit(f"plan failed for {flags}:\n{result.stderr}")
    return json.loads(result.stdout)["step_time"]


def run(paths: dict[str, Path], name: str, flags: list[str], steps: int) -> tuple[float, float]:
    out = WORK / "runs" / name.replace(" ", "_").replace(",", "")
    shutil.rmtree(out, ignore_errors=True)
    command = [
        TORCHRUN, "--standalone", f"--nproc_per_node={NPROC}", str(REPO / "chess_finetune.py"),
        *common(paths), *flags, "--output_dir", str(out), "--max_training_steps", str(steps + 2),
        "--eval_every", "0", "--eval_batches", "1", "--eval_examples", "0",
        "--save_every_minutes", "0", "--no_final_save", "--resume", "never", "--log_every", "1",
    ]  # fmt: skip
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, cwd=REPO)
    if result.returncode:
        raise SystemExit(f"run {name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    wall = statistics.median(r["step_time_s"] for r in train[2:])
    cpu = statistics.median(
        b["process_cpu_s"] - a["process_cpu_s"] for a, b in itertools.pairwise(train)
    )
    positions = SEQ * TOTAL / NPROC  # a step's sequence positions per process
    return positions / wall, positions / cpu


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, index in enumerate(order):
            out[index] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True)) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps a run (after 2)")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    started, load_before = time.time(), load()
    print(f"load average before: {load_before}", flush=True)
    paths = assets()
    names = list(CONFIGURATIONS)
    predicted: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    wall: dict[str, list[float]] = {name: [] for name in names}
    calibrations = []
    for index in range(args.rounds):
        calibrations.append(calibrate())
        print(f"round {index + 1}: calibrated (load {load()})\n{calibrations[-1]}", flush=True)
        for name in names if index % 2 == 0 else reversed(names):
            predicted[name].append(predict(paths, CONFIGURATIONS[name])["tokens_per_s_per_gpu"])
            by_wall, by_cpu = run(paths, name, CONFIGURATIONS[name], args.steps)
            wall[name].append(by_wall)
            cpu[name].append(by_cpu)
            print(
                f"  {name}: predicted {predicted[name][-1]:,.0f}, measured {by_cpu:,.0f} per CPU "
                f"second ({by_wall:,.0f} by the wall clock) tokens/s per process (load {load()})",
                flush=True,
            )
    rows: list[dict[str, Any]] = []
    for name in names:
        p, c, w = (statistics.median(x[name]) for x in (predicted, cpu, wall))
        rows.append({"configuration": name, "predicted": p, "measured_cpu": c,
                     "measured_wall": w, "error": p / c - 1, "error_wall": p / w - 1})  # fmt: skip
    predicted_list = [r["predicted"] for r in rows]
    rho = spearman(predicted_list, [r["measured_cpu"] for r in rows])
    rho_wall = spearman(predicted_list, [r["measured_wall"] for r in rows])
    median_error = statistics.median(abs(r["error"]) for r in rows)
    median_wall = statistics.median(abs(r["error_wall"]) for r in rows)
    load_after = load()
    lines = [
        f"Step-time model against {NPROC} CPU processes (gloo), {args.rounds} round(s) of "
        f"{args.steps} timed steps, {time.time() - started:.0f} s; load average before "
        f"{load_before}, after {load_after} (2 cores)",
        "",
        "| configuration | predicted tokens/s per process | measured (per CPU second) | error "
        "| measured (wall clock) | error |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {r['configuration']} | {r['predicted']:,.0f} | {r['measured_cpu']:,.0f} | "
            f"{r['error']:+.0%} | {r['measured_wall']:,.0f} | {r['error_wall']:+.0%} |"
            for r in rows
        ),
        "",
        f"Per CPU second of rank 0 (the machine's load taken out): Spearman {rho:.2f} (goal >= "
        f"0.8), median |error| {median_error:.0%} (goal <= 25%).",
        f"By the wall clock: Spearman {rho_wall:.2f}, median |error| {median_wall:.0%}.",
    ]
    table = "\n".join(lines)
    print("\n" + table)
    (RESULTS / "speed_ranking.md").write_text(table + "\n")
    (RESULTS / "speed_ranking.json").write_text(
        json.dumps(
            {"rows": rows, "spearman": rho, "median_error": median_error,
             "spearman_wall": rho_wall, "median_error_wall": median_wall,
             "load_before": load_before, "load_after": load_after,
             "calibrations": calibrations, "rounds": args.rounds, "steps": args.steps},
            indent=2,
        )
    )  # fmt: skip


if __name__ == "__main__":
    main()
