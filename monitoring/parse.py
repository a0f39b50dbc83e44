"""Pure parsers for the text that GPU and Slurm tools print. No I/O, no subprocesses.

Each parser is tested against outputs copied exactly from real tools (tests/fixtures/).
Values a device cannot report (`[N/A]`, `[Not Supported]`, `N/A`, `-`) become `None`, never 0.
Cells that read as an error (`ERR!`, `[Unknown Error]`, `[GPU is lost]`) also become `None`, and
are listed in the sample's `faults`: the GPU is in an error state, which is not the same as a
value the device does not support.
Lines that are not measurements (e.g. "Unable to determine the device handle for GPU0000:01:00.0:
GPU has fallen off the bus.") are returned as `NodeError`s so the report can say what happened.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from monitoring.records import (
    QUERY_APPS_FIELDS,
    QUERY_GPU_FIELDS,
    AccountingGpu,
    BscLoadGpu,
    BscLoadNode,
    GpuProcess,
    GpuSample,
    JobInfo,
    NodeError,
    Probe,
    SamplerStart,
)

# A number, optionally followed by the unit nvidia-smi prints without `nounits` (or in its table).
_NUMBER = re.compile(r"^([-+]?\d+(?:\.\d+)?)\s*(?:MiB|GiB|MB|%|W|C)?$")
_UNIT_SUFFIX = re.compile(r"\s*\[[^\]]*\]$")  # "memory.used [MiB]" -> "memory.used"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_KNOWN_QUERY_FIELDS = {
    *QUERY_GPU_FIELDS,
    *QUERY_APPS_FIELDS,
    "timestamp",
    "memory.free",
    "pci.bus_id",
    "power.limit",
    "power.draw.average",
    "power.draw.instant",
    "time",
    "host",
    "job_id",
}


# What nvidia-smi prints in a cell when it could not read the GPU: `ERR!` in its table (a GSP
# timeout, an Xid error, a GPU falling off the bus), bracketed NVML errors in --query-gpu CSV.
_FAULT_CELLS = frozenset(
    {
        "err!",
        "unknown error",
        "gpu is lost",
        "gpu requires reset",
        "gpu access blocked by the operating system",
    }
)


def is_fault(cell: str) -> bool:
    """`ERR!`, `[Unknown Error]`, `[GPU is lost]`, `[GPU requires reset]`: a GPU in error."""
    return cell.strip().strip("[]").strip().lower() in _FAULT_CELLS


def parse_number(cell: str) -> float | None:
    """`"100"`, `"100 %"`, `"45934MiB"`, `"286W"`, `"45C"` -> float; anything else -> None."""
    match = _NUMBER.match(cell.strip())
    return float(match.group(1)) if match else None


def parse_text(cell: str) -> str | None:
    """A text field, or None for the placeholders nvidia-smi prints instead of a value."""
    cell = cell.strip()
    if not cell or cell in ("N/A", "-") or (cell.startswith("[") and cell.endswith("]")):
        return None
    return cell


def _field_name(cell: str) -> str:
    return _UNIT_SUFFIX.sub("", cell.strip())


_FIELD_NAME = re.compile(r"^[a-z][a-z0-9_.]*(\s*\[[^\]]*\])?$")


def _is_header(cells: Sequence[str]) -> bool:
    """A CSV header: every cell a field name (`memory.used [MiB]`), at least one we know."""
    return (
        bool(cells)
        and all(_FIELD_NAME.match(cell) for cell in cells)
        and any(_field_name(cell) in _KNOWN_QUERY_FIELDS for cell in cells)
    )


def _split(line: str) -> list[str]:
    return [cell.strip() for cell in line.split(",")]


def _sample_from_row(
    row: dict[str, str], host: str, time: float | None, job_id: str | None
) -> GpuSample:
    def number(*names: str) -> float | None:
        for name in names:
            if name in row:
                return parse_number(row[name])
        return None

    return GpuSample(
        host=host,
        index=int(row["index"]),
        uuid=parse_text(row.get("uuid", row.get("gpu_uuid", ""))),
        name=parse_text(row.get("name", "")),
        utilization_gpu=number("utilization.gpu"),
        utilization_memory=number("utilization.memory"),
        memory_used_mib=number("memory.used"),
        memory_total_mib=number("memory.total"),
        power_w=number("power.draw", "power.draw.average", "power.draw.instant"),
        temperature_c=number("temperature.gpu"),
        time=time,
        job_id=job_id,
        faults=tuple(f"{name}: {cell}" for name, cell in row.items() if is_fault(cell)),
    )


# A pasted command line: `$ nvidia-smi --query-gpu=index,name --format=csv,noheader`.
_QUERY_COMMAND = re.compile(r"nvidia-smi\b.*?--query-(gpu|compute-apps)[= ]+[\"']?([\w.,]+)")


@dataclass(frozen=True)
class QueryGpuRead:
    """`parse_query_gpu`'s result, with where the column names came from."""

    samples: list[GpuSample]
    errors: list[NodeError]
    columns: tuple[str, ...]  # the field list used for the GPU rows (the last one, if several)
    columns_from: str  # "header", "command line" or "assumed"


