"""Files and folders written whole or not at all: a crash, a full disk or the time limit never
leaves half of one where a reader (a requeued job, `from_pretrained`) would take it for whole."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def folder_written_atomically(destination: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `destination` to write into; when the block completes it
    replaces `destination`, so a crash (or the time limit) never leaves a half model. The old
    folder is renamed aside before the new one takes its name and removed after: at every
    moment one whole folder exists (under its name, or `<name>.old` for the instant between
    the two renames). A block that raises leaves `destination` as it was."""
    destination = Path(destination)
    tmp = destination.with_name(destination.name + ".tmp")
    old = destination.with_name(destination.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    if destination.exists():
        destination.rename(old)
    tmp.rename(destination)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def file_written_atomically(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` (`.<name>.<pid>.tmp`: two processes never share
    one) for a writer that takes a path (parquet, tarfile, gzip); when the block completes it is
    renamed over `path`, and removed if the block raises: `path` is the old whole file or the new
    one, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over `path`: readers
    see the old or the new content, never a truncated one, even after a crash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, 0o666 & ~_umask())  # mkstemp's 0600 would hide it from the group
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _umask() -> int:
    """The process umask, read without changing it (os.umask would, racing other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def write_json_atomic(path: Path, data: Any) -> None:
    """`data` as indented JSON (ending in a newline), written with `write_text_atomic`: the one
    way this project writes a JSON record that another process (a requeued leg, the sbatch
    script, a reader of the manifest) may read at any moment."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")
