"""Summaries, notes and the three renderings (rich, plain text, JSON); the CLI without Slurm."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from monitoring.allocation import (
    Allocation,
    allocation_from_env,
    job_gpu_indices,
    select_job_gpus,
)
from monitoring.cli import check_owner
from monitoring.collect import ReportError, accounting_note
from monitoring.parse import accounting_gpu_tres, parse_sacct
from monitoring.records import GpuSample, JobInfo, NodeError
from monitoring.report import Report, make_console, measure, render, to_json
from monitoring.summary import Thresholds, make_notes

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
SCRIPT = REPO / "monitoring" / "gpu_report.py"


def samples(host: str, index: int, utils: list[float | None], **fields: float) -> list[GpuSample]:
    """A GPU's samples 60 s apart (synthetic: these tests are about the arithmetic)."""
    return [
        GpuSample(host=host, index=index, utilization_gpu=u, time=60.0 * i, **fields)  # type: ignore[arg-type]
        for i, u in enumerate(utils)
    ]


def job(**overrides: object) -> JobInfo:
    base: dict[str, object] = {"job_id": "7", "state": "COMPLETED", "source": "test", "gpus": 4}
    return JobInfo(**{**base, **overrides})  # type: ignore[arg-type]


def notes_for(all_samples: list[GpuSample], j: JobInfo | None = None, errors=()) -> list:  # type: ignore[no-untyped-def]
    m = measure("Whole run", "test", all_samples, j, timeline_bins=4)
    return make_notes(m.gpus, m.summary, j, errors)


def test_jobstats_thresholds_and_unused_gpu() -> None:
    data = (
        samples("n1", 0, [90, 95, 100, 95], memory_used_mib=70000, memory_total_mib=81559)
        + samples("n1", 1, [10, 12, 8, 14], memory_used_mib=70000, memory_total_mib=81559)
        + samples("n1", 2, [20, 22, 18, 24], memory_used_mib=70000, memory_total_mib=81559)
        + samples("n1", 3, [0, 0, 0, 0], memory_used_mib=500, memory_total_mib=81559)
    )
    notes = notes_for(data, job(run_seconds=3600))
    text = " | ".join(f"{n.level}: {n.text}" for n in notes)
    assert "error: GPUs allocated but not used (0% in every sample): n1 GPU 3" in text
    assert "error: Very low GPU utilisation (<= 15%): n1 GPU 1 (11%)" in text
    assert "warning: Low GPU utilisation (15-25%): n1 GPU 2 (21%)" in text
    assert "Utilisation differs across GPUs: n1 GPU 1 (11%) vs n1 GPU 0 (95%)" in text
    # The fullest GPU is at 86%: no headroom advice.
    assert "headroom" not in text


def test_memory_headroom_and_missing_values() -> None:
    data = samples("n1", 0, [97, 99], memory_used_mib=20000, memory_total_mib=81559) + samples(
        "n1", 1, [None, None], memory_used_mib=21000, memory_total_mib=81559
    )
    notes = notes_for(data, job(run_seconds=3600, gpus=2))
    text = " | ".join(n.text for n in notes)
    assert (
        "GPU memory headroom: the fullest GPU (n1 GPU 1) peaked at 20.5 of 79.6 GiB (26%)" in text
    )
    assert "--batch_size_per_device" in text
    assert "utilization.gpu on n1 GPU 1" in text  # missing, reported as such...
    assert "not used" not in text  # ...and never mistaken for an idle GPU


def test_no_utilisation_advice_in_the_first_five_minutes() -> None:
    data = samples("n1", 0, [0, 0, 0])
    notes = notes_for(data, job(run_seconds=120, state="RUNNING"))
    assert [n.level for n in notes if "not used" in n.text] == []
    assert any("has run for only 2:00" in n.text for n in notes)


def test_error_notes_name_the_fix() -> None:
    lost = "Unable to determine the device handle for GPU0000:01:00.0: GPU has fallen off the bus."
    errors = [NodeError("gpu07", lost), NodeError("gpu07", lost), NodeError("gpu08", "x")]
    notes = notes_for(samples("gpu07", 0, [99]), job(run_seconds=900, gpus=2), errors)
    first = notes[0]
    assert first.level == "error"
    assert "seen 2 times" in first.text and "sbatch --exclude=gpu07" in first.text
    assert any(n.text == "gpu08: x" for n in notes)
    assert any("allocated 2 GPUs but 1 were measured" in n.text for n in notes)


