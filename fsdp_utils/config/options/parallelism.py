"""Parallelism, precision and memory: FSDP2 or DDP, sharding, offload, activation
checkpointing, sequence parallelism, the loss in chunks, compilation, attention
(fsdp_utils/parallel/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .section import Section, check_at_least

SECTION = Section("parallelism", "parallelism, precision and memory")
_opt = SECTION.option

Precision = Literal["bf16-mixed", "fp16-mixed", "bf16-true", "fp32"]
Sharding = Literal["full", "shard_grad_op", "hybrid", "no_shard"]
DeviceName = Literal["auto", "cuda", "cpu"]
# transformers' names (`attn_implementation=`); what each can do: fsdp_utils/model/attention.py.
AttnImplementation = Literal["sdpa", "eager", "flash_attention_2", "flex_attention"]


@dataclass
class ParallelismOptions:
    no_fsdp: bool = field(
        default=False,
        metadata=_opt("Plain data parallel (DDP): every device holds everything."),
    )
    no_layer_wrap_policy: bool = field(
        default=False,
        metadata=_opt("Shard only at the root (one FSDP group for the whole model)."),
    )
    sharding: Sharding = field(
        default="full",
        metadata=_opt(
            "full: shard params, grads, optimizer state; shard_grad_op: keep params gathered "
            "between forward and backward; hybrid: shard within a node, replicate across nodes; "
            "no_shard: replicate (DDP-like)."
        ),
    )
    cpu_offload: bool = field(
        default=False,
        metadata=_opt("Keep sharded params, grads and optimizer state in host RAM (FSDP2)."),
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata=_opt("Recompute decoder-layer activations in backward."),
    )
    checkpoint_every_n_layers: int = field(
        default=1,
        metadata=_opt("With --gradient_checkpointing: checkpoint every Nth layer."),
    )
    checkpoint_layers: int | None = field(
        default=None,
        metadata=_opt(
            "Checkpoint the first N decoder layers (0: none; the layer count or more: all, as "
            "--gradient_checkpointing): between no and full checkpointing, the memory of N "
            "layers' activations for their recompute. --auto chooses it."
        ),
    )
    sequence_parallel: int = field(
        default=1,
        metadata=_opt(
            "Split each sequence into N contiguous slices over N ranks (DeepSpeed-Ulysses: an "
            "all-to-all around attention), so that a GPU holds 1/N of its activations: for "
            "sequences longer than one GPU holds. N divides the processes and the attention "
            "heads; the N ranks of a group read the same sequences (docs/long-context.md)."
        ),
    )
    loss_chunk_size: int | None = field(
        default=None,
        metadata=_opt(
            "Target tokens per chunk of the loss: the output layer and cross-entropy run over "
            "chunks of this many tokens, each chunk's logits recomputed in backward, so the "
            "full [tokens, vocabulary] logits never exist (default: as many tokens as hold "
            "64 Mi logits, 523 for a 128,256-word vocabulary; 0: the whole batch at once)."
        ),
    )
    defer_grad_sync: bool = field(
        default=False,
        metadata=_opt(
            "Reduce gradients only on the last micro-batch (less communication, but full "
            "unsharded gradients stay in memory)."
        ),
    )
    precision: Precision = field(
        default="bf16-mixed",
        metadata=_opt(
            "bf16-mixed (fp32 master weights, bf16 compute), fp16-mixed (with a gradient "
            "scaler), bf16-true (everything bf16: least memory), fp32."
        ),
    )
    device: DeviceName = field(
        default="auto",
        metadata=_opt("cuda if available, else cpu (gloo backend)."),
    )
    collective_timeout_minutes: float = field(
        default=30.0,
        metadata=_opt(
            "A collective (all-reduce, barrier, ...) that waits longer than this for a rank "
            "fails the run instead of hanging: a dead or frozen node ends the job. Raise it if "
            "the final save of a very large model takes longer (ranks wait for rank 0)."
        ),
    )
    attn_implementation: AttnImplementation = field(
        default="sdpa",
        metadata=_opt(
            "transformers' attention implementation (llama-recipes' use_fast_kernels): sdpa "
            "(eager for models without it, as transformers does), eager, flash_attention_2 "
            "(CUDA and the flash-attn package), flex_attention. Checked before the job waits."
        ),
    )
    compile: bool = field(
        default=False,
        metadata=_opt(
            "torch.compile each decoder layer (after activation checkpointing, before FSDP), "
            "as torchtitan does; the first step is slower while it compiles."
        ),
    )
    auto: bool = field(
        default=False,
        metadata=_opt(
            "Choose the fastest configuration that fits, before the first step: sharding, "
            "--checkpoint_layers, --batch_size_per_device (the total batch held), "
            "--sequence_parallel, --compile on GPUs, --cpu_offload only when nothing else "
            "fits (the memory planner and the step-time model: docs/plan.md). A setting you "
            "give yourself is kept (--auto_keep); the choice and why are in the log, the "
            "values in config.json, and a requeued leg reuses it."
        ),
    )
    auto_keep: str = field(
        default="",
        metadata=_opt(
            "With --auto: settings it must not change, comma-separated (e.g. "
            "sharding,batch_size_per_device); any of them given on the command line or in "
            "--config is added."
        ),
    )
    interconnect: str | None = field(
        default=None,
        metadata=_opt(
            "The network between nodes, for the step time (--plan, --auto): ndr, ndr200, "
            "hdr, hdr100, edr, eth100, eth25 (default: the GPU kind's usual one)."
        ),
    )
    fabric_gbps: float | None = field(
        default=None,
        metadata=_opt("Bandwidth between nodes per GPU in Gb/s (overrides --interconnect)."),
    )


# What --auto chooses (fsdp_utils/plan/auto.py), in the order its log names them.
AUTO_SETTINGS = (
    "sharding", "checkpoint_layers", "batch_size_per_device", "sequence_parallel", "compile",
    "cpu_offload",
)  # fmt: skip
# A flag given that pins one of them (--gradient_checkpointing pins the checkpointed layers).
AUTO_PINNED_BY = {
    "gradient_checkpointing": "checkpoint_layers",
    "checkpoint_every_n_layers": "checkpoint_layers",
    "gradient_accumulation_steps": "batch_size_per_device",
}


def auto_kept(options: ParallelismOptions) -> list[str]:
    """--auto_keep's names, each one --auto chooses (checked in `check`)."""
    return [name.strip() for name in options.auto_keep.split(",") if name.strip()]


