"""Throughput, MFU, memory, and the run's log: JSONL file + console (rich live on a terminal,
plain lines in a Slurm log). Only rank 0 writes."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, TextIO

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


def flops_per_token(hf_config: Any, non_embedding_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls (forward + backward) plus 12·L·H·Q·T for
    attention scores and values (PaLM appendix B; torchtitan, nanoGPT). Recomputation by
    activation checkpointing is not counted: MFU measures useful work."""
    layers = _config_int(hf_config, "num_hidden_layers", "n_layer")
    heads = _config_int(hf_config, "num_attention_heads", "n_head")
    head_dim = getattr(hf_config, "head_dim", None) or (
        _config_int(hf_config, "hidden_size", "n_embd") // heads
    )
    return 6.0 * non_embedding_params + 12.0 * layers * heads * head_dim * seq_len


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
        out["cuda_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / gib
        out["cuda_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / gib
        torch.cuda.reset_peak_memory_stats(device)
    rss = _read_status_kib("VmRSS")
    out["host_rss_gib"] = rss * 1024 / gib if rss is not None else None
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    out["host_peak_rss_gib"] = peak_kib * 1024 / gib
    return out


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def format_step(m: dict[str, Any], max_steps: int) -> str:
    mem = (
        f"cuda {_fmt(m.get('cuda_peak_allocated_gib'), '.2f')}/"
        f"{_fmt(m.get('cuda_peak_reserved_gib'), '.2f')} GiB | "
        if "cuda_peak_allocated_gib" in m
        else ""
    )
    return (
        f"step {m['step']:>5}/{max_steps} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | "
        f"grad norm {_fmt(m.get('grad_norm'), '.3f')} | "
        f"{m['tokens_per_s']:,.0f} tok/s ({m['tokens_per_s_per_device']:,.0f}/device) | "
        f"MFU {_fmt(m.get('mfu_pct'), '.1f', '%')} | {mem}"
        f"rss {_fmt(m.get('host_rss_gib'), '.2f')} GiB | {m['step_time_s']:.3f} s/step"
    )


class RunLogger:
    """Rank 0's log. Every record goes to metrics.jsonl with a `kind` and a wall-clock time."""

    def __init__(
        self, metrics_path: Path | None, enabled: bool, max_steps: int, stream: TextIO | None = None
    ) -> None:
        self.enabled = enabled
        self.max_steps = max_steps
        self.stream = stream or sys.stdout
        self._file = open(metrics_path, "a") if (enabled and metrics_path) else None  # noqa: SIM115
        self._live: Any = None
        self._live_rows: list[str] = []
        if enabled and self.stream.isatty():
            from rich.console import Console
            from rich.live import Live

            self._console = Console(file=self.stream)
            self._live = Live(console=self._console, refresh_per_second=4, transient=False)
            self._live.start()

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
            self._file.flush()

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self._live is not None:
            self._live.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self.stream, flush=True)

    def event(self, kind: str, message: str, **fields: Any) -> None:
        """Something that happened (checkpoint saved, resumed, stopping): log + JSONL."""
        self._write({"kind": kind, "message": message, **fields})
        self.info(message)

    def step(self, metrics: dict[str, Any]) -> None:
        self._write({"kind": "train", **metrics})
        if not self.enabled:
            return
        if self._live is not None:
            self._live.update(self._render(metrics))
        else:
            print(format_step(metrics, self.max_steps), file=self.stream, flush=True)

    def _render(self, m: dict[str, Any]) -> Any:
        """A progress bar over a one-row table that is refreshed in place."""
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        table = Table(box=None, pad_edge=False, header_style="bold")
        columns = {
            "step": f"{m['step']}/{self.max_steps}",
            "loss": f"{m['loss']:.4f}",
            "lr": f"{m['lr']:.2e}",
            "grad norm": _fmt(m.get("grad_norm"), ".3f"),
            "tokens/s": f"{m['tokens_per_s']:,.0f}",
            "per device": f"{m['tokens_per_s_per_device']:,.0f}",
            "MFU": _fmt(m.get("mfu_pct"), ".1f", "%"),
        }
        if "cuda_peak_allocated_gib" in m:
            columns["CUDA peak GiB"] = _fmt(m.get("cuda_peak_allocated_gib"), ".2f")
        columns["RSS GiB"] = _fmt(m.get("host_rss_gib"), ".2f")
        columns["s/step"] = f"{m['step_time_s']:.3f}"
        for name in columns:
            table.add_column(name, justify="right")
        table.add_row(*columns.values())
        bar = ProgressBar(total=self.max_steps, completed=m["step"], width=60)
        return Group(bar, table)

    def eval(self, metrics: dict[str, Any]) -> None:
        self._write({"kind": "eval", **metrics})
        self.info(
            f"eval  step {metrics['step']:>5} | loss {metrics['eval_loss']:.4f} | "
            f"perplexity {metrics['eval_perplexity']:.2f} | {metrics['eval_tokens']:,} tokens"
        )

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._file is not None:
            self._file.close()
            self._file = None
