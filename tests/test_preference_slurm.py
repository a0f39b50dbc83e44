"""`sbatch slurm/finetune.sh --method dpo` on the real one-node Slurm (tiny chat model, CPU,
2 processes with gloo), three legs whose ends the test chooses, whatever the machine's load:

1. Slurm's time-limit signal (sent by the test, as `--signal=B:USR1@...` sends it) comes while
   the job is starting: the script does not start the trainer (importing and setting up would
   spend what is left of the job, and a leg that Slurm's TIMEOUT ends is never requeued), and
   requeues; or, if the signal reached the script only after it started the trainer, the trainer
   stops before its first step. Either way: no step, requeued (issue 47's defect: such a leg
   stayed in its start until TIMEOUT).
2. The reference pass, then `--stop_after_steps` ends the leg after its budget of steps: saved,
   requeued.
3. It resumes that checkpoint, reuses the reference cache, and completes.

A stop during the reference pass, before its first pair, and at the start are checked on 2
processes without Slurm in tests/test_preference.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fsdp_utils.synthetic import preference_pairs, save_chat_model
from tests import local_slurm as slurm_fixture
from tests.chat_helpers import write_jsonl
from tests.local_slurm import LocalSlurm, finetune_env

local_slurm = slurm_fixture.local_slurm  # the session fixture, under its own name

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def test_sbatch_dpo_survives_a_requeue(local_slurm: LocalSlurm, tmp_path: Path) -> None:
    model = save_chat_model(tmp_path / "model", "chatml")
    # 64 pairs: 16 to evaluate, 48 to train on, of which the 4 steps of 8 read 32 (no epoch
    # ends). Legs 2 and 3 end where the test chose (--stop_after_steps, then the last step),
    # whatever the machine's load: a few steps each show what they show as well as many.
    data = write_jsonl(tmp_path / "prefs.jsonl", preference_pairs(64))
    run_dir, log = tmp_path / "run", tmp_path / "slurm.out"
    env = finetune_env(model, data, 8)
    steps, budget = 4, 2  # legs 2 and 3: 2 steps each
    job = local_slurm.sbatch(
        "--gpus-per-node=2", "--cpus-per-task=2", "--mem=6G", "--time=10",
        f"--output={log}", "slurm/finetune.sh",
        "--method", "dpo", "--dataset_include", "", "--max_seq_length", "64",
        "--eval_examples", "16", "--eval_every", "0", "--precision", "fp32",
        "--output_dir", str(run_dir), "--max_training_steps", str(steps),
        "--stop_after_steps", str(budget), "--save_every_minutes", "0",
        cwd=REPO, env=env,
    )  # fmt: skip
    # Leg 1: the signal once the script is past its trap (its first line names the job), while
    # the preflight runs: bash runs the trap when the preflight ends.
    deadline = time.monotonic() + 120
    while not (log.exists() and f"job {job} (restart 0) on" in log.read_text()):
        assert time.monotonic() < deadline, local_slurm.job_info(job)
        time.sleep(0.1)
    local_slurm.run("scancel", "--batch", "--signal=USR1", job)
    info = local_slurm.wait(job, timeout=480)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "2"), text
    leg1, leg2, leg3 = text.split(f"job {job} (restart ")[1:]
    assert "Slurm signalled the coming time limit" in leg1
    assert (
        "the time limit is near and the trainer has not started: not starting it" in leg1
        or "stopping before the first step: stop file during the start" in leg1
    ), leg1
    assert "requeueing to resume" in leg1 and "dpo: computing" not in leg1
    # The preflight passed in leg 1; legs 2 and 3 run the same command and skip it.
    assert "preflight OK" in leg1
    for leg in (leg2, leg3):
        assert "preflight OK" not in leg and "preflight: passed in an earlier leg" in leg, leg
    assert "dpo: computing the reference log-probabilities" in leg2
    assert "stop_after_steps" in leg2 and "requeueing to resume" in leg2
    assert "dpo: reference log-probabilities from" in leg3  # leg 3 reuses the whole cache
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    done = [r["step"] for r in records if r.get("kind") == "train"]
    assert done.count(1) == 1 and max(done) == steps and len(set(done)) == len(done)
    assert [r["step"] for r in records if r.get("kind") == "resumed"] == [budget]
    assert "rewards/accuracies" in next(r for r in records if r.get("kind") == "train")
    assert (run_dir / "final" / "config.json").is_file()
