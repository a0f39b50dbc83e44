"""Files and folders written whole or not at all: a crash, a full disk or the time limit never
leaves half of one where a reader (a requeued job, `from_pretrained`) would take it for whole."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def folder_written_atomically(destination: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `destination` to write into; when the block completes it
    replaces `destination`, so a crash (or the time limit) never leaves a half model."""
    destination = Path(destination)
    tmp = destination.with_name(destination.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    if destination.exists():
        shutil.rmtree(destination)
    tmp.rename(destination)
