"""Throughput figures: training FLOPs per token, the GPU's peak for MFU, and memory."""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where CUDA is asked about: plots need not import it (1 s)
    import torch
    from torch import nn

    from fsdp_utils.config.train_config import TrainConfig

# Dense bf16 peak TFLOP/s per GPU (no sparsity), from NVIDIA's data sheets. V100 has no bf16:
# its fp16 tensor-core peak is used.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM
    ("H200", 989.0),
    ("GH200", 989.0),
    ("A100", 312.0),
    ("V100", 125.0),
)


def detect_peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS:
        if key in name:
            return tflops
    return None


def _config_int(hf_config: Any, *names: str) -> int:
    for name in names:
        value = getattr(hf_config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"config has none of {names}")


def tied_output_parameters(hf_config: Any) -> int:
    """The output projection's weights when they are the token embeddings (tie_word_embeddings:
    Qwen2, Gemma, GPT-2): a matmul of vocabulary x hidden per token like any linear layer, but
    left out of the non-embedding count, which subtracts the embedding tensor it shares."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if not getattr(text, "tie_word_embeddings", False):
        return 0
    return _config_int(text, "vocab_size") * _config_int(text, "hidden_size", "n_embd")


def attention_flops_per_token(hf_config: Any, seq_len: int) -> float:
    """Attention scores and values, forward and backward, per token: 12·L·H·Q·T, as if every
    token attended to all T (the convention of PaLM's appendix B, torchtitan and nanoGPT: causal
    masking and sliding windows are not discounted)."""
    layers = _config_int(hf_config, "num_hidden_layers", "n_layer")
    heads = _config_int(hf_config, "num_attention_heads", "n_head")
    head_dim = getattr(hf_config, "head_dim", None) or (
        _config_int(hf_config, "hidden_size", "n_embd") // heads
    )
    return 12.0 * layers * heads * head_dim * seq_len


def flops_per_token(hf_config: Any, non_embedding_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls (forward 2N, backward 4N) plus 12·L·H·Q·T for
    attention scores and values (PaLM appendix B; torchtitan, nanoGPT). N counts every weight
    that multiplies: the non-embedding parameters a token passes through and a tied output
    projection (nanoGPT counts it; leaving it out undercounted Qwen2, Gemma and GPT-2 by the
    lm_head's 6·V·d). For a mixture of experts `non_embedding_params` is the active count
    (`ModelInfo.active_parameters`: top-k / experts of the routed experts' parameters plus
    everything else), as torchtitan counts its MoE models; router softmax and top-k are left out.
    Checked against torch's FlopCounterMode for every tiny family (tests/test_flops.py).
    Recomputation by activation checkpointing is not counted: MFU measures useful work."""
    matmul_params = non_embedding_params + tied_output_parameters(hf_config)
    return 6.0 * matmul_params + attention_flops_per_token(hf_config, seq_len)


def lora_flops_per_token(
    full: float, hf_config: Any, non_embedding_params: int, trainable: int
) -> float:
    """A LoRA run's FLOPs per token, from full fine-tuning's: the frozen weights (every matmul
    weight of the model before the adapters) still take forward and input-gradient matmuls
    but no weight gradients (2 of their 6 per parameter); the adapters take all three."""
    frozen = non_embedding_params + tied_output_parameters(hf_config)
    return full - 2.0 * frozen + 6.0 * trainable


def frozen_layers_flops_per_token(
    full: float,
    hf_config: Any,
    seq_len: int,
    *,
    frozen_layers: int,
    frozen_layer_params: int,
    tied_output_frozen: bool,
) -> float:
    """A --freeze_layers run's FLOPs per token, from full fine-tuning's: nothing below the first
    trained layer needs a gradient, so the frozen layers run forward only (2 of 6 per weight, 4
    of 12 attention units); a lm_head tied to the frozen embeddings gets no weight gradient."""
    layers = _config_int(hf_config, "num_hidden_layers", "n_layer")
    attention_per_layer = attention_flops_per_token(hf_config, seq_len) / layers
    saved = 4.0 * frozen_layer_params + (8.0 / 12.0) * attention_per_layer * frozen_layers
    if tied_output_frozen:
        saved += 2.0 * tied_output_parameters(hf_config)
    return full - saved


def training_flops_per_token(
    hf_config: Any, model: nn.Module, non_embedding_params: int, config: TrainConfig
) -> float:
    """The FLOPs per token MFU counts for this run: full fine-tuning's, or a LoRA or
    --freeze_layers run's (from the built model's frozen and trainable parameters)."""
    full = flops_per_token(hf_config, non_embedding_params, config.seq_length)
    params = list(model.parameters())
    if config.lora:
        trainable = sum(p.numel() for p in params if p.requires_grad)
        return lora_flops_per_token(full, hf_config, non_embedding_params, trainable)
    if config.freeze_layers:
        from fsdp_utils.model.freeze import frozen_layer_parameters, tied_output_frozen

        frozen = frozen_layer_parameters(model)
        return frozen_layers_flops_per_token(
            full,
            hf_config,
            config.seq_length,
            frozen_layers=config.freeze_layers,
            frozen_layer_params=frozen,
            tied_output_frozen=tied_output_frozen(model),
        )
    return full


def _read_status_kib(*fields: str) -> dict[str, int]:
    """The KiB figures of /proc/self/status named `fields` (those found), in one read."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in fields:
                    found[name] = int(rest.split()[0])
    except OSError:
        pass
    return found


def reset_memory_peaks(device: torch.device) -> bool:
    """Start a new interval for `memory_snapshot`'s peaks: CUDA's peak statistics, and the
    host's peak RSS (VmHWM) through /proc/self/clear_refs ("5": Linux 4.0 and later, the
    process's own). False where the host's peak cannot be reset (it then runs from the
    process's start)."""
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def memory_snapshot(device: torch.device) -> dict[str, float | None]:
    """GiB: the PEAKS since the previous snapshot (or `reset_memory_peaks`), and a new interval:
    CUDA's peak allocated and reserved, the host's peak resident memory (rank 0's process:
    VmHWM, else ru_maxrss, the peak since the process started); and the host's RSS now."""
    gib = 1024**3
    out: dict[str, float | None] = {}
    if device.type == "cuda":
        import torch

        out["cuda_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / gib
        out["cuda_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / gib
    status = _read_status_kib("VmRSS", "VmHWM")
    rss = status.get("VmRSS")
    out["host_rss_gib"] = rss * 1024 / gib if rss is not None else None
    peak_kib = status.get("VmHWM")
    if peak_kib is None:
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    out["host_peak_rss_gib"] = peak_kib * 1024 / gib
    reset_memory_peaks(device)
    return out


def throughput(
    tokens: int,
    seconds: float,
    *,
    world_size: int,
    flops_per_token: float,
    peak_tflops: float | None,
) -> dict[str, float | None]:
    """A step's tokens/s (all devices and per device) and MFU in % (None without a known peak:
    CPUs, unknown GPUs; --peak_tflops sets one)."""
    tokens_per_s = tokens / seconds if seconds > 0 else 0.0
    per_device = tokens_per_s / world_size
    mfu = 100.0 * flops_per_token * per_device / (peak_tflops * 1e12) if peak_tflops else None
    return {"tokens_per_s": tokens_per_s, "tokens_per_s_per_device": per_device, "mfu_pct": mfu}
