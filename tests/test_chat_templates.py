"""The chat templates model families publish (tests/fixtures/chat_templates, sources there):
which tokens carry loss, token by token, against an expectation written per family.

Each family gets a tiny byte-level tokenizer with its template and special tokens; a few
hundred generated conversations (some with a system message, some answers that repeat the
prompt, start with a space, or read like a role name) are prepared by `prepare_dataset`, and
every row's mask is compared with one computed here independently of the encoder: from the
family's own rule (the header before an answer, how the template writes the answer, the token
that closes it), located in the row's decoded tokens. Exactly each answer and its end-of-turn
token is trained, for every turn; templates that rewrite answers are handled or refused as
`fsdp_utils.data.chat` says.
"""

from __future__ import annotations

import copy
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import IGNORE_INDEX
from fsdp_utils.data.prepare import PreparedData, prepare_dataset
from fsdp_utils.synthetic import random_words, train_chat_tokenizer
from tests.chat_helpers import write_jsonl

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
ROWS = 240
Message = dict[str, str]


def _same(messages: list[Message], k: int) -> str:
    return messages[k]["content"]


def _trimmed(messages: list[Message], k: int) -> str:
    return messages[k]["content"].strip()


@dataclass(frozen=True)
class Family:
    """A template's own rule: `header` (a regex) comes right before each answer, `shown` is
    the answer's text as the template writes it, `eot` the special token that closes it."""

    header: str
    eot: str
    special: dict[str, str]  # bos_token / eos_token / pad_token
    others: tuple[str, ...] = ()  # other special tokens the template writes
    plain: tuple[str, ...] = ()  # added tokens that are not special
    shown: Callable[[list[Message], int], str] = _same
    system: bool = True  # the template accepts a system message


LLAMA3 = Family(
    re.escape("<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "<|eot_id|>",
    {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|finetune_right_pad_id|>",
    },
    ("<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"),
    shown=_trimmed,
)
CHATML = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
GEMMA = Family(
    re.escape("<start_of_turn>model\n"),
    "<end_of_turn>",
    {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
    ("<start_of_turn>",),
    shown=_trimmed,
)
MISTRAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
MISTRAL_TOKENS = ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]")


def _qwen3_shown(messages: list[Message], k: int) -> str:
    """Qwen3 writes an answer before the last user turn without its <think> part."""
    content = messages[k]["content"]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    if k < last_user and "</think>" in content:
        return content.split("</think>")[-1].lstrip("\n")
    return content


FAMILIES: dict[str, Family] = {
    "llama3_1": LLAMA3,
    "llama3_2": LLAMA3,
    "qwen2_5": Family(
        re.escape("<|im_start|>assistant\n"), "<|im_end|>", CHATML, ("<|im_start|>",),
        plain=("<tool_call>", "</tool_call>"),
    ),
    "qwen3": Family(
        # The last answer, when it has no <think> part, gets an empty one.
        re.escape("<|im_start|>assistant\n") + "(?:" + re.escape("<think>\n\n</think>\n\n") + ")?",
        "<|im_end|>", CHATML, ("<|im_start|>",),
        plain=("<think>", "</think>", "<tool_call>", "</tool_call>"), shown=_qwen3_shown,
    ),
    "smollm2": Family(
        re.escape("<|im_start|>assistant\n"), "<|im_end|>",
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"},
        ("<|endoftext|>",),
    ),
    "gemma2": Family(GEMMA.header, GEMMA.eot, GEMMA.special, GEMMA.others, shown=_trimmed,
                     system=False),
    "gemma3": GEMMA,
    "phi3_5": Family(
        re.escape("<|assistant|>\n"), "<|end|>",
        {"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
        ("<|system|>", "<|user|>", "<|assistant|>"),
    ),
    "phi4_mini": Family(
        re.escape("<|assistant|>"), "<|end|>",
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
        ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|/tool|>"),
    ),
    "mistral_nemo": Family(re.escape("[/INST]"), "</s>", MISTRAL, MISTRAL_TOKENS),
    "mistral_small": Family(
        re.escape("[/INST]"), "</s>", MISTRAL,
        (*MISTRAL_TOKENS, "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"),
    ),
    "deepseek_r1_distill": Family(
        re.escape("<｜Assistant｜>"), "<｜end▁of▁sentence｜>",
        {
            "bos_token": "<｜begin▁of▁sentence｜>",
            "eos_token": "<｜end▁of▁sentence｜>",
            "pad_token": "<｜end▁of▁sentence｜>",
        },
        plain=("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"),
        # Its template drops an answer's <think> part wherever it is.
        shown=lambda messages, k: messages[k]["content"].split("</think>")[-1],
    ),
    "olmo2": Family(
        re.escape("<|assistant|>\n"), "<|endoftext|>",
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"},
    ),
    "granite3": Family(
        re.escape("<|start_of_role|>assistant<|end_of_role|>"), "<|end_of_text|>",
        {"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>",
         "pad_token": "<|end_of_text|>"},
        ("<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"),
    ),
}  # fmt: skip


def test_every_family_has_its_published_template():
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(FAMILIES)
    sources = (TEMPLATES / "README.md").read_text()
    assert all(f"`{name}.jinja`" in sources for name in FAMILIES)


@pytest.fixture(scope="module")
def base():
    return train_chat_tokenizer()


def _save_tokenizer(folder: Path, base: Any, name: str) -> Path:
    """The family's tokenizer: the tiny byte-level BPE with its special tokens and template."""
    from tokenizers import AddedToken
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    family = FAMILIES[name]
    raw = copy.deepcopy(base)
    special = [*family.special.values(), *family.others, family.eot]
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.plain])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, **family.special)
    tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    tokenizer.save_pretrained(folder)
    # Preparation reads the tokenizer only; the folder is a model's, so it has a config.
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, num_attention_heads=2).save_pretrained(
        folder
    )
    return folder