def check(options: ParallelismOptions) -> None:
    check_at_least(options, ("checkpoint_every_n_layers", "sequence_parallel"))
    if options.checkpoint_layers is not None and options.checkpoint_layers < 0:
        raise ValueError(
            f"--checkpoint_layers must be 0 or more (0: none), got {options.checkpoint_layers}."
        )
    if options.checkpoint_layers is not None and options.checkpoint_every_n_layers > 1:
        raise ValueError(
            "--checkpoint_layers N checkpoints the first N layers; --checkpoint_every_n_layers "
            "spreads them over the stack: give one of the two."
        )
    unknown = [name for name in auto_kept(options) if name not in AUTO_SETTINGS]
    if unknown:
        raise ValueError(
            f"--auto_keep {','.join(unknown)}: not a setting --auto chooses. It chooses "
            f"{', '.join(AUTO_SETTINGS)}."
        )
    if options.loss_chunk_size is not None and options.loss_chunk_size < 0:
        raise ValueError(
            f"--loss_chunk_size must be >= 0 (0: unchunked), got {options.loss_chunk_size}."
        )
    if options.collective_timeout_minutes <= 0:
        raise ValueError(
            "--collective_timeout_minutes must be positive, got "
            f"{options.collective_timeout_minutes}."
        )
    if options.no_fsdp and (options.no_layer_wrap_policy or options.cpu_offload):
        raise ValueError(
            "--no_fsdp (DDP) cannot be combined with --no_layer_wrap_policy or --cpu_offload, "
            "which are FSDP options."
        )
    if options.no_fsdp and options.sharding != "full":
        raise ValueError("--no_fsdp (DDP) cannot be combined with --sharding.")
