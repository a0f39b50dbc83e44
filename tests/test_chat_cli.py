"""Bad instruction and chat data through chess_finetune.py: each a clear message naming the
fix, exit 2, no traceback. One process (the data is prepared before any model is built)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fsdp_utils.synthetic import random_conversations, save_chat_model, train_chat_tokenizer
from tests.chat_helpers import write_jsonl
from tests.prefork import launch
from tests.train_helpers import run_finetune, tiny_args


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_cli")
    base = train_chat_tokenizer()
    thinking = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>hmm</think>kalo"},
        {"role": "user", "content": "and"},
    ]  # the last answer's reasoning dropped by the template: refused
    chats = [{"messages": c} for c in random_conversations(20, seed=0)]
    long_answer = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ka " * 200}]
    return {
        "root": root,
        "plain": save_chat_model(root / "plain", "plain", base=base),
        "chatml": save_chat_model(root / "chatml", "chatml", base=base),
        "thinking_model": save_chat_model(root / "think", "think_dropping", base=base),
        "qa": write_jsonl(root / "qa.jsonl", [{"question": "q", "answer": "a"}] * 20),
        "chat": write_jsonl(root / "chat.jsonl", chats),
        "thinking": write_jsonl(root / "thinking.jsonl", [{"messages": thinking}] * 20),
        "long": write_jsonl(root / "long.jsonl", [*chats, {"messages": long_answer}]),
    }


CASES: dict[str, tuple[str, str, dict[str, Any], list[str]]] = {
    # name: (model, dataset, options, what the message must say)
    "unknown format": (
        "plain", "qa", {},
        ["columns (question, answer) match no format", "--prompt_template", "--dataset_module"],
    ),
    "placeholder naming no column": (
        "plain", "qa", {"prompt_template": "Q: {question}\n", "response_template": "{answr}"},
        ["names {answr}, which is not a column", "Its columns are: question, answer"],
    ),
    "model without a chat template": (
        "plain", "chat", {}, ["has no chat template", "--chat_template FILE"],
    ),
    "template dropping the last answer's reasoning": (
        "thinking_model", "thinking", {},
        ["the chat template of", "drops its <think>...</think> part", "message 1 of row 0"],
    ),
    "overlong row with --long_examples error": (
        "chatml", "long", {"long_examples": "error", "max_seq_length": 128, "eval_examples": 2},
        ["Row 20 has", "more than --max_seq_length 128", "--long_examples truncate"],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def results(assets) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every case's chess_finetune.py, one after another (forked: no imports to overlap)."""

    def run(case: str) -> subprocess.CompletedProcess[str]:
        model, dataset, options, _ = CASES[case]
        folder = assets["root"] / case.replace(" ", "_")
        args = tiny_args(
            {"model": assets[model], "data": assets[dataset]}, folder / "run", folder / "prep",
            **options,
        )  # fmt: skip
        return run_finetune(1, args, timeout=180)

    return {case: run(case) for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_data_is_one_clear_message(results, case):
    expected = CASES[case][3]
    result = results[case]
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    message = result.stderr.split("error: ", 1)[-1]
    for words in expected:
        assert words in message, message


def test_an_unknown_data_format_is_refused_by_the_parser(assets, tmp_path):
    args = tiny_args({"model": assets["plain"], "data": assets["qa"]}, tmp_path, tmp_path)
    result = run_finetune(1, [*args, "--data_format", "sharegpt"], timeout=60)
    assert result.returncode == 2 and "invalid choice: 'sharegpt'" in result.stderr
    assert "Traceback" not in result.stderr


def test_download_models_prepare_runs_the_dataset_module(assets, tmp_path):
    """On the login node: download_models.py --config train.yaml --prepare runs the module
    and prepares; the training job then finds the preparation (same key)."""

    from fsdp_utils.config.parse import load_config_file
    from fsdp_utils.config.train_config import TrainConfig
    from fsdp_utils.data.prepare import prepare_dataset

    module = tmp_path / "my_data.py"
    module.write_text(
        "import json\n"
        "def build():\n"
        f"    rows = [json.loads(line) for line in open({str(assets['chat'])!r})]\n"
        "    return [{'prompt': r['messages'][0]['content'], 'completion': r['messages'][1]['content']} for r in rows]\n"
    )
    config_file = tmp_path / "train.json"
    config_file.write_text(
        json.dumps(
            {
                "model": str(assets["chatml"]), "dataset_module": f"{module}:build",
                "data_cache_dir": str(tmp_path / "prepared"), "max_seq_length": 64,
                "eval_examples": 4,
            }
        )
    )  # fmt: skip
    result = launch(1, "download_models.py", ["--config", str(config_file), "--prepare"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"data: {module}:build: 20 rows" in result.stdout
    assert "data: format prompt_completion" in result.stdout and "prepared in" in result.stdout
    lines: list[str] = []
    config = TrainConfig(**load_config_file(config_file))
    folder = prepare_dataset(config, log=lines.append)
    assert any(line.startswith(f"data: using prepared data in {folder}") for line in lines)
