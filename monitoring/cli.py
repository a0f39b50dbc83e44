"""`python monitoring/gpu_report.py <jobid>`: how well does (or did) a job use its GPUs?

Running job: one `srun --jobid=<id> --overlap` step samples nvidia-smi on every node for a few
seconds (plus `bsc_load` where it exists), and the run's sampler files so far, if found.
Finished job: the sampler files in the run folder (see monitoring.rundir for how they are found)
and Slurm accounting's GPU TRES where the cluster records them.
"""

from __future__ import annotations

import argparse
import os
import pwd
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from monitoring.allocation import select_job_gpus
from monitoring.arguments import ArgumentParser
from monitoring.collect import (
    Accounting,
    JobEndedError,
    MissingCommandError,
    ProbeOptions,
    ReportError,
    load_accounting,
    load_job,
    probe_job,
    run_bsc_load,
    validate_job_id,
)
from monitoring.legs import Leg, find_legs
from monitoring.parse import (
    QUERY_GPU_FIELDS,
    looks_like_table,
    parse_bsc_load,
    parse_nvidia_smi_table,
    parse_sample_csv,
    read_query_gpu,
)
from monitoring.records import BscLoadNode, GpuProcess, GpuSample, JobInfo, NodeError
from monitoring.report import (
    Measurement,
    Report,
    make_console,
    measure,
    render,
    samples_from_bsc_load,
    to_json,
)
from monitoring.rundir import describe, find_samples
from monitoring.summary import Note, Thresholds, make_notes, summarize_job

SAMPLER_HINT = (
    "The per-node sampler writes them when the job runs slurm/finetune.sh. In your own job "
    "script, start it before the main step: srun --overlap --ntasks-per-node=1 "
    "-N $SLURM_NNODES python -m monitoring.sampler --output <run_dir>/gpu_samples "
    "--interval 30 &"
)


@dataclass(frozen=True)
class ReportOptions:
    job_id: str | None = None
    run_dir: Path | None = None
    from_file: Path | None = None
    probe: ProbeOptions = field(default_factory=ProbeOptions)
    bsc_load: bool = True
    timeline_bins: int = 24
    thresholds: Thresholds = field(default_factory=Thresholds)
    plot: Path | None = None  # draw the sampler files' GPU use over time into this file


def current_user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a container without a passwd entry
        return str(os.getuid())


def check_owner(job: JobInfo, user: str, uid: int) -> None:
    """Slurm lets only the owner (or root/an admin) attach a step to a running job."""
    if job.user and job.user != user and uid != 0:
        raise ReportError(
            f"Job {job.job_id} belongs to {job.user}, not to you ({user}): Slurm lets only a "
            "job's owner (or an admin) attach to its nodes to measure the GPUs. Ask "
            f"{job.user} to run: python monitoring/gpu_report.py {job.job_id}"
        )


# ----------------------------------------------------------------------------- collecting


_ASSUMED = (
    "no header line and no pasted `nvidia-smi --query-gpu=...` command line, so gpu_report "
    "assumed its own field order: " + ",".join(QUERY_GPU_FIELDS)
)


