"""`--sample_prompts FILE`: what the model answers, at every evaluation.

The file is jsonl, one prompt per line, in the formats training reads:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}]}
    {"prompt": "Summarize this dialog:\\n...\\n---\\nSummary:\\n"}

`messages` are rendered with the run's chat template (the tokenizer's, or `--chat_template`'s)
and its generation prompt, as the exported model will be prompted; a `prompt` is the text as
given (write it as the run's training prompts look: an Alpaca or `--prompt_template` prompt).
Every rank decodes every prompt greedily through the sharded model (`parallel.generate`: each
forward is a collective, no rank gathers the model), until an EOS or end-of-turn token or
`--sample_max_new_tokens`; rank 0 appends the answers to `<output_dir>/samples.jsonl` and
prints them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.parallel.generate import continue_prompts
from fsdp_utils.parallel.parallelize import no_grad_pass

BATCH_SIZE = 8  # prompts per decoding batch
LOGGED_CHARACTERS = 160  # of each prompt and answer, in the log


def read_sample_prompts(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a --sample_prompts file, checked: ValueError naming the line and the fix."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--sample_prompts {path}: no such file. Give a jsonl file of prompts.")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"--sample_prompts {path}, line {number}: not JSON ({err}).") from err
        messages, prompt = (
            (row.get("messages"), row.get("prompt")) if isinstance(row, dict) else (None, None)
        )
        good_messages = (
            isinstance(messages, list)
            and all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in messages
            )
            and len(messages) > 0
        )
        if not (good_messages or isinstance(prompt, str)):
            raise ValueError(
                f"--sample_prompts {path}, line {number}: expected "
                '{"messages": [{"role": "user", "content": "..."}]} or {"prompt": "..."}, got '
                f"{line.strip()[:120]}"
            )
        rows.append({"messages": messages} if good_messages else {"prompt": prompt})
    if not rows:
        raise ValueError(f"--sample_prompts {path}: the file holds no prompts.")
    return rows


def encode_prompt(row: dict[str, Any], tokenizer: Any, *, where: str) -> list[int]:
    """A prompt's token ids as the trained model will see it (see the module docstring)."""
    if "messages" not in row:
        return list(tokenizer(row["prompt"], add_special_tokens=True)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{where} has chat `messages`, but the model's tokenizer has no chat template to "
            "render them with. Give the template the model is trained with: --chat_template "
            'FILE (a Jinja file), or write the prompt as text: {"prompt": "..."}.'
        )
    encoded = tokenizer.apply_chat_template(
        row["messages"], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])


@dataclass
class SamplePrompts:
    rows: list[dict[str, Any]]
    prompts: list[list[int]]
    tokenizer: Any
    stop_ids: list[int]
    max_new_tokens: int

    @classmethod
    def load(
        cls, path: str | Path, tokenizer: Any, *, stop_ids: Sequence[int], max_new_tokens: int
    ) -> SamplePrompts:
        rows = read_sample_prompts(path)
        prompts = [
            encode_prompt(row, tokenizer, where=f"--sample_prompts {path}, prompt {i + 1},")
            for i, row in enumerate(rows)
        ]
        stops = list(stop_ids) or [tokenizer.eos_token_id]
        return cls(rows, prompts, tokenizer, stops, max_new_tokens)

    def describe(self) -> str:
        names = self.tokenizer.convert_ids_to_tokens(self.stop_ids)
        stops = ", ".join(f"{name} ({i})" for name, i in zip(names, self.stop_ids, strict=True))
        return (
            f"sample prompts: {len(self.prompts)} answered at every evaluation (greedy, up to "
            f"{self.max_new_tokens} tokens, ending at {stops})"
        )

    def answer(
        self, model: nn.Module, *, device: torch.device, autocast: Callable[[], Any]
    ) -> list[dict[str, Any]]:
        """Collective: every rank decodes every prompt. One record per prompt."""
        stops = set(self.stop_ids)
        pad = self.tokenizer.pad_token_id
        pad = self.stop_ids[0] if pad is None else pad
        records: list[dict[str, Any]] = []
        with no_grad_pass(model):
            for start in range(0, len(self.prompts), BATCH_SIZE):
                batch = self.prompts[start : start + BATCH_SIZE]
                generated = continue_prompts(
                    model,
                    batch,
                    pad_token_id=pad,
                    eos_token_id=self.stop_ids[0],
                    max_new_tokens=self.max_new_tokens,
                    is_done=lambda _row, tokens: tokens[-1] in stops,
                    device=device,
                    autocast=autocast,
                )
                for offset, result in enumerate(generated):
                    tokens = result.tokens
                    stopped = result.eos or (bool(tokens) and tokens[-1] in stops)
                    answer_ids = tokens[:-1] if tokens and tokens[-1] in stops else tokens
                    row = self.rows[start + offset]
                    records.append(
                        {
                            **row,
                            "prompt_text": self.tokenizer.decode(self.prompts[start + offset]),
                            "answer": self.tokenizer.decode(answer_ids, skip_special_tokens=True),
                            "stopped": stopped,
                            "new_tokens": len(tokens) + (1 if result.eos else 0),
                        }
                    )
        return records

    def run(
        self,
        model: nn.Module,
        step: int,
        *,
        env: DistEnv,
        autocast: Callable[[], Any],
        out: Path,
        log: Callable[[str], None],
    ) -> None:
        """Collective: answer every prompt; rank 0 appends the answers to `out` and logs them."""
        answers = self.answer(model, device=env.device, autocast=autocast)
        if env.is_main:
            write_answers(out, step, answers)
            log(format_answers(step, answers))


def write_answers(path: Path, step: int, records: list[dict[str, Any]]) -> None:
    """Append one line per answer to samples.jsonl (rank 0)."""
    with open(path, "a", encoding="utf-8") as f:
        for index, record in enumerate(records, start=1):
            f.write(json.dumps({"step": step, "index": index, **record}, ensure_ascii=False) + "\n")


def format_answers(step: int, records: list[dict[str, Any]]) -> str:
    """The log's lines: each prompt's end and its answer, and whether the model stopped."""

    def clip(text: str, head: bool) -> str:
        # As written: newlines and tabs show as \n and \t in the quoted text (repr), never as
        # spaces, so a template's line breaks can be checked in the log.
        if len(text) <= LOGGED_CHARACTERS:
            return text
        return (text[:LOGGED_CHARACTERS] + " ...") if head else ("... " + text[-LOGGED_CHARACTERS:])

    lines = [f"samples step {step}:"]
    for index, record in enumerate(records, start=1):
        how = "stopped" if record["stopped"] else f"cut at {record['new_tokens']} tokens"
        lines.append(f"  [{index}] {clip(record['prompt_text'], head=False)!r}")
        lines.append(f"      -> {clip(record['answer'], head=True)!r} ({how})")
    return "\n".join(lines)
