"""`sbatch slurm/finetune.sh --method grpo` on the real one-node Slurm (the tiny chess model,
CPU, 2 processes with gloo), nothing else started: the first leg reaches its time limit, saves
(inside its first step: its rollout kept) and requeues; the second resumes and completes, every
step trained once. A built-in reward (chess_legal): no file to ship."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import local_slurm as slurm_fixture
from tests.grpo_helpers import write_prompts
from tests.local_slurm import LocalSlurm, finetune_env
from tests.train_helpers import prepare_in_this_process, read_metrics

local_slurm = slurm_fixture.local_slurm  # the session fixture, under its own name

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
LEG = ("--gpus-per-node=2", "--cpus-per-task=2", "--mem=6G", "--time=3", "--signal=B:USR1@40")


def test_sbatch_grpo_survives_a_requeue(
    local_slurm: LocalSlurm, tiny_assets: dict[str, Path], tmp_path: Path
) -> None:
    prompts = write_prompts(tiny_assets["data"], tmp_path / "prompts.jsonl")
    run_dir, log = tmp_path / "run", tmp_path / "slurm.out"
    env = finetune_env(tiny_assets["model"], prompts, 4)
    # Leg 1: a 3-minute limit and a 3-minute margin: the trainer is inside its margin from its
    # start, whatever the machine's load. It samples step 1's rollout, and is asked between the
    # rollout and the update: it saves the rollout with step 0's weights, and requeues. Slurm's
    # USR1 (40 s before the end) is a second line of defence. The prompts are prepared before
    # the job (as slurm/prepare.sh or `download_models.py --prepare` would): inside the margin
    # the trainer's own preparation would stop before the first step. 4 steps: leg 2 trains
    # each once, in order (logged at every step).
    steps = 4
    args = (
        "--method", "grpo", "--reward_funcs", "chess_legal", "--num_generations", "4",
        "--max_completion_length", "4", "--max_seq_length", "64", "--eval_examples", "16",
        "--eval_every", "0", "--precision", "fp32", "--output_dir", str(run_dir),
        "--max_training_steps", str(steps), "--time_limit_margin_minutes", "3",
        "--save_every_minutes", "0", "--log_every", "1", "--log_completions_every", "0",
    )  # fmt: skip
    prepare_in_this_process(tiny_assets["model"], prompts, ("--total_batch_size", "4", *args))
    job = local_slurm.sbatch(*LEG, f"--output={log}", "slurm/finetune.sh", *args, cwd=REPO, env=env)
    local_slurm.wait_for_requeue(job, log, timeout=300, then_minutes=10)
    info = local_slurm.wait(job, timeout=580)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), text
    assert "requeueing to resume" in text
    # Leg 2 runs the same command on the same processes: the preflight of leg 1 is not repeated.
    assert text.count("preflight OK") == 1 and "preflight: passed in an earlier leg" in text
    records = read_metrics(run_dir, None)
    stops = [r for r in records if r.get("kind") == "stopping"]
    assert stops, text  # inside step 1 (its rollout kept), at the margin
    done = [r["step"] for r in records if r.get("kind") == "train"]
    assert max(done) == steps and len(set(done)) == len(done) and done == sorted(done)
    assert "reward" in next(r for r in records if r.get("kind") == "train")
    assert (run_dir / "final" / "config.json").is_file()
