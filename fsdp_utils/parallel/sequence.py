"""Sequence parallelism (`--sequence_parallel N`): the ranks as a data-parallel x
sequence-parallel mesh, and what may be split.

Each sequence of a micro-batch is split into N contiguous slices, one per rank of a
sequence-parallel group of N consecutive ranks; the W / N groups are the data-parallel ranks
(every rank of a group reads the same sequences: the step sampler is given the data-parallel
rank and size, so the data order stays a pure function of the step on any world size and any
N). Attention trades the sequence slice for a slice of the heads and back (DeepSpeed-Ulysses:
`fsdp_utils.parallel.ulysses`); everything else in a decoder layer works on its own tokens.
FSDP2 still shards the parameters over all W ranks (its mesh is the flattened one, the same as
without sequence parallelism), so a checkpoint does not depend on N.

Why the update equals the unsplit run's without any change to the gradient reduction: every
target token lives on exactly one rank (the labels are shifted before the split), the step's
loss is the sum over all ranks' tokens divided by the global count of target tokens
(`train.step`), FSDP averages the gradients over all W ranks and the loss is multiplied by W
beforehand. The all-to-all's backward carries each head's gradient back to the rank of its
tokens, so the sum over the ranks' parameter gradients is the gradient of the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh

from fsdp_utils.config.batch import data_parallel_size, divisors
from fsdp_utils.config.seq_length import context_length
from fsdp_utils.data.sequence_slices import padded_length
from fsdp_utils.parallel.distributed import DistEnv

# The keyword under which a forward receives its SequenceParallel (`forward_kwargs`): transformers
# hands unknown keywords of a causal LM's forward down to the attention function of every layer
# (checked for every supported family in tests/test_sequence_parallel.py), so only the forwards of
# sliced batches split their attention; generation and scoring of whole sequences (the chess
# evaluation, --sample_prompts) run the inner kernel untouched.
FORWARD_KEYWORD = "sequence_parallel"

# Model types whose split attention tests/test_sequence_parallel.py checks against the unsplit
# model's, loss and gradients: the supported families (docs/models.md). Another family may pass
# its attention differently, so it is refused by name rather than trusted.
SPLIT_FAMILIES = frozenset(
    {
        "llama", "qwen2", "mistral", "gemma", "gpt2", "gpt_neox", "qwen3", "gemma2", "gemma3_text",
        "phi3", "olmo2", "granite", "mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss",
    }
)  # fmt: skip
# The kernels split attention runs inside (after the all-to-all, on whole sequences): the two
# whose masks transformers builds as tensors, which this project can test on CPU.
SPLIT_KERNELS = ("sdpa", "eager")


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in the data-parallel x sequence-parallel mesh.

    `size` ranks share each sequence (1: off); this rank holds slice `rank` of it; `group` is
    their process group. `data_rank` / `data_size`: which sequences the rank reads, as the step
    sampler and the evaluation split count ranks."""

    size: int = 1
    rank: int = 0
    data_rank: int = 0
    data_size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup of the `size` ranks; None when off

    @classmethod
    def off(cls, env: DistEnv) -> SequenceParallel:
        """No sequence parallelism: every rank reads its own sequences."""
        return cls(data_rank=env.rank, data_size=env.world_size)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def leader(self) -> bool:
        """The rank of its group that carries what is computed whole from the slices (a DPO
        pair's loss and metrics: `sum_over_slices`). Every rank leads its own when off."""
        return self.rank == 0

    def sum_over_slices(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of `value` over the group's ranks (each rank's slices' part of a per-sequence
        total: a sequence's log-probability), differentiable. Its backward sums the gradients
        over the group, so only the `leader` may carry a loss computed from it (the others
        carry it times 0): each rank's slices then get the whole sequence's gradient once."""
        if not self.enabled:
            return value
        summed = funcol.all_reduce(value, "sum", self.group)
        return summed.wait() if isinstance(summed, funcol.AsyncCollectiveTensor) else summed

    def forward_kwargs(self) -> dict[str, Any]:
        """What a forward of this rank's slices passes to the model (nothing when off)."""
        return {FORWARD_KEYWORD: self} if self.enabled else {}


def init_sequence_parallel(env: DistEnv, size: int) -> SequenceParallel:
    """This rank's SequenceParallel: a (data, sequence) device mesh whose sequence dimension is
    the innermost, so that a group is N consecutive ranks (the GPUs of one node, where the
    all-to-all is fastest, when N divides the GPUs per node). Collective when size > 1."""
    data_size = data_parallel_size(env.world_size, size)
    if size == 1:
        return SequenceParallel.off(env)
    mesh = init_device_mesh(env.device.type, (data_size, size), mesh_dim_names=("data", "sequence"))
    group = mesh.get_group("sequence")
    return SequenceParallel(
        size=size,
        rank=dist.get_rank(group),
        data_rank=mesh.get_local_rank("data"),
        data_size=data_size,
        group=group,
    )


def check_splittable(
    hf_config: Any,
    size: int,
    *,
    attn_implementation: str,
    max_seq_length: int,
    world_size: int | None = None,
) -> None:
    """Refuse, with the valid values, what --sequence_parallel `size` cannot split: a world
    size it does not divide, attention heads it does not divide, a family or kernel that is not
    known to split exactly, a sequence whose padding (to a multiple of N) would pass the
    model's context. Key-value heads fewer than N (or not a multiple of it) are repeated."""
    if size == 1:
        return
    if world_size is not None:
        data_parallel_size(world_size, size)
    padded = padded_length(max_seq_length, size)
    limit = context_length(hf_config)
    if limit is not None and padded > limit:
        raise ValueError(
            f"--max_seq_length {max_seq_length} is padded to {padded} for --sequence_parallel "
            f"{size} (a multiple of N), above the model's context length of {limit} tokens. "
            f"Use --max_seq_length {limit // size * size}."
        )
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SPLIT_FAMILIES:
        raise ValueError(
            f"--sequence_parallel: the attention of {model_type} models is not known to split "
            f"exactly (tested families: {', '.join(sorted(SPLIT_FAMILIES))}). Train without "
            "--sequence_parallel, with a shorter --max_seq_length and --gradient_checkpointing."
        )
    heads = attention_heads(hf_config)
    if heads % size:
        fits = [d for d in divisors(heads) if world_size is None or world_size % d == 0]
        raise ValueError(
            f"--sequence_parallel {size} does not divide the {heads} attention heads of this "
            f"{model_type} model: after the all-to-all each rank computes whole sequences for "
            f"heads / N of the heads. Valid values: {', '.join(str(d) for d in fits)}"
            + (f" (those that also divide the {world_size} processes)." if world_size else ".")
        )
    if attn_implementation not in SPLIT_KERNELS:
        raise ValueError(
            f"--sequence_parallel with --attn_implementation {attn_implementation}: split "
            f"attention runs inside {' or '.join(SPLIT_KERNELS)} (on GPUs SDPA picks its flash "
            "kernel when no mask is needed); flash_attention_2 and flex_attention are not "
            "wired to it. Use --attn_implementation sdpa."
        )


def attention_heads(hf_config: Any) -> int:
    """The query heads of a decoder layer (GPT-2 calls them n_head)."""
    heads = getattr(hf_config, "num_attention_heads", None) or getattr(hf_config, "n_head", None)
    assert heads, f"{type(hf_config).__name__} names no attention heads"
    return int(heads)
