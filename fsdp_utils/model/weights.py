"""Pretrained weights into a (sharded) model: checkpoint keys mapped to model keys with
transformers' own conversion rules, and safetensors read slice by slice, each rank only the
slices it owns, so no rank ever holds a full copy in RAM. Tensors that transformers fuses on
load (mixture-of-experts experts) are assembled per shard by `fused_weights`.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from torch import nn

from fsdp_utils.model.build import tied_parameter_names
from fsdp_utils.model.fused_weights import (
    FusedTensor,
    SafetensorsFolder,
    UnsupportedConversionError,
    conversion_rules,
    load_fused_tensors,
    plan_fused_tensor,
)


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


# A model tensor comes from one checkpoint tensor (its name there) or is assembled from several
# (a fused mixture-of-experts tensor: `fused_weights.FusedTensor`).
WeightSource = str | FusedTensor


def checkpoint_key_map(model: nn.Module, model_dir: Path) -> dict[str, WeightSource]:
    """Map each model state-dict key to where it is in `model_dir`'s safetensors files: a
    checkpoint key, or for tensors transformers fuses on load (MoE experts) the plan that
    assembles it from the checkpoint's tensors.

    transformers' own conversion mapping decides: renames (GPT-NeoX's `embed_out` is the
    model's `lm_head`, Mixtral's `block_sparse_moe` its `mlp`), the base-model prefix added or
    stripped (`h.0...` vs `transformer.h.0...`), and fusions (`fused_weights`). Call it on the
    freshly built model, before `parallelize` (FSDP2 swaps the classes that transformers looks
    its conversion mapping up by). Tied output embeddings are usually not stored;
    non-persistent buffers never are.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    checkpoint_keys = _safetensors_keys(model_dir)
    if not checkpoint_keys:
        raise ValueError(
            f"No safetensors weights in {model_dir}. Convert .bin weights once with "
            "`AutoModelForCausalLM.from_pretrained(...).save_pretrained(..., "
            "safe_serialization=True)` or download the safetensors files."
        )
    check_not_quantized(getattr(model, "config", None), model_dir)
    state = get_model_state_dict(model)
    model_keys = set(state)
    mapping: dict[str, WeightSource] = {}
    fused_sources: dict[str, list[_Renamed]] = {}
    for renamed in _renamed_keys(model, checkpoint_keys, model_keys):
        if renamed.model_key not in model_keys:
            continue
        if renamed.converter is None:
            mapping[renamed.model_key] = renamed.checkpoint_key
        else:
            fused_sources.setdefault(renamed.model_key, []).append(renamed)
    if fused_sources:
        mapping.update(_fused_plans(fused_sources, state, model_dir))
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


class _Renamed(NamedTuple):
    checkpoint_key: str
    model_key: str
    renamed: str  # after transformers' renamings, before its converter
    converter: Any  # the WeightConverter that takes it (None: a plain tensor)
    pattern: str | None  # the converter's source pattern it matched


def _renamed_keys(
    model: nn.Module, checkpoint_keys: set[str], model_keys: set[str]
) -> list[_Renamed]:
    """Each checkpoint key renamed with transformers' `rename_source_key`, as `from_pretrained`
    calls it: the model key, and the converter that takes it if any."""
    prefix = getattr(model, "base_model_prefix", "")
    try:
        from transformers.core_model_loading import apply_renamings, rename_source_key
    except ImportError:  # transformers 4: keys match, up to the base-model prefix
        return [
            _Renamed(key, key if key in model_keys else f"{prefix}.{key}", key, None, None)
            for key in checkpoint_keys
        ]
    renamings, converters = conversion_rules(model)
    meta_state = dict.fromkeys(model_keys, True)
    renamed = []
    for key in sorted(checkpoint_keys):
        model_key, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        converter = None
        if pattern is not None:
            converter = next(c for c in converters if pattern in c.source_patterns)
        renamed.append(
            _Renamed(key, model_key, apply_renamings(key, renamings), converter, pattern)
        )
    return renamed


