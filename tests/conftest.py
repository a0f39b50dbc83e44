"""Shared fixtures: tiny local assets built once per test session (nothing from the Hub)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Tests must never reach the Hub, nor read or fill the user's cache: set before any Hugging
# Face import (subprocesses and Slurm jobs inherit it).
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="fsdp-utils-tests-hf-")
os.environ.pop("HF_HUB_CACHE", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2-layer Llama with a chess BPE tokenizer, and 400 random games in 2 parquet shards.

    Returns {"model": folder, "data": folder}.
    """
    from fsdp_utils.synthetic import build_demo_assets

    return build_demo_assets(tmp_path_factory.mktemp("tiny_assets"), num_games=400, num_shards=2)
