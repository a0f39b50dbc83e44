"""LoRA adapters (fsdp_utils/model/lora.py): the base frozen, the adapters trained."""

from __future__ import annotations

from dataclasses import dataclass, field

from .section import Section

SECTION = Section("lora", "LoRA")
_opt = SECTION.option


@dataclass
class LoraOptions:
    lora: bool = field(
        default=False,
        metadata=_opt(
            "Train LoRA adapters (peft) instead of the whole model: the base stays frozen in the "
            "compute dtype; checkpoints hold the adapters only; the final model is a PEFT "
            "adapter folder."
        ),
    )
    lora_r: int = field(default=8, metadata=_opt("LoRA rank."))
    lora_alpha: int = field(
        default=16, metadata=_opt("LoRA alpha: the update is scaled by alpha / r.")
    )
    lora_dropout: float = field(
        default=0.05, metadata=_opt("Dropout on the adapters' input (0: none).")
    )
    lora_target_modules: str | None = field(
        default=None,
        metadata=_opt(
            "Comma-separated linear layers of the decoder layers to adapt, e.g. q_proj,v_proj; "
            "mixture-of-experts models also take their fused expert tensors (gate_up_proj, "
            "down_proj, or experts for both; needs --lora_dropout 0). Default: every linear "
            "layer of the decoder layers outside mixture-of-experts blocks."
        ),
    )
    lora_dora: bool = field(
        default=False,
        metadata=_opt(
            "With --lora: DoRA (weight-decomposed LoRA, peft's use_dora): a trained magnitude "
            "per output feature on top of the low-rank direction update."
        ),
    )
    lora_from: str | None = field(
        default=None,
        metadata=_opt(
            "With --lora: continue training this PEFT LoRA adapter (llama-recipes' "
            "from_peft_checkpoint), a local folder or a hub id in the offline cache "
            "(download_models.py --model ID). Its rank, alpha, targets and DoRA setting win "
            "over the --lora_* flags."
        ),
    )
    merge: bool = field(
        default=False,
        metadata=_opt(
            "With --lora: also write the base model with the adapters merged in "
            "(output_dir/final_merged), loadable without peft."
        ),
    )


def check(options: LoraOptions) -> None:
    if options.merge and not options.lora:
        raise ValueError(
            "--merge writes the base model with the LoRA adapters merged in: it needs --lora "
            "(a full fine-tune's final model is already a complete model)."
        )
    if options.lora and (options.lora_r < 1 or options.lora_alpha <= 0):
        raise ValueError(
            f"--lora_r must be at least 1 and --lora_alpha positive, got {options.lora_r} and "
            f"{options.lora_alpha}."
        )
    if options.lora and not 0.0 <= options.lora_dropout < 1.0:
        raise ValueError(f"--lora_dropout must be in [0, 1), got {options.lora_dropout}.")
    for name in ("lora_dora", "lora_from"):
        if getattr(options, name) and not options.lora:
            raise ValueError(f"--{name} is a LoRA option: add --lora.")
