"""Host memory that training frees goes back to the operating system.

glibc's malloc serves a block of 128 KiB or more from a mapping of its own, unmapped when it is
freed, but each time such a block is freed it raises that threshold to the block's size (up to
32 MiB): from then on blocks of that size come from its heaps, and freed ones stay resident
there as fragments. A training step allocates and frees activation and all-gather buffers of a
few MiB each by the hundred, so after the first step the process holds them all: on CPU, 284M
parameters trained with LoRA on 2 processes peaked at 2,443 MiB per process with the moving
threshold and at 1,432 MiB with it fixed (docs/benchmarks.md#qlora-and-lora-host-memory-per-process).
The price, on CPU: each such block is mapped and zeroed afresh, 1.1-1.3x the CPU time per step
(`bench/qlora.py --malloc`). Fixing it (`mallopt(M_MMAP_THRESHOLD)`, which also turns the raising
off) is what glibc's `MALLOC_MMAP_THRESHOLD_` does before a process starts; a user's own
`MALLOC_MMAP_THRESHOLD_` (32 MiB: speed over memory; or another allocator, which has no
`mallopt`) is left alone.
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
GLIBC_INITIAL_THRESHOLD = 128 * 1024


def fix_mmap_threshold(threshold: int = GLIBC_INITIAL_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold for this process; False where it is not glibc's malloc or the
    environment already sets it."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to fix
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
