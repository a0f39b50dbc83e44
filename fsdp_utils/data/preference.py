"""Preference pairs (`--method dpo`): TRL's preference formats -> a chosen and a rejected sequence
per row, each with the loss mask of its answer; and at training time, batches of whole pairs.

The formats, told apart by the columns and by what they hold (as TRL's DPOTrainer reads them):

    prompt, chosen, rejected    strings: `prompt + answer + EOS`, as prompt/completion rows
                                message lists: the prompt's messages, then the answer's,
                                through the chat template
    chosen, rejected            whole conversations (or texts) that share their start: the
                                common prefix is the prompt (TRL's `extract_prompt`)

Each side is encoded as a prompt/completion row (`fsdp_utils.data.rows.RowEncoder`): the loss
mask covers the answer tokens (and the end-of-turn or EOS that closes them) by the rules of the
chat masking, and the length rules of --long_examples apply to each side. A pair is kept or
dropped whole: if either side is dropped, both are, and the pair is counted once.

Prepared layout (`fsdp_utils.data.prepare`), per split: the sequences padded one per block
(never packed, so no pair attends to another), chosen and rejected of a pair next to each other
(blocks 2i and 2i + 1), and `pair_rows`: each pair's row in the dataset as read, which indexes
the reference model's cached log-probabilities whatever the world size (fsdp_utils/preference/).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fsdp_utils.data.blocks import TokenBlocks
from fsdp_utils.data.chat import Conversation
from fsdp_utils.data.rows import ROW_INDEX, RowEncoder

PAIR_ROWS = "pair_rows"  # a batch's key: the dataset row of each pair, [pairs] int64


def extract_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen answer, rejected answer) from two conversations (message lists) or texts
    that share their start, as TRL's `extract_prompt` splits them: the longest common prefix
    (of messages, or of characters, a space before the split going to the answers)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if isinstance(chosen, str) and idx and chosen[idx - 1] == " ":
                idx -= 1
            break
    else:
        idx = min(len(chosen), len(rejected))
    return chosen[:idx], chosen[idx:], rejected[idx:]


@dataclass
class PreferenceEncoder:
    """Preference rows -> two prompt/completion rows each (chosen, then rejected), encoded by
    `rows` (a RowEncoder of format prompt_completion); the same output as RowEncoder's, two
    entries per row, a pair dropped whole."""

    rows: RowEncoder

    @staticmethod
    def sides(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """The prompt/completion batch: for row r, entries 2r (chosen) and 2r + 1 (rejected)."""
        out: dict[str, list[Any]] = {"prompt": [], "completion": [], ROW_INDEX: []}
        has_prompt = "prompt" in batch
        for i, row in enumerate(batch[ROW_INDEX]):
            chosen, rejected = batch["chosen"][i], batch["rejected"][i]
            if has_prompt and batch["prompt"][i] is not None:
                prompt = batch["prompt"][i]
            else:
                prompt, chosen, rejected = extract_prompt(chosen or "", rejected or "")
            for answer in (chosen, rejected):
                out["prompt"].append(prompt)
                out["completion"].append(answer)
                out[ROW_INDEX].append(row)
        return out

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        out = self.rows(self.sides(batch))
        for i in range(0, len(out["dropped"]), 2):
            reason = out["dropped"][i] or out["dropped"][i + 1]
            if reason:
                for k in (i, i + 1):
                    out["dropped"][k] = reason
                    out["input_ids"][k], out["loss_mask"][k] = [], []
                    out["truncated"][k] = False
        return out

    def conversations(self, batch: dict[str, list[Any]]) -> list[Conversation] | None:
        return self.rows.conversations(self.sides(batch))


def pair_sequences(pairs: np.ndarray) -> np.ndarray:
    """The spilled or prepared sequences of these pairs, chosen and rejected of each together."""
    pairs = np.asarray(pairs, dtype=np.int64)
    return np.stack([2 * pairs, 2 * pairs + 1], axis=1).ravel()


@dataclass(frozen=True)
class PreferencePairs:
    """A prepared split of pairs; `batch` gives whole pairs. Its length counts pairs, so the
    step sampler and the total batch count pairs too."""

    sequences: TokenBlocks  # blocks 2i (chosen) and 2i + 1 (rejected) of pair i
    rows: np.ndarray  # (pairs,) each pair's row in the dataset

    @classmethod
    def load(cls, folder: Path, split: str) -> PreferencePairs:
        path = folder / f"{split}_{PAIR_ROWS}.npy"
        rows = np.load(path) if path.is_file() else np.zeros(0, np.int64)
        return cls(TokenBlocks.load(folder, split), rows)

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """input_ids and labels [2 x pairs, seq]: the chosen sequences of the pairs in order, then
        their rejected ones (TRL's concatenated layout); `pair_rows` [pairs]."""
        indices = np.asarray(indices, dtype=np.int64)
        order = np.concatenate([2 * indices, 2 * indices + 1])
        out = self.sequences.batch(order)
        out[PAIR_ROWS] = torch.from_numpy(self.rows[indices].astype(np.int64))
        return out
