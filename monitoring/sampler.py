"""Per-node GPU sampler: `python -m monitoring.sampler --output <run_dir>/gpu_samples --interval 30`.

`slurm/finetune.sh` starts one per node in the background for the whole run and stops it with
SIGTERM at the end; `gpu_report.py` turns the files into a post-mortem report. The live report
runs the same sampler for a few seconds with `--output -` inside an `srun --overlap` step.

Files, one pair per node (appended to, so a requeued job continues the same files):
    <output>/<node>.csv   header `time,host,job_id,<nvidia-smi query fields>`, then one row per
                          GPU per sample: epoch seconds, Slurm node name, $SLURM_JOB_ID, and the
                          cells exactly as `nvidia-smi --query-gpu ... --format=csv,noheader,
                          nounits` printed them (`[N/A]` kept: missing, never zero).
    <output>/<node>.log   `time<TAB>job_id<TAB>message` for anything that was not a sample
                          (a lost GPU, nvidia-smi errors or timeouts), and one `sampler start
                          {json}` line per start: $SLURM_RESTART_COUNT (the leg of a requeued
                          job), the GPUs kept and the rule that chose them (monitoring.allocation).
Only the job's GPUs are recorded: on a node without device cgroups nvidia-smi also lists other
jobs' GPUs, whose use is neither this job's business nor part of its report.
With `--output -` it prints one JSON object per nvidia-smi call instead (see `parse_probe_output`).

Light by design: stdlib only, one `nvidia-smi` call per interval. If nvidia-smi is missing it
prints one line and exits 0, so a job on a node without GPUs is never failed by its sampler.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from monitoring.allocation import Allocation, allocation_from_env, choose
from monitoring.arguments import ArgumentParser
from monitoring.parse import REPLAY_PREFIX, SAMPLER_START
from monitoring.records import QUERY_APPS_FIELDS, QUERY_GPU_FIELDS

CSV_HEADER = ",".join(("time", "host", "job_id", *QUERY_GPU_FIELDS))


@dataclass(frozen=True)
class SamplerConfig:
    output: str  # a folder, or "-" for JSON lines on stdout
    interval: float = 30.0  # seconds between samples
    count: int | None = None  # stop after this many samples (default: until SIGTERM/SIGINT)
    processes: bool = False  # also query the processes on the GPUs (after the last sample)
    nvidia_smi: str = "nvidia-smi"
    timeout: float = 20.0  # a hung nvidia-smi must not stall the sampler

    def __post_init__(self) -> None:
        if self.interval <= 0:
            raise ValueError(f"--interval must be > 0 seconds, got {self.interval}")
        if self.count is not None and self.count < 1:
            raise ValueError(f"--count must be >= 1, got {self.count}")


@dataclass(frozen=True)
class QueryResult:
    returncode: int
    lines: list[str]


def node_name() -> str:
    """Slurm's name for this node (what squeue and scontrol show), else the short hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def run_query(nvidia_smi: str, kind: str, fields: Sequence[str], timeout: float) -> QueryResult:
    argv = [nvidia_smi, f"--query-{kind}={','.join(fields)}", "--format=csv,noheader,nounits"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return QueryResult(124, [f"nvidia-smi did not answer within {timeout:g} s"])
    except OSError as error:
        return QueryResult(127, [f"cannot run {nvidia_smi}: {error}"])
    # A lost GPU is reported in-line ("Unable to determine the device handle for GPU...");
    # keep stderr too so the report can quote it.
    return QueryResult(proc.returncode, (proc.stdout + proc.stderr).splitlines())


@dataclass(frozen=True)
class Split:
    """One query's output: the job's GPU rows, the lines that are not GPU rows, the GPUs
    nvidia-smi listed, the ones kept, and why (see monitoring.allocation.choose)."""

    rows: list[list[str]]
    other: list[str]
    seen: set[int]
    kept: set[int]
    why: str
    replay: str | None = None  # what a stand-in said it replays (`REPLAY_PREFIX`)


_UUID = QUERY_GPU_FIELDS.index("uuid")


def split_sample_lines(lines: Sequence[str], allocation: Allocation | None) -> Split:
    rows: list[list[str]] = []
    other: list[str] = []
    replay = None
    for line in lines:
        cells = [cell.strip() for cell in line.split(",")]
        if line.startswith(REPLAY_PREFIX):
            replay = line[len(REPLAY_PREFIX) :].strip()
        elif len(cells) == len(QUERY_GPU_FIELDS) and cells[0].isdigit():
            rows.append(cells)
        elif line.strip():
            other.append(line.strip())
    listed = [(int(r[0]), r[_UUID]) for r in rows]
    kept, why = choose(listed, allocation)
    rows = [r for r in rows if int(r[0]) in kept]
    return Split(rows, other, {index for index, _ in listed}, kept, why, replay)


def restart_count() -> int | None:
    """The leg of a requeued job; Slurm sets SLURM_RESTART_COUNT only from the first requeue."""
    value = os.environ.get("SLURM_RESTART_COUNT", "").strip()
    if value.isdigit():
        return int(value)
    return 0 if os.environ.get("SLURM_JOB_ID") else None


class CsvSink:
    """Appends samples to `<folder>/<host>.csv` and anything else to `<folder>/<host>.log`."""

    def __init__(self, folder: Path, host: str, job_id: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.csv = folder / f"{host}.csv"
        self.log = folder / f"{host}.log"
        self.host = host
        self.job_id = job_id
        self.started = False
        if not self.csv.exists() or self.csv.stat().st_size == 0:
            self.csv.write_text(CSV_HEADER + "\n")

    def _log(self, now: float, lines: Sequence[str]) -> None:
        append_log(self.log, now, self.job_id, lines)

    def write(self, now: float, result: QueryResult, allocation: Allocation | None) -> None:
        split = split_sample_lines(result.lines, allocation)
        rows, other = split.rows, split.other
        if rows and not self.started:
            # Once per start (per leg of a requeued job), with the first GPU list: the report
            # reads the legs and the GPU choice from it.
            self.started = True
            start = {
                "restart": restart_count(),
                "gpus": sorted(split.kept) if allocation is not None else None,
                "node_gpus": len(split.seen),
                "rule": split.why,
                **({"replay": split.replay} if split.replay else {}),
            }
            self._log(now, [SAMPLER_START + json.dumps(start)])
        if rows:
            # One write per sample: a sampler killed at the end of a job (srun escalates to
            # SIGKILL) leaves whole samples, at worst a cut-off last line (ignored when read).
            prefix = f"{now:.1f},{self.host},{self.job_id},"
            with self.csv.open("a") as f:
                f.write("".join(prefix + ",".join(cells) + "\n" for cells in rows))
        if result.returncode and not other:
            other = [f"nvidia-smi exited with {result.returncode}"]
        if other:
            self._log(now, other)


def append_log(log: Path, now: float, job_id: str, lines: Sequence[str]) -> None:
    """`time<TAB>job_id<TAB>message` lines (monitoring.parse.parse_sampler_log reads them)."""
    with log.open("a") as f:
        for line in lines:
            f.write(f"{now:.1f}\t{job_id}\t{line}\n")


def record_only(folder: Path, host: str, job_id: str, message: str) -> None:
    """A line in `<folder>/<host>.log` and no CSV: why this node has no samples."""
    folder.mkdir(parents=True, exist_ok=True)
    append_log(folder / f"{host}.log", time.time(), job_id, [message])


def _emit(stream: TextIO, record: dict[str, object]) -> None:
    stream.write(json.dumps(record) + "\n")
    stream.flush()


def run(config: SamplerConfig, stop: threading.Event, out: TextIO = sys.stdout) -> int:
    host = node_name()
    job_id = os.environ.get("SLURM_JOB_ID", "")
    to_stdout = config.output == "-"
    if shutil.which(config.nvidia_smi) is None:
        message = f"nvidia-smi not found on PATH on node {host}: no GPU samples"
        if to_stdout:
            _emit(out, {"host": host, "kind": "missing", "message": message})
        else:  # in the job's log, and in the sampler's own record, where the report reads it
            print(f"gpu sampler: {message}.", file=sys.stderr)
            record_only(Path(config.output), host, job_id, message)
        return 0
    allocation = allocation_from_env(os.environ)
    sink = None if to_stdout else CsvSink(Path(config.output), host, job_id)
    started = time.monotonic()
    taken = 0
    while not stop.is_set():
        now = time.time()
        result = run_query(config.nvidia_smi, "gpu", QUERY_GPU_FIELDS, config.timeout)
        taken += 1
        if sink is not None:
            sink.write(now, result, allocation)
        else:
            split = split_sample_lines(result.lines, allocation)
            lines = [", ".join(cells) for cells in split.rows] + split.other
            _emit(
                out,
                {
                    "host": host,
                    "kind": "gpu",
                    "time": now,
                    "job_id": job_id,
                    "returncode": result.returncode,
                    "lines": lines,
                    **({"replay": split.replay} if split.replay else {}),
                },
            )
        if config.count is not None and taken >= config.count:
            break
        # Sample on a fixed grid so a slow nvidia-smi does not make the timeline drift.
        stop.wait(max(0.0, started + taken * config.interval - time.monotonic()))
    if config.processes and to_stdout:
        apps = run_query(config.nvidia_smi, "compute-apps", QUERY_APPS_FIELDS, config.timeout)
        _emit(
            out,
            {
                "host": host,
                "kind": "apps",
                "returncode": apps.returncode,
                "lines": [line for line in apps.lines if not line.startswith(REPLAY_PREFIX)],
            },
        )
    return 0


def parse_args(argv: Sequence[str] | None = None) -> SamplerConfig:
    parser = ArgumentParser(
        prog="python -m monitoring.sampler",
        description="Append nvidia-smi samples of this node's GPUs to <output>/<node>.csv "
        "until SIGTERM/SIGINT (or --count samples).",
    )
    parser.add_argument(
        "--output", required=True, help="folder for <node>.csv, or - for JSON on stdout"
    )
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--count", type=int, default=None, help="stop after N samples")
    parser.add_argument(
        "--processes", action="store_true", help="also list GPU processes (with --output -)"
    )
    parser.add_argument("--nvidia-smi", default="nvidia-smi", help="nvidia-smi executable")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per nvidia-smi call")
    args = parser.parse_args(argv)
    try:
        return SamplerConfig(
            output=args.output,
            interval=args.interval,
            count=args.count,
            processes=args.processes,
            nvidia_smi=args.nvidia_smi,
            timeout=args.timeout,
        )
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        return run(config, stop)
    except OSError as error:
        print(f"gpu sampler: cannot write samples: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
