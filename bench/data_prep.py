"""How fast are chat rows prepared, and how much does packing them waste?

    python bench/data_prep.py                    # 20,000 rows, 3 measured rounds
    python bench/data_prep.py --rows 5000 --repeats 1
    python bench/data_prep.py --scale 200000,1000000,2000000            # peak memory by size
    python bench/data_prep.py --scale 200000,1000000,2000000 --shape text

rate: rows/s to render, mask and tokenise N chat rows (ChatML template without generation
    markers: every answer found in the one rendering by its character offsets), against a bare
    `tokenizer.apply_chat_template(batch, tokenize=True)` pass over the same rows, in batches
    of 256 as `datasets.map` gives them:
    - bare: apply_chat_template, one process: the floor any chat preparation pays;
    - encode: the preparation's map function (fsdp_utils.data.rows.RowEncoder: render, locate
      each answer by offsets, mask, the long-row rule) called in this process;
    - map, --num_proc 1 and 2: `Dataset.map` of that function, as `prepare_dataset` runs it
      (Arrow conversion, worker start-up and transfer included);
    - prepare, --num_proc 1 and 2: `prepare_dataset` end to end from a jsonl file (load,
      split, encode, pack, write), the cache emptied before each run.
waste: the padding fraction of the same rows packed into blocks of 1024, 2048 and 4096
    tokens: best-fit decreasing (ours), next-fit in row order (a new block whenever the next
    row does not fit: what a simple packer does), one row per block (--no_packing).

How it measures on a shared machine: rounds interleave every variant (the order reversed every
other round) after one discarded warm-up round; one-process figures are CPU seconds of this
process (time.process_time, TOKENIZERS_PARALLELISM=false so the tokenizer runs on one thread),
multi-process figures are wall-clock seconds (and the CPU seconds of this process and its
children beside them). Medians over the rounds; ratios per round, then their median.

The tokenizer is a byte-level BPE (4,000 tokens) trained on the synthetic conversations, the
rows a mix of 1-3 user/assistant turns, half with a system message, message lengths drawn
from a log-normal (median 40 words). Writes bench/results/data_prep.json.

scale (--scale N1,N2,N3): the whole preparation (`python -m fsdp_utils.data`, the command of
slurm/prepare.sh, and the trainer's preparation) of N chat rows of one user and one assistant
message of 40-60 random words each (~112 tokens a row; drawn from 50,000 such messages), or with --shape text N `text` rows of
the same words, each size in a fresh process: rows, tokens, wall seconds and the process's
peak RSS (wait4's ru_maxrss), and the growth of the peak from the smallest size to the
largest. Peak memory does not depend on the machine's load; seconds do. Writes
bench/results/data_prep_scale_<shape>_<num_proc>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.chat import ChatTemplate
from fsdp_utils.data.packing import best_fit_decreasing
from fsdp_utils.data.prepare import prepare_dataset
from fsdp_utils.data.rows import ROW_INDEX, RowEncoder
from fsdp_utils.synthetic import (
    CHATML_TEMPLATE,
    chat_tokenizer,
    random_words,
    save_tiny_model,
    train_chat_tokenizer,
)

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 256


def conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)

    def words() -> int:
        return max(1, min(400, round(rng.lognormvariate(math.log(40), 0.8))))

    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": random_words(rng, words())}] if i % 2 else []
        for _ in range(rng.choice((1, 1, 2, 3))):
            messages.append({"role": "user", "content": random_words(rng, words())})
            messages.append({"role": "assistant", "content": random_words(rng, words())})
        rows.append(messages)
    return rows


def children_cpu_seconds() -> float:
    """CPU time of this process's finished children (the map workers)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


def timed(run: Callable[[], Any], num_proc: int) -> dict[str, float]:
    """CPU seconds of this process and of its workers, wall seconds, and the CPU critical
    path: this process's CPU plus the workers' spread over `num_proc` cores, i.e. the wall
    time with a core for each process (what a shared machine's clock cannot show)."""
    own, workers, wall = time.process_time(), children_cpu_seconds(), time.perf_counter()
    run()
    own, workers = time.process_time() - own, children_cpu_seconds() - workers
    return {
        "cpu_s": own + workers,
        "wall_s": time.perf_counter() - wall,
        "critical_path_s": own + workers / num_proc,
    }


def waste(lengths: np.ndarray, block: int) -> dict[str, float]:
    lengths = lengths[lengths <= block]
    total = int(lengths.sum())
    bins, _ = best_fit_decreasing(lengths, block)
    best = int(bins.max()) + 1
    next_fit, free = 0, 0
    for n in lengths:
        if n > free:
            next_fit, free = next_fit + 1, block
        free -= int(n)
    return {
        "rows": len(lengths),
        "best_fit_decreasing": 1 - total / (best * block),
        "next_fit_in_order": 1 - total / (next_fit * block),
        "one_row_per_block": 1 - total / (len(lengths) * block),
    }


