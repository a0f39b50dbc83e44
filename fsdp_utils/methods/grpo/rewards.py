"""Reward functions: plain Python with TRL's signature, loaded by name, called per rollout batch.

`--reward_funcs a.py:correct,length` names each function as `FILE.py:FUNCTION` (imported the
way --dataset_module is) or as a built-in (`BUILTINS`). Each is called as TRL's GRPOTrainer
calls a reward function (trl 1.16.0, `GRPOTrainer._calculate_rewards`):

    function(prompts=[...], completions=[...], completion_ids=[[...], ...],
             <every column of the dataset but `prompt`>=[...], trainer_state=...,
             log_metric=..., log_extra=...)

with one entry per completion (a prompt's G completions next to each other, its columns repeated
G times); `completions` are the decoded texts, or for chat prompts [{"role": "assistant",
"content": text}] lists. It returns one float per completion, or None to skip one (a completion
every function skipped takes no part in its group's baseline and gets no advantage). A function
may be `async def`. So a TRL user's reward functions run unchanged.

A function that raises, returns the wrong number of rewards, or a NaN or infinite one stops the
run with a `RewardError` (a ValueError: exit 2) naming the function and the sample; nothing
saved before is touched. A chess engine that keeps failing after its restarts
(`fsdp_utils.chess_eval.judge.EngineGaveUp`) is not the function's fault: it passes through
unwrapped, and the rollout saves what it did and stops the run (rollouts.py).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdp_utils.chess_eval.judge import EngineGaveUp
from fsdp_utils.data.custom import import_function
from fsdp_utils.parallel import distributed as dist_utils

from . import builtin_rewards


class RewardError(ValueError):
    """A reward function failed on a batch: the run stops (exit 2), naming it and the sample."""


# --reward_funcs NAME without a file: the built-in rewards (docs/grpo.md).
BUILTINS: dict[str, Callable[..., list[float | None]]] = {
    "exact_answer": builtin_rewards.exact_answer,
    "length": builtin_rewards.length,
    "chess_format": builtin_rewards.chess_format,
    "chess_legal": builtin_rewards.chess_legal,
    "chess_engine": builtin_rewards.chess_engine,
    "chess_centipawn": builtin_rewards.chess_centipawn,
}


@dataclass
class RewardFunction:
    name: str  # the function's __name__, or the built-in's: the log's and the metrics' name
    function: Callable[..., Any]

    @property
    def needs_engine(self) -> bool:
        """It calls the chess engine (the built-in, or an `EngineReward` of one's own)."""
        from fsdp_utils.chess_eval.rewards import EngineReward

        engines = (builtin_rewards.chess_engine, builtin_rewards.chess_centipawn)
        return self.function in engines or isinstance(self.function, EngineReward)


def engine_gave_up_anywhere(error: str | None, gave_up: str | None) -> str | None:
    """Collective, after every rank scored its completions (or had none to score): this rank's
    `RewardError` message (`error`) and `EngineGaveUp` message (`gave_up`), None for none. A
    reward function's error on any rank stops every rank (`raise_from_any_rank`: a user's
    mistake, exit 2); else the first rank's message of an engine that gave up, the same on
    every rank, for each to skip or stop alike; else None."""
    outcomes = dist_utils.all_gather_objects((error, gave_up))
    if any(e for e, _ in outcomes):
        dist_utils.raise_from_any_rank(error)
    return next((g for _, g in outcomes if g), None)


def load_reward_function(spec: str) -> RewardFunction:
    """One --reward_funcs entry: FILE.py:FUNCTION, or a built-in name."""
    if spec in BUILTINS:
        return RewardFunction(spec, BUILTINS[spec])
    if ":" not in spec:
        raise ValueError(
            f"--reward_funcs {spec}: neither FILE.py:FUNCTION nor a built-in reward (built in: "
            f"{', '.join(BUILTINS)}; docs/grpo.md)."
        )
    function = import_function(spec, flag="--reward_funcs")
    # TRL names a reward by its function's __name__ (its metrics: rewards/<name>/mean)
    return RewardFunction(getattr(function, "__name__", type(function).__name__), function)


@dataclass
class TrainerState:
    """What TRL's `trainer_state` keyword gives a reward function that shapes its reward over
    training (transformers' TrainerState: these fields)."""

    global_step: int
    max_steps: int
    epoch: float


@dataclass
class RewardLog:
    """What the reward functions logged through `log_metric(name, value)` and
    `log_extra(column, values)` (TRL's keywords) in one rollout."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, list[Any]] = field(default_factory=dict)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list[Any]) -> None:
        self.extra.setdefault(column, []).extend(values)


def _sample(prompts: Sequence[Any], completions: Sequence[Any], index: int) -> str:
    prompt, completion = prompts[index], completions[index]
    return f"sample {index}: prompt {_short(prompt)}, completion {_short(completion)}"


def _short(value: Any, width: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _where(err: BaseException) -> str:
    """The innermost frame of the traceback: the user's file and line."""
    frames = traceback.extract_tb(err.__traceback__)
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def score(
    functions: Sequence[RewardFunction],
    *,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[list[int]],
    columns: dict[str, list[Any]],
    state: TrainerState,
    log: RewardLog,
) -> torch.Tensor:
    """[completions, functions] float32 rewards, NaN where a function returned None."""
    out = torch.full((len(completions), len(functions)), math.nan, dtype=torch.float32)
    kwargs = {
        **columns,
        "trainer_state": state,
        "log_metric": log.log_metric,
        "log_extra": log.log_extra,
    }
    for j, reward in enumerate(functions):
        try:
            values = reward.function(
                prompts=list(prompts), completions=list(completions),
                completion_ids=[list(c) for c in completion_ids], **kwargs,
            )  # fmt: skip
            if inspect.isawaitable(values):
                values = asyncio.run(_awaited(values))
        except EngineGaveUp:  # an external program's fault, not the function's: the caller
            raise  # saves and stops (rollouts.py)
        except Exception as err:
            raise RewardError(
                f"The reward function {reward.name} raised {type(err).__name__}: {err}"
                f"{_where(err)}, on a batch of {len(completions)} completions whose first is "
                f"{_sample(prompts, completions, 0)}. Fix the function (or the data's columns "
                "it reads) and rerun: the checkpoints saved so far are kept."
            ) from err
        values = list(values) if isinstance(values, Sequence | torch.Tensor) else values
        if not isinstance(values, list) or len(values) != len(completions):
            got = f"{len(values)} values" if isinstance(values, list) else type(values).__name__
            raise RewardError(
                f"The reward function {reward.name} returned {got} for {len(completions)} "
                "completions: it must return one float (or None to skip) per completion, in "
                f"order. The first: {_sample(prompts, completions, 0)}."
            )
        for i, value in enumerate(values):
            if value is None:
                continue
            number = float(value)
            if not math.isfinite(number):
                raise RewardError(
                    f"The reward function {reward.name} returned {number} for "
                    f"{_sample(prompts, completions, i)}. A reward must be a finite number, or "
                    "None to skip the completion."
                )
            out[i, j] = number
    return out


async def _awaited(values: Any) -> Any:
    return await values
