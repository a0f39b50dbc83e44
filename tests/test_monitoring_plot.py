"""`gpu_report.py --plot`: the drawn lines equal the sampler CSVs (read back from the figure)."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

from monitoring.cli import ReportOptions, load_history, main
from monitoring.plot import ATTENTION, FAULT, gpu_figure
from monitoring.records import QUERY_GPU_FIELDS
from monitoring.sampler import CsvSink, QueryResult
from tests.test_monitoring_sampler import FAKE_BIN, FIXTURES, env_with_fake

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "monitoring" / "gpu_report.py"
T0 = 1_760_000_000.0


def recording(faulty: bool = False) -> list[str]:
    """What nvidia-smi prints for the sampler's query: the 8 x H200 recording through the
    stand-in; `faulty` puts NVML's `[Unknown Error]` in GPU 3's utilisation cell (as nvidia-smi
    prints it for a GPU in an error state)."""
    lines = subprocess.run(
        [sys.executable, str(FAKE_BIN / "nvidia-smi"), f"--query-gpu={','.join(QUERY_GPU_FIELDS)}",
         "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True, env=env_with_fake(),
    ).stdout.splitlines()  # fmt: skip
    if faulty:
        cells = lines[3].split(", ")
        cells[QUERY_GPU_FIELDS.index("utilization.gpu")] = "[Unknown Error]"
        lines[3] = ", ".join(cells)
    return lines


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two nodes, two legs of job 9 (restart 0 and 1), samples 30 s apart, written by the
    sampler's own writer at chosen times; node b's GPU 3 faults in the second leg."""
    good, bad = recording(), recording(faulty=True)
    for restart, (start, count) in enumerate([(T0, 6), (T0 + 900, 4)]):
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        for host in ("node-a", "node-b"):
            sink = CsvSink(tmp_path / "gpu_samples", host, "9")
            for i in range(count):
                lines = bad if host == "node-b" and restart == 1 else good
                sink.write(
                    start + 30 * i + (2 if host == "node-b" else 0), QueryResult(0, lines), None
                )
    return tmp_path


def read_csvs(folder: Path) -> dict[tuple[str, int], list[tuple[float, str, str]]]:
    """The sampler files read with the csv module alone: (time, utilisation, memory) per GPU."""
    out: dict[tuple[str, int], list[tuple[float, str, str]]] = {}
    for path in sorted(folder.glob("*.csv")):
        with path.open() as f:
            for row in csv.DictReader(f, skipinitialspace=True):
                key = (row["host"], int(row["index"]))
                out.setdefault(key, []).append(
                    (float(row["time"]), row["utilization.gpu"], row["memory.used"])
                )
    return out


def number(cell: str) -> float:
    try:
        return float(cell)
    except ValueError:
        return math.nan  # [N/A], [Unknown Error]: no value, no point drawn


def test_plot_data_equal_the_sampler_csvs(run_dir: Path) -> None:
    history, _ = load_history(None, None, ReportOptions(run_dir=run_dir), "Samples")
    assert history is not None and len(history.legs) == 2
    fig, result = gpu_figure(history.samples, history.legs, title="GPU use of job 9")
    assert (result.nodes, result.gpus, result.time_unit) == (2, 16, "min")
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.get_lines() if line.get_gid()}
    expected = read_csvs(run_dir / "gpu_samples")
    assert len(expected) == 16
    for (host, index), rows in expected.items():
        for kind, column in (("util", 1), ("mem", 2)):
            line = lines[f"{kind}:{host}:{index}"]
            xs, ys = line.get_xdata(), line.get_ydata()
            drawn = [(x, y) for x, y in zip(xs, ys, strict=True) if not math.isnan(x)]
            # x is minutes since the first sample of the job; memory is drawn in GiB.
            assert [T0 + x * 60 for x, _ in drawn] == pytest.approx([r[0] for r in rows])
            scale = 1024 if kind == "mem" else 1
            want = [number(r[column]) / scale for r in rows]
            assert [y for _, y in drawn] == pytest.approx(want, nan_ok=True)
            # One break (NaN) between the two legs: the queue wait is not drawn as a line.
            assert sum(math.isnan(x) for x in xs) == 1
    # What needs attention stands out: GPU 7 idles on both nodes, node-b's GPU 3 faulted.
    assert sorted(result.idle) == ["node-a GPU 7", "node-b GPU 7"]
    assert result.faulted == ("node-b GPU 3",)
    assert lines["util:node-a:7"].get_color() == ATTENTION
    assert "idle" in str(lines["util:node-a:7"].get_label())
    assert lines["util:node-b:3"].get_color() == FAULT
    assert "FAULT ([Unknown Error])" in str(lines["util:node-b:3"].get_label())
    assert len(lines["fault:node-b:3"].get_xdata()) == 4  # an X per faulted sample
    assert lines["util:node-a:0"].get_color() not in (ATTENTION, FAULT)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert titles == [
        "node-a: utilisation",
        "node-a: memory used",
        "node-b: utilisation",
        "node-b: memory used",
    ]
    assert fig.axes[0].get_ylabel() == "GPU utilisation (%)"
    assert fig.axes[-1].get_xlabel() == "time since the first sample (min)"
    suptitle = fig.get_suptitle()
    assert "16 GPUs on 2 nodes" in suptitle and "in 2 legs" in suptitle
    assert "a sample every 30 s" in suptitle


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env_with_fake(),
        check=False,
    )


def test_plot_from_the_command_line(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "plots" / "gpu.png"
    result = run_script("--run-dir", str(run_dir), "--plot", str(png))  # as users run it
    assert result.returncode == 0, result.stderr
    assert f"GPU plot: {png}" in result.stdout
    height, width, _ = imread(png).shape
    assert width > 1000 and height > 500  # a real picture, two node rows
    capsys.readouterr()
    # A job with no samples: one paragraph, exit 1, no traceback, and no empty picture.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["12345", "--run-dir", str(empty), "--plot", str(tmp_path / "x.png")]) == 1
    stderr = capsys.readouterr().err
    assert stderr.startswith("gpu_report: Nothing to plot for job 12345")
    assert len(stderr.strip().splitlines()) == 1
    assert "python -m monitoring.sampler" in stderr
    assert not (tmp_path / "x.png").exists()
    # A saved one-moment output cannot be plotted over time; a bad suffix is a usage error.
    saved = FIXTURES / "nvidia_smi_query_gpu_8xH200.csv"
    assert main(["--from-file", str(saved), "--plot", str(tmp_path / "y.png")]) == 1
    assert "is one moment" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["--run-dir", str(run_dir), "--plot", "gpu.jpeg"])
    assert usage.value.code == 2 and "name a .png, .pdf or .svg file" in capsys.readouterr().err
