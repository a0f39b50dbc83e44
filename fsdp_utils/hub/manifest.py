"""The manifest: what the offline cache holds, pinned and checksummed.

`<cache>/offline-manifest.json` has one entry per (repo type, repo, requested revision): the
commit the revision resolved to, every file fetched (path, size, sha256, all verified against
the Hub's metadata), the full file listing of the repo at that commit (so the trainer can tell
"this shard was never downloaded" from "this shard does not exist"), the endpoint and the time.

An entry is written only after all its files are downloaded and verified, by an atomic rename
under a lock: an interrupted or failed download never leaves a half-written entry, and
concurrent downloads into one cache do not lose each other's entries.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from fsdp_utils.atomic import write_json_atomic
from fsdp_utils.hub.cache import snapshot_dir
from fsdp_utils.hub.selection import matches, select_data_paths, split_patterns

MANIFEST_NAME = "offline-manifest.json"
FORMAT_VERSION = 1
DEFAULT_REVISION = "main"


@dataclass(frozen=True)
class FileRecord:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ManifestEntry:
    repo_id: str
    repo_type: str  # "model" or "dataset"
    revision: str  # as requested: branch, tag or commit
    commit: str  # what it resolved to when downloaded
    files: tuple[FileRecord, ...]
    repo_files: tuple[str, ...]  # every file of the repo at `commit`
    endpoint: str
    downloaded_at: str  # ISO 8601, UTC

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.repo_type, self.repo_id, self.revision)

    def snapshot(self, cache_dir: Path) -> Path:
        return snapshot_dir(cache_dir, self.repo_id, self.repo_type, self.commit)

    def file_paths(self) -> set[str]:
        return {f.path for f in self.files}

    def wanted_paths(self, include: str | None) -> list[str]:
        """The files a consumer asking for `include` needs, by the downloader's own selection
        rules: a model's recorded files (or those matching `include`), a dataset's data files
        matching `include` among all the repo's files, downloaded or not."""
        patterns = split_patterns(include)
        if self.repo_type == "model":
            if not patterns:
                return sorted(self.file_paths())
            return sorted(p for p in self.repo_files if matches(p, patterns))
        return select_data_paths(self.repo_files, include)

    def merged_into(self, old: ManifestEntry | None) -> ManifestEntry:
        """This (new) entry combined with the one it replaces.

        At the same commit the files accumulate (fetching shard 2 keeps shard 1). If the branch
        moved, the entry is re-pinned to the new commit with only the new files: mixing files
        from two commits would silently train on something no revision ever contained.
        """
        if old is None or old.commit != self.commit:
            return self
        files = {f.path: f for f in old.files} | {f.path: f for f in self.files}
        return replace(self, files=tuple(files[p] for p in sorted(files)))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["repo_files"] = list(self.repo_files)
        data["files"] = [asdict(f) for f in self.files]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ManifestEntry:
        return cls(
            repo_id=data["repo_id"],
            repo_type=data["repo_type"],
            revision=data["revision"],
            commit=data["commit"],
            files=tuple(FileRecord(**f) for f in data["files"]),
            repo_files=tuple(data["repo_files"]),
            endpoint=data["endpoint"],
            downloaded_at=data["downloaded_at"],
        )


def manifest_path(cache_dir: Path) -> Path:
    return cache_dir / MANIFEST_NAME


def load_manifest(cache_dir: Path) -> list[ManifestEntry]:
    """The entries of the cache's manifest (none if nothing was downloaded yet)."""
    path = manifest_path(cache_dir)
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT_VERSION}")
        return [ManifestEntry.from_json(item) for item in data["assets"]]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"The manifest {path} is unreadable ({error}). Move it aside and re-run "
            "`python download_models.py` for your assets: files already in the cache are "
            "verified, not downloaded again."
        ) from error


def find_entry(
    entries: Sequence[ManifestEntry], repo_type: str, repo_id: str, revision: str | None
) -> ManifestEntry | None:
    """The entry for a requested revision: a branch or tag by name, a commit by (a prefix of
    at least 7 characters of) its hash. No revision means the default branch, or the only
    revision of that repo in the cache."""
    mine = [e for e in entries if (e.repo_type, e.repo_id) == (repo_type, repo_id)]
    if revision is None:
        default = [e for e in mine if e.revision == DEFAULT_REVISION]
        if default:
            return default[0]
        return mine[0] if len(mine) == 1 else None
    for entry in mine:
        if entry.revision == revision:
            return entry
    if len(revision) >= 7:
        for entry in mine:
            if entry.commit.startswith(revision.lower()):
                return entry
    return None


def cached_revisions(entries: Sequence[ManifestEntry], repo_type: str, repo_id: str) -> list[str]:
    """'v1.0 (commit 1a2b3c4)' for each cached revision of a repo, for error messages."""
    return [
        f"{e.revision} (commit {e.commit[:7]})"
        for e in entries
        if (e.repo_type, e.repo_id) == (repo_type, repo_id)
    ]


def record_entry(cache_dir: Path, entry: ManifestEntry) -> ManifestEntry:
    """Add or update `entry` in the manifest (atomically, under a lock). Returns what was
    recorded, which includes files from earlier downloads of the same commit."""
    with _manifest_lock(cache_dir):
        entries = {e.key: e for e in load_manifest(cache_dir)}
        merged = entry.merged_into(entries.get(entry.key))
        entries[entry.key] = merged
        _write(cache_dir, list(entries.values()))
    return merged


@contextmanager
def _manifest_lock(cache_dir: Path) -> Iterator[None]:
    from filelock import FileLock

    lock_path = cache_dir / ".locks" / f"{MANIFEST_NAME}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_path)):
        yield


def _write(cache_dir: Path, entries: list[ManifestEntry]) -> None:
    data = {
        "format": FORMAT_VERSION,
        "written_by": "download_models.py (fsdp_utils.hub); check with --verify",
        "assets": [e.to_json() for e in sorted(entries, key=lambda e: e.key)],
    }
    write_json_atomic(manifest_path(cache_dir), data)
