"""Throughput benchmark (CPU, 2 processes, gloo), one run on the same tiny model and data:

(a) tokens/s of chess_finetune.py against a bare FSDP2 loop doing the same work
    (bench/bare_fsdp2.py): what our loop, metrics and checks cost;
(b) useful (non-pad) tokens/s with packing against the seed's pad-per-batch approach (each
    micro-batch padded to its longest document), both in the bare loop, plus chess_finetune.py
    with --no_packing (pad every document to the block length).

    python bench/throughput.py [--steps 20]     # or: make bench

Writes bench/results/throughput.json and prints a table. CPU timings on a shared machine are
noisy: compare ratios measured in one run, not absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from fsdp_utils.config import TrainConfig
from fsdp_utils.data import prepare_dataset
from fsdp_utils.synthetic import build_demo_assets

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SEQ, PER_DEVICE, TOTAL, NPROC = 1024, 2, 8, 2
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def assets() -> dict[str, Path]:
    folder = RESULTS / "assets"
    if not (folder / "model" / "config.json").is_file():
        build_demo_assets(folder, num_games=2000, num_shards=1, hidden_size=256, num_layers=4)
    return {"model": folder / "model", "data": folder / "data"}


def finetune(paths: dict[str, Path], steps: int, *extra: str) -> float:
    out = RESULTS / ("run" + "".join(extra).replace("-", "_"))
    command = [
        TORCHRUN, "--standalone", f"--nproc_per_node={NPROC}", str(REPO / "chess_finetune.py"),
        "--model", str(paths["model"]), "--dataset", str(paths["data"]),
        "--data_cache_dir", str(RESULTS / "prepared"), "--output_dir", str(out),
        "--max_seq_length", str(SEQ), "--batch_size_per_device", str(PER_DEVICE),
        "--total_batch_size", str(TOTAL), "--max_training_steps", str(steps + 3),
        "--precision", "fp32", "--eval_every", "0", "--eval_batches", "1",
        "--save_every_minutes", "0", "--no_final_save", "--resume", "never", *extra,
    ]  # fmt: skip
    subprocess.run(command, check=True, env=ENV, cwd=REPO, capture_output=True)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"][3:]  # skip warm-up steps
    # tokens_per_s counts non-pad tokens over all ranks: useful tokens.
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in train)
    return tokens / sum(r["step_time_s"] for r in train)


def bare(paths: dict[str, Path], prepared: Path, mode: str, steps: int) -> float:
    command = [
        TORCHRUN, "--standalone", f"--nproc_per_node={NPROC}", str(REPO / "bench" / "bare_fsdp2.py"),
        "--model", str(paths["model"]), "--prepared", str(prepared), "--mode", mode,
        "--batch_size_per_device", str(PER_DEVICE), "--accumulation", str(TOTAL // (PER_DEVICE * NPROC)),
        "--seq_len", str(SEQ), "--steps", str(steps),
    ]  # fmt: skip
    out = subprocess.run(command, check=True, env=ENV, cwd=REPO, capture_output=True, text=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["useful_tokens_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2, help="alternate the runs this often")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    paths = assets()
    config = TrainConfig(
        model=str(paths["model"]), dataset=str(paths["data"]), max_seq_length=SEQ,
        data_cache_dir=str(RESULTS / "prepared"),
    )  # fmt: skip
    prepared = prepare_dataset(config, log=lambda _: None)

    runs: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # alternate, so drifting background load hits all alike
        for name, measure in {
            "chess_finetune.py (packed)": lambda: finetune(paths, args.steps),
            "bare FSDP2 loop (packed)": lambda: bare(paths, prepared, "packed", args.steps),
            "bare FSDP2 loop, pad per batch (seed)": lambda: bare(
                paths, prepared, "pad_per_batch", args.steps
            ),
            "chess_finetune.py --no_packing": lambda: finetune(paths, args.steps, "--no_packing"),
        }.items():
            runs.setdefault(name, []).append(measure())
            print(f"  {name}: {runs[name][-1]:,.0f} useful tokens/s", flush=True)
    median = {name: statistics.median(values) for name, values in runs.items()}
    ours, reference = median["chess_finetune.py (packed)"], median["bare FSDP2 loop (packed)"]
    packed, seed = reference, median["bare FSDP2 loop, pad per batch (seed)"]
    summary = {
        "setup": f"{NPROC} CPU processes (gloo), Llama 4x256, seq {SEQ}, {PER_DEVICE}/device, total {TOTAL}, fp32",
        "useful_tokens_per_s": median,
        "ratio_ours_vs_bare": ours / reference,
        "ratio_packing_vs_pad_per_batch": packed / seed,
    }
    (RESULTS / "throughput.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{summary['setup']}; median of {args.repeats} runs x {args.steps} steps")
    print("| run | useful tokens/s |\n|---|---:|")
    for name, value in median.items():
        print(f"| {name} | {value:,.0f} |")
    print(f"\n(a) chess_finetune.py / bare FSDP2 loop: {summary['ratio_ours_vs_bare']:.3f}")
    print(
        f"(b) packing / pad per batch (useful tokens): {summary['ratio_packing_vs_pad_per_batch']:.2f}x"
    )


if __name__ == "__main__":
    main()
