"""GPU use over a job's time, from the sampler files: `gpu_report.py <jobid> --plot gpu.png`.

One row per node, utilisation (%) on the left and memory used (GiB) on the right, one line per
GPU against the time since the first sample. What needs attention stands out: an idle or
very-low GPU is drawn thick and red, a faulted GPU black with an X at every faulted sample, and
each later leg of a requeued job starts at a labelled vertical line (lines break between legs).

Headless by construction: a bare `matplotlib.figure.Figure` is saved with the Agg renderer, so
neither a display nor pyplot's global state is involved (compute and login nodes have neither).
Every drawn line carries a gid (`util:<node>:<gpu>`, `mem:<node>:<gpu>`, `fault:<node>:<gpu>`)
so tests can read the data back from the figure.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from monitoring.legs import Leg, leg_of
from monitoring.records import GpuSample
from monitoring.summary import GpuStats, Thresholds, summarize_gpus

# Tableau colours without red, which is kept for the GPUs that need attention.
_PALETTE = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:gray",
    "tab:olive",
    "tab:cyan",
)
_STYLES = ("-", "--", "-.", ":")
ATTENTION = "tab:red"
FAULT = "black"
FAULT_STRIP = 104.0  # where faulted samples are marked on the utilisation axis


@dataclass(frozen=True)
class PlotResult:
    path: Path
    nodes: int
    gpus: int
    idle: tuple[str, ...]  # labels of the GPUs drawn as idle / very low
    faulted: tuple[str, ...]
    time_unit: str  # "min" or "h"


def _clock(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(epoch))


def _time_unit(span_s: float) -> tuple[str, float]:
    return ("h", 3600.0) if span_s > 3 * 3600 else ("min", 60.0)


def _series(
    group: Sequence[GpuSample], legs: Sequence[Leg], t0: float, scale: float
) -> tuple[list[float], list[float], list[float]]:
    """x, utilisation, memory (GiB); NaN where a value is missing and between two legs."""
    xs: list[float] = []
    util: list[float] = []
    mem: list[float] = []
    previous: int | None = None
    for s in group:
        assert s.time is not None
        leg = leg_of(s, legs)
        if xs and leg != previous:
            xs.append(math.nan)  # the queue wait between legs is not a line
            util.append(math.nan)
            mem.append(math.nan)
        previous = leg
        xs.append((s.time - t0) / scale)
        util.append(math.nan if s.utilization_gpu is None else s.utilization_gpu)
        mem.append(math.nan if s.memory_used_mib is None else s.memory_used_mib / 1024)
    return xs, util, mem


def _attention(g: GpuStats, t: Thresholds) -> str | None:
    if g.faulted:
        return "FAULT (" + ", ".join(dict.fromkeys(f.split(": ", 1)[-1] for f in g.faults)) + ")"
    if g.util_peak == 0:
        return "idle (0% throughout)"
    if g.util_mean is not None and g.util_mean <= t.very_low_pct:
        return f"very low (mean {g.util_mean:.0f}%)"
    return None


def gpu_figure(
    samples: Sequence[GpuSample],
    legs: Sequence[Leg] = (),
    *,
    title: str = "GPU use",
    thresholds: Thresholds | None = None,
) -> tuple[Figure, PlotResult]:
    """The figure (not saved) and what it shows; `samples` must hold timed samples."""
    t = thresholds or Thresholds()
    timed = sorted((s for s in samples if s.time is not None), key=lambda s: s.time or 0.0)
    if not timed:
        raise ValueError("no timed GPU samples to plot")
    t0 = timed[0].time or 0.0
    t1 = timed[-1].time or 0.0
    unit, scale = _time_unit(t1 - t0)
    groups: dict[str, dict[int, list[GpuSample]]] = defaultdict(lambda: defaultdict(list))
    for s in timed:
        groups[s.host][s.index].append(s)
    stats = {(g.host, g.index): g for g in summarize_gpus(timed)}
    hosts = sorted(groups)

    fig = Figure(figsize=(13, 1.4 + 2.8 * len(hosts)), layout="constrained")
    axes = fig.subplots(len(hosts), 2, squeeze=False, sharex=True)
    idle: list[str] = []
    faulted: list[str] = []
    for row, host in enumerate(hosts):
        ax_util, ax_mem = axes[row]
        totals: list[float] = []
        any_memory = False
        for n, (index, group) in enumerate(sorted(groups[host].items())):
            g = stats[(host, index)]
            xs, util, mem = _series(group, legs, t0, scale)
            any_memory = any_memory or any(not math.isnan(v) for v in mem)
            totals += [s.memory_total_mib for s in group if s.memory_total_mib is not None]
            flag = _attention(g, t)
            label = f"GPU {index}" + (f": {flag}" if flag else "")
            style = {
                "color": _PALETTE[n % len(_PALETTE)],
                "linestyle": _STYLES[(n // len(_PALETTE)) % len(_STYLES)],
                "linewidth": 1.3,
            }
            if g.faulted:
                style = {"color": FAULT, "linestyle": "-", "linewidth": 2.0}
                faulted.append(g.label)
            elif flag:
                style = {"color": ATTENTION, "linestyle": "-", "linewidth": 2.6}
                idle.append(g.label)
            ax_util.plot(xs, util, label=label, gid=f"util:{host}:{index}", **style)
            ax_mem.plot(xs, mem, label=label, gid=f"mem:{host}:{index}", **style)
            bad = [s for s in group if s.faults]
            if bad:
                # A strip along the top: a faulted sample has no utilisation to stand on.
                ax_util.plot(
                    [((s.time or t0) - t0) / scale for s in bad],
                    [FAULT_STRIP] * len(bad),
                    linestyle="none",
                    marker="X",
                    markersize=9,
                    color=FAULT,
                    gid=f"fault:{host}:{index}",
                    label=f"GPU {index}: faulted sample",
                )
        ax_util.set_ylim(-3, FAULT_STRIP + 6)
        ax_util.set_ylabel("GPU utilisation (%)")
        ax_util.set_title(f"{host}: utilisation", loc="left", fontsize=10)
        ax_mem.set_ylabel("memory used (GiB)")
        ax_mem.set_title(f"{host}: memory used", loc="left", fontsize=10)
        if totals:
            capacity = max(totals) / 1024
            ax_mem.axhline(capacity, color="0.5", linestyle=":", linewidth=1.0)
            ax_mem.text(0.0, capacity, f" capacity {capacity:.1f} GiB", va="bottom", fontsize=8)
            ax_mem.set_ylim(0, capacity * 1.1)
        if not any_memory:
            ax_mem.text(
                0.5,
                0.5,
                "memory not reported by these GPUs\n(e.g. unified memory, as on GB10)",
                transform=ax_mem.transAxes,
                ha="center",
                va="center",
                color="0.4",
            )
        for ax in (ax_util, ax_mem):
            ax.grid(True, alpha=0.3)
            for leg in legs[1:]:
                x = (leg.start - t0) / scale
                ax.axvline(x, color="0.3", linestyle="--", linewidth=0.9)
            ax.margins(x=0.01)
        for leg in legs[1:]:
            # Short labels on the utilisation side only (the legend sits right of the memory
            # side; restarts and times are in the report's legs table); near the right end
            # the label goes left of its line. A new job id in the run folder is named.
            job = f" (job {leg.job_id})" if leg.job_id != legs[0].job_id else ""
            late = t1 > t0 and (leg.start - t0) / (t1 - t0) > 0.8
            ax_util.text(
                (leg.start - t0) / scale,
                0.985,
                f" leg {leg.number}{job} ",
                transform=ax_util.get_xaxis_transform(),  # x in data, y just inside the top
                fontsize=8,
                va="top",
                ha="right" if late else "left",
                color="0.3",
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 1},
            )
        ax_mem.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    for ax in axes[-1]:
        ax.set_xlabel(f"time since the first sample ({unit})")

    n_gpus = sum(len(v) for v in groups.values())
    intervals = [
        (b.time or 0.0) - (a.time or 0.0)
        for per_gpu in groups.values()
        for group in per_gpu.values()
        for a, b in itertools.pairwise(group)
    ]
    every = f", a sample every {statistics.median(intervals):.0f} s" if intervals else ""
    in_legs = f" in {len(legs)} legs" if len(legs) > 1 else ""
    end = _clock(t1)
    end = end[11:] if end[:10] == _clock(t0)[:10] else end  # the same day: the time only
    attention = []
    if idle:
        attention.append(f"{len(idle)} idle or very low (red)")
    if faulted:
        attention.append(f"{len(faulted)} faulted (black, X)")
    fig.suptitle(
        f"{title}\n{n_gpus} GPU{'s' if n_gpus != 1 else ''} on {len(hosts)} node"
        f"{'s' if len(hosts) != 1 else ''}, {_clock(t0)} to {end}{in_legs}{every}"
        + (": " + ", ".join(attention) if attention else ""),
        fontsize=11,
    )
    result = PlotResult(Path(), len(hosts), n_gpus, tuple(idle), tuple(faulted), unit)
    return fig, result


def write_plot(
    samples: Sequence[GpuSample],
    path: Path,
    legs: Sequence[Leg] = (),
    *,
    title: str = "GPU use",
    thresholds: Thresholds | None = None,
) -> PlotResult:
    """Draw and save (PNG, or any format matplotlib infers from the suffix)."""
    fig, result = gpu_figure(samples, legs, title=title, thresholds=thresholds)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return PlotResult(
        path, result.nodes, result.gpus, result.idle, result.faulted, result.time_unit
    )
