"""`chess_finetune.py --preflight`: everything that can be checked before the expensive part.

The sbatch script runs it on the job's first node before torchrun starts: config, batch
arithmetic for the job's world size, model and data in the offline cache, sequence length, and,
where the GPU's memory is known, the memory planner's verdict. A failure ends the job within
seconds (the plan takes ~15 s for a 7B model) with the fix in the log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_utils.config import TrainConfig

if TYPE_CHECKING:
    from fsdp_utils.batch import BatchPlan

GPU_MEMORY_AUTO, GPU_MEMORY_OFF = "auto", "off"


def detect_gpu_memory() -> str | None:
    """The smallest GPU of this node as a size the planner reads ("81559MiB"), from
    nvidia-smi; None without GPUs. (nvidia-smi rather than torch.cuda: no CUDA context.)"""
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    sizes = [int(x) for x in result.stdout.split() if x.strip().isdigit()]
    return f"{min(sizes)}MiB" if result.returncode == 0 and sizes else None


def check_batch_and_model(config: TrainConfig, world_size: int) -> tuple[BatchPlan, Path, Any]:
    """Trackers, batch arithmetic, the model in the offline cache, the sequence length against
    its context: (plan, model folder, model config). The trainer starts with the same checks."""
    from fsdp_utils.assets import resolve_model_dir
    from fsdp_utils.batch import plan_batch
    from fsdp_utils.model import check_seq_length, load_model_config
    from fsdp_utils.trackers import check_trackers

    check_trackers(config)
    plan = plan_batch(config, world_size)
    model_dir = resolve_model_dir(config.model, config.revision, config.cache_dir)
    hf_config = load_model_config(model_dir)
    check_seq_length(hf_config, config.max_seq_length)
    if config.lora:  # an unknown --lora_target_modules fails here, before any data work
        from fsdp_utils.lora import check_target_modules

        check_target_modules(hf_config, config)
    return plan, model_dir, hf_config


def check_basics(config: TrainConfig, world_size: int) -> str:
    """Batch arithmetic, offline assets, sequence length: no weights, no process group."""
    from fsdp_utils.assets import resolve_dataset_files

    plan, model_dir, _ = check_batch_and_model(config, world_size)
    files = resolve_dataset_files(
        config.dataset, config.resolved_dataset_include, config.dataset_revision, config.cache_dir
    )
    return f"preflight OK: {plan.describe()}; model {model_dir}; {len(files)} data file(s)"


def check_memory(config: TrainConfig, nodes: int, world_size: int, gpu_memory: str) -> str:
    """Run the memory planner (in a child process with CUDA hidden: it traces on fake CPU
    tensors and must not touch the GPUs the job is about to use). Raises ValueError with the
    plan when the run does not fit."""
    if world_size % nodes:
        raise ValueError(f"--world_size {world_size} is not a multiple of --nodes {nodes}.")
    with tempfile.TemporaryDirectory() as tmp:
        config_file = Path(tmp) / "config.json"
        config_file.write_text(json.dumps(config.to_dict()))
        command = [
            sys.executable, "-m", "fsdp_utils.plan", "--config", str(config_file),
            "--nodes", str(nodes), "--gpus-per-node", str(world_size // nodes),
            "--gpu-memory", gpu_memory, "--no-fixes",
        ]  # fmt: skip
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode == 0:
        verdict = next(
            (line for line in result.stdout.splitlines() if line.startswith("verdict:")), ""
        )
        return f"memory plan: {verdict.removeprefix('verdict: ') or 'fits'}"
    if result.returncode == 1:
        raise ValueError(
            f"The run does not fit in GPU memory:\n{result.stdout.strip()}\n"
            "For the cheapest changes that make it fit, run on the login node:\n  "
            f"python chess_finetune.py --plan --nodes {nodes} --gpus-per-node "
            f"{world_size // nodes} --gpu-memory {gpu_memory} <your training flags>"
        )
    raise ValueError(f"The memory planner failed:\n{(result.stderr or result.stdout).strip()}")


def preflight(
    config: TrainConfig, world_size: int, nodes: int = 1, gpu_memory: str = GPU_MEMORY_AUTO
) -> str:
    """All checks; returns what was checked, raises ValueError with the fix otherwise."""
    lines = [check_basics(config, world_size)]
    if config.no_fsdp or gpu_memory == GPU_MEMORY_OFF:
        return lines[0]
    memory = detect_gpu_memory() if gpu_memory == GPU_MEMORY_AUTO else gpu_memory
    if memory is None:
        lines.append("memory plan: skipped (no GPU on this node; --gpu_memory 80GiB plans anyway)")
    else:
        lines.append(check_memory(config, nodes, world_size, memory))
    return "\n".join(lines)
