"""Sequence parallelism on this CPU machine: peak memory per process and tokens/s, N = 1 and 2.

    python bench/sequence_parallel.py             # make bench: memory at 8k, speed at 4k (1 round)
    python bench/sequence_parallel.py --full      # make bench-full: memory at 16k and 32k too,
                                                  #   3 rounds of speed
    python bench/sequence_parallel.py --lengths 16384 --rounds 1 --speed_length 0

The model: a Llama of hidden 256, 2 layers, 8 heads (4 key-value heads), intermediate 512,
on the tests' chess tokenizer (512 words, so that the logits weigh little), fp32, no activation
checkpointing: at these lengths its activations are most of a process's memory (the
parameters take 5 MB). Each run is chess_finetune.py for real (the trainer's own peak RSS per
step, metrics.jsonl's host_peak_rss_gib, reset every step; tokens/s over the steps after the
first), one sequence per step per data-parallel rank:

- memory: N = 1 on 1 process against N = 2 on 2 processes, each at the same length (glibc's
  malloc told to map every block above 64 KiB: `MEMORY_ENV`); the
  activations' part is a step's peak minus the same run's peak at 256 tokens (what does not
  grow with the length: interpreter, torch, the model, the optimizer state; the data is
  prepared beforehand, so no run's memory holds its preparation);
- speed: the same 2 processes as 2 data-parallel ranks (N = 1, 2 sequences per step) against
  one sequence-parallel group (N = 2, 1 sequence per step), and 1 process (N = 1) for scale, at
  a length all fit; interleaved rounds (the order reversed every other round), the load
  average recorded. On 2 CPU cores gloo's all-to-alls go through shared memory: GPU figures
  (NVLink, InfiniBand) are not measured here.
Results: bench/results/sequence_parallel.json and .md.
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
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
GIB = 1024**3
# Memory runs: every allocation above 64 KiB gets its own mapping, returned to the system when
# freed. glibc's default threshold grows with the largest block freed (up to 32 MiB), after
# which freed tensors stay in the heap and the resident size follows the heap's history more
# than the tensors alive (seen here: 32k tokens at N = 2 read 0.74 of N = 1's instead of ~0.5).
MEMORY_ENV = {**ENV, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


def assets(root: Path, max_positions: int) -> dict[str, Path]:
    """The tests' chess games and tokenizer (enough games for a few 32k blocks), and the model."""
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from fsdp_utils.synthetic import build_demo_assets, save_tiny_model

    built = build_demo_assets(root / "assets", num_games=1200, num_shards=2)
    tokenizer = AutoTokenizer.from_pretrained(built["model"])
    model = save_tiny_model(
        root / "model", tokenizer, arch="llama", hidden_size=256, num_layers=2, num_heads=8,
        max_positions=max_positions,
    )  # fmt: skip
    return {"model": model, "data": built["data"]}


def prepare(found: dict[str, Path], root: Path, lengths: list[int]) -> None:
    """The prepared blocks of every length, made here once: the runs find them cached."""
    sys.path.insert(0, str(REPO))
    from fsdp_utils.config.train_config import TrainConfig
    from fsdp_utils.data.prepare import prepare_dataset

    for length in lengths:
        config = TrainConfig(
            model=str(found["model"]), dataset=str(found["data"]), dataset_include="",
            data_cache_dir=str(root / "cache"), max_seq_length=length, eval_examples=0,
        )  # fmt: skip
        prepare_dataset(config, log=lambda _: None)


