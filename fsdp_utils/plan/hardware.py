"""GPU memory sizes: `--gpu_memory 80GiB`, `81920MiB`, `80GB` or a GPU name such as `a100-80gb`.

Preset sizes are the `memory.total` that nvidia-smi prints for each GPU, which is what the CUDA
driver manages (the CUDA context then takes its share of it: see `report.Margin`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MIB = 1024**2
GIB = 1024**3

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1024,
    "mib": MIB,
    "gib": GIB,
    "tib": 1024**4,
}


@dataclass(frozen=True)
class Gpu:
    name: str  # "" when only the size is known
    memory_bytes: int


# nvidia-smi `memory.total` in MiB. A100 and H100 80GB: as printed on those GPUs in public
# nvidia-smi tables; H100 64GB (MareNostrum 5), H200 and L40S: the real outputs in
# /work/shared/reference/samples.md (tests/fixtures/nvidia_smi_*).
GPU_PRESETS: dict[str, Gpu] = {
    "a100-40gb": Gpu("A100-40GB", 40960 * MIB),
    "a100-80gb": Gpu("A100-80GB", 81920 * MIB),
    "h100-64gb": Gpu("H100-64GB", 65247 * MIB),
    "h100-80gb": Gpu("H100-80GB", 81559 * MIB),
    "h200": Gpu("H200", 143771 * MIB),
    "l40s": Gpu("L40S", 46068 * MIB),
}
_ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h200-141gb": "h200"}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)\s*$", re.IGNORECASE)


def parse_size(text: str, flag: str) -> int:
    """Bytes in `text`: a number and a unit (GiB/MiB binary, GB/MB decimal)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(
            f"{flag} {text!r} is not a size. Give a number with its unit, e.g. 80GiB or "
            "81920MiB (GB and MB are decimal: 80GB = 74.5 GiB)."
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_gpu_memory(text: str) -> Gpu:
    """A preset GPU name (`a100-80gb`) or a size (`80GiB`)."""
    key = text.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key in GPU_PRESETS:
        return GPU_PRESETS[key]
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(
            f"--gpu_memory {text!r} is neither a size nor a known GPU. Give a size with its "
            "unit, e.g. 80GiB or 81920MiB (GB and MB are decimal: 80GB = 74.5 GiB), or one of: "
            f"{', '.join(sorted(GPU_PRESETS))}."
        )
    size = parse_size(text, "--gpu_memory")
    if size < GIB:
        raise ValueError(f"--gpu_memory {text!r} is under 1 GiB: did you mean {match.group(1)}GiB?")
    return Gpu("", size)


def detect_gpu() -> Gpu | None:
    """The first visible CUDA device (on a GPU node), else None (a login node)."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return Gpu(props.name, int(props.total_memory))


def format_bytes(size: float) -> str:
    return f"{size / GIB:.2f} GiB"
