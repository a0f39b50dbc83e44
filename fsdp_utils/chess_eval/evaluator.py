"""The chess evaluator: held-out game prefixes -> the model plays on -> the referee's counts,
the engine judge's figures and games against a ladder of opponents.

Built once and run like torchtitan's Validator: `ChessEvaluator.from_config(...)` loads the
games and the tokenizer; `run(model, step=...)` is collective under torchrun. The prefixes and
the games are dealt round-robin to the ranks and padded with dummy rows, so every rank runs
the same number of batches and forward passes; each rank counts only its real rows and one
all-reduce of the integer counts gives every rank the same totals, whatever the world size.

The engine part (`engine`: `EngineSettings`, None without an engine) composes the referee
(`referee.py`), the judge (`judge.py`, one Stockfish process per rank, started for the run and
ended on every way out of it) and the games (`games.py`, `ladder.py`): each rank judges its
own continuations and plays its share of the ladder's games (unmasked, or masked: the model's
most likely legal move, `_masked_moves`), so the engine work is spread over the ranks' CPU
cores; the per-move and per-game records are gathered and every figure is computed from them in
one order (`figures.py`). An engine that crashes or hangs is restarted and asked again
(`engine_restarts`); one that keeps failing ends that part of this evaluation with its error in
the metrics (`engine_error`); the referee's figures and the training run go on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import chess
import torch
from torch import nn

from fsdp_utils.atomic import folder_written_atomically, write_text_atomic
from fsdp_utils.chess_eval.figures import (
    FIGURE_PHASES,
    Played,
    distinct_positions,
    engine_metrics,
    judge_board_score,
    move_records,
    pct,
)
from fsdp_utils.chess_eval.games import (
    PHASES,
    Prefix,
    balanced_ply,
    balanced_prefix,
    make_prefixes,
    moves_offset,
    render_prompt,
    require_games,
)
from fsdp_utils.chess_eval.judge import (
    CP_CEILING,
    EngineFailed,
    EngineJudge,
    EngineProcess,
    choose_engine,
    uci_engine_name,
)
from fsdp_utils.chess_eval.ladder import (
    MAX_PLIES,
    LadderGame,
    Opponent,
    check_opponents,
    ladder_line,
    masked_totals,
    score_rungs,
)
from fsdp_utils.chess_eval.referee import FAILURES, Verdict, board_after, judge
from fsdp_utils.config.options.evaluation import engine_choice, ladder_rungs
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.render import render_row
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.generate import (
    Sampling,
    continuation_logprobs,
    continue_prompts,
    row_seed,
    top1_hits,
)
from fsdp_utils.parallel.parallelize import no_grad_pass

DEFAULT_BATCH_SIZE = 8
# What a run returns beside its numbers: not metrics.jsonl material (`log_record` drops them).
RECORDS = ("examples", "move_records", "game_records", "pgns", "engine_notes")

# The integer counts every rank contributes; one all-reduce sums them.
COUNTS = (
    "continuations", "legal_plies", "moves_judged", "full_length", "ended",
    "result_checked", "result_matched", "tf_moves", "tf_correct",
    *(f"{phase}_{what}" for phase in PHASES for what in ("legal_plies", "moves_judged")),
    *(f"fail_{kind}" for kind in FAILURES),
)  # fmt: skip


@dataclass
class Example:
    """One continuation, for people: the end of its prompt, what the model wrote, verdict."""

    phase: str
    prompt: str
    continuation: str
    verdict: Verdict

    def describe(self, *, width: int = 60) -> str:
        prompt = self.prompt if len(self.prompt) <= width else "..." + self.prompt[-width:]
        written = self.continuation.strip().replace("\n", " ")
        if len(written) > 2 * width:
            written = written[: 2 * width] + "..."
        v = self.verdict
        outcome = f"{v.legal_plies} legal plies" + (f", then {v.failure}" if v.failure else "")
        if v.ended:
            outcome += f"; game over {v.result}"
        return f"{prompt} | {written or '(nothing)'}  [{outcome}]"


@dataclass
class _Tally:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))

    def add_verdict(self, prefix: Prefix, verdict: Verdict) -> None:
        c = self.counts
        c["continuations"] += 1
        c["legal_plies"] += verdict.legal_plies
        c["moves_judged"] += verdict.moves_judged
        c[f"{prefix.phase}_legal_plies"] += verdict.legal_plies
        c[f"{prefix.phase}_moves_judged"] += verdict.moves_judged
        c["full_length"] += verdict.failure is None
        if verdict.failure is not None:
            c[f"fail_{verdict.failure}"] += 1
        if verdict.ended:
            c["ended"] += 1
            if prefix.header_result is not None:
                c["result_checked"] += 1
                c["result_matched"] += verdict.result == prefix.header_result


@dataclass(frozen=True)
class EngineSettings:
    """The engine part of an evaluation (from the config: `EngineSettings.from_config`)."""

    path: str
    depth: int | None = 10
    nodes: int | None = None
    judged_plies: int = 1
    ladder: tuple[str, ...] = ()
    ladder_games: int = 8
    masking: str = "off"  # the ladder's games: unmasked (off), masked (on), or both

    @classmethod
    def from_config(cls, config: TrainConfig) -> tuple[EngineSettings | None, str]:
        """(settings, one line for the log). None when --chess_engine is off, or auto and no
        engine is found; EngineNotFound (a ValueError: exit 2) when it is on and none is
        found, or a path that is not a working UCI engine (`judge.choose_engine`)."""
        choice = engine_choice(config)
        if choice == "off":
            return None, "engine judge off (--chess_engine off)"
        path = choose_engine(choice)
        if path is None:
            return None, (
                "engine judge skipped: no Stockfish found, legality only "
                "(conda install -c conda-forge stockfish, or apt-get install stockfish)"
            )
        nodes = config.chess_eval_nodes
        settings = cls(
            path=path,
            depth=None if nodes else config.chess_eval_depth,
            nodes=nodes,
            judged_plies=config.chess_eval_judged_plies,
            ladder=tuple(ladder_rungs(config.chess_eval_ladder)),
            ladder_games=config.chess_eval_ladder_games,
            masking=config.chess_eval_masking,
        )
        return settings, settings.describe()

    def check(self) -> str:
        """The preflights' check: start the engine once (its version, e.g. "Stockfish 15.1")
        and each rung's opponent; a ValueError naming the fix when the binary does not run as
        a UCI engine or refuses a rung's level."""
        try:
            version = uci_engine_name(self.path)
        except EngineFailed as err:
            raise ValueError(
                f"The chess engine {self.path} does not run as a UCI engine ({err}). Point "
                "--chess_engine at a Stockfish binary, or turn the engine judge off "
                "(--chess_engine off)."
            ) from err
        check_opponents(self.ladder, self.path)
        return version

    def describe(self) -> str:
        ways = {"off": "", "on": ", masked", "both": ", unmasked and masked"}[self.masking]
        ladder = f"; ladder {','.join(self.ladder)}, {self.ladder_games} games each{ways}"
        return f"engine judge: {self.path}, {self.limit_text}" + (ladder if self.ladder else "")

    @property
    def masked_modes(self) -> tuple[bool, ...]:
        """The ladder's games against each rung: unmasked (False), masked (True)."""
        return {"off": (False,), "on": (True,), "both": (False, True)}[self.masking]

    @property
    def limit_text(self) -> str:
        return f"depth {self.depth}" if self.depth is not None else f"{self.nodes} nodes"


