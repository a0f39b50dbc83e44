"""`make demo`: the whole training job on an embedded default, on a laptop or login node.

1. builds a tiny chess model (Llama architecture, 4 layers, 0.8M parameters) with a
   128-token BPE tokenizer trained on chess moves (small enough that the structure of a move,
   file-rank-file-rank, is learnt within a minute, so the loss visibly falls), and a few thousand random legal games in the laion/strategic_game_chess schema
   (parquet shards), in `demo_assets/` (reused by later runs);
2. runs `chess_finetune.py` under torchrun with 2 CPU processes (gloo) and FSDP2 for a few
   dozen steps;
3. prints what happened: the loss falling, tokens/s, and where everything was written.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def build_assets(folder: Path, games: int) -> dict[str, Path]:
    from fsdp_utils.synthetic import build_demo_assets

    stamp = folder / "assets.json"
    wanted = {"games": games, "version": 2}
    if stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        print(f"demo: reusing the tiny model and {games:,} games in {folder}")
        return {"model": folder / "model", "data": folder / "data"}
    started = time.perf_counter()
    print(f"demo: playing {games:,} random legal games and training a chess tokenizer ...")
    paths = build_demo_assets(
        folder, num_games=games, num_shards=2, hidden_size=128, num_layers=4, vocab_size=128
    )
    stamp.write_text(json.dumps(wanted))
    print(
        f"demo: assets ready in {time.perf_counter() - started:.0f}s: {paths['model']}, {paths['data']}"
    )
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--games", type=int, default=3000, help="random games to generate")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--nproc", type=int, default=2, help="processes (CPU, gloo)")
    parser.add_argument("--assets", type=Path, default=REPO_ROOT / "demo_assets")
    parser.add_argument("--output_dir", type=Path, default=REPO_ROOT / "runs" / "demo")
    args = parser.parse_args(argv)

    paths = build_assets(args.assets, args.games)
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        str(torchrun), "--standalone", f"--nproc_per_node={args.nproc}",
        str(REPO_ROOT / "chess_finetune.py"),
        "--model", str(paths["model"]),
        "--dataset", str(paths["data"]),
        "--output_dir", str(args.output_dir),
        "--data_cache_dir", str(args.assets / "prepared"),
        "--max_seq_length", "256",
        "--total_batch_size", "16",
        "--batch_size_per_device", "4",
        "--max_training_steps", str(args.steps),
        "--learning_rate", "3e-3",
        "--warmup_steps", "5",
        "--precision", "fp32",
        "--eval_every", str(max(args.steps // 3, 1)),
        "--log_every", "5",
        "--save_every_minutes", "0",
        "--save_every_steps", str(args.steps),
        "--resume", "never",
    ]  # fmt: skip
    print("demo: " + " ".join(command[:4]) + " ...", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env)
    if result.returncode != 0:
        print(f"demo: training failed (exit {result.returncode})", file=sys.stderr)
        return result.returncode

    records = [
        json.loads(line) for line in (args.output_dir / "metrics.jsonl").read_text().splitlines()
    ]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    print(
        "\ndemo summary\n"
        f"  train loss  {train[0]['loss']:.3f} (step {train[0]['step']}) -> {train[-1]['loss']:.3f} "
        f"(step {train[-1]['step']})\n"
        f"  eval loss   {evals[0]['eval_loss']:.3f} -> {evals[-1]['eval_loss']:.3f} "
        f"(perplexity {evals[-1]['eval_perplexity']:.1f})\n"
        f"  throughput  {train[-1]['tokens_per_s']:,.0f} tokens/s "
        f"({train[-1]['tokens_per_s_per_device']:,.0f} per process)\n"
        f"  run folder  {args.output_dir}  (config.json, metrics.jsonl, checkpoints/, final/)\n"
        f"  model       from_pretrained('{args.output_dir / 'final'}')"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
