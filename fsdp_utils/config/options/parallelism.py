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
# What activation checkpointing keeps of a checkpointed layer (fsdp_utils/parallel/selective_checkpoint.py).
CheckpointMode = Literal["layer", "op"]
# torch's SDPA kernels (torch.nn.attention.SDPBackend); what runs where: fsdp_utils/model/sdpa.py.
SdpaBackend = Literal["auto", "cudnn", "flash", "efficient", "math"]
# What --compile compiles (fsdp_utils/parallel/compile.py).
CompileScope = Literal["layers", "model"]
# How one process trains (fsdp_utils/parallel/single_device.py).
SingleDevicePath = Literal["fsdp", "direct"]
# torchao's float8 training recipes (fsdp_utils/model/float8.py).
Float8Recipe = Literal["none", "tensorwise", "rowwise"]


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
    checkpoint_mode: CheckpointMode = field(
        default="layer",
        metadata=_opt(
            "With --gradient_checkpointing: layer keeps only a checkpointed layer's input and "
            "recomputes all of it in backward; op (torchtitan's selective checkpointing) also "
            "keeps the attention outputs and every second matrix product, and recomputes the "
            "cheap ops between them (norms, rotary, activations): less recompute, more memory."
        ),
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
            "full [tokens, vocabulary] logits never exist (default per device: on a GPU 8,192 "
            "tokens, at most 256 Mi logits; on a CPU as many tokens as hold 64 Mi logits, 523 for "
            "a 128,256-word vocabulary; 0: the whole batch at once)."
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
    sdpa_backend: SdpaBackend = field(
        default="auto",
        metadata=_opt(
            "The kernel under sdpa attention: auto (torch's choice), cudnn, flash, efficient "
            "or math (torch.nn.attention.sdpa_kernel). The log names the kernel that ran; one "
            "the device cannot run is refused before the first step (the CPU has math and flash)."
        ),
    )
    compile: bool = field(
        default=False,
        metadata=_opt(
            "torch.compile each decoder layer (after activation checkpointing, before FSDP), "
            "as torchtitan does, and the loss's chunks; the first step is slower while it "
            "compiles. Graph breaks and recompiles are counted in the log."
        ),
    )
    compile_scope: CompileScope = field(
        default="layers",
        metadata=_opt(
            "With --compile: layers (each decoder layer on its own, torchtitan's way) or model "
            "(the whole decoder stack, embeddings to final norm, as one compiled forward; "
            "FSDP2's hooks still break its graph around every layer)."
        ),
    )
    single_device_path: SingleDevicePath = field(
        default="fsdp",
        metadata=_opt(
            "On one process: fsdp (FSDP2 as on many GPUs) or direct (no FSDP2: each layer "
            "casts its fp32 weights to the compute dtype itself, with FSDP2's numerics and "
            "checkpoint format, without its per-layer copies; resumable on any number of "
            "processes). Ignored on more processes."
        ),
    )
    reshard_last_layer: bool = field(
        default=False,
        metadata=_opt(
            "Free the last decoder layer's gathered parameters after its forward, as every "
            "other layer's (default: kept gathered until its backward, which comes next: one "
            "all-gather less per micro-batch for one layer's parameters in memory)."
        ),
    )
    float8: Float8Recipe = field(
        default="none",
        metadata=_opt(
            "float8 matrix products for the decoder layers' linear layers (torchao's float8 "
            "training; the output layer stays in the compute dtype): tensorwise or rowwise "
            "scaling. Needs a GPU with float8 (compute capability 8.9: L4, L40, H100, H200, "
            "B200); best with --compile."
        ),
    )
    liger_kernels: bool = field(
        default=False,
        metadata=_opt(
            "liger-kernel's Triton kernels (CUDA only): fused RMSNorm, SwiGLU and rotary in the "
            "decoder layers and its fused linear cross-entropy for the loss, for the families "
            "it supports (docs/switches.md). Refused on the CPU."
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


def auto_kept(auto_keep: str) -> list[str]:
    """--auto_keep's names (a run's or a config file's), each one --auto chooses (checked in
    `check`)."""
    return [name.strip() for name in auto_keep.split(",") if name.strip()]


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
    unknown = [name for name in auto_kept(options.auto_keep) if name not in AUTO_SETTINGS]
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
    checkpoints = options.gradient_checkpointing or options.checkpoint_layers or options.auto
    if options.checkpoint_mode != "layer" and not checkpoints:
        raise ValueError(
            f"--checkpoint_mode {options.checkpoint_mode} chooses what activation checkpointing "
            "keeps, and this run does not checkpoint: add --gradient_checkpointing (or "
            "--checkpoint_layers N), or drop --checkpoint_mode."
        )
    if options.no_fsdp and options.sharding != "full":
        raise ValueError("--no_fsdp (DDP) cannot be combined with --sharding.")
    if options.compile_scope != "layers" and not options.compile:
        raise ValueError(
            f"--compile_scope {options.compile_scope} chooses what --compile compiles, and "
            "--compile is off. Add --compile, or drop --compile_scope."
        )
    if options.single_device_path == "direct" and (options.no_fsdp or options.cpu_offload):
        raise ValueError(
            "--single_device_path direct replaces FSDP2 on one process; --no_fsdp (DDP) and "
            "--cpu_offload (FSDP2's offload) are other ways to run. Drop one of them."
        )
