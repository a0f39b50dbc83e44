"""TrainConfig: the command line and config files are thin layers over one dataclass."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_utils.config.parse import (
    CHECKS_SECTION,
    config_from_dict,
    parse_config,
)
from fsdp_utils.config.train_config import SECTIONS, TrainConfig

REPO = Path(__file__).resolve().parent.parent


def test_the_tutorials_flags_set_those_fields_and_no_other():
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
    # Every other field keeps its dataclass default: the parser adds no defaults of its own.
    assert config == TrainConfig(
        batch_size_per_device=4, gradient_accumulation_steps=2, learning_rate=1e-4,
        max_training_steps=7, gradient_checkpointing=True, max_seq_length=256, no_fsdp=True,
    )  # fmt: skip


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


# --- --help: one section per stage of a run, the checks first ---------------------------------


def test_every_field_has_a_help_section():
    unsorted = [
        f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("section") not in SECTIONS
    ]
    assert unsorted == []


def _sections(help_text: str) -> dict[str, str]:
    """`--help` cut into its sections: title -> the lines under it."""
    sections: dict[str, str] = {}
    title = None
    for line in help_text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            sections[title] = ""
        elif title is not None:
            sections[title] += line + "\n"
    return sections


def test_help_shows_its_sections_in_order_with_each_flag_in_its_own():
    result = subprocess.run(
        [sys.executable, "chess_finetune.py", "--help"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "usage: chess_finetune.py [options]"
    sections = _sections(result.stdout)
    assert list(sections) == ["options", CHECKS_SECTION, *SECTIONS.values()]
    flags = {title: set(text.split()) for title, text in sections.items()}
    checks = {"--config", "--print_config", "--preflight", "--world_size", "--nodes",
              "--gpu_memory", "--plan"}  # fmt: skip
    assert checks <= flags[CHECKS_SECTION]
    for field in dataclasses.fields(TrainConfig):
        assert f"--{field.name}" in flags[SECTIONS[field.metadata["section"]]], field.name


def test_a_runs_own_config_json_is_a_config_file(tmp_path):
    """What the toolkit writes, it reads: config.json's options (under "config"), its resolved
    values and versions beside them; an epoch run's resolved step count is not an option."""
    config = TrainConfig(num_epochs=2, learning_rate=1e-4, reward_weights=None)
    record = {"config": config.replace(max_training_steps=123).to_dict(),
              "resolved": {"world_size": 4, "tokens_per_step": 4096},
              "versions": {"torch": "2.13.0"}}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(record))
    parsed, _ = parse_config(["--config", str(path), "--seed", "7"])
    assert parsed.learning_rate == 1e-4 and parsed.num_epochs == 2 and parsed.seed == 7
    # An --auto run's record holds its choices: read back, --auto chooses them again (on
    # another allocation they may differ), but for those it kept.
    chosen = TrainConfig(auto=True, auto_keep="compile", batch_size_per_device=4, compile=True,
                         sharding="shard_grad_op", gradient_checkpointing=True, learning_rate=1e-4)  # fmt: skip
    path.write_text(json.dumps({"config": chosen.to_dict(), "versions": {}}))
    again, _ = parse_config(["--config", str(path)])
    assert again.auto and again.auto_keep == "compile" and again.compile
    default = TrainConfig()
    assert (again.batch_size_per_device, again.sharding, again.gradient_checkpointing) == (
        default.batch_size_per_device, default.sharding, default.gradient_checkpointing)  # fmt: skip
    assert again.learning_rate == 1e-4
    # Any other file with a "config" key is options as before (and refused as unknown).
    path.write_text(json.dumps({"config": {"seed": 1}, "learning_rate": 1e-4}))
    with pytest.raises(ValueError, match="'config'"):
        parse_config(["--config", str(path)])


def test_list_options_take_lists_in_config_files(tmp_path):
    """What people write in YAML: a list for an option the command line takes comma-separated;
    config.json then holds the one string the command line would have given."""
    path = tmp_path / "run.yaml"
    path.write_text(
        "method: grpo\nreward_funcs: [chess_legal, my_rewards.py:score]\n"
        "reward_weights: [1, 0.5]\ndataset_include:\n  - 'chess_game_0001.parquet'\n"
        "  - 'chess_game_0002.parquet'\nchess_eval_ladder: [random, 'depth:1']\n"
        "eval_tasks: [arc_easy, mmlu]\nlora_target_modules: [q_proj, v_proj]\n"
    )
    config, _ = parse_config(["--config", str(path)])
    assert config.reward_funcs == "chess_legal,my_rewards.py:score"
    assert config.reward_weights == "1,0.5"
    assert config.dataset_include == "chess_game_0001.parquet,chess_game_0002.parquet"
    assert config.chess_eval_ladder == "random,depth:1" and config.eval_tasks == "arc_easy,mmlu"
    assert config.lora_target_modules == "q_proj,v_proj"
    joined = {f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("joined")}
    assert "reward_funcs" in joined and "learning_rate" not in joined
    with pytest.raises(ValueError, match="its item 'a,b' is not one"):
        config_from_dict({"reward_funcs": ["a,b", "c"]})
    with pytest.raises(ValueError, match="learning_rate must be float"):  # not a list option
        config_from_dict({"learning_rate": [1e-4]})
