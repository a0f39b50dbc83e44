"""The engine judge: Stockfish, over UCI with python-chess, says how good a move is.

This module owns the engine process and nothing else (the referee, `referee.py`, says whether
a move is legal; `evaluator.py` composes the two). One `EngineJudge` is one UCI process with
`Threads=1`, its hash cleared before every search (a new `game` object makes python-chess send
`ucinewgame`) and a fixed depth or node limit: under these conditions Stockfish gives the same
best move, score and node count in every run and every process, so the judge's records are
reproducible. A time limit, or a hash kept between positions, would not be.

A move is judged from its position's side to move (the mover):

- before: the engine's search of the position (its best move and score);
- after: the same search restricted to the played move (`root_moves=[move]`); for the engine's
  own best move, the search before is that move's score, so the best move loses nothing.
- centipawns: mates count as +-1000 and scores are ceiled to +-1000 (lila's `Cp.CEILING`,
  scalachess `core/src/main/scala/eval.scala`); cp_loss = before - after, at least 0 and at most
  1000 (lila's `AccuracyCP.diffsList` takes `atLeast(0)` of the ceiled difference; we also cap
  it at 1000 so one lost position weighs like one lost game, not two).
- win% = 50 + 50 * (2 / (1 + exp(-0.00368208 * cp)) - 1), cp ceiled (scalachess `eval.scala`
  `WinPercent.fromCentiPawns`/`winningChances`, the multiplier from lila PR #11148).
- accuracy = 100 when the win% does not fall, else
  103.1668100711649 * exp(-0.04354415386753951 * (win_before - win_after)) - 3.166924740191411
  + 1 (lila's "uncertainty bonus"), clipped to [0, 100] (lila
  `modules/analyse/src/main/AccuracyPercent.scala`, `fromWinPercents`).
- judgement (inaccuracy, mistake, blunder): lila `modules/tree/src/main/Advice.scala`. Between
  two centipawn scores, the mover's drop in winning chances (`winningChances` above, on the raw
  centipawns, in [-1, 1]) of at least 0.3 is a blunder, 0.2 a mistake, 0.1 an inaccuracy. With a
  mate score on either side (`MateAdvice`): walking into a forced mate is an inaccuracy if the
  position was already below -999 cp, a mistake below -700 cp, else a blunder; losing one's own
  forced mate is an inaccuracy if the score after stays above 999 cp, a mistake above 700 cp,
  else (or if the mate turns into being mated) a blunder.

The engine is found by `find_engine` (a path given > $FSDP_UTILS_STOCKFISH > `stockfish` on
PATH > Debian's /usr/games/stockfish); `choose_engine` reads `--chess_engine auto|on|off|PATH`
(a path given must be a working UCI engine). An engine that dies or hangs is restarted and the
search run again (`EngineProcess`: at most `RETRIES` restarts in a row, each counted and
logged); one that keeps failing raises `EngineGaveUp` (an `EngineFailed`). Every exit path ends
the process (`close()`, the context manager, and a finalizer at exit; an engine whose parent was
killed sees its stdin close and exits by itself).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import math
import os
import shutil
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import chess
import chess.engine

ENGINE_ENV = "FSDP_UTILS_STOCKFISH"
DEBIAN_ENGINE = "/usr/games/stockfish"
ENGINE_FLAG = "--chess_engine"

CP_CEILING = 1000  # lila/scalachess Eval.Cp.CEILING
MATE_SCORE = 100_000  # a mate's centipawns before the ceiling (any value above it works)
WIN_MULTIPLIER = -0.00368208  # scalachess WinPercent.winningChances (lila PR #11148)
ACCURACY_A = 103.1668100711649  # lila AccuracyPercent.fromWinPercents
ACCURACY_K = 0.04354415386753951
ACCURACY_B = -3.166924740191411
ACCURACY_BONUS = 1.0  # "uncertainty bonus (due to imperfect analysis)"
Judgement = Literal["inaccuracy", "mistake", "blunder"]
# lila Advice.scala, CpAdvice.winningChanceJudgements: drops in winning chances ([-1, 1]).
JUDGEMENTS: tuple[tuple[float, Judgement], ...] = (
    (0.3, "blunder"),
    (0.2, "mistake"),
    (0.1, "inaccuracy"),
)
DEFAULT_TIMEOUT_S = 60.0  # one search of a judged position; depth 10 takes ~0.1 s
# Starting (loading the network, the UCI handshake) and configuring: slow on a busy node or a
# shared file system, and not what `timeout_s` bounds.
START_TIMEOUT_S = 120.0
QUIT_TIMEOUT_S = 5.0
# Restarts of a crashed or hung engine before the same call gives up (EngineProcess).
RETRIES = 2
LOG = logging.getLogger("fsdp_utils.chess_eval")
T = TypeVar("T")


class EngineNotFound(ValueError):
    """No engine binary: a user mistake (exit 2 with how to install one)."""


class EngineFailed(RuntimeError):
    """The engine died, hung past its timeout, or would not start."""


class EngineGaveUp(EngineFailed):
    """The engine failed on the same call `RETRIES + 1` times in a row, restarted after each
    failure but the last (`EngineProcess`): not a fault of the caller's code or data."""


