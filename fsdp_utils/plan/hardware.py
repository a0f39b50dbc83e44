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


def _preset_key(text: str) -> str:
    """A GPU kind as `GPU_PRESETS` and `GPU_SPECS` name it: lower case, dashes, aliases resolved
    (`H100_80GB` and `h100` are `h100-80gb`)."""
    key = text.strip().lower().replace("_", "-")
    return _ALIASES.get(key, key)


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
    key = _preset_key(text)
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


def gpu_kind_name(text: str) -> str:
    """`--gpu_kind`: a kind of `GPU_PRESETS` (`h100-80gb`) as its preset's name, which
    `spec_key` matches exactly whatever the memory; anything else is the name nvidia-smi or
    CUDA prints ("NVIDIA H100 NVL"), kept as given (`spec_key` reads it, a kind without a data
    sheet is looked up as --calibrate stored it: `gpu:<name>`)."""
    key = _preset_key(text)
    return GPU_PRESETS[key].name if key in GPU_PRESETS else text.strip()


def planner_flags(gpu: Gpu) -> list[str]:
    """The planner's flags for a GPU found on a node (nvidia-smi, torch.cuda): its real memory
    (`--gpu_memory`; a preset would plan the preset's size) and its name (`--gpu_kind`: the kind
    the step-time model times)."""
    flags = ["--gpu_memory", f"{gpu.memory_bytes // MIB}MiB"]
    return flags + (["--gpu_kind", gpu.name] if gpu.name else [])


