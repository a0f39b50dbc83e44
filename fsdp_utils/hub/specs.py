"""What to fetch: `AssetSpec`, built from the command line, an assets file or a training config.

An assets file lists several repos:

    cache_dir: /projects/my_group/hf-cache     # optional; --cache-dir wins
    assets:
      - model: codellama/CodeLlama-7b-hf
        revision: main                         # branch, tag or commit (default: main)
      - dataset: laion/strategic_game_chess
        include: "chess_game_000[1-4].parquet" # comma-separated globs (default: all data files)

A training config (the YAML/JSON given to `chess_finetune.py --config`) works too: its model,
dataset, dataset_include, revision, dataset_revision and cache_dir are what the trainer will
look up, so fetching from it cannot miss anything the run needs.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from fsdp_utils.arguments import closest, did_you_mean
from fsdp_utils.config.model_path import with_model_path
from fsdp_utils.config.parse import config_from_dict, load_config_file
from fsdp_utils.config.train_config import (
    DEFAULT_DATASET,
    DEFAULT_DATASET_INCLUDE,
    DEFAULT_MODEL,
    TrainConfig,
    default_dataset_include,
)
from fsdp_utils.hub.cache import BUILTIN_CACHE_DIR, hub_cache_dir
from fsdp_utils.hub.selection import DATA_SUFFIXES

RepoType = Literal["model", "dataset"]
DEFAULT_REVISION = "main"  # the Hub's default branch (huggingface_hub.constants.DEFAULT_REVISION)
_ASSET_KEYS = ("model", "dataset", "revision", "include")


@dataclass(frozen=True)
class AssetSpec:
    """One repo to fetch. `include` (comma-separated globs) picks dataset files; for a model it
    replaces the automatic selection (safetensors + config + tokenizer) when given."""

    repo_id: str
    repo_type: RepoType
    revision: str | None = None
    include: str | None = None

    @property
    def requested_revision(self) -> str:
        return self.revision or DEFAULT_REVISION

    def __str__(self) -> str:
        text = f"{self.repo_type} {self.repo_id}@{self.requested_revision}"
        return text + (f" [{self.include}]" if self.include else "")

    def command(self, cache_dir: str | Path | None = None) -> str:
        """The `download_models.py` command that fetches (or repairs) this asset."""
        if self.repo_type == "model":
            return download_command(model=self.repo_id, revision=self.revision, cache_dir=cache_dir)
        return download_command(
            dataset=self.repo_id,
            include=self.include,
            dataset_revision=self.revision,
            cache_dir=cache_dir,
        )


def looks_local(name: str) -> bool:
    """A path rather than a hub id: explicit path syntax, or something that exists on disk
    (the rule transformers' `from_pretrained` applies too)."""
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists()


def looks_like_path(name: str) -> bool:
    """Meant as a path, whether or not it exists: `looks_local`, a file's suffix (a hub id
    names a repository, not a file: `data/chat.jsonl`), more than two names between its `/`s
    (a hub id has two: org/name; `org//name` is a mistyped id, not a path), or a first folder that exists here (`data/chat` beside a `data/` folder).
    Callers ask after the offline cache had no such hub id, so a cached one still wins."""
    path = PurePosixPath(name)
    return (
        looks_local(name)
        or path.suffix in (*DATA_SUFFIXES, ".safetensors", ".bin", ".json", ".yaml")
        or len(path.parts) > 2
        or (len(path.parts) > 1 and Path(path.parts[0]).expanduser().is_dir())
    )


def no_such_path(flag: str, name: str) -> str:
    """`--dataset data/chat.jsonl: no such file or folder`, with the names beside it that look
    closest (`chats.jsonl`), from the nearest folder that exists."""
    path = Path(name).expanduser()
    folder = path.parent
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    wanted = path.parts[len(folder.parts)]  # the first part that is not there
    try:
        beside = sorted(entry.name for entry in folder.iterdir())
    except OSError:
        beside = []
    close = closest(wanted, beside, n=3)
    where = "./" if folder == Path(".") else str(folder).rstrip("/") + "/"
    hint = (
        f" In {where} the closest names are: {', '.join(close)}."
        if close
        else f" {where} holds {len(beside)} entries, none named like {wanted!r}."
    )
    return (
        f"{flag} {name}: no such file or folder.{hint} Fix the path (a path is read where it "
        "is; only a hub id, org/name, comes from the offline cache or a download)."
    )


def download_command(
    *,
    model: str | None = None,
    dataset: str | None = None,
    include: str | None = None,
    revision: str | None = None,
    dataset_revision: str | None = None,
    cache_dir: str | Path | None = None,
) -> str:
    """`python download_models.py ...` for the given assets, ready to paste on the login node.

    The cache folder is spelled out unless it is Hugging Face's built-in default: a compute
    node that found its cache through HF_HOME may be talking to a login shell that lacks it.
    """
    parts = ["python", "download_models.py"]
    if model:
        parts += ["--model", model]
        if revision:
            parts += ["--revision", revision]
    if dataset:
        parts += ["--dataset", dataset]
        # No globs means every data file; say so when the command line's default is a subset.
        if include or default_dataset_include(dataset) is not None:
            parts += ["--dataset-include", include or ""]
        if dataset_revision:
            parts += ["--dataset-revision", dataset_revision]
    cache = hub_cache_dir(cache_dir)
    if cache != BUILTIN_CACHE_DIR:
        parts += ["--cache-dir", str(cache)]
    return shlex.join(parts)


def default_specs() -> list[AssetSpec]:
    """What `chess_finetune.py` uses when given no asset flags."""
    return [
        AssetSpec(DEFAULT_MODEL, "model"),
        AssetSpec(DEFAULT_DATASET, "dataset", include=DEFAULT_DATASET_INCLUDE),
    ]


def specs_from_train_config(config: TrainConfig) -> list[AssetSpec]:
    """The hub assets a training run will look up (local paths need no download)."""
    specs = []
    if not looks_local(config.model):
        specs.append(AssetSpec(config.model, "model", revision=config.revision))
    if config.lora_from and not looks_local(config.lora_from):  # an adapter repo: as a model's
        specs.append(AssetSpec(config.lora_from, "model"))
    if config.teacher and not looks_local(config.teacher):  # --method distill's teacher
        specs.append(AssetSpec(config.teacher, "model", revision=config.teacher_revision))
    # A --dataset_module reads its own files; --dataset is not used then.
    names = [d.strip() for d in config.dataset.split(",") if d.strip()]
    for name in names if config.dataset_module is None else []:
        if not looks_local(name):
            include = config.resolved_dataset_include
            specs.append(AssetSpec(name, "dataset", config.dataset_revision, include))
    return specs


@dataclass(frozen=True)
class AssetsFile:
    """What `--config FILE` asks for. `train_config` is set when FILE is a training config."""

    specs: list[AssetSpec]
    cache_dir: str | None
    train_config: TrainConfig | None = None
    eval_tasks: tuple[str, ...] = ()  # lm-eval tasks whose data to cache (`eval_tasks:`)


def load_assets_file(path: str | Path) -> AssetsFile:
    """Assets and cache folder from an assets file or a training config file."""
    data = load_config_file(path)
    if "assets" not in data:  # a training config: what its run will look up
        config = with_model_path(config_from_dict(data, source=str(path)))
        tasks = split_tasks(config.eval_tasks)
        return AssetsFile(specs_from_train_config(config), config.cache_dir, config, tasks)
    unknown = sorted(set(data) - {"assets", "cache_dir", "eval_tasks"})
    if unknown:
        raise ValueError(
            f"{path}: unknown key(s) {unknown}; an assets file has `assets:` (a list) and "
            "optionally `cache_dir:` and `eval_tasks:` (lm-eval tasks)."
        )
    items = data["assets"]
    tasks = split_tasks(data.get("eval_tasks"))
    if not isinstance(items, list) or not (items or tasks):
        raise ValueError(f"{path}: `assets:` must be a non-empty list of model/dataset entries.")
    specs = [_spec_from_item(item, f"{path}, asset {i + 1}") for i, item in enumerate(items)]
    cache_dir = data.get("cache_dir")
    return AssetsFile(specs, str(cache_dir) if cache_dir else None, eval_tasks=tasks)


def split_tasks(value: Any) -> tuple[str, ...]:
    """`arc_easy,mmlu` or a list of names -> ('arc_easy', 'mmlu')."""
    if not value:
        return ()
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    return tuple(dict.fromkeys(t.strip() for t in items if t.strip()))


def _spec_from_item(item: Any, where: str) -> AssetSpec:
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a mapping such as `- model: org/name`, got {item!r}.")
    for key in item:
        if key not in _ASSET_KEYS:
            hint = did_you_mean(str(key), _ASSET_KEYS)
            raise ValueError(f"{where}: unknown key {key!r}{hint}; allowed: {list(_ASSET_KEYS)}.")
    kinds = [k for k in ("model", "dataset") if item.get(k)]
    if len(kinds) != 1:
        raise ValueError(f"{where}: give exactly one of `model:` or `dataset:`, got {item!r}.")
    kind: RepoType = "model" if kinds[0] == "model" else "dataset"
    values = {k: (None if item.get(k) is None else str(item[k])) for k in _ASSET_KEYS}
    repo_id = values[kind]
    assert repo_id is not None
    include = values["include"]
    if kind == "dataset" and "include" not in item:
        include = default_dataset_include(repo_id)
    return AssetSpec(repo_id, kind, values["revision"], include)
