"""The engine judge (fsdp_utils/chess_eval/judge.py) against Stockfish itself.

Stockfish is a real dependency here (Debian's `stockfish`, installed by `make setup-system`):
the judge's figures are compared with a direct python-chess computation, byte for byte, and
its failures are real ones (a killed engine, a stopped one, a missing binary).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time

import chess
import chess.engine
import pytest

from fsdp_utils.chess_eval import judge as J

DEPTH = 8
# Fixed positions and moves: the start, a quiet middlegame, a mate in one (found and missed),
# a move into a forced mate, an ending.
CASES = [
    (chess.STARTING_FEN, "e2e4"),
    (chess.STARTING_FEN, "g1h3"),
    ("r1bqkb1r/pppp1ppp/2n2n2/4p2Q/2B1P3/8/PPPP1PPP/RNB1K1NR w KQkq - 4 4", "h5f7"),
    ("r1bqkb1r/pppp1ppp/2n2n2/4p2Q/2B1P3/8/PPPP1PPP/RNB1K1NR w KQkq - 4 4", "h5h4"),
    ("rnbqkbnr/pppp1ppp/8/4p3/6P1/8/PPPPPP1P/RNBQKBNR w KQkq - 0 2", "f2f3"),
    ("r2q1rk1/pp2bppp/2n1pn2/3p4/3P4/2NBPN2/PP3PPP/R2QK2R w KQ - 0 10", "e1g1"),
    ("8/5k2/8/3K4/8/8/4P3/8 w - - 0 1", "e2e4"),
]


@pytest.fixture(scope="module")
def engine_path() -> str:
    return J.find_engine()


@pytest.fixture(scope="module")
def judge(engine_path: str):
    with J.EngineJudge(path=engine_path, depth=DEPTH) as j:
        yield j


def direct_verdict(engine: chess.engine.SimpleEngine, fen: str, uci: str) -> J.MoveVerdict:
    """The judge's procedure written out with python-chess alone."""
    board, move = chess.Board(fen), chess.Move.from_uci(uci)
    limit = chess.engine.Limit(depth=DEPTH)
    root = engine.analyse(board, limit, game=object())
    best = root["pv"][0]
    after = root if best == move else engine.analyse(board, limit, root_moves=[move], game=object())
    s0, s1 = root["score"].pov(board.turn), after["score"].pov(board.turn)
    c0 = max(-1000, min(1000, s0.score(mate_score=100_000)))
    c1 = max(-1000, min(1000, s1.score(mate_score=100_000)))
    w0, w1 = J.win_percent(c0), J.win_percent(c1)
    return J.MoveVerdict(
        fen=board.fen(), move=uci, best_move=best.uci(), cp_before=c0, cp_after=c1,
        cp_loss=min(1000, max(0, c0 - c1)), win_before=w0, win_after=w1,
        accuracy=J.move_accuracy(w0, w1), is_best=best == move, depth=DEPTH, nodes=None,
        score_before=J.score_text(s0), score_after=J.score_text(s1),
        judgement=None if best == move else J.judgement(s0, s1),
        nodes_searched=root["nodes"] + (0 if best == move else after["nodes"]),
    )  # fmt: skip


def test_verdicts_equal_a_direct_python_chess_computation_byte_for_byte(judge, engine_path):
    got = [judge.judge_move(chess.Board(f), chess.Move.from_uci(m)) for f, m in CASES]
    with chess.engine.SimpleEngine.popen_uci(engine_path) as engine:
        engine.configure({"Threads": 1, "Hash": 16})
        # The opposite order: a cleared hash makes each search independent of the ones before.
        want = [direct_verdict(engine, f, m) for f, m in reversed(CASES)][::-1]
    assert [json.dumps(v.to_record()) for v in got] == [json.dumps(v.to_record()) for v in want]
    by_move = {(v.fen, v.move): v for v in got}
    mate_found = by_move[(CASES[2][0], "h5f7")]
    assert mate_found.is_best and mate_found.score_before == "mate 1" and mate_found.cp_loss == 0
    missed = by_move[(CASES[3][0], "h5h4")]
    assert not missed.is_best and missed.cp_loss == 1000 and missed.judgement == "blunder"
    assert all(0 <= v.cp_loss <= 1000 and 0 <= v.accuracy <= 100 for v in got)


def test_a_cached_search_gives_the_same_verdict_as_a_fresh_judge(judge, engine_path):
    board = chess.Board(CASES[5][0])
    moves = [m for m in board.legal_moves][:3]
    first = [judge.judge_move(board, m) for m in moves]
    with J.EngineJudge(path=engine_path, depth=DEPTH, cache_size=0) as fresh:
        assert [fresh.judge_move(board, m) for m in reversed(moves)][::-1] == first


def test_the_judge_refuses_illegal_moves_and_double_limits(judge):
    with pytest.raises(ValueError, match="not a legal move"):
        judge.judge_move(chess.Board(), chess.Move.from_uci("e2e5"))
    with pytest.raises(ValueError, match="exactly one"):
        J.EngineJudge(depth=4, nodes=100)


