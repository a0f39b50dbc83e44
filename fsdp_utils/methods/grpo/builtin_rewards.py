"""The built-in reward functions (`--reward_funcs NAME`), each with TRL's signature.

    exact_answer   1.0 when the completion's final answer equals the row's (`answer` or
                   `solution` column): gsm8k's `#### 72`, MATH's `\\boxed{72}`; 0.0 otherwise;
                   None for a row without a reference answer
    length         TRL's documentation example: -|20 - characters of the completion|
    chess_format   1.0 when the completion's first word is a move in UCI (e2e4, e7e8q) written
                   after a space, as the games were written; else 0.0
    chess_legal    1.0 when that move is legal in the row's position (`fen`, or `moves` from the
                   start); else 0.0
    chess_engine   the engine judge's accuracy of that move in [0, 1] (Lichess's formula,
                   fsdp_utils/chess_eval/judge.py, Stockfish at depth 8); 0.0 for an illegal
                   or unparseable one
    chess_centipawn  dense, in centipawns: 1 - (the move's centipawn loss) / 1000 in [0, 1] for
                   a legal move (the engine's best 1.0), -1.0 for an illegal or unparseable one

The chess rewards judge only the first move of a completion (the next move of the prompt's
position), with python-chess as referee; `python -m fsdp_utils.chess_eval.prompt_set` writes
such prompts from games. Chess-R1 (arXiv 2507.00726) rewards the best move and an engine
value, and illegal moves nothing, in the same spirit.
"""

from __future__ import annotations

import re
from typing import Any

from fsdp_utils.chess_eval import rewards as chess_rewards

# --- math-style answers ----------------------------------------------------------------------

_BOXED = re.compile(r"\\boxed\{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def final_answer(text: str) -> str | None:
    """The answer a solution ends with: after its last `####` (gsm8k), else in its last
    \\boxed{} (MATH), else its last number; None when it has none."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normal(answer: str) -> str:
    """Compared as numbers when both are (72 = 72.0 = 72.00, 1,000 = 1000), else as text with
    spaces and a trailing period dropped."""
    cleaned = answer.strip().rstrip(".").replace("$", "").replace(" ", "")
    number = cleaned.replace(",", "")
    try:
        value = float(number)
    except ValueError:
        return cleaned
    return repr(int(value)) if value.is_integer() else repr(value)


def _text(completion: Any) -> str:
    """A completion as text: TRL gives chat prompts' completions as [{"role", "content"}]."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def exact_answer(completions: list[Any], **kwargs: Any) -> list[float | None]:
    references = kwargs.get("answer") or kwargs.get("solution")
    if references is None:
        raise ValueError(
            "exact_answer compares with the row's reference answer: the data needs a column "
            "`answer` (gsm8k) or `solution` (MATH)."
        )
    rewards: list[float | None] = []
    for completion, reference in zip(completions, references, strict=True):
        expected = final_answer(str(reference)) if reference is not None else None
        if expected is None:
            rewards.append(None)
            continue
        got = final_answer(_text(completion))
        rewards.append(1.0 if got is not None and _normal(got) == _normal(expected) else 0.0)
    return rewards


def length(completions: list[Any], **kwargs: Any) -> list[float | None]:
    """TRL's example reward (its GRPO trainer's documentation, `reward_len`): completions near 20
    characters."""
    return [-abs(20 - len(_text(c))) for c in completions]


# --- chess -----------------------------------------------------------------------------------


def chess_format(completions: list[Any], **kwargs: Any) -> list[float | None]:
    return [chess_rewards.format_reward(chess_rewards.move_text(c)) for c in completions]


def chess_legal(completions: list[Any], **kwargs: Any) -> list[float | None]:
    positions = chess_rewards.positions(kwargs)
    return [
        chess_rewards.legal_reward(p, chess_rewards.move_text(c))
        for p, c in zip(positions, completions, strict=True)
    ]


def chess_engine(completions: list[Any], **kwargs: Any) -> list[float | None]:
    return chess_rewards.shared_judge("accuracy")(completions, **kwargs)


def chess_centipawn(completions: list[Any], **kwargs: Any) -> list[float | None]:
    return chess_rewards.shared_judge("centipawn")(completions, **kwargs)
