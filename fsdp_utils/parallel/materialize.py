"""From a transformed meta model to the model that trains, torchtitan's order: the run's
kernels (liger-kernel's, `--liger_kernels`; the SDPA function and `--sdpa_backend`) -> parallelize
(activation checkpointing, torch.compile, FSDP2) -> `to_empty` on the device, each rank
allocating only its shards -> the adapters initialised (LoRA) -> the pretrained weights read
slice by slice (then DoRA's magnitudes, or --lora_from's adapter) -> DDP's wrapper for
`--no_fsdp`."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.model import sdpa
from fsdp_utils.model.build import materialize
from fsdp_utils.model.liger import apply_liger_kernels
from fsdp_utils.model.transforms import MetaModel, load_initial_weights
from fsdp_utils.model.weights import WeightSource
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.parallel.parallelize import parallelize_model, wrap_ddp


def build_model(
    meta: MetaModel,
    config: TrainConfig,
    env: DistEnv,
    model_dir: Path,
    key_map: dict[str, WeightSource],
    *,
    load_weights: bool,
    frozen: bool = False,
) -> nn.Module:
    """The model on `env`'s device, sharded, in training mode. `key_map`: model key ->
    checkpoint key, taken on the meta model before its transforms (`checkpoint_key_map`).
    `load_weights`: False when a checkpoint will fill the weights (a resumed run); a LoRA or
    --freeze_layers run loads its frozen part anyway, since its checkpoints hold only what
    trains (`load_initial_weights`). `frozen`: a model that only runs forward (a distillation
    teacher, `fsdp_utils.model.teacher`): no gradients, eval mode (no dropout), and no DDP
    wrapper with --no_fsdp (nothing of it is reduced)."""
    use_kernels(meta, config, env)
    model = parallelize_model(meta, config, env)
    materialize(model, env.device, offload=config.cpu_offload)
    load_initial_weights(model, model_dir, key_map, config, resuming=not load_weights)
    if frozen:
        model.requires_grad_(False)
        return model.eval()
    if config.no_fsdp:
        model = wrap_ddp(model, env.device)
    model.train()
    return model


def use_kernels(meta: MetaModel, config: TrainConfig, env: DistEnv) -> None:
    """The run's kernels, before the model is parallelized: transformers' sdpa attention as
    `fsdp_utils.model.sdpa` runs it (grouped key-value heads without copies) restricted to
    `--sdpa_backend`'s kernel (refused here, with torch's reasons, if it cannot run the run's
    attention on this GPU), and liger-kernel's (`--liger_kernels`)."""
    sdpa.install()
    sdpa.use_sdpa_backend(config.sdpa_backend)
    sdpa.check_backend_runs(config, meta.model.config, env.device)
    if config.liger_kernels:
        apply_liger_kernels(meta.model)
