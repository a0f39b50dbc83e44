"""Compute-side resolution of `--model` and `--dataset` to local files, never touching the network.

A local path is used as is. A hub id is looked up in the offline cache written by
`download_models.py` (pinned commit from the manifest). Anything missing raises
`MissingAssetError`, whose message is the exact `download_models.py` command to run on the
login node.
"""

from __future__ import annotations

import fnmatch
import shlex
from pathlib import Path

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


class MissingAssetError(ValueError):
    """An asset is not available offline; the message says how to fetch it."""


def download_command(
    *,
    model: str | None = None,
    dataset: str | None = None,
    include: str | None = None,
    revision: str | None = None,
    cache_dir: str | None = None,
) -> str:
    parts = ["python", "download_models.py"]
    if model:
        parts += ["--model", model]
    if dataset:
        parts += ["--dataset", dataset]
    if include:
        parts += ["--dataset-include", include]
    if revision:
        parts += ["--revision", revision]
    if cache_dir:
        parts += ["--cache-dir", cache_dir]
    return shlex.join(parts)


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists()


def resolve_model_dir(
    model: str, revision: str | None = None, cache_dir: str | None = None
) -> Path:
    """Folder holding config.json, tokenizer files and safetensors weights."""
    if _looks_local(model):
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise MissingAssetError(
                f"Model folder {path} has no config.json. Point --model at a folder saved with "
                "save_pretrained(), or at a hub id cached with download_models.py."
            )
        return path
    raise MissingAssetError(
        f"Model {model!r} is not in the offline cache. On the login node, run:\n  "
        + download_command(model=model, revision=revision, cache_dir=cache_dir)
    )


def _select(files: list[Path], include: str | None) -> list[Path]:
    if not include:
        return files
    patterns = [p.strip() for p in include.split(",") if p.strip()]
    return [f for f in files if any(fnmatch.fnmatch(f.name, p) for p in patterns)]


def resolve_dataset_files(
    dataset: str,
    include: str | None = None,
    revision: str | None = None,
    cache_dir: str | None = None,
) -> list[Path]:
    """The data files (parquet or jsonl) that make up `dataset`, sorted by name."""
    names = [d.strip() for d in dataset.split(",") if d.strip()]
    if names and all(_looks_local(n) for n in names):
        files: list[Path] = []
        for name in names:
            path = Path(name).expanduser()
            if path.is_dir():
                found = sorted(p for p in path.rglob("*") if p.suffix in DATA_SUFFIXES)
                selected = _select(found, include)
                if not selected:
                    raise MissingAssetError(
                        f"No data files in {path} match {include!r} "
                        f"(found {len(found)} parquet/jsonl files)."
                    )
                files.extend(selected)
            elif path.is_file():
                files.append(path)
            else:
                raise MissingAssetError(f"Dataset file {path} does not exist.")
        return files
    raise MissingAssetError(
        f"Dataset {dataset!r} is not in the offline cache. On the login node, run:\n  "
        + download_command(dataset=dataset, include=include, revision=revision, cache_dir=cache_dir)
    )