def run(
    found: dict[str, Path],
    root: Path,
    *,
    nproc: int,
    size: int,
    length: int,
    steps: int,
    env: dict[str, str] = ENV,
) -> dict[str, Any]:
    """One chess_finetune.py run: its steps' records."""
    out = root / f"run-{nproc}-{size}-{length}"
    shutil.rmtree(out, ignore_errors=True)
    flags = [
        "--model", str(found["model"]), "--dataset", str(found["data"]), "--dataset_include", "",
        "--data_cache_dir", str(root / "cache"), "--output_dir", str(out),
        "--max_seq_length", str(length), "--batch_size_per_device", "1",
        "--total_batch_size", str(nproc // size), "--sequence_parallel", str(size),
        "--max_training_steps", str(steps), "--precision", "fp32", "--eval_examples", "0",
        "--save_every_minutes", "0", "--no_final_save", "--warmup_steps", "0",
    ]  # fmt: skip
    script = str(REPO / "chess_finetune.py")
    command = [sys.executable, script] if nproc == 1 else [TORCHRUN, "--standalone"]
    if nproc > 1:
        command += [f"--nproc_per_node={nproc}", script]
    result = subprocess.run([*command, *flags], capture_output=True, text=True, env=env, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"failed: {' '.join(command + flags)}\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"steps": [r for r in records if r.get("kind") == "train"]}


BASELINE = 256  # tokens: a run whose activations are next to nothing


def step_peak(found: dict[str, Path], root: Path, *, nproc: int, size: int, length: int) -> float:
    """Rank 0's peak RSS in the second step (the optimizer state exists by then), GiB."""
    steps = run(found, root, nproc=nproc, size=size, length=length, steps=2, env=MEMORY_ENV)[
        "steps"
    ]
    return float(steps[-1]["host_peak_rss_gib"])


def memory(found: dict[str, Path], root: Path, lengths: list[int]) -> list[dict[str, Any]]:
    rows = []
    for nproc, size in ((1, 1), (2, 2)):
        base = step_peak(found, root, nproc=nproc, size=size, length=BASELINE)
        for length in lengths:
            peak = step_peak(found, root, nproc=nproc, size=size, length=length)
            rows.append({
                "tokens": length, "sequence_parallel": size, "processes": nproc,
                "peak_rss_gib": peak, "baseline_peak_rss_gib": base,
                "activations_gib": peak - base, "load": os.getloadavg(),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return sorted(rows, key=lambda r: (r["tokens"], r["sequence_parallel"]))


def speed(found: dict[str, Path], root: Path, length: int, rounds: int) -> list[dict[str, Any]]:
    """tokens/s and rank 0's CPU seconds per step over steps 2.., interleaved rounds."""
    kinds = [(1, 1), (2, 1), (2, 2)]  # (processes, N)
    rows: list[dict[str, Any]] = []
    for index in range(rounds):
        for nproc, size in kinds if index % 2 == 0 else list(reversed(kinds)):
            every = run(found, root, nproc=nproc, size=size, length=length, steps=4)["steps"]
            steps = every[1:]  # the first allocates the optimizer state
            seconds = sum(s["step_time_s"] for s in steps)
            tokens = every[-1]["tokens_seen"] - every[0]["tokens_seen"]
            cpu = [b["process_cpu_s"] - a["process_cpu_s"] for a, b in itertools.pairwise(steps)]
            rows.append({
                "round": index, "tokens": length, "processes": nproc, "sequence_parallel": size,
                "tokens_per_s": tokens / seconds, "s_per_step": seconds / len(steps),
                "rank0_cpu_s_per_step": statistics.mean(cpu), "load": os.getloadavg(),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def table(mem: list[dict[str, Any]], fast: list[dict[str, Any]]) -> str:
    lines = [
        f"| tokens | N | processes | peak RSS per process | peak at {BASELINE} tokens | "
        "activations (the difference) | load (1 min) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in mem:
        lines.append(
            f"| {r['tokens']:,} | {r['sequence_parallel']} | {r['processes']} | "
            f"{r['peak_rss_gib']:.2f} GiB | {r['baseline_peak_rss_gib']:.2f} GiB | "
            f"{r['activations_gib']:.2f} GiB | {r['load'][0]:.1f} |"
        )
    for length in sorted({r["tokens"] for r in mem}):
        pair = {r["sequence_parallel"]: r for r in mem if r["tokens"] == length}
        if 1 in pair and 2 in pair:
            ratio = pair[2]["activations_gib"] / pair[1]["activations_gib"]
            lines.append(
                f"\n{length:,} tokens: activations per process at N = 2 / N = 1: {ratio:.2f}"
            )
    if fast:
        lines += [
            "",
            "| processes | N | sequences per step | tokens/s (median, min - max) | s/step | "
            "rank 0 CPU s/step | load (1 min) |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for nproc, size in sorted({(r["processes"], r["sequence_parallel"]) for r in fast}):
            mine = [r for r in fast if (r["processes"], r["sequence_parallel"]) == (nproc, size)]
            rates = [r["tokens_per_s"] for r in mine]
            lines.append(
                f"| {nproc} | {size} | {nproc // size} | {statistics.median(rates):,.0f} "
                f"({min(rates):,.0f} - {max(rates):,.0f}) | "
                f"{statistics.median(r['s_per_step'] for r in mine):.2f} | "
                f"{statistics.median(r['rank0_cpu_s_per_step'] for r in mine):.2f} | "
                f"{statistics.median(r['load'][0] for r in mine):.1f} |"
            )
        lines.append(f"\nat {fast[0]['tokens']:,} tokens per sequence, {len(fast) // 3} round(s)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="make bench-full: 16k and 32k too")
    parser.add_argument("--lengths", type=int, nargs="*", help="memory at these lengths")
    parser.add_argument("--speed_length", type=int, default=4096, help="0: no speed rounds")
    parser.add_argument("--rounds", type=int, help="speed rounds (default 1; --full: 3)")
    args = parser.parse_args()
    lengths = args.lengths or ([8192, 16384, 32768] if args.full else [8192])
    rounds = args.rounds or (3 if args.full else 1)
    with tempfile.TemporaryDirectory(prefix="bench-sp-") as folder:
        root = Path(folder)
        found = assets(root, max([*lengths, args.speed_length]))
        prepare(found, root, sorted({BASELINE, *lengths, args.speed_length} - {0}))
        mem = memory(found, root, lengths)
        fast = speed(found, root, args.speed_length, rounds) if args.speed_length else []
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sequence_parallel.json").write_text(
        json.dumps({"memory": mem, "speed": fast}, indent=1)
    )
    text = table(mem, fast)
    (RESULTS / "sequence_parallel.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