def install_hint() -> str:
    return (
        "Install Stockfish: `conda install -c conda-forge stockfish` (no root needed), "
        "`apt-get install stockfish` (Debian/Ubuntu, /usr/games/stockfish), or `module load "
        "stockfish` where your centre provides a module; or point "
        f"{ENGINE_FLAG} PATH or the environment variable {ENGINE_ENV} at a Stockfish binary."
    )


def find_engine(path: str | None = None) -> str:
    """The Stockfish binary: `path` (a flag) > $FSDP_UTILS_STOCKFISH > `stockfish` on PATH >
    /usr/games/stockfish. Raises EngineNotFound naming how to install one."""
    for given, where in ((path, ENGINE_FLAG), (os.environ.get(ENGINE_ENV) or None, ENGINE_ENV)):
        if given is None:
            continue
        found = shutil.which(os.path.expanduser(given))
        if found is None:
            raise EngineNotFound(
                f"The chess engine {given!r} (from {where}) is not an executable file. "
                + install_hint()
            )
        return found
    for candidate in ("stockfish", DEBIAN_ENGINE):
        found = shutil.which(candidate)
        if found is not None:
            return found
    raise EngineNotFound(
        "No chess engine found: the engine judge needs Stockfish (looked at "
        f"{ENGINE_FLAG}, ${ENGINE_ENV}, `stockfish` on PATH and {DEBIAN_ENGINE}). " + install_hint()
    )


def engines_on_this_machine() -> list[str]:
    """The executables `auto` would look at without a path given: `stockfish` on PATH and
    /usr/games/stockfish (each once)."""
    found = [shutil.which(candidate) for candidate in ("stockfish", DEBIAN_ENGINE)]
    return list(dict.fromkeys(os.path.realpath(f) for f in found if f is not None))


def choose_engine(choice: str) -> str | None:
    """The engine `--chess_engine auto|on|off|PATH` asks for: its path, or None for no engine.

    auto and on look where `find_engine` does; none found is None for auto and EngineNotFound
    for on. A path the user gave (PATH, or $FSDP_UTILS_STOCKFISH) is required: one that is
    not there, not executable or not a UCI engine raises EngineNotFound (a ValueError: exit
    2) naming it and the engines that are on this machine; it is started once to know."""
    if choice == "off":
        return None
    given = None if choice in ("auto", "on") else choice
    where = ENGINE_FLAG
    if given is None and os.environ.get(ENGINE_ENV):
        given, where = os.environ[ENGINE_ENV], f"${ENGINE_ENV}"
    if given is None:
        try:
            return find_engine()
        except EngineNotFound:
            if choice == "on":
                raise
            return None
    found = shutil.which(os.path.expanduser(given))
    if found is None:
        exists = os.path.exists(os.path.expanduser(given))
        problem = "is not executable" if exists else "does not exist"
        raise EngineNotFound(_given_engine_fails(given, where, problem))
    try:
        uci_engine_name(found)
    except EngineFailed as err:
        raise EngineNotFound(
            _given_engine_fails(given, where, f"does not run as a UCI engine ({err})")
        ) from err
    return found


