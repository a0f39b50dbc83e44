"""The run's two records beside metrics.jsonl, each written whole (`fsdp_utils.atomic`):

config.json    the resolved TrainConfig, what it resolved to on this world (batch plan, model
               folder, FSDP groups, FLOPs per token, data) and the library versions
status.json    how the last run ended: completed | interrupted | failed, and why (read by
               slurm/finetune.sh to decide whether to requeue, and by people)
"""

from __future__ import annotations

import platform
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_utils.atomic import write_json_atomic
from fsdp_utils.config.batch import BatchPlan
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig

if TYPE_CHECKING:
    from fsdp_utils.data.prepare import PreparedData
    from fsdp_utils.model.transforms import ModelInfo
    from fsdp_utils.parallel.distributed import DistEnv


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def run_config_record(
    config: TrainConfig,
    *,
    env: DistEnv,
    plan: BatchPlan,
    info: ModelInfo,
    model_dir: Path,
    fsdp_groups: list[str],
    flops_per_token: float,
    data: PreparedData,
    loss_chunk_size: int | None = None,
    optimizer_kernel: str | None = None,
) -> dict[str, Any]:
    """What config.json holds: the config as given, what it resolved to on this world, and
    the library versions."""
    resolved = {
        "world_size": env.world_size,
        "num_nodes": env.num_nodes,
        "device": env.device.type,
        "backend": env.backend,
        "total_batch_size": plan.total_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "tokens_per_step": plan.tokens_per_step,
        "warmup_steps": config.resolved_warmup_steps,
        "model_dir": str(model_dir),
        "decoder_layer_class": info.decoder_layer_class,
        "num_decoder_layers": info.decoder_layers,
        "fsdp_groups": fsdp_groups,
        "parameters": info.parameters,
        "non_embedding_parameters": info.non_embedding_parameters,
        "active_non_embedding_parameters": info.active_parameters,
        "flops_per_token": flops_per_token,
        # target tokens per chunk of the loss (0: unchunked), --loss_chunk_size resolved
        "loss_chunk_size": loss_chunk_size,
        # "fused" or "foreach": the optimizer's update kernel (--fused_optimizer)
        "optimizer_kernel": optimizer_kernel,
        "prepared_data": str(data.folder),
        "data_stats": data.meta.get("stats"),
    }
    return {
        "config": config.to_dict(),
        "resolved": resolved,
        "versions": {
            "python": platform.python_version(),
            "torch": _version("torch"),
            "transformers": _version("transformers"),
        },
    }


def write_run_config(layout: RunLayout, record: dict[str, Any]) -> None:
    write_json_atomic(layout.config, record)


def write_status(
    layout: RunLayout,
    status: str,
    reason: str,
    *,
    step: int,
    max_training_steps: int,
    user_error: str | None = None,
) -> str | None:
    """Write status.json; a warning line for the log if it could not be written (e.g. the disk
    is full: the caller keeps its real error). `user_error`: the one-paragraph message of a
    run that failed on a user mistake, which the sbatch script repeats at the end of the log."""
    record: dict[str, Any] = {
        "status": status,
        "reason": reason,
        "step": step,
        "max_training_steps": max_training_steps,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if user_error is not None:
        record["user_error"] = user_error
    try:
        write_json_atomic(layout.status, record)
    except OSError as err:
        return f"warning: could not write {layout.status}: {err}"
    return None
