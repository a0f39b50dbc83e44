"""Write a LoRA run's result: a PEFT adapter folder, and with `--merge` a full Hugging Face model.

    <output_dir>/final/          adapter_config.json, adapter_model.safetensors, tokenizer files:
                                 PeftModel.from_pretrained(base_model, folder) loads it
    <output_dir>/final_merged/   (--merge) the base with W + (alpha / r) * B @ A: from_pretrained

The adapters are gathered to rank 0's CPU (megabytes). Merging needs the base weights too, so
with `--merge` the whole model is gathered (once, on rank 0, as the full fine-tune's export does)
and merged there: peft's own merge cannot run on FSDP-sharded layers. `export_lora_checkpoint`
does the same in one CPU process from a training checkpoint (adapters) and the base model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fsdp_utils.atomic import folder_written_atomically
from fsdp_utils.checkpoint.hf_folder import (
    copy_tokenizer_files,
    drop_tied_duplicates,
    gather_full_state_dict,
    resolve_export_dtype,
    write_hf_folder,
)
from fsdp_utils.model import qlora
from fsdp_utils.model.lora import (
    adapted_modules,
    adapted_tensor_name,
    expert_delta,
    is_tensor_adapter,
    lora_settings,
    peft_config,
    without_base_layer,
)
from fsdp_utils.model.peft_adapter import (
    ADAPTER,
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    is_adapter_key,
    is_reference_key,
    peft_key,
)

if TYPE_CHECKING:
    from fsdp_utils.checkpoint.sharded import CheckpointInfo
    from fsdp_utils.config.layout import RunLayout
    from fsdp_utils.config.train_config import TrainConfig

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "adapter_state", "merged_state"]


def adapter_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The adapters of a (gathered) LoRA state dict, named as PEFT saves them
    (`fsdp_utils.model.peft_adapter.peft_key`)."""
    return {
        peft_key(key): value.contiguous()
        for key, value in state.items()
        if is_adapter_key(key) and not is_reference_key(key)  # DPO's frozen copy stays
    }


def merged_state(state: dict[str, Any], model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter merged in, under the base model's names.

    W' = W + scaling x B @ A (transposed for Conv1D, whose weight is stored (in, out); one pair
    per expert for fused expert tensors: `expert_delta`), computed in fp32 and stored in W's
    dtype, as peft's `merge_and_unload` does. With DoRA each output row of W + scaling x B @ A
    is rescaled to its trained magnitude m: W' = m / ||W + s B A|| x (W + s B A), as peft's DoRA
    merge does.
    """
    merged = {
        without_base_layer(key): value for key, value in state.items() if not is_adapter_key(key)
    }
    for name, module in adapted_modules(model).items():
        a = state[f"{name}.lora_A.{ADAPTER}.weight"].float()
        b = state[f"{name}.lora_B.{ADAPTER}.weight"].float()
        if is_tensor_adapter(module):  # fused expert tensors (peft's target_parameters)
            key = adapted_tensor_name(name, module)
            weight = merged[key]
            merged[key] = (weight.float() + expert_delta(a, b, module)).to(weight.dtype)
            continue
        delta = (b @ a) * module.scaling[ADAPTER]
        weight = merged[f"{name}.weight"]
        updated = (weight.float().T if module.fan_in_fan_out else weight.float()) + delta
        magnitude = state.get(f"{name}.lora_magnitude_vector.{ADAPTER}.weight")
        if magnitude is not None:  # DoRA: rows (output features) scaled to their magnitude
            norm = torch.linalg.norm(updated, dim=1, keepdim=True)
            updated = updated * (magnitude.float().view(-1, 1) / norm)
        if module.fan_in_fan_out:
            updated = updated.T
        merged[f"{name}.weight"] = updated.to(weight.dtype)
    return merged


def saved_target_modules(model: nn.Module) -> list[str]:
    """`target_modules` for adapter_config.json: the short names (q_proj, ...) when they pick
    exactly the adapted modules, as peft matches them in the base model; else the full names."""
    from peft.tuners.lora import LoraLayer
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    from fsdp_utils.model.lora import linear_types

    adapted = {name for name, m in adapted_modules(model).items() if not is_tensor_adapter(m)}
    short = sorted({name.rpartition(".")[2] for name in adapted})
    candidates = {
        name.replace(_CHECKPOINT_PREFIX, "")
        for name, module in model.named_modules()
        if isinstance(module, (*linear_types(), LoraLayer))
        and not is_tensor_adapter(module)
        and not any(part in name for part in (".base_layer", ".lora_A.", ".lora_B."))
    }
    matched = {name for name in candidates if name.rpartition(".")[2] in short}
    return short if matched == adapted else sorted(adapted)


def saved_target_parameters(model: nn.Module) -> list[str]:
    """`target_parameters` for adapter_config.json: the adapted fused expert tensors, as
    `experts.gate_up_proj` when that picks exactly them in every layer, else by full name."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    adapted = {
        adapted_tensor_name(name, module)
        for name, module in adapted_modules(model).items()
        if is_tensor_adapter(module)
    }
    short = sorted({".".join(name.split(".")[-2:]) for name in adapted})
    everywhere = set()
    for name, param in model.named_parameters():
        plain = without_base_layer(name.replace(_CHECKPOINT_PREFIX, ""))
        if param.dim() == 3 and ".".join(plain.split(".")[-2:]) in short:
            everywhere.add(plain)
    return short if everywhere == adapted else sorted(adapted)


