"""Which format a dataset is in: from its columns, or `--data_format`; and the reason, for the log.

    chess              Moves, Termination, Result       a game -> text (render.py)
    text               text (or --text_field)           the text as is
    chat               messages, or ShareGPT            the tokenizer's chat template (chat.py)
                       conversations (from/value)
    prompt_completion  prompt, completion               strings, or message lists (chat.py)
    alpaca             instruction, output (+ input)    the Alpaca prompt (instruct.py)
    templates          any, named by --prompt_template  {column} placeholders (instruct.py)
                       and --response_template
    preference         chosen, rejected (+ prompt)      pairs for --method dpo (preference.py)
    prompts            prompt (+ any columns)           prompts for --method grpo (prompts.py)

Chess and text are token streams cut into blocks, every token trained, as they always were.
The other formats carry a loss mask: only the answers are trained (`--train_on_prompt`: all).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.render import CHESS_COLUMNS

STREAM_FORMATS = ("chess", "text")  # every token trained; documents cut into blocks
MASKED_FORMATS = ("chat", "prompt_completion", "alpaca", "templates", "preference")  # loss masks
PROMPT_FORMAT = "prompts"  # prompts alone, the model samples the answers (--method grpo)
PREFERENCE_COLUMNS = ("chosen", "rejected")  # TRL's preference formats; `prompt` optional

CHAT_COLUMNS = ("messages", "conversations")

# The settings beyond chess and text that decide what a run trains on (see `data_identity`).
DATA_SETTINGS = (
    "data_format",
    "chat_template",
    "prompt_template",
    "response_template",
    "dataset_module",
    "train_on_prompt",
    "long_examples",
)


def data_identity(config: TrainConfig) -> dict[str, Any]:
    """The data settings that differ from their defaults, for a checkpoint's run identity: a
    resumed run must train on the same rows and masks. Empty for chess and text runs, whose
    checkpoints keep the identity they had."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    return {
        name: getattr(config, name)
        for name in DATA_SETTINGS
        if getattr(config, name) != defaults[name]
    }


@dataclass(frozen=True)
class FormatChoice:
    name: str  # one of STREAM_FORMATS + MASKED_FORMATS
    reason: str  # why, for the log

    @property
    def masked(self) -> bool:
        return self.name in MASKED_FORMATS


def _required(name: str, config: TrainConfig) -> str:
    """The columns a format needs, as the error names them."""
    return {
        "chess": ", ".join(CHESS_COLUMNS),
        "text": f"`{config.text_field}` (--text_field)",
        "chat": "`messages`, or ShareGPT `conversations`",
        "prompt_completion": "`prompt` and `completion`",
        "alpaca": "`instruction` and `output` (and optionally `input`)",
        "templates": "the columns --prompt_template and --response_template name",
        "preference": "`chosen` and `rejected` (and optionally `prompt`)",
    }[name]


def _has(name: str, columns: Sequence[str], config: TrainConfig) -> bool:
    return {
        "chess": all(c in columns for c in CHESS_COLUMNS),
        "text": config.text_field in columns,
        "chat": any(c in columns for c in CHAT_COLUMNS),
        "prompt_completion": "prompt" in columns and "completion" in columns,
        "alpaca": "instruction" in columns and "output" in columns,
        "templates": True,  # checked against the placeholders (instruct.check_templates)
        "preference": all(c in columns for c in PREFERENCE_COLUMNS),
    }[name]


def chat_column(columns: Sequence[str]) -> str:
    return next(c for c in CHAT_COLUMNS if c in columns)


