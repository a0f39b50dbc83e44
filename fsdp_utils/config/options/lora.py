"""LoRA adapters (fsdp_utils/model/lora.py): the base frozen, the adapters trained."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .section import Section

Quantize = Literal["none", "nf4"]

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
            "layer of the decoder layers outside mixture-of-experts blocks.",
            joined=True,
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
    # QLoRA (fsdp_utils/model/qlora.py); --qlora is --lora --quantize nf4 (fsdp_utils.config.parse)
    quantize: Quantize = field(
        default="none",
        metadata=_opt(
            "With --lora: store the frozen base's decoder-layer linear weights in 4 bits: nf4 "
            "(QLoRA's NormalFloat4 with double-quantized scales, torchao's NF4Tensor, sharded "
            "by FSDP2). Embeddings, norms and the output layer stay in the compute dtype; the "
            "adapters train as with --lora. --qlora is short for --lora --quantize nf4."
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
    if options.lora_dora and options.quantize != "none":
        raise ValueError(
            f"--lora_dora with --quantize {options.quantize}: peft's DoRA reads the base weight "
            "through a dequantize() that torchao's NF4Tensor does not have (it fails as the "
            "adapters are made), so DoRA over a 4-bit base (QDoRA) is not supported. Drop "
            "--lora_dora for QLoRA, or drop --quantize for DoRA on the 16-bit base."
        )
