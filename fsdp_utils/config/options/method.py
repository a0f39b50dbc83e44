"""The training method (`--method`, fsdp_utils/methods/) and the options of one method
(`only_for` in their metadata: DPO's)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from .section import Section

SECTION = Section("method", "training method (fsdp_utils/methods/; DPO: docs/preference.md)")
_opt = SECTION.option


def _dpo(help: str) -> dict[str, Any]:
    return SECTION.option(help, only_for="dpo")


DpoLoss = Literal["sigmoid", "ipo"]
ReferenceMode = Literal["cached", "live"]
# The methods whose examples are preference pairs (a chosen and a rejected answer, 2 sequences
# each): the data stage prepares pairs for them (fsdp_utils/data/formats.py) and the batch sizes
# count pairs (fsdp_utils/config/batch.py). It is said here, not by the methods package, because
# those stages sit below it (`python -m fsdp_utils.data` prepares a run's data without it).
PAIRED_METHODS = frozenset({"dpo"})
# The methods that score the policy against a reference model: continuing a LoRA adapter
# (--lora --lora_from), their reference is a frozen copy of it (`TrainConfig.reference_adapter`,
# which the model stage builds), as TRL's DPOTrainer takes `ref_adapter_name`.
REFERENCE_METHODS = frozenset({"dpo"})


@dataclass
class MethodOptions:
    # A name, not a Literal: the methods are listed in fsdp_utils/methods/registry.py, which
    # a program may extend; a name not there fails the run's checks (`method_class`).
    method: str = field(
        default="sft",
        metadata=_opt(
            "sft: supervised fine-tuning (the loss on the answers); dpo: Direct Preference "
            "Optimization on pairs of a chosen and a rejected answer (columns chosen, rejected "
            "and optionally prompt; docs/preference.md). With dpo the batch sizes count pairs."
        ),
    )
    # The options of one method (`only_for` in their metadata): setting one with another
    # --method is an error (`check`).
    dpo_beta: float = field(
        default=0.1,
        metadata=_dpo("DPO's beta: how far the policy may move from the reference (higher: less)."),
    )
    dpo_loss: DpoLoss = field(
        default="sigmoid",
        metadata=_dpo(
            "sigmoid: DPO's loss; ipo: IPO's squared loss on length-averaged log-probabilities "
            "(TRL's loss_type names)."
        ),
    )
    dpo_label_smoothing: float = field(
        default=0.0,
        metadata=_dpo(
            "With --dpo_loss sigmoid: the assumed fraction of pairs whose labels are flipped "
            "(conservative DPO); 0: plain DPO."
        ),
    )
    reference: ReferenceMode = field(
        default="cached",
        metadata=_dpo(
            "The DPO reference model without --lora: cached (its log-probabilities computed "
            "once before training, sharded, and kept beside the prepared data) or live (a "
            "frozen sharded copy of the model, run at every step: one more forward per step, "
            "one more model in memory). With --lora the reference is the model with its "
            "adapters off."
        ),
    )

    @property
    def trains_on_pairs(self) -> bool:
        return self.method in PAIRED_METHODS


def check(options: MethodOptions) -> None:
    """A method's own options need that method; DPO's values."""
    fields = dataclasses.fields(MethodOptions)
    owners = {f.metadata["only_for"] for f in fields if "only_for" in f.metadata}
    for owner in sorted(owners - {options.method}):
        changed = [
            f"--{g.name}"
            for g in fields
            if g.metadata.get("only_for") == owner and getattr(options, g.name) != g.default
        ]
        if changed:
            raise ValueError(
                f"{', '.join(changed)}: option(s) of --method {owner}, which --method "
                f"{options.method} does not read. Add --method {owner}"
                + " (and a dataset of chosen/rejected pairs)" * (owner in PAIRED_METHODS)
                + ", or drop them."
            )
    if options.method != "dpo":
        return
    if options.dpo_beta <= 0:
        raise ValueError(f"--dpo_beta must be positive, got {options.dpo_beta}.")
    if not 0.0 <= options.dpo_label_smoothing < 0.5:
        raise ValueError(
            f"--dpo_label_smoothing must be in [0, 0.5), got {options.dpo_label_smoothing}."
        )
    if options.dpo_label_smoothing and options.dpo_loss != "sigmoid":
        raise ValueError("--dpo_label_smoothing applies to --dpo_loss sigmoid only.")
