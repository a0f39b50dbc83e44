"""Prompts for methods that sample their own answers (`--method grpo`): TRL's prompt-only format.

A row has a `prompt`, text or a list of chat messages, and any other columns, which the reward
functions receive as keyword arguments (an answer to check against, a chess position). As TRL's
GRPOTrainer encodes them (trl 1.16.0, `GRPOTrainer._tokenize_prompts`): a text prompt is
tokenised as it is, special tokens added (the BOS of tokenizers that have one); messages go
through the chat template with the generation prompt (`add_generation_prompt=True`), so the
model's answer starts where the assistant's turn does.

Prepared layout (`fsdp_utils.data.prepare`), per split: `<split>_prompt_ids.npy` (every prompt's
tokens, end to end, int32) with `<split>_prompt_offsets.npy` (where each starts, and the end),
`<split>_prompt_rows.npy` (each prompt's row in the dataset as read: the completions' seeds are
drawn from it, whatever the world size) and `<split>_prompt_columns.jsonl` (the raw `prompt` and
the other columns of each, one JSON object per line). A prompt is never truncated: one longer
than --max_seq_length minus --max_completion_length stops the preparation, naming it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fsdp_utils.data.chat import ChatTemplate, to_messages

PROMPT_COLUMN = "prompt"
PROMPT_INDEX = "prompt_index"  # a batch's key: each prompt's index in its split, [prompts] int64


def is_messages(prompt: Any) -> bool:
    """A conversational prompt (TRL's `is_conversational`): a list of role/content messages."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def jsonable(value: Any) -> Any:
    """A column's value as JSON holds it (numpy scalars and arrays from parquet, NaN as None)."""
    if isinstance(value, np.ndarray):
        return [jsonable(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


@dataclass
class PromptEncoder:
    """A prompt (text or messages) -> its token ids, as TRL's GRPOTrainer encodes it."""

    tokenizer: Any
    template: ChatTemplate | None  # needed once a prompt is a list of messages

    def __call__(self, prompt: Any, row: int) -> list[int]:
        if is_messages(prompt):
            if self.template is None:
                raise ValueError(
                    f"Row {row}'s prompt is a list of chat messages, and the model's tokenizer "
                    "has no chat template to render it with. Give one with --chat_template "
                    "FILE, or give the prompts as text."
                )
            text = self.tokenizer.apply_chat_template(
                to_messages(prompt, row), chat_template=self.template.text,
                add_generation_prompt=True, tokenize=False,
            )  # fmt: skip
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(
                f"Row {row} has no prompt ({type(prompt).__name__} {prompt!r}): every row "
                "needs a `prompt`, text or a list of chat messages."
            )
        return list(self.tokenizer(prompt)["input_ids"])


def end_of_turn_id(tokenizer: Any, template: ChatTemplate) -> int | None:
    """The special token the template closes an assistant turn with (ChatML's <|im_end|>,
    Llama 3's <|eot_id|>), where it is not the tokenizer's EOS: a completion ends there too."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Fine"}]
    text = tokenizer.apply_chat_template(probe, chat_template=template.text, tokenize=False)
    after = text[text.rindex("Fine") + len("Fine") :]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = set(getattr(tokenizer, "all_special_ids", []))
    special |= {i for i, token in added.items() if getattr(token, "special", False)}
    first = next((i for i in ids if i in special), None)
    return None if first is None or first == tokenizer.eos_token_id else int(first)


@dataclass
class PromptSplit:
    """A split's prompts as they are written: tokens, rows and columns."""

    ids: list[list[int]] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    columns: list[dict[str, Any]] = field(default_factory=list)

    def write(self, folder: Path, split: str) -> dict[str, Any]:
        lengths = np.array([len(i) for i in self.ids], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = [t for ids in self.ids for t in ids]
        np.save(folder / f"{split}_prompt_ids.npy", np.asarray(flat, dtype=np.int32))
        np.save(folder / f"{split}_prompt_offsets.npy", offsets)
        np.save(folder / f"{split}_prompt_rows.npy", np.asarray(self.rows, dtype=np.int64))
        with open(folder / f"{split}_prompt_columns.jsonl", "w", encoding="utf-8") as f:
            for columns in self.columns:
                f.write(json.dumps(columns, ensure_ascii=False) + "\n")
        return {
            "documents": len(self.ids),
            "tokens": int(lengths.sum()),
            "longest": int(lengths.max(initial=0)),
            "mean_length": float(lengths.mean()) if len(lengths) else 0.0,
        }


def check_prompt_lengths(
    lengths: Sequence[int], rows: Sequence[int], *, limit: int, max_seq_length: int
) -> None:
    """Every prompt leaves --max_completion_length tokens in --max_seq_length; else one
    paragraph naming how many do not, the longest, and the fixes."""
    too_long = [(n, r) for n, r in zip(lengths, rows, strict=True) if n > limit]
    if not too_long:
        return
    longest, row = max(too_long)
    completion = max_seq_length - limit
    raise ValueError(
        f"{len(too_long):,} of {len(lengths):,} prompts are longer than the {limit} tokens "
        f"--max_seq_length {max_seq_length} leaves beside --max_completion_length {completion} "
        f"(the longest: {longest} tokens, row {row}). Prompts are never cut: raise "
        f"--max_seq_length to {longest + completion}, lower --max_completion_length, or leave "
        "the long prompts out of the data."
    )


class PromptSet:
    """A prepared split of prompts; `batch` gives their indices (`PROMPT_INDEX`), and the
    method reads each one's tokens (`prompt_ids`) and columns (`columns`). Its length counts
    prompts, so the step sampler and the total batch count prompts too."""

    def __init__(self, folder: Path, split: str) -> None:
        self.folder, self.split = folder, split
        path = folder / f"{split}_prompt_ids.npy"
        present = path.is_file()
        self.ids = np.load(path, mmap_mode="r") if present else np.zeros(0, np.int32)
        self.offsets = (
            np.load(folder / f"{split}_prompt_offsets.npy") if present else np.zeros(1, np.int64)
        )
        self.rows = np.load(folder / f"{split}_prompt_rows.npy") if present else np.zeros(0)
        self._columns: list[dict[str, Any]] | None = None

    @classmethod
    def load(cls, folder: Path, split: str) -> PromptSet:
        return cls(folder, split)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def prompt_ids(self, index: int) -> list[int]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return [int(t) for t in self.ids[start:end]]

    def row(self, index: int) -> int:
        """The prompt's row in the dataset as read."""
        return int(self.rows[index])

    def columns(self, index: int) -> dict[str, Any]:
        """The raw `prompt` and the other columns of the prompt (read once, then kept)."""
        if self._columns is None:
            path = self.folder / f"{self.split}_prompt_columns.jsonl"
            with open(path, encoding="utf-8") as f:
                self._columns = [json.loads(line) for line in f]
        return self._columns[index]

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        return {PROMPT_INDEX: torch.from_numpy(np.asarray(indices, dtype=np.int64))}