def write_rows(path: Path, n: int, shape: str, seed: int = 0) -> None:
    """N rows of the scale table's shape, written as they are made (the bench's own memory
    stays flat too). Messages are drawn from a pool of 50,000, so that millions of rows take
    seconds to write, not minutes."""
    rng = random.Random(seed)
    pool = [random_words(rng, rng.randint(40, 60)) for _ in range(50_000)]
    with open(path, "w") as f:
        for _ in range(n):
            question, answer = rng.choice(pool), rng.choice(pool)
            if shape == "text":
                row: dict[str, Any] = {"text": f"{question}\n{answer}"}
            else:
                row = {
                    "messages": [
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": answer},
                    ]
                }
            f.write(json.dumps(row) + "\n")


def scale(sizes: list[int], shape: str, num_proc: int, repo: Path) -> None:
    import subprocess
    import sys

    work = Path(tempfile.mkdtemp(prefix="bench-data-scale-"))
    tokenizer = chat_tokenizer("chatml", base=train_chat_tokenizer(vocab_size=4000))
    model = save_tiny_model(work / "model", tokenizer)
    table = []
    for n in sizes:
        data = work / f"{shape}-{n}.jsonl"
        write_rows(data, n, shape)
        cache = work / f"prepared-{n}"
        # prepare_dataset as the trainer and download_models.py --prepare call it; importable
        # from an older checkout too (--repo), to compare.
        code = (
            "from fsdp_utils.config.train_config import TrainConfig\n"
            "from fsdp_utils.data.prepare import prepare_dataset\n"
            f"prepare_dataset(TrainConfig(model={str(model)!r}, dataset={str(data)!r}, "
            f"data_cache_dir={str(cache)!r}, max_seq_length=2048, eval_examples=200, "
            f"num_proc={num_proc}))"
        )
        command = [sys.executable, "-c", code]
        started = time.perf_counter()
        child = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=repo
        )
        output = child.stdout.read() if child.stdout else ""
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = status  # reaped here: Popen must not wait for it again
        seconds = time.perf_counter() - started
        if status != 0:
            raise SystemExit(f"preparing {n:,} rows failed:\n{output}")
        meta = json.loads(next(cache.glob("*/meta.json")).read_text())["stats"]
        tokens = sum(meta[s]["tokens"] for s in ("train", "eval") if s in meta)
        peak = usage.ru_maxrss / 2**20  # KiB -> GiB
        table.append({"rows": n, "tokens": tokens, "seconds": seconds, "peak_rss_gib": peak})
        print(
            f"{n:,} rows: {tokens:,} tokens, {seconds:.0f} s, peak RSS {peak:.2f} GiB", flush=True
        )
        data.unlink()
        shutil.rmtree(cache, ignore_errors=True)
    print(f"\n{shape} rows, --num_proc {num_proc}:\n")
    print("| rows | tokens | seconds | tokens/s | peak RSS |\n|---:|---:|---:|---:|---:|")
    for row in table:
        print(
            f"| {row['rows']:,} | {row['tokens'] / 1e6:.1f} M | {row['seconds']:.0f} | "
            f"{row['tokens'] / row['seconds']:,.0f} | {row['peak_rss_gib']:.2f} GiB |"
        )
    growth = table[-1]["peak_rss_gib"] / table[0]["peak_rss_gib"] - 1
    print(
        f"\npeak RSS growth from {table[0]['rows']:,} to {table[-1]['rows']:,} rows: "
        f"{100 * growth:+.0f}%"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"data_prep_scale_{shape}_{num_proc}.json"
    summary = {"shape": shape, "num_proc": num_proc, "sizes": table, "growth": growth}
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds (+1 warm-up)")
    parser.add_argument("--scale", default=None, help="row counts, comma-separated")
    parser.add_argument("--shape", choices=("chat", "text"), default="chat", help="with --scale")
    parser.add_argument("--num_proc", type=int, default=1, help="with --scale")
    parser.add_argument(
        "--repo", type=Path, default=Path(__file__).resolve().parent.parent,
        help="with --scale: the checkout whose preparation runs (another one, to compare)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.scale:
        scale([int(n) for n in args.scale.split(",")], args.shape, args.num_proc, args.repo)
        return
    # One-process figures on one thread (the tokenizer reads this when it first encodes).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import datasets

    datasets.disable_progress_bars()
    work = Path(tempfile.mkdtemp(prefix="bench-data-prep-"))
    tokenizer = chat_tokenizer("chatml", base=train_chat_tokenizer(vocab_size=4000))
    model = save_tiny_model(work / "model", tokenizer)
    rows = conversations(args.rows)
    data = work / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    dataset = datasets.Dataset.from_list([{"messages": m} for m in rows])
    dataset = dataset.add_column(ROW_INDEX, np.arange(len(dataset)))
    encoder = RowEncoder(
        "chat", tokenizer, 1 << 20, "drop", template=ChatTemplate(CHATML_TEMPLATE, "ChatML")
    )
    columns = dataset.to_dict()

    def bare() -> None:
        for i in range(0, len(rows), BATCH):
            tokenizer.apply_chat_template(rows[i : i + BATCH], tokenize=True)

    def encode() -> None:
        for i in range(0, len(rows), BATCH):
            encoder({k: v[i : i + BATCH] for k, v in columns.items()})

    def mapped(num_proc: int) -> Callable[[], None]:
        def run() -> None:
            dataset.map(
                encoder, batched=True, batch_size=BATCH, remove_columns=dataset.column_names,
                num_proc=num_proc, new_fingerprint=f"bench-{time.perf_counter_ns()}",
                keep_in_memory=True,
            )  # fmt: skip

        return run

    def prepared(num_proc: int) -> Callable[[], None]:
        cache = work / f"prepared-{num_proc}"

        def run() -> None:
            shutil.rmtree(cache, ignore_errors=True)
            config = TrainConfig(
                model=str(model), dataset=str(data), data_cache_dir=str(cache),
                max_seq_length=4096, eval_examples=0, num_proc=num_proc,
            )  # fmt: skip
            prepare_dataset(config, log=lambda _: None)

        return run

    variants: dict[str, Callable[[], None]] = {
        "bare apply_chat_template": bare,
        "encode (1 process)": encode,
        "map --num_proc 1": mapped(1),
        "map --num_proc 2": mapped(2),
        "prepare --num_proc 1": prepared(1),
        "prepare --num_proc 2": prepared(2),
    }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for round_ in range(args.repeats + 1):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in order:
            figures = timed(variants[name], 2 if "2" in name else 1)
            if round_:  # the first round warms caches up
                runs[name].append(figures)
            print(
                f"round {round_}: {name}: {figures['cpu_s']:.2f} cpu s, "
                f"{figures['critical_path_s']:.2f} s critical path, {figures['wall_s']:.2f} s wall",
                flush=True,
            )

    bare_runs = runs["bare apply_chat_template"]
    table = {}
    for name, measured in runs.items():
        # Against the bare pass's CPU seconds (one process): for one process its CPU seconds,
        # for several the critical path (the wall time with a core each). Wall clock beside.
        pairs = list(zip(measured, bare_runs, strict=True))
        ratios = [b["cpu_s"] / m["critical_path_s"] for m, b in pairs]
        table[name] = {
            "rows_per_s": statistics.median(args.rows / m["critical_path_s"] for m in measured),
            "vs_bare": statistics.median(ratios),
            "vs_bare_min_max": [min(ratios), max(ratios)],
            "wall_vs_bare": statistics.median(b["wall_s"] / m["wall_s"] for m, b in pairs),
            "runs": measured,
        }

    encoded = encoder({k: v for k, v in columns.items()})
    lengths = np.array([len(ids) for ids in encoded["input_ids"]])
    trained = sum(sum(m) for m in encoded["loss_mask"])
    packing = {block: waste(lengths, block) for block in (1024, 2048, 4096)}
    started = time.process_time()
    best_fit_decreasing(lengths[lengths <= 2048], 2048)
    pack_seconds = time.process_time() - started

    print(f"\n{args.rows:,} chat rows, median {int(np.median(lengths))} tokens "
          f"(p90 {int(np.percentile(lengths, 90))}), {100 * trained / lengths.sum():.0f}% of tokens trained\n")  # fmt: skip
    print(
        "| variant | rows/s (CPU critical path) | / bare (min-max) | wall clock / bare |\n"
        "|---|---:|---:|---:|"
    )
    for name, row in table.items():
        lo, hi = row["vs_bare_min_max"]
        print(
            f"| {name} | {row['rows_per_s']:,.0f} | {row['vs_bare']:.2f} ({lo:.2f}-{hi:.2f}) | "
            f"{row['wall_vs_bare']:.2f} |"
        )
    print("\n| block | rows | best-fit decreasing | next fit in order | one row per block |")
    print("|---:|---:|---:|---:|---:|")
    for block, w in packing.items():
        print(
            f"| {block} | {w['rows']:,} | {100 * w['best_fit_decreasing']:.1f}% | "
            f"{100 * w['next_fit_in_order']:.1f}% | {100 * w['one_row_per_block']:.1f}% |"
        )
    print(
        f"\nbest-fit decreasing of {len(lengths):,} rows into 2048-token blocks: {pack_seconds:.2f} cpu s"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "data_prep.json"
    out.write_text(json.dumps({
        "rows": args.rows, "repeats": args.repeats, "rates": table, "packing_waste": packing,
        "median_tokens": float(np.median(lengths)), "pack_cpu_s": pack_seconds,
    }, indent=2))  # fmt: skip
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
