"""A bare FSDP2 training loop, the reference `bench/throughput.py` compares against.

The same work as chess_finetune.py's step (same model, fully_shard per decoder layer + root,
fp32, AdamW with the same betas, foreach optimizer and gradient clipping as the trainer,
micro-batches with gradient sync on each) and nothing else: no metrics, no data pipeline beyond
indexing, no checks. Run with torchrun; prints one JSON line on rank 0.

Timing: wall clock from the end of the warm-up steps to the end of the last step, as
throughput.py reads chess_finetune.py's metrics.jsonl; useful tokens are the non-pad tokens of
all ranks.

Data modes:
  packed         the trainer's prepared blocks (every position is a real token)
  pad_per_batch  the original script's way: each micro-batch holds whole documents, padded to
                 the longest one in it (truncated at the block length); padding costs compute,
                 not loss
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM


def documents(prepared: str) -> list[np.ndarray]:
    """Whole documents, cut back out of the packed stream at the EOS separators."""
    with open(os.path.join(prepared, "meta.json")) as f:
        meta = json.load(f)
    eos = meta["stats"]["eos_token_id"]
    ids = np.load(os.path.join(prepared, "train_input_ids.npy"))
    lengths = np.load(os.path.join(prepared, "train_lengths.npy"))
    stream = np.concatenate([row[:n] for row, n in zip(ids, lengths, strict=True)])
    ends = np.flatnonzero(stream == eos) + 1
    return [d for d in np.split(stream, ends) if len(d)]


def main(argv: list[str] | None = None, on_timed: Callable[[bool], None] | None = None) -> None:
    """`on_timed(True)` / `on_timed(False)` at the start / end of the timed steps (a profiler's
    hook: bench/profile_step.py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prepared", required=True, help="a folder written by prepare_dataset")
    parser.add_argument("--mode", choices=["packed", "pad_per_batch"], default="packed")
    parser.add_argument("--batch_size_per_device", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), foreach=True)

    rng = np.random.default_rng(rank)
    bs, length = args.batch_size_per_device, args.seq_len
    if args.mode == "packed":
        blocks = np.load(os.path.join(args.prepared, "train_input_ids.npy"), mmap_mode="r")

        def micro_batch() -> tuple[torch.Tensor, torch.Tensor, int]:
            rows = torch.from_numpy(
                np.ascontiguousarray(blocks[rng.integers(0, len(blocks), bs)])
            ).long()
            return rows, rows, rows.numel()
    else:
        pad = model.config.pad_token_id or 0
        docs = documents(args.prepared)

        def micro_batch() -> tuple[torch.Tensor, torch.Tensor, int]:
            chosen = [docs[i][:length] for i in rng.integers(0, len(docs), bs)]
            longest = max(len(d) for d in chosen)
            ids = torch.full((bs, longest), pad, dtype=torch.long)
            labels = torch.full((bs, longest), -100, dtype=torch.long)
            for i, d in enumerate(chosen):
                ids[i, : len(d)] = labels[i, : len(d)] = torch.from_numpy(d.astype(np.int64))
            return ids, labels, sum(len(d) for d in chosen)

    useful = 0.0
    start = cpu_start = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if on_timed is not None:
                on_timed(True)
            start, cpu_start = time.perf_counter(), time.process_time()
        tokens = 0
        for _ in range(args.accumulation):
            ids, labels, real = micro_batch()
            loss = model(input_ids=ids, labels=labels).loss / args.accumulation
            loss.backward()
            tokens += real
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        count = torch.tensor([tokens], dtype=torch.float64)
        dist.all_reduce(count)
        if step >= args.warmup:
            useful += count.item()
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    if on_timed is not None:
        on_timed(False)
    if rank == 0:
        print(json.dumps({"mode": args.mode, "useful_tokens_per_s": useful / seconds,
                          "seconds_per_step": seconds / args.steps,
                          "cpu_seconds_per_step": cpu_seconds / args.steps}))  # fmt: skip
    # The model, its optimizer and mesh go first, then all ranks end together: see
    # fsdp_utils.parallel.distributed.destroy.
    del model, optimizer, mesh
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
