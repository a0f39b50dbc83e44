"""The chess evaluation during real training: torchrun, 2 CPU processes, FSDP2.

One short training run (module fixture) serves every test: it evaluates at steps 50 and 100
under FSDP (with the engine judge at a shallow depth and two ladder games per rung), then the
standalone command evaluates its final/ folder on one process and on two under torchrun, and
the untrained model the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_utils.chess_eval.cli import main as chess_eval_main
from tests.train_helpers import check_ok, read_metrics, run_finetune, run_script, tiny_args

pytestmark = pytest.mark.slow

STEPS, EVERY = 100, 50
# What training must add to the untrained model's legal-move rate. A tiny 2-layer model
# trained for 100 steps on 380 random games reaches ~45-55% (mostly legal first moves);
# the untrained one writes move-shaped tokens that are almost never legal (~0%).
MARGIN = 0.25
EVAL_OPTIONS = {
    "chess_eval_games": 16, "chess_eval_plies": 10, "eval_examples": 20,
    # The engine judge (Stockfish, installed by `make setup-system`): shallow, and the two
    # deterministic rungs, so that every process count plays the same games, unmasked and
    # masked (the model's most likely legal move).
    "chess_eval_engine": "on", "chess_eval_depth": 5, "chess_eval_ladder": "random,depth:1",
    "chess_eval_ladder_games": 2, "chess_eval_masking": "both",
}  # fmt: skip
RECORDS = ("moves.jsonl", "games.jsonl", "games.pgn")


@pytest.fixture(scope="module")
def trained_run(tiny_assets, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("chess_run")
    args = tiny_args(
        tiny_assets, out / "run", out / "cache",
        max_seq_length=256, total_batch_size=16, batch_size_per_device=4,
        max_training_steps=STEPS, warmup_steps=3, chess_eval_every=EVERY,
        document_masking=True, log_every=EVERY, **EVAL_OPTIONS,
    )  # fmt: skip
    result = run_finetune(2, args, timeout=400)
    check_ok(result)
    assert f"chess eval step {STEPS}" in result.stdout and "legal-move rate" in result.stdout
    return out / "run"


def _standalone(model: Path, run: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    assert chess_eval_main([str(model), "--config", str(run / "config.json"), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_training_beats_the_untrained_models_legal_move_rate(trained_run, tiny_assets, capsys):
    records = read_metrics(trained_run, "chess_eval")
    assert [r["step"] for r in records] == [EVERY, STEPS]
    untrained = _standalone(tiny_assets["model"], trained_run, capsys)
    trained = records[-1]
    assert trained["continuations"] == untrained["continuations"] == 3 * 16
    assert trained["legal_move_rate"] >= untrained["legal_move_rate"] + MARGIN, (
        untrained["legal_move_rate"],
        trained["legal_move_rate"],
    )


def test_same_numbers_on_1_and_2_processes(trained_run, capsys):
    """The 2-process FSDP evaluation at the last step and one plain process on final/ (found
    through the run's config.json beside it) count exactly the same moves, and the engine
    judges them into the same per-move records and the same games, unmasked and masked, byte
    for byte."""
    fsdp = read_metrics(trained_run, "chess_eval")[-1]
    single = _standalone(trained_run / "final", trained_run, capsys)
    # Every field but the timings, the log record's own (kind, message, step, time) and the
    # command's (model, config_source, examples, written): the same keys, the same values.
    skip = {"kind", "message", "step", "time", "seconds", "engine_seconds"}
    counted = {k: v for k, v in fsdp.items() if k not in skip}
    judged = {
        k: v for k, v in single.items()
        if k not in skip | {"model", "config_source", "examples", "written"}
    }  # fmt: skip
    assert judged == counted
    assert counted["moves_judged"] > 0 and "legal_move_rate" in counted
    assert counted["engine_moves"] > 0 and counted["engine_error"] is None
    assert single["config_source"].endswith("config.json")
    during, after = (
        trained_run / "chess_eval" / f"step_{STEPS:06d}",
        trained_run / "chess_eval" / "final",
    )
    for name in RECORDS:
        assert (during / name).read_bytes() == (after / name).read_bytes(), name
    assert (during / "games.pgn").read_text().count("[Event ") == 8
    assert counted["ladder_masked_depth1_games"] == 2 and counted["ladder_masked_moves_judged"] > 0
    assert counted["ladder_masked_random_illegal_losses"] == 0


def test_the_command_under_torchrun_shards_the_model_and_the_engine_work(trained_run, tmp_path):
    """`torchrun --nproc_per_node 2 -m fsdp_utils.chess_eval final/`, each process with its own
    engine: the same records as the training run's own evaluation of its last step. (Its two
    processes are forked as torchrun's workers, tests/prefork.py: the launcher is not the point.)"""
    out = tmp_path / "two"
    args = ["fsdp_utils.chess_eval", str(trained_run / "final"), "--output_dir", str(out)]
    result = run_script(2, "-m", args, timeout=300)
    check_ok(result)
    assert "centipawn loss" in result.stdout and "records:" in result.stdout
    during = trained_run / "chess_eval" / f"step_{STEPS:06d}"
    for name in RECORDS:
        assert (out / name).read_bytes() == (during / name).read_bytes(), name


def test_the_trainer_refuses_a_dataset_without_games(tiny_assets, tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"line {i} " * 20}) + "\n" for i in range(400)))
    args = tiny_args(tiny_assets, tmp_path / "run", tmp_path / "cache", chess_eval_every=2)
    args[args.index("--dataset") + 1] = str(text)
    result = run_finetune(1, args, timeout=120)
    assert result.returncode == 2
    assert "needs chess games" in result.stderr and "Traceback" not in result.stderr
