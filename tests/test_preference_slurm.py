"""`sbatch slurm/finetune.sh --method dpo` on the real one-node Slurm (tiny chat model, CPU,
2 processes with gloo): the first leg reaches its time limit, saves and requeues; the second
resumes its checkpoint, reuses the reference cache, and completes. On a loaded machine the
time limit can come while the first leg still computes the reference log-probabilities: it then
keeps the pairs done and requeues before its first step, and the second leg computes the rest
(tests/test_preference.py checks that path at a chosen batch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_utils.synthetic import preference_pairs, save_chat_model
from tests import local_slurm as slurm_fixture
from tests.chat_helpers import write_jsonl
from tests.local_slurm import ONE_MINUTE_LEG, LocalSlurm, finetune_env

local_slurm = slurm_fixture.local_slurm  # the session fixture, under its own name

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def test_sbatch_dpo_survives_a_requeue(local_slurm: LocalSlurm, tmp_path: Path) -> None:
    model = save_chat_model(tmp_path / "model", "chatml")
    data = write_jsonl(tmp_path / "prefs.jsonl", preference_pairs(300))
    run_dir, log = tmp_path / "run", tmp_path / "slurm.out"
    env = finetune_env(model, data, 8)
    # Leg 1: a 1-minute limit and a 45 s margin leave too little for 400 steps: save, requeue
    steps = 400
    job = local_slurm.sbatch(
        *ONE_MINUTE_LEG, f"--output={log}", "slurm/finetune.sh",
        "--method", "dpo", "--dataset_include", "", "--max_seq_length", "64",
        "--eval_examples", "16", "--eval_every", "0", "--precision", "fp32",
        "--output_dir", str(run_dir), "--max_training_steps", str(steps),
        "--time_limit_margin_minutes", "0.75", "--save_every_minutes", "0",
        cwd=REPO, env=env,
    )  # fmt: skip
    # Leg 2 may have all of it to do (the first may stop before its first step): on a loaded
    # machine (load 12 on 2 cores) 5 minutes were not enough for the reference pass and 400 steps
    local_slurm.wait_for_requeue(job, log, then_minutes=10)
    info = local_slurm.wait(job, timeout=580)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), text
    assert "requeueing to resume" in text
    # Leg 1 stopped after steps and a checkpoint, or before its first step (what it finished
    # kept); which of the two depends on the machine's load, and both must requeue and finish.
    early = "stopping before the first step" in text
    assert "dpo: computing the reference log-probabilities" in text  # leg 1, or leg 2
    if not early:  # leg 2 reuses the whole cache
        assert "dpo: reference log-probabilities from" in text
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    done = [r["step"] for r in records if r.get("kind") == "train"]
    assert done.count(1) == 1 and max(done) == steps and len(set(done)) == len(done)
    assert early or any(r.get("kind") == "resumed" for r in records)
    assert "rewards/accuracies" in next(r for r in records if r.get("kind") == "train")
    assert (run_dir / "final" / "config.json").is_file()