def _from_file(path: Path, options: ReportOptions) -> Report:
    """A saved nvidia-smi table/CSV, bsc_load table or sampler CSV (format recognised)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as error:
        raise ReportError(f"cannot read {path}: {error.strerror}") from None
    host = path.stem
    errors: list[NodeError] = []
    processes: tuple[GpuProcess, ...] = ()
    bsc_nodes: list[BscLoadNode] = []
    fields_read: tuple[str, ...] | None = None  # None: every field the report shows
    assumed = False
    if "NODE" in text and ("│" in text or "\t" in text):
        bsc_nodes = parse_bsc_load(text)
        samples = samples_from_bsc_load(bsc_nodes, None)
        kind = "bsc_load table"
        fields_read = ("utilization.gpu",)
    elif looks_like_table(text):
        probe = parse_nvidia_smi_table(text, host)
        samples, processes, errors = list(probe.samples), probe.processes, list(probe.errors)
        kind = "nvidia-smi table"
    elif text.startswith("time,host,job_id,"):
        samples, errors = parse_sample_csv(text, host)
        kind = "sampler CSV"
    else:
        read = read_query_gpu(text, host)
        samples, errors, fields_read = read.samples, read.errors, read.columns
        assumed = read.columns_from == "assumed"
        kind = f"nvidia-smi --query-gpu CSV (fields from its {read.columns_from})"
        if assumed:
            kind = "nvidia-smi --query-gpu CSV (field order assumed)"
    if not samples:
        hint = ""
        if assumed and errors:
            hint = (
                f" Its rows do not fit: {_ASSUMED} ({len(QUERY_GPU_FIELDS)} fields). Paste the "
                "command line above the rows (`nvidia-smi --query-gpu=index,name,... "
                "--format=csv,noheader`), or save the output with its header (--format=csv)."
            )
        raise ReportError(
            f"{path} holds no GPU rows that gpu_report can read. It reads saved outputs of "
            "`nvidia-smi`, `nvidia-smi --query-gpu=... --format=csv`, `bsc_load <jobid>` and "
            "the sampler's <node>.csv files." + hint
        )
    timed = any(s.time is not None for s in samples)
    bins = options.timeline_bins if timed else 0
    m = measure("Saved output", f"{kind} in {path}", samples, None, processes, bins)
    notes = make_notes(m.gpus, m.summary, None, errors, options.thresholds, fields_read=fields_read)
    if assumed:
        notes.insert(
            0,
            Note(
                "warning",
                f"{path}: {_ASSUMED}. If the file came from another "
                "field list, paste its command line above the rows.",
            ),
        )
    plot = None
    if options.plot is not None:
        if kind != "sampler CSV":
            raise ReportError(
                f"--plot draws GPU samples over time, and {path} is one moment (a {kind}). "
                "Plot a job (python monitoring/gpu_report.py <jobid> --plot gpu.png), a run "
                "folder (--run_dir DIR --plot gpu.png) or a sampler <node>.csv."
            )
        plot = _plot(samples, find_legs(samples), options.plot, f"GPU use: {path}", options)
    return Report(None, None, (m,), tuple(notes), bsc_load=tuple(bsc_nodes), plot=plot)


@dataclass(frozen=True)
class History:
    """The run's sampler files, reduced to the job's GPUs."""

    measurement: Measurement
    samples: list[GpuSample]
    legs: list[Leg]
    errors: list[NodeError]
    warnings: tuple[str, ...]  # doubts about which GPUs were the job's
    replay: str | None = None  # a note: the samples replay recorded output, no measurement


def load_history(
    job_id: str | None, job: JobInfo | None, options: ReportOptions, title: str
) -> tuple[History | None, str]:
    """The run's sampler files: (history or None, where we looked)."""
    found, looked = find_samples(job_id, job, options.run_dir)
    if found is None:
        return None, describe(looked)
    if not found.samples and not found.job_ids:  # no CSV: the sampler's record says why
        raise ReportError(_sampler_said(job_id, found.folder, found.errors))
    if not found.samples:
        others = ", ".join(j or "(outside Slurm)" for j in found.job_ids)
        raise ReportError(
            f"The GPU samples in {found.folder} are from job(s) {others}, not from job "
            f"{job_id}. Pass the run folder of job {job_id} with --run_dir, or leave --run_dir "
            "out to let gpu_report find it."
        )
    chosen = select_job_gpus(found.samples, found.starts, job)
    legs = find_legs(chosen.samples, found.starts)
    source = f"sampler files in {found.folder}"
    replays = "; ".join(sorted({start.replay for start in found.starts if start.replay}))
    replay = None
    if replays:  # a stand-in's rows: say so wherever the numbers are shown
        source = f"REPLAY, not measured: {replays} (from the {source})"
        replay = (
            f"These GPU numbers are a replay, not a measurement of this job: {replays}. The "
            "nodes had a stand-in for nvidia-smi on PATH (the local Slurm's, slurm/local/bin/); "
            "the numbers show what the report looks like."
        )
    m = measure(
        title,
        source,
        chosen.samples,
        job,
        timeline_bins=options.timeline_bins,
        legs=legs,
        gpu_selection=chosen.rules,
    )
    history = History(m, chosen.samples, legs, list(found.errors), chosen.warnings, replay)
    return history, describe(looked)


