"""`python -m fsdp_utils.export`: consolidate a sharded DCP checkpoint (any world size) into a
Hugging Face model folder, or a LoRA checkpoint into a PEFT adapter folder (or, with --merge,
a full model), in one process on CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fsdp_utils.checkpoint.hf_folder import (
    EXPORT_DTYPES,
    drop_tied_duplicates,
    resolve_export_dtype,
    write_hf_folder,
)


def export_checkpoint(
    checkpoint: Path,
    destination: Path,
    *,
    merge: bool = False,
    base: Path | None = None,
    export_dtype: str = "auto",
) -> Path:
    """Consolidate a sharded DCP checkpoint (any world size) into a Hugging Face folder, in one
    process on CPU. The checkpoint carries the model config and tokenizer (`hf/`). A LoRA
    checkpoint becomes a PEFT adapter folder, or with `merge` a full model (`lora_adapters`);
    a --freeze_layers checkpoint takes its frozen layers from the pretrained model (`base`, else
    the run's --model from the offline cache), exactly as the run held them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from fsdp_utils.checkpoint.sharded import HF_SUBDIR, read_checkpoint
    from fsdp_utils.hub.resolve import load_model_config
    from fsdp_utils.model.build import build_meta_model, materialize
    from fsdp_utils.model.weights import single_process_dcp_allowed

    info = read_checkpoint(Path(checkpoint))
    from fsdp_utils.checkpoint.lora_adapters import export_lora_checkpoint, is_lora_checkpoint

    if is_lora_checkpoint(info):
        return export_lora_checkpoint(
            info, Path(destination), merge=merge, base=base, export_dtype=export_dtype
        )
    if merge:
        raise ValueError(
            f"--merge merges LoRA adapters into their base model, and {checkpoint} is a full "
            "fine-tune's checkpoint (already a complete model): export it without --merge."
        )
    hf_dir = info.path / HF_SUBDIR
    hf_config = load_model_config(hf_dir)
    dtype = resolve_export_dtype(export_dtype, hf_config)
    identity = info.meta["identity"]
    if identity.get("freeze_layers"):
        model = _frozen_model_with_pretrained_weights(info, hf_config, base)
        options = StateDictOptions(ignore_frozen_params=True)
    else:
        model = build_meta_model(hf_config, identity["precision"])
        materialize(model, torch.device("cpu"))
        options = StateDictOptions()
    trained = get_model_state_dict(model, options=options)
    with single_process_dcp_allowed():
        dcp.load({"model": trained}, checkpoint_id=str(info.path))
    set_model_state_dict(model, trained, options=StateDictOptions(strict=False))
    state = get_model_state_dict(model)
    drop_tied_duplicates(state, model)
    return write_hf_folder(state, hf_config, Path(destination), hf_dir, dtype)


def _frozen_model_with_pretrained_weights(info: Any, hf_config: Any, base: Path | None) -> Any:
    """A --freeze_layers checkpoint holds what trained only: its model, on CPU, with every
    weight from the pretrained model (`base`, else the run's --model from the offline cache)
    and its frozen ones stored as the run stored them."""
    from fsdp_utils.checkpoint.lora_adapters import base_model_dir
    from fsdp_utils.config.train_config import TrainConfig
    from fsdp_utils.model.build import build_meta_model, find_decoder_layers, materialize
    from fsdp_utils.model.transforms import apply_transforms
    from fsdp_utils.model.weights import checkpoint_key_map, load_pretrained_weights

    identity = info.meta["identity"]
    config = TrainConfig(
        model=identity["model"],
        revision=identity.get("revision"),
        precision=identity["precision"],
        freeze_layers=identity["freeze_layers"],
    )
    base_dir = base_model_dir(
        config,
        base,
        why="A --freeze_layers checkpoint holds only what trained; the rest comes from",
    )
    model = build_meta_model(hf_config, config.precision)
    key_map = checkpoint_key_map(model, base_dir)
    apply_transforms(model, find_decoder_layers(model), hf_config, config)
    materialize(model, torch.device("cpu"))
    load_pretrained_weights(model, base_dir, key_map)
    return model


def main(argv: list[str] | None = None) -> int:
    import sys

    from fsdp_utils.arguments import ArgumentParser

    parser = ArgumentParser(
        prog="python -m fsdp_utils.export",
        description="Write a sharded training checkpoint as a Hugging Face model folder "
        "(safetensors + config + tokenizer), loadable with from_pretrained; a LoRA checkpoint as "
        "a PEFT adapter folder (PeftModel.from_pretrained), or with --merge as a full model.",
    )
    parser.add_argument("checkpoint", type=Path, help="e.g. runs/chess/checkpoints/step_00000100")
    parser.add_argument("output", type=Path, help="folder to create (replaced if it exists)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="LoRA checkpoint: write the base model with the adapters merged in (a full model; "
        "without it, a PEFT adapter folder).",
    )
    parser.add_argument(
        "--base",
        type=Path,
        default=None,
        help="The pretrained model folder, for --merge and for a --freeze_layers checkpoint "
        "(which holds the trained layers only); default: the run's --model from the offline "
        "cache.",
    )
    parser.add_argument(
        "--export_dtype",
        choices=EXPORT_DTYPES,
        default="auto",
        help="dtype of the weights written (auto: the source model's, from its config)",
    )
    args = parser.parse_args(argv)
    try:
        path = export_checkpoint(
            args.checkpoint,
            args.output,
            merge=args.merge,
            base=args.base,
            export_dtype=args.export_dtype,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {path}")
    if args.merge and _is_quantized(args.checkpoint):
        from fsdp_utils.model.qlora import NF4_MERGE_NOTE

        print(NF4_MERGE_NOTE)
    return 0


def _is_quantized(checkpoint: Path) -> bool:
    from fsdp_utils.checkpoint.sharded import read_checkpoint

    return read_checkpoint(checkpoint).meta["identity"].get("quantize", "none") != "none"


if __name__ == "__main__":
    raise SystemExit(main())