def read_query_gpu(
    text: str,
    host: str,
    fields: Sequence[str] = QUERY_GPU_FIELDS,
    time: float | None = None,
    job_id: str | None = None,
) -> QueryGpuRead:
    """Output of `nvidia-smi --query-gpu=<fields> --format=csv[,noheader][,nounits]`.

    The columns come from, in order: a header line (`--format=csv`, so CSVs saved with any field
    list work); a pasted `nvidia-smi --query-gpu=...` command line above the rows (the fields of
    `noheader` output); else `fields` (gpu_report's own order), and `columns_from` says that they
    were assumed. Rows after a pasted `--query-compute-apps` command are processes, not GPUs,
    and are skipped. Without an `index` column GPUs are numbered by position.
    """
    columns = [*fields]
    columns_from = "assumed"
    in_apps = False
    samples: list[GpuSample] = []
    errors: list[NodeError] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        command = _QUERY_COMMAND.search(line)
        if command:
            in_apps = command.group(1) == "compute-apps"
            if not in_apps:
                columns = [name.strip() for name in command.group(2).split(",") if name.strip()]
                columns_from = "command line"
            continue
        cells = _split(line)
        if _is_header(cells):
            names = [_field_name(cell) for cell in cells]
            in_apps = "index" not in names and bool(set(names) & {"pid", "gpu_uuid"})
            if not in_apps:
                columns, columns_from = names, "header"
            continue
        if in_apps:
            continue
        row = dict(zip(columns, cells, strict=False))
        if "index" not in row:
            row["index"] = str(len(samples))
        if len(cells) != len(columns) or not row["index"].isdigit():
            errors.append(NodeError(host, line.strip()))
            continue
        samples.append(_sample_from_row(row, host, time, job_id))
    return QueryGpuRead(samples, errors, tuple(columns), columns_from)


def parse_query_gpu(
    text: str,
    host: str,
    fields: Sequence[str] = QUERY_GPU_FIELDS,
    time: float | None = None,
    job_id: str | None = None,
) -> tuple[list[GpuSample], list[NodeError]]:
    """`read_query_gpu` without the column provenance."""
    read = read_query_gpu(text, host, fields, time, job_id)
    return read.samples, read.errors


def parse_compute_apps(
    text: str, host: str, fields: Sequence[str] = QUERY_APPS_FIELDS
) -> tuple[list[GpuProcess], list[NodeError]]:
    """Output of `nvidia-smi --query-compute-apps=<fields> --format=csv[,noheader][,nounits]`."""
    columns = [*fields]
    processes: list[GpuProcess] = []
    errors: list[NodeError] = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("No running"):
            continue
        cells = _split(line)
        if _is_header(cells):
            columns = [_field_name(cell) for cell in cells]
            continue
        if len(cells) > len(columns) and "process_name" in columns:
            # A process name with commas: give the surplus cells back to it.
            at = columns.index("process_name")
            extra = len(cells) - len(columns)
            cells[at : at + extra + 1] = [", ".join(cells[at : at + extra + 1])]
        if len(cells) != len(columns):
            errors.append(NodeError(host, line.strip()))
            continue
        row = dict(zip(columns, cells, strict=True))
        pid = parse_number(row.get("pid", ""))
        processes.append(
            GpuProcess(
                host=host,
                gpu_uuid=parse_text(row.get("gpu_uuid", "")),
                pid=int(pid) if pid is not None else None,
                process_name=parse_text(row.get("process_name", "")),
                used_memory_mib=parse_number(row.get("used_gpu_memory", "")),
            )
        )
    return processes, errors


