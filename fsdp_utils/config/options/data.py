"""The data: how rows become text and tokens (formats, templates, masks), packing, and the
prepared-data cache (fsdp_utils/data/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .section import Section

SECTION = Section("data", "data")
_opt = SECTION.option

DataFormat = Literal[
    "auto", "chess", "text", "chat", "prompt_completion", "alpaca", "templates", "preference",
    "prompts",
]  # fmt: skip
LongExamples = Literal["drop", "truncate", "error"]
# The text a game becomes (see fsdp_utils.data.render). Fields: {result}, {termination}, {moves}.
DEFAULT_TEMPLATE = "[Result {result}] [Termination {termination}] {moves}"


@dataclass
class DataOptions:
    template: str = field(
        default=DEFAULT_TEMPLATE,
        metadata=_opt("How a chess game becomes text: {result}, {termination}, {moves}."),
    )
    text_field: str = field(default="text", metadata=_opt("Text column of plain-text datasets."))
    data_format: DataFormat = field(
        default="auto",
        metadata=_opt(
            "auto: from the columns (Moves/Termination/Result: chess; messages or "
            "conversations: chat; prompt+completion; instruction+output: alpaca; text); or "
            "name one. templates: --prompt_template/--response_template over any columns; "
            "prompts: a prompt column alone (--method grpo)."
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=_opt(
            "A Jinja chat template file to render chat rows with, instead of the tokenizer's "
            "own (needed for a model without one); the final model carries it."
        ),
    )
    prompt_template: str | None = field(
        default=None,
        metadata=_opt(
            "The prompt of a row, with {column} placeholders, e.g. "
            "'Summarize this dialog:\\n{dialogue}\\n---\\nSummary:\\n' (with "
            "--response_template)."
        ),
    )
    response_template: str | None = field(
        default=None,
        metadata=_opt(
            "The answer of a row, with {column} placeholders, e.g. '{summary}'; the loss is "
            "on it and the EOS after it."
        ),
    )
    dataset_module: str | None = field(
        default=None,
        metadata=_opt(
            "FILE.py:FUNCTION returning the rows (a datasets.Dataset or a list of dicts) in "
            "any format above, instead of --dataset; it runs wherever data is prepared."
        ),
    )
    train_on_prompt: bool = field(
        default=False,
        metadata=_opt(
            "Chat, prompt/completion, alpaca, templates: train on every token, not only on "
            "the answers."
        ),
    )
    long_examples: LongExamples = field(
        default="drop",
        metadata=_opt(
            "Chat, prompt/completion, alpaca, templates: a row longer than --max_seq_length "
            "is dropped, truncated (its start kept) or an error; counted in the log."
        ),
    )
    no_packing: bool = field(
        default=False,
        metadata=_opt("Pad each document to max_seq_length instead of packing full blocks."),
    )
    max_examples: int | None = field(
        default=None, metadata=_opt("Use at most this many documents (quick runs).")
    )
    num_proc: int | None = field(
        default=None,
        metadata=_opt("Tokenisation worker processes (default: CPUs, max 8)."),
    )
    data_cache_dir: str | None = field(
        default=None,
        metadata=_opt("Where tokenised/packed data is cached (default: beside the hub cache)."),
    )
    document_masking: bool = field(
        default=False,
        metadata=_opt(
            "Packed documents do not attend to each other: position ids restart at every "
            "document (transformers then masks attention per document; sdpa, eager, flex)."
        ),
    )


def check(options: DataOptions) -> None:
    templates = (options.prompt_template, options.response_template)
    if (templates[0] is None) != (templates[1] is None):
        raise ValueError(
            "--prompt_template and --response_template go together: the prompt carries no "
            "loss, the response does. Give both, e.g. --prompt_template "
            "$'Summarize this dialog:\\n{dialogue}\\n---\\nSummary:\\n' "
            "--response_template '{summary}'."
        )
    if templates[0] is not None and options.data_format not in ("auto", "templates"):
        raise ValueError(
            f"--prompt_template/--response_template make the format `templates`, but "
            f"--data_format is {options.data_format}: drop one of them."
        )
    if options.data_format == "templates" and templates[0] is None:
        raise ValueError(
            "--data_format templates needs --prompt_template and --response_template, "
            "strings with {column} placeholders."
        )
    module = options.dataset_module
    if module is not None and (":" not in module or not module.rsplit(":", 1)[1].isidentifier()):
        raise ValueError(
            f"--dataset_module {module!r}: expected FILE.py:FUNCTION, e.g. my_data.py:build."
        )
    for field_name in ("{moves}",):
        if field_name not in options.template:
            raise ValueError(f"--template must contain {field_name}: got {options.template!r}.")
