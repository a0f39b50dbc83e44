"""The optimizer, the learning-rate schedule, how long to train, the seed and the frozen layers
(fsdp_utils/train/optim.py, fsdp_utils/model/freeze.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .section import Section, check_at_least

SECTION = Section("optimizer", "optimizer and learning-rate schedule")
_opt = SECTION.option

OptimizerName = Literal["adamw", "sgd"]
LrSchedule = Literal["cosine", "linear", "constant"]


@dataclass
class OptimizerOptions:
    learning_rate: float = field(default=2e-5, metadata=_opt("Peak learning rate."))
    optimizer: OptimizerName = field(
        default="adamw",
        metadata=_opt("adamw (2 fp32 states per parameter) or sgd (none without momentum)."),
    )
    weight_decay: float = field(default=0.0, metadata=_opt("Decoupled weight decay."))
    fused_optimizer: bool = field(
        default=False,
        metadata=_opt(
            "torch's fused AdamW (or SGD) kernel, one kernel for every parameter's update, "
            "where torch has one for the parameters' device and dtype (CUDA, CPU); else the "
            "foreach implementation (the default). The log says which ran."
        ),
    )
    momentum: float = field(
        default=0.0,
        metadata=_opt("SGD momentum (0 keeps SGD stateless: least memory)."),
    )
    lr_schedule: LrSchedule = field(
        default="cosine",
        metadata=_opt("Decay after linear warmup: cosine, linear or constant."),
    )
    warmup_steps: int | None = field(
        default=None,
        metadata=_opt("Linear warmup steps (default: 5% of max_training_steps)."),
    )
    min_lr_ratio: float = field(
        default=0.1,
        metadata=_opt("Final learning rate as a fraction of the peak."),
    )
    grad_clip: float = field(
        default=1.0,
        metadata=_opt("Clip the global gradient norm to this value (0: off)."),
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata=_opt(
            "Mixture-of-experts models: weight of the routers' load-balancing loss added to the "
            "language-model loss and logged as aux_loss (0: off; default: the model config's "
            "router_aux_loss_coef if it sets output_router_logits, else off)."
        ),
    )
    max_training_steps: int = field(default=100, metadata=_opt("Optimizer steps to run."))
    num_epochs: int | None = field(
        default=None,
        metadata=_opt(
            "Instead of --max_training_steps: passes over the prepared training blocks; the "
            "steps are epochs x (blocks // total batch), printed at start, the same on any "
            "number of GPUs."
        ),
    )
    seed: int = field(default=1234, metadata=_opt("Seed for model init, shuffling, dropout."))
    freeze_layers: int = field(
        default=0,
        metadata=_opt(
            "Freeze the embeddings and the first N decoder layers (llama-recipes' freeze_layers "
            "/ num_freeze_layers): they keep their pretrained weights and get no gradients, "
            "optimizer state or place in the checkpoints; the final model still holds them "
            "(0: train everything)."
        ),
    )

    @property
    def resolved_warmup_steps(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return round(0.05 * self.max_training_steps)


def check(options: OptimizerOptions) -> None:
    check_at_least(options, ("max_training_steps",))
    if options.learning_rate <= 0:
        raise ValueError(f"--learning_rate must be positive, got {options.learning_rate}.")
    warmup = options.warmup_steps
    if options.num_epochs is not None and options.num_epochs < 1:
        raise ValueError(f"--num_epochs must be at least 1, got {options.num_epochs}.")
    # With --num_epochs the steps are known once the data is prepared; checked again then.
    steps_known = options.num_epochs is None
    if (
        steps_known
        and warmup is not None
        and (warmup < 0 or (warmup > 0 and warmup >= options.max_training_steps))
    ):
        raise ValueError(
            f"--warmup_steps ({warmup}) must be between 0 and "
            f"--max_training_steps - 1 ({options.max_training_steps - 1})."
        )
    if not 0.0 <= options.min_lr_ratio <= 1.0:
        raise ValueError(f"--min_lr_ratio must be in [0, 1], got {options.min_lr_ratio}.")
    if options.grad_clip < 0:
        raise ValueError(
            f"--grad_clip must be >= 0 (0 disables clipping), got {options.grad_clip}."
        )
    if options.freeze_layers < 0:
        raise ValueError(f"--freeze_layers must be >= 0 (0: off), got {options.freeze_layers}.")
