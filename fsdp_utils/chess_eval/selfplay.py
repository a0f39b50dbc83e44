"""Engine games as data, made by as many CPUs as you have: Stockfish playing itself (and, by
`--mix`, against a random mover, and random legal games), written in the schema of
laion/strategic_game_chess (`Moves`, `Termination`, `Result`; parquet shards), which is itself
Stockfish playing itself.

    python -m fsdp_utils.chess_eval.selfplay --games 20000 --output data/engine_games --processes 2
    sbatch --array=0-15 slurm/selfplay.sh --games 200000 --output data/engine_games
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

Speed, one process at depth 1: about 12 self-play games a second on a quiet core of this
machine (~90 plies a game), 2-4 on a busy one; a random game takes a few milliseconds.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
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
from fsdp_utils.atomic import write_text_atomic
from fsdp_utils.chess_eval.judge import (
    DEFAULT_TIMEOUT_S,
    EngineFailed,
    EngineProcess,
    choose_engine,
    find_engine,
    guarded,
)
from fsdp_utils.data.chess_files import shard_name

OPENING_PLIES = (4, 8)
KINDS = ("selfplay", "vs_random", "random")
MANIFEST = "selfplay.json"
METADATA_KEY = b"fsdp_utils.selfplay"
DEFAULT_SHARD_GAMES = 500
ENGINE_OPTIONS = {"Threads": 1, "Hash": 16}


@dataclass(frozen=True)
class Plan:
    """What a data set is: every task of it must have the same (checked in each shard)."""

    games: int
    seed: int = 0
    depth: int | None = 1
    nodes: int | None = None
    mix: tuple[tuple[str, float], ...] = (("selfplay", 1.0),)
    shard_games: int = DEFAULT_SHARD_GAMES

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
        return out

    def command(self, output: Path) -> str:
        limit = f"--depth {self.depth}" if self.depth is not None else f"--nodes {self.nodes}"
        mix = ",".join(f"{k}:{w:g}" for k, w in self.mix)
        return (
            f"python -m fsdp_utils.chess_eval.selfplay --games {self.games} --seed {self.seed} "
            f"{limit} --mix {mix} --shard_games {self.shard_games} --output {output}"
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


def random_move(board: chess.Board, rng: random.Random) -> chess.Move:
    return rng.choice(sorted(board.legal_moves, key=lambda m: m.uci()))


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


def _play_on(engine: chess.engine.SimpleEngine, *, index: int, plan: Plan) -> dict[str, Any]:
    return play_game(engine, index, plan=plan)


def _play_call(
    engine: chess.engine.SimpleEngine, board: chess.Board, limit: chess.engine.Limit, game: object
) -> Any:
    return lambda: engine.play(board, limit, game=game)


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


def play_shard(
    path: str,
    version: str,
    plan: Plan,
    shard: int,
    output: str,
    task: int,
    engine: EngineProcess | None = None,
) -> dict[str, Any]:
    """Play shard `shard` and write it whole; returns its metadata. On `engine`, or on an
    engine of its own (ended here). A game whose engine dies or hangs is played again from
    its start on a restarted engine (`EngineProcess`), so that it is the game it would have
    been."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    started, cpu = time.perf_counter(), time.process_time()
    games = list(plan.shard_range(shard))
    needs_engine = any(plan.kind(i) != "random" for i in games)
    own = engine is None and needs_engine
    process = EngineProcess(path, ENGINE_OPTIONS) if own else engine
    restarts_before = process.restarts if process is not None else 0
    engine_cpu_before = process.cpu_seconds() if process is not None else 0.0
    try:
        rows = []
        for i in games:
            if process is None:
                rows.append(play_game(None, i, plan=plan))
            else:
                game = functools.partial(_play_on, index=i, plan=plan)
                rows.append(process.call(game, f"game {i}", guard=False))
        restarts = process.restarts - restarts_before if process is not None else 0
        engine_cpu = process.cpu_seconds() - engine_cpu_before if process is not None else 0.0
    finally:
        if own and process is not None:
            process.close()
    # In the shard: what it is (the same bytes whichever task or host plays it); beside it:
    # how it was made here (the task, the host, the seconds).
    meta = {
        "plan": plan.record(), "engine": version, "shard": shard, "first": games[0],
        "games": len(games), "plies": sum(len(r["Moves"]) for r in rows),
        "kinds": dict(Counter(plan.kind(i) for i in games)),
    }  # fmt: skip
    stats = {
        "task": task, "host": socket.gethostname(),
        "wall_seconds": round(time.perf_counter() - started, 3),
        "cpu_seconds": round(time.process_time() - cpu + engine_cpu, 3),
        "engine_restarts": restarts,
    }  # fmt: skip
    schema = pa.schema(
        [("Moves", pa.list_(pa.string())), ("Termination", pa.string()), ("Result", pa.string())]
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    table = table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()})
    final = shard_path(Path(output), shard)
    write_text_atomic(stats_path(final), json.dumps(stats) + "\n")
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, final)  # whole or not at all: a killed task leaves only its temporary file
    return meta | stats


def shard_metadata(path: Path) -> dict[str, Any] | None:
    """A shard's metadata (None: not one of ours, or unreadable)."""
    import pyarrow.parquet as pq

    try:
        raw = (pq.read_schema(path).metadata or {}).get(METADATA_KEY)
    except (OSError, ValueError):
        return None
    return json.loads(raw) if raw else None


