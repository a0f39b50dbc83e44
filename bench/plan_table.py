"""The README's memory table: CodeLlama-7B on 4 x A100-80GB, batch per device 1 to 16, with and
without activation checkpointing (the seed tutorial's questions), and how long planning takes.

    python bench/plan_table.py                      # from the config in tests/fixtures/configs
    python bench/plan_table.py --model codellama/CodeLlama-7b-hf   # from the offline cache

Each row is one `plan_memory` (a fake-tensor trace of the trainer's step). Total batch 64, so
that 16 per device x 4 GPUs divides it; everything else is chess_finetune.py's defaults
(1024 tokens per sequence, bf16-mixed, AdamW, FSDP2 per decoder layer).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from fsdp_utils.config import TrainConfig
from fsdp_utils.plan import GPU_PRESETS, MemoryPlan, plan_memory

CONFIGS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "configs"
GPU = GPU_PRESETS["a100-80gb"]
GIB = 1024**3


def timed_plan(config: TrainConfig, gpus: int = 4) -> tuple[MemoryPlan, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    plan = plan_memory(
        config, nodes=1, gpus_per_node=gpus, gpu_memory_bytes=GPU.memory_bytes,
        gpu_name=GPU.name, suggest_fixes=False,
    )  # fmt: skip
    return plan, time.perf_counter() - wall, time.process_time() - cpu


def table(model: str) -> str:
    rows = [
        "| batch/GPU | accum. | act. ckpt | params | grads | optimizer | activations "
        "| temporaries | peak | peak in | + margin | fits 80 GB? | plan (wall / CPU) |",
        "|---:|---:|:---:|---:|---:|---:|---:|---:|---:|:---:|---:|:---:|---:|",
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
            if plan.fits:
                largest[checkpointing] = batch
            g = [
                f"{x / GIB:.1f}"
                for x in (
                    plan.parameter_bytes,
                    plan.gradient_bytes,
                    plan.optimizer_bytes,
                    plan.activation_bytes,
                    plan.temporary_bytes,
                    plan.peak_bytes,
                )
            ]
            phase = "optimizer" if plan.peak_in_optimizer_step else "fwd/bwd"
            rows.append(
                f"| {batch} | {plan.batch.gradient_accumulation_steps} | "
                f"{'yes' if checkpointing else 'no'} | {' | '.join(g)} | {phase} | "
                f"{plan.required_bytes / GIB:.1f} | "
                f"{'yes' if plan.fits else '**no**'} | {wall:.0f} s / {cpu:.0f} s |"
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
    lines = ["", "Planning time, chess_finetune.py defaults (total batch 32, 1 per GPU, 4 GPUs):"]
    for name in ("codellama-7b", "codellama-13b"):
        plan, wall, cpu = timed_plan(TrainConfig(model=str(CONFIGS / name)))
        lines.append(
            f"  {name}: {wall:.0f} s wall, {cpu:.0f} s CPU "
            f"({plan.batch.gradient_accumulation_steps} micro-batches, peak "
            f"{plan.peak_bytes / GIB:.1f} GiB, {plan.verdict})"
        )
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(CONFIGS / "codellama-7b"))
    args = parser.parse_args()
    print(f"\n{table(args.model)}\n{timings()}")


if __name__ == "__main__":
    main()
