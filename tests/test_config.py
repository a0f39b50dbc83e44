"""TrainConfig: the command line and config files are thin layers over one dataclass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_utils.config.parse import config_from_dict, parse_config
from fsdp_utils.config.train_config import TrainConfig

REPO = Path(__file__).resolve().parent.parent


def test_defaults_and_seed_flags():
    config, _ = parse_config(
        [
            "--batch_size_per_device", "4",
            "--gradient_accumulation_steps", "2",
            "--learning_rate", "1e-4",
            "--max_training_steps", "7",
            "--gradient_checkpointing",
            "--max_seq_length", "256",
            "--no_fsdp",
        ]
    )  # fmt: skip
    assert config.batch_size_per_device == 4
    assert config.gradient_accumulation_steps == 2
    assert config.learning_rate == pytest.approx(1e-4)
    assert config.max_training_steps == 7
    assert config.gradient_checkpointing and config.no_fsdp
    assert config.precision == TrainConfig().precision


def test_config_file_then_cli_override(tmp_path: Path):
    path = tmp_path / "run.yaml"
    path.write_text("precision: fp32\nmax_training_steps: 11\noptimizer: sgd\n")
    config, _ = parse_config(["--config", str(path), "--max_training_steps", "3"])
    assert config.precision == "fp32" and config.optimizer == "sgd"
    assert config.max_training_steps == 3  # the command line wins over the file


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ValueError, match="did you mean 'learning_rate'"):
        config_from_dict({"learning_rat": 1e-3})


def test_wrong_type_and_choice_are_named():
    with pytest.raises(ValueError, match="max_training_steps must be int"):
        config_from_dict({"max_training_steps": "ten"})
    with pytest.raises(ValueError, match="precision must be one of"):
        config_from_dict({"precision": "fp8"})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"batch_size_per_device": 0}, "batch_size_per_device must be at least 1"),
        ({"warmup_steps": 10, "max_training_steps": 5}, "warmup_steps"),
        ({"no_fsdp": True, "cpu_offload": True}, "cannot be combined"),
        ({"template": "no moves here"}, "must contain"),
    ],
)
def test_invalid_settings(values, message):
    with pytest.raises(ValueError, match=message):
        config_from_dict(values)


def test_print_config_is_the_resolved_json():
    result = subprocess.run(
        [sys.executable, "chess_finetune.py", "--print_config", "--total_batch_size", "64"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["total_batch_size"] == 64
    assert set(printed) == set(TrainConfig().to_dict())


def test_bad_flag_value_is_one_clear_line():
    result = subprocess.run(
        [sys.executable, "chess_finetune.py", "--print_config", "--warmup_steps", "500"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "warmup_steps" in result.stderr and "Traceback" not in result.stderr
