"""`python -m fsdp_utils.export`: consolidate a sharded DCP checkpoint (any world size) into a
Hugging Face model folder, or a LoRA checkpoint into a PEFT adapter folder (or, with --merge,
a full model), in one process on CPU.
"""

from __future__ import annotations

from pathlib import Path

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
    checkpoint becomes a PEFT adapter folder, or with `merge` a full model (`lora_export`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

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
    model = build_meta_model(hf_config, info.meta["identity"]["precision"])
    materialize(model, torch.device("cpu"))
    state = get_model_state_dict(model)
    with single_process_dcp_allowed():
        dcp.load({"model": state}, checkpoint_id=str(info.path))
    drop_tied_duplicates(state, model)
    return write_hf_folder(state, hf_config, Path(destination), hf_dir, dtype)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(
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
        help="With --merge: the base model folder (default: the run's --model from the offline "
        "cache).",
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