class _EngineRun:
    """This rank's engine for one evaluation: the judge, and the first error it met."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.error: str | None = None
        self.judge: EngineJudge | None = None
        self.name = "engine"
        self.restarts = 0  # of engines ended already (the ladder's opponents)
        self.notes: list[str] = []  # the restarts' log lines
        try:
            self.judge = EngineJudge(path=settings.path, depth=settings.depth, nodes=settings.nodes)
            self.name = self.judge.name
        except EngineFailed as err:
            self.error = str(err)

    def fail(self, err: Exception) -> None:
        self.error = self.error or str(err)
        self.close()

    def count(self, process: EngineProcess | None) -> None:
        """Add a finished engine's restarts (and their log lines) to this run's."""
        if process is not None:
            self.restarts += process.restarts
            self.notes.extend(process.take_notes())

    def all_restarts(self) -> int:
        return self.restarts + (self.judge.restarts if self.judge is not None else 0)

    @property
    def ok(self) -> bool:
        return self.error is None and self.judge is not None

    def close(self) -> None:
        if self.judge is not None:
            self.notes.extend(self.judge.process.take_notes())
            self.judge.close()


class ChessEvaluator:
    def __init__(
        self,
        games: Sequence[dict[str, Any]],
        tokenizer: Any,
        *,
        template: str,
        plies: int,
        max_seq_length: int,
        seed: int,
        temperature: float = 0.0,
        batch_size: int = DEFAULT_BATCH_SIZE,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | None = None,
        engine: EngineSettings | None = None,
    ) -> None:
        require_games(games)
        if plies < 1:
            raise ValueError(f"--chess_eval_plies must be at least 1, got {plies}.")
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "The tokenizer has no EOS token: the evaluation cannot tell where a game ends."
            )
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                "The chess evaluation needs a fast tokenizer (tokenizer.json) to map moves to "
                "tokens; this one is a slow (Python) tokenizer."
            )
        self.games = list(games)
        self.tokenizer = tokenizer
        self.template = template
        self.plies = plies
        self.max_seq_length = max_seq_length
        self.temperature = temperature
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.device = device or torch.device("cpu")
        self.eos = int(tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id
        self.pad = int(pad) if pad is not None else self.eos
        self.tokens_per_ply = self._tokens_per_ply()
        self.max_new_tokens = (plies + 1) * self.tokens_per_ply
        self.seed = seed
        self.prefixes = self._fit(make_prefixes(self.games, template, plies=plies, seed=seed))
        self.engine = engine
        self.engine_note = engine.describe() if engine else "engine judge off"
        # Balanced positions, chosen with the engine at the first run that has one.
        self.balanced: list[Prefix] | None = None

    @classmethod
    def from_config(
        cls,
        config: TrainConfig,
        tokenizer: Any,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | None = None,
        files: Sequence[Path] | None = None,
    ) -> ChessEvaluator:
        """`files`: the run's data files when already resolved (the trainer's)."""
        from fsdp_utils.data.prepare import held_out_games

        games = held_out_games(config, limit=config.chess_eval_games, files=files)
        engine, note = EngineSettings.from_config(config)
        evaluator = cls(
            games,
            tokenizer,
            template=config.template,
            plies=config.chess_eval_plies,
            max_seq_length=config.seq_length,
            seed=config.seed,
            temperature=config.chess_eval_temperature,
            batch_size=config.chess_eval_batch_size or DEFAULT_BATCH_SIZE,
            rank=rank,
            world_size=world_size,
            device=device,
            engine=engine,
        )
        evaluator.engine_note = note  # with the reason when there is no engine
        return evaluator

    # --- preparation ------------------------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def _tokens_per_ply(self) -> int:
        """A generous token budget per move: twice the longest of a few awkward moves."""
        longest = max(
            len(self.tokenizer(" " + m, add_special_tokens=False)["input_ids"])
            for m in ("a7a8q", "h2h1n", "b1c3", "e2e4")
        )
        return max(8, 2 * longest)

    def _fit(self, prefixes: list[Prefix]) -> list[Prefix]:
        """Shorten prefixes whose prompt and token budget exceed max_seq_length (long games):
        the model never saw a game go on past the block length in training."""
        fitted = []
        for p in prefixes:
            moves, prompt = list(p.moves), p.prompt
            while (
                excess := len(self._encode(prompt)) + self.max_new_tokens - self.max_seq_length
            ) > 0:
                if not moves:
                    raise ValueError(
                        f"The chess evaluation needs {self.max_new_tokens} tokens after a game's "
                        f"header to play {self.plies} plies, more than --max_seq_length "
                        f"{self.max_seq_length} leaves. Raise --max_seq_length or lower "
                        "--chess_eval_plies."
                    )
                moves = moves[: max(0, len(moves) - excess // 2 - 1)]
                prompt = render_prompt(self.template, self.games[p.game], moves)
            fitted.append(dataclasses.replace(p, moves=tuple(moves), prompt=prompt))
        return fitted

    def _mine(self, items: Sequence[Any]) -> list[Any | None]:
        """This rank's share, round-robin, padded with None to the same length on all ranks."""
        per_rank = math.ceil(len(items) / self.world_size)
        mine: list[Any | None] = list(items[self.rank :: self.world_size])
        return mine + [None] * (per_rank - len(mine))

    def _batches(self, items: Sequence[Any]) -> list[list[Any | None]]:
        mine = self._mine(items)
        return [mine[i : i + self.batch_size] for i in range(0, len(mine), self.batch_size)]

    # --- the evaluation ---------------------------------------------------------------

    def run(self, model: nn.Module, *, autocast: Callable[[], Any] | None = None) -> dict[str, Any]:
        """Collective. Returns the metrics (same on every rank), the continuations of this
        rank's first batch ("examples") and, with the engine, every rank's per-move and
        per-game records ("move_records", "game_records", "pgns")."""
        started = time.perf_counter()
        tally = _Tally()
        examples: list[Example] = []
        played: list[Played] = []
        ladder: list[LadderGame] = []
        engine = _EngineRun(self.engine) if self.engine is not None else None
        with contextlib.ExitStack() as stack:
            if engine is not None:
                stack.callback(engine.close)  # every way out of the run ends the engine
                if self.balanced is None:
                    self.balanced = self._select_balanced(engine)
            with no_grad_pass(model):
                for batch in self._batches(self.prefixes):
                    self._play(model, batch, tally, examples, played, autocast)
                for batch in self._batches(self.balanced or []):
                    self._play(model, batch, None, None, played, autocast)
                for batch in self._batches(list(range(len(self.games)))):
                    self._teacher_forced(model, batch, tally, autocast)
                if engine is not None and self.engine is not None and self.engine.ladder:
                    ladder = self._ladder(model, engine, autocast)
            engine_started = time.perf_counter()
            # Each distinct position once (every rank knows every prefix: the same choice).
            judged = distinct_positions([*self.prefixes, *(self.balanced or [])])
            played = [p for p in played if p.prefix.index in judged]
            moves = self._judge(engine, played) if engine is not None else []
            if engine is not None:
                self._judge_ladder(engine, ladder)
            engine_seconds = time.perf_counter() - engine_started
        counts = torch.tensor(
            [tally.counts[k] for k in COUNTS], dtype=torch.float64, device=self.device
        )
        totals = dict(
            zip(COUNTS, (int(v) for v in dist_utils.all_reduce_sum(counts).tolist()), strict=True)
        )
        metrics = self._metrics(totals)
        if engine is not None:
            metrics.update(self._engine_results(engine, moves, ladder, engine_seconds))
        metrics["seconds"] = time.perf_counter() - started
        metrics["examples"] = examples
        return metrics

    def _play(
        self,
        model: nn.Module,
        batch: list[Prefix | None],
        tally: _Tally | None,
        examples: list[Example] | None,
        played: list[Played],
        autocast: Callable[[], Any] | None,
    ) -> None:
        """Continue a batch of prefixes; the referee's verdicts go to `tally` (None: the
        balanced prefixes, which only the engine judges) and every continuation to `played`."""
        real = [p for p in batch if p is not None]
        stand_in = real[0] if real else self.prefixes[0]  # dummy rows repeat a real prompt
        rows = [p or stand_in for p in batch]
        texts = self._continue(
            model, [p.prompt for p in rows], [board_after(p.moves) for p in rows],
            live=[p is not None for p in batch], plies=self.plies,
            seeds=[p.index for p in rows], autocast=autocast,
        )  # fmt: skip
        for b, prefix in enumerate(batch):
            if prefix is None:
                continue
            text = texts[b]
            verdict = judge(board_after(prefix.moves), text, plies=self.plies, finished=True)
            assert verdict is not None
            played.append(Played(prefix, tuple(text.split()), verdict))
            if tally is not None:
                tally.add_verdict(prefix, verdict)
            if examples is not None and not examples:
                examples.append(Example(prefix.phase, prefix.prompt, text, verdict))

    def _continue(
        self,
        model: nn.Module,
        prompt_texts: list[str],
        boards: list[chess.Board],
        *,
        live: list[bool],
        plies: int,
        seeds: list[int],
        autocast: Callable[[], Any] | None,
    ) -> list[str]:
        """The text the model writes after each prompt, until the referee's verdict on
        `plies` plies is known (dead rows, `live` False, stop at once). Collective."""
        prompts = [self._encode(text) for text in prompt_texts]
        decoded = [self._decode(ids) for ids in prompts]

        def continuation(b: int, tokens: list[int]) -> str:
            text = self._decode(prompts[b] + tokens)
            if text.startswith(decoded[b]):
                return text[len(decoded[b]) :]
            return " " + self._decode(tokens)  # the tokenizer re-spelled the prompt

        def is_done(b: int, tokens: list[int]) -> bool:
            if not live[b]:
                return True
            return (
                judge(boards[b], continuation(b, tokens), plies=plies, finished=False) is not None
            )

        generated = continue_prompts(
            model, prompts, pad_token_id=self.pad, eos_token_id=self.eos,
            max_new_tokens=(plies + 1) * self.tokens_per_ply, is_done=is_done,
            device=self.device,
            sampling=Sampling(self.temperature) if self.temperature > 0 else None,
            seeds=seeds, autocast=autocast,
        )  # fmt: skip
        return [continuation(b, g.tokens) for b, g in enumerate(generated)]

    # --- the engine part ----------------------------------------------------------------

    def _select_balanced(self, engine: _EngineRun) -> list[Prefix] | None:
        """Collective: each rank scores its share of the games' candidate positions; the
        balanced prefixes every rank then plays. None (tried again next run) if an engine
        failed."""
        found: dict[int, int] = {}
        if engine.ok:
            assert engine.judge is not None
            judge_ = engine.judge
            try:
                for g in range(self.rank, len(self.games), self.world_size):
                    ply = balanced_ply(
                        self.games[g], g, seed=self.seed,
                        score=lambda moves: judge_board_score(judge_, moves),
                    )  # fmt: skip
                    if ply is not None:
                        found[g] = ply
            except EngineFailed as err:
                engine.fail(err)
        gathered = dist_utils.all_gather_objects((found, engine.error))
        errors = [e for _, e in gathered if e]
        if errors:
            engine.error = engine.error or errors[0]
            return None
        plies = {g: ply for part, _ in gathered for g, ply in part.items()}
        start = len(self.prefixes)
        prefixes = [
            balanced_prefix(self.games, self.template, g, plies[g], start + k)
            for k, g in enumerate(sorted(plies))
        ]
        fits = [p for p in prefixes if self._fits(p.prompt)]
        return fits

    def _fits(self, prompt: str, plies: int | None = None) -> bool:
        budget = ((plies or self.plies) + 1) * self.tokens_per_ply
        return len(self._encode(prompt)) + budget <= self.max_seq_length

    def _judge(self, engine: _EngineRun, played: list[Played]) -> list[dict[str, Any]]:
        """This rank's per-move records (none once its engine has failed)."""
        assert self.engine is not None
        records: list[dict[str, Any]] = []
        if not engine.ok:
            return records
        assert engine.judge is not None
        try:
            for continuation in played:
                records.extend(move_records(engine.judge, continuation, self.engine.judged_plies))
        except EngineFailed as err:
            engine.fail(err)
        return records

    def _ladder(
        self, model: nn.Module, engine: _EngineRun, autocast: Callable[[], Any] | None
    ) -> list[LadderGame]:
        """Collective: this rank's share of the ladder's games, played to their end. Every
        rank runs the same number of generation rounds (dummy rows where it has no game to
        move in)."""
        settings = self.engine
        assert settings is not None
        # Every rank agrees whether to play: an engine that failed before stops the ladder.
        failed = dist_utils.all_reduce_max(torch.tensor([0.0 if engine.ok else 1.0]))
        if failed.item() > 0:
            return []
        schedule = [
            (rung, masked, i)
            for rung in settings.ladder
            for masked in settings.masked_modes
            for i in range(settings.ladder_games)
        ]
        games = [
            LadderGame(i, rung, self.seed, masked=masked)
            for rung, masked, i in schedule[self.rank :: self.world_size]
        ]
        opponents: dict[str, Opponent] = {}
        try:
            while True:
                self._opponents_move(games, opponents, engine)
                todo = [g for g in games if g.model_to_move and not g.masked]
                masked = [g for g in games if g.model_to_move and g.masked]
                work = torch.tensor([float(math.ceil(len(todo) / self.batch_size)), len(masked)])
                rounds, masked_anywhere = dist_utils.all_reduce_max(work).tolist()
                if rounds == 0 and masked_anywhere == 0:
                    break
                for k in range(int(rounds)):
                    self._model_moves(
                        model, todo[k * self.batch_size : (k + 1) * self.batch_size], autocast
                    )
                if masked_anywhere:  # collective: every rank scores, its own games or none
                    self._masked_moves(model, masked, autocast)
        finally:
            for opponent in opponents.values():
                engine.count(opponent.process)
                opponent.close()
        return games

    def _opponents_move(
        self, games: list[LadderGame], opponents: dict[str, Opponent], engine: _EngineRun
    ) -> None:
        """The opponents' replies, and the ends of games (local to this rank)."""
        try:
            for game in games:
                if game.over:
                    continue
                game.check_end()
                if not game.over and not game.model_to_move:
                    if game.rung not in opponents:
                        opponents[game.rung] = Opponent(
                            game.rung, path=self.engine.path if self.engine else None
                        )
                    game.board.push(opponents[game.rung].move(game.board, game.rng))
                    game.check_end()
                if game.over:
                    continue
                prompt = self._ladder_prompt(game)
                if game.board.ply() >= MAX_PLIES or not self._fits(prompt, plies=1):
                    assert engine.judge is not None
                    why = f"{MAX_PLIES} plies" if game.board.ply() >= MAX_PLIES else "context full"
                    game.adjudicate(engine.judge, why)
        except EngineFailed as err:
            engine.fail(err)
            for game in games:
                if not game.over:
                    game.finish("*", "engine failed")

    def _ladder_prompt(self, game: LadderGame) -> str:
        header = {"Result": game.header_result(), "Termination": "CHECKMATE"}
        return render_prompt(self.template, header, [m.uci() for m in game.board.move_stack])

    def _model_moves(
        self, model: nn.Module, batch: list[LadderGame], autocast: Callable[[], Any] | None
    ) -> None:
        """One move of the model in each game of `batch` (may be empty: a dummy row)."""
        rows: list[LadderGame | None] = list(batch) or [None]
        prompts = [self._ladder_prompt(g) if g else self.prefixes[0].prompt for g in rows]
        boards = [g.board if g else board_after(self.prefixes[0].moves) for g in rows]
        seeds = [row_seed(self.seed, g.rung, g.index, g.board.ply()) if g else 0 for g in rows]
        texts = self._continue(
            model, prompts, boards, live=[g is not None for g in rows], plies=1, seeds=seeds,
            autocast=autocast,
        )  # fmt: skip
        for game, text in zip(rows, texts, strict=True):
            if game is None:
                continue
            verdict = judge(game.board, text, plies=1, finished=True)
            assert verdict is not None
            if verdict.failure is not None:
                words = text.split()
                game.forfeit(words[0] if words else "", verdict.failure)
                continue
            game.board.push_uci(text.split()[0])
            game.check_end()

    def _masked_moves(
        self, model: nn.Module, games: list[LadderGame], autocast: Callable[[], Any] | None
    ) -> None:
        """Collective: the model's move in each of `games` (masked; may be none here), chosen
        among the legal moves by the model's own probability of writing each one next (the
        move's tokens after the game so far): the most likely (greedy), or drawn at
        --chess_eval_temperature with a seed per game and ply."""
        prompts, candidates, legal_moves = [], [], []
        for game in games:
            prompt = self._ladder_prompt(game)
            ids = self._encode(prompt)
            legal = sorted(game.board.legal_moves, key=lambda m: m.uci())
            prompts.append(ids)
            candidates.append(self._move_tokens(prompt, ids, [m.uci() for m in legal]))
            legal_moves.append(legal)
        scores = continuation_logprobs(
            model, prompts, candidates, pad_token_id=self.pad, device=self.device,
            batch_size=self.batch_size, autocast=autocast,
        )  # fmt: skip
        for game, legal, logps in zip(games, legal_moves, scores, strict=True):
            values = torch.tensor(logps, dtype=torch.float64)
            if self.temperature > 0:
                seed = row_seed(self.seed, "masked", game.rung, game.index, game.board.ply())
                weights = torch.softmax(values / self.temperature, dim=0)
                pick = int(
                    torch.multinomial(weights, 1, generator=torch.Generator().manual_seed(seed))
                )
            else:
                pick = int(torch.argmax(values))  # the first of equals: moves in UCI order
            # Rounded: a batch of another shape (another process count) moves the last digits.
            game.legal_mass.append(round(float(values.exp().sum()), 4))
            game.board.push(legal[pick])
            game.check_end()

    def _move_tokens(self, prompt: str, prompt_ids: list[int], moves: list[str]) -> list[list[int]]:
        """The tokens the model writes for each of `moves` after `prompt`: as the prompt and
        the move encode together, less the prompt's tokens (apart, where the tokenizer spells
        the prompt differently then). One batched call of the tokenizer."""
        encoded = self.tokenizer([f"{prompt} {move}" for move in moves], add_special_tokens=True)
        tokens = []
        for move, whole in zip(moves, encoded["input_ids"], strict=True):
            if whole[: len(prompt_ids)] == prompt_ids and len(whole) > len(prompt_ids):
                tokens.append(list(whole[len(prompt_ids) :]))
            else:
                apart = self.tokenizer(" " + move, add_special_tokens=False)["input_ids"]
                tokens.append(list(apart))
        return tokens

    def _judge_ladder(self, engine: _EngineRun, games: list[LadderGame]) -> None:
        """The engine judge on the model's moves in this rank's masked games."""
        if not engine.ok:
            return
        assert engine.judge is not None
        try:
            for game in games:
                if game.masked and game.over and game.result != "*":
                    game.judge_moves(engine.judge)
        except EngineFailed as err:
            engine.fail(err)

    def _engine_results(
        self,
        engine: _EngineRun,
        moves: list[dict[str, Any]],
        ladder: list[LadderGame],
        seconds: float,
    ) -> dict[str, Any]:
        """Collective: every rank's records, and the figures computed from them."""
        settings = self.engine
        assert settings is not None
        games = [g for g in ladder if g.over and g.result != "*"]
        mine = (moves, [g.record() for g in games], [g.pgn(model_name="model") for g in games])
        restarts = (engine.all_restarts(), engine.notes)
        gathered = dist_utils.all_gather_objects((mine, engine.error, engine.name, restarts))
        errors = [e for _, e, _, _ in gathered if e]
        moves = sorted(
            (r for (m, _, _), _, _, _ in gathered for r in m),
            key=lambda r: (r["position"], r["ply"]),
        )
        order = {rung: k for k, rung in enumerate(settings.ladder)}
        paired = sorted(
            ((r, p) for (_, g, pg), _, _, _ in gathered for r, p in zip(g, pg, strict=True)),
            key=lambda rp: (order[rp[0]["rung"]], rp[0]["masked"], rp[0]["game"]),
        )
        results: dict[str, Any] = {
            "engine": gathered[0][2],
            "engine_depth": settings.depth,
            "engine_nodes": settings.nodes,
            "engine_error": errors[0] if errors else None,
            # Engines that died or hung and were restarted (the judge's and the opponents'):
            # the figures are the same as without, the notes say what happened.
            "engine_restarts": sum(n for *_, (n, _) in gathered),
            "engine_notes": [note for *_, (_, notes) in gathered for note in notes],
        }
        if errors:  # a failed engine: no figures from half the work
            return results | {"move_records": [], "game_records": [], "pgns": []}
        results.update(engine_metrics(moves))
        results["engine_seconds"] = seconds  # this rank's judging time
        rungs = score_rungs([r for r, _ in paired], list(settings.ladder))
        for rung in rungs:
            results.update(rung.metrics())
        results.update(masked_totals(rungs))
        results["move_records"] = moves
        results["game_records"] = [r for r, _ in paired]
        results["pgns"] = [p for _, p in paired]
        return results

    def _decode(self, ids: Sequence[int]) -> str:
        # Special tokens stay in the text: one written mid-game makes its word unparseable.
        text = self.tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return str(text)

    def _teacher_forced(
        self,
        model: nn.Module,
        batch: list[int | None],
        tally: _Tally,
        autocast: Callable[[], Any] | None,
    ) -> None:
        real = [g for g in batch if g is not None]
        rows = [g if g is not None else (real[0] if real else 0) for g in batch]
        encodings = []
        for row in rows:
            game = self.games[row]
            text = render_row(game, self.template)
            enc = self.tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
            encodings.append(
                (list(enc["input_ids"])[: self.max_seq_length], list(enc["offset_mapping"]))
            )
        hits = top1_hits(
            model, [ids for ids, _ in encodings], pad_token_id=self.pad,
            device=self.device, autocast=autocast,
        )  # fmt: skip
        for b, index in enumerate(batch):
            if index is None:
                continue
            game = self.games[index]
            ids, offsets = encodings[b]
            for start, end in _move_spans(game["Moves"], moves_offset(self.template, game)):
                tokens = [j for j, (a, z) in enumerate(offsets) if a < end and z > start and z > a]
                if not tokens or tokens[-1] >= len(ids) or tokens[0] == 0:
                    continue  # cut off by max_seq_length (or no token of its own)
                tally.counts["tf_moves"] += 1
                tally.counts["tf_correct"] += all(hits[b][j] for j in tokens)

    def _metrics(self, t: dict[str, int]) -> dict[str, Any]:
        def rate(num: int, den: int) -> float | None:
            return num / den if den else None

        metrics: dict[str, Any] = {
            "legal_move_rate": rate(t["legal_plies"], t["moves_judged"]),
            "mean_legal_plies": rate(t["legal_plies"], t["continuations"]),
            "full_length_share": rate(t["full_length"], t["continuations"]),
            "next_move_accuracy": rate(t["tf_correct"], t["tf_moves"]),
            "result_match_rate": rate(t["result_matched"], t["result_checked"]),
        }
        for phase in PHASES:
            metrics[f"legal_move_rate_{phase}"] = rate(
                t[f"{phase}_legal_plies"], t[f"{phase}_moves_judged"]
            )
        metrics.update(
            games=len(self.games),
            continuations=t["continuations"],
            plies=self.plies,
            moves_judged=t["moves_judged"],
            illegal_moves=t["moves_judged"] - t["legal_plies"],
            games_ended=t["ended"],
            results_checked=t["result_checked"],
            results_matched=t["result_matched"],
            next_move_total=t["tf_moves"],
            temperature=self.temperature,
            **{f"illegal_{kind}": t[f"fail_{kind}"] for kind in FAILURES},
        )
        return metrics


