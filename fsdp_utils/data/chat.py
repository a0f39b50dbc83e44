"""Chat rows through the tokenizer's chat template, with the loss on the assistant's turns only.

What carries loss: each trained assistant turn's content and the end-of-turn token(s) the
template writes after it; never a system, user or tool turn, and never a role header.

- A template with `{% generation %}` markers says so itself: `apply_chat_template(...,
  return_assistant_tokens_mask=True)`.
- Any other template (most, e.g. ChatML): assistant turn i spans the tokens from
  len(tokens(render(messages[:i], add_generation_prompt=True))) to
  len(tokens(render(messages[:i + 1]))): the header is what the generation prompt adds, and
  the end of the turn is what the template writes to close it. Each such prefix must render
  as the start of the whole conversation, and the opening's tokens (what the model is asked
  at inference) must be the whole's first tokens; a template that renders a conversation's
  beginning differently once more follows (Qwen3's drops earlier <think> parts) is refused,
  naming the template and the row: a mask is never guessed.

Rendered text is tokenised without adding special tokens: a template that writes the BOS
itself (Llama 3) gets exactly one. `check_end_of_turn` checks once per dataset that the token
closing an answer is trained (a model that never learns it never stops).

Cost: one render per prefix (cheap), one tokenisation of each whole conversation, and of each
prefix only the tail after its last special token (`ChatEncoder._prefix_lengths`), so a
conversation costs about one tokenisation however many turns it has.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")

# ShareGPT `from` values -> chat roles.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}

Message = dict[str, Any]


@dataclass(frozen=True)
class ChatTemplate:
    text: str
    source: str  # for messages: "the chat template of MODEL" or "--chat_template FILE"

    @property
    def has_generation_markers(self) -> bool:
        return GENERATION_MARKER.search(self.text) is not None


def chat_template(tokenizer: Any, *, template_file: str | None, model: str) -> ChatTemplate:
    """The template to render with: `--chat_template FILE`, else the tokenizer's own."""
    if template_file is not None:
        path = Path(template_file).expanduser()
        if not path.is_file():
            raise ValueError(
                f"--chat_template {template_file}: no such file. Give a Jinja chat template "
                "file, e.g. the chat_template.jinja of a model that has one."
            )
        return ChatTemplate(path.read_text(encoding="utf-8"), f"--chat_template {path}")
    own = tokenizer.chat_template
    if isinstance(own, dict):  # named templates: the default one
        own = own.get("default")
    if not own:
        raise ValueError(
            f"The tokenizer of {model} has no chat template, so chat rows cannot be rendered "
            "the way the model will be prompted. Give one with --chat_template FILE (a Jinja "
            "file, e.g. the chat_template.jinja of the instruct model of the same family); the "
            "final model is saved with it."
        )
    return ChatTemplate(own, f"the chat template of {model}")


def to_messages(raw: Sequence[Any], row: int) -> list[Message]:
    """OpenAI-style messages ({role, content}) from `messages` or ShareGPT ({from, value})."""
    messages = []
    for m in raw:
        if not isinstance(m, dict):
            raise ValueError(f"Row {row}: a message must be an object, got {m!r:.100}.")
        if m.get("role") is not None:
            messages.append(m)
        elif m.get("from") is not None:
            role = SHAREGPT_ROLES.get(str(m["from"]).lower())
            if role is None:
                raise ValueError(
                    f"Row {row}: unknown ShareGPT speaker {m['from']!r} (known: "
                    f"{', '.join(SHAREGPT_ROLES)}). Map it to a role in a --dataset_module."
                )
            messages.append({"role": role, "content": m.get("value")})
        else:
            raise ValueError(
                f"Row {row}: a message needs `role` and `content` (or ShareGPT `from` and "
                f"`value`), got keys {sorted(m)}."
            )
    return messages


