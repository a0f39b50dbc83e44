"""A training process's start-up without Python's cyclic garbage collector.

Starting a training process imports torch, its distributed tensor machinery and transformers,
and builds the model on `meta`: ~1.5 million objects that live as long as the process, and no
cyclic garbage worth collecting. The collector, which runs every few hundred new objects and
walks the older ones again each time their number has grown by a quarter, took 17% of that
start's CPU (the imports of a worker: 5.3 -> 4.4 s on the 2-core test machine; every rank of
every job, every requeued leg and the preflight pay it).

So `chess_finetune.py` pauses it first thing, and the Trainer resumes it once the model is
built on meta, before the data is prepared (which can run long and make garbage): what the
start built is frozen out of the collector's passes (`gc.freeze`), which then see only what
the run makes. Only the process's own entry point pauses it: a program that runs the trainer
in its own process (the tests, a notebook) keeps its collector as it was, and resuming is then
nothing.
"""

from __future__ import annotations

import gc

_paused = False


def pause_collector() -> None:
    """Turn the cyclic collector off for the process's start (its entry point only)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_collector() -> None:
    """Turn it back on, if `pause_collector` turned it off, with what exists now frozen.
    Called where the start-up ends (the model on meta, before the data), and on every way out
    of the command; each call after the first does nothing."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