def _move_spans(moves: Sequence[str], offset: int) -> list[tuple[int, int]]:
    """Character spans of the moves in the rendered text (moves joined by single spaces)."""
    spans = []
    for move in moves:
        spans.append((offset, offset + len(move)))
        offset += len(move) + 1
    return spans


def format_table(metrics: dict[str, Any], *, step: int | None) -> str:
    """The log's small table."""

    m = metrics
    sampling = "greedy" if not m["temperature"] else f"temperature {m['temperature']:g}"
    where = f"step {step}" if step is not None else "standalone"
    phases = ", ".join(f"{p} {pct(m[f'legal_move_rate_{p}'])}" for p in PHASES)
    lines = [
        f"chess eval {where}: {m['games']} held-out games x {len(PHASES)} prefixes, up to "
        f"{m['plies']} plies each ({sampling}), {m['seconds']:.1f}s",
        f"  legal-move rate        {pct(m['legal_move_rate']):>7}  ({phases})",
        f"  plies to 1st illegal   {m['mean_legal_plies'] or 0:>7.2f}  mean; "
        f"{pct(m['full_length_share'])} of continuations reach {m['plies']} legal plies or a legal end",
        f"  next-move accuracy     {pct(m['next_move_accuracy']):>7}  teacher-forced top-1 over "
        f"{m['next_move_total']:,} moves",
    ]
    if m["results_checked"]:
        lines.append(
            f"  result as in header    {m['results_matched']:>3} of {m['results_checked']} games the model ended"
        )
    kinds = ", ".join(f"{m[f'illegal_{k}']} {k.replace('_', ' ')}" for k in FAILURES)
    lines.append(f"  illegal moves          {m['illegal_moves']:>7}  ({kinds})")
    lines.extend(engine_lines(m))
    examples = m.get("examples") or []
    if examples:
        lines.append(f"  example ({examples[0].phase}): {examples[0].describe()}")
    return "\n".join(lines)


