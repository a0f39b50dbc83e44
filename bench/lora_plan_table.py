"""The LoRA table of docs/lora.md: CodeLlama-7B, LoRA against full fine-tuning, on the hardware of the
seed documents: 1 and 4 x V100-32GB (no bf16 there: fp16-mixed, as seed 000's `--use_fp16`) and
1 x A100-80GB (bf16-mixed), with and without activation checkpointing.

    python bench/lora_plan_table.py                      # from the config in tests/fixtures
    python bench/lora_plan_table.py --model codellama/CodeLlama-7b-hf   # from the offline cache

Each row is one `plan_memory` (a fake-tensor trace of the trainer's step). Everything else is
chess_finetune.py's defaults: 1024 tokens per sequence, 1 per GPU, total batch 32, AdamW, FSDP2
per decoder layer; LoRA r=8, alpha 16, dropout 0.05 on every linear layer of the blocks.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from fsdp_utils.config.train_config import Precision, TrainConfig
from fsdp_utils.plan import GPU_PRESETS, plan_memory

CONFIGS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "configs"
GIB = 1024**3
# Nominal 32 GiB; nvidia-smi may report a little less as usable (not checked on a V100 here).
V100 = ("V100-32GB", 32 * GIB)
A100 = (GPU_PRESETS["a100-80gb"].name, GPU_PRESETS["a100-80gb"].memory_bytes)
SETUPS: list[tuple[int, tuple[str, int], Precision]] = [  # (GPUs, GPU, precision)
    (1, V100, "fp16-mixed"),
    (4, V100, "fp16-mixed"),
    (1, A100, "bf16-mixed"),
]


def table(model: str, dropout_zero: bool) -> str:
    rows = [
        "| GPUs | precision | method | act. ckpt | params | grads | optimizer | activations "
        "| temporaries | peak | + margin | fits? | state B/param |",
        "|---|---|---|:---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|",
    ]
    for gpus, (gpu_name, gpu_bytes), precision in SETUPS:
        for lora in (True,) if dropout_zero else (False, True):
            for checkpointing in (False, True):
                config = TrainConfig(
                    model=model,
                    precision=precision,
                    lora=lora,
                    lora_dropout=0.0 if dropout_zero else 0.05,
                    gradient_checkpointing=checkpointing,
                )
                started = time.perf_counter()
                plan = plan_memory(
                    config, nodes=1, gpus_per_node=gpus, gpu_memory_bytes=gpu_bytes,
                    gpu_name=gpu_name, suggest_fixes=False,
                )  # fmt: skip
                parts = plan.parts_gib()
                rows.append(
                    f"| {gpus} x {gpu_name} | {precision} | {'LoRA' if lora else 'full'} | "
                    f"{'yes' if checkpointing else 'no'} | {' | '.join(parts)} | "
                    f"{plan.required_bytes / GIB:.1f} | {'yes' if plan.fits else '**no**'} | "
                    f"{plan.state_bytes_per_parameter:.2f} |"
                )
                print(f"{rows[-1]}  ({time.perf_counter() - started:.0f} s)", flush=True)
    rows.append("")
    rows.append(f"GiB per GPU at the peak (its parts sum to it). Margin: {plan.margin.describe()}.")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(CONFIGS / "codellama-7b"))
    parser.add_argument(
        "--lora_dropout_0", action="store_true", help="LoRA rows only, without dropout"
    )
    args = parser.parse_args()
    print(f"\n{table(args.model, args.lora_dropout_0)}")


if __name__ == "__main__":
    main()
