"""CPU timings of the step levers of issue 60 (docs/levers.md), each against the default run.

    python bench/levers.py                 # 2 measured rounds after a warm-up round, 4 steps
    python bench/levers.py --pairs 3 --steps 10 --seq 1024
    python bench/levers.py --compile       # also the loss's chunks compiled by inductor (its
                                           #   first call compiles: ~30 s of CPU)

**These figures do not predict a GPU's.** On a CPU there is no host-device synchronisation to
save (--sync_free_steps), no separate device memory for FSDP2 to copy into (its copies are
memcpys at CPU speed, not the launches and stream waits they are on a GPU), no float8 matrix
unit (--float8 runs in torchao's emulation, slower by design: not timed here), and the loss's
matrix products are not starved by small chunks as a GPU's are. They show what each lever costs
or saves of the host's own work, and that it runs; the GPU kit's rows (bench/gpu_check.py)
measure the levers where they matter.

Two parts, run on the bench's Llama (4 layers x 256, bench/throughput.py's assets; sequences of
256 tokens: bf16 matrix products on this CPU run at a few hundred tokens/s):

1. training runs (`chess_finetune.py`, bf16-mixed, 2 sequences per device, total batch 8,
   `--log_every 1`): the default run and one run per lever, on 1 process (--fused_optimizer,
   --single_device_path direct, --sync_free_steps) and on 2 (--reshard_last_layer against the
   2-process default), interleaved in rounds (bench/throughput.py's method: a warm-up round
   discarded, the order reversed every other round); figures are rank 0's CPU seconds per step
   and the wall seconds per step, each lever's as a ratio to its default run of the same round;
2. the loss alone (in process): forward and backward of 4,096 target tokens through a
   32,000-word output layer (hidden 512, bf16 weights as under FSDP's policy), in the CPU's
   default chunks (64 Mi logits: 2,097 tokens) and in the GPU's (8,192 tokens: one chunk),
   and with --compile the chunks through inductor: CPU seconds, median of 5.

Writes bench/results/levers.json and prints markdown tables with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import (  # bench/ is not a package: its folder is on sys.path
    RESULTS,
    TORCHRUN,
    ChildFailed,
    assets,
    interleaved_rounds,
    run_child,
    spread,
)

REPO = Path(__file__).resolve().parent.parent
PER_DEVICE, TOTAL = 2, 8
# name: (processes, extra flags, the default run it is compared with)
RUNS: dict[str, tuple[int, tuple[str, ...], str | None]] = {
    "default (1 process)": (1, (), None),
    "--fused_optimizer": (1, ("--fused_optimizer",), "default (1 process)"),
    "--single_device_path direct": (1, ("--single_device_path", "direct"), "default (1 process)"),
    "--sync_free_steps": (1, ("--sync_free_steps",), "default (1 process)"),
    "default (2 processes)": (2, (), None),
    "--reshard_last_layer": (2, ("--reshard_last_layer",), "default (2 processes)"),
}


def training_run(
    name: str, paths: dict[str, Path], args: argparse.Namespace, reruns: list[dict[str, Any]]
) -> dict[str, float]:
    nproc, extra, _ = RUNS[name]
    out = (
        RESULTS
        / "levers"
        / name.replace(" ", "_").replace("-", "").replace("(", "").replace(")", "")
    )
    launcher = (
        [sys.executable] if nproc == 1 else [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}"]
    )
    command = [
        *launcher, str(REPO / "chess_finetune.py"),
        "--model", str(paths["model"]), "--dataset", str(paths["data"]),
        "--data_cache_dir", str(RESULTS / "prepared"), "--output_dir", str(out),
        "--max_seq_length", str(args.seq), "--batch_size_per_device", str(PER_DEVICE),
        "--total_batch_size", str(TOTAL), "--max_training_steps", str(args.steps + args.warmup_steps),
        "--precision", "bf16-mixed", "--eval_every", "0", "--eval_batches", "1",
        "--save_every_minutes", "0", "--no_final_save", "--resume", "never", *extra,
    ]  # fmt: skip
    run_child(command, name, reruns)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    first, last = train[args.warmup_steps - 1], train[-1]
    return {
        "useful_tokens_per_s": (last["tokens_seen"] - first["tokens_seen"])
        / (last["time"] - first["time"]),
        "seconds_per_step": (last["time"] - first["time"]) / args.steps,
        "cpu_seconds_per_step": (last["process_cpu_s"] - first["process_cpu_s"]) / args.steps,
    }


def loss_timings(compile_chunks: bool) -> dict[str, dict[str, float]]:
    """CPU seconds of one forward and backward of the loss, median of 5 after a warm-up."""
    import torch

    from fsdp_utils.train.loss import Targets, chunked_target_nll, default_chunk_size

    torch.manual_seed(0)
    vocab, hidden, tokens = 32_000, 512, 4096
    head = torch.nn.Linear(hidden, vocab, bias=False).to(torch.bfloat16)
    states = torch.randn(1, tokens, hidden, dtype=torch.bfloat16)
    targets = Targets.of(torch.randint(0, vocab, (1, tokens)), tokens)
    cpu_chunk, _ = default_chunk_size(vocab, "cpu")
    gpu_chunk, _ = default_chunk_size(vocab, "cuda")
    cases = {
        f"chunks of {cpu_chunk:,} (the CPU default)": (cpu_chunk, False),
        f"chunks of {gpu_chunk:,} (the GPU default)": (gpu_chunk, False),
    }
    if compile_chunks:
        cases[f"chunks of {cpu_chunk:,}, compiled (inductor)"] = (cpu_chunk, True)
        cases[f"chunks of {gpu_chunk:,}, compiled (inductor)"] = (gpu_chunk, True)
    results: dict[str, dict[str, float]] = {}
    reference: tuple[torch.Tensor, torch.Tensor] | None = None
    for name, (chunk, compiled) in cases.items():
        outcome: list[torch.Tensor] = []

        def once(
            chunk: int = chunk, compiled: bool = compiled, outcome: list[torch.Tensor] = outcome
        ) -> float:
            head.zero_grad()
            h = states.clone().requires_grad_(True)
            started = time.process_time()
            loss = chunked_target_nll(
                head, h, targets, chunk_size=chunk, summed=True, compiled=compiled
            )
            loss.backward()
            seconds = time.process_time() - started
            assert h.grad is not None
            outcome[:] = [loss.detach(), h.grad]
            return seconds

        warm = once()  # with --compile: the compilation
        seconds = [once() for _ in range(5)]
        loss, grad = outcome
        reference = reference or (loss, grad)  # the CPU default's, eager
        results[name] = {
            "cpu_seconds": statistics.median(seconds),
            "first_call_s": warm,
            "loss_relative_difference": float(abs(loss - reference[0]) / reference[0]),
            "grad_relative_difference": float((grad - reference[1]).norm() / reference[1].norm()),
        }
        print(f"  loss, {name}: {statistics.median(seconds):.3f} CPU s", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=2, help="measured rounds after a warm-up")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup_steps", type=int, default=1, help="untimed steps per run")
    parser.add_argument(
        "--seq", type=int, default=256, help="tokens per sequence (bf16 on a CPU is slow)"
    )
    parser.add_argument(
        "--compile", action="store_true", help="also the loss's chunks compiled by inductor"
    )
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    paths = assets()
    reruns: list[dict[str, Any]] = []

    def measure(name: str) -> Callable[[], dict[str, float]]:
        return lambda: training_run(name, paths, args, reruns)

    measures = {name: measure(name) for name in RUNS}
    try:
        rounds = interleaved_rounds(measures, args.pairs)
    except ChildFailed as err:
        sys.exit(f"error: {err}")
    loss = loss_timings(args.compile)
    load_after = os.getloadavg()

    ratios = {
        name: {
            "cpu": [
                r[name]["cpu_seconds_per_step"] / r[base]["cpu_seconds_per_step"] for r in rounds
            ],
            "wall": [r[name]["seconds_per_step"] / r[base]["seconds_per_step"] for r in rounds],
        }
        for name, (_, _, base) in RUNS.items()
        if base is not None
    }
    load = f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after (2 cores)"
    setup = (
        f"Llama 4 layers x 256, seq {args.seq}, {PER_DEVICE}/device, total batch {TOTAL}, bf16-mixed, "
        f"CPU (gloo); {args.pairs} interleaved rounds after a warm-up, {args.steps} timed steps "
        f"per run after {args.warmup_steps}; {load}"
    )
    (RESULTS / "levers.json").write_text(
        json.dumps(
            {"setup": setup, "rounds": rounds, "ratios": ratios, "loss": loss, "reruns": reruns},
            indent=2,
        )
    )
    print(f"\n{setup}\nmedian (min - max) over the rounds; ratios against the default run of the"
          " same round (below 1: the lever takes less)\n")  # fmt: skip
    print("| run | CPU s / step (rank 0) | wall s / step | CPU ratio | wall ratio |")
    print("|---|---:|---:|---:|---:|")
    for name in RUNS:
        cpu = [r[name]["cpu_seconds_per_step"] for r in rounds]
        wall = [r[name]["seconds_per_step"] for r in rounds]
        ratio = ratios.get(name)
        cells = (spread(ratio["cpu"], ".3f"), spread(ratio["wall"], ".3f")) if ratio else ("1", "1")
        print(
            f"| {name} | {spread(cpu, '.3f')} | {spread(wall, '.3f')} | {cells[0]} | {cells[1]} |"
        )
    print(
        "\n| the loss (4,096 targets, 32,000 words, hidden 512, bf16) | CPU s, forward + backward "
        "| loss, gradient: relative difference to the first row |"
    )
    print("|---|---:|---|")
    for name, figures in loss.items():
        differences = (
            f"{figures['loss_relative_difference']:.1e}, {figures['grad_relative_difference']:.1e}"
        )
        print(f"| {name} | {figures['cpu_seconds']:.3f} | {differences} |")


if __name__ == "__main__":
    main()
