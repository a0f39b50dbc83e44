"""`--plan --scaling`: how the run's speed per GPU holds from 1 to 1,024 GPUs, on paper.

Each GPU keeps the run's own micro-batch and accumulation (the total batch grows with the GPUs,
as in torchtitan's scaling figures), the nodes have --gpus_per_node GPUs, and each size is
predicted with full sharding (state split over every GPU: all-gathers and reduce-scatters over
the fabric once there are several nodes) and hybrid (split within a node, an all-reduce of the
gradients' shards between nodes). Memory is not checked here: `--plan --nodes N` checks one
size.

The published figure to hold it against: torchtitan's Llama 3.1 8B on H100s lost 2.7% of its
tokens/s per GPU from 8 to 128 GPUs (benchmarks/llama3_h100_202412_torchtitan.md: FSDP,
local batch 2, selective activation checkpointing, compiled, bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_utils.config.batch import plan_batch
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.plan.estimate import Cluster
from fsdp_utils.plan.speed import SpeedModel
from fsdp_utils.plan.step_time import StepTime

WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TORCHTITAN_8_TO_128 = -0.027


@dataclass(frozen=True)
class ScalingRow:
    gpus: int
    nodes: int
    full: StepTime
    hybrid: StepTime | None  # None on one node: hybrid sharding is full sharding there


def scaling_rows(config: TrainConfig, planned: Cluster, speed: SpeedModel) -> list[ScalingRow]:
    """The run at every size of `WORLD_SIZES` divisible by its sequence-parallel degree, each
    GPU with the micro-batch and accumulation the run has on `planned` (--nodes x
    --gpus_per_node), nodes of `planned.gpus_per_node` GPUs."""
    gpus_per_node = planned.gpus_per_node
    here = plan_batch(config, planned.world_size)
    per_gpu, accumulation = here.batch_size_per_device, here.gradient_accumulation_steps
    rows = []
    for gpus in WORLD_SIZES:
        if gpus % config.sequence_parallel:
            continue
        per_node = min(gpus, gpus_per_node)
        cluster = Cluster(max(1, gpus // per_node), per_node)
        total = per_gpu * (gpus // config.sequence_parallel) * accumulation
        sized = config.replace(
            total_batch_size=total, batch_size_per_device=per_gpu, gradient_accumulation_steps=None
        )
        full = speed.predict(sized.replace(sharding="full"), cluster)
        hybrid = None
        if cluster.nodes > 1:
            hybrid = speed.predict(sized.replace(sharding="hybrid"), cluster)
        rows.append(ScalingRow(gpus, cluster.nodes, full, hybrid))
    return rows


def change(rows: list[ScalingRow], start: int, end: int) -> float | None:
    """Full sharding's tokens/s per GPU at `end` GPUs over `start`'s, less 1."""
    found = {row.gpus: row.full.tokens_per_s_per_gpu for row in rows}
    if start not in found or end not in found:
        return None
    return found[end] / found[start] - 1


def format_scaling(rows: list[ScalingRow], speed: SpeedModel) -> str:
    first = rows[0].full
    lines = [
        f"Scaling on paper ({speed.describe()}): the batch per GPU held, "
        f"{first.tokens_per_gpu:,.0f} tokens per GPU and step",
        "",
        "|   GPUs | nodes | full: tokens/s/GPU | step | vs 8 GPUs | hybrid: tokens/s/GPU | step |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    eight = next((r.full.tokens_per_s_per_gpu for r in rows if r.gpus == 8), None)
    for row in rows:
        versus = f"{row.full.tokens_per_s_per_gpu / eight - 1:+.1%}" if eight else "-"
        hybrid = (
            f"{row.hybrid.tokens_per_s_per_gpu:,.0f} | {row.hybrid.seconds:,.3f} s"
            if row.hybrid is not None
            else "(= full) | "
        )
        lines.append(
            f"| {row.gpus:>6,} | {row.nodes:>5} | {row.full.tokens_per_s_per_gpu:,.0f} | "
            f"{row.full.seconds:,.3f} s | {versus} | {hybrid} |"
        )
    predicted = change(rows, 8, 128)
    if predicted is not None:
        lines += [
            "",
            f"8 -> 128 GPUs, full sharding: {predicted:+.1%} tokens/s per GPU predicted; "
            f"torchtitan measured {TORCHTITAN_8_TO_128:+.1%} for Llama 3.1 8B on H100s "
            "(compiled, selective checkpointing, local batch 2 x 8,192).",
        ]
    return "\n".join(lines)