def _fused_plans(
    sources: dict[str, list[_Renamed]], state: dict[str, Any], model_dir: Path
) -> dict[str, WeightSource]:
    plans: dict[str, WeightSource] = {}
    with SafetensorsFolder(model_dir) as files:
        for model_key, pieces in sorted(sources.items()):
            converter = pieces[0].converter
            try:
                plans[model_key] = plan_fused_tensor(
                    converter,
                    [
                        (p.checkpoint_key, p.renamed, p.pattern, files.shape(p.checkpoint_key))
                        for p in pieces
                    ],
                    tuple(state[model_key].shape),
                )
            except UnsupportedConversionError as err:
                raise UnsupportedConversionError(
                    f"The checkpoint's tensors {pieces[0].checkpoint_key!r} (and "
                    f"{len(pieces) - 1} more) make the model's {model_key!r} through the "
                    f"transformers conversion {converter!r}, which the sharded loader cannot "
                    f"read slice by slice ({err}). It reads stacked and concatenated tensors "
                    "(mixture-of-experts experts), not this rule. A checkpoint that holds the "
                    "model's own tensor names and shapes loads as is: please report the model."
                ) from err
    return plans


def check_not_quantized(hf_config: Any, model_dir: Path) -> None:
    """Pre-quantized checkpoints (gpt-oss's MXFP4 expert blocks, GPTQ, AWQ, FP8, ...) store
    other tensors than the model trains; refuse them with the way to a trainable copy."""
    quantization = getattr(hf_config, "quantization_config", None)
    if not quantization:
        return
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    )
    method = getattr(method, "value", method)
    if method == "mxfp4":
        fix = (
            "Dequantize it once to bf16 on the login node (the copy is several times larger): "
            "`AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.bfloat16, "
            "quantization_config=Mxfp4Config(dequantize=True)).save_pretrained(OUT)`, then "
            "pass --model OUT"
        )
    else:
        fix = (
            "Fine-tune the unquantized model it was made from, or dequantize it once with "
            "transformers and save_pretrained the result"
        )
    raise ValueError(
        f"{model_dir} holds a pre-quantized checkpoint (config.json: quantization_config, "
        f"quant_method {method}): its tensors are packed blocks and scales, not weights that "
        f"FSDP2 can shard and train. {fix}."
    )


def _is_non_persistent_buffer(model: nn.Module, key: str) -> bool:
    module_name, _, buffer_name = key.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return buffer_name in getattr(module, "_non_persistent_buffers_set", set())


def load_pretrained_weights(
    model: nn.Module, model_dir: Path, key_map: Mapping[str, WeightSource]
) -> None:
    """Load safetensors weights into the (possibly sharded) model.

    torch.distributed.checkpoint's HuggingFaceStorageReader reads, for each rank, only the
    slices of each tensor that the rank's DTensor shard covers (safetensors `get_slice` on a
    memory map), and casts to the parameter dtype on copy. Fused tensors (MoE experts) are
    assembled the same way, each rank reading only the experts it holds (`fused_weights`).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    plain = {key: source for key, source in key_map.items() if isinstance(source, str)}
    fused = {key: src for key, src in key_map.items() if isinstance(src, FusedTensor)}
    state = get_model_state_dict(model)
    to_load = {ckpt_key: state[model_key] for model_key, ckpt_key in plain.items()}
    with single_process_dcp_allowed():  # plain single-process use (export, tests) is fine
        dcp.load(to_load, storage_reader=HuggingFaceStorageReader(str(model_dir)))
    loaded = {model_key: to_load[ckpt_key] for model_key, ckpt_key in plain.items()}
    # strict=False: tied followers, non-persistent buffers and fused tensors are not in it.
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
    if fused:
        load_fused_tensors(model, model_dir, fused)


@contextlib.contextmanager
def single_process_dcp_allowed() -> Iterator[None]:
    """torch.distributed.checkpoint warns when used without a process group ("assuming the
    intent is to load in a single process"): in export and tests that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
