"""Instruction and chat data: which tokens carry loss, token-exactly, for each format and
template family; the formats people publish; drops, long rows, the prefix and end-of-turn
checks; packing with masks; the cache key; --num_epochs; the exported tokenizer."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from fsdp_utils.checkpoint.hf_folder import copy_tokenizer_files
from fsdp_utils.config.batch import plan_batch
from fsdp_utils.config.parse import parse_config
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import IGNORE_INDEX, StepSampler, epoch_steps
from fsdp_utils.data.chat import ChatEncoder, ChatTemplate, Conversation, check_end_of_turn
from fsdp_utils.data.files import peek_columns
from fsdp_utils.data.instruct import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT
from fsdp_utils.data.packing import best_fit_decreasing, pack_rows
from fsdp_utils.data.prepare import prepare_dataset
from fsdp_utils.synthetic import (
    CHATML_TEMPLATE,
    chat_tokenizer,
    train_chat_tokenizer,
)
from tests.chat_helpers import chat_models, prepare, row_segments, segments, write_jsonl

STYLES = ("chatml", "llama3", "chatml_generation", "think_dropping", "plain")


@pytest.fixture(scope="module")
def base():
    return train_chat_tokenizer()


@pytest.fixture(scope="module")
def models(base, tmp_path_factory) -> dict[str, Path]:
    return chat_models(tmp_path_factory.mktemp("chat_models"), base, STYLES)


def _tokenizer(models, style):
    return AutoTokenizer.from_pretrained(models[style])


def _chat(tmp_path, models, style, messages, **options):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    prepared = prepare(models[style], data, tmp_path / "cache", **options)
    return row_segments(prepared, _tokenizer(models, style)), prepared


ONE_TURN = [
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "kalo mine"},
]
MULTI_TURN = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "kalo mine"},
    {"role": "user", "content": "and then"},
    {"role": "assistant", "content": "sa ti"},
]


# --- which tokens carry loss: hand-written expectations ------------------------------------


def test_chatml_without_markers_trains_the_answer_and_its_end_of_turn(tmp_path, models):
    runs, prepared = _chat(tmp_path, models, "chatml", ONE_TURN)
    assert runs == [
        ("<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", False),
        ("kalo mine<|im_end|>", True),
        ("\n", False),  # what the template writes after the end-of-turn token: not trained
    ]
    assert prepared.meta["stats"]["end_of_turn"] == "<|im_end|>"


def test_multi_turn_with_a_system_message_trains_every_answer_and_nothing_else(tmp_path, models):
    runs, _ = _chat(tmp_path, models, "chatml", MULTI_TURN)
    assert runs == [
        (
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n"
            "<|im_start|>assistant\n",
            False,
        ),
        ("kalo mine<|im_end|>", True),
        ("\n<|im_start|>user\nand then<|im_end|>\n<|im_start|>assistant\n", False),
        ("sa ti<|im_end|>", True),
        ("\n", False),
    ]


def test_llama3_template_writes_the_only_bos(tmp_path, models):
    """The template writes <|begin_of_text|>, and the tokenizer would add one too: the
    rendered text is tokenised without special tokens, so there is exactly one."""
    runs, prepared = _chat(tmp_path, models, "llama3", MULTI_TURN)
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert runs == [
        (
            "<|begin_of_text|>" + header.format("system") + "be brief<|eot_id|>"
            + header.format("user") + "hi there<|eot_id|>" + header.format("assistant"),
            False,
        ),
        ("kalo mine<|eot_id|>", True),
        (header.format("user") + "and then<|eot_id|>" + header.format("assistant"), False),
        ("sa ti<|eot_id|>", True),
    ]  # fmt: skip
    tokenizer = _tokenizer(models, "llama3")
    ids = prepared.split("train").input_ids[0]
    assert ids[0] == tokenizer.bos_token_id and int((ids == tokenizer.bos_token_id).sum()) == 1
    # The trap this avoids: tokenising the rendered text as ordinary text doubles the BOS.
    text = tokenizer.apply_chat_template(MULTI_TURN, tokenize=False)
    assert tokenizer(text)["input_ids"][:2] == [tokenizer.bos_token_id] * 2


def test_generation_markers_give_the_mask(tmp_path, models):
    """With {% generation %} markers the template says what is trained: here the content
    and <|im_end|>, not the newline after it."""
    runs, prepared = _chat(tmp_path, models, "chatml_generation", MULTI_TURN)
    assert runs == [
        (
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n"
            "<|im_start|>assistant\n",
            False,
        ),
        ("kalo mine<|im_end|>", True),
        ("\n<|im_start|>user\nand then<|im_end|>\n<|im_start|>assistant\n", False),
        ("sa ti<|im_end|>", True),
        ("\n", False),
    ]
    assert prepared.meta["stats"]["generation_markers"] is True
    assert prepared.meta["stats"]["answers_found_by"] == "the template's {% generation %} markers"


def test_sharegpt_conversations_are_chat(tmp_path, models):
    sharegpt = [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "kalo mine"}]
    data = write_jsonl(tmp_path / "sharegpt.jsonl", [{"conversations": sharegpt}])
    prepared = prepare(models["chatml"], data, tmp_path / "cache")
    chat, _ = _chat(tmp_path / "messages", models, "chatml", ONE_TURN)
    assert row_segments(prepared, _tokenizer(models, "chatml")) == chat
    assert prepared.meta["stats"]["format_reason"] == "column `conversations` (ShareGPT)"


def test_alpaca_with_and_without_input(tmp_path, models):
    rows = [
        {"instruction": "Name a colour.", "input": "", "output": "Blue."},
        {"instruction": "Add them.", "input": "2 and 3", "output": "5"},
    ]
    (tmp_path / "alpaca.json").write_text(json.dumps(rows))  # as alpaca_data.json: a list
    prepared = prepare(
        models["plain"], tmp_path / "alpaca.json", tmp_path / "cache", max_seq_length=256
    )
    tokenizer = _tokenizer(models, "plain")
    got = sorted(row_segments(prepared, tokenizer, i) for i in range(2))
    assert got == sorted(
        [
            [
                (ALPACA_PROMPT_NO_INPUT.format(instruction="Name a colour."), False),
                ("Blue.<|endoftext|>", True),
            ],
            [
                (ALPACA_PROMPT.format(instruction="Add them.", input="2 and 3"), False),
                ("5<|endoftext|>", True),
            ],
        ]
    )
    assert prepared.meta["stats"]["format"] == "alpaca"


def test_an_eval_split_as_large_as_what_it_leaves_is_refused(tmp_path, models):
    """More held out than trained on is refused, with the fix; the default (200), which
    would leave 1 of 40 rows to train on, holds out a tenth instead (issue 48)."""
    rows = [{"instruction": f"Say {i}.", "input": "", "output": str(i)} for i in range(40)]
    (tmp_path / "alpaca.json").write_text(json.dumps(rows))
    data, cache = tmp_path / "alpaca.json", tmp_path / "cache"
    with pytest.raises(
        ValueError,
        match=r"--eval_examples 39 would hold out 39 of the 40 documents for evaluation, "
        r"leaving 1 to train on\. .*--eval_examples 4 ",
    ):
        prepare(models["plain"], data, cache, max_seq_length=256, eval_examples=39)
    with pytest.raises(ValueError, match="would hold out 21 of the 40 documents"):
        prepare(models["plain"], data, cache, max_seq_length=256, eval_examples=21)
    prepared = prepare(models["plain"], data, cache, max_seq_length=256, eval_examples=20)
    stats = prepared.meta["stats"]
    assert (stats["eval"]["documents"], stats["train"]["documents"]) == (20, 20)


def test_samsum_style_templates(tmp_path, models):
    rows = [{"id": "1", "dialogue": "A: hi\nB: yo", "summary": "They greet."}]
    data = write_jsonl(tmp_path / "samsum.jsonl", rows)
    prepared = prepare(
        models["plain"], data, tmp_path / "cache",
        prompt_template="Summarize this dialog:\n{dialogue}\n---\nSummary:\n",
        response_template="{summary}",
    )  # fmt: skip
    assert row_segments(prepared, _tokenizer(models, "plain")) == [
        ("Summarize this dialog:\nA: hi\nB: yo\n---\nSummary:\n", False),
        ("They greet.<|endoftext|>", True),
    ]


def test_prompt_completion_strings_and_message_lists(tmp_path, models):
    strings = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+2=", "completion": "4"}])
    prepared = prepare(models["chatml"], strings, tmp_path / "c1")
    tokenizer = _tokenizer(models, "chatml")
    assert row_segments(prepared, tokenizer) == [("2+2=", False), ("4<|im_end|>", True)]
    messages = write_jsonl(
        tmp_path / "pcm.jsonl",
        [{"prompt": [ONE_TURN[0]], "completion": [ONE_TURN[1]]}],
    )
    prepared = prepare(models["chatml"], messages, tmp_path / "c2")
    chat, _ = _chat(tmp_path / "chat", models, "chatml", ONE_TURN)
    assert row_segments(prepared, tokenizer) == chat


def test_train_on_prompt_trains_every_token_but_the_first(tmp_path, models):
    runs, _ = _chat(tmp_path, models, "chatml", ONE_TURN, train_on_prompt=True)
    assert runs == [
        ("<|im_start|>", False),
        ("user\nhi there<|im_end|>\n<|im_start|>assistant\nkalo mine<|im_end|>\n", True),
    ]


# --- formats people publish ----------------------------------------------------------------


ALPACA_ROWS = [
    {"instruction": f"Say {w}.", "input": "" if i % 2 else f"in {i}", "output": f"{w}!"}
    for i, w in enumerate(["kalo", "mine", "ruvo", "sati", "zedo", "gine"])
]


def _write_everywhere(folder: Path) -> dict[str, Path]:
    folder.mkdir()
    table = pa.Table.from_pylist(ALPACA_ROWS)
    (folder / "rows.json").write_text(json.dumps(ALPACA_ROWS, indent=1))
    paths = {"json": folder / "rows.json", "jsonl": write_jsonl(folder / "rows.jsonl", ALPACA_ROWS)}
    pq.write_table(table, folder / "rows.parquet")
    paths["parquet"] = folder / "rows.parquet"
    table.to_pandas().to_csv(folder / "rows.csv", index=False)
    paths["csv"] = folder / "rows.csv"
    datasets.Dataset.from_list(ALPACA_ROWS).save_to_disk(str(folder / "arrow"))
    paths["arrow"] = folder / "arrow"  # a folder: its .arrow file, not the .json beside it
    return paths


def test_every_file_type_gives_the_same_prepared_rows(tmp_path, models):
    paths = _write_everywhere(tmp_path / "files")
    prepared = {
        kind: prepare(models["plain"], path, tmp_path / f"cache_{kind}", max_seq_length=256)
        for kind, path in paths.items()
    }
    reference = prepared["jsonl"].split("train")
    for kind, p in prepared.items():
        assert p.meta["stats"]["format"] == "alpaca", kind
        blocks = p.split("train")
        np.testing.assert_array_equal(blocks.input_ids, reference.input_ids, err_msg=kind)
        np.testing.assert_array_equal(blocks.loss_mask, reference.loss_mask, err_msg=kind)
    for kind in ("json", "jsonl", "parquet", "csv"):
        assert set(peek_columns([paths[kind]])) == {"instruction", "input", "output"}


def test_the_log_names_the_format_and_why(tmp_path, models):
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": ONE_TURN, "text": "x"}])
    config = TrainConfig(
        model=str(models["chatml"]), dataset=str(data), data_cache_dir=str(tmp_path)
    )
    lines: list[str] = []
    prepare_dataset(config, log=lines.append)
    assert "data: format chat (column `messages`)" in lines
    lines.clear()
    prepare_dataset(config.replace(data_format="text"), log=lines.append)
    assert "data: format text (--data_format)" in lines


def test_unknown_columns_and_bad_templates_are_explained(tmp_path, models):
    data = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    config = TrainConfig(
        model=str(models["plain"]), dataset=str(data), data_cache_dir=str(tmp_path)
    )
    with pytest.raises(
        ValueError, match=r"columns \(question, answer\) match no format.*\{answer\}"
    ):
        prepare_dataset(config, log=lambda _: None)
    with pytest.raises(ValueError, match=r"--data_format chat needs the column\(s\) `messages`"):
        prepare_dataset(config.replace(data_format="chat"), log=lambda _: None)
    typo = config.replace(prompt_template="Q: {question}\nA: ", response_template="{answr}")
    with pytest.raises(ValueError, match=r"names \{answr\}.*Its columns are: question, answer"):
        prepare_dataset(typo, log=lambda _: None)


# --- dropped, truncated and refused rows --------------------------------------------------


def test_drops_are_counted_and_summarised(tmp_path, models):
    rows = [{"messages": ONE_TURN}] * 3
    rows.append({"messages": [{"role": "user", "content": "no answer here"}]})
    rows.append({"messages": [ONE_TURN[0], {"role": "assistant", "content": "kalo " * 80}]})
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    lines: list[str] = []
    config = TrainConfig(
        model=str(models["chatml"]), dataset=str(data), data_cache_dir=str(tmp_path / "c"),
        max_seq_length=48, eval_examples=0,
    )  # fmt: skip
    folder = prepare_dataset(config, log=lines.append)
    stats = json.loads((folder / "meta.json").read_text())["stats"]["train"]
    assert stats["rows_read"] == 5 and stats["documents"] == 3
    assert stats["dropped"] == {
        "longer than --max_seq_length": 1,
        "no assistant turn to train on": 1,
    }
    assert any(line.startswith("data: rows: 5 read, 3 used, 2 dropped (") for line in lines), lines
    trained = stats["trained_tokens"]
    assert any(
        f"data: tokens: {trained:,} trained of {stats['tokens']:,}" in line for line in lines
    )

    truncated = prepare_dataset(config.replace(long_examples="truncate"), log=lambda _: None)
    stats = json.loads((truncated / "meta.json").read_text())["stats"]["train"]
    assert stats["documents"] == 4 and stats["truncated"] == 1
    assert stats["dropped"] == {"no assistant turn to train on": 1}
    lengths = np.load(truncated / "train_lengths.npy")
    assert lengths.max() <= 48

    with pytest.raises(ValueError, match=r"Row 4 has \d+ tokens, more than --max_seq_length 48"):
        prepare_dataset(config.replace(long_examples="error"), log=lambda _: None)


def test_truncation_that_leaves_nothing_to_train_drops_the_row(tmp_path, models):
    rows = [{"messages": ONE_TURN}] * 2
    rows.append({"messages": [{"role": "user", "content": "ka " * 80}, ONE_TURN[1]]})
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    prepared = prepare(
        models["chatml"], data, tmp_path / "c", max_seq_length=48, long_examples="truncate"
    )
    assert prepared.meta["stats"]["train"]["dropped"] == {"nothing to train on after truncation": 1}


def test_a_template_that_drops_reasoning_trains_the_answers_it_shows_whole(tmp_path, models):
    """Qwen3-like: an earlier answer loses its <think> part once the conversation goes on (as
    the model sees it at inference): it is context, not trained; the last answer, shown whole,
    is. A last answer whose reasoning the template drops is refused, naming row and cause."""
    thinking = [dict(m) for m in MULTI_TURN]
    thinking[2]["content"] = "<think>hmm</think>kalo mine"
    runs, _ = _chat(tmp_path, models, "think_dropping", thinking)
    assert [text for text, trained in runs if trained] == ["sa ti<|im_end|>"]
    ends_asking = [*thinking[:3], {"role": "user", "content": "and then"}]
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": MULTI_TURN}, {"messages": ends_asking}])
    with pytest.raises(
        ValueError,
        match=r"think_dropping cannot be masked for the assistant answer in message 2 of row 1: "
        r"the template drops its <think>\.\.\.</think> part although it is the last answer",
    ):
        prepare(models["think_dropping"], data, tmp_path / "c")


def _conversation(messages):
    return Conversation(messages, row=0)


def test_the_end_of_turn_token_must_be_trained(base):
    tokenizer = chat_tokenizer("chatml", base=base)
    # Nothing after the answer: nothing to learn stopping from.
    bare = ChatTemplate(
        "{% for m in messages %}{{ m['role'] + ':\\n' + m['content'] }}"
        "{% if m['role'] == 'user' %}{{ '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:\\n' }}{% endif %}",
        "bare",
    )
    with pytest.raises(ValueError, match="bare writes nothing after an assistant answer"):
        check_end_of_turn(
            ChatEncoder(tokenizer, bare, train_on_prompt=False), [_conversation(ONE_TURN)]
        )
    # Generation markers around the content only: the end-of-turn token is left out.
    outside = ChatTemplate(
        CHATML_TEMPLATE.replace(
            "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}",
            "{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message['role'] == 'assistant' %}"
            "{% generation %}{{ message['content'] }}{% endgeneration %}{% else %}"
            "{{ message['content'] }}{% endif %}{{ '<|im_end|>\\n' }}",
        ),
        "outside",
    )
    assert outside.has_generation_markers
    with pytest.raises(
        ValueError, match=re.escape("leaves out the end-of-turn token '<|im_end|>'")
    ):
        check_end_of_turn(
            ChatEncoder(tokenizer, outside, train_on_prompt=False), [_conversation(ONE_TURN)]
        )
    good = ChatTemplate(CHATML_TEMPLATE, "chatml")
    found = check_end_of_turn(
        ChatEncoder(tokenizer, good, train_on_prompt=False), [_conversation(MULTI_TURN)]
    )
    assert found is not None and found.token == "<|im_end|>" and found.special


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_encoded_tokens_are_apply_chat_templates(base, style):
    """The encoder's tokens are exactly transformers' own."""
    from fsdp_utils.synthetic import CHAT_STYLES, random_conversations

    tokenizer = chat_tokenizer(style, base=base)
    template = ChatTemplate(CHAT_STYLES[style][0] or "", style)
    conversations = random_conversations(40, seed=5, turns=(1, 3), system="be brief")
    for k in range(0, 40, 3):  # characters of several bytes, inside answers and prompts
        conversations[k][-1]["content"] += " café ☕ naïve"
        conversations[k][1]["content"] = "日本 " + conversations[k][1]["content"]
    rows = [Conversation(m, row) for row, m in enumerate(conversations)]
    encoder = ChatEncoder(tokenizer, template, train_on_prompt=False)
    encoded = encoder(rows)
    expected = tokenizer.apply_chat_template(conversations, tokenize=True, return_dict=False)
    assert [ids for ids, _ in encoded] == expected
    # Token positions from the ids alone (a byte-level BPE) agree with the tokenizer's offsets
    # on the first batch; later batches take them from the ids, with the same masks.
    assert encoder.ids_give_offsets is True
    offsets = ChatEncoder(tokenizer, template, train_on_prompt=False)
    offsets.ids_give_offsets = False
    assert encoder(rows) == offsets(rows) == encoded
    trained = [
        tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) for ids, mask in encoded
    ]
    assert trained[0].endswith(" café ☕ naïve" + CHAT_STYLES[style][1]["eos_token"])


def test_a_tokenizer_whose_added_tokens_eat_whitespace(base):
    """An added token with rstrip=True swallows the newline after it: the newline is inside
    the end-of-turn token, trained with it (it cannot be split off)."""
    import copy

    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    raw = copy.deepcopy(base)
    raw.add_special_tokens([AddedToken("<|end|>", rstrip=True, special=True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|end|>")
    template = ChatTemplate(CHATML_TEMPLATE.replace("<|im_end|>", "<|end|>"), "rstrip")
    rows = [Conversation(MULTI_TURN, 0), Conversation(ONE_TURN, 1)]
    encoder = ChatEncoder(tokenizer, template, train_on_prompt=False)
    ids, mask = encoder(rows)[0]
    trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == "kalo mine<|end|>sa ti<|end|>"  # the newline went into <|end|>
    assert encoder.ids_give_offsets is False  # <|end|> stands for more than its own text


# --- packing with masks --------------------------------------------------------------------


def test_best_fit_decreasing_fills_blocks_and_keeps_rows_whole():
    lengths = np.array([5, 3, 8, 2, 6, 4, 7, 1])
    bins, offsets = best_fit_decreasing(lengths, 12)
    assert bins.max() + 1 == 3  # 36 tokens in blocks of 12: no room to spare
    for b in range(3):
        members = np.flatnonzero(bins == b)
        spans = sorted((offsets[m], offsets[m] + lengths[m]) for m in members)
        assert spans[0][0] == 0 and spans[-1][1] <= 12
        assert all(a[1] == c[0] for a, c in itertools.pairwise(spans))  # contiguous


def test_pack_rows_masks_every_row_start():
    """A row's first token is never a target (it would be predicted from the row before it),
    even where its own mask says train (--train_on_prompt)."""
    lengths = [4, 6, 3, 5]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.arange(1, offsets[-1] + 1, dtype=np.int32)
    packed = pack_rows(ids, np.ones(offsets[-1], bool), offsets, 10, pad=0, packing=True)
    assert len(packed.lengths) == 2 and packed.lengths.sum() == offsets[-1]
    starts = packed.row_starts
    assert starts.sum() == 4 and not packed.loss_mask[starts].any()
    assert packed.loss_mask.sum() == offsets[-1] - 4
    rows = {tuple(r[r > 0]) for r in packed.input_ids}
    stream = sorted(t for r in rows for t in r)
    assert stream == list(ids)  # every token once, rows whole


# --- the cache key -------------------------------------------------------------------------


def test_the_cache_key_covers_format_templates_and_masking(tmp_path, models, base):
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [{"messages": ONE_TURN, "q": "hi there", "a": "kalo mine"}] * 4,
    )
    config = TrainConfig(
        model=str(models["chatml"]), dataset=str(data), data_cache_dir=str(tmp_path / "c"),
        max_seq_length=64, eval_examples=0,
    )  # fmt: skip
    template_file = tmp_path / "t.jinja"
    template_file.write_text(
        CHATML_TEMPLATE.replace("\\n' }}{% endfor %}", "\\n\\n' }}{% endfor %}")
    )

    def key(c: TrainConfig) -> str:
        return prepare_dataset(c, log=lambda _: None).name

    base_key = key(config)
    assert key(config.replace(data_format="chat")) == base_key  # the same format, named
    variants = {
        "chat template": config.replace(chat_template=str(template_file)),
        "train_on_prompt": config.replace(train_on_prompt=True),
        "long_examples": config.replace(long_examples="truncate"),
        "format": config.replace(prompt_template="{q}\n", response_template="{a}"),
        "prompt template": config.replace(prompt_template="Q: {q}\n", response_template="{a}"),
        "response template": config.replace(prompt_template="{q}\n", response_template="{a}."),
    }
    keys = {name: key(c) for name, c in variants.items()}
    assert base_key not in keys.values() and len(set(keys.values())) == len(keys), keys
    # The template's text, not its file name: rewriting the file re-prepares.
    template_file.write_text(CHATML_TEMPLATE)
    assert key(variants["chat template"]) != keys["chat template"]


def test_a_dataset_module_is_keyed_by_the_rows_it_returns(tmp_path, models):
    module = tmp_path / "my_data.py"
    rows_file = tmp_path / "rows.json"
    module.write_text(
        "import json, pathlib\n"
        f"ROWS = pathlib.Path({str(rows_file)!r})\n"
        "def build():\n"
        "    return [{'messages': m} for m in json.loads(ROWS.read_text())]\n"
    )
    rows_file.write_text(json.dumps([ONE_TURN] * 3))
    config = TrainConfig(
        model=str(models["chatml"]), dataset_module=f"{module}:build",
        data_cache_dir=str(tmp_path / "c"), eval_examples=0, max_seq_length=64,
    )  # fmt: skip
    lines: list[str] = []
    first = prepare_dataset(config, log=lines.append)
    assert (
        f"data: {module}:build: 3 rows" in lines
        and "data: format chat (column `messages`)" in lines
    )
    assert prepare_dataset(config, log=lambda _: None) == first  # same rows: cached
    rows_file.write_text(json.dumps([ONE_TURN] * 4))  # the module unchanged, its rows not
    assert prepare_dataset(config, log=lambda _: None) != first
    with pytest.raises(ValueError, match="has no function 'nope' \\(its functions: build\\)"):
        prepare_dataset(config.replace(dataset_module=f"{module}:nope"), log=lambda _: None)


# --- --num_epochs --------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 8])
def test_epoch_steps_do_not_depend_on_the_world_size(world):
    config = TrainConfig(num_epochs=3, total_batch_size=16, batch_size_per_device=2)
    plan = plan_batch(config, world)
    steps = epoch_steps(config, 1000, plan.total_batch_size).max_training_steps
    assert steps == 3 * (1000 // 16) == 3 * StepSampler(1000, plan, seed=0).steps_per_epoch


def test_num_epochs_is_checked():
    with pytest.raises(ValueError, match="num_epochs and max_training_steps both"):
        parse_config(["--num_epochs", "2", "--max_training_steps", "10"])
    with pytest.raises(ValueError, match="--warmup_steps \\(50\\)"):
        epoch_steps(TrainConfig(num_epochs=1, warmup_steps=50), 64, 16)  # 4 steps
    assert parse_config(["--num_epochs", "2", "--warmup_steps", "50"])[0].num_epochs == 2


# --- the exported tokenizer carries the template the run trained with -----------------------


def test_export_carries_the_chat_template_and_the_end_of_turn_stop(tmp_path, models):
    """A model without a template, trained with --chat_template FILE: the final model's
    tokenizer files carry the file's template, and generation_config.json stops at the
    template's end-of-turn token (here not the tokenizer's EOS)."""
    template_file = tmp_path / "chatml.jinja"
    template_file.write_text(CHATML_TEMPLATE)
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": ONE_TURN}])
    prepared = prepare(models["plain"], data, tmp_path / "c", chat_template=str(template_file))
    exported = tmp_path / "final"
    exported.mkdir()
    copy_tokenizer_files(prepared.tokenizer_dir(models["plain"]), exported)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert tokenizer.chat_template == CHATML_TEMPLATE
    generation = json.loads((exported / "generation_config.json").read_text())
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generation["eos_token_id"] == [tokenizer.eos_token_id, im_end]

    # A model with its own template whose end of turn is its EOS: its own files, unchanged.
    own = prepare(models["chatml"], data, tmp_path / "c2")
    assert own.tokenizer_dir(models["chatml"]) == models["chatml"]
    assert AutoTokenizer.from_pretrained(models["chatml"]).chat_template == CHATML_TEMPLATE


# --- labels of a packed block --------------------------------------------------------------


def test_packed_blocks_carry_each_rows_mask(tmp_path, models):
    rows = [{"messages": MULTI_TURN}, {"messages": ONE_TURN}] * 3
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    prepared = prepare(models["chatml"], data, tmp_path / "c", no_packing=False)
    tokenizer = _tokenizer(models, "chatml")
    blocks = prepared.split("train")
    batch = blocks.batch(np.arange(len(blocks)))
    trained = [
        text
        for row, labels, n in zip(batch["input_ids"], batch["labels"], blocks.lengths, strict=True)
        for text, flag in segments(tokenizer, row[:n], labels[:n])
        if flag
    ]
    assert sorted(trained) == sorted(["kalo mine<|im_end|>"] * 6 + ["sa ti<|im_end|>"] * 3)
    starts = (
        blocks.row_starts
        if blocks.row_starts is not None
        else np.load(prepared.folder / "train_row_starts.npy")
    )
    assert (batch["labels"].numpy()[np.asarray(starts)] == IGNORE_INDEX).all()


# --- document masking with chat rows -------------------------------------------------------


def test_document_masking_gives_each_conversation_the_logits_it_has_alone(tmp_path, models):
    """ChatML's end-of-turn token is the EOS here (as in Qwen): restarting positions after
    every EOS would cut a conversation into its turns. The stored row starts do not."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_utils.synthetic import random_conversations
    from fsdp_utils.train.step import model_forward

    rows = [{"messages": c} for c in random_conversations(24, seed=3, turns=(2, 3), words=(2, 6))]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    prepared = prepare(models["chatml"], data, tmp_path / "c", no_packing=False, max_seq_length=256)
    blocks = prepared.split("train", document_masking=True)
    assert blocks.row_starts is not None
    batch = blocks.batch(np.arange(2))
    eos = _tokenizer(models, "chatml").eos_token_id
    model = AutoModelForCausalLM.from_pretrained(models["chatml"]).eval()
    cpu = torch.device("cpu")
    checked = 0
    with torch.no_grad():
        packed = model_forward(model, batch, cpu, contextlib.nullcontext).logits  # as trained
        leaky = model(input_ids=batch["input_ids"], use_cache=False).logits
        for r in range(2):
            starts = np.flatnonzero(np.asarray(blocks.row_starts[r]))
            bounds = [*starts.tolist(), int(blocks.lengths[r])]
            assert len(starts) >= 2  # several conversations in the block
            for start, end in itertools.pairwise(bounds):
                ids = batch["input_ids"][r : r + 1, start:end]
                assert (ids[0, :-1] == eos).any()  # an EOS inside: EOS restarts would cut it
                alone = model(input_ids=ids, use_cache=False).logits
                torch.testing.assert_close(packed[r, start:end], alone[0], rtol=1e-4, atol=1e-5)
                if start > 0:  # without document masking it sees the conversations before it
                    assert (leaky[r, start:end] - alone[0]).abs().max() > 1e-3
                checked += 1
    assert checked >= 4


def test_a_checkpoint_identity_covers_the_data_settings():
    """A resumed run must train on the same rows and masks; chess runs' identity is as it was."""
    from fsdp_utils.checkpoint.sharded import IDENTITY_FIELDS, run_identity

    chess = run_identity(TrainConfig(), 32)
    assert set(chess) == {*IDENTITY_FIELDS, "dataset_include", "total_batch_size"}
    chat = run_identity(TrainConfig(train_on_prompt=True, long_examples="truncate"), 32)
    assert chat == {**chess, "train_on_prompt": True, "long_examples": "truncate"}
    # what a training method adds (`Method.identity`: tests/test_methods.py)
    dpo = run_identity(TrainConfig(method="dpo"), 32, {"method": "dpo"})
    assert dpo == {**chess, "method": "dpo"}