def engine_lines(m: dict[str, Any]) -> list[str]:
    """The engine judge's lines of the table (none without an engine)."""
    if "engine" not in m:
        return []
    limit = f"depth {m['engine_depth']}" if m["engine_depth"] else f"{m['engine_nodes']} nodes"
    if m.get("engine_error"):
        return [f"  engine judge           FAILED ({m['engine']}, {limit}): {m['engine_error']}"]

    def num(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    def se(key: str, fmt: str) -> str:
        return f"{num(m[key], fmt)} ± {num(m[key + '_se'], fmt)}"

    judged = m["engine_moves"] + m["engine_illegal"]
    spread = ", ".join(
        f"{p} {m[f'engine_moves_{p}'] + m[f'engine_illegal_{p}']}"
        for p in FIGURE_PHASES
        if m[f"engine_moves_{p}"] + m[f"engine_illegal_{p}"]
    )
    phases = ", ".join(
        f"{p} {num(m[f'engine_centipawn_loss_{p}'], '.0f')}"
        for p in FIGURE_PHASES
        if m[f"engine_moves_{p}"]
    )
    lines = [
        f"  engine judge           {m['engine']}, {limit}: {judged} moves from "
        f"{m['engine_positions']} distinct positions ({spread}), {m['engine_seconds']:.1f}s",
        f"  strength, every move   centipawn loss {se('engine_all_centipawn_loss', '.0f')}, "
        f"accuracy {se('engine_all_accuracy', '.1f')}%: {judged} moves, the "
        f"{m['engine_illegal']} illegal ones scored as the worst move ({CP_CEILING} cp, "
        "accuracy 0)",
        f"  legal moves only       centipawn loss {se('engine_centipawn_loss', '.0f')}, "
        f"accuracy {se('engine_accuracy', '.1f')}%: {m['engine_moves']} moves"
        + (f" ({phases})" if phases else ""),
        f"                         best move {pct(m['engine_best_move_rate'])}; inaccuracies "
        f"{pct(m['engine_inaccuracy_rate'])}, mistakes {pct(m['engine_mistake_rate'])}, "
        f"blunders {pct(m['engine_blunder_rate'])}",
    ]
    if m.get("engine_restarts"):
        notes = m.get("engine_notes") or []
        lines.append(
            f"  engine restarts        {m['engine_restarts']} (an engine died or hung, was "
            "restarted and asked again: the figures are as without)"
            + (f"; the first: {notes[0]}" if notes else "")
        )
    rungs = [
        k.removesuffix("_games").removeprefix("ladder_")
        for k in m
        if k.startswith("ladder_") and k.endswith("_games")
    ]
    for record_rung in rungs:
        lines.append(ladder_line(m, record_rung))
    if m.get("ladder_masked_moves_judged"):
        lines.append(
            f"  masked games           its moves: centipawn loss "
            f"{se('ladder_masked_centipawn_loss', '.0f')}, accuracy "
            f"{se('ladder_masked_accuracy', '.1f')}% ({m['ladder_masked_moves_judged']} moves "
            f"judged); the model's probability on the legal moves "
            f"{pct(m['ladder_masked_legal_mass'])} (unmasked results stay in the rows above "
            "without 'masked')"
        )
    return lines


def write_records(folder: Path, metrics: dict[str, Any], *, step: int | None) -> list[Path]:
    """The records beside the summary, for anyone to audit: `moves.jsonl` (one judged move a
    line), `games.jsonl` and `games.pgn` (the ladder's games), `summary.json` (the figures).
    Written whole or not at all: nothing without the engine part or when the engine failed
    (the records of an earlier evaluation in `folder` stay as they were), and the four files
    replace the folder's together (`folder_written_atomically`), so a reader never finds one
    evaluation's moves beside another's games. Returns the files written."""
    if "move_records" not in metrics or metrics.get("engine_error"):
        return []
    summary = log_record(metrics, step=step if step is not None else 0)
    if step is None:
        summary.pop("step")
    files = {
        "moves.jsonl": "".join(json.dumps(r) + "\n" for r in metrics["move_records"]),
        "games.jsonl": "".join(json.dumps(r) + "\n" for r in metrics["game_records"]),
        "games.pgn": "\n\n".join(metrics["pgns"]) + ("\n" if metrics["pgns"] else ""),
        "summary.json": json.dumps(summary, indent=2) + "\n",
    }
    with folder_written_atomically(folder) as tmp:
        for name, text in files.items():
            write_text_atomic(tmp / name, text)
    return [folder / name for name in files]


def log_record(metrics: dict[str, Any], *, step: int) -> dict[str, Any]:
    """The flat fields of a `kind: chess_eval` record in metrics.jsonl (no per-move records)."""
    return {k: v for k, v in metrics.items() if k not in RECORDS} | {"step": step}
