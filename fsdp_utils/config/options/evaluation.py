"""Evaluation during and after training: the held-out loss, lm-eval benchmarks, the chess
evaluation, answers to sample prompts."""

from __future__ import annotations

from dataclasses import dataclass, field

from .section import Section, check_at_least

SECTION = Section("evaluation", "evaluation")
_opt = SECTION.option


@dataclass
class EvaluationOptions:
    eval_examples: int = field(
        default=200,
        metadata=_opt("Documents held out for evaluation (0: no eval split)."),
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
            "results in <output_dir>/lm_eval/."
        ),
    )
    eval_limit: int | None = field(
        default=None,
        metadata=_opt("With --eval_tasks: at most N documents per task."),
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
    if options.eval_limit is not None and not options.eval_tasks:
        raise ValueError("--eval_limit limits --eval_tasks: give --eval_tasks too.")
    check_at_least(options, ("eval_limit",))
    if options.chess_eval_plies < 1:
        raise ValueError(
            f"--chess_eval_plies (K, the plies each continuation is judged for) must be at "
            f"least 1, got {options.chess_eval_plies}."
        )
    check_at_least(options, ("chess_eval_every",), least=0)
    check_at_least(options, ("chess_eval_games", "chess_eval_batch_size"))
    if options.chess_eval_temperature < 0:
        raise ValueError(
            "--chess_eval_temperature must be >= 0 (0: greedy), got "
            f"{options.chess_eval_temperature}."
        )
