"""Preparation at any size: bad rows explained, and the waiting ranks never time out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_utils.cli import main as finetune_main
from fsdp_utils.config.parse import parse_config
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.cli import main as data_main
from fsdp_utils.data.prepare import SLOW_IN_JOB_S, prepare_dataset, slow_preparation_advice
from tests.train_helpers import check_ok, run_finetune, tiny_args


def _write_rows(path: Path, count: int, *, bad_line: int | None = None) -> Path:
    lines = [json.dumps({"text": f"1.e4 e5 2.Nf3 Nc6 game {i}"}) for i in range(count)]
    if bad_line is not None:
        lines[bad_line - 1] = lines[bad_line - 1][:-7]  # a truncated write
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_malformed_json_line_names_the_file_and_line(tiny_assets, tmp_path, capsys):
    data = _write_rows(tmp_path / "rows.jsonl", 300, bad_line=123)
    config = TrainConfig(
        model=str(tiny_assets["model"]), dataset=str(data), data_cache_dir=str(tmp_path / "c"),
        max_seq_length=64, eval_examples=10,
    )  # fmt: skip
    with pytest.raises(ValueError, match=rf"{data}:123: not a valid JSON line"):
        prepare_dataset(config, log=lambda _: None)
    # The training command: one paragraph, exit 2, no traceback.
    args = tiny_args(tiny_assets, tmp_path / "run", tmp_path / "c", dataset=data)
    assert finetune_main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert f"error: {data}:123: not a valid JSON line" in err
    assert "Traceback" not in err and "DatasetGenerationError" not in err


@pytest.mark.slow
def test_preparing_longer_than_the_collective_timeout_still_trains(tiny_assets, tmp_path):
    """Rank 0 prepares while rank 1 waits: on the process group's store, not in a collective
    that --collective_timeout_minutes would end (gloo's timeout traceback, then torchrun's).
    The rows' function takes longer than the timeout whatever the machine's speed."""
    module = tmp_path / "slow_rows.py"
    module.write_text(
        "import time\n\n\ndef rows():\n"
        "    time.sleep(8)  # longer than the 6 s collective timeout below\n"
        "    return [{'text': f'1.e4 e5 2.Nf3 Nc6 3.Bb5 a6 game {i}'} for i in range(200)]\n"
    )
    args = tiny_args(
        tiny_assets, tmp_path / "run", tmp_path / "cache", dataset=None,
        dataset_module=f"{module}:rows", collective_timeout_minutes=0.1, max_training_steps=2,
        eval_examples=10,
    )  # fmt: skip
    result = run_finetune(2, [str(a) for a in args])
    check_ok(result)
    assert "data: preparing" in result.stdout + result.stderr
    assert "done in" in result.stdout
    assert "Timed out" not in result.stderr and "Traceback" not in result.stderr


def test_a_slow_preparation_in_the_job_says_how_to_prepare_before_it():
    assert slow_preparation_advice(SLOW_IN_JOB_S - 1, 8) is None
    advice = slow_preparation_advice(600, 8)
    assert advice is not None and "10.0 min inside the job while 7 other process(es)" in advice
    assert "download_models.py --config" in advice and "--prepare" in advice
    assert "sbatch slurm/prepare.sh" in advice


def test_the_data_command_prepares_what_the_training_run_finds(tiny_assets, tmp_path, capsys):
    """`python -m fsdp_utils.data` (slurm/prepare.sh's command): the same key as training."""
    cache = tmp_path / "cache"
    options = ["--model", str(tiny_assets["model"]), "--dataset", str(tiny_assets["data"])]
    options += ["--dataset_include", "", "--data_cache_dir", str(cache), "--max_seq_length", "64"]
    assert data_main([*options, "--num_proc", "1"]) == 0
    assert "prepared in" in capsys.readouterr().out
    config, _ = parse_config(options)
    lines: list[str] = []
    prepare_dataset(config, log=lines.append)
    assert any(line.startswith("data: using prepared data") for line in lines), lines
    assert data_main([*options, "--max_seq_length", "0"]) == 2
    assert "error: " in capsys.readouterr().err
