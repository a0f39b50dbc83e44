"""GRPO on this CPU machine: rollout tokens/s against transformers' `generate`, and where a
step's time goes (rollout against update).

    python bench/grpo.py               # make bench: 2 rounds of each, 6 GRPO steps per run
    python bench/grpo.py --full        # make bench-full: 5 rounds, 12 steps
    python bench/grpo.py --rounds 1 --steps 4

The model: a Llama of hidden 256, 4 layers, 8 heads, on the tests' chess tokenizer (512 words),
fp32, randomly initialised (the numbers are about the machinery, not the completions: every
completion runs to the limit, no EOS).

- rollout: 16 prompts x G = 8 (128 rows), 64 new tokens each, sampled at temperature 1.0 in one
  process, no FSDP: `PolicyEngine.generate` (fsdp_utils/parallel/generate.py: a KV cache,
  a generator per row, the draws and each token's log-probability on the CPU, one tiny
  all-reduce per token under torchrun) against transformers' `model.generate(do_sample=True)`
  (its own KV cache and sampling) on the same model and prompts, interleaved rounds, the load
  average recorded. tokens/s counts the new tokens of every row.
- split: `chess_finetune.py --method grpo` for real, 1 process and 2 (FSDP2, gloo): the median
  over the steps after the first of metrics.jsonl's rollout/seconds and update/seconds (the
  update: the old log-probabilities where needed, the forward and backward, the optimizer),
  and their tokens/s.
Results: bench/results/grpo.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
PROMPTS, GENERATIONS, NEW_TOKENS = 16, 8, 64


def assets(root: Path) -> dict[str, Path]:
    """The tests' chess games and tokenizer, a larger model, and prompts from the games."""
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from fsdp_utils.chess_eval.prompt_set import positions, read_games
    from fsdp_utils.config.train_config import DEFAULT_TEMPLATE
    from fsdp_utils.synthetic import build_demo_assets, save_tiny_model

    built = build_demo_assets(root / "assets", num_games=200, num_shards=1)
    tokenizer = AutoTokenizer.from_pretrained(built["model"])
    model = save_tiny_model(
        root / "model", tokenizer, arch="llama", hidden_size=256, num_layers=4, num_heads=8
    )
    rows = positions(
        read_games(built["data"]), template=DEFAULT_TEMPLATE, per_game=2, seed=0, max_plies=12
    )
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"model": model, "prompts": prompts}


