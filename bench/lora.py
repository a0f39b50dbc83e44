"""LoRA against full fine-tuning, one run on the same tiny model and data (CPU, 2 processes, gloo):

- per-process memory of one training step, measured with the planner's tracker on the real run
  (`python -m fsdp_utils.plan.measure`): the peak, and the state (parameters, gradients,
  optimizer state) that lives between steps, in fp32 and in bf16-mixed (where the frozen base
  is kept in bf16: no fp32 master copy); with --full also the bf16-mixed LoRA peak without
  dropout;
- with --full, tokens/s of chess_finetune.py with and without --lora in both precisions, in
  interleaved rounds as bench/throughput.py runs them (a warm-up round, then `--pairs` rounds;
  every figure and ratio as median and min-max over the rounds, ratios pair by pair), by wall
  clock and by rank 0's CPU time.

    python bench/lora.py            # make bench: the memory of both precisions
    python bench/lora.py --full     # make bench-full: + tokens/s in both precisions, 5 rounds

The short set leaves the tokens/s to bench/throughput.py, whose rounds time fp32 LoRA beside
the same full fine-tuning run ((d) there). bf16-mixed tokens/s are in the long set only: a CPU's
bf16 speed says nothing about a GPU's, and on a CPU without native bf16 those runs are several
times slower. The memory figures are bytes, the same on any device.

Writes bench/results/lora.json and prints a table. CPU timings on a shared machine are noisy:
compare the ratios of one run, not absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import (  # bench/ is not a package: its folder is on sys.path
    NPROC,
    PER_DEVICE,
    RESULTS,
    SEQ,
    TORCHRUN,
    TOTAL,
    ChildFailed,
    Figures,
    assets,
    finetune,
    interleaved_rounds,
    run_child,
    spread,
)

MIB = 1024**2
PRECISIONS = ("fp32", "bf16-mixed")
FLAGS = {"full": [], "LoRA": ["--lora"]}


def measure(paths: dict[str, Path], reruns: list[dict[str, Any]], *extra: str) -> dict[str, int]:
    """Tracker bytes of one step (after a warm-up step) on rank 0 of a real 2-process run."""
    out = RESULTS / "lora_measure.json"
    command = [
        TORCHRUN, "--standalone", f"--nproc_per_node={NPROC}", "-m", "fsdp_utils.plan.measure",
        "--out", str(out), "--model", str(paths["model"]), "--dataset", str(paths["data"]),
        "--data_cache_dir", str(RESULTS / "prepared"), "--output_dir", str(RESULTS / "run_measure"),
        "--max_seq_length", str(SEQ), "--batch_size_per_device", str(PER_DEVICE),
        "--total_batch_size", str(TOTAL), "--eval_batches", "1", "--save_every_minutes", "0",
        "--no_final_save", "--resume", "never", *extra,
    ]  # fmt: skip
    run_child(command, f"fsdp_utils.plan.measure {' '.join(extra)}", reruns)
    from fsdp_utils.plan import StepMemory

    memory = StepMemory.from_dict(json.loads(out.read_text()))
    return {"peak": memory.peak_bytes, "state": memory.state_bytes}


def speed_rows(rounds: list[dict[str, Figures]], precision: str) -> dict[str, Any]:
    """Tokens/s of full fine-tuning and LoRA in one precision, and LoRA/full pair by pair."""
    full, lora = f"{precision} full", f"{precision} LoRA"
    rates = {m: [r[f"{precision} {m}"]["useful_tokens_per_s"] for r in rounds] for m in FLAGS}
    # Both runs see the same tokens per step: the inverse ratio of rank 0's CPU seconds per
    # step is the tokens/s ratio that other processes on the machine hardly move.
    cpu = [r[full]["cpu_seconds_per_step"] / r[lora]["cpu_seconds_per_step"] for r in rounds]
    return {
        "tokens_per_s": rates,
        "ratio_tokens_per_s": [a / b for a, b in zip(rates["LoRA"], rates["full"], strict=True)],
        "ratio_cpu_time": cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--full", action="store_true", help="make bench-full: tokens/s too, in 5 rounds"
    )
    parser.add_argument("--pairs", type=int, default=5, help="measured rounds, with --full")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup_steps", type=int, default=3, help="untimed steps per run")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    paths = assets()
    timed = PRECISIONS if args.full else ()
    reruns: list[dict[str, Any]] = []  # failed runs that were rerun (printed as they happen)

    def run(precision: str, method: str) -> Callable[[], Figures]:
        return lambda: finetune(paths, args, reruns, "--precision", precision, *FLAGS[method])

    measures = {f"{p} {m}": run(p, m) for p in timed for m in FLAGS}
    try:
        rounds = interleaved_rounds(measures, args.pairs) if measures else []
        memory = {
            (precision, method): measure(paths, reruns, "--precision", precision, *FLAGS[method])
            for precision in PRECISIONS
            for method in FLAGS
        }
        no_dropout = (
            measure(paths, reruns, "--precision", "bf16-mixed", "--lora", "--lora_dropout", "0")
            if args.full
            else None
        )
    except ChildFailed as err:
        sys.exit(f"error: {err}")
    rows: list[dict[str, Any]] = []
    for precision in PRECISIONS:
        full, lora = memory[(precision, "full")], memory[(precision, "LoRA")]
        row: dict[str, Any] = {
            "precision": precision,
            "peak_mib": {"full": full["peak"] / MIB, "lora": lora["peak"] / MIB},
            "state_mib": {"full": full["state"] / MIB, "lora": lora["state"] / MIB},
            "ratio_peak": lora["peak"] / full["peak"],
            "ratio_state": lora["state"] / full["state"],
        }
        if precision in timed:
            row.update(speed_rows(rounds, precision))
        rows.append(row)
    summary = {
        "setup": f"{NPROC} CPU processes (gloo), Llama 4x256, seq {SEQ}, {PER_DEVICE}/device, "
        f"total {TOTAL}; LoRA r=8 alpha=16 dropout 0.05 on every linear layer of the blocks",
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "pairs": args.pairs,
        "rounds": rounds,
        "reruns": reruns,
        "rows": rows,
        "bf16_mixed_lora_dropout_0_peak_mib": no_dropout["peak"] / MIB if no_dropout else None,
    }
    (RESULTS / "lora.json").write_text(json.dumps(summary, indent=2))
    speeds = (
        f"{args.pairs} interleaved rounds after a warm-up round, {args.steps} timed steps per run "
        f"after {args.warmup_steps}; median (min - max) over the rounds, ratios pair by pair"
        if args.full
        else "fp32 in bench/throughput.py's (d), both precisions with --full"
    )
    print(
        f"\n{summary['setup']}\ntokens/s: {speeds}; memory: one tracked step after a warm-up step\n"
    )
    print(
        "| precision | tokens/s full | tokens/s LoRA | LoRA/full (wall) | LoRA/full (rank 0 CPU) "
        "| peak MiB full | peak MiB LoRA | LoRA/full | state MiB full | state MiB LoRA "
        "| LoRA/full |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        p, s = r["peak_mib"], r["state_mib"]
        if "tokens_per_s" in r:
            t = r["tokens_per_s"]
            speed = (
                f"{spread(t['full'], ',.0f')} | {spread(t['LoRA'], ',.0f')} | "
                f"{spread(r['ratio_tokens_per_s'], '.2f')} | {spread(r['ratio_cpu_time'], '.2f')}"
            )
        else:
            speed = "--full | --full | --full | --full"
        print(
            f"| {r['precision']} | {speed} | {p['full']:.1f} | {p['lora']:.1f} | "
            f"{r['ratio_peak']:.2f} | {s['full']:.2f} | {s['lora']:.2f} | {r['ratio_state']:.3f} |"
        )
    if no_dropout:
        print(f"bf16-mixed LoRA with --lora_dropout 0: peak {no_dropout['peak'] / MIB:.1f} MiB")
    for rerun in reruns:
        passed = "passed on the rerun" if rerun.get("rerun_passed") else "failed again"
        print(f"\nnote: {rerun['run']} failed once (exit code {rerun['exit_code']}); {passed}")


if __name__ == "__main__":
    main()
