"""The chess recipe of docs/grpo.md on CPU: SFT on games (`make demo`'s run), then GRPO with the
chess rewards, and the learning curves, however far they get in CPU minutes.

    python bench/grpo_chess.py                       # ~10-15 min on 2 busy cores
    python bench/grpo_chess.py --steps 40 --engine_steps 20

1. `python -m fsdp_utils.demo`: the tiny chess model (2 layers, hidden 64) trained for 200
   steps on 3,000 random games (2 processes);
2. prompts: positions of those games after 4 to 40 plies, in the demo's template
   (`python -m fsdp_utils.chess_eval.prompt_set`), 128 held out;
3. GRPO from the SFT model with `chess_legal` (is the next move legal?), 2 processes, G = 8,
   8 prompts per step, 3 new tokens (a move and its space); the held-out prompts' legality,
   sampled at the training temperature and greedy, every 10 steps;
4. GRPO from the SFT model with `chess_engine` (the engine judge's accuracy of the move,
   Stockfish depth 8; 0 for an illegal move), the same way.
Results: bench/results/grpo_chess.json and .md, and grpo_chess.png (the two runs' curves).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def sft(root: Path) -> Path:
    if not (root / "sft" / "final" / "config.json").is_file():
        command = [sys.executable, "-m", "fsdp_utils.demo", "--assets", str(root / "assets"),
                   "--output_dir", str(root / "sft")]  # fmt: skip
        subprocess.run(command, cwd=REPO, env=ENV, check=True)
    return root / "sft" / "final"


def prompts(root: Path) -> Path:
    out = root / "prompts.jsonl"
    if not out.is_file():
        command = [sys.executable, "-m", "fsdp_utils.chess_eval.prompt_set",
                   str(root / "assets" / "data"), str(out), "--per_game", "1",
                   "--max_plies", "40", "--games", "1500"]  # fmt: skip
        subprocess.run(command, cwd=REPO, env=ENV, check=True)
    return out


def grpo(
    root: Path, model: Path, data: Path, name: str, reward: str, steps: int, lr: float = 5e-4
) -> list[dict]:
    out = root / name
    shutil.rmtree(out, ignore_errors=True)
    flags = [
        "--method", "grpo", "--model", str(model), "--dataset", str(data),
        "--data_cache_dir", str(root / "cache"), "--output_dir", str(out),
        "--reward_funcs", reward, "--num_generations", "8", "--max_completion_length", "3",
        "--max_seq_length", "256", "--total_batch_size", "8", "--batch_size_per_device", "4",
        "--max_training_steps", str(steps), "--learning_rate", str(lr), "--warmup_steps", "0",
        "--lr_schedule", "constant", "--precision", "fp32", "--eval_examples", "128",
        "--eval_every", "10", "--eval_batches", "16", "--save_every_minutes", "0",
        "--log_every", "1", "--log_completions_every", "10",
    ]  # fmt: skip
    command = [TORCHRUN, "--standalone", "--nproc_per_node=2", str(REPO / "chess_finetune.py")]
    subprocess.run([*command, *flags], cwd=REPO, env=ENV, check=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(name: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    return {
        "run": name,
        "steps": len(train),
        "train_reward_first": train[0]["reward"],
        "train_reward_last10": sum(r["reward"] for r in train[-10:]) / len(train[-10:]),
        "evals": [
            {"step": e["step"], "sampled": e["eval_reward"], "greedy": e["eval_greedy_reward"]}
            for e in evals
        ],
        "step_seconds": sorted(r["step_time_s"] for r in train)[len(train) // 2],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/grpo-chess"))
    parser.add_argument("--steps", type=int, default=60, help="GRPO steps with chess_legal")
    parser.add_argument("--engine_steps", type=int, default=40, help="with chess_engine")
    args = parser.parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    model = sft(args.root)
    data = prompts(args.root)
    # The SFT model's held-out rewards before any GRPO step: one step at a learning rate that
    # moves nothing, then the run's final evaluation (the trainer evaluates after steps only).
    start = grpo(args.root, model, data, "start", "chess_legal,chess_engine", 1, lr=1e-12)
    before = next(r for r in start if r.get("kind") == "eval")
    runs = {
        "legal": grpo(args.root, model, data, "legal", "chess_legal", args.steps),
        "engine": grpo(args.root, model, data, "engine", "chess_engine", args.engine_steps),
    }
    results = [summary(name, records) for name, records in runs.items()]
    for r, key in zip(results, ("chess_legal", "chess_engine"), strict=True):
        r["evals"].insert(0, {
            "step": 0,
            "sampled": before[f"eval_rewards/{key}/mean"],
            "greedy": before[f"eval_greedy_rewards/{key}/mean"],
        })  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "grpo_chess.json").write_text(json.dumps(results, indent=2))
    plot = [sys.executable, "-m", "fsdp_utils.plot", str(args.root / "legal"),
            str(args.root / "engine"), "-o", str(RESULTS / "grpo_chess.png")]  # fmt: skip
    subprocess.run(plot, cwd=REPO, env=ENV, check=True)
    lines = ["# GRPO on chess, from the demo's SFT model (bench/grpo_chess.py)", ""]
    for r in results:
        lines.append(
            f"{r['run']}: {r['steps']} steps ({r['step_seconds']:.1f} s/step), train reward "
            f"{r['train_reward_first']:.3f} at step 1, {r['train_reward_last10']:.3f} over the "
            "last 10; held-out (sampled / greedy): "
            + ", ".join(f"{e['step']}: {e['sampled']:.3f}/{e['greedy']:.3f}" for e in r["evals"])
        )
    (RESULTS / "grpo_chess.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
