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
    git_blob_id: str | None = None  # sha1 of b"blob <size>\0" + content (`git hash-object`)


def digest_file(path: Path, git_blob_id: bool = False) -> FileDigest:
    """sha256 (~1.3 GB/s per core here) and, if asked, the git blob id (~0.75 GB/s for both):
    only small files kept in git need the latter."""
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    git_sha1 = hashlib.sha1(f"blob {size}\0".encode()) if git_blob_id else None
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            sha256.update(chunk)
            if git_sha1 is not None:
                git_sha1.update(chunk)
    blob_id = git_sha1.hexdigest() if git_sha1 is not None else None
    return FileDigest(size=size, sha256=sha256.hexdigest(), git_blob_id=blob_id)


def digest_files(
    paths: Iterable[Path], workers: int = 4, git_blob_ids: bool = False
) -> dict[Path, FileDigest]:
    """Digests of several files in parallel threads (disk and hashing overlap)."""
    paths = list(paths)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        digests = pool.map(lambda p: digest_file(p, git_blob_ids), paths)
        return dict(zip(paths, digests, strict=True))
