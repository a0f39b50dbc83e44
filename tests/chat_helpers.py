"""Tiny chat models and datasets for the tests of instruction and chat data (written in the
file formats people publish), and a readable view of a prepared row's labels."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import IGNORE_INDEX
from fsdp_utils.data.prepare import PreparedData, prepare_dataset
from fsdp_utils.synthetic import save_chat_model


def chat_models(root: Path, base: Any, styles: tuple[str, ...]) -> dict[str, Path]:
    return {style: save_chat_model(root / style, style, base=base) for style in styles}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prepare(model: Path, dataset: Path, cache: Path, **options: Any) -> PreparedData:
    config = TrainConfig(
        **{
            "model": str(model), "dataset": str(dataset), "data_cache_dir": str(cache),
            "max_seq_length": 128, "eval_examples": 0, "no_packing": True, **options,
        }
    )  # fmt: skip
    folder = prepare_dataset(config, log=lambda _: None)
    return PreparedData(folder, json.loads((folder / "meta.json").read_text()))


def segments(
    tokenizer: Any, input_ids: torch.Tensor, labels: torch.Tensor
) -> list[tuple[str, bool]]:
    """A row as (text, trained) runs: consecutive tokens with the same trained flag, decoded
    with their special tokens. Padding (past the last non-pad label run) is left out."""
    trained = (labels != IGNORE_INDEX).tolist()
    ids = input_ids.tolist()
    runs: list[tuple[list[int], bool]] = []
    for token, flag in zip(ids, trained, strict=True):
        if runs and runs[-1][1] == flag:
            runs[-1][0].append(token)
        else:
            runs.append(([token], flag))
    return [(tokenizer.decode(t, skip_special_tokens=False), f) for t, f in runs]


def row_segments(prepared: PreparedData, tokenizer: Any, index: int = 0) -> list[tuple[str, bool]]:
    """The labelled runs of the `index`-th row of an unpacked training split (one row per
    block), without its padding."""
    blocks = prepared.split("train")
    batch = blocks.batch(np.array([index]))
    n = int(blocks.lengths[index])
    return segments(tokenizer, batch["input_ids"][0, :n], batch["labels"][0, :n])