def test_lichess_formulas():
    # scalachess WinPercent: 50 at 0 cp, mates and anything past the ceiling as +-1000.
    assert J.win_percent(0) == 50
    assert (
        J.win_percent(5000) == J.win_percent(1000) == 50 + 50 * (2 / (1 + math.exp(-3.68208)) - 1)
    )
    assert J.win_percent(-1000) == pytest.approx(100 - J.win_percent(1000))
    assert J.ceiled_cp(chess.engine.Mate(3)) == 1000 and J.ceiled_cp(chess.engine.Mate(-1)) == -1000
    assert J.ceiled_cp(chess.engine.Cp(-1234)) == -1000 and J.ceiled_cp(chess.engine.Cp(37)) == 37
    # lila AccuracyPercent: 100 when the win% does not fall; else the fitted curve + 1, clipped.
    assert J.move_accuracy(40.0, 40.0) == 100.0 and J.move_accuracy(40.0, 70.0) == 100.0
    assert (
        J.move_accuracy(60.0, 50.0)
        == 103.1668100711649 * math.exp(-0.4354415386753951) - 3.166924740191411 + 1
    )
    assert J.move_accuracy(100.0, 0.0) == 0.0
    # The curve lila fitted (its comment's sample data): within 6 points of each sample (the fit weights 0 and 80 most).
    for drop, target in [(5, 75), (10, 60), (20, 42), (40, 20), (60, 5), (80, 0)]:
        assert abs(J.move_accuracy(50.0 + drop / 2, 50.0 - drop / 2) - 1 - target) < 6


def test_lila_judgements():
    Cp, Mate = chess.engine.Cp, chess.engine.Mate

    def cp_for(chances: float) -> float:  # the inverse of winning_chances
        return math.log((1 + chances) / (1 - chances)) / 0.00368208

    # Drops in winning chances of 0.3 / 0.2 / 0.1 ([-1, 1] scale), just above and below.
    for drop, name in [(0.3, "blunder"), (0.2, "mistake"), (0.1, "inaccuracy")]:
        assert J.judgement(Cp(0), Cp(-math.ceil(cp_for(drop + 0.002)))) == name
    assert J.judgement(Cp(0), Cp(-math.floor(cp_for(0.098)))) is None
    assert J.judgement(Cp(50), Cp(80)) is None
    # MateAdvice: walking into a forced mate, and losing one's own.
    assert J.judgement(Cp(-1200), Mate(-3)) == "inaccuracy"
    assert J.judgement(Cp(-800), Mate(-3)) == "mistake"
    assert J.judgement(Cp(100), Mate(-3)) == "blunder"
    assert J.judgement(Mate(2), Cp(1200)) == "inaccuracy"
    assert J.judgement(Mate(2), Cp(800)) == "mistake"
    assert J.judgement(Mate(2), Cp(300)) == "blunder"
    assert J.judgement(Mate(2), Mate(-4)) == "blunder"
    assert J.judgement(Mate(2), Mate(5)) is None  # a slower mate: lila says nothing


def test_find_engine_order_and_missing_engine(tmp_path, monkeypatch, engine_path):
    monkeypatch.delenv(J.ENGINE_ENV, raising=False)
    assert J.find_engine() == engine_path
    monkeypatch.setenv(J.ENGINE_ENV, str(tmp_path / "nothing"))
    with pytest.raises(J.EngineNotFound, match=J.ENGINE_ENV) as err:
        J.find_engine()
    assert "conda-forge" in str(err.value) and "apt-get install stockfish" in str(err.value)
    assert J.find_engine(engine_path) == engine_path  # the flag wins over the environment
    monkeypatch.delenv(J.ENGINE_ENV)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(J, "DEBIAN_ENGINE", str(tmp_path / "games" / "stockfish"))
    with pytest.raises(J.EngineNotFound, match="No chess engine found"):
        J.EngineJudge()
    with pytest.raises(J.EngineNotFound, match="--chess_engine"):
        J.find_engine(str(tmp_path / "sf"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: its parent (the event loop) has not reaped it yet.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def test_a_killed_or_hung_engine_raises_and_is_ended(engine_path):
    """Without restarts (retries=0; the restarts themselves: test_grpo_units.py and
    test_chess_engine_eval.py)."""
    board = chess.Board()
    with J.EngineJudge(path=engine_path, depth=DEPTH, retries=0) as j:
        pid = j.engine.transport.get_pid()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(J.EngineFailed, match="stopped answering"):
            j.judge_move(board, chess.Move.from_uci("d2d4"))
    assert not _alive(pid)

    j = J.EngineJudge(path=engine_path, depth=30, timeout_s=1.0, retries=0)
    pid = j.engine.transport.get_pid()
    os.kill(pid, signal.SIGSTOP)  # hangs mid-search: only the judge's timer can end it
    started = time.monotonic()
    with pytest.raises(J.EngineFailed, match="no answer within 1 s"):
        j.judge_move(board, chess.Move.from_uci("d2d4"))
    assert time.monotonic() - started < 10
    assert not _alive(pid)
    j.close()  # closing again is harmless


def test_close_ends_the_process(engine_path):
    j = J.EngineJudge(path=engine_path, depth=2)
    pid = j.engine.transport.get_pid()
    assert _alive(pid)
    j.close()
    assert not _alive(pid)
