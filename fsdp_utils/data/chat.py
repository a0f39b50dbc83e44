"""Chat rows through the tokenizer's chat template, with the loss on the assistant's turns only.

What carries loss: each trained assistant answer's tokens and the end-of-turn token that closes
it (<|im_end|>, <|eot_id|>, <end_of_turn>, <|end|>, </s>, ...), and nothing else: no system,
user or tool turn, no role header, nothing the template writes after the end-of-turn token
(ChatML's "\n", the EOS Phi-3.5 writes after the last turn).

- A template with `{% generation %}` markers says so itself: `apply_chat_template(...,
  return_assistant_tokens_mask=True)`.
- Any other template (most): the conversation is rendered once and tokenised with character
  offsets; each trained answer's text is found in the rendering, in order, after its opening
  (messages[:i] with the generation prompt) where that opening is the start of the rendering,
  else after the messages before it (Mistral Nemo moves the system prompt into the last user
  turn; DeepSeek-R1's generation prompt adds <think>). The trained tokens are those holding the
  answer's characters (with whitespace the template writes between the header and the answer,
  and stripped if the template trims: Llama 3, Gemma), through the first special token after
  it: the end-of-turn token. Only whitespace may come between; text there (a template that
  closes turns with words, or nothing at all) is an error naming the row.
- An answer whose text the template rewrites: Qwen3's drops the <think> part of answers before
  the last user turn, as the model sees them at inference: such an answer is context, not
  trained (its authors' meaning); any other rewritten answer (a tool call) is what the template
  writes after the generation prompt, through the end-of-turn token, where that opening is the
  start of the rendering; otherwise (DeepSeek-R1 drops the reasoning of the last answer too) an
  error naming the row and the cause: a mask is never guessed.

Rendered text is tokenised without adding special tokens: a template that writes the BOS
itself (Llama 3) gets exactly one. Cost: two renders (whole, openings) and one tokenisation
per conversation, however many turns it has; each token's characters follow from its ids
(`ChatEncoder.tokens`).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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
    """Tokens and loss masks of conversations, a batch at a time: two render calls (whole
    conversations, and each trained turn's opening) and one tokeniser call."""

    def __init__(self, tokenizer: Any, template: ChatTemplate, *, train_on_prompt: bool) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.train_on_prompt = train_on_prompt
        # End-of-turn candidates: special tokens (<|im_end|>, <|eot_id|>, </s>), not added
        # ones that are ordinary text to the model (Qwen3's <think>, <tool_call>).
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self.added_ids = frozenset(added)
        special = {i for i, t in added.items() if getattr(t, "special", True)}
        self.special_ids = frozenset(special | set(getattr(tokenizer, "all_special_ids", [])))
        # Whether token positions may come from the ids alone (`tokens`): decided on the
        # first batch, against the tokenizer's offsets.
        self.bytes_per_id: np.ndarray | None = None
        self.ids_give_offsets: bool | None = None

    @property
    def rule(self) -> str:
        """How the answers are found, for the summary at the start of the log."""
        if self.template.has_generation_markers:
            return "the template's {% generation %} markers"
        return "locating each answer's text in the rendered conversation (character offsets)"

    def render(
        self,
        conversations: Sequence[list[Message]],
        *,
        generation_prompt: bool,
        rows: Sequence[int] | None = None,
    ) -> list[str]:
        """The conversations rendered to text; a ValueError naming the row (`rows`: each
        conversation's row) that the template refuses, with the template's own message."""
        if not conversations:
            return []

        def render(batch: list[list[Message]]) -> list[str]:
            return list(
                self.tokenizer.apply_chat_template(
                    batch,
                    chat_template=self.template.text,
                    add_generation_prompt=generation_prompt,
                    tokenize=False,
                )
            )

        try:
            return render(list(conversations))
        except Exception as err:  # a Jinja error, or the template's raise_exception
            cause, row = err, " a row"
            for k, messages in enumerate(conversations):  # which row: render them one by one
                try:
                    render([messages])
                except Exception as one:
                    cause, row = one, f" row {rows[k]}" if rows is not None else row
                    break
            raise ValueError(
                f"{self.template.source} cannot render the conversation of{row}: "
                f"{cause}. Fix the rows (a --dataset_module can), or give a template that accepts "
                "them with --chat_template FILE."
            ) from None

    def tokens(self, texts: Sequence[str]) -> list[Rendered]:
        """Token ids of rendered texts (no special tokens added: the template wrote them) and
        each token's characters.

        The tokenizer's offsets cost about a third more than its ids alone; a byte-level BPE's
        tokens each stand for as many bytes as their vocabulary entry has characters, so the
        characters follow from the ids (`_from_ids`). The first batch checks that against
        the offsets; a tokenizer where it does not hold gets the offsets from then on."""
        if not texts:
            return []
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                "The model's tokenizer is a slow (Python) tokenizer, which cannot say where "
                "each token lies in the text, so the answers of chat rows cannot be found. "
                "Save it as a fast one into the model's folder: AutoTokenizer.from_pretrained("
                "MODEL, use_fast=True).save_pretrained(MODEL)."
            )
        fast: list[Rendered | None] = []
        if self.bytes_per_id is None:
            self.bytes_per_id = _bytes_per_id(self.tokenizer)
        if self.ids_give_offsets is not False:
            encoded = backend.encode_batch_fast(list(texts), add_special_tokens=False)
            fast = [self._from_ids(t, e.ids) for t, e in zip(texts, encoded, strict=True)]
            if self.ids_give_offsets and None not in fast:
                return fast  # type: ignore[return-value]
        full = [
            Rendered(text, e.ids, [s for s, _ in e.offsets], [e for _, e in e.offsets])
            for text, e in zip(
                texts, backend.encode_batch(list(texts), add_special_tokens=False), strict=True
            )
        ]
        if self.ids_give_offsets is None:
            self.ids_give_offsets = fast == full
        return full

    def _from_ids(self, text: str, ids: list[int]) -> Rendered | None:
        """Each token's characters from its byte count (None if they do not add up)."""
        assert self.bytes_per_id is not None
        ends = np.cumsum(self.bytes_per_id[ids]) if ids else np.zeros(0, np.int64)
        data = np.frombuffer(text.encode("utf-8"), np.uint8)
        if (ends[-1] if len(ends) else 0) != len(data):
            return None
        starts = np.concatenate([[0], ends[:-1]]) if len(ends) else ends
        if len(data) != len(text) and len(ends):
            # Not ASCII: a token spans the characters its bytes are part of (as the
            # tokenizer's offsets say; a character split over two tokens is in both).
            upto = np.cumsum((data & 0xC0) != 0x80)  # characters begun by byte b and before
            starts, ends = upto[starts] - 1, upto[ends - 1]
        return Rendered(text, list(ids), starts.tolist(), ends.tolist())

    def __call__(self, conversations: Sequence[Conversation]) -> list[Encoded | None]:
        """(input_ids, loss_mask) per conversation; None for one with no trained turn."""
        if self.template.has_generation_markers and all(c.trained_from == 0 for c in conversations):
            return self._by_markers(conversations)
        if self.train_on_prompt:  # every token: no answer to find
            texts = self.render(
                [c.messages for c in conversations],
                generation_prompt=False,
                rows=[c.row for c in conversations],
            )
            return [(r.ids, [1] * len(r.ids)) for r in self.tokens(texts)]
        encoded: list[Encoded | None] = []
        for c, rendered, answers in self.answers(conversations):
            mask = [0] * len(rendered.ids)
            for a in answers:
                mask[a.first : a.end_of_turn + 1] = [1] * (a.end_of_turn + 1 - a.first)
            encoded.append((rendered.ids, mask) if c.trained_turns() else None)
        return encoded

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
            # The same rows as text: the error names the row the template refuses.
            self.render(
                [c.messages for c in conversations],
                generation_prompt=False,
                rows=[c.row for c in conversations],
            )
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

    def answers(
        self, conversations: Sequence[Conversation]
    ) -> list[tuple[Conversation, Rendered, list[Answer]]]:
        """Each conversation rendered whole and tokenised, with the token span of each of its
        trained answers (see the module's docstring for the rule)."""
        texts = self.render(
            [c.messages for c in conversations],
            generation_prompt=False,
            rows=[c.row for c in conversations],
        )
        rendered = self.tokens(texts)
        turns = [(c, i) for c in conversations for i in c.trained_turns()]
        opened = self.render(
            [c.messages[:i] for c, i in turns],
            generation_prompt=True,
            rows=[c.row for c, _ in turns],
        )
        openings = dict(zip(((id(c), i) for c, i in turns), opened, strict=True))
        return [
            (c, r, self._locate(c, r, {i: openings[id(c), i] for i in c.trained_turns()}))
            for c, r in zip(conversations, rendered, strict=True)
        ]

    def _locate(self, c: Conversation, r: Rendered, openings: dict[int, str]) -> list[Answer]:
        text, ids, starts, ends = r.text, r.ids, r.starts, r.ends
        answers: list[Answer] = []
        cursor = 0  # the end of what was found so far: the next answer lies after it
        done = 0  # messages passed by the cursor
        trained = c.trained_turns()
        for n, i in enumerate(trained):
            opening = openings[i]
            prefix = text.startswith(opening) and len(opening) >= cursor
            if prefix:
                low = len(opening)
            else:
                # The opening renders otherwise (Mistral Nemo moves the system prompt into
                # the last user turn; DeepSeek-R1's generation prompt opens <think>): the
                # answer comes after the messages before it, found in order.
                for m in c.messages[done:i]:
                    content = m.get("content")
                    if m["role"] != "system" and isinstance(content, str) and content:
                        at = text.find(content, cursor)
                        cursor = at + len(content) if at >= 0 else cursor
                low = cursor
            done = i + 1
            content = c.messages[i].get("content")
            span = self._find(content, text, low, starts, ids, check_between=prefix)
            if span is None:
                reasoning = isinstance(content, str) and "</think>" in content
                last = n + 1 == len(trained)
                if reasoning and not last:
                    # Qwen3's template shows earlier answers without their reasoning, as the
                    # model sees them at inference: context, not trained.
                    answer = str(content).split("</think>")[-1]
                    shown = self._find(answer, text, low, starts, ids, check_between=prefix)
                    if shown is not None:
                        cursor = shown[1]
                        continue
                if reasoning or not prefix:
                    raise self._rewritten(c, i, reasoning=reasoning, last=last)
                # The template writes the answer otherwise (a tool call, a reasoning part
                # laid out anew): what it writes after the generation prompt is the answer.
                span, rewritten = (len(opening), len(opening)), True
            else:
                rewritten = False
            start, end = span
            if prefix and text[len(opening) : start].isspace():
                start = len(opening)  # whitespace the template writes before the answer
            first = bisect.bisect_right(ends, start)  # the first token ending after `start`
            after = bisect.bisect_left(starts, end)  # the first token starting after the answer
            eot = self._end_of_turn(c, i, r, after, anywhere=rewritten)
            answers.append(Answer(i, first, eot))
            cursor = ends[eot]
        return answers

    def _find(
        self,
        content: Any,
        text: str,
        low: int,
        starts: list[int],
        ids: list[int],
        *,
        check_between: bool,
    ) -> tuple[int, int] | None:
        """Where an answer's text is in the rendered text, at `low` or after: as written, or
        stripped (templates that trim answers: Llama 3, Gemma); None if it is not there, or
        (after an opening that is a prefix) only past a special token, i.e. in a later turn."""
        if not isinstance(content, str) or not content.strip():
            return None
        for candidate in (content, content.strip()):
            at = text.find(candidate, low)
            # Not inside an added token's text (an answer "Assistant" in <｜Assistant｜>).
            while at >= 0 and self._inside_added(at, starts, ids):
                at = text.find(candidate, at + 1)
            if at < 0:
                continue
            if check_between:
                between = ids[bisect.bisect_left(starts, low) : bisect.bisect_left(starts, at)]
                if any(t in self.special_ids for t in between):
                    continue
            return at, at + len(candidate)
        return None

    def _inside_added(self, at: int, starts: list[int], ids: list[int]) -> bool:
        k = bisect.bisect_right(starts, at) - 1  # the token holding character `at`
        return k >= 0 and starts[k] < at and ids[k] in self.added_ids

    def _end_of_turn(
        self, c: Conversation, turn: int, r: Rendered, k: int, *, anywhere: bool
    ) -> int:
        """The token index of the special token that closes the answer ending before token
        `k`: the first one from `k` on, past whitespace only (or past anything, `anywhere`,
        for an answer the template rewrote). A ValueError naming the row otherwise."""
        for j in range(k, len(r.ids)):
            if r.ids[j] in self.special_ids:
                return j
            piece = r.text[r.starts[j] : r.ends[j]]
            if not anywhere and not piece.isspace():
                token = self.tokenizer.convert_ids_to_tokens(r.ids[j])
                raise ValueError(
                    f"{self.template.source} writes {piece!r} (token {token!r}) after the "
                    f"assistant answer in message {turn} of row {c.row}, not a special "
                    "end-of-turn token: the model could not learn where its turn ends. Give a "
                    "template that closes every assistant turn with a special token (e.g. the "
                    "EOS) with --chat_template FILE."
                )
        raise ValueError(
            f"{self.template.source} writes nothing after an assistant answer (row "
            f"{c.row}): there is no end-of-turn token to train, and the model would "
            "never learn to stop. Give a template that closes every turn (e.g. with "
            "the EOS token) with --chat_template FILE."
        )

    def _rewritten(self, c: Conversation, turn: int, *, reasoning: bool, last: bool) -> ValueError:
        shown = repr(c.messages)
        shown = shown if len(shown) <= 300 else shown[:300] + "...]"
        if reasoning and last:
            cause = (
                "the template drops its <think>...</think> part although it is the last answer "
                "(DeepSeek-R1 distills' template drops it from every answer; Qwen3's from "
                "answers before the last user turn), so its reasoning would never be trained. "
                "Remove the <think> parts from the answers to train the answers alone, end "
                "the conversation with that answer, or give a template that keeps the "
                "reasoning with --chat_template FILE"
            )
        elif reasoning:
            cause = (
                "the template drops its <think>...</think> part and the answer after it is "
                "not in the rendered conversation either. Give a template that writes earlier "
                "answers as they are, or without their reasoning, with --chat_template FILE"
            )
        else:
            cause = (
                "its text is not in the rendered conversation (the template rewrites it), and "
                "the conversation up to that answer renders otherwise with the generation "
                "prompt, so where the rewritten answer starts cannot be told. Give a template "
                "that writes answers as they are, or one with {% generation %} markers around "
                "the answer and its end-of-turn token, with --chat_template FILE"
            )
        return ValueError(
            f"{self.template.source} cannot be masked for the assistant answer in message "
            f"{turn} of row {c.row}: {cause}. Row {c.row}: {shown}"
        )