def rollout_speed(model_dir: Path, prompts_file: Path, rounds: int) -> dict[str, Any]:
    """New tokens per second, ours and transformers', interleaved."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_utils.parallel.generate import PolicyEngine, RolloutSettings, Sampling, row_seed

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [json.loads(line)["prompt"] for line in prompts_file.read_text().splitlines()]
    encoded = [tokenizer(t)["input_ids"] for t in texts[:PROMPTS]]
    rows = [ids for ids in encoded for _ in range(GENERATIONS)]
    never = len(tokenizer)  # no stop token: every row runs to the limit, in both
    engine = PolicyEngine(
        model,
        RolloutSettings(NEW_TOKENS, (never,), int(tokenizer.pad_token_id), Sampling(1.0)),
        device=torch.device("cpu"),
    )
    seeds = [row_seed(0, i) for i in range(len(rows))]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), int(tokenizer.pad_token_id))
    mask = torch.zeros_like(input_ids)
    for b, ids in enumerate(rows):  # left padding, as both decode
        input_ids[b, width - len(ids) :] = torch.tensor(ids)
        mask[b, width - len(ids) :] = 1

    def ours() -> float:
        started = time.perf_counter()
        with engine.rollout_phase():
            rollout = engine.generate(rows, seeds)
        assert all(n == NEW_TOKENS for n in rollout.lengths)
        return time.perf_counter() - started

    def theirs() -> float:
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0,
                top_k=0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                pad_token_id=int(tokenizer.pad_token_id), eos_token_id=None,
            )  # fmt: skip
        assert out.shape[1] == width + NEW_TOKENS
        return time.perf_counter() - started

    ours(), theirs()  # warm-up
    times: dict[str, list[float]] = {"ours": [], "transformers": []}
    loads = []
    for r in range(rounds):
        order = [("ours", ours), ("transformers", theirs)]
        for name, run in order if r % 2 == 0 else order[::-1]:
            times[name].append(run())
        loads.append(os.getloadavg()[0])
    tokens = len(rows) * NEW_TOKENS
    return {
        "rows": len(rows),
        "new_tokens": NEW_TOKENS,
        "seconds": times,
        "tokens_per_s": {k: tokens / statistics.median(v) for k, v in times.items()},
        "load": loads,
    }


def split(found: dict[str, Path], root: Path, *, nproc: int, steps: int) -> dict[str, Any]:
    """A GRPO run's steps: rollout and update seconds and tokens/s (medians after step 1)."""
    out = root / f"grpo-{nproc}"
    shutil.rmtree(out, ignore_errors=True)
    flags = [
        "--method", "grpo", "--model", str(found["model"]), "--dataset", str(found["prompts"]),
        "--data_cache_dir", str(root / "cache"), "--output_dir", str(out),
        "--reward_funcs", "chess_legal", "--num_generations", str(GENERATIONS),
        "--max_completion_length", "16", "--max_seq_length", "128",
        "--total_batch_size", "8", "--batch_size_per_device", str(8 // nproc),
        "--max_training_steps", str(steps), "--precision", "fp32", "--eval_examples", "0",
        "--save_every_minutes", "0", "--no_final_save", "--log_every", "1",
        "--log_completions_every", "0",
    ]  # fmt: skip
    script = str(REPO / "chess_finetune.py")
    command = [sys.executable, script]
    if nproc > 1:
        command = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", script]
    result = subprocess.run([*command, *flags], capture_output=True, text=True, env=ENV, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"failed: {' '.join(command + flags)}\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"][1:]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in train)

    return {
        "processes": nproc,
        "rollout_s": median("rollout/seconds"),
        "update_s": median("update/seconds"),
        "step_s": median("step_time_s"),
        "rollout_tokens_per_s": median("rollout/tokens_per_s"),
        "update_tokens_per_s": median("update/tokens_per_s"),
        "load": os.getloadavg()[0],
    }


def report(results: dict[str, Any]) -> str:
    speed = results["rollout"]
    ours, theirs = speed["tokens_per_s"]["ours"], speed["tokens_per_s"]["transformers"]
    lines = [
        "# GRPO on CPU (bench/grpo.py)",
        "",
        f"Rollout: {speed['rows']} rows ({PROMPTS} prompts x G {GENERATIONS}), "
        f"{speed['new_tokens']} new tokens each, one process, fp32; load "
        f"{min(speed['load']):.1f}-{max(speed['load']):.1f}.",
        "",
        "| sampler | new tokens/s | seconds (median) |",
        "|---|---|---|",
        f"| PolicyEngine.generate | {ours:,.0f} | {statistics.median(speed['seconds']['ours']):.2f} |",
        f"| transformers generate(do_sample=True) | {theirs:,.0f} | "
        f"{statistics.median(speed['seconds']['transformers']):.2f} |",
        "",
        f"Ours / transformers: {ours / theirs:.2f}x.",
        "",
        "Where a step's time goes (8 prompts x G 8 per step, 16 new tokens at most, "
        "max_seq_length 128; medians after step 1):",
        "",
        "| processes | rollout s | update s | step s | rollout tokens/s | update tokens/s | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["split"]:
        lines.append(
            f"| {row['processes']} | {row['rollout_s']:.2f} | {row['update_s']:.2f} | "
            f"{row['step_s']:.2f} | {row['rollout_tokens_per_s']:,.0f} | "
            f"{row['update_tokens_per_s']:,.0f} | {row['load']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="5 rounds, 12 steps per run")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds or (5 if args.full else 2)
    steps = args.steps or (12 if args.full else 6)
    root = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    try:
        found = assets(root)
        results = {
            "rollout": rollout_speed(found["model"], found["prompts"], rounds),
            "split": [split(found, root, nproc=n, steps=steps) for n in (1, 2)],
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "grpo.json").write_text(json.dumps(results, indent=2))
    text = report(results)
    (RESULTS / "grpo.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
