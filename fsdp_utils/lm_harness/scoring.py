"""How a model is scored: lm-eval's own options for the prompts and the answers, with its names
and meanings (lm_eval/_cli/run.py, lm_eval/config/evaluate_config.py, 0.4.13).

    --apply_chat_template [NAME]  write each prompt through the model's chat template (NAME: one
                                  of a tokenizer's several named templates)
    --fewshot_as_multiturn [B]    the few-shot examples as user/assistant turns, not one user
                                  message (default: on with a chat template; on without one is
                                  an error)
    --system_instruction TEXT     a system message before the prompt
    --gen_kwargs K=V,...          generation settings for every generation task (over the
                                  task's own): do_sample, temperature, top_p, top_k, until,
                                  max_gen_toks
    --seed N | A,B,C,D            the python, numpy, torch and few-shot seeds (one number: all
                                  four; default 0,1234,1234,1234)

Sampling draws from the torch seed as HFLM's does (transformers' `generate` samples from torch's
global generator, which lm-eval seeds with it), but reproducibly on any number of processes:
each request draws from a generator of its own, seeded by the torch seed and what names the
request (its task, document, answer and repeat: `fsdp_utils.parallel.generate.row_seed`), so
its text is the same on one process or eight, in any batch, beside any other tasks.

What a results file says about the way it was scored is lm-eval's own record, the keys its
command writes at the top of every results file (`chat_template`, `chat_template_sha`,
`fewshot_as_multiturn`, `system_instruction`, `system_instruction_sha`): `Scoring.record` writes
them, `ScoredWay.of` reads them back (from any lm-eval results file; a file without them was
scored as plain text).
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from typing import Any

from fsdp_utils.config.options.evaluation import bool_or_name, bool_text

# lm-eval is imported where it is used: this module is read by the training command's
# preflight and by `python -m fsdp_utils.evaluate` before it has set the offline variables.

DEFAULT_SEED = "0,1234,1234,1234"  # lm-eval's: python, numpy, torch, few-shot
Seeds = tuple[int | None, int | None, int | None, int | None]
# What the generation path does with a task's or the user's generation settings; the rest
# (beam search, repetition penalties, ...) is refused by name rather than silently ignored.
GEN_KWARGS = frozenset(
    {"until", "max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens"}
    | {"do_sample", "temperature", "top_p", "top_k", "num_beams"}
)


def parse_seed(text: str) -> Seeds:
    """lm-eval's `--seed`: one number for all four seeds, or four (three: the fourth is
    1234), `None` leaving one unset. ValueError on anything else."""
    from lm_eval._cli.utils import _int_or_none_list_arg_type

    try:
        values = _int_or_none_list_arg_type(3, 4, DEFAULT_SEED, str(text))
    except ValueError as err:
        raise ValueError(
            f"--seed {text}: {err}. Give one number (all four seeds) or four, for python, numpy, "
            f"torch and the few-shot examples, e.g. --seed 42 or --seed {DEFAULT_SEED}."
        ) from None
    return (values[0], values[1], values[2], values[3])


def parse_gen_kwargs(text: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """lm-eval's `--gen_kwargs`: `K=V,K2=V2` (values read as Python literals: True, 0.7,
    ["\\n"]) or a dict already. None when empty. ValueError naming what the generation path
    cannot do."""
    if text is None or text == "":
        return None
    from lm_eval._cli.utils import key_val_to_dict

    try:
        values = dict(text) if isinstance(text, dict) else key_val_to_dict(text)
    except ValueError as err:
        raise ValueError(
            f"--gen_kwargs {text}: {err}. Give key=value pairs separated by commas, e.g. "
            "--gen_kwargs do_sample=True,temperature=0.7,top_p=0.95,max_gen_toks=256."
        ) from None
    check_gen_kwargs(values, where=f"--gen_kwargs {text}")
    return values or None


def hash_string(text: str) -> str:
    """lm-eval's fingerprint of a template or instruction (lm_eval.utils.hash_string)."""
    from lm_eval.utils import hash_string as lm_eval_hash

    return str(lm_eval_hash(text))


