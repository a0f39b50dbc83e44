"""Checksums of cached files, in one read: sha256 (what the Hub publishes for LFS files, and
what the manifest records) and the git blob id (what it publishes for small files in git)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 8 * 1024**2  # hashlib releases the GIL on large updates: threads hash in parallel


@dataclass(frozen=True)
class FileDigest:
    size: int
    sha256: str
    git_blob_id: str  # sha1 of b"blob <size>\0" + content, as `git hash-object`


def digest_file(path: Path) -> FileDigest:
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    git_sha1 = hashlib.sha1(f"blob {size}\0".encode())
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            sha256.update(chunk)
            git_sha1.update(chunk)
    return FileDigest(size=size, sha256=sha256.hexdigest(), git_blob_id=git_sha1.hexdigest())


def digest_files(paths: Iterable[Path], workers: int = 4) -> dict[Path, FileDigest]:
    """Digests of several files in parallel threads (disk and hashing overlap)."""
    paths = list(paths)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return dict(zip(paths, pool.map(digest_file, paths), strict=True))
