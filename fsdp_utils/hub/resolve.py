"""Compute-side resolution of `--model` and `--dataset` to local files, never touching the network.

A local path is used as is. A hub id is looked up in the offline cache written by
`download_models.py`: its manifest (`<cache>/offline-manifest.json`) pins the requested
revision to the commit that was downloaded and verified, and lists every file of the repo at
that commit, so a shard that was never fetched is told apart from one that does not exist.
The cache folder is `cache_dir`, else what huggingface_hub uses (HF_HUB_CACHE, HF_HOME/hub,
~/.cache/huggingface/hub). Like huggingface_hub with HF_HUB_OFFLINE=1, nothing here makes a
network call; unlike it, a stale or partial snapshot is an error rather than a silent fallback.

Anything missing raises `MissingAssetError`, whose message is the exact `download_models.py`
command to run on the login node.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from fsdp_utils.config.train_config import TrainConfig, default_dataset_include
from fsdp_utils.hub.cache import hub_cache_dir, storage_dir
from fsdp_utils.hub.manifest import (
    ManifestEntry,
    cached_revisions,
    find_entry,
    load_manifest,
    manifest_path,
)
from fsdp_utils.hub.selection import (
    DATA_SUFFIXES,
    POSITION_SHARDS,
    is_data_file,
    select_data_paths,
    split_patterns,
    without_positions,
)
from fsdp_utils.hub.specs import (
    AssetSpec,
    download_command,
    looks_like_path,
    looks_local,
    no_such_path,
)

__all__ = [
    "DATA_SUFFIXES",
    "MissingAssetError",
    "describe_dataset_files",
    "download_command",
    "resolve_adapter_dir",
    "resolve_dataset_files",
    "resolve_model_dir",
]


# Missing dataset files are named one by one in the download command up to this many; beyond,
# the command repeats the globs asked for.
MAX_FILES_BY_NAME = 16


class MissingAssetError(ValueError):
    """An asset is not available offline; the message says how to fetch it."""


def resolve_model_dir(
    model: str, revision: str | None = None, cache_dir: str | None = None
) -> Path:
    """Folder holding config.json, tokenizer files and safetensors weights."""
    if looks_local(model):
        path = Path(model).expanduser()
        if not path.exists():
            raise MissingAssetError(no_such_path("--model", model))
        if not (path / "config.json").is_file():
            raise MissingAssetError(
                f"Model folder {path} has no config.json. Point --model at a folder saved with "
                "save_pretrained(), or at a hub id cached with download_models.py."
            )
        return path
    spec = AssetSpec(model, "model", revision)
    entry, snapshot = _cached(spec, cache_dir, revision_flag="--revision", flag="--model")
    _require_files(spec, entry, snapshot, entry.wanted_paths(None), cache_dir)
    if not (snapshot / "config.json").is_file():
        raise MissingAssetError(
            f"The cached {spec} ({snapshot}) has no config.json: it was downloaded with an "
            "`include:` that left it out. Download the model with the default file selection:\n  "
            + spec.command(cache_dir)
        )
    return snapshot


def config_folder(model: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """The folder with a model's config.json, which is all the memory planner reads: the
    offline cache normally holds the whole model (download_models.py); failing that, the
    config.json of a model recorded with files missing, or one that huggingface_hub cached on
    its own (`download_models.py --config_only`), is enough to plan before downloading."""
    try:
        return resolve_model_dir(model, revision, cache_dir)
    except MissingAssetError as err:
        from huggingface_hub import try_to_load_from_cache

        if looks_local(model):
            raise
        cache = hub_cache_dir(cache_dir)
        entry = find_entry(load_manifest(cache), "model", model, revision)
        if entry is not None and (entry.snapshot(cache) / "config.json").is_file():
            return entry.snapshot(cache)
        cached = try_to_load_from_cache(model, "config.json", cache_dir=cache, revision=revision)
        if isinstance(cached, str):
            return Path(cached).parent
        spec = AssetSpec(model, "model", revision)
        raise MissingAssetError(
            f"{err}\nThe memory plan reads only the model's config.json: to plan before "
            f"downloading the weights, fetch just that on the login node (seconds):\n  "
            f"{spec.command(cache_dir)} --config_only"
        ) from None


def resolve_adapter_dir(adapter: str, cache_dir: str | None = None) -> Path:
    """Folder of a PEFT adapter (`--lora_from`): a local folder as is, or a hub id from the
    offline cache (`download_models.py --model ID` fetches an adapter repo like a model's:
    adapter_config.json and adapter_model.safetensors)."""
    if looks_local(adapter):
        path = Path(adapter).expanduser()
        if not path.is_dir():
            raise MissingAssetError(no_such_path("--lora_from", adapter))
        return path
    spec = AssetSpec(adapter, "model")
    entry, snapshot = _cached(spec, cache_dir, revision_flag="--lora_from", flag="--lora_from")
    _require_files(spec, entry, snapshot, entry.wanted_paths(None), cache_dir)
    return snapshot


def _select(files: list[Path], include: str | None) -> list[Path]:
    patterns = split_patterns(include)
    if not patterns:
        return files
    return [f for f in files if any(fnmatch.fnmatch(f.name, p) for p in patterns)]


def resolve_dataset_files(
    dataset: str,
    include: str | None = None,
    revision: str | None = None,
    cache_dir: str | None = None,
) -> list[Path]:
    """The data files (parquet, json, jsonl, csv, arrow) that make up `dataset`, sorted.

    `dataset` is a hub id, a folder, a file, or several of them comma-separated; `include`
    (comma-separated globs on file names) selects among them. Without `include` (None), a hub
    dataset is the files `download_models.py` fetched for it (its manifest entry: every shard
    downloaded at that commit, whatever `--dataset-include` was used) and a folder is all its
    data files (a self-play folder's games: its labelled positions, `chess_position_*.parquet`,
    only by `include`); an empty `include` is every data file of the dataset, downloaded or not.
    """
    names = [d.strip() for d in dataset.split(",") if d.strip()]
    files: list[Path] = []
    for name in names:
        if looks_local(name):
            if not Path(name).expanduser().exists():
                raise MissingAssetError(no_such_path("--dataset", name))
            files.extend(_local_dataset_files(Path(name).expanduser(), include))
        else:
            files.extend(_cached_dataset_files(name, include, revision, cache_dir))
    return files


def describe_dataset_files(files: list[Path], include: str | None, dataset: str) -> str:
    """Which data files a run uses and why, for its log: 'N file(s) (...): a, b, ... z'."""
    names = [name.strip() for name in dataset.split(",") if name.strip()]
    local = all(looks_local(name) for name in names)
    if include is None and local and all(Path(n).expanduser().is_file() for n in names):
        why = "the file(s) given"
    elif include is None and local:
        why = "every data file of the folder(s) given; --dataset_include to choose"
        folders = [Path(n).expanduser() for n in names if Path(n).expanduser().is_dir()]
        left_out = not _select(files, POSITION_SHARDS)
        if left_out and any(next(f.rglob(POSITION_SHARDS), None) for f in folders):
            why += (
                f"; the labelled positions beside the games: --dataset_include {POSITION_SHARDS!r}"
            )
    elif include is None:
        why = "those download_models.py fetched; --dataset_include to choose"
    elif include == "":
        why = "all data files: --dataset_include ''"
    else:
        why = f"--dataset_include {include!r}"
    names = [f.name for f in files]
    shown = ", ".join(names if len(names) <= 4 else [*names[:3], "...", names[-1]])
    return f"{len(files)} file(s) ({why}): {shown}"


def _local_dataset_files(path: Path, include: str | None) -> list[Path]:
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and is_data_file(p.name))
        selected = _select(found, include) if include is not None else without_positions(found)
        if not selected:
            raise MissingAssetError(
                f"No data files in {path} match {include!r} "
                f"(found {len(found)} {'/'.join(s[1:] for s in DATA_SUFFIXES)} files)."
            )
        return selected
    return [path]


def _cached_dataset_files(
    dataset: str, include: str | None, revision: str | None, cache_dir: str | None
) -> list[Path]:
    if include is None:
        # Not downloaded at all: fetch what download_models.py fetches by default (one shard
        # of the chess dataset, never all of them).
        spec = AssetSpec(dataset, "dataset", revision, default_dataset_include(dataset))
        entry, snapshot = _cached(
            spec, cache_dir, revision_flag="--dataset_revision", flag="--dataset"
        )
        wanted = select_data_paths(entry.file_paths(), None)
        if not wanted:
            raise MissingAssetError(
                f"download_models.py fetched no data file of dataset {dataset} (commit "
                f"{entry.commit[:10]}). On the login node run:\n  {spec.command(cache_dir)}"
            )
    else:
        spec = AssetSpec(dataset, "dataset", revision, include or None)
        entry, snapshot = _cached(
            spec, cache_dir, revision_flag="--dataset_revision", flag="--dataset"
        )
        wanted = entry.wanted_paths(include)
        if not wanted:
            data_files = entry.wanted_paths(None)
            raise ValueError(
                f"No file of dataset {dataset} (commit {entry.commit[:10]}) matches {include!r}: "
                f"it has {len(data_files)} data files, e.g. "
                f"{', '.join(data_files[:3]) or 'none'}. Fix --dataset_include."
            )
    _require_files(spec, entry, snapshot, wanted, cache_dir)
    return [snapshot / p for p in wanted]


def _cached(
    spec: AssetSpec, cache_dir: str | None, *, revision_flag: str, flag: str
) -> tuple[ManifestEntry, Path]:
    """The manifest entry and snapshot folder of a hub asset, or MissingAssetError: a name
    that is no hub id in the cache but looks like a path (`flag` took it) is a missing file,
    not something to download."""
    cache = hub_cache_dir(cache_dir)
    entries = load_manifest(cache)
    entry = find_entry(entries, spec.repo_type, spec.repo_id, spec.revision)
    if entry is not None:
        return entry, entry.snapshot(cache)
    if looks_like_path(spec.repo_id) and not cached_revisions(
        entries, spec.repo_type, spec.repo_id
    ):
        raise MissingAssetError(no_such_path(flag, spec.repo_id))
    kind = spec.repo_type.capitalize()
    others = cached_revisions(entries, spec.repo_type, spec.repo_id)
    if others:
        where = (
            f"{kind} {spec.repo_id} is cached at {', '.join(others)}, but not at "
            f"{spec.requested_revision!r}. Pass {revision_flag} with one of those, or"
        )
    elif (storage_dir(cache, spec.repo_id, spec.repo_type) / "snapshots").is_dir():
        where = (
            f"{kind} {spec.repo_id} is in {cache} but was not downloaded with "
            f"download_models.py, so it is neither pinned nor verified (no entry in "
            f"{manifest_path(cache).name}). Cached files are reused:"
        )
    else:
        where = f"{kind} {spec.repo_id} is not in the offline cache {cache}. To fetch it,"
    raise MissingAssetError(f"{where} on the login node run:\n  {spec.command(cache_dir)}")


def _require_files(
    spec: AssetSpec,
    entry: ManifestEntry,
    snapshot: Path,
    wanted: list[str],
    cache_dir: str | None,
) -> None:
    """Every wanted file recorded and present (a stat, not a hash: that is --verify's job)."""
    recorded = entry.file_paths()
    missing = [p for p in wanted if p not in recorded or not (snapshot / p).is_file()]
    if not missing:
        return
    shown = ", ".join(missing[:3]) + (
        f", ... ({len(missing) - 3} more)" if len(missing) > 3 else ""
    )
    raise MissingAssetError(
        f"{len(missing)} file(s) of {spec} (commit {entry.commit[:10]}) are not in the "
        f"offline cache: {shown}. {_fetch_missing(spec, missing, cache_dir)}"
    )


def _fetch_missing(spec: AssetSpec, missing: list[str], cache_dir: str | None) -> str:
    """What to run on the login node, ending with the command: it fetches the missing files
    by name when they are few, and never all of a dataset too large to fetch whole (the chess
    dataset's shards are terabytes together)."""
    if spec.repo_type == "dataset" and len(missing) <= MAX_FILES_BY_NAME:
        names = ",".join(glob.escape(PurePosixPath(p).name) for p in missing)
        spec = dataclasses.replace(spec, include=names)
    elif spec.repo_type == "dataset" and not spec.include:
        subset = default_dataset_include(spec.repo_id)
        if subset is not None:
            example = dataclasses.replace(spec, include=subset)
            return (
                f"That is every data file of {spec.repo_id}, too much to fetch: choose shards "
                "with --dataset_include (the same globs for download_models.py "
                "--dataset-include), e.g. on the login node:\n  " + example.command(cache_dir)
            )
    return f"On the login node run:\n  {spec.command(cache_dir)}"


def load_model_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(
            f"Cannot read the model config in {model_dir}: {err}. Is it a transformers model "
            "folder (config.json with a known model_type)?"
        ) from err


@dataclass(frozen=True)
class ResolvedAssets:
    """What a run's `--model` and `--dataset` are on this machine: resolved once per process
    (`fsdp_utils.run.preflight.check_run`) and handed to the storage check, the Trainer and the
    data preparation, so the manifest is read and config.json parsed once."""

    model_dir: Path
    model_config: Any  # transformers' PretrainedConfig, read from model_dir/config.json
    dataset_files: tuple[Path, ...]


def resolve_assets(config: TrainConfig) -> ResolvedAssets:
    """The run's model folder, its config, and its data files, from the offline cache or local
    paths; MissingAssetError (a ValueError naming the download command) when any is missing."""
    model_dir = resolve_model_dir(config.model, config.revision, config.cache_dir)
    files: list[Path] = []
    if config.dataset_module is None:  # a --dataset_module reads its own files
        files = resolve_dataset_files(
            config.dataset, config.dataset_include, config.dataset_revision, config.cache_dir
        )
    return ResolvedAssets(model_dir, load_model_config(model_dir), tuple(files))
