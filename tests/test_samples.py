"""`--sample_prompts` (fsdp_utils.train.samples): the file's formats and its mistakes, how a
prompt becomes tokens, and the log's lines. The answers themselves come from a real 2-process
chat run (tests/test_chat_e2e.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_utils.synthetic import chat_tokenizer
from fsdp_utils.train.samples import (
    SamplePrompts,
    encode_prompt,
    format_answers,
    read_sample_prompts,
)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_messages_and_prompt_rows_are_read_blank_lines_skipped(tmp_path):
    chat = {"messages": [{"role": "user", "content": "hi"}], "id": 7}
    path = _write(
        tmp_path / "p.jsonl", [json.dumps(chat), "", json.dumps({"prompt": "Q: 2+2\nA:"})]
    )
    assert read_sample_prompts(path) == [
        {"messages": [{"role": "user", "content": "hi"}]},
        {"prompt": "Q: 2+2\nA:"},
    ]


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (None, "no such file"),
        ([], "holds no prompts"),
        (["{not json"], "line 1: not JSON"),
        ([json.dumps({"prompt": "ok"}), json.dumps({"text": "x"})], "line 2: expected"),
        ([json.dumps({"messages": [{"role": "user"}]})], "line 1: expected"),
        ([json.dumps({"messages": []})], "line 1: expected"),
    ],
)
def test_a_bad_file_names_the_line_and_the_formats(tmp_path, lines, expected):
    path = tmp_path / "p.jsonl"
    if lines is not None:
        _write(path, lines)
    with pytest.raises(ValueError, match=expected):
        read_sample_prompts(path)


def test_messages_go_through_the_chat_template_with_its_generation_prompt():
    tokenizer = chat_tokenizer("chatml")
    row = {"messages": [{"role": "user", "content": "how are you"}]}
    ids = encode_prompt(row, tokenizer, where="test")
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and "how are you" in text
    assert ids == list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_messages_without_a_chat_template_name_the_fix():
    with pytest.raises(ValueError, match="--chat_template FILE"):
        encode_prompt(
            {"messages": [{"role": "user", "content": "x"}]}, chat_tokenizer("plain"), where="p"
        )


def test_a_prompt_is_the_text_as_given():
    tokenizer = chat_tokenizer("plain")
    ids = encode_prompt({"prompt": "Summary:\n"}, tokenizer, where="test")
    assert ids == list(tokenizer("Summary:\n", add_special_tokens=True)["input_ids"])


def test_the_log_shows_newlines_and_names_the_stop_tokens():
    """Issue 48: newlines were printed as spaces and the stop tokens as ids."""
    records = [{"prompt_text": "Q:\nhi\n", "answer": "a\n\nb", "stopped": True, "new_tokens": 4}]
    lines = format_answers(3, records).splitlines()
    assert lines[1] == "  [1] 'Q:\\nhi\\n'" and lines[2] == "      -> 'a\\n\\nb' (stopped)"
    tokenizer = chat_tokenizer("chatml")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = SamplePrompts([], [], tokenizer, [end, tokenizer.eos_token_id], 32)
    assert f"ending at <|im_end|> ({end}), {tokenizer.eos_token} " in prompts.describe()


def test_the_log_shows_each_prompts_end_and_its_answer():
    records = [
        {"prompt_text": "x" * 500 + "END", "answer": "fine", "stopped": True, "new_tokens": 3},
        {"prompt_text": "short", "answer": "y " * 200, "stopped": False, "new_tokens": 64},
    ]
    text = format_answers(12, records)
    lines = text.splitlines()
    assert lines[0] == "samples step 12:"
    assert lines[1].endswith("END'") and "..." in lines[1]  # the prompt's end is kept
    assert lines[2] == "      -> 'fine' (stopped)"
    assert lines[4].endswith("(cut at 64 tokens)") and len(lines[4]) < 200
