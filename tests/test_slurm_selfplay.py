"""`sbatch --array=0-1 slurm/selfplay.sh` against the real one-node Slurm: engine games and
positions labelled by the engine made by an array job, each task its own shards; one task
signalled as at its time limit (USR1, as `#SBATCH --signal=B:USR1@60` sends it) requeues itself
and goes on from its last shard; the last task to finish writes the manifest."""

from __future__ import annotations

import json
import time
from pathlib import Path

import chess
import pytest

from tests import local_slurm as slurm_fixture
from tests.local_slurm import LocalSlurm
from tests.test_slurm_finetune import REPO, job_env

local_slurm = slurm_fixture.local_slurm  # the session fixture, under its own name

pytestmark = pytest.mark.slow


def test_an_array_job_makes_one_data_set_and_a_requeued_task_goes_on(
    local_slurm: LocalSlurm, tmp_path: Path
) -> None:
    from fsdp_utils.chess_eval.selfplay import read_games, read_positions

    out, logs = tmp_path / "games", tmp_path / "logs"
    logs.mkdir()
    job = local_slurm.sbatch(
        "--array=0-1", "--cpus-per-task=1", "--mem=1G", f"--output={logs}/%A_%a.out",
        "slurm/selfplay.sh", "--games", "24", "--shard_games", "3", "--positions", "1",
        "--label_depth", "2", "--output", str(out),
        cwd=REPO, env=job_env(),
    )  # fmt: skip
    first = logs / f"{job}_0.out"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # task 0 wrote a shard: it is under way
        if first.is_file() and "shard " in first.read_text():
            break
        time.sleep(0.2)
    signalled = local_slurm.run(
        "scancel", "--signal=USR1", "--batch", f"{job}_0", check=False
    )  # as the time limit's warning
    for task in (0, 1):
        info = local_slurm.wait(f"{job}_{task}", timeout=240)
        text = (logs / f"{job}_{task}.out").read_text()
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
        assert f"selfplay task {task}/2" in text and "--processes 1" in text
    text = first.read_text()
    if signalled.returncode == 0:  # not finished before the signal came (it never is here)
        assert "Slurm signalled the coming time limit" in text
        assert local_slurm.job_info(f"{job}_0")["Restarts"] == "1"
        assert "are done already (a requeued task goes on): skipping them" in text
    manifest = json.loads((out / "selfplay.json").read_text())
    assert manifest["games"] == 24 and manifest["tasks"] == 2 and len(manifest["shards"]) == 8
    assert {s["task"] for s in manifest["shards"]} == {0, 1}
    assert manifest["labelled_positions"] == 24 and len(manifest["position_shards"]) == 8
    games = read_games(out)
    assert len(games) == 24
    for game in games:
        board = chess.Board()
        for uci in game["Moves"]:
            board.push_uci(uci)
        outcome = board.outcome(claim_draw=True)
        assert outcome is not None and outcome.result() == game["Result"]
    positions = read_positions(out)  # one a game, every legal move valued
    assert [p["game"] for p in positions] == list(range(24))
    for p in positions:
        board = chess.Board(p["fen"])
        assert sorted(p["legal_moves"]) == sorted(m.uci() for m in board.legal_moves)
        assert (
            p["best_move"] == p["legal_moves"][0] and max(p["move_values"]) == p["move_values"][0]
        )
