"""Throughput figures: training FLOPs per token, the GPU's peak for MFU, and memory."""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where CUDA is asked about: plots need not import it (1 s)
    import torch

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


def flops_per_token(hf_config: Any, active_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls (forward + backward) plus 12·L·H·Q·T for
    attention scores and values (PaLM appendix B; torchtitan, nanoGPT). Recomputation by
    activation checkpointing is not counted: MFU measures useful work.

    N is the non-embedding parameters a token passes through (`ModelInfo.active_parameters`):
    all of them for a dense model; for a mixture of experts, top-k / experts of the routed
    experts' parameters plus everything else (attention, routers, shared experts), as
    torchtitan counts its MoE models. Router softmax and top-k are left out (a few FLOPs per
    expert, against thousands per weight).
    """
    layers = _config_int(hf_config, "num_hidden_layers", "n_layer")
    heads = _config_int(hf_config, "num_attention_heads", "n_head")
    head_dim = getattr(hf_config, "head_dim", None) or (
        _config_int(hf_config, "hidden_size", "n_embd") // heads
    )
    return 6.0 * active_params + 12.0 * layers * heads * head_dim * seq_len


def _read_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def memory_snapshot(device: torch.device) -> dict[str, float | None]:
    """GiB: CUDA peak allocated/reserved since the last reset; host RSS now and at peak."""
    gib = 1024**3
    out: dict[str, float | None] = {}
    if device.type == "cuda":
        import torch

        out["cuda_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / gib
        out["cuda_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / gib
        torch.cuda.reset_peak_memory_stats(device)
    rss = _read_status_kib("VmRSS")
    out["host_rss_gib"] = rss * 1024 / gib if rss is not None else None
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    out["host_peak_rss_gib"] = peak_kib * 1024 / gib
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