def write_adapter_folder(
    adapters: dict[str, torch.Tensor],
    lora_config: Any,
    destination: Path,
    tokenizer_source: Path | None,
) -> Path:
    """adapter_config.json + adapter_model.safetensors (+ tokenizer files), written into a
    temporary sibling and renamed, so a crash leaves no half folder."""
    from safetensors.torch import save_file

    lora_config.inference_mode = True  # as PeftModel.save_pretrained writes it
    with folder_written_atomically(destination) as tmp:
        lora_config.save_pretrained(str(tmp))
        save_file(adapters, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        if tokenizer_source is not None:
            copy_tokenizer_files(tokenizer_source, tmp)
    return Path(destination)


def write_lora_outputs(
    state: dict[str, Any],
    model: nn.Module,
    config: TrainConfig,
    hf_config: Any,
    destinations: tuple[Path, Path | None],
    tokenizer_source: Path | None,
    *,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """The adapter folder, and the merged model (in `dtype`) if a second destination is given
    (then `state` must hold the base weights too). Returns the adapter folder."""
    adapter_dir, merged_dir = destinations
    lora_config = peft_config(
        lora_settings(config),
        saved_target_modules(model),
        fan_in_fan_out=any(m.fan_in_fan_out for m in adapted_modules(model).values()),
        parameters=saved_target_parameters(model),
    )
    lora_config.base_model_name_or_path = config.model
    lora_config.revision = config.revision
    write_adapter_folder(adapter_state(state), lora_config, adapter_dir, tokenizer_source)
    if merged_dir is not None:
        merged = merged_state(state, model)
        drop_tied_duplicates(merged, model)
        write_hf_folder(merged, hf_config, merged_dir, tokenizer_source, dtype)
    return adapter_dir


def save_lora_model(
    model: nn.Module,
    config: TrainConfig,
    hf_config: Any,
    layout: RunLayout,
    tokenizer_source: Path | None,
    is_main: bool,
) -> Path:
    """Collective over all ranks; rank 0 writes `final/` (and `final_merged/` with --merge)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    dtype = resolve_export_dtype(config.export_dtype, hf_config)  # before the collective
    state: dict[str, Any]
    if config.merge and config.quantize != "none":  # the 4-bit base, dequantized to merge into
        state = gather_full_state_dict(model)
    else:
        # Without --merge only the adapters are gathered: megabytes, whatever the base's size.
        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=not config.merge
        )
        state = get_model_state_dict(model, options=options)
    if is_main:
        merged_dir = layout.merged_model if config.merge else None
        write_lora_outputs(
            state,
            model,
            config,
            hf_config,
            (layout.final_model, merged_dir),
            tokenizer_source,
            dtype=dtype,
        )
    return layout.final_model


def lora_config_of_checkpoint(info: CheckpointInfo) -> TrainConfig:
    """The settings that rebuild a LoRA checkpoint's model, from its identity."""
    from fsdp_utils.config.train_config import TrainConfig

    identity = info.meta["identity"]
    lora = identity["lora"]
    return TrainConfig(
        model=identity["model"],
        revision=identity.get("revision"),
        precision=identity["precision"],
        lora=True,
        lora_r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        lora_target_modules=lora["target_modules"],
        lora_dora=lora.get("dora", False),
        quantize=identity.get("quantize", "none"),
    )


def export_lora_checkpoint(
    info: CheckpointInfo,
    destination: Path,
    *,
    merge: bool,
    base: Path | None,
    export_dtype: str = "auto",
) -> Path:
    """A LoRA training checkpoint (any world size) as a PEFT adapter folder, or with `merge` as
    a full Hugging Face model (the base weights come from `base`, else from the offline cache
    by the run's --model and --revision). One process, on CPU."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from fsdp_utils.checkpoint.sharded import HF_SUBDIR
    from fsdp_utils.hub.resolve import load_model_config
    from fsdp_utils.model.build import build_meta_model, find_decoder_layers, materialize
    from fsdp_utils.model.lora import apply_lora, base_key_map
    from fsdp_utils.model.weights import (
        checkpoint_key_map,
        load_pretrained_weights,
        single_process_dcp_allowed,
    )

    config = lora_config_of_checkpoint(info)
    hf_dir = info.path / HF_SUBDIR
    hf_config = load_model_config(hf_dir)
    model = build_meta_model(hf_config, config.precision)
    base_dir = base_model_dir(config, base) if merge else None
    key_map = checkpoint_key_map(model, base_dir) if base_dir is not None else {}
    layers = find_decoder_layers(model)
    if merge and config.quantize != "none":  # merged into the base as it trained: 4-bit
        qlora.quantize_base(model, layers, config)
    apply_lora(model, layers, config)
    materialize(model, torch.device("cpu"))
    adapters = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    with single_process_dcp_allowed():
        dcp.load({"model": adapters}, checkpoint_id=str(info.path))
    set_model_state_dict(model, adapters, options=StateDictOptions(strict=False))
    if base_dir is not None:
        key_map = qlora.load_quantized_weights(model, base_dir, base_key_map(model, key_map))
        load_pretrained_weights(model, base_dir, key_map)
    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=not merge))
    state = {key: qlora.dequantized(value) for key, value in state.items()}
    destination = Path(destination)
    if merge:
        merged = merged_state(state, model)
        drop_tied_duplicates(merged, model)
        dtype = resolve_export_dtype(export_dtype, hf_config)
        return write_hf_folder(merged, hf_config, destination, hf_dir, dtype)
    write_lora_outputs(state, model, config, hf_config, (destination, None), hf_dir)
    return destination


def base_model_dir(config: TrainConfig, base: Path | None, *, why: str = "Merging needs") -> Path:
    """The pretrained model a checkpoint builds on: `base`, else the run's --model and
    --revision from the offline cache."""
    from fsdp_utils.hub.resolve import resolve_model_dir

    if base is not None:
        if not (Path(base) / "config.json").is_file():
            raise ValueError(f"--base {base}: no config.json there. Give the base model's folder.")
        return Path(base)
    try:
        return resolve_model_dir(config.model, config.revision, None)
    except ValueError as err:
        raise ValueError(
            f"{why} the base model {config.model!r}, which was not found ({err}). Give its "
            "folder with --base FOLDER."
        ) from err


def is_lora_checkpoint(info: CheckpointInfo) -> bool:
    return "lora" in info.meta.get("identity", {})
