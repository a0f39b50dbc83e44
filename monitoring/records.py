"""Typed records shared by the collectors, parsers, summaries and reports.

Every measured value is `float | None`: `None` means the device or tool did not report it
(`[N/A]`, `[Not Supported]`, a dropped column). It is never silently turned into 0, because a 0%
GPU and a GPU that cannot report its utilisation call for opposite advice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The `nvidia-smi --query-gpu` fields the sampler and the live probe ask for, in this order.
QUERY_GPU_FIELDS: tuple[str, ...] = (
    "index",
    "uuid",
    "name",
    "utilization.gpu",
    "utilization.memory",
    "memory.used",
    "memory.total",
    "power.draw",
    "temperature.gpu",
)
# The per-process query (`nvidia-smi --query-compute-apps`).
QUERY_APPS_FIELDS: tuple[str, ...] = ("gpu_uuid", "pid", "process_name", "used_gpu_memory")


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment, as `nvidia-smi --query-gpu` (or a table / bsc_load) reported it."""

    host: str
    index: int
    uuid: str | None = None
    name: str | None = None
    utilization_gpu: float | None = None  # % of time a kernel ran
    utilization_memory: float | None = None  # % of time the memory bus was busy (not memory used)
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    time: float | None = None  # epoch seconds
    job_id: str | None = None
    # Cells that read as an error instead of a value (`ERR!`, `[Unknown Error]`, `[GPU is
    # lost]`), as "field: cell". Such a GPU is faulted: its readings are not measurements.
    faults: tuple[str, ...] = ()


@dataclass(frozen=True)
class SamplerStart:
    """What a sampler recorded when it started on a node (one per leg of a requeued job).

    `gpus` are the node-wide indices it kept (None: it kept every GPU nvidia-smi listed) and
    `rule` says how it chose them, e.g. "SLURM_JOB_GPUS=0,1" or "none: no allocation known".
    """

    host: str
    job_id: str
    time: float
    restart: int | None  # $SLURM_RESTART_COUNT: 0 for the first leg, 1 after one requeue, ...
    gpus: tuple[int, ...] | None
    node_gpus: int | None  # how many GPUs nvidia-smi listed on the node
    rule: str
    # Set when the nvidia-smi it ran said it replays recorded output (`REPLAY_PREFIX`): what
    # it replays. The samples are then no measurement of this job.
    replay: str | None = None


@dataclass(frozen=True)
class GpuProcess:
    host: str
    gpu_uuid: str | None
    pid: int | None
    process_name: str | None
    used_memory_mib: float | None
    gpu_index: int | None = None  # filled in from the GPU with that uuid (or the table)


@dataclass(frozen=True)
class NodeError:
    """Something a node said instead of a measurement (a lost GPU, a missing tool, a timeout)."""

    host: str
    message: str


@dataclass(frozen=True)
class Probe:
    """Everything one round of measurements produced, across nodes."""

    samples: tuple[GpuSample, ...] = ()
    processes: tuple[GpuProcess, ...] = ()
    errors: tuple[NodeError, ...] = ()
    hosts: tuple[str, ...] = ()  # nodes that answered at all
    replay: str | None = None  # what a stand-in for nvidia-smi said it replays (no measurement)


@dataclass(frozen=True)
class BscLoadGpu:
    index: int
    utilization_pct: float | None
    memory_pct: float | None


@dataclass(frozen=True)
class BscLoadNode:
    """One row of MareNostrum's `bsc_load <jobid>` table."""

    node: str
    ncpus: int | None
    cpu_usage_pct: float | None
    power_w: float | None
    gpus: tuple[BscLoadGpu, ...]


@dataclass(frozen=True)
class JobInfo:
    """What Slurm knows about a job (from `scontrol show job`, else `sacct`)."""

    job_id: str
    state: str  # RUNNING, PENDING, COMPLETED, ... (first word only)
    source: str  # "scontrol" or "sacct"
    name: str | None = None
    user: str | None = None
    reason: str | None = None
    nodes: tuple[str, ...] = ()
    gpus: int | None = None  # GPUs allocated to the whole job
    # Per node, the GPU indices Slurm allocated (from `scontrol -d`: GRES=gpu:2(IDX:0-1)).
    gpu_indices: dict[str, tuple[int, ...]] = field(default_factory=dict)
    run_seconds: float | None = None
    time_limit: str | None = None
    start: str | None = None
    end: str | None = None
    work_dir: str | None = None
    stdout: str | None = None
    stderr: str | None = None

    @property
    def is_running(self) -> bool:
        return self.state in ("RUNNING", "COMPLETING", "SUSPENDED")

    @property
    def is_pending(self) -> bool:
        return self.state in ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "RESV_DEL_HOLD")


@dataclass(frozen=True)
class AccountingGpu:
    """GPU TRES recorded by Slurm accounting for one step (Slurm >= 23.02 with NVML)."""

    step: str
    gpus: int | None  # GPUs of the step (gres/gpu in AllocTRES), when known
    gpuutil_ave: float | None  # % (from 24.05.1 summed over the step's GPUs)
    gpuutil_max: float | None
    gpumem_ave_bytes: float | None
    gpumem_max_bytes: float | None
