"""Preparation at any size: bad rows explained, and the waiting ranks never time out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_utils.cli import main as finetune_main
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.prepare import prepare_dataset
from tests.train_helpers import tiny_args


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
