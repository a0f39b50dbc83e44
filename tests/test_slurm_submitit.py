"""`slurm/submit.py`: options, the generated batch script (golden), the sweep table, and a real
sweep through the one-node Slurm. (submitit's local executor: tests/test_submitit_local.py, a
module of its own so that it runs beside the Slurm tests, not after them.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from fsdp_utils.slurm.submitit_launcher import (
    SubmitOptions,
    _RunFinished,
    choose_run_dir,
    make_task,
    parse_time_minutes,
    sbatch_preview,
)
from fsdp_utils.slurm.sweep import SweepSpec, format_sweep_table, summarise_run
from tests import local_slurm as slurm_fixture
from tests.local_slurm import LocalSlurm
from tests.test_slurm_conf import check_golden

local_slurm = slurm_fixture.local_slurm  # the session fixture, under its own name

REPO = Path(__file__).resolve().parent.parent
TINY_RUN = (
    "--dataset_include", "",
    "--max_seq_length", "128",
    "--max_training_steps", "3",
    "--total_batch_size", "8",
    "--eval_examples", "16",
    "--eval_every", "0",
    "--precision", "fp32",
)  # fmt: skip


@pytest.mark.parametrize(
    ("text", "minutes"),
    [("90", 90), ("0:30", 1), ("04:00:00", 240), ("1-12", 2160), ("2-00:30:00", 2910)],
)
def test_slurm_time_formats(text: str, minutes: int) -> None:
    assert parse_time_minutes(text) == minutes


def test_bad_options_name_the_fix() -> None:
    with pytest.raises(ValueError, match="not a Slurm time"):
        parse_time_minutes("4h")
    with pytest.raises(ValueError, match="--local runs on this machine only"):
        SubmitOptions(local=True, nodes=2)
    with pytest.raises(ValueError, match=r"OPTION a chess_finetune\.py option"):
        SweepSpec.parse("batch_size=1,2")
    assert SweepSpec.parse("--batch_size_per_device=1, 2,4").values == ("1", "2", "4")


def test_generated_batch_script_golden() -> None:
    """The exact script submitit hands to sbatch: one task per GPU, offline mode exported before
    Python, USR2 before the limit, requeue allowed, CPUs repeated for srun."""
    options = SubmitOptions(
        nodes=2,
        gpus_per_node=4,
        cpus_per_gpu=8,
        mem_gb=256,
        time="04:00:00",
        partition="gpu",
        account="proj42",
        setup=("module load anaconda3/2024.6", "conda activate fsdp-utils"),
        log_dir=Path("/scratch/alice/logs/submitit"),
        python="/home/alice/.conda/envs/fsdp-utils/bin/python",
    )
    check_golden("submitit_sbatch.sh", sbatch_preview(options))


def test_run_dir_is_fixed_at_submission(tmp_path: Path) -> None:
    now = datetime(2025, 3, 1, 14, 5, 9)
    assert choose_run_dir(SubmitOptions(), [], now) == Path("runs/chess-finetune-20250301-140509")
    assert choose_run_dir(SubmitOptions(), ["--output_dir", "x"], now) == Path("x")


def test_checkpoint_requeues_a_stopped_run_not_a_finished_one(tmp_path: Path) -> None:
    """submitit's checkpoint() (rank 0, on the preemption/time-limit signal) touches the stop
    file of the trainer's own config, waits, and requeues the next leg (counted, so that it
    resumes its own checkpoint), unless the trainer finished the run instead of stopping."""
    run_dir, halt = tmp_path / "run", tmp_path / "HALT"
    run_dir.mkdir()
    config = tmp_path / "run.yaml"
    config.write_text(f"stop_file: {halt}\n")
    task = make_task(SubmitOptions(), ["--config", str(config)], run_dir)
    assert task.command[-2:] == ["--output_dir", str(run_dir.resolve())]
    with subprocess.Popen(["true"]) as process:  # the trainer, already exited
        process.wait()
    task._process = process
    (run_dir / "status.json").write_text(json.dumps({"status": "interrupted", "step": 7}))
    delayed = task.checkpoint()
    assert halt.exists() and delayed.function.leg == 1
    assert delayed.function.checkpoint().function.leg == 2
    (run_dir / "status.json").write_text(json.dumps({"status": "completed", "step": 8}))
    with pytest.raises(_RunFinished, match=r"finished the run \(step 8\).*not requeueing"):
        task.checkpoint()


def test_a_leg_that_stopped_by_itself_is_counted_in_the_pickled_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer stopped before the signal (it reads the end time): rank 0 requeues through
    submitit's local controller, which restarts the pickled task, so the leg is stored there."""
    from submitit.core.utils import DelayedSubmission
    from submitit.local.local import LOCAL_REQUEUE_RETURN_CODE

    local_task = {"EXECUTOR": "local", "FOLDER": str(tmp_path), "LOCAL_JOB_ID": "4012"}
    local_task |= {"LOCAL_NTASKS": "1", "LOCAL_GLOBALID": "0", "LOCAL_LOCALID": "0"}
    local_task |= {"LOCAL_NODEID": "0", "LOCAL_JOB_NUM_NODES": "1"}
    for name, value in local_task.items():
        monkeypatch.setenv(f"SUBMITIT_{name}", value)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    task = make_task(SubmitOptions(), [], tmp_path / "run")
    pickled = tmp_path / "4012_submitted.pkl"
    DelayedSubmission(task).dump(pickled)
    with pytest.raises(SystemExit) as exit_info:
        task._maybe_requeue({"status": "interrupted", "step": 3}, 0)
    assert exit_info.value.code == LOCAL_REQUEUE_RETURN_CODE
    assert DelayedSubmission.load(pickled).function.leg == 1