# The default `nvidia-smi` table. Not a stable interface, but it is what users paste, so it is
# parsed tolerantly: two lines per GPU, then a "Processes:" section.
_TABLE_GPU_LINE1 = re.compile(
    r"^\|\s+(?P<index>\d+)\s+(?P<name>.+?)\s+(?:On|Off)\s+\|\s+"
    r"(?P<bus>[0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\.[0-9A-Fa-f]+)\s"
)
# The memory cell is `used / total`, or one word or two where the GPU has no own memory to report
# (`Not Supported` on unified-memory GPUs such as GB10); `ERR!` may stand in any cell, the fan's
# even touching the border (`|ERR!   68C ...`).
_TABLE_GPU_LINE2 = re.compile(
    r"^\|\s*(?P<fan>\S+)\s+(?P<temp>\S+)\s+(?P<perf>\S+)\s+(?P<power>\S+)\s*/\s*(?P<cap>\S+)\s*\|"
    r"\s*(?P<memory>[^|]*?)\s*\|\s*(?P<util>\S+)\s+"
)
_TABLE_PROCESS = re.compile(
    r"^\|\s+(?P<gpu>\d+)\s+(?P<gi>\S+)\s+(?P<ci>\S+)\s+(?P<pid>\d+)\s+(?P<type>[CGM+]+)\s+"
    r"(?P<name>.+?)\s+(?P<mem>\S+)\s*\|$"
)
_TABLE_ERROR_HINTS = ("Unable to", "failed", "No devices were found", "fallen off the bus")


def looks_like_table(text: str) -> bool:
    """The default `nvidia-smi` table, whole or a pasted fragment of its GPU rows."""
    return (
        "NVIDIA-SMI" in text
        or "Processes:" in text
        or any(_TABLE_GPU_LINE1.match(line) for line in text.splitlines())
    )


def parse_nvidia_smi_table(text: str, host: str) -> Probe:
    """The default `nvidia-smi` output (the table users see when they ssh to a node)."""
    samples: list[GpuSample] = []
    processes: list[GpuProcess] = []
    errors: list[NodeError] = []
    pending: re.Match[str] | None = None
    in_processes = False
    for line in text.splitlines():
        if "Processes:" in line:
            in_processes = True
            continue
        if in_processes:
            match = _TABLE_PROCESS.match(line)
            if match:
                processes.append(
                    GpuProcess(
                        host=host,
                        gpu_uuid=None,
                        pid=int(match["pid"]),
                        process_name=parse_text(match["name"]),
                        used_memory_mib=parse_number(match["mem"]),
                        gpu_index=int(match["gpu"]),
                    )
                )
            continue
        if pending is not None:
            match = _TABLE_GPU_LINE2.match(line)
            if match:
                used, _, total = match["memory"].partition("/")
                cells = {
                    "fan": match["fan"],
                    "temperature.gpu": match["temp"],
                    "power.draw": match["power"],
                    "memory.used": used,
                    "memory.total": total,
                    "utilization.gpu": match["util"],
                }
                # ERR! elsewhere on the GPU's first line (ECC, Disp.A) is a fault all the same.
                faults = [f"{k}: {v.strip()}" for k, v in cells.items() if is_fault(v)]
                faults += ["status: ERR!"] if "ERR!" in pending.string[pending.end() :] else []
                samples.append(
                    GpuSample(
                        host=host,
                        index=int(pending["index"]),
                        name=parse_text(pending["name"]),
                        utilization_gpu=parse_number(match["util"]),
                        memory_used_mib=parse_number(used),
                        memory_total_mib=parse_number(total),
                        power_w=parse_number(match["power"]),
                        temperature_c=parse_number(match["temp"]),
                        faults=tuple(faults),
                    )
                )
            pending = None
            continue
        pending = _TABLE_GPU_LINE1.match(line)
        if pending is None and any(hint in line for hint in _TABLE_ERROR_HINTS):
            errors.append(NodeError(host, line.strip()))
    return Probe(tuple(samples), tuple(processes), tuple(errors), (host,))


