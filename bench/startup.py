"""What a training process's start costs, with Python's cyclic garbage collector on and paused
(fsdp_utils/startup.py): the imports a worker makes and the model built on meta, in fresh
processes, taken in turns.

    python bench/startup.py                  # 7 rounds, a Llama of 22 layers (TinyLlama's shape)
    python bench/startup.py --rounds 3 --json bench/results/startup.json

Each round starts one process per mode; each process reports its own CPU and wall seconds
from its first line to the model on meta. The figures are medians over the rounds, after one
start that is not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# One worker's start, as chess_finetune.py makes it: the entry point, the trainer's imports,
# then transformers' model class and the model on meta (where fsdp_utils/startup.py resumes).
PROBE = """
import json, sys, time
cpu0, wall0 = time.process_time(), time.perf_counter()
from fsdp_utils.startup import pause_collector, resume_collector
if sys.argv[1] == "paused":
    pause_collector()
import fsdp_utils.cli, fsdp_utils.run.session, fsdp_utils.trainer.trainer
from transformers import LlamaConfig
from fsdp_utils.model.build import build_meta_model
config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                     num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
build_meta_model(config, "bf16-mixed")
resume_collector()
print(json.dumps({"cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - wall0}))
"""
MODES = ("on", "paused")


def _start(mode: str) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, cwd=REPO_ROOT
    )
    if result.returncode != 0:
        raise SystemExit(f"the probe failed:\n{result.stderr[-3000:]}")
    sample: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return sample


def measure(rounds: int) -> dict[str, dict[str, float]]:
    _start("on")  # not counted: the first start may compile and read what later ones reuse
    samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for round_ in range(rounds):
        for mode in MODES:
            samples[mode].append(_start(mode))
        print(f"round {round_ + 1}/{rounds}: " + ", ".join(
            f"{mode} {samples[mode][-1]['cpu_s']:.2f} s CPU" for mode in MODES
        ), flush=True)  # fmt: skip
    figures = {
        mode: {
            "cpu_s": statistics.median(s["cpu_s"] for s in runs),
            "wall_s": statistics.median(s["wall_s"] for s in runs),
            "min_cpu_s": min(s["cpu_s"] for s in runs),
        }
        for mode, runs in samples.items()
    }
    # Round by round (the machine's speed drifts less within a round than across them).
    ratios = [
        p["cpu_s"] / o["cpu_s"] for p, o in zip(samples["paused"], samples["on"], strict=True)
    ]
    figures["paused/on"] = {"median_cpu_ratio": statistics.median(ratios)}
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the medians here")
    args = parser.parse_args()
    medians = measure(args.rounds)
    on, paused = medians["on"], medians["paused"]
    print(
        f"start of a worker (imports + model on meta), median of {args.rounds}: "
        f"collector on {on['cpu_s']:.2f} s CPU ({on['wall_s']:.2f} s wall), "
        f"paused {paused['cpu_s']:.2f} s CPU ({paused['wall_s']:.2f} s wall); the least CPU "
        f"{on['min_cpu_s']:.2f} and {paused['min_cpu_s']:.2f} s; paused/on round by round "
        f"(median) {medians['paused/on']['median_cpu_ratio']:.3f}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rounds": args.rounds, **medians}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