def check_gen_kwargs(values: dict[str, Any], *, where: str) -> None:
    unknown = sorted(set(values) - GEN_KWARGS)
    if unknown:
        raise ValueError(
            f"{where}: {', '.join(unknown)} cannot be honoured here: this evaluation decodes "
            "with a KV cache across the ranks, greedy or sampled, and reads only "
            f"{', '.join(sorted(GEN_KWARGS))}. Drop them, or run the task with lm-eval's own "
            "HFLM."
        )
    if int(values.get("num_beams", 1) or 1) != 1:
        raise ValueError(
            f"{where}: num_beams={values['num_beams']}: beam search is not done here (greedy or "
            "sampled decoding only). Drop num_beams, or run the task with lm-eval's own HFLM."
        )
    if values.get("do_sample") and not float(values.get("temperature") or 0.0) > 0:
        raise ValueError(
            f"{where}: do_sample=True needs a temperature above 0 (as HFLM, whose transformers "
            "refuses a temperature of 0 when sampling): add one, e.g. temperature=0.7."
        )


def parse_apply_chat_template(value: bool | str | None) -> bool | str:
    """lm-eval's `--apply_chat_template [NAME]`: True (the flag alone), a template's name, or
    False; the words true/false are read as such (a YAML file may say either)."""
    if value is None or isinstance(value, bool):
        return bool(value)
    return bool_or_name(value) if value.strip() else True


def add_scoring_arguments(parser: argparse.ArgumentParser) -> None:
    """lm-eval's five options, spelled and read as its command reads them."""
    from lm_eval._cli.utils import MergeDictAction

    group = parser.add_argument_group("prompts and generation (lm-eval's options)")
    group.add_argument(
        "--apply_chat_template",
        nargs="?",
        const=True,
        default=False,
        metavar="TEMPLATE_NAME",
        help="write the prompts through the model's chat template (its tokenizer's; a name "
        "picks one of several)",
    )
    group.add_argument(
        "--fewshot_as_multiturn",
        type=bool_text,
        nargs="?",
        const=True,
        default=None,
        metavar="BOOL",
        help="few-shot examples as user/assistant turns (default: on with "
        "--apply_chat_template, which it needs)",
    )
    group.add_argument(
        "--system_instruction", metavar="TEXT", help="a system message before every prompt"
    )
    group.add_argument(
        "--gen_kwargs",
        nargs="+",
        action=MergeDictAction,
        default=None,
        metavar="K=V,...",
        help="generation settings for every generation task, over the task's own: do_sample, "
        "temperature, top_p, top_k, until, max_gen_toks (e.g. do_sample=True,temperature=0.7)",
    )
    group.add_argument(
        "--seed",
        default=DEFAULT_SEED,
        metavar="N|A,B,C,D",
        help="seeds for python, numpy, torch (sampling) and the few-shot examples; one number "
        f"for all four (default {DEFAULT_SEED})",
    )


@dataclass(frozen=True)
class Scoring:
    """The options resolved by lm-eval's rules."""

    apply_chat_template: bool | str = False
    fewshot_as_multiturn: bool = False
    system_instruction: str | None = None
    gen_kwargs: dict[str, Any] | None = None
    seeds: Seeds = (0, 1234, 1234, 1234)

    @classmethod
    def resolve(
        cls,
        *,
        apply_chat_template: bool | str | None = False,
        fewshot_as_multiturn: bool | None = None,
        system_instruction: str | None = None,
        gen_kwargs: str | dict[str, Any] | None = None,
        seed: str | None = DEFAULT_SEED,
    ) -> Scoring:
        """lm-eval's rules (EvaluatorConfig._validate_arguments): few-shot as multi-turn
        follows the chat template unless said; said without a template, it is an error."""
        template = parse_apply_chat_template(apply_chat_template)
        if fewshot_as_multiturn and not template:
            raise ValueError(
                "--fewshot_as_multiturn writes the few-shot examples as chat turns, which needs "
                "the chat template: add --apply_chat_template, or drop --fewshot_as_multiturn."
            )
        multiturn = bool(template) if fewshot_as_multiturn is None else fewshot_as_multiturn
        seeds = parse_seed(seed) if seed is not None else parse_seed(DEFAULT_SEED)
        return cls(
            template, multiturn, system_instruction or None, parse_gen_kwargs(gen_kwargs), seeds
        )

    @property
    def template_name(self) -> str | None:
        return self.apply_chat_template if isinstance(self.apply_chat_template, str) else None

    @property
    def sampling_seed(self) -> int | None:
        """The torch seed: what sampling draws from (None: not seeded)."""
        return self.seeds[2]

    def evaluate_kwargs(self) -> dict[str, Any]:
        """These options as `lm_eval.simple_evaluate` takes them."""
        return {
            "apply_chat_template": self.apply_chat_template,
            "fewshot_as_multiturn": self.fewshot_as_multiturn,
            "system_instruction": self.system_instruction,
            "gen_kwargs": self.gen_kwargs,
            "random_seed": self.seeds[0],
            "numpy_random_seed": self.seeds[1],
            "torch_random_seed": self.seeds[2],
            "fewshot_random_seed": self.seeds[3],
        }

    def record(self, chat_template: str | None) -> dict[str, Any]:
        """lm-eval's record of the prompt format, under the keys its command writes at the top
        of a results file; `chat_template`: the template's text (`LM.chat_template`)."""
        system = self.system_instruction
        return {
            "chat_template": chat_template if self.apply_chat_template else None,
            "chat_template_sha": hash_string(chat_template)
            if self.apply_chat_template and chat_template
            else None,
            "fewshot_as_multiturn": self.fewshot_as_multiturn,
            "system_instruction": system,
            "system_instruction_sha": hash_string(system) if system else None,
        }

    @property
    def way(self) -> ScoredWay:
        system = self.system_instruction
        return ScoredWay(
            bool(self.apply_chat_template),
            self.fewshot_as_multiturn and bool(self.apply_chat_template),
            system,
            hash_string(system) if system else None,
        )