def _given_engine_fails(given: str, where: str, problem: str) -> str:
    others = [p for p in engines_on_this_machine() if p != os.path.realpath(given)]
    if others:
        found = (
            f"Found on this machine: {', '.join(others)}: give it ({ENGINE_FLAG} {others[0]}), "
            f"or {ENGINE_FLAG} auto to take the first found, or off for no engine judge."
        )
    else:
        found = (
            f"No other engine is on this machine ({ENGINE_FLAG} off: no engine judge). "
            + install_hint()
        )
    return (
        f"The chess engine {given} given by {where} {problem}: an engine given must be a "
        f"working UCI engine (Stockfish). {found}"
    )


@functools.lru_cache(maxsize=8)
def uci_engine_name(path: str) -> str:
    """The engine's `id name` (e.g. "Stockfish 15.1"), starting it once per process: a path
    every rank checks costs one start each. EngineFailed when it does not speak UCI."""
    engine = open_engine(path, {})
    try:
        return str(engine.id.get("name", "unknown engine"))
    finally:
        close_engine(engine)


# --- Lichess's formulas ------------------------------------------------------------------


def ceiled_cp(score: chess.engine.Score) -> int:
    """Centipawns with mates as +-1000 and every score ceiled to +-1000 (lila's forceAsCp then
    ceiled; WinPercent.fromMate)."""
    cp = score.score(mate_score=MATE_SCORE)
    assert cp is not None
    return max(-CP_CEILING, min(CP_CEILING, cp))


def winning_chances(cp: float) -> float:
    """In [-1, 1]; scalachess WinPercent.winningChances."""
    return max(-1.0, min(1.0, 2 / (1 + math.exp(WIN_MULTIPLIER * cp)) - 1))


def win_percent(cp: int) -> float:
    """In [0, 100], cp ceiled to +-1000; scalachess WinPercent.fromCentiPawns."""
    return 50 + 50 * winning_chances(max(-CP_CEILING, min(CP_CEILING, cp)))


def move_accuracy(win_before: float, win_after: float) -> float:
    """lila AccuracyPercent.fromWinPercents."""
    if win_after >= win_before:
        return 100.0
    raw = ACCURACY_A * math.exp(-ACCURACY_K * (win_before - win_after)) + ACCURACY_B
    return max(0.0, min(100.0, raw + ACCURACY_BONUS))


def judgement(before: chess.engine.Score, after: chess.engine.Score) -> Judgement | None:
    """lila Advice (CpAdvice, then MateAdvice); both scores from the mover's view."""
    cp_before, cp_after = before.score(), after.score()
    if cp_before is not None and cp_after is not None:
        delta = winning_chances(cp_before) - winning_chances(cp_after)
        return next((name for drop, name in JUDGEMENTS if drop <= delta), None)
    mate_before, mate_after = before.mate(), after.mate()
    if mate_before is None and mate_after is not None and mate_after < 0:  # MateCreated
        prev = cp_before or 0
        return "inaccuracy" if prev < -999 else "mistake" if prev < -700 else "blunder"
    if mate_before is not None and mate_before > 0:
        if mate_after is None:  # MateLost
            now = cp_after or 0
            return "inaccuracy" if now > 999 else "mistake" if now > 700 else "blunder"
        if mate_after < 0:  # MateLost into being mated: the cp "or zero" is 0
            return "blunder"
    return None


# --- one judged move ---------------------------------------------------------------------


