"""`sbatch slurm/finetune.sh` against the real one-node Slurm, with the tiny model on CPU.

The job asks for 2 of the node's emulated GPUs, so the script sees SLURM_GPUS_ON_NODE=2 and
CUDA_VISIBLE_DEVICES=0,1 exactly as on a GPU node and starts 2 processes, which train on CPU
with gloo (torch finds no CUDA). tests/fake_bin is first on PATH so the per-node GPU sampler
has an nvidia-smi to record.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests import local_slurm as slurm_fixture
from tests.local_slurm import LocalSlurm

local_slurm = slurm_fixture.local_slurm  # the session fixture, under its own name

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
FAKE_BIN = Path(__file__).parent / "fake_bin"
# Two emulated GPUs, the node's two CPUs, a little memory: the job fits the 2-core test machine.
RESOURCES = ("--gpus-per-node=2", "--cpus-per-task=2", "--mem=6G", "--time=10")
TINY_RUN = (
    "--dataset_include", "",
    "--max_seq_length", "128",
    "--eval_examples", "16",
    "--eval_every", "0",
    "--precision", "fp32",
)  # fmt: skip


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
    local_slurm: LocalSlurm, tiny_assets: dict[str, Path], tmp_path: Path
) -> None:
    """Env overrides (model, data, batch, output) and pass-through arguments reach the trainer;
    the log shows the derived accumulation; the run folder holds everything."""
    run_dir, log = tmp_path / "run", tmp_path / "slurm.out"
    env = job_env(
        MODEL=str(tiny_assets["model"]),
        DATASET=str(tiny_assets["data"]),
        OUTPUT_DIR=str(run_dir),
        TOTAL_BATCH_SIZE="8",
        BATCH_SIZE_PER_DEVICE="2",
        GPU_SAMPLE_INTERVAL="1",
    )
    job = submit(local_slurm, log, env, *TINY_RUN, "--max_training_steps", "4")
    info = local_slurm.wait(job, timeout=240)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "1 node(s) x 2 process(es) (one per GPU, SLURM_GPUS_ON_NODE=2)" in text
    assert "total batch 8 sequences = 2 per device x 2 devices x 2 accumulation steps" in text
    # The preflight read the GPUs' memory from (the stand-in) nvidia-smi and planned the run.
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
    """CodeLlama-7B (its config.json only) on 2 GPUs of 20 GiB: the preflight's memory plan says
    it does not fit, before any training process starts."""
    run_dir, log = tmp_path / "run", tmp_path / "slurm.out"
    env = job_env(OUTPUT_DIR=str(run_dir), GPU_MEMORY="20GiB", GPU_SAMPLE_INTERVAL="0")
    model = REPO / "tests" / "fixtures" / "configs" / "codellama-7b"
    job = submit(
        local_slurm, log, env, "--model", str(model), "--dataset", str(tiny_assets["data"]),
        "--dataset_include", "",
    )  # fmt: skip
    info = local_slurm.wait(job, timeout=180)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), text
    assert "The run does not fit in GPU memory" in text
    assert "DOES NOT FIT: needs" in text and "the GPU has 20.0 GiB" in text
    assert "python chess_finetune.py --plan --nodes 1 --gpus_per_node 2" in text
    assert not (run_dir / "metrics.jsonl").exists()


def test_time_limit_requeue_resumes_its_own_leg_and_ends_without_a_wasted_leg(
    local_slurm: LocalSlurm, tiny_assets: dict[str, Path], tmp_path: Path
) -> None:
    """One job, several checks. Leg 1 (3-minute limit): the trainer stops 2.75 min before the
    end (it reads the end time; USR1 at 40 s before is the second line of defence) with too much
    left to finish, every rank saves, the script requeues. Leg 2 (the test raises the limit to
    10 min) resumes its own checkpoint although the command says `--resume never`; then Slurm's
    signal (sent by the test as `--signal=B:USR1@...` would) arrives with little work left: the
    run finishes in this leg instead of requeueing one more. Also: `--resume never` set the
    abandoned run in the folder aside; the stop file and run folder come from a --config file;
    the GPU sampler, which ends at once without nvidia-smi, is stopped without noise."""
    run_dir, log, halt = tmp_path / "run", tmp_path / "slurm.out", tmp_path / "HALT"
    # Leg 1 has 15 s between the job's start and the margin; on a quiet machine the start takes
    # about 10 s and a step 0.08 s, so 60 steps could end in it and nothing would be requeued.
    # 150 (~12 s) cannot, and what is left fits easily in leg 2's 10 minutes. On a loaded
    # machine the trainer starts after the margin, and stops after its first step. Slurm's USR1
    # comes 2 minutes later: early enough, it would find the trainer not started yet, and the
    # leg would end before its first step (slurm/finetune.sh; tests/test_preference_slurm.py).
    steps = 150
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
        "--max_training_steps", str(steps), "--time_limit_margin_minutes", "2.75",
        "--save_every_minutes", "0",
        sbatch=sbatch,
    )  # fmt: skip
    local_slurm.wait_for_requeue(job, log, timeout=240, then_minutes=10)

    def resumed_and_stepping() -> bool:
        records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        resumed = [r["step"] for r in records if r.get("kind") == "resumed"]
        trained = [r["step"] for r in records if r.get("kind") == "train"]
        return bool(resumed) and max(trained) >= resumed[-1] + 2  # type: ignore[operator]

    deadline = time.monotonic() + 120
    while not resumed_and_stepping():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
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