@dataclass(frozen=True)
class Rendered:
    text: str
    ids: list[int]
    starts: list[int]  # each token's characters in `text`: [starts[k], ends[k])
    ends: list[int]


def _bytes_per_id(tokenizer: Any) -> np.ndarray:
    """How many bytes of text each token id stands for in a byte-level BPE (one per character
    of its vocabulary entry; an added token, its text's bytes); other tokenizers differ, which
    the first batch finds out (`ChatEncoder.tokens`)."""
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    lengths = np.zeros(max(vocab.values(), default=0) + 1, np.int64)
    for token, i in vocab.items():
        lengths[i] = len(token)
    for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if i < len(lengths):
            lengths[i] = len(str(added).encode("utf-8"))
    return lengths


@dataclass(frozen=True)
class Answer:
    turn: int  # the message's index
    first: int  # its first trained token
    end_of_turn: int  # the special token that closes it: its last trained token


@dataclass(frozen=True)
class EndOfTurn:
    token: str
    id: int
    special: bool  # a special token (<|im_end|>, <|eot_id|>), not text such as "\n"


def check_end_of_turn(
    encoder: ChatEncoder, conversations: Sequence[Conversation]
) -> EndOfTurn | None:
    """Check that the token closing each trained answer (the end-of-turn token) is trained, on
    the first conversation with a trained answer; return that token, or None if no
    conversation has one. With {% generation %} markers the template's mask is checked against
    the answers found by offsets: markers that leave the end-of-turn token out are a
    ValueError (the offset rule trains it by construction)."""
    tokenizer = encoder.tokenizer
    for c in conversations:
        if not c.trained_turns():
            continue
        (encoded,) = encoder([c])
        if encoded is None:
            continue
        ids, mask = encoded
        ((_, rendered, answers),) = encoder.answers([c])
        assert list(rendered.ids) == list(ids), "the markers' tokens are the rendered text's"
        for a in answers:
            token = tokenizer.convert_ids_to_tokens(ids[a.end_of_turn])
            if not mask[a.end_of_turn]:
                raise ValueError(
                    f"The loss mask leaves out the end-of-turn token {token!r} after an "
                    f"assistant answer (row {c.row}, {encoder.template.source}): the model "
                    "would never learn to stop. With {% generation %} markers, put the "
                    "end-of-turn token inside them (--chat_template FILE)."
                )
        if answers:
            eot = answers[0].end_of_turn
            return EndOfTurn(tokenizer.convert_ids_to_tokens(ids[eot]), ids[eot], True)
    return None