@dataclass(frozen=True)
class MoveVerdict:
    """The engine's verdict on one move, every number from the mover's view."""

    fen: str  # the position before the move
    move: str  # UCI
    best_move: str  # UCI, the engine's choice
    cp_before: int  # the position's score (mates +-1000, ceiled to +-1000)
    cp_after: int  # the score after the move, same scale
    cp_loss: int  # max(0, before - after), at most 1000
    win_before: float  # Lichess win%, 0..100
    win_after: float
    accuracy: float  # Lichess move accuracy, 0..100
    is_best: bool
    depth: int | None  # the search limit used
    nodes: int | None
    score_before: str  # the engine's own score, e.g. "cp 34", "mate 3", "mate -2"
    score_after: str
    judgement: Judgement | None  # lila's inaccuracy / mistake / blunder, None otherwise
    nodes_searched: int  # what the engine reported (the same in every run: it is deterministic)

    def to_record(self) -> dict[str, Any]:
        return asdict(self)


def score_text(score: chess.engine.Score) -> str:
    mate = score.mate()
    return f"mate {mate}" if mate is not None else f"cp {score.score()}"


@dataclass(frozen=True)
class Search:
    """One search of a position: the engine's best move, its score and its node count."""

    best_move: str
    score: chess.engine.Score  # from the side to move at the root
    nodes: int


