"""One row -> (input_ids, loss_mask), per format; then the rules every masked row follows.

`RowEncoder` is the `datasets.map` function of the masked formats (chat, prompt/completion,
alpaca, templates): a batch of raw rows in, per row its tokens, its loss mask, and why it was
dropped ("" if kept). The rules after encoding are the same for every format:

- a row longer than --max_seq_length is dropped, truncated to its start (dropped if nothing
  trained is left) or an error (--long_examples drop|truncate|error): never cut silently;
- a row with no trained token is dropped (it would add no loss and only dilute the batch);
- every drop is counted by cause, for the summary at the start of the log.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_utils.data.chat import ChatEncoder, ChatTemplate, Conversation, Encoded, to_messages
from fsdp_utils.data.formats import chat_column
from fsdp_utils.data.instruct import (
    PairEncoder,
    PromptAndAnswer,
    alpaca_pair,
    prompt_completion_pair,
    template_pair,
)

ROW_INDEX = "__row"  # the row's index in the dataset as read: errors and drops name it

# Why a row was dropped (the summary's words).
NO_ASSISTANT_TURN = "no assistant turn to train on"
TOO_LONG = "longer than --max_seq_length"
NOTHING_LEFT = "nothing to train on after truncation"
NOTHING_TRAINED = "no token to train on"


@dataclass
class RowEncoder:
    """`datasets.map(batched=True)` function: raw rows -> input_ids, loss_mask, dropped,
    truncated, merged (the prompt's last token merges with the answer's first)."""

    format: str  # one of formats.MASKED_FORMATS
    tokenizer: Any
    max_seq_length: int
    long_examples: str  # drop | truncate | error
    train_on_prompt: bool = False
    template: ChatTemplate | None = None  # chat, and prompt/completion message lists
    prompt_template: str | None = None
    response_template: str | None = None
    _chat_encoder: ChatEncoder | None = field(default=None, init=False, repr=False)

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        rows = batch[ROW_INDEX]
        encoded, merged = self.encode(batch)
        out: dict[str, list[Any]] = {
            "input_ids": [], "loss_mask": [], "dropped": [], "truncated": [], "merged": merged
        }  # fmt: skip
        for row, item in zip(rows, encoded, strict=True):
            ids, mask, dropped, truncated = self.limit(row, item)
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            out["dropped"].append(dropped)
            out["truncated"].append(truncated)
        return out

    def limit(self, row: int, item: Encoded | None) -> tuple[list[int], list[int], str, bool]:
        """Apply the length and nothing-to-train rules: (ids, mask, drop reason, truncated)."""
        if item is None:
            return [], [], NO_ASSISTANT_TURN, False
        ids, mask = item
        truncated = False
        if len(ids) > self.max_seq_length:
            if self.long_examples == "error":
                raise ValueError(
                    f"Row {row} has {len(ids):,} tokens, more than --max_seq_length "
                    f"{self.max_seq_length} (--long_examples error). Raise --max_seq_length, "
                    "drop such rows (--long_examples drop, the default) or keep their start "
                    "(--long_examples truncate); the log counts them."
                )
            if self.long_examples == "drop":
                return [], [], TOO_LONG, False
            ids, mask, truncated = ids[: self.max_seq_length], mask[: self.max_seq_length], True
        # A row's first token is never a target (it follows another row in a block).
        if not any(mask[1:]):
            return [], [], NOTHING_LEFT if truncated else NOTHING_TRAINED, False
        return ids, mask, "", truncated

    def encode(self, batch: dict[str, list[Any]]) -> tuple[list[Encoded | None], list[bool]]:
        """(input_ids, loss_mask) per row (None: nothing to train), and per row whether its
        prompt merged with its answer (string formats only)."""
        rows = batch[ROW_INDEX]
        conversations = self.conversations(batch)
        if conversations is not None:
            return self._chat()(conversations), [False] * len(rows)
        pairs = self.pairs(batch)
        encoded = PairEncoder(self.tokenizer, train_on_prompt=self.train_on_prompt)(pairs)
        return [(ids, mask) for ids, mask, _ in encoded], [m for _, _, m in encoded]

    def _chat(self) -> ChatEncoder:
        # One per RowEncoder (and so per map worker): it learns about the tokenizer once.
        if self._chat_encoder is None:
            assert self.template is not None, "chat rows need a chat template (prepare checks)"
            self._chat_encoder = ChatEncoder(
                self.tokenizer, self.template, train_on_prompt=self.train_on_prompt
            )
        return self._chat_encoder

    def conversations(self, batch: dict[str, list[Any]]) -> list[Conversation] | None:
        """The rows as conversations, or None for prompt/answer strings."""
        rows = batch[ROW_INDEX]
        if self.format == "chat":
            column = chat_column(list(batch))
            return [
                Conversation(to_messages(raw or [], row), row)
                for raw, row in zip(batch[column], rows, strict=True)
            ]
        if self.format == "prompt_completion" and uses_messages(batch):
            conversations = []
            for prompt, completion, row in zip(
                batch["prompt"], batch["completion"], rows, strict=True
            ):
                asked = _as_messages(prompt, "user", row)
                answered = _as_messages(completion, "assistant", row)
                conversations.append(Conversation([*asked, *answered], row, len(asked)))
            return conversations
        return None

    def pairs(self, batch: dict[str, list[Any]]) -> list[PromptAndAnswer]:
        n = len(batch[ROW_INDEX])
        rows = [{k: v[i] for k, v in batch.items()} for i in range(n)]
        if self.format == "alpaca":
            return [alpaca_pair(r) for r in rows]
        if self.format == "templates":
            assert self.prompt_template is not None and self.response_template is not None
            pair = template_pair(self.prompt_template, self.response_template)
            return [pair(r) for r in rows]
        assert self.format == "prompt_completion", self.format
        return [prompt_completion_pair(r) for r in rows]


def uses_messages(batch: Mapping[str, Sequence[Any]]) -> bool:
    """Prompt/completion rows whose fields are message lists (rendered as a chat)."""
    return any(isinstance(batch[c][0], list) for c in ("prompt", "completion") if batch[c])


def _as_messages(value: Any, role: str, row: int) -> list[dict[str, Any]]:
    if isinstance(value, list):
        return to_messages(value, row)
    return [{"role": role, "content": "" if value is None else str(value)}]
