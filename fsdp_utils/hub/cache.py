"""The Hugging Face hub cache on disk: where things live, free space, leftovers of killed runs.

Layout (huggingface_hub's, unchanged, so `from_pretrained(..., local_files_only=True)` works
on the same folder):

    <cache>/models--org--name/blobs/<etag>                 file contents
    <cache>/models--org--name/snapshots/<commit>/<path>    symlinks into blobs/
    <cache>/models--org--name/refs/<revision>              commit of a branch or tag
    <cache>/.locks/models--org--name/<etag>.lock           held while a blob downloads
    <cache>/offline-manifest.json                          ours: see fsdp_utils.hub.manifest
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

BUILTIN_CACHE_DIR = Path("~/.cache/huggingface/hub").expanduser().absolute()
# Room left for refs, tree listings, locks and the manifest, and for filesystem rounding.
DISK_MARGIN_BYTES = 16 * 1024**2
DISK_MARGIN_FRACTION = 0.01


def hub_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """The hub cache folder: `cache_dir` if given, else what huggingface_hub would use.

    Same precedence as `huggingface_hub.constants.HF_HUB_CACHE` (HF_HUB_CACHE, then the legacy
    HUGGINGFACE_HUB_CACHE, then HF_HOME/hub, then XDG_CACHE_HOME/huggingface/hub), but read at
    call time: importing huggingface_hub freezes it, and this runs before that import.
    """
    if cache_dir:
        return Path(os.path.expandvars(str(cache_dir))).expanduser().absolute()
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.path.expandvars(os.environ[name])).expanduser().absolute()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser().absolute() / "hub"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser().absolute() / "huggingface" / "hub"
    return BUILTIN_CACHE_DIR


def repo_folder_name(repo_id: str, repo_type: str) -> str:
    """`models--org--name`, as `huggingface_hub.file_download.repo_folder_name`."""
    return "--".join([f"{repo_type}s", *repo_id.split("/")])


def storage_dir(cache_dir: Path, repo_id: str, repo_type: str) -> Path:
    return cache_dir / repo_folder_name(repo_id, repo_type)


def snapshot_dir(cache_dir: Path, repo_id: str, repo_type: str, commit: str) -> Path:
    return storage_dir(cache_dir, repo_id, repo_type) / "snapshots" / commit


def format_bytes(n: float) -> str:
    """Decimal units, as the Hub shows sizes: 13478 -> '13.5 kB'."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class InsufficientDiskSpaceError(ValueError):
    """Too little free space for the files still to download."""


def nearest_existing(folder: Path) -> Path:
    """`folder`, or its nearest ancestor that exists: where its file system can be asked."""
    existing = Path(os.path.abspath(folder))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


def free_bytes(folder: Path) -> int:
    """Free space on the filesystem that holds (or will hold) `folder`."""
    return shutil.disk_usage(nearest_existing(folder)).free


def required_bytes(download_bytes: int) -> int:
    return download_bytes + int(download_bytes * DISK_MARGIN_FRACTION) + DISK_MARGIN_BYTES


def check_free_space(folder: Path, download_bytes: int, *, what: str, fix: str) -> None:
    """Raise before anything is written if `download_bytes` (plus a margin) will not fit."""
    free = free_bytes(folder)
    needed = required_bytes(download_bytes)
    if needed > free:
        raise InsufficientDiskSpaceError(
            f"Not enough disk space in {folder}: {what} need {format_bytes(download_bytes)} "
            f"({download_bytes} bytes) plus a {format_bytes(needed - download_bytes)} margin, "
            f"but only {format_bytes(free)} is free. Nothing was downloaded. Free some space, "
            f"or put the cache on project storage (not a small home quota):\n  {fix}\n"
            "and point the trainer at it too (export HF_HOME, or --cache_dir)."
        )


def remove_partial_downloads(cache_dir: Path, repo_id: str, repo_type: str) -> tuple[int, int]:
    """Delete `blobs/*.incomplete` files left by a killed download. Returns (count, bytes).

    huggingface_hub downloads each blob into a private `<etag>.<random>.incomplete` file under
    the lock `.locks/<repo>/<etag>.lock` and deletes it on failure, but a SIGKILL or a node
    crash leaves it behind. A lock we can take at once is not held by a running download, so
    its partial files are stale: removing them frees the space they hold without disturbing a
    concurrent download of the same repo.
    """
    from filelock import FileLock, Timeout

    folder = repo_folder_name(repo_id, repo_type)
    blobs = cache_dir / folder / "blobs"
    if not blobs.is_dir():
        return 0, 0
    count = size = 0
    for partial in sorted(blobs.glob("*.incomplete")):
        etag = partial.name.split(".", 1)[0]
        lock_path = cache_dir / ".locks" / folder / f"{etag}.lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with FileLock(str(lock_path), timeout=0):
                nbytes = partial.stat().st_size
                partial.unlink()
        except (Timeout, FileNotFoundError):
            continue  # being downloaded right now, or removed by someone else
        count += 1
        size += nbytes
    return count, size
