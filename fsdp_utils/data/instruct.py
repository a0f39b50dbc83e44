"""Prompt and answer as strings: prompt/completion, alpaca and `{column}` templates.

A row becomes `prompt + answer + EOS`, tokenised as one text (so the tokens are those the
model sees when it reads its own answer) with the tokenizer's own special tokens (a BOS where
it adds one). The loss is on the tokens that hold answer characters and on the EOS, which
teaches the model to stop.

    alpaca      the Stanford Alpaca prompt, with or without its `### Input:` section
    templates   --prompt_template / --response_template with {column} placeholders; samsum:
                --prompt_template $'Summarize this dialog:\\n{dialogue}\\n---\\nSummary:\\n'
                --response_template '{summary}'
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# The Stanford Alpaca prompts, with the newline after "### Response:" that most trainers
# (axolotl, LLaMA-Factory) add, so the answer starts on its own line.
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)

PromptAndAnswer = tuple[str, str]


def alpaca_pair(row: Mapping[str, Any]) -> PromptAndAnswer:
    """(prompt, answer) of an alpaca row; an empty or missing `input` picks the shorter prompt."""
    context = row.get("input")
    if context:
        prompt = ALPACA_PROMPT.format(instruction=row["instruction"], input=context)
    else:
        prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=row["instruction"])
    return prompt, str(row["output"] or "")


def placeholders(template: str) -> list[str]:
    """The column names a template's {placeholders} refer to ('{a.b}' and '{a[0]}' -> 'a');
    positional ones ('{}', '{0}') are returned as '' and '0'."""
    names = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None:
            names.append(re.split(r"[.\[]", field, maxsplit=1)[0])
    return names


def check_templates(prompt: str, response: str, columns: Sequence[str]) -> None:
    """Every placeholder names a column; a ValueError that lists the columns otherwise."""
    for flag, template in (("--prompt_template", prompt), ("--response_template", response)):
        try:
            names = placeholders(template)
        except ValueError as err:  # unbalanced braces
            raise ValueError(
                f"{flag} {template!r} is not a valid template ({err}). Write columns as "
                "{name}, and a literal brace as {{ or }}."
            ) from None
        unknown = [n for n in names if n not in columns]
        if unknown:
            shown = ", ".join("{" + n + "}" for n in unknown)
            raise ValueError(
                f"{flag} {template!r} names {shown}, which is not a column of the dataset. "
                f"Its columns are: {', '.join(columns)}. Write each as {{column}} (a literal "
                "brace as {{ or }})."
            )
    if not placeholders(response):
        raise ValueError(
            f"--response_template {response!r} names no column: every row would have the "
            "same answer. Put the answer's column in it, e.g. '{summary}'."
        )


def template_pair(prompt: str, response: str) -> Callable[[Mapping[str, Any]], PromptAndAnswer]:
    def pair(row: Mapping[str, Any]) -> PromptAndAnswer:
        values = {k: "" if v is None else v for k, v in row.items()}
        return prompt.format_map(values), response.format_map(values)

    return pair


def prompt_completion_pair(row: Mapping[str, Any]) -> PromptAndAnswer:
    return str(row["prompt"] or ""), str(row["completion"] or "")


class PairEncoder:
    """Tokens and loss mask of (prompt, answer) pairs, a batch at a time.

    The answer's tokens are those holding a character past the prompt: a token that merges
    the prompt's last characters with the answer's first (a prompt ending in a space, say)
    is trained, and the row is counted in `merged`, because the model will see a different
    token at the end of the prompt when it is asked alone.
    """

    def __init__(self, tokenizer: Any, *, train_on_prompt: bool) -> None:
        self.tokenizer = tokenizer
        self.train_on_prompt = train_on_prompt
        self.eos = int(tokenizer.eos_token_id)
        # Tokenizers that close every text with EOS themselves (T5-like) do it to prompts too.
        self.appends_eos = tokenizer("a", add_special_tokens=True)["input_ids"][-1:] == [self.eos]

    def __call__(self, pairs: Sequence[PromptAndAnswer]) -> list[tuple[list[int], list[int], bool]]:
        """(input_ids, loss_mask, merged) per pair; merged: the prompt's tokens alone are not
        the first tokens of the row."""
        if not pairs:
            return []
        tok = self.tokenizer
        full = tok([p + a for p, a in pairs], add_special_tokens=True, return_offsets_mapping=True)
        prompts = tok([p for p, _ in pairs], add_special_tokens=True)["input_ids"]
        out = []
        for (prompt, _), ids, offsets, prompt_ids in zip(
            pairs, full["input_ids"], full["offset_mapping"], prompts, strict=True
        ):
            boundary = len(prompt)
            # Special tokens the tokenizer adds (BOS) have the offsets (0, 0): prompt side.
            mask = [int(self.train_on_prompt or end > boundary) for _, end in offsets]
            if ids and ids[-1] == self.eos:
                mask[-1] = 1
            else:
                ids, mask = [*ids, self.eos], [*mask, 1]
            head = prompt_ids[:-1] if self.appends_eos else prompt_ids
            out.append((list(ids), mask, ids[: len(head)] != head))
        return out