def _bsc_cells(line: str) -> list[str] | None:
    if "│" in line:
        return [cell.strip() for cell in line.strip().strip("│").split("│")]
    if "\t" in line:
        return [cell.strip() for cell in line.strip().split("\t")]
    return None


def _bsc_column(header: str) -> str:
    return re.sub(r"\s*\(.*?\)", "", header).strip().upper()


def parse_bsc_load(text: str) -> list[BscLoadNode]:
    """MareNostrum 5's `bsc_load <jobid>` table: box-drawn (seed 004) or tab-separated (ANSI).

    Columns: NODE, NCPUs, CPU_USAGE (%), ..., POWER (W), GPU0 (%), MEM0 (%), GPU1, MEM1, ...
    Only the first GPU/MEM pair carries units; the layout is undocumented, so columns are
    found by name and rows of the wrong width are skipped.
    """
    header: list[str] | None = None
    nodes: list[BscLoadNode] = []
    for raw in _ANSI.sub("", text).splitlines():
        cells = _bsc_cells(raw)
        if not cells:
            continue
        if header is None:
            if _bsc_column(cells[0]) == "NODE":
                header = [_bsc_column(cell) for cell in cells]
            continue
        if len(cells) != len(header) or not cells[0] or set(cells[0]) <= set("-=─━"):
            continue
        row = dict(zip(header, cells, strict=True))
        gpus = []
        for column in header:
            match = re.fullmatch(r"GPU(\d+)", column)
            if match:
                index = int(match.group(1))
                gpus.append(
                    BscLoadGpu(
                        index=index,
                        utilization_pct=parse_number(row[column]),
                        memory_pct=parse_number(row.get(f"MEM{index}", "")),
                    )
                )
        ncpus = parse_number(row.get("NCPUS", ""))
        nodes.append(
            BscLoadNode(
                node=row["NODE"],
                ncpus=int(ncpus) if ncpus is not None else None,
                cpu_usage_pct=parse_number(row.get("CPU_USAGE", "")),
                power_w=parse_number(row.get("POWER", "")),
                gpus=tuple(gpus),
            )
        )
    return nodes


# ----------------------------------------------------------------------------- Slurm


def parse_duration(text: str | None) -> float | None:
    """Slurm durations: `[days-]hours:minutes:seconds[.fraction]`, `minutes:seconds`."""
    if not text:
        return None
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+(?:\.\d+)?)", text.strip())
    if not match:
        return None
    days, hours, minutes, seconds = match.groups()
    return int(days or 0) * 86400 + int(hours or 0) * 3600 + int(minutes) * 60 + float(seconds)


