"""`--max_seq_length` against the model's context length, read from its config.

Given, it must fit the model (a ValueError naming the largest that does). Not given, it is the
default (`DEFAULT_MAX_SEQ_LENGTH`), or the model's context length where that is shorter: a
default should fit the model it is used with, and the log says which it took. Every command
that reads the model's config fits the run's config here before it uses the length: the
trainer's checks (`fsdp_utils.run.preflight.check_run`), the data preparation (its cache key
holds the length), the planner and the standalone chess evaluation.
"""

from __future__ import annotations

from typing import Any

from fsdp_utils.config.options.batch import DEFAULT_MAX_SEQ_LENGTH
from fsdp_utils.config.train_config import TrainConfig, validate_config

# Attribute names under which transformers configs store the context length.
_CONTEXT_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_sequence_length",
    "seq_length",
)


def context_length(hf_config: Any) -> int | None:
    for key in _CONTEXT_LENGTH_KEYS:
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_seq_length(hf_config: Any, max_seq_length: int) -> None:
    limit = context_length(hf_config)
    if limit is not None and max_seq_length > limit:
        raise ValueError(
            f"--max_seq_length {max_seq_length} is above the model's context length of {limit} "
            f"tokens ({hf_config.model_type}). Use --max_seq_length {limit} or less."
        )


def fit_seq_length(config: TrainConfig, hf_config: Any) -> tuple[TrainConfig, str | None]:
    """The config with `max_seq_length` set, and the log's line when the model chose it. An
    explicit value is checked (a ValueError above the context); none takes the default, or
    the context length where that is shorter."""
    if config.max_seq_length is not None:
        check_seq_length(hf_config, config.max_seq_length)
        return config, None
    limit = context_length(hf_config)
    if limit is None or limit >= DEFAULT_MAX_SEQ_LENGTH:
        return config.replace(max_seq_length=DEFAULT_MAX_SEQ_LENGTH), None
    fitted = config.replace(max_seq_length=limit)
    validate_config(fitted)  # what depends on the length (GRPO's completions) against it
    return fitted, (
        f"sequence length: {limit} tokens, the model's context length (--max_seq_length not "
        f"given; its default, {DEFAULT_MAX_SEQ_LENGTH}, is above it)"
    )