def conversations(name: str, n: int, seed: int) -> list[list[Message]]:
    """n conversations of 1-4 user/assistant turns, 40% with a system message (where the
    template takes one), each tagged `qN` in its first prompt; answers: random words, some
    repeating their prompt, starting with a space, ending with a newline, or reading like a
    role name or header word. Qwen3 and DeepSeek-R1 rows: some answers carry a <think> part,
    never the last one."""
    rng = random.Random(seed)
    family = FAMILIES[name]
    rows = []
    for q in range(n):
        messages: list[Message] = []
        if family.system and rng.random() < 0.4:
            messages.append({"role": "system", "content": random_words(rng, rng.randint(2, 8))})
        turns = rng.randint(1, 4)
        for t in range(turns):
            prompt = random_words(rng, rng.randint(2, 10))
            messages.append({"role": "user", "content": f"q{q} {prompt}" if t == 0 else prompt})
            kind = rng.random()
            if kind < 0.1:
                answer = prompt
            elif kind < 0.2:
                answer = rng.choice(["assistant", "Assistant", "model", "user", "INST", "end"])
            elif kind < 0.3:
                answer = " " + random_words(rng, rng.randint(1, 6))
            elif kind < 0.35:
                answer = random_words(rng, rng.randint(1, 6)) + "\n"
            else:
                answer = random_words(rng, rng.randint(1, 12))
            thinks = name in ("qwen3", "deepseek_r1_distill") and t + 1 < turns
            if thinks and rng.random() < 0.5:
                answer = f"<think>\n{random_words(rng, 4)}\n</think>\n\n{answer.strip()}"
            messages.append({"role": "assistant", "content": answer})
        rows.append(messages)
    return rows


def expected_mask(name: str, messages: list[Message], pieces: list[str]) -> list[bool]:
    """The family's rule on a row's tokens (decoded one by one): for each answer in order,
    find header + answer as written + end-of-turn token; train the tokens of answer + token,
    except an earlier answer the template wrote without its reasoning (context)."""
    family = FAMILIES[name]
    text = "".join(pieces)
    spans, cursor = [], 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        shown = family.shown(messages, k)
        found = re.compile(family.header + re.escape(shown + family.eot)).search(text, cursor)
        assert found is not None, (name, k, shown, text)
        cursor = found.end()
        if shown == m["content"] or shown == m["content"].strip():
            spans.append((cursor - len(shown) - len(family.eot), cursor))
    mask, at = [], 0
    for piece in pieces:
        mask.append(any(at < end and start < at + len(piece) for start, end in spans))
        at += len(piece)
    return mask


