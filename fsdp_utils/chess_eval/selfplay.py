"""Engine games as data, made by as many CPUs as you have: Stockfish playing itself (and, by
`--mix`, against a random mover, and random legal games), written in the schema of
laion/strategic_game_chess (`Moves`, `Termination`, `Result`; parquet shards), which is itself
Stockfish playing itself; and, by `--positions K`, positions of those games labelled by the
engine (every legal move's value in centipawns, the best move) beside them.

    python -m fsdp_utils.chess_eval.selfplay --games 20000 --output data/engine_games --processes 2
    sbatch --array=0-15 slurm/selfplay.sh --games 200000 --output data/engine_games
    sbatch --array=0-15 slurm/selfplay.sh --games 20000 --positions 10 --output data/labelled
    python -m fsdp_utils.chess_eval.selfplay --output data/engine_games --merge   # the manifest

Game i depends only on (seed, i, mix, limit) and the engine's version: its kind is drawn from
`--mix` with the seed `seed/i/kind`, its opening is 4 to 8 uniformly random legal plies drawn
from `seed/i`; then the engine plays at a fixed depth (or node limit) with Threads=1, its hash
cleared at the game's start (`ucinewgame`), so whichever process plays it, the game is the same.
`selfplay` games are the engine against itself; `vs_random` the engine (White in even games,
Black in odd ones) against a uniformly random legal mover (seeded per game); `random` games
random legal moves on both sides. A game ends where python-chess says it is over, claimable
draws (threefold repetition, 50 moves) claimed at once.

Shards: games [s * S, (s + 1) * S) are shard s (`chess_game_{s+1:04d}.parquet`, S =
`--shard_games`), written whole by the process that plays it (a temporary file renamed), with
the data set's settings and the engine's version in its metadata. Shard s belongs to task
s % tasks (`--task`/`--tasks`, or a Slurm array job's task: SLURM_ARRAY_TASK_ID), so one task
or sixteen write the same files. A task skips the shards that exist already (a requeued task
goes on where it stopped; a shard of other settings in the folder is refused), plays the rest
on `--processes` processes (one engine each), and, when every shard of the data set is there,
writes the manifest `selfplay.json` (how, which engine, which seeds, the games and plies by
kind, each shard's checksum and CPU seconds). `--merge` only checks the shards and writes it.
The folder is then the data set: `--dataset data/engine_games`.

Labelled positions (`--positions K`, default 0: games only): K distinct positions of game i,
after plies drawn from 1..plies-1 with the seed `seed/i/positions` (never the start, never the
finished last position), each searched by the engine at `--label_depth` (8) with MultiPV = its
legal moves, Threads=1, the hash cleared first (a depth, not a node limit: one node limit over
every move's search ends mid-iteration, and some moves would get no value): every legal move's
value in centipawns for the side to move (a mate in n: MATE_SCORE - n = 100000 - n, mated in
n: n - 100000; python-chess's `score(mate_score=100000)`), best first (ties in UCI order).
They lie beside the games as `chess_position_{s+1:04d}.parquet` (the games of shard s;
written whole, after the games, with the same metadata), columns `fen`, `moves` (UCI moves
from the start), `next_move` (the game's), `best_move`, `legal_moves` (best first),
`move_values` (centipawns, aligned with `legal_moves`), `game`, `ply`, `kind`. A requeued task
labels the games it wrote without playing them again; a data set with positions and one
without are two data sets. A folder read as a data set (`--dataset DIR`, `read_games`) is its
games; the positions by `--dataset_include 'chess_position_*.parquet'` or `read_positions`.

Speed, one process at depth 1: about 12 self-play games a second on a quiet core of this
machine (~90 plies a game), 2-4 on a busy one; a random game takes a few milliseconds.
Labelling at depth 8: ~0.11 CPU seconds a position (all its moves), ~9.7 positions a second on
one core (load average 0.4-0.9); at depth 4 ~110 a second, at 10 ~2.5.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import socket
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import chess
import chess.engine

from fsdp_utils.arguments import ArgumentParser
from fsdp_utils.atomic import file_written_atomically, write_text_atomic
from fsdp_utils.chess_eval.judge import (
    DEFAULT_TIMEOUT_S,
    MATE_SCORE,
    EngineFailed,
    EngineProcess,
    choose_engine,
    find_engine,
    guarded,
)
from fsdp_utils.chess_eval.referee import random_move
from fsdp_utils.data.chess_files import position_shard_name, shard_name
from fsdp_utils.hub.hashing import digest_file
from fsdp_utils.hub.selection import POSITION_SHARDS

OPENING_PLIES = (4, 8)
KINDS = ("selfplay", "vs_random", "random")
MANIFEST = "selfplay.json"
METADATA_KEY = b"fsdp_utils.selfplay"
DEFAULT_SHARD_GAMES = 500
STALE_TMP_S = 600.0  # a temporary shard file older than this is a killed task's
ENGINE_OPTIONS = {"Threads": 1, "Hash": 16}
DEFAULT_LABEL_DEPTH = 8
# One position's search over all its moves: ~0.1 s at depth 8, seconds at 14: what is past
# this is a hung engine (restarted), not a slow position.
LABEL_TIMEOUT_S = 600.0
GAME_SHARDS = "chess_game_*.parquet"


@dataclass(frozen=True)
class Plan:
    """What a data set is: every task of it must have the same (checked in each shard)."""

    games: int
    seed: int = 0
    depth: int | None = 1
    nodes: int | None = None
    mix: tuple[tuple[str, float], ...] = (("selfplay", 1.0),)
    shard_games: int = DEFAULT_SHARD_GAMES
    positions: int = 0  # labelled positions drawn from each game (0: games only)
    label_depth: int | None = None  # with positions; a depth only (label_position says why)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Plan:
        """The plan a shard's metadata records (`record()`'s inverse)."""
        return cls(
            games=record["games"], seed=record["seed"], depth=record["depth"],
            nodes=record["nodes"], mix=tuple(record["mix"].items()),
            shard_games=record["shard_games"], positions=record.get("positions", 0),
            label_depth=record.get("label_depth"),
        )  # fmt: skip

    @property
    def shards(self) -> int:
        return -(-self.games // self.shard_games)

    def shard_range(self, shard: int) -> range:
        return range(shard * self.shard_games, min((shard + 1) * self.shard_games, self.games))

    def kind(self, index: int) -> str:
        """Game `index`'s kind, drawn from the mix with its own seed."""
        if len(self.mix) == 1:
            return self.mix[0][0]
        kinds, weights = zip(*self.mix, strict=True)
        return random.Random(f"{self.seed}/{index}/kind").choices(kinds, weights)[0]

    @property
    def limit_text(self) -> str:
        return f"depth {self.depth}" if self.depth is not None else f"{self.nodes} nodes"

    def record(self) -> dict[str, Any]:
        out = asdict(self)
        out["mix"] = dict(self.mix)
        out["opening_plies"] = list(OPENING_PLIES)
        if not self.positions:  # games only: recorded as before positions existed
            for key in ("positions", "label_depth"):
                del out[key]
        return out

    def command(self, output: Path) -> str:
        limit = f"--depth {self.depth}" if self.depth is not None else f"--nodes {self.nodes}"
        mix = ",".join(f"{k}:{w:g}" for k, w in self.mix)
        labels = ""
        if self.positions:
            labels = f" --positions {self.positions} --label_depth {self.label_depth}"
        return (
            f"python -m fsdp_utils.chess_eval.selfplay --games {self.games} --seed {self.seed} "
            f"{limit} --mix {mix} --shard_games {self.shard_games}{labels} --output {output}"
        )


