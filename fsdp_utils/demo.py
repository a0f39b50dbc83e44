"""`make demo`: the whole training job on an embedded default, on a laptop or login node.

1. builds a tiny chess model (Llama architecture, 2 layers, hidden 64, 0.14M parameters) with
   a 512-token BPE tokenizer trained on chess moves (most moves are one token, so within a
   minute the model learns which moves tend to be legal where, and the legal-move rate
   visibly rises), and its games in the laion/strategic_game_chess schema (parquet shards), in
   `demo_assets/` (reused by later runs): with Stockfish, the 1,500 engine self-play games
   shipped in `fsdp_utils/chess_eval/engine_games/` (Stockfish 15.1 at depth 1 from random
   4-8-ply openings; `python -m fsdp_utils.chess_eval.selfplay --games 1500 --seed 0 --depth 1`
   makes them), so the model learns to play, not only to move; without one, 3,000 random legal
   games, and the demo says so in one line;
2. runs `chess_finetune.py` under torchrun with 2 CPU processes (gloo) and FSDP2 for 200
   steps, with the chess evaluation every 50 (the engine judge at depth 6 when there is one);
3. prints what happened: the loss falling, tokens/s, where everything was written, and the
   chess evaluation (fsdp_utils.chess_eval) before and after training: the legal-move rate,
   the engine's centipawn loss and accuracy of the legal moves, and one continuation written
   by each model.
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
# Made by `python -m fsdp_utils.chess_eval.selfplay --games 1500 --seed 0 --depth 1
# --output fsdp_utils/chess_eval/engine_games` (selfplay.json there says with which engine).
ENGINE_GAMES = Path(__file__).resolve().parent / "chess_eval" / "engine_games"
DEMO_ENGINE_DEPTH = 6  # the judge's depth in the demo: ~1 s per evaluation on 2 cores


def find_demo_engine() -> str | None:
    """Stockfish, or None with the one line that says the demo shows legality only."""
    from fsdp_utils.chess_eval.judge import EngineNotFound, find_engine

    try:
        return find_engine()
    except EngineNotFound:
        print(
            "demo: no Stockfish found (conda install -c conda-forge stockfish, or apt-get "
            "install stockfish): training on random games, legality only, no engine judge"
        )
        return None


def engine_games() -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return [
        row
        for path in sorted(ENGINE_GAMES.glob("chess_game_*.parquet"))
        for row in pq.read_table(path).to_pylist()
    ]


def build_assets(folder: Path, games: int, *, engine: bool = False) -> dict[str, Path]:
    from fsdp_utils.synthetic import build_demo_assets

    stamp = folder / "assets.json"
    source = "engine" if engine else "random"
    wanted = {"games": games, "source": source, "version": 5, **DEMO_MODEL}
    played = engine_games() if engine else None
    what = f"{len(played):,} engine self-play games" if played else f"{games:,} random legal games"
    if stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        print(f"demo: reusing the tiny model and {what} in {folder}")
        return {"model": folder / "model", "data": folder / "data"}
    started = time.perf_counter()
    print(f"demo: {'reading' if played else 'playing'} {what} and training a chess tokenizer ...")
    paths = build_demo_assets(folder, num_games=games, num_shards=2, games=played, **DEMO_MODEL)
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
    parser.add_argument(
        "--games", type=int, default=3000, help="random games to generate (without Stockfish)"
    )
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--nproc", type=int, default=2, help="processes (CPU, gloo)")
    parser.add_argument("--assets", type=Path, default=REPO_ROOT / "demo_assets")
    parser.add_argument("--output_dir", type=Path, default=REPO_ROOT / "runs" / "demo")
    args = parser.parse_args(argv)

    engine = find_demo_engine()
    paths = build_assets(args.assets, args.games, engine=engine is not None)
    judge = ["--chess_eval_depth", str(DEMO_ENGINE_DEPTH)] if engine else []
    command = training_command(
        paths, args.output_dir, args.assets / "prepared", args.steps, *judge, nproc=args.nproc
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
        f"{strength_before_and_after(before, after)}"
        f"  before      {before['examples'][0].describe(width=40)}\n"
        f"  after       {after['examples'][0].describe(width=40)}\n"
        f"  evaluate    python -m fsdp_utils.chess_eval {run / 'final'}\n"
        f"  next        a model that plays (more data, SFT, GRPO, masked games against "
        f"Stockfish, ~1 h on 2 cores): python bench/chess_recipe.py (docs/chess-eval.md)"
    )


def strength_before_and_after(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The engine judge's lines of the summary (empty without an engine): the headline strength
    over every judged move (an illegal one scored as the worst), then the legal moves' own, each
    with its standard error and the moves and distinct positions it rests on."""
    from fsdp_utils.chess_eval.judge import CP_CEILING

    if "engine" not in after:
        return ""
    if before.get("engine_error") or after.get("engine_error"):
        return f"  strength    the engine judge failed: {after.get('engine_error') or before.get('engine_error')}\n"

    def fig(m: dict[str, Any], key: str, fmt: str) -> str:
        if m.get(key) is None:
            return "n/a"
        se = m.get(f"{key}_se")
        return format(m[key], fmt) + (f" ± {format(se, fmt)}" if se is not None else "")

    def counts(m: dict[str, Any]) -> str:
        return f"{m['engine_moves']} legal of {m['engine_moves'] + m['engine_illegal']}"

    return (
        f"  strength    {after['engine']} at depth {after['engine_depth']} on "
        f"{after['engine_positions']} distinct held-out positions, every move counted (an "
        f"illegal one as the worst, {CP_CEILING} cp): centipawn loss "
        f"{fig(before, 'engine_all_centipawn_loss', '.0f')} -> "
        f"{fig(after, 'engine_all_centipawn_loss', '.0f')}, accuracy "
        f"{fig(before, 'engine_all_accuracy', '.0f')}% -> "
        f"{fig(after, 'engine_all_accuracy', '.0f')}%\n"
        f"  legal only  its legal moves alone ({counts(before)} -> {counts(after)}): centipawn "
        f"loss {fig(before, 'engine_centipawn_loss', '.0f')} -> "
        f"{fig(after, 'engine_centipawn_loss', '.0f')}, accuracy "
        f"{fig(before, 'engine_accuracy', '.0f')}% -> {fig(after, 'engine_accuracy', '.0f')}%, "
        f"best move {pct_of(before, 'engine_best_move_rate')} -> "
        f"{pct_of(after, 'engine_best_move_rate')}\n"
    )


def pct_of(m: dict[str, Any], key: str) -> str:
    return "n/a" if m.get(key) is None else f"{100 * m[key]:.0f}%"


if __name__ == "__main__":
    raise SystemExit(main())