def done_shards(output: Path, plan: Plan, engine: str | None) -> dict[int, dict[str, Any]]:
    """The shards of `plan` already in `output`, by number. A data file of other settings, or
    made by another engine, is a ValueError naming it (one data set per folder)."""
    done: dict[int, dict[str, Any]] = {}
    if not output.is_dir():
        return done
    for path in sorted(output.glob("chess_game_*.parquet")):
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
    mine = my_shards(plan, task, tasks)
    todo = [s for s in mine if s not in done]
    if len(todo) < len(mine):
        log(
            f"selfplay task {task}/{tasks}: {len(mine) - len(todo)} of its {len(mine)} shards "
            "are done already (a requeued task goes on): skipping them"
        )
    made: list[dict[str, Any]] = []
    if not todo:
        return made
    for shard in todo:  # a killed leg's temporary files (only this task writes these shards)
        final = shard_path(output, shard)
        for tmp in output.glob(f".{final.name}.*.tmp"):
            tmp.unlink(missing_ok=True)
    log(
        f"selfplay task {task}/{tasks}: {len(todo)} shard(s) of {plan.shard_games} games, "
        f"{version} at {plan.limit_text}, {processes} process(es)"
    )

    def report(meta: dict[str, Any]) -> None:
        made.append(meta)
        rate = meta["games"] / max(meta["wall_seconds"], 1e-9)
        log(
            f"  shard {meta['shard'] + 1}/{plan.shards}: games {meta['first']}-"
            f"{meta['first'] + meta['games'] - 1}, {meta['plies'] / meta['games']:.0f} plies on "
            f"average, {meta['wall_seconds']:.0f}s ({rate:.1f} games/s); {len(made)} of "
            f"{len(todo)} done"
        )

    if processes <= 1:
        for shard in todo:
            report(play_shard(engine, version, plan, shard, str(output), task, process))
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
        ):
            report(meta)
    return made


def merge(output: Path, plan: Plan | None = None) -> dict[str, Any] | None:
    """The manifest of a complete data set (written atomically to `selfplay.json`), or None
    while shards are missing. `plan` None: the plan of the shards found."""
    import pyarrow.parquet as pq

    if plan is None:
        found = sorted(output.glob("chess_game_*.parquet"))
        meta = shard_metadata(found[0]) if found else None
        if meta is None:
            raise ValueError(
                f"{output} holds no self-play shards: run `python -m "
                "fsdp_utils.chess_eval.selfplay --games N --output DIR` (or the array job) first."
            )
        record = meta["plan"]
        plan = Plan(
            games=record["games"], seed=record["seed"], depth=record["depth"],
            nodes=record["nodes"], mix=tuple(record["mix"].items()),
            shard_games=record["shard_games"],
        )  # fmt: skip
    done = done_shards(output, plan, None)
    if len(done) < plan.shards:
        return None
    engines = {m["engine"] for m in done.values()}
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
             "plies": meta["plies"], "sha256": _sha256(path), **shard_stats(path)}
        )  # fmt: skip
    manifest = {
        **plan.record(),
        "engine": engines.pop(),
        "games_by_kind": {k: kinds[k] for k in KINDS if kinds[k]},
        "plies": plies,
        "mean_plies": plies / plan.games,
        "cpu_seconds": round(sum(s.get("cpu_seconds", 0.0) for s in shards), 1),
        "tasks": len({s.get("task") for s in shards}),
        "shards": shards,
        "how": (
            "game i: its kind drawn from the mix with seed '{seed}/{i}/kind', 4-8 random "
            "legal opening plies from seed '{seed}/{i}', then the engine (Threads=1, Hash 16, "
            "ucinewgame at the game's start) at the limit; vs_random: the engine White in even "
            "games; claimable draws claimed"
        ),
        "command": plan.command(output),
    }
    write_text_atomic(output / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_games(output: Path) -> list[dict[str, Any]]:
    """Every game of a data set folder, in order."""
    import pyarrow.parquet as pq

    return [
        row
        for path in sorted(output.glob("chess_game_*.parquet"))
        for row in pq.read_table(path, columns=["Moves", "Termination", "Result"]).to_pylist()
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
            game = functools.partial(_play_on, index=i, plan=plan)
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
    if int(env.get("SLURM_ARRAY_TASK_STEP", "1")) != 1:
        raise ValueError(
            "slurm/selfplay.sh needs an array of consecutive task ids (--array=0-N, optionally "
            "%K to limit how many run at once), not a step."
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
    return Plan(
        games=args.games, seed=args.seed, depth=depth, nodes=args.nodes, mix=args.mix,
        shard_games=args.shard_games,
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
        task, tasks = slurm_task() or (0, 1)
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
        left = plan.shards - len(done_shards(args.output, plan, None))
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
    return (
        f"selfplay: {manifest['games']:,} games ({kinds}; {manifest['mean_plies']:.0f} plies on "
        f"average) by {manifest['engine']} at {limit}, {len(manifest['shards'])} shards from "
        f"{manifest['tasks']} task(s), {manifest['cpu_seconds']:.0f} CPU seconds -> {output} "
        f"({MANIFEST})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
