"""Write a trained (sharded) model as a Hugging Face folder: safetensors + config + tokenizer.

The full state dict is gathered to rank 0's CPU (one copy, on one rank) and written with
`huggingface_hub.save_torch_state_dict`, which shards large models into 5 GB files with an
index, exactly as `save_pretrained` does, so `from_pretrained` loads the result. Fused
mixture-of-experts tensors are written back one tensor per expert, as in the source checkpoint.

The weights are written in the source model's dtype (its config's `dtype`, `torch_dtype` in
older configs), not in the fp32 of the master weights: a bf16 7B model stays 13.5 GB, not 27.
`--export_dtype` chooses another; the config written says what the files hold.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any, get_args

import torch
from torch import nn

from fsdp_utils.atomic import folder_written_atomically
from fsdp_utils.config.train_config import ExportDtype
from fsdp_utils.model import qlora
from fsdp_utils.model.build import build_meta_model, config_dtype, tied_parameter_names
from fsdp_utils.model.fused_weights import hub_layout

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


EXPORT_DTYPES: tuple[str, ...] = get_args(ExportDtype)


def resolve_export_dtype(choice: str, hf_config: Any) -> torch.dtype:
    """`auto`: the source model's floating-point dtype, float32 if its config names none."""
    if choice not in EXPORT_DTYPES:
        raise ValueError(
            f"Unknown export dtype {choice!r}: choose one of {', '.join(EXPORT_DTYPES)} "
            "(--export_dtype; auto is the source model's)."
        )
    if choice != "auto":
        return getattr(torch, choice)  # type: ignore[no-any-return]
    declared = config_dtype(hf_config)
    if declared in (torch.float32, torch.bfloat16, torch.float16):
        return declared
    return torch.float32


def gather_full_state_dict(model: nn.Module) -> dict[str, Any]:
    """Collective: every rank must call it. Rank 0 gets CPU tensors, the others `{}`. A 4-bit
    base (--quantize nf4) comes dequantized (`fsdp_utils.model.qlora`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if qlora.quantized_parameters(model):
        return qlora.gather_full_state_dict(model)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def drop_tied_duplicates(state: dict[str, Any], model: nn.Module) -> None:
    """Keep one name per tied group (the first, e.g. embed_tokens); transformers re-ties the
    others from `tie_word_embeddings` when loading."""
    for names in tied_parameter_names(model):
        for follower in names[1:]:
            state.pop(follower, None)


def copy_tokenizer_files(source: Path, destination: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, destination / name)


def write_hf_folder(
    state: dict[str, Any],
    hf_config: Any,
    destination: Path,
    tokenizer_source: Path | None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write state dict (floating-point tensors cast to `dtype`) + config (saying `dtype`)
    (+ tokenizer files) so that `from_pretrained(destination)` works. Writes into a temporary
    sibling and renames it, so a crash leaves no half model.

    Tensors that transformers fuses on load (mixture-of-experts experts) are written one per
    expert under the checkpoint's names, as `save_pretrained` writes them (`hub_layout`), so
    that vLLM and other readers of Hub checkpoints load the result too.
    """
    from huggingface_hub import save_torch_state_dict

    state = {k: _compact(v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    # A meta build costs no memory; it is what transformers looks its conversion rules up in.
    state = hub_layout(state, build_meta_model(hf_config, "fp32"))
    with folder_written_atomically(destination) as tmp:
        save_torch_state_dict(state, tmp, max_shard_size="5GB")
        saved = copy.deepcopy(hf_config)  # the caller's config stays as it is
        saved.dtype = dtype
        saved.use_cache = True  # training switched it off; generation wants it
        saved.save_pretrained(tmp)
        if tokenizer_source is not None:
            copy_tokenizer_files(tokenizer_source, tmp)
    return Path(destination)


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in storage of its own size. A gathered FSDP2 tensor whose dim 0 is smaller
    than the world size (Qwen2-MoE's shared_expert_gate, [1, hidden]) is a view into the padded
    all-gather buffer, and safetensors refuses to write a tensor that does not cover its
    storage."""
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


def save_hf_model(
    model: nn.Module,
    hf_config: Any,
    destination: Path,
    tokenizer_source: Path | None,
    is_main: bool,
    export_dtype: str = "auto",
) -> Path:
    """Collective over all ranks; rank 0 writes, in `export_dtype` (`auto`: the source
    model's dtype, which `hf_config` keeps; see `resolve_export_dtype`)."""
    dtype = resolve_export_dtype(export_dtype, hf_config)  # before the collective: fail alike
    state = gather_full_state_dict(model)
    if is_main:
        drop_tied_duplicates(state, model)
        write_hf_folder(state, hf_config, destination, tokenizer_source, dtype)
    return destination
