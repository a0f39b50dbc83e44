"""A user mistake's report: one paragraph on stderr, exit code 2. At the bottom of the stages so
that the start-up checks (`fsdp_utils.versions`) can report before torch is imported."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

EXIT_USAGE = 2
# Rank 0 reports before the others learn of its failure; this is only so that its exit, not
# torchrun's SIGTERM after another rank's, ends it. The message does not depend on it: every
# rank that fails for a user mistake carries it in its torchrun error file.
PEER_EXIT_DELAY_S = 2.0


def report_error(message: str, *, show: bool = True) -> None:
    """A user mistake's one paragraph on stderr (`show`: rank 0 only). Under torchrun it also goes
    into the error file the agent reads (TORCHELASTIC_ERROR_FILE), on every rank that knows it:
    the agent's closing "Root Cause" report shows it where it would say "To enable traceback see
    ...", whichever rank the agent names (the first to fail by the clock, which under load need
    not be rank 0), so the message stays the last thing in the job's log."""
    if show:
        print(f"\nerror: {message}\n", file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # torch.distributed.elastic's format: {"message": {"message": ..., "extraInfo":
        # {"py_callstack": shown as the failure's traceback, "timestamp": ...}}}
        text = f"error: {message}"
        info = {"py_callstack": text, "timestamp": str(int(time.time()))}
        with contextlib.suppress(OSError):
            Path(error_file).write_text(
                json.dumps({"message": {"message": text, "extraInfo": info}})
            )
