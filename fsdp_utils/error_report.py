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
# torchrun's SIGTERM after another rank's, ends it.
PEER_EXIT_DELAY_S = 2.0


def report_error(message: str) -> None:
    """A user mistake's one paragraph on stderr (rank 0 calls this). Under torchrun it also goes
    into the error file the agent reads (TORCHELASTIC_ERROR_FILE): the agent's closing "Root
    Cause" report then shows it where it would say "To enable traceback see ...", so the message
    stays the last thing in the job's log."""
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