class EngineJudge:
    """A context manager owning one UCI engine process; judges moves deterministically."""

    def __init__(
        self,
        *,
        path: str | None = None,
        depth: int | None = 10,
        nodes: int | None = None,
        threads: int = 1,
        hash_mb: int = 16,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        cache_size: int = 4096,
        retries: int = RETRIES,
    ) -> None:
        if (depth is None) == (nodes is None):
            raise ValueError("The engine judge needs exactly one of a depth or a node limit.")
        if (depth is not None and depth < 1) or (nodes is not None and nodes < 1):
            raise ValueError(
                f"The engine judge's limit must be at least 1 (depth {depth}, nodes {nodes})."
            )
        self.path = find_engine(path)
        self.depth, self.nodes = depth, nodes
        self.limit = chess.engine.Limit(depth=depth, nodes=nodes)
        self.timeout_s = timeout_s
        self.options = {"Threads": threads, "Hash": hash_mb}
        # Searches of positions before the move, by position and history: GRPO judges a
        # group of moves from one position, and a search depends on nothing else.
        self._cache: OrderedDict[tuple[str, tuple[str, ...]], Search] = OrderedDict()
        self._cache_size = cache_size
        self.process = EngineProcess(self.path, self.options, timeout_s=timeout_s, retries=retries)
        self.name = self.process.name

    @property
    def engine(self) -> chess.engine.SimpleEngine:
        """The engine process now (another one after a restart)."""
        return self.process.engine

    @property
    def restarts(self) -> int:
        return self.process.restarts

    def __enter__(self) -> EngineJudge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Ends the engine process (idempotent)."""
        self.process.close()

    @property
    def limit_text(self) -> str:
        return f"depth {self.depth}" if self.depth is not None else f"{self.nodes} nodes"

    def _search(self, board: chess.Board, move: chess.Move | None = None) -> Search:
        # A new game each search: python-chess sends ucinewgame and the hash is cleared, so a
        # search retried on a restarted engine gives what the first would have.
        info = self.process.call(
            lambda engine: engine.analyse(
                board, self.limit, root_moves=[move] if move is not None else None,
                game=object(),
            ),
            f"the position {board.fen()}" + (f" (the move {move.uci()})" if move else ""),
        )  # fmt: skip
        pv = info.get("pv") or []
        score = info.get("score")
        if not pv or score is None:
            raise EngineFailed(f"{self.name} returned no move or score for {board.fen()}.")
        return Search(pv[0].uci(), score.pov(board.turn), int(info.get("nodes", 0)))

    def search_before(self, board: chess.Board) -> Search:
        key = (board.root().fen(), tuple(m.uci() for m in board.move_stack))
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        found = self._search(board)
        self._cache[key] = found
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return found

    def judge_move(self, board: chess.Board, move: chess.Move) -> MoveVerdict:
        """Judge a legal `move` in `board` (not modified)."""
        if move not in board.legal_moves:
            raise ValueError(
                f"{move.uci()} is not a legal move in {board.fen()}: the referee judges those."
            )
        before = self.search_before(board)
        is_best = move.uci() == before.best_move
        after = before if is_best else self._search(board, move)
        cp_before, cp_after = ceiled_cp(before.score), ceiled_cp(after.score)
        win_before, win_after = win_percent(cp_before), win_percent(cp_after)
        return MoveVerdict(
            fen=board.fen(),
            move=move.uci(),
            best_move=before.best_move,
            cp_before=cp_before,
            cp_after=cp_after,
            cp_loss=min(CP_CEILING, max(0, cp_before - cp_after)),
            win_before=win_before,
            win_after=win_after,
            accuracy=move_accuracy(win_before, win_after),
            is_best=is_best,
            depth=self.depth,
            nodes=self.nodes,
            score_before=score_text(before.score),
            score_after=score_text(after.score),
            judgement=None if is_best else judgement(before.score, after.score),
            nodes_searched=before.nodes + (0 if is_best else after.nodes),
        )


# --- the engine process ------------------------------------------------------------------


class EngineProcess:
    """One UCI engine process that is restarted when it dies or hangs.

    An engine is an external program: a crash (the process exited) or a hang (no answer
    within `timeout_s`: killed) of one search is not the caller's mistake. `call` restarts the
    engine and runs the same call again, at most `retries` times in a row; each restart is
    counted (`restarts`), kept as a line for the caller's log (`take_notes`) and logged to the
    `fsdp_utils.chess_eval` logger. Only when the call fails `retries + 1` times in a row does
    it raise `EngineGaveUp`, naming the engine, what it was asked and what it did. A call must
    not depend on the engine's earlier state (the judge clears the hash for every search), so
    that a retried call gives what the first would have."""

    def __init__(
        self,
        path: str,
        options: dict[str, Any],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retries: int = RETRIES,
    ) -> None:
        self.path, self.options = path, dict(options)
        self.timeout_s, self.retries = timeout_s, retries
        self.restarts = 0
        self._notes: list[str] = []
        # The process now, in a box: the finalizer ends whichever process is current.
        self._box = [open_engine(path, self.options)]
        self.name = str(self.engine.id.get("name", "engine"))
        self._finalizer = weakref.finalize(self, _close_boxed, self._box)

    @property
    def engine(self) -> chess.engine.SimpleEngine:
        return self._box[0]

    def close(self) -> None:
        """Ends the engine process (idempotent)."""
        self._finalizer()

    def cpu_seconds(self) -> float:
        """The engine process's CPU time so far (Linux's /proc; 0 where it cannot be read)."""
        try:
            pid = self.engine.transport.get_pid()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError, AttributeError):
            return 0.0

    def take_notes(self) -> list[str]:
        """The restarts' log lines since the last call."""
        notes, self._notes = self._notes, []
        return notes

    def call(
        self, fn: Callable[[chess.engine.SimpleEngine], T], what: str, *, guard: bool = True
    ) -> T:
        """`fn(engine)` under the hang guard (`guard` False: `fn` guards its own calls, as a
        whole game's moves do); restarted and retried as the class says."""
        failures: list[str] = []
        while True:
            try:
                return self._call_once(fn, guard=guard)
            except EngineFailed as err:
                failures.append(str(err))
                if len(failures) > self.retries:
                    n = len(failures)
                    times = "once" if n == 1 else f"{n} times in a row"
                    restarted = ", restarted after each failure but the last" if n > 1 else ""
                    raise EngineGaveUp(
                        f"The chess engine {self.path} ({self.name}) failed {times} on {what}"
                        f"{restarted}: {failures[-1]}"
                    ) from err
            self._restart(what, failures[-1])

    def _call_once(self, fn: Callable[[chess.engine.SimpleEngine], T], *, guard: bool) -> T:
        engine = self.engine
        if not guard:
            return fn(engine)
        return cast(T, guarded(engine, self.timeout_s, lambda: fn(engine)))

    def _restart(self, what: str, why: str) -> None:
        close_engine(self.engine, polite=False)
        self.restarts += 1
        note = (
            f"chess engine {self.path} ({self.name}) restarted (its restart {self.restarts}) on "
            f"{what}: {why}"
        )
        self._notes.append(note)
        LOG.warning(note)
        # Not started: the next try of the call fails on the dead engine, and counts.
        with contextlib.suppress(EngineFailed):
            self._box[0] = open_engine(self.path, self.options)