def parse_mix(text: str) -> tuple[tuple[str, float], ...]:
    """`selfplay:8,vs_random:1,random:1` -> ((kind, weight), ...); a ValueError naming the
    kinds otherwise."""
    mix: list[tuple[str, float]] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        kind, _, weight = part.partition(":")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            value = -1.0
        if kind not in KINDS or not value > 0 or kind in dict(mix):
            raise ValueError(
                f"--mix {text!r}: {part!r} is not KIND[:WEIGHT] with a positive weight and a kind "
                f"of {', '.join(KINDS)} (each once), e.g. selfplay:8,vs_random:1,random:1."
            )
        mix.append((kind, value))
    if not mix:
        raise ValueError("--mix needs at least one kind: selfplay, vs_random or random.")
    return tuple(mix)


# --- one game ----------------------------------------------------------------------------


def opening(rng: random.Random) -> chess.Board:
    """4-8 random legal plies (never a finished game: it is drawn again)."""
    while True:
        board = chess.Board()
        for _ in range(rng.randint(*OPENING_PLIES)):
            board.push(random_move(board, rng))
            if board.is_game_over():
                break
        if not board.is_game_over():
            return board


def play_game(
    engine: chess.engine.SimpleEngine | None,
    index: int,
    *,
    plan: Plan,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """Game `index` of the plan. The engine's hash is cleared once, at the game's start (one
    `game` object for the whole game): each move depends on the game so far only."""
    kind = plan.kind(index)
    rng = random.Random(f"{plan.seed}/{index}")
    board = opening(rng)
    limit = chess.engine.Limit(depth=plan.depth, nodes=plan.nodes)
    game = object()
    engine_side = chess.WHITE if index % 2 == 0 else chess.BLACK
    while (outcome := board.outcome(claim_draw=True)) is None:
        engine_moves = kind == "selfplay" or (kind == "vs_random" and board.turn == engine_side)
        if not engine_moves:
            board.push(random_move(board, rng))
            continue
        assert engine is not None
        result = guarded(engine, timeout_s, _play_call(engine, board, limit, game))
        assert result.move is not None
        board.push(result.move)
    return {
        "Moves": [m.uci() for m in board.move_stack],
        "Termination": outcome.termination.name,
        "Result": outcome.result(),
    }


def _play_call(
    engine: chess.engine.SimpleEngine, board: chess.Board, limit: chess.engine.Limit, game: object
) -> Any:
    return lambda: engine.play(board, limit, game=game)


# --- labelled positions ------------------------------------------------------------------


def position_plies(plan: Plan, index: int, moves: int) -> list[int]:
    """The plies (moves played before the position) of game `index`'s labelled positions:
    `plan.positions` distinct ones drawn with the seed `seed/index/positions` from 1 to
    moves - 1: never the start (every game's) nor the final position (the game is over)."""
    candidates = range(1, moves)
    rng = random.Random(f"{plan.seed}/{index}/positions")
    return sorted(rng.sample(candidates, min(plan.positions, len(candidates))))


def label_position(
    engine: chess.engine.SimpleEngine,
    board: chess.Board,
    limit: chess.engine.Limit,
    *,
    timeout_s: float = LABEL_TIMEOUT_S,
) -> list[tuple[str, int]]:
    """Every legal move of `board` and its value, best first (ties: UCI order): centipawns for
    the side to move, a mate in n MATE_SCORE - n (mated: n - MATE_SCORE), python-chess's
    `score(mate_score=MATE_SCORE)`. One search with MultiPV = the legal moves (each root move
    is searched and reported once; `limit` a depth: a node or time limit is shared by every
    move's search and ends mid-iteration, some moves then unvalued), the hash cleared first
    (`ucinewgame`: a new `game`), so the values depend on the position, its moves from the
    start (repetitions) and the limit only.
    EngineFailed if the engine's lines are not the legal moves, each once."""
    legal = {m.uci() for m in board.legal_moves}
    infos = guarded(
        engine,
        timeout_s,
        lambda: engine.analyse(board, limit, multipv=len(legal), game=object()),
    )
    values: dict[str, int] = {}
    for info in infos:
        pv, score = info.get("pv"), info.get("score")
        cp = score.relative.score(mate_score=MATE_SCORE) if score is not None else None
        if not pv or cp is None or pv[0].uci() in values:
            raise EngineFailed(f"a MultiPV line without a new move and a score: {info}")
        values[pv[0].uci()] = cp
    if set(values) != legal:
        raise EngineFailed(
            f"MultiPV {len(legal)} on {board.fen()} gave {sorted(values)}, not the legal moves "
            f"{sorted(legal)}"
        )
    return sorted(values.items(), key=lambda mv: (-mv[1], mv[0]))


def label_game(
    engine: chess.engine.SimpleEngine, *, game: dict[str, Any], index: int, plan: Plan
) -> list[dict[str, Any]]:
    """Game `index`'s labelled positions (one row each, in the order of its plies)."""
    limit = chess.engine.Limit(depth=plan.label_depth)
    moves = [str(m) for m in game["Moves"]]
    rows = []
    for ply in position_plies(plan, index, len(moves)):
        board = chess.Board()
        for uci in moves[:ply]:
            board.push_uci(uci)
        values = label_position(engine, board, limit)
        rows.append(
            {"fen": board.fen(), "moves": moves[:ply], "next_move": moves[ply],
             "best_move": values[0][0], "legal_moves": [m for m, _ in values],
             "move_values": [v for _, v in values], "game": index, "ply": ply,
             "kind": plan.kind(index)}
        )  # fmt: skip
    return rows


# --- shards ------------------------------------------------------------------------------


def shard_path(output: Path, shard: int) -> Path:
    return output / shard_name(shard + 1)


def stats_path(shard: Path) -> Path:
    """How a shard was made (task, host, seconds): beside it, not a data file."""
    return shard.with_suffix(".stats")


def shard_stats(shard: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(stats_path(shard).read_text()))
    except (OSError, ValueError):
        return {}


def position_path(output: Path, shard: int) -> Path:
    return output / position_shard_name(shard + 1)


def play_shard(
    path: str,
    version: str,
    plan: Plan,
    shard: int,
    output: str,
    task: int,
    have_games: bool = False,
    engine: EngineProcess | None = None,
) -> dict[str, Any]:
    """Make shard `shard`: play its games and write them whole (`have_games`: their file is
    there already, read), then, with `plan.positions`, label their positions and write those
    whole; returns what was made. On `engine`, or on an engine of its own (ended here). A game
    whose engine dies or hangs is played (or labelled) again from its start on a restarted
    engine (`EngineProcess`), so that it is what it would have been."""
    import pyarrow.parquet as pq

    out = Path(output)
    games = list(plan.shard_range(shard))
    needs_engine = plan.positions > 0 or (
        not have_games and any(plan.kind(i) != "random" for i in games)
    )
    own = engine is None and needs_engine
    process = EngineProcess(path, ENGINE_OPTIONS) if own else engine
    try:
        clock = _Clock(process)
        if have_games:
            rows = pq.read_table(shard_path(out, shard), columns=["Moves"]).to_pylist()
        else:
            rows = []
            for i in games:
                if process is None:
                    rows.append(play_game(None, i, plan=plan))
                else:
                    game = functools.partial(play_game, index=i, plan=plan)
                    rows.append(process.call(game, f"game {i}", guard=False))
            # In the shard: what it is (the same bytes whichever task or host plays it);
            # beside it: how it was made here (the task, the host, the seconds).
            meta = {
                "plan": plan.record(), "engine": version, "shard": shard, "first": games[0],
                "games": len(games), "plies": sum(len(r["Moves"]) for r in rows),
                "kinds": dict(Counter(plan.kind(i) for i in games)),
            }  # fmt: skip
            _write_shard(shard_path(out, shard), rows, GAME_SCHEMA, meta, clock.stats(task))
        labelled: list[dict[str, Any]] = []
        if plan.positions:
            assert process is not None
            clock = _Clock(process)
            for i, game in zip(games, rows, strict=True):
                label = functools.partial(label_game, game=game, index=i, plan=plan)
                labelled.extend(process.call(label, f"game {i}'s positions", guard=False))
            meta = {
                "plan": plan.record(), "engine": version, "shard": shard, "first": games[0],
                "games": len(games), "positions": len(labelled),
            }  # fmt: skip
            stats = clock.stats(task)
            _write_shard(position_path(out, shard), labelled, POSITION_SCHEMA, meta, stats)
    finally:
        if own and process is not None:
            process.close()
    return {
        "shard": shard, "first": games[0], "games": len(games), "played": not have_games,
        "plies": sum(len(r["Moves"]) for r in rows), "positions": len(labelled),
    }  # fmt: skip


class _Clock:
    """How a file was made here: wall and CPU seconds (this process's and its engine's) and
    the engine's restarts since the clock started."""

    def __init__(self, process: EngineProcess | None) -> None:
        self.process = process
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.engine_cpu = process.cpu_seconds() if process is not None else 0.0
        self.restarts = process.restarts if process is not None else 0

    def stats(self, task: int) -> dict[str, Any]:
        engine_cpu, restarts = 0.0, 0
        if self.process is not None:
            engine_cpu = self.process.cpu_seconds() - self.engine_cpu
            restarts = self.process.restarts - self.restarts
        return {
            "task": task, "host": socket.gethostname(),
            "wall_seconds": round(time.perf_counter() - self.wall, 3),
            "cpu_seconds": round(time.process_time() - self.cpu + engine_cpu, 3),
            "engine_restarts": restarts,
        }  # fmt: skip


# The columns of the two kinds of shard (pyarrow types by name: pyarrow is imported lazily).
GAME_SCHEMA = (("Moves", "list<string>"), ("Termination", "string"), ("Result", "string"))
POSITION_SCHEMA = (
    ("fen", "string"), ("moves", "list<string>"), ("next_move", "string"),
    ("best_move", "string"), ("legal_moves", "list<string>"), ("move_values", "list<int32>"),
    ("game", "int64"), ("ply", "int32"), ("kind", "string"),
)  # fmt: skip


def _write_shard(
    final: Path,
    rows: list[dict[str, Any]],
    columns: tuple[tuple[str, str], ...],
    meta: dict[str, Any],
    stats: dict[str, Any],
) -> None:
    """`rows` as the parquet file `final`, `meta` in its metadata, whole or not at all (a
    killed task leaves only its temporary file); `stats` beside it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = {
        "string": pa.string(), "int32": pa.int32(), "int64": pa.int64(),
        "list<string>": pa.list_(pa.string()), "list<int32>": pa.list_(pa.int32()),
    }  # fmt: skip
    schema = pa.schema([(name, types[kind]) for name, kind in columns])
    table = pa.Table.from_pylist(rows, schema=schema)
    table = table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()})
    write_text_atomic(stats_path(final), json.dumps(stats) + "\n")
    with file_written_atomically(final) as tmp:
        pq.write_table(table, tmp)


def shard_metadata(path: Path) -> dict[str, Any] | None:
    """A shard's metadata (None: not one of ours, or unreadable)."""
    import pyarrow.parquet as pq

    try:
        raw = (pq.read_schema(path).metadata or {}).get(METADATA_KEY)
    except (OSError, ValueError):
        return None
    return json.loads(raw) if raw else None


def done_shards(
    output: Path, plan: Plan, engine: str | None, pattern: str = GAME_SHARDS
) -> dict[int, dict[str, Any]]:
    """The shards of `plan` already in `output`, by number (`pattern`: of games, or of
    labelled positions: POSITION_SHARDS). A data file of other settings, or made by another
    engine, is a ValueError naming it (one data set per folder)."""
    done: dict[int, dict[str, Any]] = {}
    if not output.is_dir():
        return done
    for path in sorted(output.glob(pattern)):
        meta = shard_metadata(path)
        if meta is None or meta.get("plan") != plan.record():
            made = f"made with {meta['plan']}" if meta else "not made by this command"
            raise ValueError(
                f"{path} is a shard of another data set ({made}); this one is "
                f"{plan.record()}. Choose another --output, or remove the folder's shards."
            )
        if engine is not None and meta["engine"] != engine:
            raise ValueError(
                f"{path} was played by {meta['engine']}, this task's engine is {engine}: one "
                "data set, one engine. Point --chess_engine at the same Stockfish on every node."
            )
        done[int(meta["shard"])] = meta
    return done


def remove_stale_temporaries(output: Path, shards: Sequence[int]) -> list[Path]:
    """A killed leg's temporary files of these shards, removed. A file is written in well under
    a minute, so one older than STALE_TMP_S is no write in progress: the same command running
    twice at once (a second submission) must not remove the other's file before its rename."""
    removed = []
    for shard in shards:
        for final in (shard_path(output, shard), position_path(output, shard)):
            for tmp in output.glob(f".{final.name}.*.tmp"):
                with contextlib.suppress(FileNotFoundError):
                    if time.time() - tmp.stat().st_mtime > STALE_TMP_S:
                        tmp.unlink()
                        removed.append(tmp)
    return removed


def my_shards(plan: Plan, task: int, tasks: int) -> list[int]:
    return list(range(task, plan.shards, tasks))


def run_task(
    plan: Plan,
    output: Path,
    *,
    task: int = 0,
    tasks: int = 1,
    processes: int = 1,
    path: str | None = None,
    log: Any = print,
) -> list[dict[str, Any]]:
    """Play this task's shards that are not done yet; returns their metadata."""
    engine = find_engine(path)
    # Its version, and the engine of a task on one process (a game clears its hash itself).
    process = EngineProcess(engine, ENGINE_OPTIONS)
    try:
        return _run_task(plan, output, task, tasks, processes, engine, process, log)
    finally:
        process.close()


def _run_task(
    plan: Plan,
    output: Path,
    task: int,
    tasks: int,
    processes: int,
    engine: str,
    process: EngineProcess,
    log: Any,
) -> list[dict[str, Any]]:
    version = process.name
    output.mkdir(parents=True, exist_ok=True)
    done = done_shards(output, plan, version)
    labelled = done_shards(output, plan, version, POSITION_SHARDS)
    mine = my_shards(plan, task, tasks)
    # A shard is done when its games are there and, with positions, its labelled positions
    # (a task killed between the two labels the games it wrote, without playing them again).
    todo = [s for s in mine if s not in done or (plan.positions and s not in labelled)]
    if len(todo) < len(mine):
        log(
            f"selfplay task {task}/{tasks}: {len(mine) - len(todo)} of its {len(mine)} shards "
            "are done already (a requeued task goes on): skipping them"
        )
    made: list[dict[str, Any]] = []
    if not todo:
        return made
    remove_stale_temporaries(output, todo)
    labels = f", {plan.positions} positions a game labelled at depth {plan.label_depth}"
    log(
        f"selfplay task {task}/{tasks}: {len(todo)} shard(s) of {plan.shard_games} games, "
        f"{version} at {plan.limit_text}{labels if plan.positions else ''}, {processes} "
        "process(es)"
    )
    started = time.perf_counter()

    def report(meta: dict[str, Any]) -> None:
        made.append(meta)
        seconds = time.perf_counter() - started
        what = "played" if meta["played"] else "read (played before)"
        positions = f", {meta['positions']} positions labelled" if plan.positions else ""
        log(
            f"  shard {meta['shard'] + 1}/{plan.shards}: games {meta['first']}-"
            f"{meta['first'] + meta['games'] - 1} {what}, {meta['plies'] / meta['games']:.0f} "
            f"plies on average{positions}; {len(made)} of {len(todo)} done in {seconds:.0f}s"
        )

    if processes <= 1:
        for shard in todo:
            report(
                play_shard(engine, version, plan, shard, str(output), task, shard in done, process)
            )
        return made
    with ProcessPoolExecutor(max_workers=processes) as pool:
        n = len(todo)
        for meta in pool.map(
            play_shard,
            [engine] * n,
            [version] * n,
            [plan] * n,
            todo,
            [str(output)] * n,
            [task] * n,
            [s in done for s in todo],
        ):
            report(meta)
    return made


def merge(output: Path, plan: Plan | None = None) -> dict[str, Any] | None:
    """The manifest of a complete data set (written atomically to `selfplay.json`), or None
    while shards are missing. `plan` None: the plan of the shards found."""
    import pyarrow.parquet as pq

    if plan is None:
        found = sorted(output.glob(GAME_SHARDS))
        meta = shard_metadata(found[0]) if found else None
        if meta is None:
            raise ValueError(
                f"{output} holds no self-play shards: run `python -m "
                "fsdp_utils.chess_eval.selfplay --games N --output DIR` (or the array job) first."
            )
        plan = Plan.from_record(meta["plan"])
    done = done_shards(output, plan, None)
    labelled = done_shards(output, plan, None, POSITION_SHARDS)
    if len(done) < plan.shards or (plan.positions and len(labelled) < plan.shards):
        return None
    engines = {m["engine"] for m in [*done.values(), *labelled.values()]}
    if len(engines) > 1:
        raise ValueError(f"{output}'s shards were played by different engines: {sorted(engines)}.")
    shards: list[dict[str, Any]] = []
    kinds: Counter[str] = Counter()
    plies = 0
    for s in range(plan.shards):
        meta = done[s]
        path = shard_path(output, s)
        rows = pq.read_table(path).num_rows
        if rows != meta["games"]:
            raise ValueError(f"{path} holds {rows} games, its metadata says {meta['games']}.")
        kinds.update(meta["kinds"])
        plies += meta["plies"]
        shards.append(
            {"file": path.name, "first": meta["first"], "games": meta["games"],
             "plies": meta["plies"], "sha256": digest_file(path).sha256, **shard_stats(path)}
        )  # fmt: skip
    position_shards: list[dict[str, Any]] = []
    for s in range(plan.shards if plan.positions else 0):
        meta = labelled[s]
        path = position_path(output, s)
        rows = pq.read_table(path).num_rows
        if rows != meta["positions"]:
            raise ValueError(
                f"{path} holds {rows} positions, its metadata says {meta['positions']}."
            )
        position_shards.append(
            {"file": path.name, "first": meta["first"], "games": meta["games"],
             "positions": rows, "sha256": digest_file(path).sha256, **shard_stats(path)}
        )  # fmt: skip
    every = shards + position_shards
    manifest = {
        **plan.record(),
        "engine": engines.pop(),
        "games_by_kind": {k: kinds[k] for k in KINDS if kinds[k]},
        "plies": plies,
        "mean_plies": plies / plan.games,
        "cpu_seconds": round(sum(s.get("cpu_seconds", 0.0) for s in every), 1),
        "tasks": len({s.get("task") for s in every}),
        "shards": shards,
        "how": (
            "game i: its kind drawn from the mix with seed '{seed}/{i}/kind', 4-8 random "
            "legal opening plies from seed '{seed}/{i}', then the engine (Threads=1, Hash 16, "
            "ucinewgame at the game's start) at the limit; vs_random: the engine White in even "
            "games; claimable draws claimed"
        ),
        "command": plan.command(output),
    }
    if plan.positions:
        manifest.update(
            labelled_positions=sum(s["positions"] for s in position_shards),
            label_cpu_seconds=round(sum(s.get("cpu_seconds", 0.0) for s in position_shards), 1),
            position_shards=position_shards,
            positions_how=(
                "game i: min(positions, plies - 1) distinct plies drawn from 1..plies-1 with "
                "seed '{seed}/{i}/positions'; each position (with the game's moves before it) "
                "searched by the engine (Threads=1, Hash 16, ucinewgame first) at the label "
                "depth with MultiPV = its legal moves: every legal move's value in centipawns "
                f"for the side to move, a mate in n {MATE_SCORE} - n, mated in n n - "
                f"{MATE_SCORE} (python-chess Score.score(mate_score={MATE_SCORE})); best first, "
                "ties in UCI order"
            ),
        )
    write_text_atomic(output / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_games(output: Path) -> list[dict[str, Any]]:
    """Every game of a data set folder, in order."""
    import pyarrow.parquet as pq

    return [
        row
        for path in sorted(output.glob(GAME_SHARDS))
        for row in pq.read_table(path, columns=["Moves", "Termination", "Result"]).to_pylist()
    ]


def read_positions(output: Path) -> list[dict[str, Any]]:
    """Every labelled position of a data set folder, in order (game, then ply)."""
    import pyarrow.parquet as pq

    return [
        row
        for path in sorted(output.glob(POSITION_SHARDS))
        for row in pq.read_table(path).to_pylist()
    ]


def self_play(
    games: int,
    *,
    seed: int = 0,
    depth: int | None = 1,
    nodes: int | None = None,
    mix: Sequence[tuple[str, float]] = (("selfplay", 1.0),),
    path: str | None = None,
) -> Iterator[dict[str, Any]]:
    """Games 0..games-1 of a plan, played here on one engine (what a shard holds)."""
    plan = Plan(games=games, seed=seed, depth=depth, nodes=nodes, mix=tuple(mix))
    process = EngineProcess(find_engine(path), ENGINE_OPTIONS)
    try:
        for i in range(games):
            game = functools.partial(play_game, index=i, plan=plan)
            yield process.call(game, f"game {i}", guard=False)
    finally:
        process.close()


# --- the command -------------------------------------------------------------------------


def slurm_task(environ: dict[str, str] | None = None) -> tuple[int, int] | None:
    """(task, tasks) of a Slurm array job's task (contiguous ids, step 1), else None."""
    env = os.environ if environ is None else environ
    if "SLURM_ARRAY_TASK_ID" not in env:
        return None
    low, high = int(env["SLURM_ARRAY_TASK_MIN"]), int(env["SLURM_ARRAY_TASK_MAX"])
    count = int(env.get("SLURM_ARRAY_TASK_COUNT", high - low + 1))
    # A step (--array=0-15:2) or a list (--array=3,7) leaves ids out: their shards would be
    # no task's, and the manifest would never come.
    if int(env.get("SLURM_ARRAY_TASK_STEP", "1")) != 1 or count != high - low + 1:
        raise ValueError(
            "slurm/selfplay.sh needs an array of consecutive task ids (--array=0-N, optionally "
            "%K to limit how many run at once), not a step or a list. To finish what an earlier "
            "array left, submit the same --array=0-N command again: every task skips the shards "
            "that exist and plays only the missing ones."
        )
    return int(env["SLURM_ARRAY_TASK_ID"]) - low, high - low + 1


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m fsdp_utils.chess_eval.selfplay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--games", type=int, help="games in the whole data set")
    parser.add_argument("--output", type=Path, required=True, help="the data set's folder")
    parser.add_argument("--seed", type=int, default=0)
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--depth", type=int, help="search depth per move (default 1)")
    limit.add_argument("--nodes", type=int, help="node limit per move instead")
    parser.add_argument(
        "--mix", default="selfplay", type=parse_mix,
        help="kinds of games and their weights: selfplay (the engine against itself), vs_random "
        "(the engine against a random mover), random (random legal games), e.g. "
        "selfplay:8,vs_random:1,random:1 (default: selfplay)",
    )  # fmt: skip
    parser.add_argument(
        "--shard_games", type=int, default=DEFAULT_SHARD_GAMES,
        help=f"games per shard file, the unit a requeued task resumes from ({DEFAULT_SHARD_GAMES})",
    )  # fmt: skip
    parser.add_argument(
        "--positions", type=int, default=0, metavar="K",
        help="also K positions of each game labelled by the engine (every legal move's value, "
        "the best move), in chess_position_NNNN.parquet beside the games (default 0: games only)",
    )  # fmt: skip
    parser.add_argument(
        "--label_depth", type=int,
        help=f"search depth of each move of a labelled position (default {DEFAULT_LABEL_DEPTH})",
    )  # fmt: skip
    parser.add_argument("--processes", type=int, default=1, help="processes, one engine each")
    parser.add_argument(
        "--task", type=int, help="this task's number (default: the Slurm array task's, else 0)"
    )
    parser.add_argument("--tasks", type=int, help="tasks in all (default: the array's, else 1)")
    parser.add_argument(
        "--merge", action="store_true",
        help="only check the shards in --output and write the manifest (selfplay.json)",
    )  # fmt: skip
    parser.add_argument("--chess_engine", metavar="PATH", help="the Stockfish binary")
    return parser


def _plan(args: argparse.Namespace) -> Plan:
    if args.games is None or args.games < 1:
        raise ValueError("--games N (N >= 1): the games of the whole data set, whatever the tasks.")
    if args.shard_games < 1 or args.processes < 1:
        raise ValueError("--shard_games and --processes must be at least 1.")
    if (args.depth is not None and args.depth < 1) or (args.nodes is not None and args.nodes < 1):
        raise ValueError("--depth and --nodes must be at least 1.")
    depth = None if args.nodes else (args.depth or 1)
    labels: dict[str, Any] = {}
    if args.positions < 0:
        raise ValueError("--positions K: K >= 0 labelled positions a game (0: games only).")
    if args.positions:
        label_depth = DEFAULT_LABEL_DEPTH if args.label_depth is None else args.label_depth
        if label_depth < 1:
            raise ValueError("--label_depth must be at least 1.")
        labels = {"positions": args.positions, "label_depth": label_depth}
    elif args.label_depth is not None:
        raise ValueError(
            "--label_depth sets how positions are labelled: add --positions K (K labelled "
            "positions a game), or leave it out for games only."
        )
    return Plan(
        games=args.games, seed=args.seed, depth=depth, nodes=args.nodes, mix=args.mix,
        shard_games=args.shard_games, **labels,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.merge:
            manifest = merge(args.output, _plan(args) if args.games else None)
            if manifest is None:
                raise ValueError(f"{args.output}: shards are missing; the tasks have not finished.")
            print(describe(manifest, args.output))
            return 0
        plan = _plan(args)
        given = args.task is not None and args.tasks is not None  # the array's then unread
        task, tasks = (0, 1) if given else (slurm_task() or (0, 1))
        task = args.task if args.task is not None else task
        tasks = args.tasks if args.tasks is not None else tasks
        if not 0 <= task < tasks:
            raise ValueError(f"--task {task} of --tasks {tasks}: 0 <= task < tasks.")
        path = choose_engine(args.chess_engine or "on")  # a path given must be a UCI engine
        assert path is not None
        started = time.perf_counter()
        run_task(
            plan, args.output, task=task, tasks=tasks, processes=args.processes, path=path,
        )  # fmt: skip
        manifest = merge(args.output, plan)
    except ValueError as err:  # EngineNotFound, a mistake in the flags, another data set
        print(f"\nerror: {err}\n", file=sys.stderr)
        return 2
    except EngineFailed as err:
        print(f"\nerror: {err}\n", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - started
    if manifest is None:
        done = set(done_shards(args.output, plan, None))
        if plan.positions:
            done &= set(done_shards(args.output, plan, None, POSITION_SHARDS))
        left = plan.shards - len(done)
        print(
            f"selfplay task {task}/{tasks} done in {seconds:.0f}s; {left} of {plan.shards} shards "
            "are other tasks' and not there yet: the last task to finish writes the manifest "
            f"(or run `python -m fsdp_utils.chess_eval.selfplay --output {args.output} --merge`)"
        )
        return 0
    print(describe(manifest, args.output) + f" (this task: {seconds:.0f}s)")
    return 0


def describe(manifest: dict[str, Any], output: Path) -> str:
    kinds = ", ".join(f"{k} {n:,}" for k, n in manifest["games_by_kind"].items())
    limit = f"depth {manifest['depth']}" if manifest["depth"] else f"{manifest['nodes']} nodes"
    positions = ""
    if manifest.get("positions"):
        positions = (
            f" and {manifest['labelled_positions']:,} positions labelled at depth "
            f"{manifest['label_depth']}"
        )
    return (
        f"selfplay: {manifest['games']:,} games ({kinds}; {manifest['mean_plies']:.0f} plies on "
        f"average){positions} by {manifest['engine']} at {limit}, {len(manifest['shards'])} "
        f"shards from {manifest['tasks']} task(s), {manifest['cpu_seconds']:.0f} CPU seconds -> "
        f"{output} ({MANIFEST})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
