"""`slurm/submit.py --local`: the submitit path on this machine (its local executor, one task
per process), interrupted and requeued. No Slurm cluster: a module apart from
tests/test_slurm_submitit.py, whose tests share the one-node Slurm's worker (tests/conftest.py),
so that this one runs on the other worker, beside them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_slurm_submitit import REPO, TINY_RUN


def submitit_task_pids(log_dir: Path) -> list[int]:
    """The submitit task processes (one per rank) serving jobs logged in `log_dir`."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"submitit.core._submit" in args and str(log_dir).encode() in args:
            pids.append(int(cmdline.parent.name))
    return pids


@pytest.mark.slow
def test_submitit_preemption_checkpoints_every_rank(
    tiny_assets: dict[str, Path], tmp_path: Path
) -> None:
    """The submitit path on this machine (local executor, one task per process), interrupted:
    the time-limit / preemption signal (USR2, which Slurm and submitit's local executor send to
    every task) makes submitit call checkpoint() on rank 0 only; the stop file makes both ranks
    save their shards, and the requeued job resumes from them (not from scratch, although the
    command says `--resume never`) and completes."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    command = [
        sys.executable, "slurm/submit.py", "--local", "--gpus-per-node", "2", "--time", "10",
        "--log-dir", str(logs),
        "--", "--model", str(tiny_assets["model"]), "--dataset", str(tiny_assets["data"]),
        *TINY_RUN[:4], "--max_training_steps", "40", *TINY_RUN[6:],
        "--save_every_minutes", "0", "--output_dir", str(run_dir), "--resume", "never",
    ]  # fmt: skip
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True) as submit:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and '"kind": "train"' in metrics.read_text()):
            assert time.monotonic() < deadline and submit.poll() is None, "training never started"
            time.sleep(0.2)
        tasks = submitit_task_pids(logs)
        assert len(tasks) == 2
        for pid in tasks:
            os.kill(pid, signal.SIGUSR2)
        output, _ = submit.communicate(timeout=240)
    assert submit.returncode == 0, output
    assert "preflight OK: total batch 8 sequences = 1 per device x 2 devices" in output
    assert sorted(p.name.split("_")[1] for p in logs.glob("*_log.out")) == ["0", "1"]
    rank0 = next(logs.glob("*_0_log.out")).read_text()
    assert "asking all ranks to save" in rank0 and "Requeued job" in rank0
    # The requeued leg resumed its own checkpoint instead of replaying `--resume never`.
    assert "rank 0/2 (leg 1)" in rank0 and "not --resume never again" in rank0
    assert not list(run_dir.glob("previous-*"))
    # The checkpoint saved on the signal (before step 40) holds a shard from each rank.
    saved = {
        json.loads((folder / "checkpoint.json").read_text())["step"]: folder
        for folder in (run_dir / "checkpoints").iterdir()
        if (folder / "checkpoint.json").exists()
    }
    interrupted = saved[min(saved)]
    assert min(saved) < 40
    assert {p.name for p in interrupted.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["step"]) == ("completed", 40)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train_steps = [m["step"] for m in records if m["kind"] == "train"]
    assert train_steps.count(1) == 1 and len(set(train_steps)) == len(train_steps)