def _sampler_said(job_id: str | None, folder: Path, said: Sequence[NodeError]) -> str:
    what = f"job {job_id}" if job_id else str(folder.parent)
    lines = "; ".join(dict.fromkeys(f"on {e.host}: {e.message}" for e in said))
    fix = ""
    if any("nvidia-smi not found" in e.message for e in said):
        fix = (
            " nvidia-smi must be on PATH on the compute nodes (the job inherits your PATH: load "
            "your site's CUDA or driver module in the job's setup). On the local Slurm, which "
            "has no GPUs, `source slurm/local/env.sh` puts a replay of recorded nvidia-smi "
            "output on PATH for the jobs you submit (docs/local-slurm.md)."
        )
    return f"No GPU samples of {what}: the GPU sampler recorded in {folder}: {lines}.{fix}"


def _plot(
    samples: list[GpuSample], legs: list[Leg], path: Path, title: str, options: ReportOptions
) -> str:
    from monitoring.plot import write_plot  # matplotlib: only when a plot is asked for

    try:
        write_plot(samples, path, legs, title=title, thresholds=options.thresholds)
    except OSError as error:
        raise ReportError(
            f"cannot write the plot to {path}: {error.strerror}. Choose a writable path, "
            "e.g. --plot gpu.png"
        ) from None
    return str(path)


def _no_plot(job_id: str | None, looked: str) -> ReportError:
    what = f"job {job_id}" if job_id else "this run folder"
    return ReportError(
        f"Nothing to plot for {what}: no GPU sampler files of it were found (looked in: "
        f"{looked}). --plot draws the sampler files (<run_dir>/gpu_samples/<node>.csv) over "
        f"the job's time; run without --plot for the report alone. {SAMPLER_HINT} If the run "
        "folder is elsewhere, pass --run_dir <output_dir>."
    )


def _live(
    job: JobInfo, options: ReportOptions
) -> tuple[Measurement | None, list[NodeError], list[BscLoadNode]]:
    probe = probe_job(job, options.probe)
    errors = list(probe.errors)
    bsc_nodes, bsc_problem = run_bsc_load(job.job_id) if options.bsc_load else ([], None)
    if bsc_problem:
        errors.append(NodeError("bsc_load", bsc_problem))
    chosen = select_job_gpus(probe.samples, (), job)
    samples = chosen.samples
    p = options.probe
    if samples:
        source = (
            f"{p.samples} nvidia-smi samples {p.interval:g} s apart on each node (srun --overlap)"
        )
        if probe.replay:
            source = f"REPLAY, not measured: {probe.replay} (from {source})"
        m = measure("Live", source, samples, job, probe.processes, gpu_selection=chosen.rules)
        return m, errors, bsc_nodes
    if bsc_nodes:
        m = measure("Live", "bsc_load", samples_from_bsc_load(bsc_nodes, time.time()), job)
        return m, errors, bsc_nodes
    return None, errors, bsc_nodes


def _from_run_dir(options: ReportOptions) -> Report:
    """`--run_dir` without a job id: every sample in the folder, no Slurm needed."""
    history, looked = load_history(None, None, options, "Samples")
    if history is None:
        raise ReportError(f"No GPU sampler files (<node>.csv) in {looked}. " + SAMPLER_HINT)
    m = history.measurement
    notes = make_notes(m.gpus, m.summary, None, history.errors, options.thresholds)
    notes += [Note("warning", history.replay)] if history.replay else []
    plot = None
    if options.plot is not None:
        title = f"GPU use: {options.run_dir}"
        plot = _plot(history.samples, history.legs, options.plot, title, options)
    return Report(None, None, (m,), tuple(notes), plot=plot)


def _lookup(job_id: str, options: ReportOptions) -> JobInfo | None:
    try:
        job, unknown = load_job(job_id)
    except ReportError:
        # No Slurm here (or it is unreachable): an explicit run folder is enough.
        if options.run_dir is None:
            raise
        return None
    if job is None and options.run_dir is None:
        raise ReportError(
            f"Job {job_id} is unknown: {unknown}. Check the id with `squeue --me` (queued and "
            "running jobs) or `sacct -X -S now-7days` (finished ones); for an older job pass "
            "its run folder: --run_dir <output_dir>"
        )
    if job is not None and job.is_pending:
        raise ReportError(
            f"Job {job_id} is pending ({job.reason or 'waiting'}): it has no GPUs yet. Watch it "
            f"start with `squeue -j {job_id}`, then run gpu_report again (or add --watch)."
        )
    return job


