"""CPU timings of issue 60's part-B levers, against the default path, in one process:

    python bench/kernel_levers.py [--rounds 5]

- activation checkpointing: none, whole layers (`--checkpoint_mode layer`), op-level (`op`);
- grouped-query attention under a document mask: transformers' path (K/V repeated per head
  group) against `fsdp_utils.model.sdpa`'s (grouped heads passed as they are);
- `--sdpa_backend`: the CPU's flash kernel (torch's choice) against math.

Each is a forward and backward of a Llama (hidden 512, 4 layers, 16 heads over 4 key-value
heads, MLP 1,376, 2 sequences of 1,024 tokens of packed ~200-token documents, fp32), in rounds
that alternate the variants, timed in this process's CPU seconds (`time.process_time`: other
processes on a shared machine do not count), medians; also the activations saved for backward
(torch's saved-tensor hooks, bytes of the distinct storages; for checkpointing, whose
selective kind keeps what it saves out of their sight, the memory planner's activations of the
same model and batch). On a GPU the ratios differ: a
CPU's matmuls are slow next to its elementwise work, so recomputing them costs relatively more
there, and a K/V copy relatively less. These say what the CPU does, not what a GPU gains.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results"


def _config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=2048, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
    )  # fmt: skip


def _planned_activations_mib(mode: str | None) -> float:
    """The memory planner's activations for one process training this model on the batch."""
    import tempfile

    from fsdp_utils.config.train_config import TrainConfig
    from fsdp_utils.plan.estimate import Cluster, estimate

    with tempfile.TemporaryDirectory() as folder:
        _config().save_pretrained(folder)
        config = TrainConfig(
            model=folder, max_seq_length=1024, total_batch_size=2, batch_size_per_device=2,
            precision="fp32", gradient_checkpointing=mode is not None,
        )  # fmt: skip
        if mode == "op":
            config = config.replace(checkpoint_mode="op")
        memory = estimate(config, Cluster(nodes=1, gpus_per_node=1)).memory
    return memory.breakdown().activations / 2**20


def _model(checkpoint: str | None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_utils.model.build import find_decoder_layers
    from fsdp_utils.parallel.parallelize import apply_activation_checkpointing

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config())
    if checkpoint is not None:
        apply_activation_checkpointing(model, find_decoder_layers(model), mode=checkpoint)
    return model.train()


def _batch() -> dict[str, Any]:
    import torch

    from fsdp_utils.data.document_masking import document_position_ids

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 2048, (2, 1024), generator=generator)
    ids[:, 199::200] = 2  # a document ends every 200 tokens
    return {"input_ids": ids, "position_ids": document_position_ids(ids, 2), "labels": ids}


@contextlib.contextmanager
def _saved_bytes(total: list[int]) -> Iterator[None]:
    """Within: the bytes of the distinct storages autograd saves for backward, into total."""
    import torch

    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
    total.append(sum(seen.values()))


def _step(model: Any, batch: dict[str, Any], saved: list[int]) -> float:
    started = time.process_time()
    with _saved_bytes(saved):
        loss = model(**batch, use_cache=False).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.process_time() - started


def _rounds(variants: dict[str, Callable[[], Any]], rounds: int) -> dict[str, dict[str, float]]:
    """Median CPU seconds and saved MiB per variant; `variants` set up and return (model, batch)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    saved: dict[str, list[int]] = {name: [] for name in variants}
    prepared = {name: make() for name, make in variants.items()}
    for model, batch, context in prepared.values():  # warm-up
        with context():
            _step(model, batch, [])
    for _ in range(rounds):
        for name, (model, batch, context) in prepared.items():
            with context():
                times[name].append(_step(model, batch, saved[name]))
    return {
        name: {"cpu_s": statistics.median(times[name]), "saved_mib": saved[name][-1] / 2**20}
        for name in variants
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from fsdp_utils.model.sdpa import sdpa_attention, sdpa_backend

    batch = _batch()
    plain = {k: v for k, v in batch.items() if k != "position_ids"}  # one causal block
    none = contextlib.nullcontext

    @contextlib.contextmanager
    def attention(function: Any) -> Iterator[None]:
        AttentionInterface.register("sdpa", function)
        try:
            yield
        finally:
            AttentionInterface.register("sdpa", sdpa_attention_forward)

    def transformers_sdpa() -> contextlib.AbstractContextManager[None]:
        return attention(sdpa_attention_forward)

    def ours() -> contextlib.AbstractContextManager[None]:
        return attention(sdpa_attention)

    def math() -> contextlib.AbstractContextManager[None]:
        return sdpa_backend("math")

    results = {
        "checkpointing (one causal block)": _rounds(
            {
                "none": lambda: (_model(None), plain, none),
                "layer": lambda: (_model("layer"), plain, none),
                "op": lambda: (_model("op"), plain, none),
            },
            args.rounds,
        ),
        "grouped-query attention, packed documents": _rounds(
            {
                "K/V repeated (transformers)": lambda: (_model(None), batch, transformers_sdpa),
                "grouped (fsdp_utils.model.sdpa)": lambda: (_model(None), batch, ours),
            },
            args.rounds,
        ),
        "--sdpa_backend (one causal block)": _rounds(
            {
                "auto (the CPU flash kernel)": lambda: (_model(None), plain, none),
                "math": lambda: (_model(None), plain, math),
            },
            args.rounds,
        ),
    }
    checkpointing = results["checkpointing (one causal block)"].values()
    for mode, row in zip((None, "layer", "op"), checkpointing, strict=True):
        row["saved_mib"] = _planned_activations_mib(mode)
    load = os.getloadavg()
    print(f"CPU seconds per forward+backward, medians of {args.rounds} rounds; load average "
          f"{load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}")  # fmt: skip
    for part, rows in results.items():
        print(
            f"\n| {part} | CPU s | vs first | saved for backward, MiB |\n| --- | ---: | ---: | ---: |"
        )
        first = next(iter(rows.values()))["cpu_s"]
        for name, row in rows.items():
            print(f"| {name} | {row['cpu_s']:.3f} | {row['cpu_s'] / first:.2f} | "
                  f"{row['saved_mib']:.1f} |")  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "kernel_levers.json"
    out.write_text(json.dumps({"load": load, "rounds": args.rounds, **results}, indent=2))


if __name__ == "__main__":
    main()
