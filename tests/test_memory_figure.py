"""The step log's memory figure is the peak of its interval (metrics/throughput.py)."""

from __future__ import annotations

import torch

from fsdp_utils.metrics.logger import format_step
from fsdp_utils.metrics.throughput import memory_snapshot, reset_memory_peaks

CPU = torch.device("cpu")


def test_the_host_peak_is_the_intervals_not_the_process_lifetimes():
    assert reset_memory_peaks(CPU), "/proc/self/clear_refs cannot be written here"
    block = torch.ones(128 * 1024**2 // 4)  # 128 MiB, touched
    del block
    first = memory_snapshot(CPU)
    second = memory_snapshot(CPU)  # nothing allocated in between
    assert first["host_peak_rss_gib"] >= first["host_rss_gib"] + 0.1
    assert second["host_peak_rss_gib"] < first["host_peak_rss_gib"] - 0.1
    assert second["host_peak_rss_gib"] >= second["host_rss_gib"] - 0.01


def test_the_step_line_says_peak():
    record = {
        "step": 3, "loss": 1.0, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 100.0,
        "tokens_per_s_per_device": 50.0, "mfu_pct": None, "step_time_s": 0.25,
        "host_rss_gib": 0.5, "host_peak_rss_gib": 1.25,
        "cuda_peak_allocated_gib": 3.0, "cuda_peak_reserved_gib": 4.0,
    }  # fmt: skip
    line = format_step(record, 10)
    assert "peak rss 1.25 GiB" in line and "peak cuda 3.00/4.00 GiB" in line
