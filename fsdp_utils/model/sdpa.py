"""What runs under `sdpa` attention: grouped-query attention without copies of the keys and
values, and `--sdpa_backend`, the kernel torch may choose.

**GQA without copying K/V.** A grouped-query model (Llama 3: 32 query heads over 8 key-value
heads) asks SDPA to let each key-value head serve its group of query heads. transformers'
`sdpa_attention_forward` (integrations/sdpa_attention.py, 5.17 to 5.24) passes `enable_gqa=True`
only when no mask is given; with a mask (packed documents under `--document_masking`, padding)
it calls `repeat_kv`, which copies every key and value head once per query head of its group
(4x for 32/8 heads), and SDPA keeps those copies for its backward. `install()` registers, in
place of transformers' `sdpa`, a function that passes the mask and `enable_gqa=True` instead,
where torch runs the same kernel either way (`torch._fused_sdp_choice`, the function SDPA
itself dispatches with, asked for both): the same kernel reading each key-value head for its
group, without the copies. Everywhere else (no mask, where transformers already passes
`enable_gqa`; a kernel that takes no GQA with a mask, which torch would swap for its math
fallback; dropout; under `--compile`, whose graph is traced once) it calls transformers' own
function unchanged. The name stays `sdpa`, so that everything that reads it (the document
masking rule, split attention, the log) is unchanged. Exact: the same kernel computes each
query head from the same key and value numbers (tests/test_sdpa.py: outputs and gradients
against transformers' path).

**`--sdpa_backend`.** torch picks one of four CUDA kernels for each SDPA call: cuDNN (preferred
on Hopper with a recent cuDNN), flash (FlashAttention 2: no mask), memory-efficient (xformers'
cutlass kernels: masks, fp32) and math (the unfused reference, which keeps the [T, T] scores),
and on the CPU a flash kernel or math. `auto` leaves the choice to torch; the others restrict
it to one kernel (`torch.nn.attention.sdpa_kernel`, set for the training process). A kernel that
cannot run the run's attention is refused before the first step with torch's own reasons
(`check_backend_runs`: torch's `can_use_*_attention` on the run's shapes, dtype and mask), and
on the CPU already in the preflight (`check_sdpa_backend`). Which kernel ran is read from the
first step's profile (fsdp_utils/metrics/profile.py) and named in the log.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from fsdp_utils.config.train_config import TrainConfig

# --sdpa_backend's names for torch's kernels
BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
# What torch has on the CPU: its flash kernel (`_scaled_dot_product_flash_attention_for_cpu`,
# masks and grouped-query heads included) and math; cuDNN and efficient are CUDA kernels.
CPU_BACKENDS = ("flash", "math")
# The ATen operator each kernel runs as (forward), as the profiler names it without "aten::".
KERNEL_OPS = {
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
    # math is not one operator: SDPA's math path runs as this composite, then plain ops
    "_scaled_dot_product_attention_math": "math",
}


def check_sdpa_backend(
    config: TrainConfig, *, device_type: str | None, supports_sdpa: bool
) -> None:
    """Raise ValueError (one paragraph, naming the fix) for a `--sdpa_backend` that cannot run
    here, found from the options alone (the preflight): a backend for a model that does not
    run sdpa, a CUDA kernel on the CPU, flash with masks or cuDNN and flash in fp32 on GPUs
    (`device_type` None: on GPUs this machine does not have, the login node's preflight)."""
    backend = config.sdpa_backend
    if backend == "auto":
        return
    if config.attn_implementation != "sdpa" or not supports_sdpa:
        runs = config.attn_implementation if supports_sdpa else "eager (it cannot run sdpa)"
        raise ValueError(
            f"--sdpa_backend {backend} chooses the kernel under sdpa attention, and this model "
            f"runs {runs}. Drop --sdpa_backend, or use --attn_implementation sdpa."
        )
    if device_type == "cpu":
        if backend not in CPU_BACKENDS:
            raise ValueError(
                f"--sdpa_backend {backend} is a CUDA kernel, and this run is on the CPU, where "
                "torch's SDPA has two kernels: flash (its CPU flash kernel) and math. Use "
                "--sdpa_backend flash, math or auto here."
            )
        return
    if backend in ("flash", "cudnn") and config.precision == "fp32":
        raise ValueError(
            f"--sdpa_backend {backend} computes in fp16 or bf16 only, and --precision fp32 "
            "computes in fp32. Use --precision bf16-mixed, or --sdpa_backend efficient (or "
            "auto)."
        )
    if backend == "flash" and config.document_masking:
        raise ValueError(
            "--sdpa_backend flash takes no attention mask, and --document_masking keeps packed "
            "documents apart with one. Use --sdpa_backend cudnn or efficient (both take masks), "
            "or auto."
        )


@contextmanager
def sdpa_backend(backend: str) -> Iterator[None]:
    """Within: SDPA may run only `backend`'s kernel (`auto`: any, torch's choice)."""
    from torch.nn.attention import sdpa_kernel

    if backend == "auto":
        yield
        return
    with sdpa_kernel([BACKENDS[backend]]):
        yield


def use_sdpa_backend(backend: str) -> None:
    """Restrict the training process's SDPA calls to `backend`'s kernel, or (`auto`) allow
    every kernel again, torch's default: a process that trains several runs one after the
    other (the tests' launcher) gets each run's own choice."""
    from torch.backends import cuda

    allowed = set(BACKENDS) if backend == "auto" else {backend}
    cuda.enable_cudnn_sdp("cudnn" in allowed)
    cuda.enable_flash_sdp("flash" in allowed)
    cuda.enable_mem_efficient_sdp("efficient" in allowed)
    cuda.enable_math_sdp("math" in allowed)


@contextmanager
def generation_kernels() -> Iterator[None]:
    """Within: SDPA's math kernel allowed after the kernel `--sdpa_backend` chose for the
    process (`use_sdpa_backend`), the chosen one still tried first. Decoding and scoring
    (fsdp_utils/parallel/generate.py: GRPO's rollouts, the chess evaluation, sample prompts)
    attend with padding masks and one-token queries that the chosen kernel may not take
    (flash takes no mask): without a fallback torch finds "no available kernel". The training
    forward, outside, keeps the chosen kernel alone."""
    from torch.backends import cuda
    from torch.nn.attention import sdpa_kernel

    if cuda.math_sdp_enabled():  # auto or math: every call has a kernel already
        yield
        return
    enabled = {
        "cudnn": cuda.cudnn_sdp_enabled, "flash": cuda.flash_sdp_enabled,
        "efficient": cuda.mem_efficient_sdp_enabled,
    }  # fmt: skip
    chosen = [BACKENDS[name] for name, on in enabled.items() if on()]
    # torch ranks math before cuDNN: set_priority keeps the chosen kernel first. sdpa_kernel
    # restores the enabled kernels but leaves its order behind (torch 2.11 to 2.13): restored
    # here, so that a later `auto` in this process gets torch's own order.
    priority = torch._C._get_sdp_priority_order()
    try:
        with sdpa_kernel([*chosen, SDPBackend.MATH], set_priority=True):
            yield
    finally:
        torch._C._set_sdp_priority_order(priority)


def check_backend_runs(config: TrainConfig, hf_config: Any, device: torch.device) -> None:
    """On CUDA, for a chosen backend: raise ValueError (one paragraph, torch's reasons and the
    fix) if torch's `can_use_*_attention` refuses the run's attention: its shapes (one
    micro-batch, the sequence, the heads), compute dtype and mask, on this GPU."""
    if config.sdpa_backend in ("auto", "math") or device.type != "cuda":
        return
    refusal = backend_refusal(config, hf_config, device)
    if refusal is not None:
        raise ValueError(
            f"--sdpa_backend {config.sdpa_backend} cannot run this run's attention on this GPU "
            f"({torch.cuda.get_device_name(device)}; {refusal} Use --sdpa_backend auto "
            "(torch's choice), or another kernel."
        )


def backend_refusal(config: TrainConfig, hf_config: Any, device: torch.device) -> str | None:
    """None where torch's `can_use_*_attention` takes the run's attention with the chosen
    backend (CUDA), else the shapes and torch's reasons. With a mask, the key-value heads reach
    SDPA grouped (`sdpa_attention`, where the kernel takes them so) or repeated to the query's
    (transformers' `repeat_kv`, where it does not): either form runs."""
    from torch.backends import cuda

    from fsdp_utils.model.build import compute_dtype

    backend = config.sdpa_backend
    text = hf_config.get_text_config()
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    batch, length = config.batch_size_per_device, config.seq_length
    dtype = compute_dtype(config.precision)

    def heads_of(count: int) -> torch.Tensor:  # as the projections give them: [b, s, h, d]^T
        return torch.empty(batch, length, count, head_dim, dtype=dtype, device=device).transpose(
            1, 2
        )

    query = heads_of(heads)
    mask = None
    if config.document_masking:  # the block-diagonal mask transformers builds
        mask = torch.ones(batch, 1, length, length, dtype=torch.bool, device=device).tril()
    # Without a mask transformers passes enable_gqa; with one, grouped or repeated (above)
    forms = [kv_heads]
    if mask is not None and kv_heads != heads:
        forms.append(heads)
    usable = {
        "cudnn": cuda.can_use_cudnn_attention,
        "flash": cuda.can_use_flash_attention,
        "efficient": cuda.can_use_efficient_attention,
    }[backend]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for count in forms:
            key, value = heads_of(count), heads_of(count)
            params = cuda.SDPAParams(query, key, value, mask, 0.0, mask is None, count != heads)
            if usable(params, True):
                return None
    reasons = " ".join(dict.fromkeys(" ".join(str(w.message).split()) for w in caught))
    return (
        f"{heads} heads over {kv_heads} key-value heads of {head_dim}, {length} tokens, "
        f"{str(dtype).removeprefix('torch.')}{', a document mask' if mask is not None else ''})"
        f". torch says: {reasons or 'no reason given'}"
    )


# --- grouped-query attention without copies ----------------------------------------------


# transformers' own sdpa function, kept by `install` before it registers ours in its place:
# a module global, so that a compiled layer reads it without an import inside its trace
_TRANSFORMERS: dict[str, Any] = {}


def _transformers_sdpa() -> Any:
    if "sdpa" not in _TRANSFORMERS:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _TRANSFORMERS["sdpa"] = sdpa_attention_forward
    return _TRANSFORMERS["sdpa"]


def gqa_keeps_kernel(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor
) -> bool:
    """Whether SDPA runs the same kernel for `query` and the grouped `key`/`value` with
    `enable_gqa` as for key-value heads repeated to the query's number (`repeat_kv`), so that
    passing them grouped saves the copies and changes nothing else. False where no kernel
    allowed (`--sdpa_backend`) takes one of the calls: torch raises for it, and transformers'
    path, with the copies, is the one that may run."""
    try:
        grouped = torch._fused_sdp_choice(query, key, value, attn_mask=mask, enable_gqa=True)
        # repeat_kv's result has the query's shape, dtype and device: the query stands in for it
        repeated = torch._fused_sdp_choice(query, query, query, attn_mask=mask)
    except RuntimeError:  # no allowed kernel takes the grouped call: transformers' copies
        return False
    return bool(grouped == repeated)


def sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention ([batch, heads, seq, dim] in, [batch, seq, heads, dim]
    out), with grouped key-value heads passed as they are where a mask would make transformers
    copy them (see the module's doc)."""
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    if (
        groups > 1
        and attention_mask is not None
        and dropout == 0.0
        and query.shape[2] > 1
        and key.shape[2] == query.shape[2]
        and key.shape[-1] == value.shape[-1] == query.shape[-1]
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
        and not torch.compiler.is_compiling()
        and gqa_keeps_kernel(query, key, value, attention_mask)
    ):
        output = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
        )
        return output.transpose(1, 2).contiguous(), None
    return _transformers_sdpa()(  # type: ignore[no-any-return]
        module, query, key, value, attention_mask,
        dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs,
    )  # fmt: skip


def install() -> None:
    """Register `sdpa_attention` as transformers' `sdpa` for this process (idempotent): every
    model of the process whose implementation is sdpa runs it, split attention's inner kernel
    included."""
    from transformers import AttentionInterface

    _transformers_sdpa()
    AttentionInterface.register("sdpa", sdpa_attention)