def choose_format(columns: Sequence[str], config: TrainConfig) -> FormatChoice:
    """The format of a dataset with these columns; a ValueError naming the fix when none fits.
    --method dpo reads pairs only, and --method sft never does (`_preference_choice`)."""
    shown = ", ".join(columns)
    if config.trains_on_prompts:
        return _prompt_choice(columns, config)
    if config.data_format == PROMPT_FORMAT:
        raise ValueError(
            f"--data_format {PROMPT_FORMAT}: prompts without answers are what --method grpo "
            "samples answers to (docs/grpo.md); fine-tuning needs an answer per row."
        )
    preference = _preference_choice(columns, config)
    if preference is not None:
        return preference
    if config.data_format != "auto":
        if not _has(config.data_format, columns, config):
            raise ValueError(
                f"--data_format {config.data_format} needs the column(s) "
                f"{_required(config.data_format, config)}, but the dataset has: {shown}. "
                "Leave --data_format at auto to choose from the columns, or name them with "
                "--prompt_template/--response_template."
            )
        return FormatChoice(config.data_format, "--data_format")
    if config.prompt_template is not None:
        return FormatChoice("templates", "--prompt_template and --response_template")
    if config.text_field != "text" and config.text_field in columns:
        return FormatChoice("text", f"column `{config.text_field}` (--text_field)")
    if _has("chess", columns, config):
        return FormatChoice("chess", "columns Moves, Termination, Result")
    if _has("chat", columns, config):
        column = chat_column(columns)
        return FormatChoice("chat", f"column `{column}`" + (" (ShareGPT)" * (column != "messages")))
    if _has("prompt_completion", columns, config):
        return FormatChoice("prompt_completion", "columns `prompt` and `completion`")
    if _has("alpaca", columns, config):
        return FormatChoice("alpaca", "columns `instruction` and `output`")
    if _has("text", columns, config):
        return FormatChoice("text", "column `text`")
    raise ValueError(
        f"The dataset's columns ({shown}) match no format this trainer reads: chess "
        "(Moves, Termination, Result), chat (messages, or ShareGPT conversations), "
        "prompt_completion (prompt, completion), alpaca (instruction, output, optional input) "
        f"or text (`{config.text_field}`; --text_field names another column). Say how a row "
        "becomes a prompt and an answer with templates over its columns, e.g. "
        "--prompt_template $'Question:\\n{question}\\nAnswer:\\n' --response_template "
        "'{answer}', or return rows in one of these formats from a --dataset_module "
        "my_data.py:build."
    )


def _prompt_choice(columns: Sequence[str], config: TrainConfig) -> FormatChoice:
    """A method that samples its own answers (--method grpo) reads a `prompt` column and hands
    the other columns to its rewards."""
    if "prompt" not in columns:
        raise ValueError(
            f"--method {config.method} samples answers to prompts: it needs a column `prompt` "
            f"(text, or a list of chat messages; TRL's prompt-only format), but the dataset has: "
            f"{', '.join(columns)}. Name the column that holds the question `prompt` (a "
            "--dataset_module my_prompts.py:rows can rename it), or fine-tune on answers with "
            "--method sft."
        )
    if config.data_format not in ("auto", PROMPT_FORMAT):
        raise ValueError(
            f"--data_format {config.data_format} with --method {config.method}: it reads "
            f"prompts only (--data_format {PROMPT_FORMAT}, or auto)."
        )
    return FormatChoice(PROMPT_FORMAT, f"column `prompt` (--method {config.method})")


def _preference_choice(columns: Sequence[str], config: TrainConfig) -> FormatChoice | None:
    """A method on pairs (--method dpo: `TrainConfig.trains_on_pairs`): the preference format,
    or the error naming the columns it needs. --method sft on a set of pairs (nothing else to
    train on): the error naming --method dpo."""
    shown = ", ".join(columns)
    pairs = _has("preference", columns, config)
    if config.trains_on_pairs:
        if config.data_format not in ("auto", "preference") or not pairs:
            raise ValueError(
                f"--method {config.method} trains on preference pairs: it needs the columns `chosen` and "
                f"`rejected` (text or message lists, and optionally `prompt`; TRL's preference "
                f"formats), but the dataset has: {shown}"
                + (
                    f" (and --data_format is {config.data_format})"
                    * (config.data_format not in ("auto", "preference"))
                )
                + ". Give a dataset of pairs (docs/preference.md), or fine-tune on answers "
                "with --method sft (the default)."
            )
        return FormatChoice(
            "preference", f"columns `chosen` and `rejected` (--method {config.method})"
        )
    if config.data_format == "preference" or (
        pairs
        and config.data_format == "auto"
        and config.prompt_template is None
        and not any(_has(n, columns, config) for n in ("chess", "chat", "alpaca", "text"))
        and not _has("prompt_completion", columns, config)
    ):
        raise ValueError(
            f"The dataset's columns ({shown}) are preference pairs (`chosen`, `rejected`): "
            "train on them with --method dpo (docs/preference.md). Supervised fine-tuning "
            "(--method sft) needs one answer per row."
        )
    return None
