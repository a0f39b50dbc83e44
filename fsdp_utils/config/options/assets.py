"""The model and the dataset, from the offline cache (fsdp_utils.hub)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .section import Section

SECTION = Section("assets", "assets (from the offline cache)")
_opt = SECTION.option

DEFAULT_MODEL = "codellama/CodeLlama-7b-hf"
DEFAULT_DATASET = "laion/strategic_game_chess"
# laion/strategic_game_chess has hundreds of ~500 MB shards: by default one is enough.
DEFAULT_DATASET_INCLUDE = "chess_game_0001.parquet"


def default_dataset_include(dataset: str) -> str | None:
    """The default chess dataset has hundreds of ~500 MB shards: never all of them by default."""
    return DEFAULT_DATASET_INCLUDE if dataset == DEFAULT_DATASET else None


@dataclass
class AssetOptions:
    model: str = field(
        default=DEFAULT_MODEL,
        metadata=_opt("Hub id (resolved from the offline cache) or a local model folder."),
    )
    dataset: str = field(
        default=DEFAULT_DATASET,
        metadata=_opt(
            "Hub dataset id (from the offline cache), a local folder, or files (.parquet, .json, "
            ".jsonl, .csv, .arrow). The format follows from the columns (--data_format). "
            "Comma-separate several files.",
            joined=True,
        ),
    )
    dataset_include: str | None = field(
        default=None,
        metadata=_opt(
            "Glob(s) of dataset files to use, comma-separated, e.g. "
            "'chess_game_000[1-2].parquet'. Default: the files download_models.py fetched for "
            "a hub dataset (every shard it recorded), all files of a local folder; an empty "
            "string: all data files.",
            joined=True,
        ),
    )
    revision: str | None = field(
        default=None,
        metadata=_opt("Model revision (branch, tag or commit) in the cache."),
    )
    dataset_revision: str | None = field(
        default=None,
        metadata=_opt("Dataset revision (branch, tag or commit) in the cache."),
    )
    cache_dir: str | None = field(
        default=None,
        metadata=_opt("Hugging Face hub cache written by download_models.py (default: HF_HOME)."),
    )

    @property
    def resolved_dataset_include(self) -> str | None:
        """The file glob to download (download_models.py --config); None means all files. The
        trainer reads `dataset_include` itself: None there means what was downloaded."""
        if self.dataset_include is not None:
            return self.dataset_include or None
        return default_dataset_include(self.dataset)


def check(options: AssetOptions) -> None:
    """Nothing to check before the cache is read (fsdp_utils.hub.resolve does)."""
