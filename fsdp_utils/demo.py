"""`make demo`: the whole training job on an embedded default, on a laptop or login node.

1. builds a tiny chess model (Llama architecture, 2 layers, hidden 64, 0.14M parameters) with
   a 512-token BPE tokenizer trained on chess moves (most moves are one token, so within a
   minute the model learns which moves tend to be legal where, and the legal-move rate
   visibly rises), and a few thousand random legal games in the laion/strategic_game_chess
   schema (parquet shards), in `demo_assets/` (reused by later runs);
2. runs `chess_finetune.py` under torchrun with 2 CPU processes (gloo) and FSDP2 for 200
   steps, with the chess evaluation every 50;
3. prints what happened: the loss falling, tokens/s, where everything was written, and the
   chess evaluation (fsdp_utils.chess_eval) before and after training: the legal-move rate
   and one continuation written by each model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fsdp_utils.arguments import ArgumentParser

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL: dict[str, Any] = {"hidden_size": 64, "num_layers": 2, "vocab_size": 512}


def build_assets(folder: Path, games: int) -> dict[str, Path]:
    from fsdp_utils.synthetic import build_demo_assets

    stamp = folder / "assets.json"
    wanted = {"games": games, "version": 3, **DEMO_MODEL}
    if stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        print(f"demo: reusing the tiny model and {games:,} games in {folder}")
        return {"model": folder / "model", "data": folder / "data"}
    started = time.perf_counter()
    print(f"demo: playing {games:,} random legal games and training a chess tokenizer ...")
    paths = build_demo_assets(folder, num_games=games, num_shards=2, **DEMO_MODEL)
    stamp.write_text(json.dumps(wanted))
    print(
        f"demo: assets ready in {time.perf_counter() - started:.0f}s: {paths['model']}, {paths['data']}"
    )
    return paths


def training_command(
    paths: dict[str, Path],
    output_dir: Path,
    data_cache: Path,
    steps: int,
    *extra: str,
    nproc: int = 2,
) -> list[str]:
    """The demo's training run (bench/document_masking.py reuses it)."""
    every = str(max(steps // 4, 1))
    return [
        str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={nproc}",
        str(REPO_ROOT / "chess_finetune.py"),
        "--model", str(paths["model"]),
        "--dataset", str(paths["data"]),
        "--output_dir", str(output_dir),
        "--data_cache_dir", str(data_cache),
        "--max_seq_length", "256",
        "--total_batch_size", "16",
        "--batch_size_per_device", "4",
        "--max_training_steps", str(steps),
        "--learning_rate", "3e-3",
        "--warmup_steps", "5",
        "--precision", "fp32",
        "--eval_every", every,
        "--log_every", "20",
        "--save_every_minutes", "0",
        "--save_every_steps", str(steps),
        "--resume", "never",
        "--chess_eval_every", every,
        "--chess_eval_games", "32",
        *extra,
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--games", type=int, default=3000, help="random games to generate")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--nproc", type=int, default=2, help="processes (CPU, gloo)")
    parser.add_argument("--assets", type=Path, default=REPO_ROOT / "demo_assets")
    parser.add_argument("--output_dir", type=Path, default=REPO_ROOT / "runs" / "demo")
    args = parser.parse_args(argv)

    paths = build_assets(args.assets, args.games)
    command = training_command(
        paths, args.output_dir, args.assets / "prepared", args.steps, nproc=args.nproc
    )
    print("demo: " + " ".join(command[:4]) + " ...", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env)
    if result.returncode != 0:
        print(f"demo: training failed (exit {result.returncode})", file=sys.stderr)
        return result.returncode

    records = [
        json.loads(line) for line in (args.output_dir / "metrics.jsonl").read_text().splitlines()
    ]
    # metrics.jsonl is appended to: this run's records follow its last "start".
    starts = [i for i, r in enumerate(records) if r["kind"] == "start"]
    records = records[starts[-1] :] if starts else records
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
    print(chess_before_and_after(paths["model"], args.output_dir))
    return 0


def chess_before_and_after(untrained: Path, run: Path) -> str:
    """The chess evaluation of the untrained model and of final/, on the run's held-out
    games (its config.json), as `python -m fsdp_utils.chess_eval` runs it."""
    from fsdp_utils.chess_eval.cli import evaluate_saved_model

    config = ["--config", str(run / "config.json")]
    before = evaluate_saved_model([str(untrained), *config])["metrics"]
    after = evaluate_saved_model([str(run / "final"), *config])["metrics"]

    def pct(m: dict, key: str) -> str:
        return "n/a" if m[key] is None else f"{100 * m[key]:.1f}%"

    return (
        f"  chess       legal-move rate {pct(before, 'legal_move_rate')} -> "
        f"{pct(after, 'legal_move_rate')} (opening prefixes "
        f"{pct(before, 'legal_move_rate_opening')} -> {pct(after, 'legal_move_rate_opening')}); "
        f"next-move accuracy {pct(before, 'next_move_accuracy')} -> "
        f"{pct(after, 'next_move_accuracy')}\n"
        f"  before      {before['examples'][0].describe(width=40)}\n"
        f"  after       {after['examples'][0].describe(width=40)}\n"
        f"  evaluate    python -m fsdp_utils.chess_eval {run / 'final'}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
