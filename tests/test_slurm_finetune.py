"""`sbatch slurm/finetune.sh` against the real one-node Slurm, with the tiny model on CPU.

The job asks for 2 of the node's emulated GPUs, so the script sees SLURM_GPUS_ON_NODE=2 and
CUDA_VISIBLE_DEVICES=0,1 exactly as on a GPU node and starts 2 processes, which train on CPU
with gloo (torch finds no CUDA). The completed job of `test_sbatch_finetune_completes` is the
session's `finetune_job` (tests/slurm_jobs.py), submitted from a newcomer's shell: the replay
nvidia-smi of slurm/local/bin is on PATH, so the preflight plans and the per-node GPU sampler
records; tests/test_slurm_gpu_report_local.py reports the same job. Elsewhere tests/fake_bin is
first on PATH.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests import local_slurm as slurm_fixture
from tests import slurm_jobs
from tests.local_slurm import LocalSlurm
from tests.slurm_jobs import RESOURCES, TINY_RUN, FinishedJob

local_slurm = slurm_fixture.local_slurm  # the session fixture, under its own name
finetune_job = slurm_jobs.finetune_job  # the session's completed job, read by two modules

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
FAKE_BIN = Path(__file__).parent / "fake_bin"


def job_env(**overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{FAKE_BIN}{os.pathsep}{env['PATH']}"
    env["SETUP"] = f"source {REPO / '.venv' / 'bin' / 'activate'}"
    env.update(overrides)
    return env


def submit(
    slurm: LocalSlurm,
    log: Path,
    env: dict[str, str],
    *train_args: str,
    sbatch: tuple[str, ...] = RESOURCES,
) -> str:
    return slurm.sbatch(
        *sbatch, f"--output={log}", "slurm/finetune.sh", *train_args, cwd=REPO, env=env
    )


def read_metrics(run_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sbatch_finetune_completes(
    local_slurm: LocalSlurm, tiny_assets: dict[str, Path], finetune_job: FinishedJob
) -> None:
    """Env overrides (model, data, batch, output) and pass-through arguments reach the trainer;
    the log shows the derived accumulation; the run folder holds everything."""
    job, info, log = finetune_job.job, finetune_job.info, finetune_job.log
    run_dir = finetune_job.run_dir
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "1 node(s) x 2 process(es) (one per GPU, SLURM_GPUS_ON_NODE=2)" in text
    assert "total batch 8 sequences = 2 per device x 2 devices x 2 accumulation steps" in text
    # The preflight read the GPUs' memory from (the replay of) nvidia-smi and planned the run.
    assert "memory plan: FITS: needs 2.0 of 140.4 GiB" in text
    steps = [m["step"] for m in read_metrics(run_dir) if m.get("kind") == "train"]
    assert steps and max(steps) == 4  # type: ignore[type-var]
    config = json.loads((run_dir / "config.json").read_text())
    assert json.dumps(config).count(str(tiny_assets["model"])) >= 1
    assert (run_dir / "final" / "config.json").is_file()
    assert (run_dir / "logs" / log.name).resolve() == log.resolve()
    # One sampler per node ran inside the job and was stopped cleanly at the end.
    samples = (run_dir / "gpu_samples" / f"{local_slurm.node_name}.csv").read_text().splitlines()
    assert len(samples) > 1 and samples[1].split(",")[2] == job
    assert "CANCELLED" not in text  # the sampler step ended cleanly, not cancelled


def test_sbatch_prepare_uses_the_allocations_cores_and_the_training_run_finds_its_data(
    local_slurm: LocalSlurm, tiny_assets: dict[str, Path], tmp_path: Path
) -> None:
    """slurm/prepare.sh: the data prepared on a CPU allocation (no GPUs asked for), offline,
    with one process per allocated core, into the cache a run with the same options reads."""
    log, cache = tmp_path / "prepare.out", tmp_path / "prepared"
    env = job_env(MODEL=str(tiny_assets["model"]), DATASET=str(tiny_assets["data"]))
    options = ("--dataset_include", "", "--max_seq_length", "128", "--data_cache_dir", str(cache))
    job = local_slurm.sbatch(
        "--cpus-per-task=2", "--mem=2G", "--time=10", f"--output={log}", "slurm/prepare.sh",
        *options, cwd=REPO, env=env,
    )  # fmt: skip
    info = local_slurm.wait(job, timeout=180)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "-m fsdp_utils.data" in text and "--num_proc 2" in text
    assert "prepared in" in text
    from fsdp_utils.config.parse import parse_config
    from fsdp_utils.data.prepare import prepare_dataset

    config, _ = parse_config(
        ["--model", str(tiny_assets["model"]), "--dataset", str(tiny_assets["data"]), *options]
    )
    lines: list[str] = []
    prepare_dataset(config, log=lines.append)
    assert any(line.startswith("data: using prepared data") for line in lines), lines


def test_non_dividing_batch_fails_in_preflight(
    local_slurm: LocalSlurm, tiny_assets: dict[str, Path], tmp_path: Path
) -> None:
    """7 sequences cannot be split over 2 processes: the job ends within seconds, before any
    training process starts, and the log says what to change."""
    run_dir, log = tmp_path / "run", tmp_path / "slurm.out"
    env = job_env(OUTPUT_DIR=str(run_dir), TOTAL_BATCH_SIZE="7", GPU_SAMPLE_INTERVAL="0")
    started = time.monotonic()
    job = submit(
        local_slurm, log, env,
        "--model", str(tiny_assets["model"]), "--dataset", str(tiny_assets["data"]), *TINY_RUN,
    )  # fmt: skip
    info = local_slurm.wait(job, timeout=120)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), text
    assert "The total batch size does not divide: total_batch_size=7" in text
    assert "--total_batch_size 8 (= 1 x 2 x 4 accumulation)" in text
    assert "preflight failed: nothing was started" in text
    assert not (run_dir / "metrics.jsonl").exists()
    run_time = info["RunTime"].split(":")
    assert int(run_time[-2]) * 60 + int(run_time[-1]) < 20, info["RunTime"]
    assert time.monotonic() - started < 60


def test_run_that_does_not_fit_fails_in_preflight(
    local_slurm: LocalSlurm, tiny_assets: dict[str, Path], tmp_path: Path
) -> None:
    """The tiny model on 2 GPUs of 1 GiB (it needs 2.0 GiB, the CUDA context's share included):
    the preflight's memory plan says it does not fit, before any training process starts. (A
    7B model's plan says the same after a minute of tracing at load; the planner's own tests
    plan those.)"""
    run_dir, log = tmp_path / "run", tmp_path / "slurm.out"
    env = job_env(OUTPUT_DIR=str(run_dir), GPU_MEMORY="1GiB", GPU_SAMPLE_INTERVAL="0")
    job = submit(
        local_slurm, log, env, "--model", str(tiny_assets["model"]), "--dataset",
        str(tiny_assets["data"]), "--dataset_include", "",
    )  # fmt: skip
    info = local_slurm.wait(job, timeout=180)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), text
    assert "The run does not fit in GPU memory" in text
    assert "DOES NOT FIT: needs" in text and "the GPU has 1.0 GiB" in text
    assert "python chess_finetune.py --plan --nodes 1 --gpus_per_node 2" in text
    assert not (run_dir / "metrics.jsonl").exists()


def test_time_limit_requeue_resumes_its_own_leg_and_ends_without_a_wasted_leg(
    local_slurm: LocalSlurm,
    tiny_assets: dict[str, Path],
    finetune_job: FinishedJob,
    tmp_path: Path,
) -> None:
    """One job, several checks. Leg 1 (3-minute limit, a 3-minute margin): the trainer reads the
    job's end time and is inside its margin from its start, whatever the machine's load; a run
    that starts there goes on to its first step and saves it, then stops with too much left to
    finish (nothing fits before a margin already passed): every rank saves, the script
    requeues. Leg 2 (the test raises the limit to 10 min) resumes its own checkpoint although
    the command says `--resume never`; then Slurm's signal (sent by the test as
    `--signal=B:USR1@...` would) arrives with little work left: the run finishes in this leg
    instead of requeueing one more. Also: `--resume never` set the abandoned run in the folder
    aside; the stop file and run folder come from a --config file; the GPU sampler, which ends
    at once without nvidia-smi, is stopped without noise."""
    run_dir, log, halt = tmp_path / "run", tmp_path / "slurm.out", tmp_path / "HALT"
    # Leg 1 trains exactly one step. Its data must be prepared already: inside the margin, the
    # data preparation would stop too (before the first step). `finetune_job` prepared it (the
    # same data options; the cache is keyed by them, in the session's HF_HOME). Leg 2 trains
    # the rest: the test's signal comes after its first step, and the steps left after that
    # (~0.1 s each on a quiet machine, ~0.5 s at load 10) must outlast the signal's way (the
    # test's poll, scancel, slurmctld, slurmd, the script's trap: well under a second; the stop
    # came one step after the signal at load 10), else the run would complete before it.
    # Slurm's own USR1 comes at 2:20, long after leg 1 ended.
    steps = 40
    abandoned = run_dir / "checkpoints" / "step_00005000"  # a higher step than this run reaches
    abandoned.mkdir(parents=True)
    (abandoned / "checkpoint.json").write_text(json.dumps({"step": 5000, "files": {}}))
    config = tmp_path / "run.yaml"
    config.write_text(f"output_dir: {run_dir}\nstop_file: {halt}\n")
    env = job_env(
        MODEL=str(tiny_assets["model"]),
        DATASET=str(tiny_assets["data"]),
        TOTAL_BATCH_SIZE="8",
        GPU_SAMPLE_INTERVAL="1",
        PATH=os.environ["PATH"],  # no nvidia-smi: the sampler says so and ends at once
    )
    sbatch = (*RESOURCES[:-1], "--time=3", "--signal=B:USR1@40")
    job = submit(
        local_slurm, log, env, *TINY_RUN, "--config", str(config), "--resume", "never",
        "--max_training_steps", str(steps), "--time_limit_margin_minutes", "3",
        "--save_every_minutes", "0",
        sbatch=sbatch,
    )  # fmt: skip
    local_slurm.wait_for_requeue(job, log, timeout=240, then_minutes=10)

    def resumed_and_stepping() -> bool:
        records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        resumed = [r["step"] for r in records if r.get("kind") == "resumed"]
        trained = [r["step"] for r in records if r.get("kind") == "train"]
        return bool(resumed) and max(trained) >= resumed[-1] + 1  # type: ignore[operator]

    deadline = time.monotonic() + 240  # the hold, then leg 2's start (a minute at load 10)
    while not resumed_and_stepping():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    local_slurm.run("scancel", "--batch", "--signal=USR1", job)
    info = local_slurm.wait(job, timeout=240)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), text
    # Leg 1: too much left to finish before the margin: saved and requeued.
    assert "not finishing in this job: the remaining work" in text
    assert "requeueing to resume" in text and f"job {job} (restart 1)" in text
    # Leg 2: its own checkpoint, not `--resume never` again; then the signal, and the end.
    assert f"requeued leg (job {job}, restart 1): resuming this job's newest checkpoint" in text
    assert "not --resume never again" in text
    # The preflight ran once, in leg 1: leg 2 (the same command, processes and GPUs) skips it.
    assert text.count("preflight OK") == 1
    assert f"preflight: passed in an earlier leg of job {job} (2 process(es) on 1 node(s)" in text
    assert "Slurm signalled the coming time limit" in text
    assert "finishing in this job instead of requeueing (stop at step" in text
    assert "stop file): the remaining work" in text and "fits in the" in text
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["step"]) == ("completed", steps)
    assert (run_dir / "final" / "config.json").is_file() and not halt.exists()
    done = [m["step"] for m in read_metrics(run_dir) if m.get("kind") == "train"]
    assert done.count(1) == 1, "the second leg started again from step 1"
    assert max(done) == steps and len(set(done)) == len(done)
    # The abandoned run's checkpoint was set aside, never resumed nor kept among the new ones.
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] != []
    assert not (run_dir / "checkpoints" / abandoned.name).exists()
    assert list(run_dir.glob(f"previous-*/checkpoints/{abandoned.name}"))
    assert "gpu sampler: nvidia-smi not found" in text and "No such process" not in text
