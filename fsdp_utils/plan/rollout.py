"""The rollout phase of a method that samples its own completions (GRPO: fsdp_utils/methods/grpo/),
planned beside its update.

During a rollout (`fsdp_utils.parallel.generate.PolicyEngine`) every rank holds, besides what
lives between steps (its shard of the parameters, the optimizer state, a frozen reference's
shard; no gradients: they are freed after each optimizer step):

    gathered parameters  every shard group kept gathered for the phase, in the compute dtype
                         (`gathered_parameters`): the whole model's parameters on every rank
    KV cache             keys and values of every layer for the micro-batch's rows (prompts x
                         G) and every position up to --max_seq_length (prompt + completion)
    prefill              the forward over the prompts, without gradients: one layer's hidden
                         states, attention and MLP intermediates at a time
    logits               the last position's logits per row, and the sampler's float64
                         probabilities and log-probabilities of them

The update is traced as any step is (estimate.py: `Method.planned_step`); the rollout is counted
from the model's shapes and the sharded model's own parameters, because a rollout is token by
token (thousands of forwards, each reading the cache), which a trace on fake tensors would have
to follow one by one. The KV cache and the gathered parameters, which decide the phase's peak
on large models, are exact tensor sizes; the prefill's intermediates are an upper bound of one
layer's (no fused kernels assumed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_utils.config.batch import BatchPlan
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.model.build import compute_dtype
from fsdp_utils.model.qlora import quantized_parameters
from fsdp_utils.plan.search import largest_fitting
from fsdp_utils.plan.tracking import OPTIMIZER, PARAMETERS, Breakdown, StepMemory

FLOAT64 = 8


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def gathered_parameter_bytes(model: nn.Module, config: TrainConfig) -> int:
    """The bytes of every parameter gathered, as FSDP2 all-gathers it: the full shape in the
    compute dtype (its mixed-precision policy). A 4-bit base is left out: FSDP2 does not shard
    it (every rank holds it whole already: `qlora.unsharded_bytes`, in the update's state)."""
    element = _size(compute_dtype(config.precision))
    whole = {id(p) for p in quantized_parameters(model).values()}
    return sum(p.numel() * element for p in model.parameters() if id(p) not in whole)


def _text_config(hf_config: Any) -> Any:
    get = getattr(hf_config, "get_text_config", None)
    return get() if callable(get) else hf_config


@dataclass(frozen=True)
class RolloutPlan:
    """A rollout phase's bytes per GPU, by part (`describe`), and as the plan's breakdown."""

    rows: int  # completions sampled at once: prompts per micro-batch x G
    resident: int  # sharded parameters, optimizer state, a frozen copy's shard
    optimizer: int
    gathered: int
    kv_cache: int
    prefill: int
    logits: int

    @property
    def total(self) -> int:
        return self.resident + self.gathered + self.kv_cache + self.prefill + self.logits

    def breakdown(self) -> Breakdown:
        return Breakdown(
            parameters=self.resident - self.optimizer + self.gathered,
            gradients=0,
            optimizer_state=self.optimizer,
            activations=self.kv_cache + self.prefill,
            temporaries=self.logits,
        )


def plan_rollout(
    hf_config: Any,
    config: TrainConfig,
    batch: BatchPlan,
    gathered: int,
    update: StepMemory,
) -> RolloutPlan:
    """The rollout phase of `config` with the batch plan `batch`; `gathered` from
    `gathered_parameter_bytes`, what lives between steps from the traced update's state when
    its optimizer step starts (less the gradients, freed by then in a rollout)."""
    text = _text_config(hf_config)
    element = _size(compute_dtype(config.precision))
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    layers = int(text.num_hidden_layers)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    vocab = int(text.vocab_size)
    rows = batch.batch_size_per_device * batch.sequences_per_example
    positions = batch.seq_length
    prompt = max(positions - config.max_completion_length, 1)
    kv_cache = layers * 2 * kv_heads * head_dim * element * rows * positions
    # One layer at a time under no_grad: the residual stream in and out, q/k/v and the
    # attention output, and the MLP's gate, up and activated intermediates.
    per_token = 2 * hidden + (heads + 2 * kv_heads) * head_dim + hidden + 3 * intermediate
    prefill = rows * prompt * per_token * element
    logits = rows * vocab * (element + 2 * FLOAT64)
    before = update.before_optimizer
    resident = sum(before.get(k, 0) for k in PARAMETERS + OPTIMIZER)
    optimizer = sum(before.get(k, 0) for k in OPTIMIZER)
    return RolloutPlan(rows, resident, optimizer, gathered, kv_cache, prefill, logits)


def per_prompt_bytes(rollout: RolloutPlan, prompts: int) -> int:
    """The rollout's bytes that grow with the prompts per micro-batch, per prompt (its G rows'
    cache, prefill and logits)."""
    return (rollout.kv_cache + rollout.prefill + rollout.logits) // max(prompts, 1)


def largest_prompts(
    *,
    prompts: int,
    candidates: Sequence[int],
    update_state: int,
    update_peak: int,
    rollout: RolloutPlan,
    memory_bytes: int,
    required: Callable[[int], int],
) -> int:
    """The most prompts per micro-batch (each G completions) among `candidates` (those that
    divide the total batch per GPU) whose two phases both fit in `memory_bytes` with their
    margin (`required(peak) -> bytes`), the bytes of each phase that grow with the batch taken
    as proportional to it (activations, the KV cache); 0 if none."""
    update_per_prompt = max(update_peak - update_state, 0) / max(prompts, 1)
    rollout_fixed = rollout.resident + rollout.gathered
    rollout_per_prompt = per_prompt_bytes(rollout, prompts)

    def fits(n: int) -> bool:
        update = update_state + update_per_prompt * n
        sampling = rollout_fixed + rollout_per_prompt * n
        return max(required(round(update)), required(round(sampling))) <= memory_bytes

    return largest_fitting(candidates, fits) or 0
