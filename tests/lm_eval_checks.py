"""Equality with lm-eval's own HFLM, request by request and metric by metric, and the command
run in the test's process: what the lm-eval tests share (tests/test_lm_harness.py,
tests/test_lm_eval_chat.py)."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest

RTOL = 1e-4  # every per-request log-likelihood within this, relative


class Compared(NamedTuple):
    requests: int  # answers compared
    max_relative: float  # the largest relative difference of a log-likelihood seen


def responses(samples: list[dict[str, Any]]) -> list[tuple[int, list[Any]]]:
    """A task's logged samples as (document, its requests' answers), in document order."""
    return sorted((s["doc_id"], [r[0] for r in s["resps"]]) for s in samples)


def assert_same_answers(ours: dict[str, Any], theirs: dict[str, Any], tasks: list[str]) -> Compared:
    """Every request's answer the same: generated texts equal, log-likelihoods within RTOL,
    the same is-greedy verdicts. `ours`, `theirs`: lm-eval's samples per task."""
    compared, worst = 0, 0.0
    for task in tasks:
        for (doc, mine), (doc_ref, ref) in zip(
            responses(ours[task]), responses(theirs[task]), strict=True
        ):
            assert doc == doc_ref
            for a, b in zip(mine, ref, strict=True):
                compared += 1
                if isinstance(b, str):
                    assert a == b, (task, doc)
                    continue
                value, greedy = (a, None) if isinstance(b, float) else a
                value_ref, greedy_ref = (b, None) if isinstance(b, float) else b
                assert greedy == greedy_ref, (task, doc)
                assert value == pytest.approx(value_ref, rel=RTOL), (task, doc)
                if value_ref:
                    worst = max(worst, abs(value - value_ref) / abs(value_ref))
    return Compared(compared, worst)


def assert_same_metrics(
    ours: dict[str, Any], theirs: dict[str, Any], tasks: list[str], *, rel: float = RTOL
) -> None:
    """Every metric of every task the same (floats within `rel`; 0: identical)."""
    for task in tasks:
        mine, ref = ours[task], theirs[task]
        assert mine.keys() == ref.keys()
        for key, value in ref.items():
            if isinstance(value, float) and rel:
                assert mine[key] == pytest.approx(value, rel=rel), (task, key)
            else:
                assert mine[key] == value, (task, key)


def evaluate_in_process(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    """`python -m fsdp_utils.evaluate ARGV` in this process (one rank: the interpreter, torch
    and lm-eval are already loaded), its exit code; the address it sets for its process group
    is undone."""
    import socket

    from fsdp_utils.lm_harness.cli import main

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    return main(list(argv))
