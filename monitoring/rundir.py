"""Finding and reading the sampler files of a job (`<run_dir>/gpu_samples/<node>.csv`).

Where a job's samples are, in the order they are looked for:
  1. `--run_dir DIR`: `DIR/gpu_samples/`, or `DIR` itself if the CSVs are directly in it.
  2. The job's Slurm log: `StdOut`/`StdErr` from `scontrol show job` (known to Slurm for a few
     minutes after the end), else `WorkDir/logs/*<jobid>*` and `WorkDir/*<jobid>*.out`. The run
     folder named in it (slurm/finetune.sh logs `... --output_dir <run_dir> ...`), then the
     log's folder and its parent (run folders keep their logs in `logs/`), each + `gpu_samples/`.
  3. The job's working directory (`WorkDir` from scontrol, or from `sacct` long after the end):
     `WorkDir/gpu_samples`, `WorkDir/*/gpu_samples`, `WorkDir/runs/*/gpu_samples`.
A folder counts only if its CSVs contain rows of this job (the sampler writes `$SLURM_JOB_ID` on
every row), so a run folder reused by several jobs (resume) reports each job separately.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from monitoring.parse import SAMPLE_PREFIX_FIELDS, parse_sample_csv, parse_sampler_log
from monitoring.records import GpuSample, JobInfo, NodeError, SamplerStart

SAMPLES_SUBDIR = "gpu_samples"  # fsdp_utils.config.layout.RunLayout.gpu_samples
_HEADER_START = ",".join(SAMPLE_PREFIX_FIELDS) + ","


@dataclass(frozen=True)
class SampleSet:
    folder: Path
    samples: tuple[GpuSample, ...]
    errors: tuple[NodeError, ...]
    job_ids: tuple[str, ...]  # the jobs that wrote samples into this folder
    starts: tuple[SamplerStart, ...] = ()  # the samplers' start records (legs, GPU choice)


def _sampler_csvs(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob("*.csv")):
        try:
            with path.open() as f:
                first = f.readline()
        except OSError:
            continue
        if first.startswith(_HEADER_START):
            out.append(path)
    return out


_OUTPUT_DIR = re.compile(r"--output_dir[= ]+(\S+)")


def output_dir_in_log(log: Path, limit: int = 1 << 16) -> str | None:
    """The run folder a training log names (`--output_dir <dir>`, echoed by finetune.sh)."""
    try:
        with log.open(errors="replace") as f:
            match = _OUTPUT_DIR.search(f.read(limit))
    except OSError:
        return None
    return match.group(1) if match else None


def _under(work_dir: Path | None, path: str) -> Path:
    """Slurm and the training script give paths relative to the job's working directory."""
    return Path(path) if work_dir is None else work_dir / path  # an absolute path stays as is


def _job_logs(job: JobInfo, work_dir: Path | None) -> list[Path]:
    logs = [_under(work_dir, name) for name in (job.stdout, job.stderr) if name]
    if work_dir is not None:
        # Slurm forgets StdOut minutes after the end; the usual places still hold the log.
        for pattern in (f"logs/*{job.job_id}*", f"*{job.job_id}*.out"):
            logs += sorted(p for p in work_dir.glob(pattern) if p.is_file())
    unique: list[Path] = []
    for log in logs:
        if log not in unique:
            unique.append(log)
    return unique


def candidate_folders(job: JobInfo | None, run_dir: Path | None) -> list[Path]:
    """Folders that may hold the job's samples, most specific first (see module docstring)."""
    found: list[Path] = []
    if run_dir is not None:
        found += [run_dir / SAMPLES_SUBDIR, run_dir]
    if job is not None:
        work_dir = Path(job.work_dir) if job.work_dir else None
        for log in _job_logs(job, work_dir):
            named = output_dir_in_log(log)
            if named is not None:
                found.append(_under(work_dir, named) / SAMPLES_SUBDIR)
            found += [log.parent / SAMPLES_SUBDIR, log.parent.parent / SAMPLES_SUBDIR]
        if work_dir is not None:
            found.append(work_dir / SAMPLES_SUBDIR)
            for pattern in (f"*/{SAMPLES_SUBDIR}", f"runs/*/{SAMPLES_SUBDIR}"):
                matches = [p for p in work_dir.glob(pattern) if p.is_dir()]
                found += sorted(matches, key=lambda p: p.stat().st_mtime, reverse=True)
    unique: list[Path] = []
    for folder in found:
        if folder not in unique:
            unique.append(folder)
    return unique


def _read_logs(folder: Path) -> list[tuple[str, NodeError | SamplerStart]]:
    """`<node>.log` lines -> (job_id, error or sampler start)."""
    out = []
    for path in sorted(folder.glob("*.log")):
        out += parse_sampler_log(path.read_text(errors="replace"), path.stem)
    return out


def read_folder(folder: Path, job_id: str | None) -> SampleSet | None:
    """The samples (and logged errors) of `job_id` in `folder`; all of them if job_id is None.
    A folder with no CSV but a sampler's record of the job (`<node>.log`: why it took no
    samples, nvidia-smi missing, say) is returned without samples, for the report to quote."""
    csvs = _sampler_csvs(folder)
    if not csvs:
        said = [
            e for j, e in _read_logs(folder) if job_id in (None, j) and isinstance(e, NodeError)
        ]
        return SampleSet(folder, (), tuple(said), ()) if said else None
    samples: list[GpuSample] = []
    errors: list[NodeError] = []
    for path in csvs:
        found, bad = parse_sample_csv(path.read_text(errors="replace"), host=path.stem)
        samples += found
        errors += bad
    job_ids = tuple(sorted({s.job_id or "" for s in samples}))
    logged = _read_logs(folder)
    if job_id is not None:
        samples = [s for s in samples if s.job_id == job_id]
        logged = [(j, e) for j, e in logged if j == job_id]
    errors += [e for _, e in logged if isinstance(e, NodeError)]
    starts = tuple(e for _, e in logged if isinstance(e, SamplerStart))
    return SampleSet(folder, tuple(samples), tuple(errors), job_ids, starts)


def find_samples(
    job_id: str | None, job: JobInfo | None, run_dir: Path | None
) -> tuple[SampleSet | None, list[Path]]:
    """The first candidate folder holding samples of the job, and every folder looked at.

    With an explicit `run_dir` whose samples belong to other jobs, that folder's SampleSet is
    returned with no samples, so the caller can say which jobs it holds.
    """
    looked = candidate_folders(job, run_dir)
    explicit: SampleSet | None = None
    said: SampleSet | None = None  # no samples, but the sampler's record of why
    for folder in looked:
        found = read_folder(folder, job_id)
        if found is None:
            continue
        if found.samples:
            return found, looked
        if said is None and found.errors and not found.job_ids:
            said = found
        if (
            run_dir is not None
            and explicit is None
            and folder in (run_dir, run_dir / "gpu_samples")
        ):
            explicit = found
    return explicit or said, looked


def describe(folders: Iterable[Path]) -> str:
    return ", ".join(str(f) for f in folders) or "(nowhere: no run folder known)"
