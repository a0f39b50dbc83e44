"""The memory table of docs/plan.md: CodeLlama-7B on 4 x A100-80GB, batch per device 1 to 16,
with and without activation checkpointing (the tutorial's questions), how long planning takes for 7B,
13B and 70B, and how the fast planner agrees with the full trace.

    python bench/plan_table.py                      # from the configs in tests/fixtures/configs
    python bench/plan_table.py --model codellama/CodeLlama-7b-hf   # from the offline cache
    python bench/plan_table.py --timings            # only the planning times (7B, 13B, 70B)
    python bench/plan_table.py --agreement          # fast vs full trace on tiny 20-layer models

Each row is one `plan_memory` (fake-tensor traces of the trainer's step, extrapolated from
shallow copies of the model), checked against the full trace of every layer (`--full_trace`).
Total batch 64, so that 16 per device x 4 GPUs divides it; everything else is
chess_finetune.py's defaults (1024 tokens per sequence, bf16-mixed, AdamW, FSDP2 per decoder
layer). Times are wall and CPU seconds: on a shared machine the CPU time is the steadier one.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.plan import GPU_PRESETS, MemoryPlan, plan_memory

CONFIGS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "configs"
GPU = GPU_PRESETS["a100-80gb"]
GIB = 1024**3


def timed_plan(
    config: TrainConfig, gpus: int = 4, *, full_trace: bool = False
) -> tuple[MemoryPlan, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    plan = plan_memory(
        config, nodes=1, gpus_per_node=gpus, gpu_memory_bytes=GPU.memory_bytes,
        gpu_name=GPU.name, suggest_fixes=False, full_trace=full_trace,
    )  # fmt: skip
    return plan, time.perf_counter() - wall, time.process_time() - cpu


def _difference(fast: MemoryPlan, full: MemoryPlan) -> str:
    """How far the fast plan's peak is from the full trace's: 'same bytes' or a percentage."""
    if fast.peak_bytes == full.peak_bytes and fast.breakdown == full.breakdown:
        return "same bytes"
    return f"{100 * (fast.peak_bytes / full.peak_bytes - 1):+.3f}%"


def table(model: str) -> str:
    rows = [
        "| batch/GPU | accum. | act. ckpt | params | grads | optimizer | activations "
        "| temporaries | peak | peak in | + margin | fits 80 GB? | plan (wall / CPU) "
        "| full trace (wall / CPU) | fast vs full |",
        "|---:|---:|:---:|---:|---:|---:|---:|---:|---:|:---:|---:|:---:|---:|---:|:---:|",
    ]
    largest: dict[bool, int] = {}
    for checkpointing in (False, True):
        for batch in (1, 2, 4, 8, 16):
            config = TrainConfig(
                model=model,
                total_batch_size=64,
                batch_size_per_device=batch,
                gradient_checkpointing=checkpointing,
            )
            plan, wall, cpu = timed_plan(config)
            full, full_wall, full_cpu = timed_plan(config, full_trace=True)
            if plan.fits:
                largest[checkpointing] = batch
            g = plan.parts_gib()
            phase = "optimizer" if plan.peak_in_optimizer_step else "fwd/bwd"
            rows.append(
                f"| {batch} | {plan.batch.gradient_accumulation_steps} | "
                f"{'yes' if checkpointing else 'no'} | {' | '.join(g)} | {phase} | "
                f"{plan.required_bytes / GIB:.1f} | "
                f"{'yes' if plan.fits else '**no**'} | {wall:.0f} s / {cpu:.0f} s | "
                f"{full_wall:.0f} s / {full_cpu:.0f} s | {_difference(plan, full)} |"
            )
            print(rows[-1], flush=True)
    rows.append("")
    rows.append(
        f"GiB per GPU, at the peak (its parts sum to it). Largest batch per GPU that fits: "
        f"{largest.get(False, 'none')} without, {largest.get(True, 'none')} with activation "
        f"checkpointing. Margin: {plan.margin.describe()}."
    )
    return "\n".join(rows)


def timings() -> str:
    lines = [
        "",
        "Planning time, chess_finetune.py defaults (total batch 32, 1 per GPU, 4 GPUs), "
        "fast planner vs --full_trace:",
    ]
    for name in ("codellama-7b", "codellama-13b", "codellama-70b"):
        config = TrainConfig(model=str(CONFIGS / name))
        plan, wall, cpu = timed_plan(config)
        full, full_wall, full_cpu = timed_plan(config, full_trace=True)
        lines.append(
            f"  {name}: {wall:.1f} s wall, {cpu:.1f} s CPU ({plan.trace_method}); full trace "
            f"{full_wall:.1f} s wall, {full_cpu:.1f} s CPU; peak {plan.peak_bytes / GIB:.2f} GiB, "
            f"{_difference(plan, full)} ({plan.verdict})"
        )
        print(lines[-1], flush=True)
    return "\n".join(lines)


AGREEMENT_SETTINGS: list[dict[str, Any]] = [
    {},
    {"gradient_checkpointing": True},
    {"gradient_checkpointing": True, "checkpoint_every_n_layers": 2},
    {"batch_size_per_device": 1, "defer_grad_sync": True},
    {"cpu_offload": True},
    {"precision": "bf16-true", "optimizer": "sgd"},
    {"precision": "fp32"},
    {"no_layer_wrap_policy": True},
    {"sharding": "hybrid"},
    {"sharding": "shard_grad_op"},
]


def agreement(layers: int = 20) -> str:
    """Fast vs full trace on every tiny architecture with `layers` layers, 2 nodes x 2 GPUs."""
    from fsdp_utils.synthetic import TINY_ARCHITECTURES, tiny_model_config

    lines = [f"Fast planner vs full trace, tiny {layers}-layer models on 2 x 2 GPUs:"]
    same = total = 0
    for arch in TINY_ARCHITECTURES:
        with tempfile.TemporaryDirectory() as folder:
            tiny_model_config(arch, vocab_size=512, num_layers=layers).save_pretrained(folder)
            for settings in AGREEMENT_SETTINGS:
                base = {"total_batch_size": 8, "batch_size_per_device": 2, "max_seq_length": 64}
                config = TrainConfig(model=folder, **{**base, **settings})
                args: dict[str, Any] = {"nodes": 2, "gpus_per_node": 2, "gpu_memory_bytes": None}
                started = time.process_time()
                fast = plan_memory(config, **args)
                fast_cpu, started = time.process_time() - started, time.process_time()
                full = plan_memory(config, **args, full_trace=True)
                full_cpu = time.process_time() - started
                difference = _difference(fast, full)
                same += difference == "same bytes"
                total += 1
                lines.append(
                    f"  {arch:9} {settings or 'defaults'!s:72} {difference:>10}  "
                    f"CPU {fast_cpu:4.1f} s vs {full_cpu:4.1f} s  ({fast.trace_method})"
                )
                print(lines[-1], flush=True)
    lines.append(f"{same} of {total} plans byte for byte equal to the full trace.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(CONFIGS / "codellama-7b"))
    parser.add_argument("--timings", action="store_true", help="only the planning times")
    parser.add_argument("--agreement", action="store_true", help="only fast vs full, tiny")
    args = parser.parse_args()
    if args.agreement:
        print(f"\n{agreement()}")
    elif args.timings:
        print(timings())
    else:
        print(f"\n{table(args.model)}\n{timings()}")


if __name__ == "__main__":
    main()
