"""Rows tokenised a batch at a time, in order: in this process, or in forked worker processes,
with progress in the log and a stop check after every batch (`tokenised`). The preparation
(`fsdp_utils.data.prepare`) hands it the work of one batch and the batches as it reads them."""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from fsdp_utils.data.streaming import Batch

PROGRESS_EVERY_S = 30.0


class PreparationStopped(Exception):
    """`stop` asked the work to stop (a training job's time limit) after `done`."""

    def __init__(self, reason: str, done: str) -> None:
        super().__init__(f"{reason} ({done})")
        self.reason = reason
        self.done = done


# Asked after every batch: the reason to stop (a training job's time limit), or None.
StopCheck = Callable[[], "str | None"]


def available_cpus() -> int:
    """The CPUs this process may use: a Slurm allocation's, not the node's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# The work of the pool's processes, set before they are forked (they inherit it: the tokenizer
# and the chat encoder are not pickled for every batch).
_WORK: Callable[[Batch], Any] | None = None


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _do_work(batch: Batch) -> Any:
    assert _WORK is not None
    return _WORK(batch)


def tokenised(
    work: Callable[[Batch], Any],
    batches: Iterator[Batch],
    *,
    num_proc: int,
    total: int,
    log: Any,
    stop: StopCheck | None = None,
) -> Iterator[Any]:
    """`work` of every batch, in order: in this process, or in `num_proc` forked ones with at
    most two batches each in flight (the rows are read as they are needed, not ahead). Logs
    progress every PROGRESS_EVERY_S seconds; asks `stop` after every batch but the last
    (PreparationStopped)."""
    global _WORK
    started = last = time.monotonic()
    done = 0

    def progress(rows: int) -> None:
        nonlocal done, last
        done += rows
        # Not after the last batch: what is left (splitting, packing) is quick beside the
        # tokenising, and a stopped preparation keeps nothing.
        if stop is not None and done < total and (reason := stop()):
            raise PreparationStopped(reason, f"tokenised {done:,} of {total:,} rows")
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S:
            last = now
            rate = done / max(now - started, 1e-9)
            log(
                f"data: tokenised {done:,} of {total:,} rows ({rate:,.0f} rows/s, "
                f"{num_proc} process(es)); about {(total - done) / max(rate, 1e-9) / 60:.1f} "
                "min left"
            )

    if num_proc <= 1:
        for batch in batches:
            result = work(batch)
            progress(len(next(iter(batch.values()))))
            yield result
        return
    import multiprocessing

    # The parent's tokenizer ran threads already; in forked workers the Rust library would turn
    # them off with a warning per worker. One thread per worker is what we want anyway.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORK = work
    pending: deque[tuple[int, Any]] = deque()
    try:
        # Ctrl-C reaches the workers too (the terminal's process group): the parent's stop
        # check handles it, the workers ignore it rather than each print a traceback.
        with multiprocessing.get_context("fork").Pool(num_proc, _ignore_interrupts) as pool:
            for batch in batches:
                pending.append(
                    (len(next(iter(batch.values()))), pool.apply_async(_do_work, (batch,)))
                )
                if len(pending) >= 2 * num_proc:
                    rows, result = pending.popleft()
                    yield result.get()
                    progress(rows)
            while pending:
                rows, result = pending.popleft()
                yield result.get()
                progress(rows)
    finally:
        _WORK = None