def detect_gpu() -> Gpu | None:
    """The first visible CUDA device (on a GPU node), else None (a login node)."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return Gpu(props.name, int(props.total_memory))


def format_bytes(size: float) -> str:
    return f"{size / GIB:.2f} GiB"


# --- what the step-time model divides by (fsdp_utils/plan/step_time.py) -------------------------

GB = 1e9  # the data sheets' units: GB/s, TFLOP/s, Gb/s are decimal


@dataclass(frozen=True)
class GpuSpec:
    """One GPU kind's published rates, per GPU. Sources in `SPEC_SOURCES`; `--calibrate`
    measures the node's own (fsdp_utils/plan/calibrate.py), which then wins.

    bf16_flops, fp32_flops: dense peak FLOP/s (no sparsity) in bf16 tensor cores and plain
        fp32 (what an fp32 run's matrix products get: the toolkit does not enable TF32).
    memory_bandwidth: HBM (GDDR6 on the L40S), bytes/s.
    link_bandwidth: between the GPUs of a node, bytes/s per direction (NVLink, or PCIe on cards
        without it): what an all-gather or reduce-scatter moves per GPU at best.
    host_bandwidth: PCIe between the GPU and the host, bytes/s per direction (CPU offload).
    fabric: the typical network between nodes on clusters of this kind (an `INTERCONNECTS`
        name; `--interconnect`, `--fabric_gbps` override it).
    """

    kind: str
    bf16_flops: float
    fp32_flops: float
    memory_bandwidth: float
    link_bandwidth: float
    host_bandwidth: float
    fabric: str
    link: str = "NVLink"


# Per GPU: dense bf16 / fp32 TFLOP/s, memory GB/s, link GB/s per direction, PCIe GB/s per
# direction, and the fabric of a typical cluster of that kind.
GPU_SPECS: dict[str, GpuSpec] = {
    "a100-40gb": GpuSpec("A100-40GB", 312e12, 19.5e12, 1555 * GB, 300 * GB, 32 * GB, "hdr"),
    "a100-80gb": GpuSpec("A100-80GB", 312e12, 19.5e12, 2039 * GB, 300 * GB, 32 * GB, "hdr"),
    "h100-64gb": GpuSpec("H100-64GB", 989e12, 67e12, 2680 * GB, 450 * GB, 64 * GB, "ndr200"),
    "h100-80gb": GpuSpec("H100-80GB", 989e12, 67e12, 3350 * GB, 450 * GB, 64 * GB, "ndr"),
    "h200": GpuSpec("H200", 989e12, 67e12, 4800 * GB, 450 * GB, 64 * GB, "ndr"),
    "l40s": GpuSpec("L40S", 362e12, 91.6e12, 864 * GB, 32 * GB, 32 * GB, "eth100", link="PCIe"),
}

SPEC_SOURCES = """\
- A100 SXM 40/80GB: NVIDIA A100 data sheet: 312 TFLOP/s bf16 dense, 19.5 fp32, 1,555 / 2,039
  GB/s HBM2(e), NVLink 3 600 GB/s (300 per direction), PCIe Gen4 x16; DGX A100: one HDR
  200 Gb/s InfiniBand port per GPU.
- H100 SXM 80GB: NVIDIA H100 data sheet: 989 TFLOP/s bf16 dense (torchtitan's peak), 67 fp32,
  3.35 TB/s HBM3, NVLink 4 900 GB/s (450 per direction), PCIe Gen5 x16 (64 GB/s per direction);
  DGX H100: one NDR 400 Gb/s port per GPU.
- H100 64GB (MareNostrum 5's accelerated nodes, 4 per node): the H100 SXM silicon with four of
  its five HBM stacks; its bandwidth is not published: 4/5 of the 80 GB part's 3.35 TB/s
  (inferred; --calibrate measures it); one NDR200 port per GPU (BSC's description of the nodes).
- H200: NVIDIA H200 data sheet: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e, NVLink 4, PCIe Gen5.
- L40S: NVIDIA L40S data sheet: 362 TFLOP/s bf16 dense (733 with sparsity), 91.6 fp32, 864 GB/s
  GDDR6, PCIe Gen4 x16 (64 GB/s both directions), no NVLink: the GPUs of a node talk over PCIe;
  a 100 Gb/s Ethernet network between nodes is assumed (clusters vary: give --interconnect).
- Fabrics: InfiniBand NDR 400 Gb/s, NDR200 and HDR 200, HDR100 and EDR 100 Gb/s per port;
  Ethernet 100 and 25 Gb/s. One port per GPU unless the cluster says otherwise
  (--fabric_gbps is the bandwidth per GPU).
- Latencies are assumed, not sourced: 10 us per collective within a node, 20 us between nodes
  (NCCL's small-message times are tens of microseconds); --calibrate measures them here."""

# Between nodes, per GPU: the name, Gb/s, and what it is.
INTERCONNECTS: dict[str, tuple[float, str]] = {
    "ndr": (400.0, "InfiniBand NDR, one 400 Gb/s port per GPU"),
    "ndr200": (200.0, "InfiniBand NDR200, 200 Gb/s per GPU"),
    "hdr": (200.0, "InfiniBand HDR, 200 Gb/s per GPU"),
    "hdr100": (100.0, "InfiniBand HDR100, 100 Gb/s per GPU"),
    "edr": (100.0, "InfiniBand EDR, 100 Gb/s per GPU"),
    "eth100": (100.0, "Ethernet (RoCE), 100 Gb/s per GPU"),
    "eth25": (25.0, "Ethernet, 25 Gb/s per GPU"),
}

# Between the nodes of a GPU kind without a data sheet here, unless --interconnect or
# --fabric_gbps says: the usual fabric of the kinds above (one NDR port per GPU), printed.
DEFAULT_FABRIC = "ndr"

LINK_LATENCY_S = 10e-6  # per collective within a node (assumed, see SPEC_SOURCES)
FABRIC_LATENCY_S = 20e-6  # per collective between nodes (assumed)


def gpu_spec(name: str) -> GpuSpec:
    """A GPU kind by its `--gpu_memory` name (a100-80gb, h100, h200, ...); ValueError naming the
    known kinds otherwise."""
    key = _preset_key(name)
    if key not in GPU_SPECS:
        raise ValueError(
            f"Unknown GPU kind {name!r} for the step time: give --gpu_memory as one of "
            f"{', '.join(sorted(GPU_SPECS))} (a size such as 80GiB says the memory, not the "
            "speed), or run `python -m fsdp_utils.plan --calibrate` on a node of that kind."
        )
    return GPU_SPECS[key]


def spec_key(gpu: Gpu | None) -> str | None:
    """The `GPU_SPECS` key of a planned GPU (a preset's name, or a CUDA device name such as
    'NVIDIA H100 80GB HBM3'), None when only its size is known."""
    if gpu is None or not gpu.name:
        return None
    for key, preset in GPU_PRESETS.items():
        if gpu.name == preset.name:
            return key
    name = gpu.name.upper()
    gib = gpu.memory_bytes / GIB
    if "GH200" in name:  # Grace Hopper: a kind of its own (no data sheet here: --calibrate)
        return None
    if "H200" in name:
        return "h200"
    if "H100" in name:
        return "h100-64gb" if gib < 70 else "h100-80gb"
    if "A100" in name:
        return "a100-40gb" if gib < 60 else "a100-80gb"
    if "L40S" in name:
        return "l40s"
    return None


def fabric_bandwidth(
    interconnect: str | None, fabric_gbps: float | None, spec: GpuSpec | None
) -> float:
    """Bytes/s per GPU between nodes: --fabric_gbps, else the --interconnect named, else the
    kind's typical fabric (`DEFAULT_FABRIC` for a kind without a data sheet)."""
    if fabric_gbps is not None:
        if fabric_gbps <= 0:
            raise ValueError(f"--fabric_gbps must be positive, got {fabric_gbps}.")
        return fabric_gbps * GB / 8
    name = (interconnect or (spec.fabric if spec else DEFAULT_FABRIC)).strip().lower()
    if name not in INTERCONNECTS:
        known = "; ".join(f"{k} ({v[1]})" for k, v in INTERCONNECTS.items())
        raise ValueError(
            f"Unknown --interconnect {interconnect!r}. Known: {known}. Or give the bandwidth "
            "per GPU in Gb/s with --fabric_gbps."
        )
    return INTERCONNECTS[name][0] * GB / 8