def _split_top_level(spec: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in spec:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def expand_hostlist(spec: str | None) -> list[str]:
    """`node[01-03,07],gpu5` -> node01 node02 node03 node07 gpu5 (Slurm hostlist syntax)."""
    if not spec or spec in ("(null)", "None assigned", "None"):
        return []
    hosts: list[str] = []
    for part in _split_top_level(spec.strip()):
        if not part:
            continue
        match = re.search(r"\[([^\]]+)\]", part)
        if not match:
            hosts.append(part)
            continue
        prefix, suffix = part[: match.start()], part[match.end() :]
        for item in match.group(1).split(","):
            low, _, high = item.partition("-")
            if high:
                width = len(low)
                names = [f"{prefix}{n:0{width}d}{suffix}" for n in range(int(low), int(high) + 1)]
            else:
                names = [f"{prefix}{low}{suffix}"]
            for name in names:
                hosts.extend(expand_hostlist(name))
    return hosts


def expand_indices(text: str) -> tuple[int, ...]:
    """`0-1,3` -> (0, 1, 3)."""
    out: list[int] = []
    for item in text.split(","):
        low, _, high = item.strip().partition("-")
        if low.isdigit():
            out.extend(range(int(low), int(high or low) + 1))
    return tuple(out)


def parse_tres(text: str | None) -> dict[str, str]:
    """`cpu=2,mem=4G,gres/gpu=2` -> {"cpu": "2", "mem": "4G", "gres/gpu": "2"}."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        key, sep, value = item.strip().partition("=")
        if sep:
            out[key] = value
    return out


def gpus_in_tres(tres: dict[str, str]) -> int | None:
    """GPU count of a TRES dict: `gres/gpu`, else the sum of typed `gres/gpu:<type>` entries.

    `gres/gpumem` and `gres/gpuutil` share the prefix but are measurements, not GPUs.
    """
    if "gres/gpu" in tres:
        value = parse_number(tres["gres/gpu"])
        return int(value) if value is not None else None
    typed = [parse_number(v) for k, v in tres.items() if k.startswith("gres/gpu:")]
    counts = [int(v) for v in typed if v is not None]
    return sum(counts) if counts else None


_BINARY_SUFFIX = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}


def parse_bytes(text: str | None) -> float | None:
    """Slurm memory values: `38888M`, `4G`, plain bytes (`--noconvert`) -> bytes."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGTP]?)", (text or "").strip())
    if not match:
        return None
    return float(match.group(1)) * _BINARY_SUFFIX[match.group(2)]


def _key_values(text: str) -> dict[str, str]:
    """`scontrol show job -o` is `Key=value` tokens; a value may contain spaces (Reason, paths)."""
    pairs: list[list[str]] = []
    for token in text.split():
        if re.match(r"^[A-Za-z][\w:/.]*=", token):
            key, _, value = token.partition("=")
            pairs.append([key, value])
        elif pairs:
            pairs[-1][1] += " " + token
    out: dict[str, str] = {}
    for key, value in pairs:
        out.setdefault(key, value)  # the job's own fields come before per-node details
    return out


def _optional(value: str | None) -> str | None:
    return None if value in (None, "", "(null)", "None", "Unknown") else value


_GRES_DETAIL = re.compile(r"Nodes=(\S+)\s+CPU_IDs=\S+\s+Mem=\S+\s+GRES=(\S+)")
_GRES_GPU_IDX = re.compile(r"gpu(?::[^:(,]+)?:\d+\(IDX:([^)]*)\)")


def parse_scontrol_job(text: str) -> JobInfo:
    """`scontrol -d show job -o <id>` (one line per job; the first job is used)."""
    line = next((ln for ln in text.splitlines() if "JobId=" in ln), "")
    if not line:
        raise ValueError(f"no JobId in scontrol output: {text.strip()[:200]!r}")
    kv = _key_values(line)
    nodes = tuple(expand_hostlist(_optional(kv.get("NodeList"))))
    indices: dict[str, tuple[int, ...]] = {}
    for nodes_spec, gres in _GRES_DETAIL.findall(line):
        match = _GRES_GPU_IDX.search(gres)
        if match:
            for node in expand_hostlist(nodes_spec):
                indices[node] = expand_indices(match.group(1))
    # The allocation: per-node details (`-d`) are exact; TRES lists gres/gpu only where
    # accounting tracks it (not on Slurm 22.05 without AccountingStorageTRES=gres/gpu), so fall
    # back to JOB_GRES (22.05) / TresPerNode.
    gpus = sum(len(i) for i in indices.values()) if indices else None
    gpus = (
        gpus
        if gpus is not None
        else gpus_in_tres(parse_tres(kv.get("AllocTRES") or kv.get("TRES")))
    )
    if gpus is None:
        match = re.search(r"gpu(?::[^:,]+)?:(\d+)", kv.get("JOB_GRES", ""))
        gpus = int(match.group(1)) if match else None
    return JobInfo(
        job_id=kv["JobId"],
        state=kv.get("JobState", "UNKNOWN").split()[0],
        source="scontrol",
        name=_optional(kv.get("JobName")),
        user=_optional(kv.get("UserId", "").split("(")[0]),
        reason=_optional(kv.get("Reason")),
        nodes=nodes,
        gpus=gpus,
        gpu_indices=indices,
        run_seconds=parse_duration(kv.get("RunTime")),
        time_limit=_optional(kv.get("TimeLimit")),
        start=_optional(kv.get("StartTime")),
        end=_optional(kv.get("EndTime")),
        work_dir=_optional(kv.get("WorkDir")),
        stdout=_optional(kv.get("StdOut")),
        stderr=_optional(kv.get("StdErr")),
    )


