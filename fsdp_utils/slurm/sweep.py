"""`--sweep batch_size_per_device=1,2,4,8`: one run per value, then a table that answers the
tutorial's question "what is the largest batch size per device, and how fast is each?".

Pure functions: parse the spec, summarise a finished run folder, format the table.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.metrics.logger import latest_history, read_metrics

OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "out of memory")


@dataclass(frozen=True)
class SweepSpec:
    option: str
    values: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> SweepSpec:
        """`batch_size_per_device=1,2,4,8` -> option and values (checked against TrainConfig)."""
        option, sep, values = text.partition("=")
        option = option.strip().lstrip("-")
        fields = {f.name for f in dataclasses.fields(TrainConfig)}
        if not sep or option not in fields:
            raise ValueError(
                f"--sweep {text!r}: expected OPTION=V1,V2,... with OPTION a chess_finetune.py "
                "option, e.g. --sweep batch_size_per_device=1,2,4,8"
            )
        parsed = tuple(v.strip() for v in values.split(",") if v.strip())
        if not parsed:
            raise ValueError(f"--sweep {text!r}: no values after '='.")
        return cls(option, parsed)

    def run_args(self, value: str) -> list[str]:
        return [f"--{self.option}", value]

    def run_name(self, value: str) -> str:
        return f"{self.option}={value}"


@dataclass(frozen=True)
class RunSummary:
    value: str
    outcome: str  # completed, out of memory, failed: ..., interrupted
    steps: int
    step_time_s: float | None
    tokens_per_s: float | None
    tokens_per_s_per_device: float | None
    peak_memory_gib: float | None
    memory_kind: str  # "GPU reserved" or "host RSS"

    @classmethod
    def not_run(cls, value: str, outcome: str) -> RunSummary:
        return cls(value, outcome, 0, None, None, None, None, "GPU reserved")


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise_run(value: str, run_dir: Path, failure: str | None = None) -> RunSummary:
    """Steady-state speed (median over steps, the first warm-up step left out) and peak memory
    from the run's metrics.jsonl; `failure` is the job's error text if it failed."""
    train = []
    if RunLayout.of(run_dir).metrics.exists():  # a job that failed early may have written none
        train = [r for r in latest_history(read_metrics(run_dir)) if r.get("kind") == "train"]
    steady = train[1:] or train
    gpu_peaks = [r["cuda_peak_reserved_gib"] for r in train if r.get("cuda_peak_reserved_gib")]
    host_peaks = [r["host_peak_rss_gib"] for r in train if r.get("host_peak_rss_gib")]
    if failure is None:
        outcome = "completed"
        status_path = RunLayout.of(run_dir).status
        if status_path.exists():
            outcome = str(json.loads(status_path.read_text()).get("status", outcome))
    elif any(marker in failure for marker in OOM_MARKERS):
        outcome = "out of memory"
    else:
        outcome = "failed: " + (failure.strip().splitlines() or ["?"])[-1][:60]
    return RunSummary(
        value=value,
        outcome=outcome,
        steps=max((int(r["step"]) for r in train), default=0),
        step_time_s=_median([r["step_time_s"] for r in steady if r.get("step_time_s")]),
        tokens_per_s=_median([r["tokens_per_s"] for r in steady if r.get("tokens_per_s")]),
        tokens_per_s_per_device=_median(
            [r["tokens_per_s_per_device"] for r in steady if r.get("tokens_per_s_per_device")]
        ),
        peak_memory_gib=max(gpu_peaks or host_peaks, default=None),
        memory_kind="GPU reserved" if gpu_peaks else "host RSS",
    )


def _as_number(value: str, fallback: float) -> float:
    try:
        return float(value)
    except ValueError:
        return fallback


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_sweep_table(option: str, rows: Sequence[RunSummary]) -> str:
    """A plain-text table (it ends up in logs) and the answer in one line."""
    ran = [r for r in rows if r.steps]
    memory_kind = ran[0].memory_kind if ran else "GPU reserved"
    header = (
        option,
        "outcome",
        "steps",
        "s/step",
        "tokens/s",
        "tokens/s/device",
        f"peak {memory_kind} GiB",
    )
    body = [
        (
            r.value,
            r.outcome,
            str(r.steps),
            _cell(r.step_time_s, ".3f"),
            _cell(r.tokens_per_s, ",.0f"),
            _cell(r.tokens_per_s_per_device, ",.0f"),
            _cell(r.peak_memory_gib, ".2f"),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    completed = [r for r in rows if r.outcome == "completed"]
    if completed:
        largest = max(completed, key=lambda r: _as_number(r.value, rows.index(r)))
        fastest = max(completed, key=lambda r: r.tokens_per_s or 0.0)
        lines.append(
            f"largest {option} that ran: {largest.value}; fastest: {fastest.value} "
            f"({_cell(fastest.tokens_per_s, ',.0f')} tokens/s)"
        )
    else:
        lines.append(f"no {option} value completed: see the job logs")
    return "\n".join(lines)