@dataclass(frozen=True)
class ScoredWay:
    """How a results file's prompts were written, as far as it changes the scores: with the
    chat template or as plain text, few-shot examples as turns or not, which system message.
    Which template is not part of it: each model is scored with its own."""

    chat_template: bool
    fewshot_as_multiturn: bool
    system_instruction: str | None
    system_instruction_sha: str | None

    @classmethod
    def of(cls, results: dict[str, Any]) -> ScoredWay:
        """From lm-eval's keys in a results file (absent: plain text, as before lm-eval
        recorded them and as `simple_evaluate` alone writes them)."""
        templated = bool(results.get("chat_template"))
        system = results.get("system_instruction")
        sha = results.get("system_instruction_sha") or (hash_string(system) if system else None)
        return cls(templated, templated and bool(results.get("fewshot_as_multiturn")), system, sha)

    def describe(self) -> str:
        if not self.chat_template:
            text = "as plain text (no chat template)"
        elif self.fewshot_as_multiturn:
            text = "with the chat template, few-shot examples as turns"
        else:
            text = "with the chat template, few-shot examples in one user message"
        if self.system_instruction_sha:
            shown = self.system_instruction or f"sha256 {self.system_instruction_sha[:12]}"
            text += f", system instruction {shown!r}"
        return text

    def options(self) -> str:
        """The `python -m fsdp_utils.evaluate` options that score this way, as a phrase."""
        parts = []
        if self.chat_template:
            multiturn = "" if self.fewshot_as_multiturn else " false"
            parts += ["--apply_chat_template", "--fewshot_as_multiturn" + multiturn]
        if self.system_instruction:
            parts.append(f"--system_instruction {shlex.quote(self.system_instruction)}")
        return "with " + " ".join(parts) if parts else "without --apply_chat_template"


def template_name_for(
    tokenizer: Any,
    apply: bool | str,
    *,
    folder: Any,
    fix: str,
    flag: str = "--apply_chat_template",
) -> str | None:
    """Which of the tokenizer's chat templates renders the prompts under `--apply_chat_template
    [NAME]`: a name only where the tokenizer has several (one template: NAME is ignored, as
    lm-eval ignores it); None for its only or default one. ValueError naming `fix` when the
    tokenizer (saved in `folder`) has no template, or none of that name."""
    templates = getattr(tokenizer, "chat_template", None)
    if not templates:
        raise ValueError(
            f"{flag}: the tokenizer saved with the model ({folder}) has no chat "
            f"template, so its prompts cannot be written as a chat. {fix}"
        )
    if not isinstance(templates, dict):
        return None
    name = apply if isinstance(apply, str) else "default"
    if name not in templates:
        raise ValueError(
            f"{flag} {name}: the tokenizer in {folder} has the chat templates "
            f"{', '.join(sorted(templates))}, none named {name!r}. Name one of them: "
            f"{flag} {sorted(templates)[0]}."
        )
    return name
