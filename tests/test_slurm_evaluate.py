"""`sbatch slurm/evaluate.sh` against the real one-node Slurm: lm-eval's benchmarks on a tiny
model sharded over the job's 2 emulated GPUs (2 CPU processes with gloo), reading the task data
from the offline cache, as on a compute node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import local_slurm as slurm_fixture
from tests.lm_eval_data import cache_task_data
from tests.local_slurm import LocalSlurm
from tests.test_slurm_finetune import REPO, RESOURCES, job_env
from tests.test_slurm_launch import assert_offline_before_python, run_launch

local_slurm = slurm_fixture.local_slurm  # the session fixture, under its own name

EVALUATE_SH = REPO / "slurm" / "evaluate.sh"


def test_evaluate_sh_exports_offline_mode_before_python() -> None:
    assert_offline_before_python(EVALUATE_SH)


def test_launch_nodes_plans_the_processes_without_a_run_folder() -> None:
    """evaluate.sh's plan: finetune.sh's processes and rendezvous, no run folder nor stop file."""
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "vm", "SLURM_GPUS_ON_NODE": "2",
           "SLURM_CPUS_PER_TASK": "8"}  # fmt: skip
    plan = run_launch("nodes", env=env)
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.splitlines() == [
        "NNODES=1", "NPROC_PER_NODE=2", "WORLD_SIZE=2", "RDZV_ENDPOINT=127.0.0.1:20077",
        "RDZV_ID=77", "export OMP_NUM_THREADS=4",
    ]  # fmt: skip
    assert "run folder" not in plan.stderr and "world size 2" in plan.stderr


@pytest.mark.slow
def test_sbatch_evaluate_scores_a_model_on_two_processes(
    local_slurm: LocalSlurm, tmp_path: Path
) -> None:
    """Environment overrides and pass-through arguments reach the command; one process per
    (emulated) GPU; lm-eval's table in the job's log and its results in OUTPUT_DIR."""
    from fsdp_utils.synthetic import save_chat_model

    model = save_chat_model(tmp_path / "model", "llama3")
    cache, out, log = tmp_path / "hub", tmp_path / "results", tmp_path / "slurm.out"
    cache_task_data(cache, ["arc_easy"])
    env = job_env(MODEL=str(model), TASKS="arc_easy", LIMIT="3", OUTPUT_DIR=str(out))
    job = local_slurm.sbatch(
        *RESOURCES, f"--output={log}", "slurm/evaluate.sh", "--cache_dir", str(cache),
        "--batch_size", "2", cwd=REPO, env=env,
    )  # fmt: skip
    info = local_slurm.wait(job, timeout=240)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "1 node(s) x 2 process(es) (one per GPU, SLURM_GPUS_ON_NODE=2)" in text
    assert f"-m fsdp_utils.evaluate --model {model} --tasks arc_easy --limit 3" in text
    assert "FSDP2 over 2 process(es) on cpu" in text
    assert "|arc_easy|" in text  # lm-eval's table
    (results_file,) = out.glob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["fsdp_utils"]["model"]["world_size"] == 2
    assert results["n-samples"]["arc_easy"]["effective"] == 3
    assert 0.0 <= results["results"]["arc_easy"]["acc,none"] <= 1.0
