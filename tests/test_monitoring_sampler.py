"""The per-node sampler as a real process (with the nvidia-smi test stand-in on PATH), and the
post-mortem report built from the files it writes."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from monitoring.cli import ReportOptions, load_history
from monitoring.parse import (
    parse_probe_output,
    parse_sample_csv,
    parse_sampler_log,
    parse_scontrol_job,
)
from monitoring.records import QUERY_GPU_FIELDS, JobInfo, SamplerStart
from monitoring.report import Report, make_console, render
from monitoring.rundir import find_samples
from monitoring.sampler import CSV_HEADER, CsvSink, QueryResult
from monitoring.summary import make_notes

REPO = Path(__file__).resolve().parent.parent
FAKE_BIN = REPO / "tests" / "fake_bin"
FIXTURES = REPO / "tests" / "fixtures"
LOST = "Unable to determine the device handle for GPU0000:01:00.0: GPU has fallen off the bus."


def env_with_fake(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FAKE_NVIDIA"))}
    env["PATH"] = f"{FAKE_BIN}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def sampler(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "monitoring.sampler", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def gpu_report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "monitoring/gpu_report.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_sampler_appends_rows_and_a_requeued_job_continues_the_file(tmp_path: Path) -> None:
    out = tmp_path / "gpu_samples"
    env = env_with_fake(SLURM_JOB_ID="77", SLURMD_NODENAME="gpu-n1")
    for _ in range(2):  # a requeued job writes into the same run folder again
        result = sampler("--output", str(out), "--interval", "0.1", "--count", "3", env=env)
        assert result.returncode == 0, result.stderr
    text = (out / "gpu-n1.csv").read_text()
    assert text.splitlines()[0] == CSV_HEADER
    assert text.count(CSV_HEADER) == 1
    samples, errors = parse_sample_csv(text, "gpu-n1")
    assert errors == []
    assert len(samples) == 2 * 3 * 8  # runs x samples x GPUs in the recording
    assert {s.job_id for s in samples} == {"77"}
    assert {s.host for s in samples} == {"gpu-n1"}
    assert [s.utilization_gpu for s in samples[:8]] == [100.0] * 7 + [0.0]
    assert samples[0].name is None  # [N/A] in the replay: kept as missing
    # The log holds no errors, only one start record per run (per leg of a requeued job).
    logged = [record for _, record in parse_sampler_log((out / "gpu-n1.log").read_text(), "n")]
    assert [type(r) for r in logged] == [SamplerStart, SamplerStart]


def test_sampler_keeps_only_the_jobs_gpus(tmp_path: Path) -> None:
    env = env_with_fake(SLURM_JOB_ID="5", SLURM_JOB_GPUS="6,7", SLURMD_NODENAME="n")
    assert sampler("--output", str(tmp_path), "--count", "1", env=env).returncode == 0
    samples, _ = parse_sample_csv((tmp_path / "n.csv").read_text())
    assert [s.index for s in samples] == [6, 7]


def test_sampler_stops_at_once_on_sigterm(tmp_path: Path) -> None:
    # The default 30 s interval: SIGTERM must end the wait, not the next sample (Slurm sends
    # SIGKILL KillWait seconds after SIGTERM).
    env = env_with_fake(SLURMD_NODENAME="n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "monitoring.sampler", "--output", str(tmp_path), "--interval", "30"],
        cwd=REPO,
        env=env,
    )
    csv = tmp_path / "n.csv"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not csv.exists() or csv.read_text().count("\n") < 9):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == 0
    assert len(csv.read_text().splitlines()) == 1 + 8  # the header and one whole sample


def test_sampler_without_nvidia_smi_prints_one_line_and_exits_0(tmp_path: Path) -> None:
    env = env_with_fake()
    env["PATH"] = str(tmp_path)  # no nvidia-smi anywhere
    result = sampler("--output", str(tmp_path / "out"), "--interval", "1", env=env)
    assert result.returncode == 0
    assert len(result.stderr.strip().splitlines()) == 1
    assert "nvidia-smi not found" in result.stderr
    # No CSV: only its record of why, which the report quotes (issue 48).
    assert [p.suffix for p in (tmp_path / "out").iterdir()] == [".log"]
    probe = sampler("--output", "-", "--count", "1", env=env)
    assert json.loads(probe.stdout)["kind"] == "missing"


def test_probe_mode_prints_json_lines_with_processes() -> None:
    result = sampler(
        "--output", "-", "--count", "2", "--interval", "0.1", "--processes", env=env_with_fake()
    )
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["kind"] for r in records] == ["gpu", "gpu", "apps"]
    assert len(records[0]["lines"]) == 8
    assert records[1]["time"] - records[0]["time"] >= 0.09
    assert len(records[2]["lines"]) == 8


def test_post_mortem_report_from_sampler_files(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = env_with_fake(SLURM_JOB_ID="987654", SLURMD_NODENAME="gpu-n1")
    samples_dir = run_dir / "gpu_samples"
    first = sampler("--output", str(samples_dir), "--interval", "0.1", "--count", "4", env=env)
    assert first.returncode == 0, first.stderr
    # A second job that reused the run folder (GPU 0 only) must not leak into job 987654's report.
    other = env_with_fake(SLURM_JOB_ID="901", SLURMD_NODENAME="gpu-n1", SLURM_JOB_GPUS="0")
    assert sampler("--output", str(samples_dir), "--count", "1", env=other).returncode == 0

    result = gpu_report("--run-dir", str(run_dir), "--json")
    data = json.loads(result.stdout)
    (m,) = data["measurements"]
    assert len(m["gpus"]) == 8 and m["summary"]["samples_per_gpu"] == 5
    # With no job id, every sample in the folder counts; 901 only sampled GPU 0.
    assert [g["samples"] for g in m["gpus"]] == [5] + [4] * 7
    texts = [n["text"] for n in data["notes"]]
    assert any("not used" in t and "gpu-n1 GPU 7" in t for t in texts)

    # With the job id, only that job's rows; Slurm does not know the job, --run-dir is the source.
    result = gpu_report("987654", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert "gpu-n1" in result.stdout and "Util over time" in result.stdout
    assert "4 samples per GPU" in result.stdout


def test_lost_gpu_is_logged_and_explained(tmp_path: Path) -> None:
    # A recording built from the 8 x H200 fixture with a lost-GPU line (from the fixture of real
    # error lines) in place of GPU 3: what nvidia-smi prints when one GPU falls off the bus.
    rows = (FIXTURES / "nvidia_smi_query_gpu_8xH200.csv").read_text().splitlines()
    recording = tmp_path / "lost.csv"
    recording.write_text("\n".join([*rows[:4], LOST, *rows[5:]]) + "\n")
    env = env_with_fake(
        SLURMD_NODENAME="gpu07", FAKE_NVIDIA_SMI_GPUS=str(recording), FAKE_NVIDIA_SMI_EXIT="15"
    )
    out = tmp_path / "gpu_samples"
    assert (
        sampler("--output", str(out), "--count", "2", "--interval", "0.1", env=env).returncode == 0
    )
    assert (out / "gpu07.log").read_text().count(LOST) == 2
    samples, _ = parse_sample_csv((out / "gpu07.csv").read_text())
    assert sorted({s.index for s in samples}) == [0, 1, 2, 4, 5, 6, 7]

    result = gpu_report("--run-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    flat = " ".join(result.stdout.split())
    assert "fallen off the bus" in flat and "(seen 2 times)" in flat
    assert "sbatch --exclude=gpu07" in flat


def test_finds_the_run_folder_named_in_the_job_log(tmp_path: Path) -> None:
    work = tmp_path / "repo"  # where the job was submitted (its WorkDir)
    (work / "logs").mkdir(parents=True)
    run = tmp_path / "scratch" / "my-run"  # OUTPUT_DIR outside the submit directory
    env = env_with_fake(SLURM_JOB_ID="31337", SLURMD_NODENAME="n1")
    assert sampler("--output", str(run / "gpu_samples"), "--count", "1", env=env).returncode == 0
    # The line slurm/finetune.sh echoes into logs/%x-%j.out before training.
    (work / "logs" / "chess-finetune-31337.out").write_text(
        f"job 31337 (restart 0) on n1: python chess_finetune.py --output_dir {run} --model m\n"
    )
    # Long after the end only sacct's WorkDir is known, not StdOut.
    job = JobInfo(job_id="31337", state="COMPLETED", source="sacct", work_dir=str(work))
    found, looked = find_samples("31337", job, None)
    assert found is not None and found.folder == run / "gpu_samples"
    assert looked[0] == run / "gpu_samples"
    assert {s.job_id for s in found.samples} == {"31337"}
    other = JobInfo(job_id="31338", state="COMPLETED", source="sacct", work_dir=str(work))
    assert find_samples("31338", other, None)[0] is None


def _starts(folder: Path, host: str) -> list[SamplerStart]:
    logged = parse_sampler_log((folder / f"{host}.log").read_text(), host)
    return [record for _, record in logged if isinstance(record, SamplerStart)]


def test_sampler_keeps_the_jobs_gpus_by_cuda_visible_devices_and_says_so(tmp_path: Path) -> None:
    # No SLURM_*_GPUS (a step that does not inherit them), only what CUDA sees.
    env = env_with_fake(SLURM_JOB_ID="5", CUDA_VISIBLE_DEVICES="2,3", SLURMD_NODENAME="n")
    assert sampler("--output", str(tmp_path / "a"), "--count", "1", env=env).returncode == 0
    samples, _ = parse_sample_csv((tmp_path / "a" / "n.csv").read_text())
    assert [s.index for s in samples] == [2, 3]
    (start,) = _starts(tmp_path / "a", "n")
    assert (start.gpus, start.node_gpus) == ((2, 3), 8)
    assert start.rule == "GPUs 2,3 of the 8 GPUs nvidia-smi lists (CUDA_VISIBLE_DEVICES=2,3)"
    # As UUIDs (GPU 7's in the recording), and with SLURM_RESTART_COUNT (a requeued leg).
    uuid = "GPU-28780eb0-24d5-1f13-59b8-ae5c23617a72"
    env = env_with_fake(SLURM_JOB_ID="5", CUDA_VISIBLE_DEVICES=uuid, SLURM_RESTART_COUNT="2")
    assert sampler("--output", str(tmp_path / "b"), "--count", "1", env=env).returncode == 0
    csv = next((tmp_path / "b").glob("*.csv"))
    assert [s.index for s in parse_sample_csv(csv.read_text())[0]] == [7]
    assert _starts(tmp_path / "b", csv.stem)[0].restart == 2


def test_report_counts_only_the_jobs_gpus(tmp_path: Path) -> None:
    # A sampler that found no allocation recorded all 8 GPUs the node's nvidia-smi lists ...
    env = env_with_fake(SLURM_JOB_ID="4", SLURMD_NODENAME="vm")
    out = tmp_path / "gpu_samples"
    assert (
        sampler("--output", str(out), "--count", "2", "--interval", "0.1", env=env).returncode == 0
    )
    assert _starts(out, "vm")[0].gpus is None
    # ... while job 4 held GPUs 0-1 (scontrol, recorded on the local Slurm, while it ran).
    running = parse_scontrol_job((FIXTURES / "scontrol_show_job_running_2gpu.txt").read_text())
    options = ReportOptions(job_id="4", run_dir=tmp_path)
    history, _ = load_history("4", running, options, "Run so far")
    assert history is not None
    m = history.measurement
    assert [g.index for g in m.gpus] == [0, 1]
    assert (m.summary.gpus_measured, m.summary.gpus_allocated) == (2, 2)
    assert m.gpu_selection == ("vm: GPUs 0,1 of the 8 in the samples (scontrol GRES IDX:0,1)",)
    notes = make_notes(m.gpus, m.summary, running)
    assert not any("GPU 7" in n.text for n in notes)  # another job's idle GPU: not ours
    # Long after the end only sacct's GPU count is known: all 8 are shown, with a warning.
    finished = JobInfo(job_id="4", state="COMPLETED", source="sacct", nodes=("vm",), gpus=2)
    history, _ = load_history("4", finished, options, "Whole run")
    assert history is not None and len(history.measurement.gpus) == 8
    (warning,) = history.warnings
    assert "The samples of vm hold 8 GPUs but job 4 had 2 per node" in warning


def test_requeued_job_is_judged_by_all_its_legs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Four legs of job 55 through the sampler's own writer, at chosen times (waiting 9 minutes
    # in a test is not an option): 3:00, 2:58, 2:25 and a last leg of 0:29, 8:52 in all.
    rows = (FIXTURES / "nvidia_smi_query_gpu_8xH200.csv").read_text()
    fake = subprocess.run(
        [sys.executable, str(FAKE_BIN / "nvidia-smi"), f"--query-gpu={','.join(QUERY_GPU_FIELDS)}",
         "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True, env=env_with_fake(),
    ).stdout.splitlines()  # fmt: skip
    assert len(fake) == len(rows.splitlines()) - 1
    t0 = 1_760_000_000.0
    durations = [180, 178, 145, 29]
    for restart, seconds in enumerate(durations):
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        sink = CsvSink(tmp_path / "gpu_samples", "gpu-n1", "55")
        start = t0 + 1000 * restart
        for t in [*range(0, seconds, 30), seconds]:
            sink.write(start + t, QueryResult(0, fake), None)
    job = JobInfo(
        job_id="55", state="COMPLETED", source="sacct", nodes=("gpu-n1",), gpus=8, run_seconds=29
    )
    options = ReportOptions(job_id="55", run_dir=tmp_path)
    history, _ = load_history("55", job, options, "Whole run")
    assert history is not None
    summary = history.measurement.summary
    assert [(leg.restart, leg.seconds) for leg in summary.legs] == list(enumerate(durations))
    assert summary.covered_s == sum(durations) == 8 * 60 + 52
    notes = make_notes(history.measurement.gpus, summary, job)
    assert not any("has run for only" in n.text for n in notes)  # not judged by 0:29
    assert any("not used" in n.text and "gpu-n1 GPU 7" in n.text for n in notes)
    report = Report("55", job, (history.measurement,), tuple(notes))
    console = make_console(plain=True, file=io.StringIO())
    console.print(render(report, ascii_only=True))
    text = console.file.getvalue()
    assert "over 8:52 in 4 legs" in text
    assert "Legs (restarts)" in text
    for restart, seconds in enumerate(durations):
        first = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0 + 1000 * restart))
        line = next(ln for ln in text.splitlines() if first in ln)
        assert f"| {restart} |" in " ".join(line.split()).replace("| ", "| ")
        assert f"{seconds // 60}:{seconds % 60:02d}" in line


def test_no_nvidia_smi_is_reported_from_the_samplers_own_record(tmp_path: Path) -> None:
    """Issue 48: the report said "no GPU samples ... the sampler writes them when the job runs
    slurm/finetune.sh" while the job's log said nvidia-smi was missing. The sampler records why,
    and the report quotes it."""
    env = env_with_fake(SLURM_JOB_ID="4242", SLURMD_NODENAME="vm")
    env["PATH"] = env["PATH"].split(os.pathsep, 1)[1]  # no nvidia-smi at all
    run = tmp_path / "run"
    result = sampler("--output", str(run / "gpu_samples"), "--count", "1", env=env)
    assert result.returncode == 0 and "nvidia-smi not found on PATH" in result.stderr
    assert not list((run / "gpu_samples").glob("*.csv"))
    for args in (("4242", "--run_dir", str(run)), ("--run-dir", str(run))):
        report = gpu_report(*args)
        assert report.returncode == 1, report.stdout
        said = " ".join(report.stderr.split())
        assert "the GPU sampler recorded in" in said, said
        assert "on vm: nvidia-smi not found on PATH on node vm: no GPU samples" in said
        assert "source slurm/local/env.sh" in said
        assert "when the job runs slurm/finetune.sh" not in said  # it did


def test_the_local_replay_is_recorded_and_named_a_replay_in_the_report(tmp_path: Path) -> None:
    """slurm/local/bin/nvidia-smi (on PATH from slurm/local/env.sh where there is no
    nvidia-smi) says it replays recorded output; the sampler's start record keeps that, and the
    report names the numbers a replay, in its source line and a warning."""
    env = env_with_fake(SLURM_JOB_ID="4243", SLURMD_NODENAME="vm")
    shell = "source slurm/local/env.sh >/dev/null && command -v nvidia-smi"
    path = env["PATH"].split(os.pathsep, 1)[1]  # as on this machine: no nvidia-smi
    found = subprocess.run(
        ["bash", "-c", shell], cwd=REPO, env={**env, "PATH": path}, capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    assert found.stdout.strip() == str(REPO / "slurm" / "local" / "bin" / "nvidia-smi")
    env["PATH"] = f"{REPO / 'slurm' / 'local' / 'bin'}{os.pathsep}{path}"
    run = tmp_path / "run"
    assert sampler("--output", str(run / "gpu_samples"), "--count", "2", "--interval", "0.1",
                   env=env).returncode == 0  # fmt: skip
    (start,) = [e for _, e in parse_sampler_log((run / "gpu_samples" / "vm.log").read_text(), "vm")
                if isinstance(e, SamplerStart)]  # fmt: skip
    assert start.replay is not None and "replayed by slurm/local/bin/nvidia-smi" in start.replay
    report = gpu_report("4243", "--run_dir", str(run), "--json")
    assert report.returncode == 0, report.stderr
    document = json.loads(report.stdout)
    text = json.dumps(document)
    assert "REPLAY, not measured: recorded nvidia-smi output of 8 x H200" in text
    assert "These GPU numbers are a replay, not a measurement of this job" in text
    # The live probe (a running job's srun step) carries it too, and no row is lost to it.
    probe = parse_probe_output(sampler("--output", "-", "--count", "1", env=env).stdout)
    assert probe.replay == start.replay and len(probe.samples) == 8 and not probe.errors
    # With a real nvidia-smi on PATH, env.sh leaves it first.
    real = subprocess.run(
        ["bash", "-c", shell], cwd=REPO, env=env_with_fake(), capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    assert real.stdout.strip() == str(FAKE_BIN / "nvidia-smi")
