"""Packing without cross-document attention (`--document_masking`).

A packed block holds several documents back to back, each closed by EOS. With document
masking the position ids restart at 0 after every EOS (and at the start of every block), and
the model is called with those position ids and **no attention mask**. transformers then
detects the packed sequences from the position ids and keeps attention inside each document:

- `sdpa`, `eager`, `flex_attention`: `masking_utils.find_packed_sequence_indices` turns
  the position ids into document indices and builds a block-diagonal causal mask (a
  materialised boolean mask for sdpa and eager, a `BlockMask` for flex). Checked on CPU with
  transformers 5.23 (tests/test_document_masking.py).
- `flash_attention_2/3`: `_is_packed_sequence` looks at the position ids only when the batch
  holds one row; with more rows the documents of a row see each other. Hence
  `check_document_masking` refuses flash attention with `--batch_size_per_device` > 1.

Two traps, both silent, both tested: transformers ignores the position ids for packing when
an attention mask is passed (even all ones) or when a KV cache is in use (`use_cache=True`
creates one), and falls back to plain causal attention over the whole block.

Where documents begin: for chess and text, after every EOS the preparation writes between
documents (so their prepared data needs no new field; a document holding the EOS token in its
own text would be cut there, which chess games never do). For chat and the other masked
formats, at the row starts stored with the blocks (`fsdp_utils.data.packing`): their
end-of-turn token is often the EOS (ChatML's <|im_end|> in Qwen), and restarting there would
cut a conversation into its turns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import numpy as np
import torch

# Implementations whose transformers mask code turns packed position ids into a
# block-diagonal mask for any batch size.
HONOURS_PACKING = ("sdpa", "eager", "flex_attention")
# Split attention (sequence parallelism: fsdp_utils/parallel/ulysses.py) is registered as this
# prefix + the kernel it runs inside, and builds that kernel's masks on the whole sequence from
# its position ids: it keeps packed documents apart exactly when its inner kernel does.
SPLIT_PREFIX = "sequence_parallel_"
# Model types whose transformers forward builds its masks without the position ids, so that
# packed documents see each other whatever the implementation (5.23: gpt-oss's GptOssModel
# calls create_causal_mask without them). tests/test_document_masking.py checks both ways.
IGNORES_POSITION_IDS = ("gpt_oss",)


def document_position_ids(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Position ids that restart at 0 after each EOS and at the start of each row.

    [[5, 7, EOS, 9, 4, EOS, 8]] -> [[0, 1, 2, 0, 1, 2, 0]]: the EOS belongs to the document
    it closes.
    """
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos_token_id
    return positions_from_starts(starts)


def positions_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at 0 where `starts` is True and at the start of each row.

    [[T, F, F, T, F]] -> [[0, 1, 2, 0, 1]].
    """
    rows, length = starts.shape
    index = torch.arange(length, device=starts.device).expand(rows, length)
    starts = starts.clone()
    starts[:, 0] = True
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - last_start


def attention_implementation(model: Any) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "_attn_implementation", None) or "sdpa")


def check_document_masking(model: Any, *, batch_size_per_device: int) -> None:
    """Refuse an attention implementation (or a model) that would silently let documents see
    each other."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in IGNORES_POSITION_IDS:
        raise ValueError(
            f"--document_masking: transformers' {model_type} forward builds its attention masks "
            "without the position ids, so packed documents would see each other. Train without "
            "--document_masking (add --no_packing for one document per sequence)."
        )
    check_isolates_documents(
        attention_implementation(model), batch_size_per_device=batch_size_per_device
    )


def isolates_documents(implementation: str, *, batch_size_per_device: int) -> bool:
    """Whether `--document_masking` keeps packed documents apart under `implementation`."""
    implementation = implementation.removeprefix(SPLIT_PREFIX)
    if implementation in HONOURS_PACKING:
        return True
    return implementation.startswith("flash_attention") and batch_size_per_device == 1


