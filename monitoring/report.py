"""The report: what was measured (per node and GPU), a job summary and notes.

One `Report` value is rendered three ways: rich tables on a terminal, plain ASCII text when the
output is not a terminal (logs, pipes, e-mail), and JSON (`--json`) for scripts.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from monitoring.legs import Leg
from monitoring.records import AccountingGpu, BscLoadNode, GpuProcess, GpuSample, JobInfo
from monitoring.summary import (
    GpuStats,
    JobSummary,
    Note,
    Thresholds,
    format_duration,
    summarize_gpus,
    summarize_job,
)

JSON_SCHEMA = "fsdp-utils/gpu_report/1"


@dataclass(frozen=True)
class Measurement:
    title: str  # "Live", "Whole run", "Saved output"
    source: str  # how it was measured, in words
    gpus: tuple[GpuStats, ...]
    summary: JobSummary
    has_timeline: bool = False
    has_processes: bool = False
    gpu_selection: tuple[str, ...] = ()  # per node, which GPUs count as the job's, and why


@dataclass(frozen=True)
class Report:
    job_id: str | None
    job: JobInfo | None
    measurements: tuple[Measurement, ...]
    notes: tuple[Note, ...]
    bsc_load: tuple[BscLoadNode, ...] = ()
    accounting: tuple[AccountingGpu, ...] = ()
    accounting_note: str | None = None
    slurm_version: tuple[int, int, int] | None = None
    plot: str | None = None  # the PNG written by --plot


def measure(
    title: str,
    source: str,
    samples: Sequence[GpuSample],
    job: JobInfo | None,
    processes: Sequence[GpuProcess] = (),
    timeline_bins: int = 0,
    *,
    legs: Sequence[Leg] = (),
    gpu_selection: Sequence[str] = (),
) -> Measurement:
    gpus = summarize_gpus(samples, processes, bins=timeline_bins)
    return Measurement(
        title=title,
        source=source,
        gpus=tuple(gpus),
        summary=summarize_job(gpus, samples, job, legs),
        has_timeline=timeline_bins > 0,
        has_processes=bool(processes),
        gpu_selection=tuple(gpu_selection),
    )


def samples_from_bsc_load(nodes: Sequence[BscLoadNode], now: float | None) -> list[GpuSample]:
    """bsc_load's GPU% columns as samples, for when nvidia-smi could not be reached."""
    return [
        GpuSample(host=n.node, index=g.index, utilization_gpu=g.utilization_pct, time=now)
        for n in nodes
        for g in n.gpus
    ]


# ----------------------------------------------------------------------------- JSON


def to_json(report: Report, indent: int | None = 2) -> str:
    """The whole report; `--watch --json` prints one report per line (indent=None)."""
    data: dict[str, Any] = {"schema": JSON_SCHEMA, **dataclasses.asdict(report)}
    return json.dumps(data, indent=indent)


# ----------------------------------------------------------------------------- text

_SPARK_UNICODE = "▁▂▃▄▅▆▇█"
_SPARK_ASCII = "_.-:=+*#"
_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}
_PREFIX = {"error": "[!!]", "warning": "[! ]", "info": "[i ]"}


