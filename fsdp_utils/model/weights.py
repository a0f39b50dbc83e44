"""Pretrained weights into a (sharded) model: checkpoint keys mapped to model keys with
transformers' own conversion rules, and safetensors read slice by slice, each rank only the
slices it owns, so no rank ever holds a full copy in RAM.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from torch import nn

from fsdp_utils.model.build import tied_parameter_names


def _safetensors_keys(model_dir: Path) -> set[str]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    keys: set[str] = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            keys.update(f.keys())
    return keys


def _checkpoint_renamer(model: nn.Module, model_keys: set[str]) -> Any:
    """checkpoint key -> model key, with transformers' own checkpoint conversion mapping.

    transformers 5 renames some legacy checkpoint keys on load (GPT-NeoX's `embed_out` is the
    model's `lm_head`) and adds/strips the base-model prefix (`h.0...` vs `transformer.h.0...`).
    Conversions that are more than renames (fused MoE experts, ...) cannot be sliced per rank.
    """
    prefix = getattr(model, "base_model_prefix", "")
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # transformers 4: keys match, up to the base-model prefix

        def rename_v4(key: str) -> str:
            if key not in model_keys and f"{prefix}.{key}" in model_keys:
                return f"{prefix}.{key}"
            return key

        return rename_v4

    transforms: list[Any] = get_model_conversion_mapping(cast(Any, model))
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    meta_state = dict.fromkeys(model_keys, True)

    def rename(key: str) -> str:
        renamed, converter = rename_source_key(key, renamings, converters, prefix, meta_state)
        if converter is not None:
            raise ValueError(
                f"Checkpoint tensor {key!r} needs a transformers weight conversion "
                f"({converter!r}), which the sharded loader cannot apply slice by slice. "
                "Convert the checkpoint once with from_pretrained(...).save_pretrained(...)."
            )
        return renamed

    return rename


def checkpoint_key_map(model: nn.Module, model_dir: Path) -> dict[str, str]:
    """Map each model state-dict key to its name in `model_dir`'s safetensors files.

    Call it on the freshly built model, before `parallelize` (FSDP2 swaps the classes that
    transformers looks its conversion mapping up by). Tied output embeddings are usually not
    stored; non-persistent buffers never are.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    checkpoint_keys = _safetensors_keys(model_dir)
    if not checkpoint_keys:
        raise ValueError(
            f"No safetensors weights in {model_dir}. Convert .bin weights once with "
            "`AutoModelForCausalLM.from_pretrained(...).save_pretrained(..., "
            "safe_serialization=True)` or download the safetensors files."
        )

    model_keys = set(get_model_state_dict(model))
    rename = _checkpoint_renamer(model, model_keys)
    mapping = {}
    for ckpt_key in checkpoint_keys:
        model_key = rename(ckpt_key)
        if model_key in model_keys:
            mapping[model_key] = ckpt_key
    tied_followers = {n for names in tied_parameter_names(model) for n in names[1:]}
    missing = [
        key
        for key in sorted(model_keys - set(mapping))
        if key not in tied_followers and not _is_non_persistent_buffer(model, key)
    ]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        )
        raise ValueError(
            f"The checkpoint lacks {len(missing)} weight(s) the model needs: {shown}. Is the "
            "folder's config.json the one these weights were saved with?"
        )
    return mapping


def _is_non_persistent_buffer(model: nn.Module, key: str) -> bool:
    module_name, _, buffer_name = key.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return buffer_name in getattr(module, "_non_persistent_buffers_set", set())


def load_pretrained_weights(model: nn.Module, model_dir: Path, key_map: dict[str, str]) -> None:
    """Load safetensors weights into the (possibly sharded) model.

    torch.distributed.checkpoint's HuggingFaceStorageReader reads, for each rank, only the
    slices of each tensor that the rank's DTensor shard covers (safetensors `get_slice` on a
    memory map), and casts to the parameter dtype on copy.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    state = get_model_state_dict(model)
    to_load = {ckpt_key: state[model_key] for model_key, ckpt_key in key_map.items()}
    with single_process_dcp_allowed():  # plain single-process use (export, tests) is fine
        dcp.load(to_load, storage_reader=HuggingFaceStorageReader(str(model_dir)))
    loaded = {model_key: to_load[ckpt_key] for model_key, ckpt_key in key_map.items()}
    # strict=False: tied followers and non-persistent buffers are not in `loaded`.
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))


@contextlib.contextmanager
def single_process_dcp_allowed() -> Iterator[None]:
    """torch.distributed.checkpoint warns when used without a process group ("assuming the
    intent is to load in a single process"): in export and tests that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
