"""Which files of a repo to fetch. Pure functions over the repo's file listing.

Models: the weights in safetensors (never also the `.bin`, `.h5`, `.msgpack`, `.gguf` or
`original/` copies many repos carry, which would double or triple the download), plus every
small support file at the top level: config, generation config, tokenizer, chat template,
licence. With a `model.safetensors.index.json`, exactly the shards it names (not a
`consolidated.safetensors` beside them); without, `model.safetensors` if there is one. Falls
back to PyTorch `.bin` weights only for repos without safetensors.

Datasets: the files matching the include globs; without globs, every data file (parquet,
jsonl, json, csv, arrow).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePath, PurePosixPath
from typing import TypeVar

DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv", ".arrow")
# Side files that end in .json but hold no rows: dataset cards', and `save_to_disk`'s.
_DATASET_METADATA = ("dataset_info.json", "dataset_infos.json", "state.json", "selfplay.json")
# Engine-labelled positions (`python -m fsdp_utils.chess_eval.selfplay --positions K`) lie beside
# the games of a self-play folder in a schema of their own: a folder read as a data set is its
# games, the positions only when named (`--dataset_include 'chess_position_*.parquet'`, or a
# folder that holds nothing else).
POSITION_SHARDS = "chess_position_*.parquet"

WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".onnx",
    ".onnx_data",
    ".gguf",
    ".ot",
    ".tflite",
    ".mlmodel",
    ".npz",
    ".pkl",
)
# Small top-level files a causal LM needs (or that carry its licence).
SUPPORT_SUFFIXES = (".json", ".model", ".txt", ".tiktoken", ".jinja", ".py", ".vocab", ".md")
SUPPORT_NAMES = ("LICENSE", "LICENCE", "NOTICE")
# What transformers loads: the index and the shards it names, else the single file.
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
P = TypeVar("P", bound=str | PurePath)


@dataclass(frozen=True)
class RemoteFile:
    """A file of a repo at one commit, as listed by the Hub."""

    path: str
    size: int
    blob_id: str  # git object id (sha1 of the git blob)
    lfs_sha256: str | None = None  # set for LFS files: sha256 of the content

    @property
    def etag(self) -> str:
        """Name of the file's blob in the Hugging Face cache (`blobs/<etag>`)."""
        return self.lfs_sha256 or self.blob_id


class NoMatchingFilesError(ValueError):
    """The include globs (or the automatic selection) match nothing in the repo."""


def split_patterns(include: str | None) -> list[str]:
    """'a.parquet, b*.parquet' -> ['a.parquet', 'b*.parquet']; None or '' -> []."""
    return [p.strip() for p in (include or "").split(",") if p.strip()]


def matches(path: str, patterns: Sequence[str]) -> bool:
    """A glob matches the path in the repo or just the file name (`chess_game_0001.parquet`
    selects `data/chess_game_0001.parquet` too)."""
    name = PurePosixPath(path).name
    return any(fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(name, p) for p in patterns)


def is_data_file(path: str) -> bool:
    name = PurePosixPath(path).name
    return name.endswith(DATA_SUFFIXES) and name not in _DATASET_METADATA


def without_positions(paths: Sequence[P]) -> list[P]:
    """`paths` less the labelled-position shards, unless they are all there is."""
    games = [p for p in paths if not fnmatch.fnmatchcase(PurePosixPath(p).name, POSITION_SHARDS)]
    return games or list(paths)


def select_data_paths(paths: Iterable[str], include: str | None) -> list[str]:
    """Dataset files: those matching `include`, or every data file without it. Sorted."""
    patterns = split_patterns(include)
    if patterns:
        return sorted(p for p in paths if matches(p, patterns))
    return sorted(p for p in paths if is_data_file(p))


def select_dataset_files(
    files: Sequence[RemoteFile], include: str | None, repo_id: str
) -> list[RemoteFile]:
    by_path = {f.path: f for f in files}
    chosen = select_data_paths(by_path, include)
    if not chosen:
        raise NoMatchingFilesError(_no_match_message(repo_id, include, list(by_path)))
    return [by_path[p] for p in chosen]


def select_model_files(
    files: Sequence[RemoteFile],
    repo_id: str,
    include: str | None = None,
    indexed: Sequence[str] | None = None,
) -> list[RemoteFile]:
    """Safetensors weights plus top-level support files (see the module docstring).

    `indexed`: the files named by the repo's `model.safetensors.index.json` (its weight_map),
    when it has one: exactly those are the weights, as `from_pretrained` loads them. Repos
    such as Mistral-7B-v0.3 carry a consolidated copy of every weight beside the shards
    (`consolidated.safetensors`, 14.5 GB) that nothing here reads.
    """
    patterns = split_patterns(include)
    if patterns:
        chosen = [f for f in files if matches(f.path, patterns)]
        if not chosen:
            raise NoMatchingFilesError(_no_match_message(repo_id, include, [f.path for f in files]))
        return sorted(chosen, key=lambda f: f.path)

    top_level = [f for f in files if "/" not in f.path]
    safetensors = [f for f in top_level if f.path.endswith(".safetensors")]
    if indexed is not None:
        by_path = {f.path: f for f in files}
        absent = sorted(set(indexed) - set(by_path))
        if absent:
            raise NoMatchingFilesError(
                f"{repo_id}'s {SAFETENSORS_INDEX} names weight files the repo does not have: "
                f"{_sample(absent)}. The repo is incomplete at this revision; pick files "
                "explicitly with an `include:` entry in an assets file "
                "(python download_models.py --config FILE), or choose another --revision."
            )
        safetensors = [by_path[p] for p in sorted(set(indexed))]
    elif any(f.path == SAFETENSORS_SINGLE for f in safetensors):
        # One file and no index: transformers loads model.safetensors and nothing else.
        safetensors = [f for f in safetensors if f.path == SAFETENSORS_SINGLE]
    pytorch_bins = [f for f in top_level if fnmatch.fnmatchcase(f.path, "pytorch_model*.bin")]
    weights = safetensors or pytorch_bins
    if not weights:
        raise NoMatchingFilesError(
            f"{repo_id} has no weights in safetensors or PyTorch (.bin) format at the top level "
            f"(files: {_sample([f.path for f in files])}). Pick files explicitly with an "
            "`include:` entry in an assets file (python download_models.py --config FILE)."
        )
    # The index of the format we do not fetch would point at missing files.
    skipped_index = "pytorch_model.bin.index.json" if safetensors else SAFETENSORS_INDEX
    support = [f for f in top_level if _is_support_file(f.path) and f.path != skipped_index]
    return sorted(weights + support, key=lambda f: f.path)


def _is_support_file(name: str) -> bool:
    if name.endswith(WEIGHT_SUFFIXES):
        return False
    return name.endswith(SUPPORT_SUFFIXES) or name.upper().startswith(SUPPORT_NAMES)


def _sample(paths: Sequence[str], n: int = 5) -> str:
    if not paths:
        return "none"
    more = f", ... ({len(paths) - n} more)" if len(paths) > n else ""
    return ", ".join(sorted(paths)[:n]) + more


def _no_match_message(repo_id: str, include: str | None, paths: Sequence[str]) -> str:
    if split_patterns(include):
        what = f"No file of {repo_id} matches {include!r}"
        candidates = [p for p in paths if is_data_file(p)] or list(paths)
    else:
        what = f"{repo_id} has no data files (parquet, jsonl, json)"
        candidates = list(paths)
    return (
        f"{what} ({len(paths)} files, e.g. {_sample(candidates)}). Check the glob: it is matched "
        "against file names, e.g. --dataset-include 'chess_game_000[1-2].parquet'."
    )