def test_job_gpu_selection_without_device_cgroups() -> None:
    data = [GpuSample(host="n1", index=i, utilization_gpu=50.0) for i in range(8)]
    chosen = select_job_gpus(data, (), job(gpu_indices={"n1": (2, 3)}))
    assert [s.index for s in chosen.samples] == [2, 3]
    assert chosen.rules == ("n1: GPUs 2,3 of the 8 in the samples (scontrol GRES IDX:2,3)",)
    # Only two GPUs visible (device cgroups renumber them 0,1): nothing to choose.
    assert job_gpu_indices([0, 1], [4, 5]) == {0, 1}
    assert allocation_from_env({"SLURM_JOB_GPUS": "0,2-3"}) == Allocation(
        (0, 2, 3), (), "SLURM_JOB_GPUS=0,2-3"
    )
    step = allocation_from_env({"SLURM_STEP_GPUS": "1", "SLURM_JOB_GPUS": "0,1"})
    assert step is not None and step.indices == (1,)
    # CUDA_VISIBLE_DEVICES last; NoDevFiles (GRES without device files) is no allocation.
    cuda = allocation_from_env({"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"})
    assert cuda is not None and cuda.uuids == ("GPU-a", "GPU-b")
    assert allocation_from_env({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}) is None
    assert allocation_from_env({}) is None


def test_another_users_job_is_refused_with_the_command_to_give_them() -> None:
    theirs = job(user="alice", state="RUNNING")
    with pytest.raises(ReportError, match=r"belongs to alice.*gpu_report\.py 7"):
        check_owner(theirs, "bob", 1001)
    check_owner(theirs, "alice", 1000)
    check_owner(theirs, "root", 0)


def test_accounting_notes_by_slurm_version() -> None:
    rows = parse_sacct(
        (FIXTURES / "sacct_gpu_tres_max_curc.txt").read_text(), ["JobID", "TRESUsageInMax"]
    )
    gpu = accounting_gpu_tres(rows)
    assert "no GPU TRES" in (accounting_note([], (22, 5, 8), None) or "")
    assert "23.02" in (accounting_note([], (22, 5, 8), None) or "")
    assert "AutoDetect=nvml" in (accounting_note([], (23, 11, 4), None) or "")
    assert accounting_note(gpu, (23, 2, 0), None) is None
    assert "sums gres/gpuutil" in (accounting_note(gpu, (24, 5, 1), None) or "")


def _report() -> Report:
    data = samples("n1", 0, [50, 70, 90, 100], memory_used_mib=1000.0, memory_total_mib=81559.0)
    m = measure("Whole run", "test samples", data, None, timeline_bins=4)
    return Report("7", None, (m,), tuple(make_notes(m.gpus, m.summary, None)))


def test_plain_text_is_ascii_and_rich_uses_box_drawing(tmp_path: Path) -> None:
    plain_file = tmp_path / "plain.txt"
    with plain_file.open("w") as f:
        make_console(plain=True, file=f).print(render(_report(), ascii_only=True))
    plain = plain_file.read_text()
    assert plain.isascii()
    assert "\x1b[" not in plain
    assert "n1" in plain and "78" in plain  # mean of 50, 70, 90, 100
    assert "=+##" in plain  # the timeline: one bin per sample, 8 levels of 12.5%
    rich_file = tmp_path / "rich.txt"
    with rich_file.open("w") as f:
        make_console(plain=False, file=f).print(render(_report(), ascii_only=False))
    assert "▅▆██" in rich_file.read_text()


def test_json_has_per_gpu_values_and_notes() -> None:
    data = json.loads(to_json(_report()))
    assert data["schema"].startswith("fsdp-utils/gpu_report/")
    (gpu,) = data["measurements"][0]["gpus"]
    assert gpu["util_mean"] == 77.5
    assert gpu["util_peak"] == 100.0
    assert gpu["power_mean_w"] is None  # missing stays null
    assert any("headroom" in n["text"] for n in data["notes"])


