"""What does `--document_masking` cost, and what does it buy?

    python bench/document_masking.py throughput [--steps 15 --repeats 2]   # CPU, 2 processes
    python bench/document_masking.py chess [--seeds 2]                     # CPU, demo setup
    python bench/document_masking.py check [--implementations sdpa,eager,flex_attention]

throughput: useful tokens/s of chess_finetune.py with and without document masking, the setup
    of bench/throughput.py (Llama 4 x 256, 1024-token blocks, 2 per process, 2 gloo processes,
    fp32), runs alternated, medians.
chess: the demo's training (make demo: 3,000 random games, Llama 2 x 64 with a 512-token
    chess tokenizer, 256-token blocks, 200 steps) with and without document masking, per
    seed, then the chess evaluation on 64 held-out games: does the legal-move rate at the
    start of a game improve?
check: for each attention implementation, on this machine's device (CUDA if there is one),
    is a document inside a packed block computed exactly as the document alone (batch of 1
    and of 2 rows), and how fast is a forward+backward with and without document masking on
    a packed 4,096-token block of ~400-token documents (GPU: bf16 Llama, 8 x 1024 hidden).
    Prints a table; this is the command to run on a GPU node.

Writes bench/results/document_masking_<part>.json. CPU timings on a shared machine are noisy:
compare ratios measured in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import (  # bench/ is not a package: its folder is on sys.path
    REPO,
    RESULTS,
    assets,
    finetune,
    run_child,
)

from fsdp_utils.metrics.logger import read_metrics

# --- throughput -------------------------------------------------------------------------


def throughput(steps: int, repeats: int, reruns: list[dict[str, Any]]) -> dict[str, Any]:
    """bench/throughput.py's run of chess_finetune.py (its setup, assets and clock), with and
    without --document_masking."""
    paths = assets()
    args = argparse.Namespace(steps=steps, warmup_steps=3)
    runs: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, extra in {
            "packed, causal": [],
            "packed, document masking": ["--document_masking"],
        }.items():
            figures = finetune(paths, args, reruns, *extra)
            runs.setdefault(name, []).append(figures["useful_tokens_per_s"])
            print(f"  {name}: {runs[name][-1]:,.0f} useful tokens/s", flush=True)
    median = {name: statistics.median(v) for name, v in runs.items()}
    ratio = median["packed, document masking"] / median["packed, causal"]
    print("| run | useful tokens/s |\n|---|---:|")
    for name, value in median.items():
        print(f"| {name} | {value:,.0f} |")
    print(f"document masking / causal: {ratio:.3f}")
    return {"useful_tokens_per_s": median, "runs": runs, "ratio": ratio, "steps": steps}


# --- chess ------------------------------------------------------------------------------


def chess(seeds: int, steps: int, games: int, reruns: list[dict[str, Any]]) -> dict[str, Any]:
    from fsdp_utils.demo import build_assets, training_command

    paths = build_assets(REPO / "demo_assets", 3000)
    rows: dict[str, list[dict[str, Any]]] = {}
    for seed in range(1, seeds + 1):
        for name, extra in {"causal": [], "document masking": ["--document_masking"]}.items():
            out = RESULTS / f"docmask_chess_{len(extra)}_{seed}"
            started = time.perf_counter()
            command = training_command(
                paths, out, REPO / "demo_assets" / "prepared", steps,
                "--seed", str(seed), "--chess_eval_games", str(games), "--no_final_save",
                "--save_every_steps", "0", *extra,
            )  # fmt: skip
            run_child(command, f"demo training {name}, seed {seed}", reruns)
            result = read_metrics(out, "chess_eval")[-1]
            result["eval_loss"] = read_metrics(out, "eval")[-1]["eval_loss"]
            result["wall_s"] = time.perf_counter() - started
            rows.setdefault(name, []).append(result)
            print(
                f"  seed {seed} {name}: legal {result['legal_move_rate']:.3f} (opening "
                f"{result['legal_move_rate_opening']:.3f}), plies {result['mean_legal_plies']:.2f}, "
                f"next-move {result['next_move_accuracy']:.3f}, eval loss {result['eval_loss']:.3f}",
                flush=True,
            )
    keys = ("legal_move_rate", "legal_move_rate_opening", "legal_move_rate_middlegame",
            "legal_move_rate_ending", "mean_legal_plies", "next_move_accuracy", "eval_loss")  # fmt: skip
    summary = {
        name: {k: statistics.mean(r[k] for r in results) for k in keys}
        for name, results in rows.items()
    }
    print("| | " + " | ".join(keys) + " |")
    for name, values in summary.items():
        print(f"| {name} | " + " | ".join(f"{values[k]:.3f}" for k in keys) + " |")
    return {"mean_over_seeds": summary, "runs": rows, "steps": steps, "games": games}


# --- check (run this on a GPU) ----------------------------------------------------------


def check(implementations: list[str], seq: int, doc: int) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp_utils.data.document_masking import document_position_ids

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    hidden, layers = (1024, 8) if cuda else (256, 2)
    config = LlamaConfig(
        initializer_range=0.2,  # sharp attention, so documents that see each other show it
        vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 128 if cuda else 4,
        num_key_value_heads=hidden // 128 if cuda else 4, max_position_embeddings=seq,
    )  # fmt: skip
    torch.manual_seed(0)
    rows = []
    print(
        f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {dtype}, Llama {layers} x {hidden}"
    )
    for impl in implementations:
        # Correctness in fp32 (flash attention needs 16-bit), timing in `dtype`.
        check_dtype = torch.bfloat16 if impl.startswith("flash") else torch.float32
        try:
            model = LlamaForCausalLM._from_config(
                config, attn_implementation=impl, dtype=check_dtype
            )
        except Exception as err:  # an implementation that is not installed
            rows.append({"implementation": impl, "error": f"{type(err).__name__}: {err}"[:200]})
            print(f"{impl}: not available ({rows[-1]['error']})")
            continue
        model.to(device).eval()
        eos = 2
        row: dict[str, Any] = {"implementation": impl}
        with torch.no_grad():
            for rows_in_batch in (1, 2):
                a = torch.randint(3, 1000, (rows_in_batch, 40), device=device)
                b = torch.randint(3, 1000, (rows_in_batch, 24), device=device)
                a[:, -1] = eos
                packed = torch.cat([a, b], dim=1)
                position_ids = document_position_ids(packed, eos)
                together = model(
                    input_ids=packed, position_ids=position_ids, use_cache=False
                ).logits
                leaky = model(input_ids=packed, use_cache=False).logits  # plain causal
                alone = model(input_ids=b, use_cache=False).logits.float()
                diff = (together[:, 40:].float() - alone).abs().max().item()
                leak = (leaky[:, 40:].float() - alone).abs().max().item()
                row[f"max_diff_batch{rows_in_batch}"] = diff
                row[f"leak_diff_batch{rows_in_batch}"] = leak
                # Kept apart: far closer to the document alone than plain causal attention is.
                row[f"separate_batch{rows_in_batch}"] = diff < 0.05 * leak
        model.to(dtype)
        model.train()
        ids = torch.randint(3, 1000, (1, seq), device=device)
        ids[:, doc - 1 :: doc] = eos  # documents of `doc` tokens
        timings = {}
        for name, kwargs in {
            "causal": {},
            "document masking": {"position_ids": document_position_ids(ids, eos)},
        }.items():
            for i in range(6):  # 2 warm-up passes (flex compiles), then 4 timed
                if i == 2:
                    if cuda:
                        torch.cuda.synchronize()
                    started = time.perf_counter()
                loss = model(input_ids=ids, labels=ids, use_cache=False, **kwargs).loss
                loss.backward()
                model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            timings[name] = seq * 4 / (time.perf_counter() - started)
        row["tokens_per_s"] = timings
        row["ratio"] = timings["document masking"] / timings["causal"]
        rows.append(row)
        print(
            f"{impl}: documents kept apart with 1 row: {row['separate_batch1']} (max |diff| "
            f"{row['max_diff_batch1']:.1e}, plain causal {row['leak_diff_batch1']:.1e}); with "
            f"2 rows: {row['separate_batch2']} ({row['max_diff_batch2']:.1e}, "
            f"{row['leak_diff_batch2']:.1e}); fwd+bwd tokens/s causal "
            f"{timings['causal']:,.0f}, document masking {timings['document masking']:,.0f} "
            f"({row['ratio']:.2f}x)",
            flush=True,
        )
        del model
        if cuda:
            torch.cuda.empty_cache()
    return {"device": str(device), "seq": seq, "doc": doc, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=["throughput", "chess", "check"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--games", type=int, default=64)
    parser.add_argument("--implementations", default="sdpa,eager,flex_attention,flash_attention_2")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--doc", type=int, default=400)
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    reruns: list[dict[str, Any]] = []  # failed runs that were rerun (printed as they happen)
    if args.part == "throughput":
        result = throughput(args.steps or 15, args.repeats, reruns)
    elif args.part == "chess":
        result = chess(args.seeds, args.steps or 200, args.games, reruns)
    else:
        result = check(args.implementations.split(","), args.seq, args.doc)
    result["reruns"] = reruns
    (RESULTS / f"document_masking_{args.part}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