def _prepare(model: Path, rows: list[list[Any]], folder: Path) -> tuple[PreparedData, list]:
    data = write_jsonl(folder / "chat.jsonl", [{"messages": m} for m in rows])
    config = TrainConfig(
        model=str(model), dataset=str(data), data_cache_dir=str(folder / "cache"),
        max_seq_length=2048, eval_examples=0, no_packing=True, long_examples="error",
    )  # fmt: skip
    lines: list[str] = []
    prepared = prepare_dataset(config, log=lines.append)
    return PreparedData(prepared, json.loads((prepared / "meta.json").read_text())), lines


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_answer_and_its_end_of_turn_token_and_nothing_else(name, base, tmp_path):
    from transformers import AutoTokenizer

    model = _save_tokenizer(tmp_path / "model", base, name)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = conversations(name, ROWS, seed=len(name))
    prepared, lines = _prepare(model, rows, tmp_path)
    stats = prepared.meta["stats"]
    assert stats["train"]["documents"] == ROWS and not stats["train"]["dropped"]
    assert stats["end_of_turn"] == FAMILIES[name].eot
    assert any(
        "answers found by locating each answer's text in the rendered conversation" in line
        and f"end-of-turn token {FAMILIES[name].eot} trained" in line
        for line in lines
    ), lines

    blocks = prepared.split("train")
    batch = blocks.batch(np.arange(len(blocks)))
    checked = trained = 0
    for r in range(len(blocks)):
        n = int(blocks.lengths[r])
        ids = batch["input_ids"][r, :n].tolist()
        got = (batch["labels"][r, :n] != IGNORE_INDEX).tolist()
        pieces = [str(tokenizer.decode([t])) for t in ids]
        q = int(re.search(r"q(\d+) ", "".join(pieces)).group(1))  # type: ignore[union-attr]
        want = expected_mask(name, rows[q], pieces)
        assert got == want, (
            name,
            q,
            [(p, g, w) for p, g, w in zip(pieces, got, want, strict=True) if g != w],
        )
        checked += 1
        trained += sum(got)
    assert checked == ROWS and trained == stats["train"]["trained_tokens"] > 0


@pytest.mark.parametrize(
    ("name", "messages", "message"),
    [
        (  # the template's own refusal, passed on
            "gemma2",
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "ka"}],
            r"the chat template of .* cannot render the conversation of row 0: System role not "
            r"supported",
        ),
        (  # the reasoning of the last answer would never be trained
            "deepseek_r1_distill",
            [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nka"}],
            r"cannot be masked for the assistant answer in message 1 of row 0: the template "
            r"drops its <think>\.\.\.</think> part although it is the last answer",
        ),
        (  # Qwen3 drops it from an answer before the last user turn
            "qwen3",
            [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nka"},
             {"role": "user", "content": "and"}],
            r"message 1 of row 0: the template drops its <think>\.\.\.</think> part although "
            r"it is the last answer",
        ),
    ],
)  # fmt: skip
def test_templates_that_cannot_be_masked_are_refused_for_their_reason(
    name, messages, message, base, tmp_path
):
    model = _save_tokenizer(tmp_path / "model", base, name)
    with pytest.raises(ValueError, match=message):
        _prepare(model, [messages] * 4, tmp_path)


def test_a_tool_call_is_trained_as_the_template_writes_it(base, tmp_path):
    """An answer that is a tool call has no text of its own to find: what Qwen2.5's template
    writes after the generation prompt, through <|im_end|>, is trained; the tool's result is
    not, and the answer after it is, as any answer."""
    from transformers import AutoTokenizer

    from tests.chat_helpers import row_segments

    call = {"type": "function", "function": {"name": "lookup", "arguments": {"q": "ka"}}}
    messages: list[Any] = [
        {"role": "user", "content": "q0 find ka"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "lo mi"},
        {"role": "assistant", "content": "it is lo mi"},
    ]
    model = _save_tokenizer(tmp_path / "model", base, "qwen2_5")
    prepared, _ = _prepare(model, [messages] * 2, tmp_path)
    trained = [
        t for t, flag in row_segments(prepared, AutoTokenizer.from_pretrained(model)) if flag
    ]
    assert trained == [
        '<tool_call>\n{"name": "lookup", "arguments": {"q": "ka"}}\n</tool_call><|im_end|>',
        "it is lo mi<|im_end|>",
    ]


def test_qwen3_trains_the_last_answer_with_its_reasoning_and_earlier_ones_not(base, tmp_path):
    """Qwen3 shows an answer before the last user turn without its <think> part (context, not
    trained); the last answer, written as the template writes it, is trained whole."""
    from transformers import AutoTokenizer

    from tests.chat_helpers import row_segments

    messages = [
        {"role": "user", "content": "q0 hi"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nka lo"},
        {"role": "user", "content": "and"},
        {"role": "assistant", "content": "<think>\nso\n</think>\n\nmi ne"},
    ]
    model = _save_tokenizer(tmp_path / "model", base, "qwen3")
    prepared, _ = _prepare(model, [messages] * 2, tmp_path)
    runs = row_segments(prepared, AutoTokenizer.from_pretrained(model))
    assert [text for text, trained in runs if trained] == [
        "<think>\nso\n</think>\n\nmi ne<|im_end|>"
    ]
    assert "<|im_start|>assistant\nka lo<|im_end|>" in runs[0][0]  # shown without its reasoning