def _close_boxed(box: list[chess.engine.SimpleEngine]) -> None:
    close_engine(box[0])


def open_engine(path: str, options: dict[str, Any]) -> chess.engine.SimpleEngine:
    """Start a UCI engine and configure it; EngineFailed if it will not start within
    START_TIMEOUT_S. (Searches are bounded by `guarded`, not by python-chess's timeout.)"""
    try:
        # A process group of its own: a Ctrl-C at the terminal (SIGINT to the foreground group)
        # asks the run to stop and save, and must not kill the engine the run still needs.
        engine = chess.engine.SimpleEngine.popen_uci(path, timeout=START_TIMEOUT_S, setpgrp=True)
    except (OSError, chess.engine.EngineError, TimeoutError) as err:
        raise EngineFailed(f"The chess engine {path} did not start: {err}") from err
    try:
        engine.configure(options)
    except (chess.engine.EngineError, TimeoutError) as err:
        close_engine(engine)
        raise EngineFailed(f"The chess engine {path} refused options {options}: {err}") from err
    return engine


def guarded(engine: chess.engine.SimpleEngine, timeout_s: float, call: Any) -> Any:
    """Run `call()` on the engine; a hang past `timeout_s` kills the engine (python-chess sets
    no timeout for depth or node limits) and, like a crash, raises EngineFailed."""
    fired = threading.Event()

    def expire() -> None:
        fired.set()  # before the kill: the caller may see the dead engine before this returns
        close_engine(engine, polite=False)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    try:
        return call()
    except (chess.engine.EngineTerminatedError, concurrent.futures.CancelledError) as err:
        # A dead process cancels the pending call (CancelledError) or refuses new ones.
        hung = fired.is_set()
        close_engine(engine, polite=False)
        why = f"no answer within {timeout_s:g} s: ended it" if hung else "the process exited"
        raise EngineFailed(f"The chess engine stopped answering ({why}): {err!r}") from err
    except (chess.engine.EngineError, TimeoutError) as err:
        close_engine(engine, polite=False)
        raise EngineFailed(f"The chess engine failed: {err}") from err
    finally:
        timer.cancel()


def close_engine(engine: chess.engine.SimpleEngine, *, polite: bool = True) -> None:
    """End the engine process and wait for it: `quit` if `polite` (a hung engine gets
    QUIT_TIMEOUT_S), then kill what is left (python-chess's close() kills the process)."""
    if polite:
        engine.timeout = QUIT_TIMEOUT_S
        # Already dead, hung, or its event loop gone: close() below ends what is left.
        with contextlib.suppress(Exception):
            engine.quit()
    # The process is killed or gone: nothing left to wait for if this fails.
    with contextlib.suppress(Exception):
        engine.close()
        engine.returncode.result(timeout=QUIT_TIMEOUT_S)


def engine_version(path: str | None = None) -> str:
    """The engine's `id name` (e.g. "Stockfish 15.1"), starting it once."""
    return uci_engine_name(find_engine(path))
