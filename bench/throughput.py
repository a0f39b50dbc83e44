"""Throughput benchmark (CPU, 2 processes, gloo) on one tiny model and data set:

(a) tokens/s of chess_finetune.py against a bare FSDP2 loop doing the same work
    (bench/bare_fsdp2.py): what our loop, metrics and checks cost;
(b) useful (non-pad) tokens/s with packing against the original script's pad-per-batch (each
    micro-batch padded to its longest document), both in the bare loop;
(c) chess_finetune.py packed against --no_packing (every document padded to the block length;
    the long set only: the ratio is the data's padding, it hardly moves between rounds);
(d) chess_finetune.py --lora against full fine-tuning (fp32; bench/lora.py --full adds
    bf16-mixed, and measures both kinds of runs' memory).

    python bench/throughput.py                      # make bench: a warm-up round + 3 rounds of
                                                    #   6 timed steps; (a), (b), (d)
    python bench/throughput.py --full               # make bench-full: 5 rounds of 10 steps; + (c)
    python bench/throughput.py --pairs 2 --steps 5  # quick, while developing
    python bench/throughput.py --baseline /tmp/old   # also another checkout's chess_finetune.py

How it measures, so that the figures can be trusted on a shared machine:
- The runs are interleaved: one round runs each configuration once (the order reversed every
  other round, so a drifting background load hits all alike); a first warm-up round is
  discarded, then `--pairs` rounds are measured.
- Every ratio is computed pair by pair (the two runs of one round), then summarised: median and
  min-max over the rounds, as is every figure.
- Within a run, the first `--warmup_steps` steps are not timed; the timed span is wall clock
  over the whole loop for both programs (for chess_finetune.py the time stamps of its
  metrics.jsonl records, so logging, checks and the stop decision are included).
- A run that fails is shown with its command, exit code and stderr, and rerun once; a rerun
  that passes is said so in the output and in the JSON.

Writes bench/results/throughput.json (every run's figures) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.prepare import prepare_dataset
from fsdp_utils.synthetic import build_demo_assets

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SEQ, PER_DEVICE, TOTAL, NPROC = 1024, 2, 8, 2
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

OURS = "chess_finetune.py (packed)"
BARE = "bare FSDP2 loop (packed)"
PAD = "bare FSDP2 loop, pad per batch"
NO_PACKING = "chess_finetune.py --no_packing"
LORA = "chess_finetune.py --lora (packed)"
BASELINE = "baseline checkout's chess_finetune.py (packed)"
RATIOS = {
    "(a) chess_finetune.py / bare FSDP2 loop": (OURS, BARE),
    "(b) packing / pad per batch (bare loop)": (BARE, PAD),
    "(c) packing / --no_packing (chess_finetune.py)": (OURS, NO_PACKING),
    "(d) LoRA / full fine-tuning (chess_finetune.py)": (LORA, OURS),
}


class ChildFailed(RuntimeError):
    pass


def run_child(
    command: list[str], label: str, reruns: list[dict[str, Any]], checkout: Path = REPO
) -> str:
    """Run a benchmark child; on failure show why and rerun it once. Returns its stdout."""
    env = {**ENV, "PYTHONPATH": str(checkout)}
    for attempt in (1, 2):
        result = subprocess.run(command, env=env, cwd=checkout, capture_output=True, text=True)
        if result.returncode == 0:
            if attempt == 2:
                print(f"  {label}: passed on the rerun", flush=True)
                reruns[-1]["rerun_passed"] = True
            return result.stdout
        # torchrun ends with its own report; the worker's error comes before it: show both
        # ends, and keep all of it.
        lines = result.stderr.strip().splitlines()
        shown = lines if len(lines) <= 70 else [*lines[:30], "[...]", *lines[-40:]]
        stderr = "\n".join(shown)
        log = RESULTS / "failures" / f"{time.strftime('%Y%m%d-%H%M%S')}-attempt{attempt}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"{shlex.join(command)}\nexit code {result.returncode}\n{result.stderr}")
        report = (
            f"{label} failed (attempt {attempt} of 2) with exit code {result.returncode}\n"
            f"command: {shlex.join(command)}\n--- stderr (all of it in {log}) ---\n{stderr}"
        )
        print(report, file=sys.stderr, flush=True)
        if attempt == 1:
            reruns.append(
                {
                    "run": label,
                    "exit_code": result.returncode,
                    "stderr": stderr[-6000:],
                    "log": str(log),
                }
            )
            print(f"  {label}: rerunning once", flush=True)
    raise ChildFailed(f"{label} failed twice; see the stderr above.")


def assets() -> dict[str, Path]:
    folder = RESULTS / "assets"
    if not (folder / "model" / "config.json").is_file():
        build_demo_assets(folder, num_games=2000, num_shards=1, hidden_size=256, num_layers=4)
    return {"model": folder / "model", "data": folder / "data"}


def finetune(
    paths: dict[str, Path],
    args: argparse.Namespace,
    reruns: list[dict[str, Any]],
    *extra: str,
    checkout: Path = REPO,
) -> dict[str, float]:
    name = "run" + "".join(extra).replace("-", "_") + ("" if checkout == REPO else "_baseline")
    out = RESULTS / name
    command = [
        TORCHRUN, "--standalone", f"--nproc_per_node={NPROC}", str(checkout / "chess_finetune.py"),
        "--model", str(paths["model"]), "--dataset", str(paths["data"]),
        "--data_cache_dir", str(RESULTS / "prepared"), "--output_dir", str(out),
        "--max_seq_length", str(SEQ), "--batch_size_per_device", str(PER_DEVICE),
        "--total_batch_size", str(TOTAL),
        "--max_training_steps", str(args.steps + args.warmup_steps),
        "--precision", "fp32", "--eval_every", "0", "--eval_batches", "1",
        "--save_every_minutes", "0", "--no_final_save", "--resume", "never", *extra,
    ]  # fmt: skip
    # A fresh folder: metrics.jsonl is appended to, and --resume never leaves old checkpoints.
    shutil.rmtree(out, ignore_errors=True)
    run_child(command, f"{checkout}/chess_finetune.py {' '.join(extra)}", reruns, checkout)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    first, last = train[args.warmup_steps - 1], train[-1]  # log_every 1: one record a step
    assert last["step"] - first["step"] == args.steps, (first["step"], last["step"])
    seconds = last["time"] - first["time"]
    # tokens_seen counts non-pad tokens over all ranks: useful tokens.
    figures = {
        "useful_tokens_per_s": (last["tokens_seen"] - first["tokens_seen"]) / seconds,
        "seconds_per_step": seconds / args.steps,
    }
    if "process_cpu_s" in last:  # not in checkouts older than this benchmark
        cpu = last["process_cpu_s"] - first["process_cpu_s"]
        figures["cpu_seconds_per_step"] = cpu / args.steps
    return figures


def bare(
    paths: dict[str, Path],
    prepared: Path,
    mode: str,
    args: argparse.Namespace,
    reruns: list[dict[str, Any]],
) -> dict[str, float]:
    command = [
        TORCHRUN, "--standalone", f"--nproc_per_node={NPROC}", str(REPO / "bench" / "bare_fsdp2.py"),
        "--model", str(paths["model"]), "--prepared", str(prepared), "--mode", mode,
        "--batch_size_per_device", str(PER_DEVICE), "--accumulation", str(TOTAL // (PER_DEVICE * NPROC)),
        "--seq_len", str(SEQ), "--steps", str(args.steps), "--warmup", str(args.warmup_steps),
    ]  # fmt: skip
    stdout = run_child(command, f"bare_fsdp2.py --mode {mode}", reruns)
    result = json.loads(stdout.strip().splitlines()[-1])
    keys = ("useful_tokens_per_s", "seconds_per_step", "cpu_seconds_per_step")
    return {k: float(result[k]) for k in keys}


Figures = dict[str, float]


def interleaved_rounds(
    measures: dict[str, Callable[[], Figures]], pairs: int
) -> list[dict[str, Figures]]:
    """A warm-up round (discarded), then `pairs` measured rounds; a round runs every
    configuration once, in the reverse order every other round. Raises `ChildFailed`."""
    rounds: list[dict[str, Figures]] = []
    for index in range(pairs + 1):
        order = list(measures) if index % 2 == 0 else list(reversed(measures))
        label = "warm-up round (discarded)" if index == 0 else f"round {index}/{pairs}"
        print(f"{label}: {' -> '.join(order)}", flush=True)
        figures = {}
        for name in order:
            figures[name] = measures[name]()
            print(f"  {name}: {figures[name]['useful_tokens_per_s']:,.0f} useful tokens/s")
        if index > 0:
            rounds.append(figures)
    return rounds


def spread(values: list[float], fmt: str) -> str:
    return (
        f"{statistics.median(values):{fmt}} ({min(values):{fmt}} - {max(values):{fmt}})"
        if values
        else "n/a"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="the long set (make bench-full): 5 measured rounds instead of 3, and --no_packing",
    )
    parser.add_argument(
        "--pairs", type=int, default=None, help="measured rounds after a warm-up (3; --full: 5)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per run (6; --full: 10)"
    )
    parser.add_argument(
        "--warmup_steps", type=int, default=None, help="untimed steps per run (2; --full: 3)"
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout (e.g. the commit before a change): its chess_finetune.py joins "
        "every round, against the bare loop and against this checkout's",
    )
    args = parser.parse_args()
    args.pairs = args.pairs or (5 if args.full else 3)
    args.steps = args.steps or (10 if args.full else 6)
    args.warmup_steps = args.warmup_steps or (3 if args.full else 2)
    if args.pairs < 1 or args.steps < 1 or args.warmup_steps < 1:
        parser.error("--pairs, --steps and --warmup_steps must be at least 1")
    RESULTS.mkdir(parents=True, exist_ok=True)
    paths = assets()
    config = TrainConfig(
        model=str(paths["model"]), dataset=str(paths["data"]), max_seq_length=SEQ,
        data_cache_dir=str(RESULTS / "prepared"),
    )  # fmt: skip
    prepared = prepare_dataset(config, log=lambda _: None)

    reruns: list[dict[str, Any]] = []
    measures: dict[str, Callable[[], dict[str, float]]] = {}
    ratio_pairs = {
        name: pair for name, pair in RATIOS.items() if args.full or NO_PACKING not in pair
    }
    if args.baseline:  # next to OURS in either order, so that (f) compares neighbours
        baseline = args.baseline.resolve()
        measures[BASELINE] = lambda: finetune(paths, args, reruns, checkout=baseline)
        ratio_pairs["(e) baseline checkout / bare FSDP2 loop"] = (BASELINE, BARE)
        ratio_pairs["(f) chess_finetune.py / baseline checkout"] = (OURS, BASELINE)
    measures[OURS] = lambda: finetune(paths, args, reruns)
    measures[BARE] = lambda: bare(paths, prepared, "packed", args, reruns)
    measures[PAD] = lambda: bare(paths, prepared, "pad_per_batch", args, reruns)
    measures[LORA] = lambda: finetune(paths, args, reruns, "--lora")
    if args.full:
        measures[NO_PACKING] = lambda: finetune(paths, args, reruns, "--no_packing")
    try:
        rounds = interleaved_rounds(measures, args.pairs)
    except ChildFailed as err:
        sys.exit(f"error: {err}")

    rates = {n: [r[n]["useful_tokens_per_s"] for r in rounds] for n in measures}
    ratios = {
        name: [r[a]["useful_tokens_per_s"] / r[b]["useful_tokens_per_s"] for r in rounds]
        for name, (a, b) in ratio_pairs.items()
    }
    # The same comparisons in rank 0's CPU seconds per step (higher is better, as above):
    # other processes on a shared machine hardly move it. Only for runs that report it.
    cpu_ratios = {
        name: [r[b]["cpu_seconds_per_step"] / r[a]["cpu_seconds_per_step"] for r in rounds]
        for name, (a, b) in ratio_pairs.items()
        if all("cpu_seconds_per_step" in r[a] and "cpu_seconds_per_step" in r[b] for r in rounds)
        and a.endswith("(packed)")
        and b.endswith("(packed)")
    }
    setup = (
        f"{NPROC} CPU processes (gloo), Llama 4 layers x 256 hidden, seq {SEQ}, "
        f"{PER_DEVICE}/device, total batch {TOTAL}, fp32; {args.pairs} interleaved rounds "
        f"after a warm-up round, {args.steps} timed steps per run after {args.warmup_steps}; "
        "--lora: r 8, alpha 16, dropout 0.05 on every linear layer of the blocks"
    )
    summary = {
        "setup": setup,
        "baseline": str(args.baseline) if args.baseline else None,
        "rounds": rounds,
        "ratios_per_round": ratios,
        "cpu_time_ratios_per_round": cpu_ratios,
        "median_useful_tokens_per_s": {n: statistics.median(v) for n, v in rates.items()},
        "median_ratios": {n: statistics.median(v) for n, v in ratios.items()},
        "reruns": reruns,
    }
    (RESULTS / "throughput.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{setup}\nmedian (min - max) over the rounds:\n")
    print("| run | useful tokens/s |\n|---|---:|")
    for name, values in rates.items():
        print(f"| {name} | {spread(values, ',.0f')} |")
    print("\n| ratio, pair by pair | tokens/s (wall clock) | rank 0 CPU s/step, inverse |")
    print("|---|---:|---:|")
    for name, values in ratios.items():
        print(f"| {name} | {spread(values, '.3f')} | {spread(cpu_ratios.get(name, []), '.3f')} |")
    for rerun in reruns:
        passed = "passed on the rerun" if rerun.get("rerun_passed") else "failed again"
        print(f"\nnote: {rerun['run']} failed once (exit code {rerun['exit_code']}); {passed}")


if __name__ == "__main__":
    main()