def write_metrics(run_dir: Path, step_times: list[float], peak_gib: float) -> None:
    run_dir.mkdir(parents=True)
    records = [{"kind": "start", "step": 0, "message": "training"}]
    for step, seconds in enumerate(step_times, start=1):
        records.append(
            {
                "kind": "train",
                "step": step,
                "step_time_s": seconds,
                "tokens_per_s": 4096 / seconds,
                "tokens_per_s_per_device": 1024 / seconds,
                "cuda_peak_reserved_gib": peak_gib,
            }
        )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_sweep_table(tmp_path: Path) -> None:
    """Median speed without the warm-up step; OOM recognised; the answer in the last line."""
    write_metrics(tmp_path / "1", [9.0, 1.0, 1.0, 1.2], 30.5)
    write_metrics(tmp_path / "2", [9.0, 0.8, 0.8, 0.9], 52.25)
    rows = [
        summarise_run("1", tmp_path / "1"),
        summarise_run("2", tmp_path / "2"),
        summarise_run("4", tmp_path / "4", "torch.OutOfMemoryError: CUDA out of memory."),
    ]
    assert rows[0].step_time_s == 1.0 and rows[1].peak_memory_gib == 52.25
    table = format_sweep_table("batch_size_per_device", rows).splitlines()
    assert table[0].split() == [
        "batch_size_per_device", "outcome", "steps", "s/step", "tokens/s", "tokens/s/device",
        "peak", "GPU", "reserved", "GiB",
    ]  # fmt: skip
    assert table[2].split() == ["1", "completed", "4", "1.000", "4,096", "1,024", "30.50"]
    assert table[4].split()[:4] == ["4", "out", "of", "memory"]
    assert table[-1] == ("largest batch_size_per_device that ran: 2; fastest: 2 (5,120 tokens/s)")


def run_submit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "slurm/submit.py", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env or dict(os.environ),
        timeout=400,
    )


@pytest.mark.slow
def test_submitit_sweep_on_slurm(
    local_slurm: LocalSlurm, tiny_assets: dict[str, Path], tmp_path: Path
) -> None:
    """A job array on the local Slurm (2 emulated GPUs per job), then the table. 3 sequences
    per device cannot make a total of 8 on 2 devices: a table row, not a submitted job."""
    base = tmp_path / "sweep"
    result = run_submit(
        "--gpus-per-node", "2", "--cpus-per-gpu", "1", "--mem-gb", "4", "--time", "10",
        "--log-dir", str(tmp_path / "logs"), "--sweep", "batch_size_per_device=1,2,3",
        "--", "--model", str(tiny_assets["model"]), "--dataset", str(tiny_assets["data"]),
        *TINY_RUN, "--output_dir", str(base),
        env=local_slurm.env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    table = lines[lines.index(next(x for x in lines if x.startswith("batch_size_per_device"))) :]
    assert table[2].split()[:3] == ["1", "completed", "3"]
    assert table[3].split()[:3] == ["2", "completed", "3"]
    assert (
        table[4].startswith("3") and "preflight: The total batch size does not divide" in table[4]
    )
    assert table[5].startswith("largest batch_size_per_device that ran: 2")
    array_job = result.stdout.split("jobs ")[1].split("_")[0]
    # The tasks' results are written before Slurm has finished the job's epilog.
    info = local_slurm.wait(f"{array_job}_1", timeout=60)
    assert (info["JobState"], info["NumTasks"]) == ("COMPLETED", "2")
    assert (base / "batch_size_per_device=2" / "final" / "config.json").is_file()