def _fmt(value: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _gib(mib: float | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.1f}"


def sparkline(values: Sequence[float | None], ascii_only: bool) -> str:
    chars = _SPARK_ASCII if ascii_only else _SPARK_UNICODE
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        else:
            out.append(chars[min(len(chars) - 1, int(max(0.0, v) / 100 * len(chars)))])
    return "".join(out)


def _util_style(value: float | None, t: Thresholds) -> str:
    if value is None:
        return "dim"
    if value <= t.very_low_pct:
        return "red"
    return "yellow" if value <= t.low_pct else "green"


def _processes(processes: Sequence[GpuProcess]) -> str:
    if not processes:
        return "none"
    return ", ".join(
        f"{p.pid if p.pid is not None else '?'} {(p.process_name or '?').rsplit('/', 1)[-1]}"
        f" {_gib(p.used_memory_mib)}G"
        for p in processes
    )


def _memory(g: GpuStats) -> str:
    fraction = g.mem_peak_fraction
    if g.mem_used_peak_mib is None:
        return "-"
    total = f"/{_gib(g.mem_total_mib)}" if g.mem_total_mib else ""
    share = f" ({fraction:.0%})" if fraction is not None else ""
    return f"{_gib(g.mem_used_peak_mib)}{total}{share}"


def _model(name: str | None) -> str:
    return (name or "-").removeprefix("NVIDIA ")


def gpu_table(m: Measurement, ascii_only: bool, t: Thresholds) -> Table:
    """One row per GPU, grouped by node (the node name on its first row, a rule after it)."""
    table = Table(
        title=f"{m.title}: {m.source}",
        title_justify="left",
        box=box.ASCII if ascii_only else box.ROUNDED,
    )
    table.add_column("Node", no_wrap=True)
    table.add_column("GPU", justify="right")
    table.add_column("Model")
    table.add_column("Util %", justify="right")
    table.add_column("min-max", justify="right")
    table.add_column("Mem peak GiB", justify="right", no_wrap=True)
    table.add_column("Power W", justify="right")
    table.add_column("Temp C", justify="right")
    if m.has_timeline:
        table.add_column("Util over time", no_wrap=True)
    if m.has_processes:
        table.add_column("Processes (pid name mem)")
    for i, g in enumerate(m.gpus):
        last_of_node = i + 1 == len(m.gpus) or m.gpus[i + 1].host != g.host
        first_of_node = i == 0 or m.gpus[i - 1].host != g.host
        util_range = "-" if g.util_min is None else f"{g.util_min:.0f}-{g.util_peak:.0f}"
        util = (
            Text("FAULT", style="bold red")
            if g.faulted
            else Text(_fmt(g.util_mean), style=_util_style(g.util_mean, t))
        )
        row: list[str | Text] = [
            g.host if first_of_node else "",
            str(g.index),
            _model(g.name),
            util,
            util_range,
            _memory(g),
            _fmt(g.power_mean_w),
            _fmt(g.temp_peak_c),
        ]
        if m.has_timeline:
            row.append(sparkline(g.timeline, ascii_only))
        if m.has_processes:
            row.append(_processes(g.processes))
        table.add_row(*row, end_section=last_of_node)
    return table


def summary_line(m: Measurement) -> str:
    s = m.summary
    allocated = f" ({s.gpus_allocated} allocated)" if s.gpus_allocated is not None else ""
    plural = "" if s.gpus_measured == 1 else "s"
    parts = [f"{s.gpus_measured} GPU{plural} measured{allocated}"]
    if s.gpus_faulted:
        parts.append(f"{s.gpus_faulted} faulted (not counted in these figures)")
    if s.util_mean is not None:
        parts.append(
            f"mean utilisation {s.util_mean:.0f}% (lowest GPU {_fmt(s.util_lowest)}%, "
            f"highest {_fmt(s.util_highest)}%)"
        )
    if s.mem_peak_mib is not None:
        of = f" of {_gib(s.mem_total_mib)}" if s.mem_total_mib else ""
        parts.append(f"peak memory {_gib(s.mem_peak_mib)}{of} GiB on the fullest GPU")
    if len(s.legs) > 1 and s.covered_s is not None:
        parts.append(
            f"{s.samples_per_gpu} samples per GPU over {format_duration(s.covered_s)} "
            f"in {len(s.legs)} legs"
        )
    elif s.span_s:
        parts.append(f"{s.samples_per_gpu} samples per GPU over {format_duration(s.span_s)}")
    return "Job summary: " + "; ".join(parts) + "."


def _clock(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def legs_table(legs: Sequence[Leg], ascii_only: bool) -> Table:
    """The legs of a requeued (or resumed) run, each with its own times."""
    table = Table(
        title="Legs (restarts): each start of the sampler",
        title_justify="left",
        box=box.ASCII if ascii_only else None,
    )
    for name in ("Leg", "Job", "Restart", "First sample", "Last sample", "Sampled", "Samples/GPU"):
        table.add_column(name, justify="left" if name in ("Job", "First sample") else "right")
    for leg in legs:
        table.add_row(
            str(leg.number),
            leg.job_id or "-",
            _fmt(leg.restart),
            _clock(leg.start),
            _clock(leg.end),
            format_duration(leg.seconds),
            str(leg.samples_per_gpu),
        )
    return table


def bsc_load_table(nodes: Sequence[BscLoadNode], ascii_only: bool) -> Table:
    table = Table(
        title="bsc_load (site tool)", title_justify="left", box=box.ASCII if ascii_only else None
    )
    for name in ("Node", "CPUs", "CPU %", "Power W", "GPU", "GPU %", "MEM %"):
        table.add_column(name, justify="left" if name == "Node" else "right")
    for n in nodes:
        for i, g in enumerate(n.gpus):
            first = i == 0
            table.add_row(
                n.node if first else "",
                _fmt(n.ncpus) if first else "",
                _fmt(n.cpu_usage_pct, ".1f") if first else "",
                _fmt(n.power_w) if first else "",
                str(g.index),
                _fmt(g.utilization_pct),
                _fmt(g.memory_pct),
            )
    return table


def accounting_table(rows: Sequence[AccountingGpu], summed: bool, ascii_only: bool) -> Table:
    table = Table(
        title="Slurm accounting (sacct GPU TRES)",
        title_justify="left",
        box=box.ASCII if ascii_only else None,
    )
    for name in ("Step", "GPUs", "gpuutil ave %", "gpuutil max %", "gpumem ave GiB", "max GiB"):
        table.add_column(name, justify="left" if name == "Step" else "right")
    if summed:
        table.add_column("util per GPU %", justify="right")
    for r in rows:
        cells = [
            r.step,
            _fmt(r.gpus),
            _fmt(r.gpuutil_ave),
            _fmt(r.gpuutil_max),
            _fmt(r.gpumem_ave_bytes / 2**30 if r.gpumem_ave_bytes is not None else None, ".1f"),
            _fmt(r.gpumem_max_bytes / 2**30 if r.gpumem_max_bytes is not None else None, ".1f"),
        ]
        if summed:
            per_gpu = r.gpuutil_ave / r.gpus if r.gpuutil_ave is not None and r.gpus else None
            cells.append(_fmt(per_gpu))
        table.add_row(*cells)
    return table


def header_line(report: Report) -> str:
    job = report.job
    if job is None:
        return f"GPU report for job {report.job_id}" if report.job_id else "GPU report"
    parts = [f"GPU report for job {job.job_id}"]
    if job.name:
        parts.append(job.name)
    if job.user:
        parts.append(f"user {job.user}")
    parts.append(job.state)
    if job.nodes:
        shown = ", ".join(job.nodes[:4]) + (" ..." if len(job.nodes) > 4 else "")
        parts.append(f"{len(job.nodes)} node(s): {shown}")
    if job.gpus is not None:
        parts.append(f"{job.gpus} GPUs")
    if job.run_seconds is not None:
        parts.append(f"run time {format_duration(job.run_seconds)}")
    return " | ".join(parts)


def render(report: Report, ascii_only: bool, thresholds: Thresholds | None = None) -> Group:
    t = thresholds or Thresholds()
    parts: list[RenderableType] = [Text(header_line(report), style="bold")]
    summed = report.slurm_version is not None and report.slurm_version >= (24, 5, 1)
    for m in report.measurements:
        parts += [Text(""), gpu_table(m, ascii_only, t), Text(summary_line(m))]
        if m.gpu_selection:
            parts.append(Text("The job's GPUs: " + "; ".join(m.gpu_selection) + "."))
        if len(m.summary.legs) > 1:
            parts += [Text(""), legs_table(m.summary.legs, ascii_only)]
    if report.plot:
        parts += [Text(""), Text(f"GPU plot: {report.plot}")]
    if report.bsc_load:
        parts += [Text(""), bsc_load_table(report.bsc_load, ascii_only)]
    if report.accounting:
        parts += [Text(""), accounting_table(report.accounting, summed, ascii_only)]
    if report.accounting_note:
        parts += [Text(""), Text(report.accounting_note, style="dim")]
    if report.notes:
        parts += [Text(""), Text("Notes", style="bold")]
        for note in report.notes:
            parts.append(Text(f"{_PREFIX[note.level]} {note.text}", style=_STYLE[note.level]))
    return Group(*parts)


def make_console(plain: bool, file: Any = None) -> Console:
    """Rich on a terminal; plain text (no colours, no cursor codes, 120 columns) otherwise."""
    if plain:
        return Console(
            file=file, force_terminal=False, no_color=True, highlight=False, width=120, emoji=False
        )
    return Console(file=file, highlight=False)
