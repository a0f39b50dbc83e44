"""Preference data (fsdp_utils/data/preference.py): TRL's formats detected from the columns,
the loss on the answers only, pairs kept whole and counted, and the user's mistakes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from fsdp_utils.config.train_config import TrainConfig, validate_config
from fsdp_utils.data.formats import choose_format
from fsdp_utils.data.preference import PAIR_ROWS, extract_prompt
from fsdp_utils.synthetic import save_chat_model
from tests.chat_helpers import prepare, segments, write_jsonl
from tests.train_helpers import run_finetune, tiny_args

USER = {"role": "user", "content": "say ka"}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("pref_model") / "chatml", "chatml")


def _pairs(chat_model: Path, tmp_path: Path, rows: list[dict], **options):
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    prepared = prepare(chat_model, data, tmp_path / "cache", method="dpo", **options)
    return prepared, prepared.split("train")


def _texts(chat_model: Path, batch, index: int) -> list[tuple[str, bool]]:
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    runs = segments(tokenizer, batch["input_ids"][index], batch["labels"][index])
    padding = "<|endoftext|>"  # the pad token
    return [(text, trained) for text, trained in runs if text.replace(padding, "")]


def test_prompt_chosen_rejected_strings(chat_model, tmp_path):
    rows = [{"prompt": f"say {w}\n", "chosen": w, "rejected": "lo"} for w in ("ka", "mi", "ne")]
    prepared, pairs = _pairs(chat_model, tmp_path, rows)
    assert prepared.meta["stats"]["format"] == "preference" and len(pairs) == 3
    batch = pairs.batch(np.array([2, 0]))
    # [chosen of pair 2, chosen of pair 0, rejected of pair 2, rejected of pair 0]
    assert batch["input_ids"].shape == (4, 128)
    assert batch[PAIR_ROWS].tolist() == [int(pairs.rows[2]), int(pairs.rows[0])]
    assert sorted(pairs.rows.tolist()) == [0, 1, 2]
    row = pairs.rows[2]
    word = rows[row]["chosen"]
    assert _texts(chat_model, batch, 0) == [(f"say {word}\n", False), (f"{word}<|im_end|>", True)]
    assert _texts(chat_model, batch, 2) == [(f"say {word}\n", False), ("lo<|im_end|>", True)]


def test_conversations_sharing_a_prompt(chat_model, tmp_path):
    """chosen/rejected whole conversations: the common messages are the prompt (TRL's
    extract_prompt), the answers are trained by the chat masking's rules."""
    rows = [
        {"chosen": [USER, {"role": "assistant", "content": "ka ka"}],
         "rejected": [USER, {"role": "assistant", "content": "lo"}]},
    ] * 2  # fmt: skip
    _, pairs = _pairs(chat_model, tmp_path, rows)
    batch = pairs.batch(np.array([0]))
    prompt = "<|im_start|>user\nsay ka<|im_end|>\n<|im_start|>assistant\n"
    assert _texts(chat_model, batch, 0)[:2] == [(prompt, False), ("ka ka<|im_end|>", True)]
    assert _texts(chat_model, batch, 1)[:2] == [(prompt, False), ("lo<|im_end|>", True)]


def test_explicit_prompt_as_messages(chat_model, tmp_path):
    rows = [{"prompt": [USER], "chosen": [{"role": "assistant", "content": "ka"}],
             "rejected": [{"role": "assistant", "content": "lo"}]}] * 2  # fmt: skip
    _, pairs = _pairs(chat_model, tmp_path, rows)
    texts = _texts(chat_model, pairs.batch(np.array([0])), 1)
    assert texts[1] == ("lo<|im_end|>", True) and not texts[0][1]


def test_extract_prompt_is_trls():
    assert extract_prompt("Q: hi A: yes", "Q: hi A: no") == ("Q: hi A:", " yes", " no")
    chosen = [USER, {"role": "assistant", "content": "a"}]
    rejected = [USER, {"role": "assistant", "content": "b"}]
    assert extract_prompt(chosen, rejected) == ([USER], chosen[1:], rejected[1:])


@pytest.mark.parametrize("long_examples", ["drop", "truncate"])
def test_too_long_pairs_are_dropped_or_truncated_whole_and_counted(
    chat_model, tmp_path, long_examples
):
    rows = [{"prompt": "say ka\n", "chosen": "ka", "rejected": "lo"}] * 3
    rows.append({"prompt": "say ka\n", "chosen": "ka", "rejected": " lo" * 200})  # one side long
    prepared, pairs = _pairs(chat_model, tmp_path, rows, long_examples=long_examples)
    stats = prepared.meta["stats"]["train"]
    if long_examples == "drop":
        assert len(pairs) == 3 and 3 not in pairs.rows
        assert stats["dropped"] == {"longer than --max_seq_length": 1}
    else:
        assert len(pairs) == 4 and stats["truncated"] == 1
        batch = pairs.batch(np.array([list(pairs.rows).index(3)]))
        assert int((batch["labels"][1] != -100).sum()) > 100  # the kept start of the answer


def test_the_method_and_the_columns_must_agree():
    dpo, sft = TrainConfig(method="dpo"), TrainConfig()
    assert choose_format(["prompt", "chosen", "rejected"], dpo).name == "preference"
    assert choose_format(["chosen", "rejected"], dpo).name == "preference"
    # UltraFeedback's columns: messages too; --method decides
    ultra = ["prompt", "prompt_id", "chosen", "rejected", "messages"]
    assert choose_format(ultra, dpo).name == "preference"
    assert choose_format(ultra, sft).name == "chat"
    with pytest.raises(ValueError, match="--method dpo trains on preference pairs"):
        choose_format(["messages"], dpo)
    with pytest.raises(ValueError, match="train on them with --method dpo"):
        choose_format(["prompt", "chosen", "rejected"], sft)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"method": "dpo", "lora": True, "reference": "live"}, "Drop --reference live"),
        ({"dpo_beta": 0.5}, "Add --method dpo"),
        ({"method": "dpo", "dpo_beta": 0}, "--dpo_beta must be positive"),
        ({"method": "dpo", "dpo_loss": "ipo", "dpo_label_smoothing": 0.1}, "sigmoid only"),
        ({"method": "dpo", "train_on_prompt": True}, "Drop --train_on_prompt"),
    ],
)
def test_bad_preference_options(changes, words):
    with pytest.raises(ValueError, match=words):
        validate_config(TrainConfig(**changes))


def test_mistakes_end_with_one_paragraph_and_exit_2(chat_model, tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [USER]}] * 4)
    pairs = write_jsonl(tmp_path / "p.jsonl", [{"chosen": "a", "rejected": "b"}] * 4)
    cases = {
        "dpo on chat rows": ({"dataset": chat}, {"method": "dpo"}, "needs the columns `chosen`"),
        "live with lora": ({"dataset": pairs}, {"method": "dpo", "lora": True,
                           "reference": "live"}, "Drop --reference live"),
    }  # fmt: skip

    def run(case: str):
        data, options, _ = cases[case]
        assets = {"model": chat_model, "data": data["dataset"]}
        folder = tmp_path / case.replace(" ", "_")
        return run_finetune(1, tiny_args(assets, folder / "run", folder / "prep", **options))

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(cases, pool.map(run, cases), strict=True))
    for case, result in results.items():
        assert result.returncode == 2, (case, result.stdout + result.stderr)
        assert "Traceback" not in result.stderr
        assert cases[case][2] in result.stderr.split("error: ", 1)[-1], result.stderr
