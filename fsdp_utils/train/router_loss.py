"""The routers' load-balancing loss of mixture-of-experts models, added to the language-model
loss (`--router_aux_loss_coef`).

The loss is transformers' own (`load_balancing_loss_func`, Switch Transformer's auxiliary
loss: experts x sum over experts of the fraction of routed tokens x the mean router
probability, over every layer's router): the model returns it as `aux_loss` when called with
`output_router_logits=True`. Its default weight is the model config's: `router_aux_loss_coef`
when the config sets `output_router_logits` (as `from_pretrained` + `labels` would add it), else
off; the released Mixtral, Qwen-MoE, OLMoE and gpt-oss configs all leave it off.

Scaling. The language-model loss of a step is the sum of its token losses divided by the target
tokens of the whole step (all micro-batches, all ranks: `forward_backward_step`), so that any
split of the same total batch gives the same update. The router loss is one number per forward
(a mean over that micro-batch's tokens), so it enters the same sum as if each of the
micro-batch's target tokens carried it: coef x aux x (the micro-batch's target tokens). The step's
objective is then  sum(token losses) / targets + coef x (token-weighted mean of the micro-batches'
router losses): the router loss keeps its weight whatever the accumulation steps or world size,
and a split that forms the same micro-batches (the same --batch_size_per_device on another number
of GPUs) gives exactly the same update. What no scaling can give: the router loss of a
micro-batch depends on which tokens share it (it is not a sum over tokens), so another
--batch_size_per_device changes it a little, as in every framework that computes it per forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.parallel import distributed as dist_utils


def has_router(hf_config: Any) -> bool:
    """Mixture-of-experts configs of transformers say whether the forward returns router logits."""
    return hasattr(hf_config, "output_router_logits")


def resolve_coefficient(config: TrainConfig, hf_config: Any) -> float:
    """The router loss weight of this run (0: off); ValueError for a model without routers."""
    coef = config.router_aux_loss_coef
    if coef is None:
        if has_router(hf_config) and getattr(hf_config, "output_router_logits", False):
            return float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
        return 0.0
    if coef < 0:
        raise ValueError(f"--router_aux_loss_coef {coef} is negative: give 0 (off) or more.")
    if coef > 0 and not has_router(hf_config):
        raise ValueError(
            f"--router_aux_loss_coef {coef}: {hf_config.model_type} is not a mixture-of-experts "
            "model (it has no router to balance). Leave the option out."
        )
    return float(coef)


class RouterLoss:
    """Adds coef x the router loss to each micro-batch's objective and keeps, for the log, the
    step's token-weighted sum of router losses on this rank (on the device: no sync)."""

    def __init__(self, coefficient: float) -> None:
        self.coefficient = coefficient
        self._weighted_sum: torch.Tensor | None = None

    @classmethod
    def build(cls, config: TrainConfig, hf_config: Any) -> RouterLoss | None:
        coefficient = resolve_coefficient(config, hf_config)
        return cls(coefficient) if coefficient > 0 else None

    @staticmethod
    def describe(config: TrainConfig, hf_config: Any) -> str | None:
        if not has_router(hf_config):
            return None
        coef = resolve_coefficient(config, hf_config)
        if coef > 0:
            source = "" if config.router_aux_loss_coef is not None else " (the model config's)"
            return f"router loss: load balancing x {coef:g}{source}, logged as aux_loss"
        why = (
            "--router_aux_loss_coef 0" if config.router_aux_loss_coef == 0 else "the model config's"
        )
        return (
            f"router loss: off ({why}; --router_aux_loss_coef "
            f"{getattr(hf_config, 'router_aux_loss_coef', None) or 0.001:g} adds it)"
        )

    # What the model's forward needs to return its router loss (`outputs.aux_loss`).
    forward_kwargs: ClassVar[Mapping[str, Any]] = {"output_router_logits": True}

    def objective_term(self, outputs: Any, targets: int) -> torch.Tensor:
        """coef x the micro-batch's router loss x its target tokens: add it to the summed token
        loss before the common normalisation."""
        aux = outputs.aux_loss
        assert isinstance(aux, torch.Tensor), "the model returned no router loss"
        weighted = aux.float() * targets
        detached = weighted.detach().to(torch.float64)
        self._weighted_sum = (
            detached if self._weighted_sum is None else self._weighted_sum + detached
        )
        return self.coefficient * weighted

    def step_value(self, global_targets: float) -> float:
        """Collective: the step's router loss (token-weighted mean over all micro-batches and
        ranks, without the coefficient), and a fresh start for the next step."""
        local = self._weighted_sum
        assert local is not None, "no micro-batch in this step"
        self._weighted_sum = None
        return float(dist_utils.all_reduce_sum(local)) / max(global_targets, 1.0)

    def reset(self) -> None:
        """Forget this rank's sum (a step that is not logged)."""
        self._weighted_sum = None
