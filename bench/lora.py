"""LoRA against full fine-tuning, one run on the same tiny model and data (CPU, 2 processes, gloo):

- tokens/s of chess_finetune.py with and without --lora (alternated, medians);
- per-process memory of one training step, measured with the planner's tracker on the real run
  (`python -m fsdp_utils.plan.measure`): the peak, and the state (parameters, gradients,
  optimizer state) that lives between steps;

in fp32 and in bf16-mixed (where the frozen base is kept in bf16: no fp32 master copy).

    python bench/lora.py [--steps 10] [--repeats 2]

Writes bench/results/lora.json and prints a table. CPU timings on a shared machine are noisy:
compare the ratios of one run, not absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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
    assets,
    finetune,
    run_child,
)

MIB = 1024**2


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup_steps", type=int, default=3, help="untimed steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="alternate the runs this often")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    paths = assets()
    variants = {
        ("fp32", "full"): ["--precision", "fp32"],
        ("fp32", "lora"): ["--precision", "fp32", "--lora"],
        ("bf16-mixed", "full"): ["--precision", "bf16-mixed"],
        ("bf16-mixed", "lora"): ["--precision", "bf16-mixed", "--lora"],
    }
    speed: dict[tuple[str, str], list[float]] = {}
    reruns: list[dict[str, Any]] = []  # failed runs that were rerun (printed as they happen)
    for _ in range(args.repeats):  # alternate, so drifting background load hits all alike
        for key, flags in variants.items():
            figures = finetune(paths, args, reruns, *flags)
            speed.setdefault(key, []).append(figures["useful_tokens_per_s"])
            print(f"  {key}: {speed[key][-1]:,.0f} useful tokens/s", flush=True)
    memory = {key: measure(paths, reruns, *flags) for key, flags in variants.items()}
    no_dropout = measure(paths, reruns, *variants[("bf16-mixed", "lora")], "--lora_dropout", "0")
    rows: list[dict[str, Any]] = []
    for precision in ("fp32", "bf16-mixed"):
        full, lora = (precision, "full"), (precision, "lora")
        rows.append(
            {
                "precision": precision,
                "tokens_per_s": {
                    m: statistics.median(speed[(precision, m)]) for m in ("full", "lora")
                },
                "peak_mib": {m: memory[(precision, m)]["peak"] / MIB for m in ("full", "lora")},
                "state_mib": {m: memory[(precision, m)]["state"] / MIB for m in ("full", "lora")},
                "ratio_tokens_per_s": statistics.median(speed[lora])
                / statistics.median(speed[full]),
                "ratio_peak": memory[lora]["peak"] / memory[full]["peak"],
                "ratio_state": memory[lora]["state"] / memory[full]["state"],
            }
        )
    summary = {
        "setup": f"{NPROC} CPU processes (gloo), Llama 4x256, seq {SEQ}, {PER_DEVICE}/device, "
        f"total {TOTAL}; LoRA r=8 alpha=16 dropout 0.05 on every linear layer of the blocks",
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "repeats": args.repeats,
        "reruns": reruns,
        "rows": rows,
        "bf16_mixed_lora_dropout_0_peak_mib": no_dropout["peak"] / MIB,
    }
    (RESULTS / "lora.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{summary['setup']}; median of {args.repeats} runs x {args.steps} steps")
    print(
        "| precision | tokens/s full | tokens/s LoRA | LoRA/full | peak MiB full | peak MiB LoRA "
        "| LoRA/full | state MiB full | state MiB LoRA | LoRA/full |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        t, p, s = r["tokens_per_s"], r["peak_mib"], r["state_mib"]
        print(
            f"| {r['precision']} | {t['full']:,.0f} | {t['lora']:,.0f} | "
            f"{r['ratio_tokens_per_s']:.2f} | {p['full']:.1f} | {p['lora']:.1f} | "
            f"{r['ratio_peak']:.2f} | {s['full']:.2f} | {s['lora']:.2f} | {r['ratio_state']:.3f} |"
        )
    print(f"bf16-mixed LoRA with --lora_dropout 0: peak {no_dropout['peak'] / MIB:.1f} MiB")


if __name__ == "__main__":
    main()