def _nothing_to_report(job_id: str, job: JobInfo | None, looked: str, note: str | None) -> str:
    if job is not None and job.is_running:
        return (
            f"Could not measure the GPUs of running job {job_id}: the srun probe returned no "
            "nvidia-smi data and bsc_load is not available here. nvidia-smi must be on PATH on "
            "the compute nodes (the probe inherits your environment: load the CUDA or driver "
            "module first)."
        )
    state = job.state if job else "unknown state"
    return (
        f"Job {job_id} has ended ({state}) and no GPU samples of it were found (looked in: "
        f"{looked}). {SAMPLER_HINT} If the run folder is elsewhere, pass --run_dir "
        f"<output_dir>. {note or ''}"
    ).strip()


def build_report(options: ReportOptions) -> Report:
    """Collect everything for one report. ReportError for anything the user must fix."""
    if options.from_file is not None:
        return _from_file(options.from_file, options)
    if options.job_id is None:
        return _from_run_dir(options)
    job_id = validate_job_id(options.job_id)
    job = _lookup(job_id, options)

    measurements: list[Measurement] = []
    errors: list[NodeError] = []
    bsc_nodes: list[BscLoadNode] = []
    if job is not None and job.is_running:
        check_owner(job, current_user(), os.getuid())
        try:
            live, errors, bsc_nodes = _live(job, options)
            measurements += [live] if live is not None else []
        except JobEndedError:
            job = _lookup(job_id, options)

    running = job is not None and job.is_running
    title = "Run so far" if running else "Whole run"
    history, looked = load_history(job_id, job, options, title)
    if history is None and options.plot is not None:
        raise _no_plot(job_id, looked)
    errors += history.errors if history else []
    measurements += [history.measurement] if history is not None else []

    acct = Accounting((), None, None)
    if not running:
        try:
            acct = load_accounting(job_id)
        except MissingCommandError:
            acct = Accounting((), "No accounting data: sacct is not available here.", None)

    if not measurements and not acct.gpu and not errors:
        raise ReportError(_nothing_to_report(job_id, job, looked, acct.note))

    # Advice from the longest view available: the run's samples, else the live snapshot.
    basis = history.measurement if history else (measurements[0] if measurements else None)
    if basis is None:
        notes = make_notes((), summarize_job([], [], job), job, errors, options.thresholds)
    else:
        notes = make_notes(basis.gpus, basis.summary, job, errors, options.thresholds)
    notes += [Note("warning", text) for text in (history.warnings if history else ())]
    notes += [Note("warning", history.replay)] if history and history.replay else []
    plot = None
    if history is not None and options.plot is not None:
        name = f" ({job.name})" if job is not None and job.name else ""
        plot = _plot(
            history.samples, history.legs, options.plot, f"GPU use of job {job_id}{name}", options
        )
    return Report(
        job_id=job_id,
        job=job,
        measurements=tuple(measurements),
        notes=tuple(notes),
        bsc_load=tuple(bsc_nodes),
        accounting=acct.gpu,
        accounting_note=acct.note,
        slurm_version=acct.version,
        plot=plot,
    )


# ----------------------------------------------------------------------------- output


def _print(
    report: Report, as_json: bool, plain: bool, thresholds: Thresholds, one_line: bool = False
) -> None:
    if as_json:
        print(to_json(report, indent=None if one_line else 2), flush=True)
    else:
        make_console(plain).print(render(report, ascii_only=plain, thresholds=thresholds))


def _watch(options: ReportOptions, refresh: float, as_json: bool, plain: bool) -> int:
    """Re-measure every `refresh` seconds until the job ends (or Ctrl-C)."""
    if as_json or plain:
        for report in _reports_until_the_end(options, refresh):
            _print(report, as_json, plain, options.thresholds, one_line=True)
        return 0
    from rich.live import Live

    with Live(console=make_console(plain=False), auto_refresh=False) as live:
        for report in _reports_until_the_end(options, refresh):
            live.update(render(report, False, options.thresholds), refresh=True)
    return 0