def run_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_script_reports_on_saved_outputs() -> None:
    result = run_script("--from-file", str(FIXTURES / "nvidia_smi_table_mn5_4xH100.txt"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.isascii()  # not a terminal: plain text
    assert "H100" in result.stdout and "38" in result.stdout
    assert "Utilisation differs across GPUs" in result.stdout
    result = run_script("--json", "--from-file", str(FIXTURES / "bsc_load_mn5_4xH100.txt"))
    data = json.loads(result.stdout)
    utils = [g["util_mean"] for g in data["measurements"][0]["gpus"]]
    assert utils == [56.0, 99.0, 100.0, 74.0]
    assert data["bsc_load"][0]["node"] == "as07r3b28"


@pytest.mark.parametrize(
    ("args", "path_has_slurm", "message"),
    [
        (["not-a-job"], True, "is not a Slurm job id"),
        (["12345"], False, "`scontrol` is not on PATH"),
        (["--from-file", "tests/fixtures/README.md"], True, "holds no GPU rows"),
        (["--run-dir", "tests"], True, "No GPU sampler files"),
    ],
)
def test_bad_input_gives_one_clear_message(
    args: list[str], path_has_slurm: bool, message: str, tmp_path: Path
) -> None:
    env = dict(os.environ)
    if not path_has_slurm:
        env["PATH"] = str(tmp_path)  # no Slurm client commands at all
    result = run_script(*args, env=env)
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("gpu_report: ")


def test_thresholds_are_configurable() -> None:
    data = samples("n1", 0, [30, 30])
    m = measure("t", "t", data, None)
    strict = make_notes(m.gpus, m.summary, None, thresholds=Thresholds(low_pct=40))
    default = make_notes(m.gpus, m.summary, None)
    assert any("Low GPU utilisation" in n.text for n in strict)
    assert not any("Low GPU utilisation" in n.text for n in default)


def test_faulted_gpu_is_flagged_and_left_out_of_the_means() -> None:
    # GPU 2 turns to ERR! halfway (synthetic values: this is about the arithmetic and the note).
    data = samples("n1", 0, [90, 90, 90, 90]) + samples("n1", 1, [80, 80, 80, 80])
    data += [
        GpuSample(
            host="n1",
            index=2,
            utilization_gpu=None if i >= 2 else 0.0,
            time=60.0 * i,
            faults=("utilization.gpu: ERR!",) if i >= 2 else (),
        )
        for i in range(4)
    ]
    m = measure("Whole run", "test", data, job(run_seconds=3600, gpus=3), timeline_bins=4)
    assert m.summary.gpus_faulted == 1
    assert m.summary.util_mean == 85.0  # GPUs 0 and 1 only
    assert m.summary.util_lowest == 80.0
    notes = make_notes(m.gpus, m.summary, job(run_seconds=3600, gpus=3))
    text = " | ".join(f"{n.level}: {n.text}" for n in notes)
    assert "error: n1 GPU 2 is in an error state: nvidia-smi read utilization.gpu: ERR!" in text
    assert "in 2 of 4 samples" in text
    assert "sbatch --exclude=n1" in text and "admins" in text
    assert "not used" not in text and "differs" not in text  # not mistaken for an idle GPU
    assert "utilization.gpu on" not in text  # nor for a value it cannot report
    console = make_console(plain=True, file=io.StringIO())
    console.print(render(Report("7", None, (m,), ()), ascii_only=True))
    plain = console.file.getvalue()
    assert "FAULT" in plain and "1 faulted" in plain


def test_saved_outputs_of_other_shapes(tmp_path: Path) -> None:
    from tests.test_monitoring_parse import GB10_TABLE

    gb10 = tmp_path / "spark.txt"
    gb10.write_text(GB10_TABLE)
    result = run_script("--json", "--from-file", str(gb10))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    (gpu,) = data["measurements"][0]["gpus"]
    assert (gpu["util_mean"], gpu["mem_used_peak_mib"]) == (87.0, None)
    assert any("memory.used on all GPUs" in n["text"] for n in data["notes"])

    # Rows without a header or a command line, in another field order than ours.
    rows = (FIXTURES / "nvidia_smi_query_gpu_1xL40S.csv").read_text().splitlines()[1:]
    bare = tmp_path / "noheader.csv"
    bare.write_text("\n".join(rows) + "\n")
    result = run_script("--from-file", str(bare))
    assert result.returncode == 1
    flat = " ".join(result.stderr.split())
    assert "assumed its own field order: index,uuid,name,utilization.gpu" in flat
    assert "Paste the command line above the rows" in flat

    # Columns the saved output never had are not blamed on the GPUs.
    result = run_script("--json", "--from-file", str(FIXTURES / "nvidia_smi_query_gpu_8xH200.csv"))
    texts = [n["text"] for n in json.loads(result.stdout)["notes"]]
    assert any("Not in the saved output" in t and "power.draw" in t for t in texts)
    assert not any("Not reported by the GPUs" in t for t in texts)
    # One reading is a snapshot: GPU 7 at 0% is worth a warning, not "0% in every sample".
    assert any("GPUs at 0% in this snapshot" in t and "GPU 7" in t for t in texts)
