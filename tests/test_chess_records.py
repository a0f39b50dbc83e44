"""The chess evaluation's records (`write_records`) are written whole or not at all: an
evaluation whose engine failed writes none and leaves the earlier ones as they were, and a
write that fails half-way (`fsdp_utils.atomic.folder_written_atomically`) leaves the earlier
folder whole, with nothing of the new one beside it."""

from __future__ import annotations

import pytest

from fsdp_utils.atomic import folder_written_atomically
from fsdp_utils.chess_eval.evaluator import write_records

GOOD = {
    "engine": "Stockfish 15.1", "engine_depth": 6, "engine_error": None,
    "move_records": [{"position": 0, "ply": 0, "move": "e2e4"}],
    "game_records": [{"rung": "random", "game": 0, "result": "1-0"}],
    "pgns": ['[Event "ladder"]\n\n1. e4 1-0'],
}  # fmt: skip


def _contents(folder):
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def test_a_failed_evaluation_keeps_the_earlier_records(tmp_path):
    folder = tmp_path / "chess_eval" / "final"
    written = write_records(folder, GOOD, step=None)
    assert [p.name for p in written] == ["moves.jsonl", "games.jsonl", "games.pgn", "summary.json"]
    earlier = _contents(folder)
    assert "e2e4" in earlier["moves.jsonl"] and "1. e4" in earlier["games.pgn"]
    failed = {**GOOD, "engine_error": "The chess engine stopped answering (the process exited)",
              "move_records": [], "game_records": [], "pgns": []}  # fmt: skip
    assert write_records(folder, failed, step=None) == []
    assert _contents(folder) == earlier
    assert write_records(folder, {"legal_move_rate": 0.5}, step=None) == []  # no engine part


def test_a_folder_write_that_fails_half_way_leaves_the_earlier_folder(tmp_path):
    folder = tmp_path / "records"
    write_records(folder, GOOD, step=3)
    earlier = _contents(folder)
    with pytest.raises(OSError), folder_written_atomically(folder) as tmp:
        (tmp / "moves.jsonl").write_text("half of it")
        raise OSError("No space left on device")
    assert _contents(folder) == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["records"]  # no .tmp, no .old
    newer = {**GOOD, "move_records": [{"position": 1, "ply": 0, "move": "d2d4"}]}
    write_records(folder, newer, step=4)
    assert "d2d4" in _contents(folder)["moves.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["records"]