def parse_sacct(text: str, fields: Sequence[str]) -> list[dict[str, str]]:
    """`sacct -n -P` (or `-p`, with a trailing `|`) output with the given `--format` fields."""
    rows = []
    for line in text.splitlines():
        if not line.strip() or set(line.strip()) <= {"-"}:
            continue
        cells = line.split("|")
        if len(cells) == len(fields) + 1 and cells[-1] == "":
            cells = cells[:-1]  # `-p` ends every line with a separator
        if len(cells) == len(fields):
            rows.append(dict(zip(fields, cells, strict=True)))
    return rows


def job_from_sacct(rows: Sequence[dict[str, str]], job_id: str) -> JobInfo | None:
    """The allocation row of a job in `sacct` rows (`JobID` without a `.step` suffix)."""
    row = next((r for r in rows if r.get("JobID") == job_id), None)
    row = row or next((r for r in rows if "." not in r.get("JobID", ".")), None)
    if row is None:
        return None
    return JobInfo(
        job_id=row.get("JobID", job_id),
        state=(row.get("State") or "UNKNOWN").split()[0],
        source="sacct",
        name=_optional(row.get("JobName")),
        user=_optional(row.get("User")),
        nodes=tuple(expand_hostlist(_optional(row.get("NodeList")))),
        gpus=gpus_in_tres(parse_tres(row.get("AllocTRES"))),
        run_seconds=parse_duration(row.get("Elapsed")),
        start=_optional(row.get("Start")),
        end=_optional(row.get("End")),
        work_dir=_optional(row.get("WorkDir")),
    )


def accounting_gpu_tres(rows: Iterable[dict[str, str]]) -> list[AccountingGpu]:
    """GPU TRES (`gres/gpuutil`, `gres/gpumem`) per step, for steps that have any.

    Empty when accounting does not record them (Slurm < 23.02, or no `AutoDetect=nvml`).
    """
    out = []
    for row in rows:
        ave = parse_tres(row.get("TRESUsageInAve"))
        peak = parse_tres(row.get("TRESUsageInMax"))
        if not any(k in d for d in (ave, peak) for k in ("gres/gpuutil", "gres/gpumem")):
            continue
        out.append(
            AccountingGpu(
                step=row.get("JobID", "?"),
                gpus=gpus_in_tres(parse_tres(row.get("AllocTRES"))),
                gpuutil_ave=parse_number(ave.get("gres/gpuutil", "")),
                gpuutil_max=parse_number(peak.get("gres/gpuutil", "")),
                gpumem_ave_bytes=parse_bytes(ave.get("gres/gpumem")),
                gpumem_max_bytes=parse_bytes(peak.get("gres/gpumem")),
            )
        )
    return out


def parse_slurm_version(text: str) -> tuple[int, int, int] | None:
    """`slurm 22.05.8` -> (22, 5, 8)."""
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


# ----------------------------------------------------------------------------- our own formats

SAMPLE_PREFIX_FIELDS: tuple[str, ...] = ("time", "host", "job_id")


