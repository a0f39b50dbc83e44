"""How many CPU threads a training process computes with, when nothing set it.

torch takes one thread per CPU the process may run on. Under `torchrun` with several processes
that is set to 1 per process (torchrun exports OMP_NUM_THREADS=1), and under `slurm/finetune.sh`
to the job's CPUs shared among them (`fsdp_utils.slurm.launch`); a process started on its own
(`python chess_finetune.py ...`, or torchrun with one process) keeps the default. On a CPU that
other work keeps busy, the threads of each small matmul then wait for one another: the demo's
model on a 2-core machine at load 8-9 took 68 s for 20 steps with torch's 2 threads and 6.6 s
with one (docs/training.md). So a CPU run with OMP_NUM_THREADS unset computes with the CPUs
that are idle (the CPUs less the load average, at least 1), never more than torch's own
choice, and the log says so; OMP_NUM_THREADS, or a number set before (a test, a notebook),
wins. A GPU run computes on the GPU: nothing changes.
"""

from __future__ import annotations

import os

import torch

from fsdp_utils.parallel.distributed import DistEnv


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def choose_cpu_threads(env: DistEnv) -> str | None:
    """Set this process's compute threads for a CPU run nothing configured; the log's line."""
    if env.device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    cpus = max(1, usable_cpus() // max(1, env.local_world_size))
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    idle = max(1, cpus - round(load))
    current = torch.get_num_threads()
    if idle >= current:
        return None
    torch.set_num_threads(idle)
    return (
        f"threads: {idle} compute thread(s) instead of torch's {current}: {cpus} CPU(s) with a "
        f"load average of {load:.1f} (OMP_NUM_THREADS=N chooses)"
    )