@dataclass(frozen=True)
class Conversation:
    messages: list[Message]
    row: int  # the row's index in the dataset as read, for messages
    trained_from: int = 0  # assistant messages before this index carry no loss (prompt)

    def trained_turns(self) -> list[int]:
        # An assistant message that opens a conversation answers nothing: not trained.
        return [
            i
            for i, m in enumerate(self.messages)
            if m["role"] == "assistant" and i >= max(self.trained_from, 1)
        ]


Encoded = tuple[list[int], list[int]]  # input_ids, loss_mask


class ChatEncoder:
    """Tokens and loss masks of conversations, a batch at a time: three render calls (whole
    conversations, openings, turn ends) and two tokeniser calls (whole, tails) per batch."""

    def __init__(self, tokenizer: Any, template: ChatTemplate, *, train_on_prompt: bool) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.train_on_prompt = train_on_prompt
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self.added_ids = frozenset(added)
        contents = sorted({str(t) for t in added.values()}, key=len, reverse=True)
        self.added_pattern = re.compile("|".join(map(re.escape, contents))) if contents else None
        # Whether prefixes may be tokenised from their last added token on (`_prefix_lengths`):
        # decided on the first batch, against tokenising every prefix whole.
        self.tails_verified: bool | None = None

    def render(
        self, conversations: Sequence[list[Message]], *, generation_prompt: bool
    ) -> list[str]:
        if not conversations:
            return []
        try:
            return list(
                self.tokenizer.apply_chat_template(
                    list(conversations),
                    chat_template=self.template.text,
                    add_generation_prompt=generation_prompt,
                    tokenize=False,
                )
            )
        except Exception as err:  # a Jinja error, or the template's raise_exception
            raise ValueError(
                f"{self.template.source} cannot render the conversation: {err}. Fix the rows "
                "(a --dataset_module can), or give a template that accepts them with "
                "--chat_template FILE."
            ) from None

    def tokens(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of rendered texts (no special tokens added: the template wrote them)."""
        if not texts:
            return []
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:  # the Rust tokenizer, ids only: no offsets computed
            return [e.ids for e in backend.encode_batch_fast(list(texts), add_special_tokens=False)]
        return list(self.tokenizer(list(texts), add_special_tokens=False)["input_ids"])

    def __call__(self, conversations: Sequence[Conversation]) -> list[Encoded | None]:
        """(input_ids, loss_mask) per conversation; None for one with no trained turn."""
        if self.template.has_generation_markers and all(c.trained_from == 0 for c in conversations):
            return self._by_markers(conversations)
        return self._by_prefixes(conversations)

    def _by_markers(self, conversations: Sequence[Conversation]) -> list[Encoded | None]:
        if not conversations:
            return []
        try:
            out = self.tokenizer.apply_chat_template(
                [c.messages for c in conversations],
                chat_template=self.template.text,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
        except Exception as err:
            raise ValueError(
                f"{self.template.source} cannot render the conversation: {err}."
            ) from None
        encoded: list[Encoded | None] = []
        for c, ids, mask in zip(
            conversations, out["input_ids"], out["assistant_masks"], strict=True
        ):
            if self.train_on_prompt:
                mask = [1] * len(ids)
            encoded.append(
                (list(ids), list(mask)) if c.trained_turns() or self.train_on_prompt else None
            )
        return encoded

    def _by_prefixes(self, conversations: Sequence[Conversation]) -> list[Encoded | None]:
        """Turn i spans from the length of its opening's tokens (messages[:i] with the
        generation prompt: what the model is asked at inference) to the length of the tokens
        of the render through it; both renders must be the start of the whole text, and their
        tokens the first tokens of the whole."""
        turns = [(c, i) for c in conversations for i in c.trained_turns()]
        openings = self.render([c.messages[:i] for c, i in turns], generation_prompt=True)
        # A turn's end is the end of the render through it; the last turn's is the whole.
        closing = [(c, i) for c, i in turns if i + 1 < len(c.messages)]
        closings = self.render([c.messages[: i + 1] for c, i in closing], generation_prompt=False)
        texts = self.render([c.messages for c in conversations], generation_prompt=False)
        whole = {
            id(c): (text, ids)
            for c, text, ids in zip(conversations, texts, self.tokens(texts), strict=True)
        }
        ends = dict(zip(((id(c), i) for c, i in closing), closings, strict=True))
        prefixes = [(c, i, text, True) for (c, i), text in zip(turns, openings, strict=True)]
        prefixes += [(c, i, ends.get((id(c), i), whole[id(c)][0]), False) for c, i in turns]
        lengths = self._prefix_lengths(prefixes, whole)
        starts, stops = lengths[: len(turns)], lengths[len(turns) :]

        masks = {id(c): [0] * len(whole[id(c)][1]) for c in conversations}
        for (c, _), start, end in zip(turns, starts, stops, strict=True):
            masks[id(c)][start:end] = [1] * (end - start)
        encoded: list[Encoded | None] = []
        for c in conversations:
            full = whole[id(c)][1]
            if self.train_on_prompt:
                encoded.append((full, [1] * len(full)))
            else:
                encoded.append((full, masks[id(c)]) if c.trained_turns() else None)
        return encoded

    def _prefix_lengths(
        self,
        prefixes: Sequence[tuple[Conversation, int, str, bool]],
        whole: dict[int, tuple[str, list[int]]],
    ) -> list[int]:
        """len(tokens(prefix)) for each (conversation, turn, prefix text, is opening), each
        prefix checked to be the start of its conversation's text and its tokens the first
        tokens of the whole; a ValueError naming the template and row otherwise.

        A tokenizer cuts text at its added tokens (<|im_start|>, <|eot_id|>) before anything
        else, so such a prefix tokenises as the whole's tokens up to the prefix's last added
        token, then as its tail alone: only the tail (`assistant\n` in ChatML) is tokenised,
        and a conversation costs one tokenisation however many turns it has. The first batch
        checks this against tokenising each prefix whole; a tokenizer where it does not hold
        gets whole prefixes from then on.
        """
        for c, i, prefix, opening in prefixes:
            if not whole[id(c)][0].startswith(prefix):
                raise self._prefix_error(c, i, opening)
        fast = self._by_tails(prefixes, whole) if self.tails_verified is not False else None
        exact = None
        if self.tails_verified is not True:
            exact = [
                len(t) if whole[id(c)][1][: len(t)] == t else None
                for (c, _, _, _), t in zip(
                    prefixes, self.tokens([p for _, _, p, _ in prefixes]), strict=True
                )
            ]
            if self.tails_verified is None:
                self.tails_verified = fast == exact
        lengths = fast if self.tails_verified else exact
        assert lengths is not None
        checked = []
        for (c, i, _, opening), n in zip(prefixes, lengths, strict=True):
            if n is None:
                raise self._prefix_error(c, i, opening)
            checked.append(n)
        return checked

    def _by_tails(
        self,
        prefixes: Sequence[tuple[Conversation, int, str, bool]],
        whole: dict[int, tuple[str, list[int]]],
    ) -> list[int | None]:
        """Token counts of prefixes from their tails (see `_prefix_lengths`); None for a
        prefix whose tokens are not the first tokens of the whole."""
        # Per conversation: where its added tokens end in the text, and their token indices.
        marks: dict[int, tuple[list[int], list[int]]] = {}
        cuts, tails = [], []
        for c, _, prefix, _ in prefixes:
            if id(c) not in marks:
                text, ids = whole[id(c)]
                found = (
                    [m.end() for m in self.added_pattern.finditer(text)]
                    if self.added_pattern
                    else []
                )
                at = [k for k, t in enumerate(ids) if t in self.added_ids]
                marks[id(c)] = (found, at) if len(found) == len(at) else ([], [])
            found, at = marks[id(c)]
            m = bisect.bisect_right(found, len(prefix))  # added tokens inside the prefix
            cuts.append(at[m - 1] + 1 if m else 0)
            tails.append(prefix[found[m - 1] :] if m else prefix)
        lengths: list[int | None] = []
        for (c, _, _, _), k, tail in zip(prefixes, cuts, self.tokens(tails), strict=True):
            ids = whole[id(c)][1]
            lengths.append(k + len(tail) if ids[k : k + len(tail)] == tail else None)
        return lengths

    def _prefix_error(self, c: Conversation, turn: int, opening: bool) -> ValueError:
        shown = repr(c.messages)
        shown = shown if len(shown) <= 300 else shown[:300] + "...]"
        rendered = (
            f"messages[:{turn}] with the assistant header" if opening else f"messages[:{turn + 1}]"
        )
        return ValueError(
            f"{self.template.source} renders the start of a conversation differently once "
            f"more messages follow: in row {c.row}, the tokens of {rendered} are not the "
            "first tokens of the whole conversation. Templates that rewrite earlier turns "
            "(Qwen3's drops earlier <think> parts) do this, and so does a header ending in a "
            "space that the answer's first word takes over; the assistant's tokens cannot be "
            "found by rendering prefixes then. Give a template that renders earlier turns "
            "unchanged and ends its headers with a newline, or one with {% generation %} "
            "markers around the assistant's content and end-of-turn token, with "
            f"--chat_template FILE. Row {c.row}: {shown}"
        )


@dataclass(frozen=True)
class EndOfTurn:
    token: str
    id: int
    special: bool  # a special or added token (<|im_end|>, <|eot_id|>), not text such as "\n"


def check_end_of_turn(
    encoder: ChatEncoder, conversations: Sequence[Conversation]
) -> EndOfTurn | None:
    """Check that the token after each trained answer (the end-of-turn token) is trained, on
    the first conversation whose answers can be found in its rendered text; return that token,
    or None if no conversation could be checked. A template that writes nothing after an
    answer, or a mask that leaves the token out, is a ValueError."""
    tokenizer = encoder.tokenizer
    for c in conversations:
        turns = [i for i in c.trained_turns() if isinstance(c.messages[i].get("content"), str)]
        if not turns:
            continue
        (encoded,) = encoder([c])
        if encoded is None:
            continue
        ids, mask = encoded
        text = encoder.render([c.messages], generation_prompt=False)[0]
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        assert list(enc["input_ids"]) == list(ids), "the encoder tokenises the rendered text"
        offsets = enc["offset_mapping"]
        searched_from, seen = 0, None
        for i in turns:
            # Search after the turn's header: the answer's words may also be in the prompt.
            opening = encoder.render([c.messages[:i]], generation_prompt=True)[0]
            if text.startswith(opening):
                searched_from = max(searched_from, len(opening))
            content = c.messages[i]["content"].strip()
            at = text.find(content, searched_from) if content else -1
            if at < 0:
                break  # the template rewrites the content: cannot tell where it ends
            end = at + len(content)
            searched_from = end
            after = next((k for k, (_, stop) in enumerate(offsets) if stop > end), None)
            if after is None:
                raise ValueError(
                    f"{encoder.template.source} writes nothing after an assistant answer (row "
                    f"{c.row}): there is no end-of-turn token to train, and the model would "
                    "never learn to stop. Give a template that closes every turn (e.g. with "
                    "the EOS token) with --chat_template FILE."
                )
            token = tokenizer.convert_ids_to_tokens(ids[after])
            if not mask[after]:
                raise ValueError(
                    f"The loss mask leaves out the end-of-turn token {token!r} after an "
                    f"assistant answer (row {c.row}, {encoder.template.source}): the model "
                    "would never learn to stop. With {% generation %} markers, put the "
                    "end-of-turn token inside them (--chat_template FILE)."
                )
            special = (
                ids[after] in tokenizer.all_special_ids or token in tokenizer.get_added_vocab()
            )
            seen = EndOfTurn(token, ids[after], special)
        else:
            return seen
    return None
