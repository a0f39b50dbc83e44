"""Peak memory and seconds per step against sequence length, the loss in chunks and not.

    python bench/long_context.py            # make bench: 2,048 tokens, 2 chunked/unchunked pairs
    python bench/long_context.py --full     # make bench-full: + 8,192 and 32,768 tokens, chunked
    python bench/long_context.py --lengths 2048 8192 --unchunked_up_to 8192 --pairs 3

The model of issue 31: a 2-layer Llama (hidden 64) with Llama 3's vocabulary of 128,256 words,
fp32, batch 1, one process, 3 optimizer steps of the trainer's own step (train/step.TrainStep)
on random tokens. Each run is its own process, so that its peak resident memory (from
`os.wait4`, as `/usr/bin/time` reads it) is its own; chunked and unchunked runs take turns
(pairs), so that a loaded machine slows both alike. s/step: the mean of steps 2 and 3 (step 1
allocates the optimizer state). Above --unchunked_up_to only the chunked loss runs, once: the
unchunked one took 17.4 GB at 8,192 tokens (issue 31), and at 32,768 its fp32 logits alone take
16.8 GB, their softmax and gradients several times that.
Results: bench/results/long_context.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
VOCAB, HIDDEN, LAYERS, STEPS = 128_256, 64, 2, 3


def child(seq: int, chunk: int) -> None:
    """One run: 3 steps at `seq` tokens, loss chunks of `chunk` (0: unchunked); prints JSON."""
    sys.path.insert(0, str(BENCH.parent))
    import torch
    import transformers

    from fsdp_utils.config.train_config import TrainConfig
    from fsdp_utils.train.step import build_train_step

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=seq, tie_word_embeddings=False,
    )  # fmt: skip
    hf_config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    chunk_size = None if chunk < 0 else chunk  # the default: 64 Mi logits per chunk
    config = TrainConfig(loss_chunk_size=chunk_size, precision="fp32", warmup_steps=0)
    step = build_train_step(
        model, config, world_size=1, device=torch.device("cpu"), hf_config=hf_config
    )
    ids = torch.randint(0, VOCAB, (1, seq))
    times, cpu = [], []
    for index in range(STEPS):
        started, cpu_started = time.perf_counter(), time.process_time()
        metrics = step([{"input_ids": ids, "labels": ids}], step=index + 1)
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    print(
        json.dumps(
            {
                "s_per_step": statistics.mean(times[1:]),
                "cpu_s_per_step": statistics.mean(cpu[1:]),
                "loss": metrics["loss"],
            }
        )
    )


def run(seq: int, chunk: int) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", str(seq), str(chunk)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    out = proc.stdout.read() if proc.stdout else ""
    if status != 0:
        raise SystemExit(f"{' '.join(command)} failed (status {status})")
    return {**json.loads(out), "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="make bench-full: 2k, 8k and 32k")
    parser.add_argument("--lengths", type=int, nargs="+", help="tokens per sequence")
    parser.add_argument(
        "--chunk", type=int, default=-1, help="--loss_chunk_size of the runs (-1: the default)"
    )
    parser.add_argument("--pairs", type=int, default=2, help="chunked/unchunked pairs per length")
    parser.add_argument(
        "--unchunked_up_to", type=int, default=2048, help="longer: one chunked run, no pairs"
    )
    parser.add_argument("--child", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    lengths = args.lengths or ([2048, 8192, 32768] if args.full else [2048])
    rows: list[dict[str, Any]] = []
    for seq in lengths:
        paired = seq <= args.unchunked_up_to
        chunked, unchunked = [], []
        for _ in range(args.pairs if paired else 1):
            chunked.append(run(seq, args.chunk))
            if paired:
                unchunked.append(run(seq, 0))
        row: dict[str, Any] = {"tokens": seq}
        for kind, results in (("chunked", chunked), ("unchunked", unchunked)):
            if results:
                row[f"{kind}_peak_rss_gb"] = max(r["peak_rss_gb"] for r in results)
                row[f"{kind}_s_per_step"] = statistics.median(r["s_per_step"] for r in results)
        if paired:  # pair by pair: unchunked s / chunked s (> 1: chunked faster)
            ratios = [
                u["s_per_step"] / c["s_per_step"] for c, u in zip(chunked, unchunked, strict=True)
            ]
            row["speed_ratios"] = ratios
            row["speed_ratio_median"] = statistics.median(ratios)
            row["speed_ratio_range"] = [min(ratios), max(ratios)]
            cpu_ratios = [
                u["cpu_s_per_step"] / c["cpu_s_per_step"]
                for c, u in zip(chunked, unchunked, strict=True)
            ]
            row["cpu_ratios"] = cpu_ratios
            row["cpu_ratio_median"] = statistics.median(cpu_ratios)
            row["cpu_ratio_range"] = [min(cpu_ratios), max(cpu_ratios)]
            row["loss_relative_gap"] = abs(chunked[0]["loss"] / unchunked[0]["loss"] - 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "long_context.json").write_text(json.dumps(rows, indent=2))
    lines = [
        f"2-layer Llama, hidden {HIDDEN}, vocabulary {VOCAB:,}, fp32, batch 1, 1 process; "
        f"--loss_chunk_size {'default' if args.chunk < 0 else args.chunk}; {args.pairs} pair(s) up to {args.unchunked_up_to:,} "
        "tokens; peak RSS: the largest of the runs, s/step: the median",
        "",
        "| tokens | peak RSS chunked | peak RSS unchunked | s/step chunked | s/step unchunked "
        "| speed chunked/unchunked (range): wall | CPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:

        def cell(key: str, fmt: str, unit: str = "", row: dict[str, Any] = row) -> str:
            return format(row[key], fmt) + unit if key in row else "-"

        ratio = cpu = "-"
        if "speed_ratio_median" in row:
            low, high = row["speed_ratio_range"]
            ratio = f"{row['speed_ratio_median']:.2f} ({low:.2f}-{high:.2f})"
            low, high = row["cpu_ratio_range"]
            cpu = f"{row['cpu_ratio_median']:.2f} ({low:.2f}-{high:.2f})"
        lines.append(
            f"| {row['tokens']:,} | {cell('chunked_peak_rss_gb', '.2f', ' GB')} "
            f"| {cell('unchunked_peak_rss_gb', '.2f', ' GB')} | {cell('chunked_s_per_step', '.2f')} "
            f"| {cell('unchunked_s_per_step', '.2f')} | {ratio} | {cpu} |"
        )
    (RESULTS / "long_context.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
