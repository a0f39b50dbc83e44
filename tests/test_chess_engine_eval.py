"""The engine judge inside the chess evaluation, the ladder's games and engine games as data,
with real Stockfish processes and scripted players through the real decoding loop.

One evaluation per player is shared by the checks that read it (module fixtures); the engine
searches shallow (depth 6) and the games are few, so the module takes seconds.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path

import chess
import chess.engine
import pytest
from transformers import AutoTokenizer

from fsdp_utils.chess_eval.cli import main as chess_eval_main
from fsdp_utils.chess_eval.evaluator import ChessEvaluator, EngineSettings, format_table
from fsdp_utils.chess_eval.games import PHASES
from fsdp_utils.chess_eval.judge import EngineNotFound, find_engine
from fsdp_utils.chess_eval.ladder import OPENINGS, elo_difference, wilson_interval
from fsdp_utils.chess_eval.referee import board_after
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.prepare import held_out_games
from tests.chess_players import ScriptedPlayer, board_from_prompt, fixed_writer

DEPTH = 6
GAMES = 8
FLAKY = Path(__file__).parent / "fake_bin" / "flaky-stockfish"  # dies once a marker file exists


@pytest.fixture(scope="module")
def config(tiny_assets, tmp_path_factory) -> TrainConfig:
    return TrainConfig(
        model=str(tiny_assets["model"]), dataset=str(tiny_assets["data"]), dataset_include="",
        data_cache_dir=str(tmp_path_factory.mktemp("engine_eval_cache")), max_seq_length=512,
        eval_examples=20, chess_eval_games=GAMES, chess_eval_plies=1,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets["model"])


@pytest.fixture(scope="module")
def games(config):
    return held_out_games(config, limit=GAMES)


def _evaluator(games, tokenizer, **engine) -> ChessEvaluator:
    settings = EngineSettings(path=find_engine(), depth=DEPTH, **engine)
    return ChessEvaluator(
        games, tokenizer, template=TrainConfig().template, plies=1, max_seq_length=512, seed=0,
        batch_size=8, engine=settings,
    )  # fmt: skip


def engine_writer(options: dict, limit: chess.engine.Limit, engines: list):
    """A player whose move is Stockfish's (with `options`), on an engine the test ends."""
    engine = chess.engine.SimpleEngine.popen_uci(find_engine())
    engine.configure({"Threads": 1, **options})
    engines.append(engine)

    def write(prompt: str) -> tuple[str, bool]:
        board = board_from_prompt(prompt)
        if board.is_game_over():
            return "", True
        return " " + engine.play(board, limit, game=object()).move.uci(), False

    return write


def random_writer(prompt: str) -> tuple[str, bool]:
    board = board_from_prompt(prompt)
    if board.is_game_over():
        return "", True
    rng = random.Random(prompt)
    return " " + rng.choice(sorted(board.legal_moves, key=lambda m: m.uci())).uci(), False


@pytest.fixture(scope="module")
def movers(games, tokenizer):
    """Three players on the same positions: random, Skill Level 0 (10 ms), and full strength at
    the judge's own depth (a deeper mover would be judged by a weaker judge: on positions of
    random games, mostly decided, that makes its loss noise)."""
    engines: list = []
    players = {
        "random": random_writer,
        "skill0": engine_writer({"Skill Level": 0}, chess.engine.Limit(time=0.01), engines),
        "full": engine_writer({"Hash": 16}, chess.engine.Limit(depth=DEPTH), engines),
    }
    try:
        evaluator = _evaluator(games, tokenizer)
        results = {name: evaluator.run(ScriptedPlayer(tokenizer, w)) for name, w in players.items()}
    finally:
        for engine in engines:
            engine.quit()
    return evaluator, results


