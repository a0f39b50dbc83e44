"""The chess evaluator: held-out game prefixes -> the model plays on -> the referee's counts.

Built once and run like torchtitan's Validator: `ChessEvaluator.from_config(...)` loads the
games and the tokenizer; `run(model, step=...)` is collective under torchrun. The prefixes and
the games are dealt round-robin to the ranks and padded with dummy rows, so every rank runs
the same number of batches and forward passes; each rank counts only its real rows and one
all-reduce of the integer counts gives every rank the same totals, whatever the world size.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_utils.chess_eval.games import PHASES, Prefix, make_prefixes, moves_offset, render_prompt
from fsdp_utils.chess_eval.referee import FAILURES, Verdict, board_after, judge
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.render import render_row
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.generate import Sampling, continue_prompts, top1_hits
from fsdp_utils.parallel.parallelize import no_grad_pass

DEFAULT_BATCH_SIZE = 8

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
    ) -> None:
        if not games:
            raise ValueError(
                "The chess evaluation found no held-out games: the eval split is empty. Hold "
                "some out with --eval_examples (e.g. --eval_examples 200)."
            )
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
        self.prefixes = self._fit(make_prefixes(self.games, template, plies=plies, seed=seed))

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
        return cls(
            games,
            tokenizer,
            template=config.template,
            plies=config.chess_eval_plies,
            max_seq_length=config.max_seq_length,
            seed=config.seed,
            temperature=config.chess_eval_temperature,
            batch_size=config.chess_eval_batch_size or DEFAULT_BATCH_SIZE,
            rank=rank,
            world_size=world_size,
            device=device,
        )

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
        """Collective. Returns the metrics (same on every rank) and, under "examples", the
        continuations of this rank's first batch."""
        started = time.perf_counter()
        tally = _Tally()
        examples: list[Example] = []
        with no_grad_pass(model):
            for batch in self._batches(self.prefixes):
                self._play(model, batch, tally, examples, autocast)
            for batch in self._batches(list(range(len(self.games)))):
                self._teacher_forced(model, batch, tally, autocast)
        counts = torch.tensor(
            [tally.counts[k] for k in COUNTS], dtype=torch.float64, device=self.device
        )
        totals = dict(
            zip(COUNTS, (int(v) for v in dist_utils.all_reduce_sum(counts).tolist()), strict=True)
        )
        metrics = self._metrics(totals)
        metrics["seconds"] = time.perf_counter() - started
        metrics["examples"] = examples
        return metrics

    def _play(
        self,
        model: nn.Module,
        batch: list[Prefix | None],
        tally: _Tally,
        examples: list[Example],
        autocast: Callable[[], Any] | None,
    ) -> None:
        real = [p for p in batch if p is not None]
        stand_in = real[0] if real else self.prefixes[0]  # dummy rows repeat a real prompt
        rows = [p or stand_in for p in batch]
        boards = [board_after(p.moves) for p in rows]
        prompts = [self._encode(p.prompt) for p in rows]
        prompt_texts = [self._decode(ids) for ids in prompts]

        def continuation(b: int, tokens: list[int]) -> str:
            text = self._decode(prompts[b] + tokens)
            if text.startswith(prompt_texts[b]):
                return text[len(prompt_texts[b]) :]
            return " " + self._decode(tokens)  # the tokenizer re-spelled the prompt

        def is_done(b: int, tokens: list[int]) -> bool:
            if batch[b] is None:
                return True
            return (
                judge(boards[b], continuation(b, tokens), plies=self.plies, finished=False)
                is not None
            )

        generated = continue_prompts(
            model, prompts, pad_token_id=self.pad, eos_token_id=self.eos,
            max_new_tokens=self.max_new_tokens, is_done=is_done, device=self.device,
            sampling=Sampling(self.temperature) if self.temperature > 0 else None,
            seeds=[p.index for p in rows], autocast=autocast,
        )  # fmt: skip
        for b, prefix in enumerate(batch):
            if prefix is None:
                continue
            text = continuation(b, generated[b].tokens)
            verdict = judge(boards[b], text, plies=self.plies, finished=True)
            assert verdict is not None
            tally.add_verdict(prefix, verdict)
            if not examples:
                examples.append(Example(prefix.phase, prefix.prompt, text, verdict))

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

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.1f}%"

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
    examples = m.get("examples") or []
    if examples:
        lines.append(f"  example ({examples[0].phase}): {examples[0].describe()}")
    return "\n".join(lines)


def log_record(metrics: dict[str, Any], *, step: int) -> dict[str, Any]:
    """The flat numeric fields of a `kind: chess_eval` record in metrics.jsonl."""
    return {k: v for k, v in metrics.items() if k != "examples"} | {"step": step}
