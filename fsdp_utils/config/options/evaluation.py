"""Evaluation during and after training: the held-out loss, lm-eval benchmarks, the chess
evaluation, answers to sample prompts."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from .section import Section, check_at_least

SECTION = Section("evaluation", "evaluation")
_opt = SECTION.option
# lm-eval's options for --eval_tasks (their reading: fsdp_utils/lm_harness/scoring.py).
EVAL_SCORING_FIELDS = (
    "eval_apply_chat_template",
    "eval_fewshot_as_multiturn",
    "eval_system_instruction",
    "eval_gen_kwargs",
    "eval_seed",
)


EngineUse = Literal["auto", "on", "off"]

Masking = Literal["off", "on", "both"]


def engine_choice(options: EvaluationOptions) -> str:
    """What `--chess_engine` asks for, with its old spelling folded in: "auto", "on", "off" or
    a path (a run's config.json from before has `chess_engine: null`, which is auto)."""
    given = options.chess_engine if options.chess_engine not in (None, "") else "auto"
    old = options.chess_eval_engine
    if old == "off" or (old is not None and given == "auto"):
        return old  # off wins over a path, as it did; on or auto where the new flag is auto
    return given


# A rung of the ladder of opponents (fsdp_utils/chess_eval/ladder.py): a random mover, or
# Stockfish at a depth, a node limit, a Skill Level (0-20) or a UCI_Elo (1350-2850 in 15.1).
LADDER_RUNG = re.compile(r"random|(depth|nodes|skill|elo):(\d+)")


def ladder_rungs(text: str | None) -> list[str]:
    """`--chess_eval_ladder`'s rungs, checked: a ValueError names the one that is not a rung."""
    rungs = [word.strip() for word in (text or "").split(",") if word.strip()]
    for rung in rungs:
        match = LADDER_RUNG.fullmatch(rung)
        if match is None:
            raise ValueError(
                f"--chess_eval_ladder: {rung!r} is not an opponent. Rungs are random, depth:N, "
                "nodes:N, skill:N (Stockfish's Skill Level, 0-20) and elo:N (UCI_Elo, 1350 "
                "or more), comma-separated, e.g. random,depth:1,skill:0,elo:1350."
            )
        if match.group(1) == "skill" and int(match.group(2)) > 20:
            raise ValueError(f"--chess_eval_ladder: {rung}: Skill Level goes from 0 to 20.")
        if match.group(1) in ("depth", "nodes") and int(match.group(2)) < 1:
            raise ValueError(f"--chess_eval_ladder: {rung}: a limit of at least 1.")
    return rungs


def bool_text(text: str) -> bool:
    """A flag's optional true/false value (lm-eval's reading: true, 1 or yes is true)."""
    return text.strip().lower() in ("true", "1", "yes")


def bool_or_name(text: str) -> bool | str:
    """true/false as such, any other word as a name (`--eval_apply_chat_template [NAME]`)."""
    word = text.strip().lower()
    if word in ("true", "1", "yes", "false", "0", "no"):
        return bool_text(word)
    return text


# Held out by default: right for the chess games and most published sets; a set too small for
# it (under 2 x 200 rows) holds out a tenth instead (`fsdp_utils.data.prepare.eval_count`).
DEFAULT_EVAL_EXAMPLES = 200


@dataclass
class EvaluationOptions:
    eval_examples: int = field(
        default=DEFAULT_EVAL_EXAMPLES,
        metadata=_opt(
            "Documents held out for evaluation (0: no eval split). The default holds out a "
            f"tenth of a set under {2 * DEFAULT_EVAL_EXAMPLES} documents, where "
            f"{DEFAULT_EVAL_EXAMPLES} would leave fewer to train on; the log says how many."
        ),
    )
    eval_every: int = field(
        default=50,
        metadata=_opt("Evaluate every N optimizer steps and at the end (0: end only)."),
    )
    eval_batches: int = field(
        default=20,
        metadata=_opt("At most this many batches per device per evaluation."),
    )
    eval_tasks: str | None = field(
        default=None,
        metadata=_opt(
            "lm-eval benchmarks to score the final model on at the end of the run, e.g. "
            "arc_easy,hellaswag (their data cached with download_models.py --eval_tasks); "
            "results in <output_dir>/lm_eval/.",
            joined=True,
        ),
    )
    eval_limit: int | None = field(
        default=None,
        metadata=_opt("With --eval_tasks: at most N documents per task."),
    )
    # --- --eval_tasks: lm-eval's prompt and generation options, its names with eval_ before
    # them (fsdp_utils/lm_harness/scoring.py reads them; docs/evaluate.md) ------------------
    eval_apply_chat_template: bool | str | None = field(
        default=None,
        metadata=_opt(
            "With --eval_tasks: lm-eval's --apply_chat_template [TEMPLATE_NAME], the prompts "
            "written through the final model's chat template. Default: on when the run "
            "trained on chat data (rows rendered with a chat template), else off; false: off.",
            cli={"nargs": "?", "const": True, "type": bool_or_name, "metavar": "TEMPLATE_NAME"},
        ),
    )
    eval_fewshot_as_multiturn: bool | None = field(
        default=None,
        metadata=_opt(
            "With --eval_tasks: lm-eval's --fewshot_as_multiturn [BOOL], the few-shot examples "
            "as chat turns (default: on with the chat template, which it needs).",
            cli={"nargs": "?", "const": True, "type": bool_text, "metavar": "BOOL"},
        ),
    )
    eval_system_instruction: str | None = field(
        default=None,
        metadata=_opt(
            "With --eval_tasks: lm-eval's --system_instruction, a system message before every "
            "prompt."
        ),
    )
    eval_gen_kwargs: str | None = field(
        default=None,
        metadata=_opt(
            "With --eval_tasks: lm-eval's --gen_kwargs for every generation task, e.g. "
            "do_sample=True,temperature=0.7,top_p=0.95 (do_sample, temperature, top_p, top_k, "
            "until, max_gen_toks).",
            joined=True,
        ),
    )
    eval_seed: int | str | None = field(
        default=None,
        metadata=_opt(
            "With --eval_tasks: lm-eval's --seed, one number or python,numpy,torch,few-shot "
            "seeds (default 0,1234,1234,1234); the torch seed seeds sampling.",
            cli={"type": str, "metavar": "N|A,B,C,D"},
        ),
    )
    chess_eval_every: int = field(
        default=0,
        metadata=_opt(
            "Run the chess evaluation (legal-move rate, next-move accuracy) on held-out games "
            "every N optimizer steps and at the end (0: off)."
        ),
    )
    chess_eval_games: int = field(
        default=32,
        metadata=_opt("Held-out games per chess evaluation (3 continuations each)."),
    )
    chess_eval_plies: int = field(
        default=10,
        metadata=_opt("K: plies the model plays on from each game prefix."),
    )
    chess_eval_temperature: float = field(
        default=0.0,
        metadata=_opt("Sampling temperature of the chess evaluation (0: greedy)."),
    )
    chess_eval_batch_size: int | None = field(
        default=None,
        metadata=_opt("Sequences per forward pass in the chess evaluation (default: 8)."),
    )
    chess_engine: str | None = field(
        default="auto",
        metadata=_opt(
            "The chess engine (Stockfish) of the engine judge (centipawn loss, Lichess accuracy, "
            "best-move rate, games against --chess_eval_ladder) and of GRPO's chess_engine "
            "reward: auto (the first found: $FSDP_UTILS_STOCKFISH, `stockfish` on PATH, "
            "/usr/games/stockfish; none found: the chess evaluation shows legality only), on "
            "(the same, but required), off, or PATH (this binary, required: one that is not a "
            "working UCI engine stops the run before any work).",
            cli={"metavar": "auto|on|off|PATH"},
        ),
    )
    chess_eval_engine: EngineUse | None = field(
        default=None,
        metadata=_opt(
            "The old spelling of --chess_engine auto|on|off, still read (off wins over a "
            "--chess_engine PATH, as it did)."
        ),
    )
    chess_eval_depth: int = field(
        default=10,
        metadata=_opt("The engine judge's search depth per position (fixed: reproducible)."),
    )
    chess_eval_nodes: int | None = field(
        default=None,
        metadata=_opt("A node limit per position for the engine judge instead of the depth."),
    )
    chess_eval_judged_plies: int = field(
        default=1,
        metadata=_opt(
            "Moves of each continuation the engine judges: its first N legal moves (at most "
            "--chess_eval_plies)."
        ),
    )
    chess_eval_ladder: str | None = field(
        default=None,
        metadata=_opt(
            "Opponents the model plays games against, weakest first, comma-separated: random, "
            "depth:N, nodes:N, skill:N, elo:N (e.g. random,depth:1,skill:0,elo:1350).",
            cli={"metavar": "RUNGS"},
            joined=True,
        ),
    )
    chess_eval_ladder_games: int = field(
        default=8,
        metadata=_opt("Games against each rung of --chess_eval_ladder (colours alternate)."),
    )
    chess_eval_masking: Masking = field(
        default="off",
        metadata=_opt(
            "The ladder's games with the model's moves masked to the legal ones (each move "
            "chosen among the legal moves by the model's own probabilities, as DeepMind's "
            "searchless-chess evaluation plays): off (unmasked only: an illegal move loses), on "
            "(masked only), both (each rung's games played both ways, reported apart: "
            "ladder_<rung>_* and ladder_masked_<rung>_*)."
        ),
    )
    sample_prompts: str | None = field(
        default=None,
        metadata=_opt(
            "A jsonl file of prompts (chat `messages`, or a `prompt` string): at every evaluation "
            "the model answers each greedily, under FSDP, into output_dir/samples.jsonl and the "
            "log."
        ),
    )
    sample_max_new_tokens: int = field(
        default=64,
        metadata=_opt(
            "At most this many tokens per --sample_prompts answer (it ends earlier at EOS or the "
            "end-of-turn token)."
        ),
    )


def check(options: EvaluationOptions) -> None:
    check_at_least(options, ("sample_max_new_tokens",))
    if options.chess_eval_engine == "on" and options.chess_engine == "off":
        raise ValueError(
            "--chess_eval_engine on and --chess_engine off disagree: give "
            "--chess_engine alone (auto, on, off or the engine's path); --chess_eval_engine is "
            "its old spelling."
        )
    if options.eval_limit is not None and not options.eval_tasks:
        raise ValueError("--eval_limit limits --eval_tasks: give --eval_tasks too.")
    for name in EVAL_SCORING_FIELDS:
        if getattr(options, name) is not None and not options.eval_tasks:
            raise ValueError(f"--{name} says how --eval_tasks scores: give --eval_tasks too.")
    check_at_least(options, ("eval_limit",))
    if options.chess_eval_plies < 1:
        raise ValueError(
            f"--chess_eval_plies (K, the plies each continuation is judged for) must be at "
            f"least 1, got {options.chess_eval_plies}."
        )
    check_at_least(options, ("chess_eval_every",), least=0)
    check_at_least(options, ("chess_eval_games", "chess_eval_batch_size"))
    check_at_least(options, ("chess_eval_depth", "chess_eval_nodes", "chess_eval_judged_plies"))
    check_at_least(options, ("chess_eval_ladder_games",), least=2)
    if options.chess_eval_judged_plies > options.chess_eval_plies:
        raise ValueError(
            f"--chess_eval_judged_plies {options.chess_eval_judged_plies} is more than the "
            f"{options.chess_eval_plies} plies each continuation has (--chess_eval_plies)."
        )
    ladder_rungs(options.chess_eval_ladder)
    if options.chess_eval_temperature < 0:
        raise ValueError(
            "--chess_eval_temperature must be >= 0 (0: greedy), got "
            f"{options.chess_eval_temperature}."
        )