def test_random_loses_more_than_skill_0_which_loses_more_than_full_strength(movers):
    evaluator, r = movers
    loss = {name: m["engine_centipawn_loss"] for name, m in r.items()}
    accuracy = {name: m["engine_accuracy"] for name, m in r.items()}
    assert loss["random"] > loss["skill0"] > loss["full"], loss
    assert accuracy["random"] < accuracy["skill0"] < accuracy["full"], accuracy
    # Full strength at the judge's depth is the judge's own choice (deterministic search).
    assert loss["full"] == 0 and accuracy["full"] == 100 and r["full"]["engine_best_move_rate"] == 1
    assert r["random"]["engine_best_move_rate"] < r["full"]["engine_best_move_rate"]
    # The same positions for all three: every opening, middlegame and ending prefix, and the
    # balanced ones the engine found (within +-100 cp).
    positions = {
        name: {(x["position"], x["fen"]) for x in m["move_records"]} for name, m in r.items()
    }
    assert positions["random"] == positions["skill0"] == positions["full"]
    # Each distinct position once (the start position at most once), spread over the phases.
    prefixes = [*evaluator.prefixes, *(evaluator.balanced or [])]
    distinct = {board_after(p.moves).epd() for p in prefixes}
    assert r["full"]["engine_positions"] == len(distinct) < len(prefixes)
    fens = [x["fen"] for x in r["full"]["move_records"]]
    assert len(fens) == len(set(fens)) and fens.count(chess.STARTING_FEN) <= 1
    assert all(r["full"][f"engine_moves_{phase}"] >= GAMES // 2 for phase in PHASES)
    balanced = [x for x in r["full"]["move_records"] if x["phase"] == "balanced"]
    assert balanced and all(abs(x["cp_before"]) <= 100 for x in balanced)
    assert r["full"]["engine_moves"] == r["full"]["engine_positions"]  # all legal, none illegal
    assert "centipawn loss" in format_table(r["random"], step=None)


def test_per_move_records_are_complete_and_the_table_reads_them(movers):
    _, r = movers
    record = r["random"]["move_records"][0]
    for key in ("fen", "move", "best_move", "cp_before", "cp_after", "cp_loss", "accuracy",
                "depth", "win_before", "win_after", "judgement", "nodes_searched"):  # fmt: skip
        assert key in record, key
    assert record["depth"] == DEPTH and record["legal"] is True
    board = chess.Board(record["fen"])
    assert chess.Move.from_uci(record["move"]) in board.legal_moves
    rates = sum(r["random"][f"engine_{k}_rate"] for k in ("inaccuracy", "mistake", "blunder"))
    assert 0 < rates <= 1


def test_garbage_gets_no_engine_figures_and_counts_its_illegal_moves(games, tokenizer):
    m = _evaluator(games, tokenizer).run(ScriptedPlayer(tokenizer, fixed_writer(" Nf3 e4")))
    assert m["engine_moves"] == 0 and m["engine_illegal"] == m["engine_positions"] > 0
    assert m["engine_centipawn_loss"] is None and m["engine_accuracy"] is None
    assert {x["failure"] for x in m["move_records"]} == {"unparseable"}
    assert m["legal_move_rate"] == 0.0 and m["engine_error"] is None


def _stockfish_children() -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name, rest = stat.split("(", 1)[1].split(") ", 1)
        if name.startswith("stockfish") and int(rest.split()[1]) == os.getpid() and rest[0] != "Z":
            pids.append(int(pid))
    return pids


def test_an_engine_killed_mid_run_is_restarted_and_the_figures_stand(games, tokenizer, movers):
    """The judge's engine dies (SIGKILL) while the model is writing: it is restarted and asked
    again, the restart is counted and said, the figures are those of the run without, and no
    engine process is left behind."""
    killed: list[int] = []

    def kill_then_move(prompt: str) -> tuple[str, bool]:
        if not killed:
            killed.extend(_stockfish_children())
            for pid in killed:
                os.kill(pid, 9)
        return random_writer(prompt)

    m = _evaluator(games, tokenizer).run(ScriptedPlayer(tokenizer, kill_then_move))
    assert killed, "the judge's engine was running during generation"
    assert m["engine_error"] is None and m["engine_restarts"] == 1
    assert "restarted" in m["engine_notes"][0] and "the process exited" in m["engine_notes"][0]
    assert m["move_records"] == movers[1]["random"]["move_records"]
    assert "engine restarts        1" in format_table(m, step=None)
    assert not _stockfish_children()


def test_an_engine_that_keeps_dying_is_an_error_beside_the_legal_move_figures(
    games, tokenizer, tmp_path, monkeypatch
):
    """An engine that dies at every search: restarted twice on the first position, then given
    up; the referee's figures stand, the engine's are replaced by the error naming it."""
    marker = tmp_path / "die"
    marker.touch()
    monkeypatch.setenv("FLAKY_ENGINE_MARKER", str(marker))
    settings = EngineSettings(path=str(FLAKY), depth=DEPTH)
    evaluator = ChessEvaluator(
        games, tokenizer, template=TrainConfig().template, plies=1, max_seq_length=512, seed=0,
        batch_size=8, engine=settings,
    )  # fmt: skip
    m = evaluator.run(ScriptedPlayer(tokenizer, random_writer))
    assert m["engine_error"] and "failed 3 times in a row" in m["engine_error"]
    assert str(FLAKY) in m["engine_error"] and "the process exited" in m["engine_error"]
    assert m["engine_restarts"] == 2
    assert m["legal_move_rate"] == 1.0 and m["continuations"] == 3 * GAMES
    assert "engine_centipawn_loss" not in m and m["move_records"] == []
    assert "FAILED" in format_table(m, step=None)


# --- the ladder -------------------------------------------------------------------------


def test_openings_are_legal_and_scores_have_intervals():
    for _, moves in OPENINGS:
        board = chess.Board()
        for uci in moves:
            board.push_uci(uci)
    low, high = wilson_interval(0.0, 8)
    assert low == 0.0 and 0.2 < high < 0.4
    low, high = wilson_interval(0.5, 8)
    assert low < 0.5 < high and math.isclose(low + high, 1.0)
    assert elo_difference(0.5) == 0 and math.isinf(elo_difference(0.0))
    assert elo_difference(0.75) == pytest.approx(190.8, abs=0.1)  # 400 log10(3)


def test_ladder_games_alternate_colours_and_an_illegal_move_loses(games, tokenizer):
    """Against the random mover and Stockfish at depth 1: a legal random player plays on (the
    depth-1 rung beats it), a garbage player loses every game on its first move."""
    ev = _evaluator(games, tokenizer, ladder=("random", "depth:1"), ladder_games=4)
    garbage = ev.run(ScriptedPlayer(tokenizer, fixed_writer(" Nf3")))
    records = garbage["game_records"]
    assert [(g["rung"], g["model_color"]) for g in records] == [
        (rung, color) for rung in ("random", "depth:1") for color in ("white", "black") * 2
    ]
    assert all(g["points"] == 0 and g["termination"] == "model unparseable" for g in records)
    assert garbage["ladder_random_score"] == 0 and garbage["ladder_random_illegal_losses"] == 4
    assert garbage["ladder_random_elo_diff"] is None  # -inf: not a number in JSON
    assert len(garbage["pgns"]) == 8 and "an illegal move loses" in garbage["pgns"][0]
    assert records[0]["opening"] == records[1]["opening"] != records[2]["opening"]

    ev = _evaluator(games, tokenizer, ladder=("depth:1",), ladder_games=2)
    legal = ev.run(ScriptedPlayer(tokenizer, random_writer))
    assert legal["ladder_depth1_losses"] == 2 and legal["ladder_depth1_illegal_losses"] == 0
    assert all(g["plies"] > 6 for g in legal["game_records"])
    pgn = chess.pgn.read_game(__import__("io").StringIO(legal["pgns"][0]))
    assert pgn is not None and pgn.headers["Opening"] == OPENINGS[0][0]


def test_masked_games_play_only_legal_moves_and_are_reported_apart(tiny_assets, games, tokenizer):
    """The untrained tiny model (its unmasked moves are almost never legal) plays both ways:
    masked, every move is legal (the most likely legal one), the engine judges its moves in
    the games, and the figures go to their own names beside the unmasked games'."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_assets["model"]).eval()
    ev = _evaluator(games, tokenizer, ladder=("depth:1",), ladder_games=2, masking="both")
    m = ev.run(model)
    records = m["game_records"]
    assert [(g["masked"], g["model_color"]) for g in records] == [
        (False, "white"), (False, "black"), (True, "white"), (True, "black"),
    ]  # fmt: skip
    for g in records:
        board = chess.Board()
        for uci in g["moves"]:  # every move on the board was legal (push_uci checks)
            board.push_uci(uci)
        if not g["masked"]:
            continue
        assert not g["termination"].startswith("model ")  # no illegal move
        model_moves = (
            len(g["moves"]) - len(OPENINGS[g["game"] // 2][1]) + (g["model_color"] == "white")
        ) // 2
        assert len(g["legal_mass"]) == model_moves and all(0 < x <= 1 for x in g["legal_mass"])
        assert len(g["judged"]) == min(16, model_moves)
        assert all(0 <= j["cp_loss"] <= 1000 and 0 <= j["accuracy"] <= 100 for j in g["judged"])
    assert m["ladder_masked_depth1_games"] == m["ladder_depth1_games"] == 2
    assert m["ladder_masked_depth1_illegal_losses"] == 0
    assert m["ladder_masked_moves_judged"] == sum(len(g["judged"]) for g in records if g["masked"])
    assert m["ladder_masked_centipawn_loss"] is not None and "ladder_centipawn_loss" not in m
    table = format_table(m, step=None)
    assert "vs depth1 masked" in table and "masked games" in table
    assert 'Event "fsdp_utils chess_eval ladder, masked"' in m["pgns"][2]


# --- missing engine, the command and its preflight ----------------------------------------


def test_missing_engine_auto_skips_on_refuses(config, tmp_path, monkeypatch, capsys):
    from fsdp_utils.chess_eval import judge

    settings, note = EngineSettings.from_config(config.replace(chess_engine="off"))
    assert settings is None and "off" in note
    old = EngineSettings.from_config(config.replace(chess_eval_engine="off"))  # the old spelling
    assert old[0] is None
    # No engine anywhere: auto shows legality only, on refuses with how to install one.
    monkeypatch.delenv("FSDP_UTILS_STOCKFISH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(judge, "DEBIAN_ENGINE", str(tmp_path / "games" / "stockfish"))
    settings, note = EngineSettings.from_config(config)
    assert settings is None and "legality only" in note
    for on in ({"chess_engine": "on"}, {"chess_eval_engine": "on"}):
        with pytest.raises(EngineNotFound, match="conda-forge"):
            EngineSettings.from_config(config.replace(**on))
    monkeypatch.undo()

    args = [str(config.model), "--dataset", config.dataset, "--dataset_include", "",
            "--data_cache_dir", str(config.data_cache_dir), "--eval_examples", "20", "--games",
            "2", "--engine", "on", "--preflight"]  # fmt: skip
    assert chess_eval_main(args) == 0
    assert "preflight OK" in (out := capsys.readouterr().out) and "Stockfish" in out
    # A rung the engine refuses fails in the preflight, not after the games began.
    assert chess_eval_main([*args, "--ladder", "random,elo:100"]) == 2
    assert "'elo:100' cannot be played" in capsys.readouterr().err


def _not_an_engine(folder: Path) -> Path:
    """An executable that exits at once, as /bin/ls would, instead of speaking UCI."""
    script = folder / "not-stockfish"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    return script


def test_an_engine_path_given_is_required_to_work(config, tmp_path, monkeypatch, capsys):
    """auto may fall back to legality only; a path the user gave (--chess_engine, or
    $FSDP_UTILS_STOCKFISH) may not: one paragraph naming it and the engines found, exit 2,
    before any work, and the previous records are left as they were."""
    installed = find_engine()
    broken = {"missing": str(tmp_path / "usr" / "bin" / "stockfish"),
              "not UCI": str(_not_an_engine(tmp_path))}  # fmt: skip
    for why, path in broken.items():
        for choice in ({"chess_engine": path}, {"chess_engine": path, "chess_eval_engine": "auto"}):
            with pytest.raises(EngineNotFound) as err:
                EngineSettings.from_config(config.replace(**choice))
            text = str(err.value)
            assert path in text and installed in text, text
            assert (
                "does not exist" if why == "missing" else "does not run as a UCI engine"
            ) in text
    monkeypatch.setenv("FSDP_UTILS_STOCKFISH", broken["missing"])  # a path given, by the variable
    with pytest.raises(EngineNotFound, match="FSDP_UTILS_STOCKFISH"):
        EngineSettings.from_config(config)
    monkeypatch.delenv("FSDP_UTILS_STOCKFISH")
    assert EngineSettings.from_config(config.replace(chess_engine=installed))[0] is not None

    records = tmp_path / "records"
    records.mkdir()
    (records / "moves.jsonl").write_text("earlier\n")
    args = [str(config.model), "--dataset", config.dataset, "--dataset_include", "",
            "--data_cache_dir", str(config.data_cache_dir), "--eval_examples", "20",
            "--games", "2", "--output_dir", str(records)]  # fmt: skip
    for flag in ("--chess_engine", "--engine"):
        assert chess_eval_main([*args, flag, broken["not UCI"]]) == 2
        err = capsys.readouterr().err
        assert broken["not UCI"] in err and installed in err and "Traceback" not in err
    assert (records / "moves.jsonl").read_text() == "earlier\n"


def test_the_trainers_preflight_refuses_a_required_engine_that_is_missing(
    tiny_assets, tmp_path, capsys
):
    from fsdp_utils.cli import main as finetune_main

    args = ["--model", str(tiny_assets["model"]), "--dataset", str(tiny_assets["data"]),
            "--dataset_include", "", "--output_dir", str(tmp_path / "run"), "--preflight",
            "--chess_eval_every", "5"]  # fmt: skip
    # The old spelling of a required engine at a path, and the new one (auto, the default).
    missing = str(tmp_path / "nowhere" / "stockfish")
    for engine in (["--chess_eval_engine", "on", "--chess_engine", missing],
                   ["--chess_engine", missing]):  # fmt: skip
        assert finetune_main([*args, *engine]) == 2
        err = capsys.readouterr().err
        assert f"{missing} given by --chess_engine does not exist" in err, err
        assert find_engine() in err  # the engine that is there
    assert finetune_main([*args, "--chess_engine", str(_not_an_engine(tmp_path))]) == 2
    assert "does not run as a UCI engine" in capsys.readouterr().err
    # The run itself (no --preflight) stops before any work, and status.json says why: what a
    # script under torchrun (whose own exit code is 1) or the sbatch script reads back.
    (tmp_path / "run").mkdir()
    run = [a for a in args if a != "--preflight"]
    assert finetune_main([*run, "--chess_engine", missing]) == 2
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "failed" and missing in status["user_error"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_standalone_writes_records_beside_the_summary(tiny_assets, config, tmp_path, capsys):
    out = tmp_path / "records"
    args = [str(tiny_assets["model"]), "--dataset", config.dataset, "--dataset_include", "",
            "--data_cache_dir", str(config.data_cache_dir), "--eval_examples", "20",
            "--games", "3", "--plies", "2", "--depth", "4", "--output_dir", str(out), "--json"]  # fmt: skip
    assert chess_eval_main(args) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["engine"].startswith("Stockfish") and document["engine_depth"] == 4
    summary = json.loads((out / "summary.json").read_text())
    moves = [json.loads(line) for line in (out / "moves.jsonl").read_text().splitlines()]
    assert summary["engine_positions"] == len({m["position"] for m in moves}) >= 9
    assert summary["engine_moves"] + summary["engine_illegal"] == len(moves)
    assert "move_records" not in document and document["written"]


# --- engine games as data -----------------------------------------------------------------


def _ended_as_recorded(game: dict) -> None:
    board = chess.Board()
    for uci in game["Moves"]:
        board.push_uci(uci)
    outcome = board.outcome(claim_draw=True)
    assert outcome is not None and outcome.result() == game["Result"]
    assert outcome.termination.name == game["Termination"]


def test_an_array_task_is_its_offset_in_consecutive_ids_and_a_list_is_refused():
    from fsdp_utils.chess_eval.selfplay import slurm_task

    def env(task: int, low: int, high: int, **more: str) -> dict[str, str]:
        ids = {
            "SLURM_ARRAY_TASK_ID": task,
            "SLURM_ARRAY_TASK_MIN": low,
            "SLURM_ARRAY_TASK_MAX": high,
        }
        return {k: str(v) for k, v in ids.items()} | more

    assert slurm_task({}) is None
    assert slurm_task(env(5, 1, 16, SLURM_ARRAY_TASK_COUNT="16")) == (4, 16)
    assert slurm_task(env(3, 0, 15)) == (3, 16)  # an older Slurm without the count
    with pytest.raises(ValueError, match="submit the same --array=0-N command again"):
        slurm_task(env(7, 3, 7, SLURM_ARRAY_TASK_COUNT="2"))  # --array=3,7
    with pytest.raises(ValueError, match="not a step or a list"):
        slurm_task(env(2, 0, 14, SLURM_ARRAY_TASK_STEP="2", SLURM_ARRAY_TASK_COUNT="8"))


def test_only_a_killed_tasks_temporary_shard_files_are_removed(tmp_path):
    """A task removes its shards' leftover temporary files, but not one being written now by
    the same command submitted twice (it would fail that one's rename)."""
    from fsdp_utils.chess_eval.selfplay import STALE_TMP_S, remove_stale_temporaries, shard_path

    final = shard_path(tmp_path, 3)
    old, fresh = (tmp_path / f".{final.name}.{pid}.tmp" for pid in (111, 222))
    other = tmp_path / f".{shard_path(tmp_path, 4).name}.111.tmp"  # another shard's
    for path in (old, fresh, other):
        path.write_bytes(b"x")
    stale = time.time() - STALE_TMP_S - 60
    os.utime(old, (stale, stale))
    os.utime(other, (stale, stale))
    assert remove_stale_temporaries(tmp_path, [3]) == [old]
    assert fresh.exists() and other.exists() and not old.exists()


def test_engine_data_is_the_same_from_one_task_or_two_and_a_requeued_task_skips_done_shards(
    tmp_path, capsys
):
    """The array job's shards: two tasks (as `sbatch --array=0-1` runs them) and one task on
    two processes write the same files, byte for byte: the games in
    laion/strategic_game_chess's schema and, beside them, positions of each game labelled by
    the engine (every legal move's value); the manifest says how and by which engine; a task
    run again makes only what is missing; the games' readers never read the positions."""
    import pyarrow.parquet as pq

    from fsdp_utils.chess_eval.judge import engine_version
    from fsdp_utils.chess_eval.selfplay import main as selfplay_main
    from fsdp_utils.chess_eval.selfplay import read_games, read_positions, self_play

    mix = "selfplay:2,vs_random:1,random:1"
    games_only = ["--games", "6", "--shard_games", "2", "--mix", mix, "--seed", "3"]  # 3 kinds
    common = [*games_only, "--positions", "2", "--label_depth", "3"]
    two, one = tmp_path / "two", tmp_path / "one"
    for task in range(2):  # task 0: shards 1 and 3 of 3; task 1: shard 2
        assert (
            selfplay_main([*common, "--output", str(two), "--task", str(task), "--tasks", "2"]) == 0
        )
    assert selfplay_main([*common, "--output", str(one), "--processes", "2"]) == 0
    names = sorted(p.name for p in one.glob("chess_game_*.parquet"))
    assert names == [f"chess_game_{k:04d}.parquet" for k in range(1, 4)]
    labelled = [f"chess_position_{k:04d}.parquet" for k in range(1, 4)]
    assert sorted(p.name for p in one.glob("*.parquet")) == names + labelled
    assert names + labelled == sorted(p.name for p in two.glob("*.parquet"))
    for name in names + labelled:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    games = read_games(one)
    assert games == list(
        self_play(6, seed=3, mix=(("selfplay", 2), ("vs_random", 1), ("random", 1)))
    )
    for game in games:
        _ended_as_recorded(game)
    assert pq.read_table(one / names[0]).column_names == ["Moves", "Termination", "Result"]
    positions = read_positions(one)
    _labelled_as_the_engine_says(positions, games)
    manifest = json.loads((one / "selfplay.json").read_text())
    assert manifest == {**manifest, "games": 6, "seed": 3, "depth": 1, "shard_games": 2,
                        "positions": 2, "label_depth": 3,
                        "labelled_positions": 12, "engine": engine_version(), "tasks": 1}  # fmt: skip
    assert sum(manifest["games_by_kind"].values()) == 6 and len(manifest["games_by_kind"]) == 3
    assert manifest["plies"] == sum(len(g["Moves"]) for g in games)
    assert [(s["file"], s["positions"]) for s in manifest["position_shards"]] == [
        (name, 4) for name in labelled
    ]
    other = json.loads((two / "selfplay.json").read_text())
    assert other["tasks"] == 2
    for key in ("shards", "position_shards"):
        assert [s["sha256"] for s in other[key]] == [s["sha256"] for s in manifest[key]]
    assert (
        f"--mix {mix}" in manifest["command"]
        and "--positions 2 --label_depth 3" in manifest["command"]
    )
    # The data set is the folder's games: its manifest, the shards' notes and the labelled
    # positions beside the games are not read as games; the positions only by name.
    from fsdp_utils.hub.resolve import describe_dataset_files, resolve_dataset_files

    files = resolve_dataset_files(str(one))
    assert [p.name for p in files] == names
    assert "--dataset_include 'chess_position_*.parquet'" in describe_dataset_files(
        files, None, str(one)
    )
    positional = resolve_dataset_files(str(one), "chess_position_*.parquet")
    assert [p.name for p in positional] == labelled

    # A requeued task: the shards it wrote stay, the games it lost are played again and
    # labelled; positions it lost are labelled again from the games it wrote.
    (two / names[2]).unlink()
    (two / labelled[0]).unlink()
    kept = (two / names[0]).stat().st_mtime_ns
    capsys.readouterr()
    assert selfplay_main([*common, "--output", str(two), "--task", "0", "--tasks", "2"]) == 0
    out = capsys.readouterr().out
    assert (
        "shard 1/3: games 0-1 read (played before)" in out and "shard 3/3: games 4-5 played" in out
    )
    assert "shard 2/3" not in out
    assert (two / names[0]).stat().st_mtime_ns == kept
    for name in (names[2], labelled[0]):
        assert (two / name).read_bytes() == (one / name).read_bytes(), name
    assert selfplay_main([*common, "--output", str(two), "--task", "0", "--tasks", "2"]) == 0
    assert "2 of its 2 shards are done already" in capsys.readouterr().out
    # Another data set in the same folder is refused: other settings, or the games alone.
    assert selfplay_main(["--games", "7", "--shard_games", "2", "--output", str(two)]) == 2
    assert "a shard of another data set" in capsys.readouterr().err
    assert selfplay_main([*games_only, "--output", str(two)]) == 2
    assert "a shard of another data set" in capsys.readouterr().err
    # The games alone, in a folder of their own: the same games, no positions.
    alone = tmp_path / "alone"
    assert selfplay_main([*games_only, "--output", str(alone)]) == 0
    assert sorted(p.name for p in alone.glob("*.parquet")) == names
    assert read_games(alone) == games and "position_shards" not in json.loads(
        (alone / "selfplay.json").read_text()
    )


def _labelled_as_the_engine_says(positions: list[dict], games: list[dict]) -> None:
    """Each game's 2 positions, at distinct plies before its last move, each with every legal
    move's value once, best first, the best move the first."""
    assert [(p["game"], p["kind"]) for p in positions][::2] == [
        (i, positions[2 * i]["kind"]) for i in range(len(games))
    ]
    for p in positions:
        moves = games[p["game"]]["Moves"]
        assert 1 <= p["ply"] < len(moves) and p["moves"] == moves[: p["ply"]]
        assert p["next_move"] == moves[p["ply"]]
        board = board_after(p["moves"])
        assert board.fen() == p["fen"] and not board.is_game_over()
        assert sorted(p["legal_moves"]) == sorted(m.uci() for m in board.legal_moves)
        assert len(p["move_values"]) == len(p["legal_moves"])
        assert p["move_values"] == sorted(p["move_values"], reverse=True)
        assert p["best_move"] == p["legal_moves"][0]
    for a, b in zip(positions[::2], positions[1::2], strict=True):
        assert a["game"] == b["game"] and a["ply"] < b["ply"]


def test_a_labelled_position_values_every_legal_move_for_the_side_to_move(tmp_path):
    """Known positions: the mate in one is the best move at the mate's value, for White and for
    Black (the side to move's view); the piece left hanging is worse than the capture; a
    position with one legal move has that move alone. An engine that dies while labelling is
    restarted and labels the same."""
    import functools

    from fsdp_utils.chess_eval.judge import MATE_SCORE, EngineProcess, close_engine, open_engine
    from fsdp_utils.chess_eval.selfplay import ENGINE_OPTIONS, Plan, label_game, label_position

    scholar = board_after(["e2e4", "e7e5", "f1c4", "b8c6", "d1f3", "d7d6"])  # White: Qxf7#
    fool = board_after(["f2f3", "e7e5", "g2g4"])  # Black: Qh4#
    queen_up = "4k3/8/8/3q4/8/8/3R4/4K3"  # Black's queen against White's rook
    white, black = chess.Board(f"{queen_up} w - - 0 1"), chess.Board(f"{queen_up} b - - 0 1")
    forced = chess.Board("k7/8/8/8/8/8/6q1/7K w - - 0 1")  # Kxg2, nothing else
    game = {"Moves": [m.uci() for m in scholar.move_stack] + ["f3f7"]}
    plan = Plan(games=1, positions=3, label_depth=4)
    engine = open_engine(find_engine(), ENGINE_OPTIONS)
    try:
        limit = chess.engine.Limit(depth=4)
        labels = {
            name: label_position(engine, board, limit)
            for name, board in [("scholar", scholar), ("fool", fool), ("white", white),
                                ("black", black), ("forced", forced)]
        }  # fmt: skip
        rows = label_game(engine, game=game, index=0, plan=plan)
    finally:
        close_engine(engine)
    flaky = tmp_path / "engine"
    flaky.symlink_to(FLAKY)
    (tmp_path / "engine.die-once").touch()  # its first search dies
    process = EngineProcess(str(flaky), ENGINE_OPTIONS)
    try:
        label = functools.partial(label_game, game=game, index=0, plan=plan)
        assert process.call(label, "game 0's positions", guard=False) == rows
    finally:
        process.close()
    assert process.restarts == 1
    plies = [r["ply"] for r in rows]  # 3 distinct, after the first move, before the last
    assert plies == sorted(set(plies)) and len(plies) == 3 and 1 <= plies[0] <= plies[-1] <= 6
    assert all(r["best_move"] == "f3f7" for r in rows if r["ply"] == 6)
    for name, board in [("scholar", scholar), ("fool", fool), ("white", white), ("black", black)]:
        moves = [m for m, _ in labels[name]]
        assert sorted(moves) == sorted(m.uci() for m in board.legal_moves), name
    assert labels["scholar"][0] == ("f3f7", MATE_SCORE - 1)  # mate in one, White to move
    assert labels["fool"][0] == ("d8h4", MATE_SCORE - 1)  # the same for Black: its own view
    assert all(v < MATE_SCORE - 1000 for _, v in labels["scholar"][1:] + labels["fool"][1:])
    assert labels["white"][0][0] == "d2d5" and labels["white"][0][1] > 300  # takes the queen
    assert labels["white"][-1][1] < -300  # a rook move that leaves the queen on the board
    assert labels["black"][0][1] > 300  # a queen up, seen from Black
    # Qxd2+ Kxd2: the queen traded for the rook, bare kings, a draw.
    assert abs(dict(labels["black"])["d5d2"]) < 100 < labels["black"][0][1] - 200
    assert forced.legal_moves.count() == 1 and [m for m, _ in labels["forced"]] == ["h1g2"]


def test_the_shipped_engine_games_are_what_their_command_makes():
    from fsdp_utils.chess_eval.judge import engine_version
    from fsdp_utils.chess_eval.selfplay import self_play
    from fsdp_utils.demo import ENGINE_GAMES, engine_games

    made = json.loads((ENGINE_GAMES / "selfplay.json").read_text())
    assert len(engine_games()) == made["games"] == sum(made["games_by_kind"].values())
    if made["engine"] == engine_version():  # the engine that made the shipped file remakes it
        assert engine_games()[:3] == list(self_play(3, seed=made["seed"], depth=made["depth"]))