def check_isolates_documents(implementation: str, *, batch_size_per_device: int) -> None:
    """The check of `--document_masking` by name: in the preflight (`--attn_implementation`)
    and on the built model (the implementation transformers settled on)."""
    if isolates_documents(implementation, batch_size_per_device=batch_size_per_device):
        return
    if implementation.startswith("flash_attention"):
        raise ValueError(
            f"--document_masking with {implementation}: transformers separates packed "
            "documents for flash attention only when a forward pass holds one sequence, and "
            f"this run has --batch_size_per_device {batch_size_per_device}. Use "
            "--batch_size_per_device 1 (the total batch stays the same), or sdpa attention."
        )
    raise ValueError(
        f"--document_masking: the model uses the attention implementation {implementation!r}, "
        f"which is not known to honour packed position ids (known: {', '.join(HONOURS_PACKING)}, "
        "and flash attention with one sequence per pass). Use sdpa, or train without "
        "--document_masking."
    )


# --- packing known on the host (--sync_free_steps) --------------------------------------------

# Set while a training step runs with --sync_free_steps (`packing_from_host`).
_PACKING_FROM_HOST: ContextVar[bool] = ContextVar("packing_from_host", default=False)


@contextlib.contextmanager
def packing_from_host() -> Iterator[None]:
    """Within: the forwards of `known_packing` take the packing of their batch from the host."""
    token = _PACKING_FROM_HOST.set(True)
    try:
        yield
    finally:
        _PACKING_FROM_HOST.reset(token)


# The packing of the batch being forwarded, known on the host (`known_packing`); None outside.
_BATCH_PACKED: ContextVar[bool | None] = ContextVar("batch_packed", default=None)
# transformers' own `find_packed_sequence_indices`, saved when `known_packing` first replaces it.
_TRANSFORMERS_FIND: list[Any] = []


def _find_packed_from_host(position_ids: torch.Tensor) -> torch.Tensor | None:
    """transformers' `find_packed_sequence_indices` without its read, inside `known_packing`;
    transformers' own outside it and while dynamo traces (where it reads nothing either)."""
    if torch.compiler.is_compiling():  # first: dynamo cannot trace a ContextVar's get
        return _TRANSFORMERS_FIND[0](position_ids)
    packed = _BATCH_PACKED.get()
    if packed is None:
        return _TRANSFORMERS_FIND[0](position_ids)
    if not packed:  # every row one sequence: transformers' None
        return None
    first = position_ids[:, :1] - 1  # transformers' own: a diff of 1 at the start
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


@contextlib.contextmanager
def known_packing(position_ids: torch.Tensor | None) -> Iterator[None]:
    """A forward whose batch's position ids (None: every row one sequence from 0) are these
    host tensors, under `packing_from_host`: transformers' packing detection reads nothing.

    Every forward without an attention mask (every training forward here) calls
    `masking_utils.find_packed_sequence_indices`, which ends with `(mask[:, -1] == 0).all()`
    to return None for rows of one document each: a read of a device tensor, so a host-device
    sync per micro-batch (found by counting the step's reads: tests/test_levers.py). The
    answer is known on the host before the position ids go to the device: no boundary (a
    position that does not follow its neighbour by 1) means None, as transformers returns;
    else the same document indices, computed on the device without reading them. Once
    replaced, transformers' function stays replaced by one that is transformers' own outside
    this context: one function, so a compiled forward that calls it is not recompiled. Not
    used for sequence-parallel slices, whose attention sees the whole sequence's position ids."""
    from transformers import masking_utils

    current = getattr(masking_utils, "find_packed_sequence_indices", None)
    if not _PACKING_FROM_HOST.get() or current is None:
        yield
        return
    if current is not _find_packed_from_host:
        _TRANSFORMERS_FIND[:] = [current]
        masking_utils.find_packed_sequence_indices = _find_packed_from_host
    # numpy: the host's own arrays, never the device's (the batch is still on the host)
    packed = position_ids is not None and bool(np.any(np.diff(position_ids.numpy(), axis=-1) != 1))
    token = _BATCH_PACKED.set(packed)
    try:
        yield
    finally:
        _BATCH_PACKED.reset(token)