def _reports_until_the_end(options: ReportOptions, refresh: float) -> Iterator[Report]:
    """A report every `refresh` seconds while the job runs, then its post-mortem if there is one.

    A job that ends without anything to report after it (no sampler files) just ends the watch.
    """
    report = build_report(options)
    yield report
    while report.job is not None and report.job.is_running:
        time.sleep(refresh)
        try:
            report = build_report(options)
        except ReportError as error:
            print(f"gpu_report: the job has ended. {error}", file=sys.stderr)
            return
        yield report


def parse_args(argv: Sequence[str] | None) -> tuple[ReportOptions, argparse.Namespace]:
    parser = ArgumentParser(
        prog="python monitoring/gpu_report.py",
        description="How well does (or did) a Slurm job use its GPUs? Per node and GPU, a job "
        "summary and advice. Running jobs are measured live (srun --overlap + nvidia-smi, and "
        "bsc_load where it exists); finished jobs are summarised from the sampler files that "
        "slurm/finetune.sh writes into the run folder (gpu_samples/).",
    )
    parser.add_argument("job_id", nargs="?", help="Slurm job id (e.g. 123456 or 123456_7)")
    parser.add_argument(
        "--run_dir",
        type=Path,
        help="the run folder (--output_dir of the run) holding gpu_samples/; "
        "default: found from the job's log and working directory",
    )
    parser.add_argument(
        "--from_file",
        type=Path,
        help="report on a saved output instead: nvidia-smi (table or --query-gpu CSV), "
        "bsc_load, or a sampler <node>.csv",
    )
    parser.add_argument("--samples", type=int, default=5, help="live: samples per GPU (default 5)")
    parser.add_argument(
        "--interval", type=float, default=1.0, help="live: seconds between samples (default 1)"
    )
    parser.add_argument("--watch", action="store_true", help="refresh in place until the job ends")
    parser.add_argument(
        "--refresh", type=float, default=10.0, help="--watch: seconds between reports (10)"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable JSON")
    parser.add_argument(
        "--plain", action="store_true", help="plain ASCII text (default when not a terminal)"
    )
    parser.add_argument("--no_bsc_load", action="store_true", help="do not run bsc_load")
    parser.add_argument(
        "--timeline_bins", type=int, default=24, help="post-mortem timeline width (24)"
    )
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="FILE",
        help="also draw per-GPU utilisation and memory over the job's time from the sampler "
        "files, all nodes (.png, .pdf or .svg)",
    )
    args = parser.parse_args(argv)
    if args.plot is not None and args.plot.suffix.lower() not in (".png", ".pdf", ".svg"):
        parser.error(f"--plot {args.plot}: name a .png, .pdf or .svg file, e.g. --plot gpu.png")
    if args.job_id is None and args.run_dir is None and args.from_file is None:
        parser.error("give a job id (or --run_dir / --from_file)")
    if args.refresh <= 0 or args.timeline_bins < 0:
        parser.error("--refresh must be > 0 and --timeline_bins >= 0")
    try:
        probe = ProbeOptions(samples=args.samples, interval=args.interval)
    except ReportError as error:
        parser.error(str(error))
    options = ReportOptions(
        job_id=args.job_id,
        run_dir=args.run_dir,
        from_file=args.from_file,
        probe=probe,
        bsc_load=not args.no_bsc_load,
        timeline_bins=args.timeline_bins,
        plot=args.plot,
    )
    return options, args


def main(argv: Sequence[str] | None = None) -> int:
    options, args = parse_args(argv)
    plain = args.plain or not sys.stdout.isatty()
    try:
        if args.watch:
            return _watch(options, args.refresh, args.json, plain)
        report = build_report(options)
        _print(report, args.json, plain, options.thresholds)
    except ReportError as error:
        print(f"gpu_report: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    # Nothing measured (only errors to explain): say so in the exit status too.
    return 0 if report.measurements or report.accounting else 1