def parse_sample_csv(text: str, host: str = "?") -> tuple[list[GpuSample], list[NodeError]]:
    """A sampler file: a header `time,host,job_id,<query fields>`, then one row per GPU sample.

    The query fields are whatever the header says, so files from older samplers still parse.
    """
    lines = text.splitlines()
    if not lines:
        return [], []
    columns = [_field_name(cell) for cell in _split(lines[0])]
    if columns[: len(SAMPLE_PREFIX_FIELDS)] != list(SAMPLE_PREFIX_FIELDS):
        return [], [NodeError(host, f"not a GPU sampler CSV (header {lines[0][:80]!r})")]
    samples: list[GpuSample] = []
    errors: list[NodeError] = []
    # A sampler killed mid-write (the end of a job) may leave the last line cut off: not news.
    complete = lines[1:] if text.endswith("\n") else lines[1:-1]
    for line in complete:
        if not line.strip():
            continue
        cells = _split(line)
        if len(cells) != len(columns) or not cells[columns.index("index")].isdigit():
            errors.append(NodeError(host, f"unreadable sample row: {line.strip()[:120]}"))
            continue
        row = dict(zip(columns, cells, strict=True))
        samples.append(
            _sample_from_row(row, row["host"] or host, parse_number(row["time"]), row["job_id"])
        )
    return samples, errors


# `<node>.log` lines are `time<TAB>job_id<TAB>message`; a sampler's start is `sampler start {json}`.
SAMPLER_START = "sampler start "
# The first line a stand-in for nvidia-smi prints to say its rows are recorded output replayed,
# not this machine's GPUs (slurm/local/bin/nvidia-smi on the local Slurm, which has none).
REPLAY_PREFIX = "REPLAY: "


def parse_sampler_log(text: str, host: str) -> list[tuple[str, NodeError | SamplerStart]]:
    """A sampler's `<node>.log`: (job id, what the node said, or the sampler's start record)."""
    out: list[tuple[str, NodeError | SamplerStart]] = []
    for line in text.splitlines():
        parts = line.split("\t", 2)
        if len(parts) != 3:
            continue
        when, job_id, message = parts
        if message.startswith(SAMPLER_START):
            try:
                record = json.loads(message[len(SAMPLER_START) :])
                gpus = record.get("gpus")
                out.append(
                    (
                        job_id,
                        SamplerStart(
                            host=host,
                            job_id=job_id,
                            time=float(when),
                            restart=record.get("restart"),
                            gpus=tuple(gpus) if gpus is not None else None,
                            node_gpus=record.get("node_gpus"),
                            rule=str(record.get("rule", "")),
                            replay=record.get("replay"),
                        ),
                    )
                )
                continue
            except (ValueError, AttributeError, TypeError):
                pass  # not ours after all: shown as what the node said
        out.append((job_id, NodeError(host, message)))
    return out


_SRUN_LABEL = re.compile(r"^\s*\d+:\s?")


def parse_probe_output(text: str) -> Probe:
    """The JSON lines `python -m monitoring.sampler --output -` prints (one per nvidia-smi call).

    `srun --label` prefixes each line with the task number, which is stripped here.
    """
    samples: list[GpuSample] = []
    processes: list[GpuProcess] = []
    errors: list[NodeError] = []
    hosts: list[str] = []
    replays: list[str] = []
    for raw in text.splitlines():
        line = _SRUN_LABEL.sub("", raw, count=1).strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            errors.append(NodeError("?", line))
            continue
        host = str(record.get("host", "?"))
        if host not in hosts:
            hosts.append(host)
        body = "\n".join(record.get("lines", []))
        kind = record.get("kind")
        if record.get("replay") and record["replay"] not in replays:
            replays.append(str(record["replay"]))
        if kind == "gpu":
            found, bad = parse_query_gpu(body, host, QUERY_GPU_FIELDS, record.get("time"))
            samples.extend(found)
            errors.extend(bad)
            if record.get("returncode") and not found and not bad:
                errors.append(NodeError(host, f"nvidia-smi exited with {record['returncode']}"))
        elif kind == "apps":
            found_apps, bad = parse_compute_apps(body, host)
            processes.extend(found_apps)
            errors.extend(bad)
        elif kind in ("missing", "error"):
            errors.append(NodeError(host, str(record.get("message", kind))))
    replay = "; ".join(replays) or None
    return Probe(tuple(samples), tuple(processes), tuple(errors), tuple(hosts), replay)
