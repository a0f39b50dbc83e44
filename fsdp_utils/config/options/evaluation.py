"""Evaluation during and after training: the held-out loss, lm-eval benchmarks, the chess
evaluation, answers to sample prompts."""

from __future__ import annotations

from dataclasses import dataclass, field

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
            "results in <output_dir>/lm_eval/."
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
            "until, max_gen_toks)."
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
    if options.chess_eval_temperature < 0:
        raise ValueError(
            "--chess_eval_temperature must be >= 0 (0: greedy), got "
            f"{options.chess_eval_temperature}."
        )
