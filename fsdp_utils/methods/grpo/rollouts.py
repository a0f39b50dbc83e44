"""GRPO's rollouts: every prompt of a step sampled G times by the policy, scored by the reward
functions, and kept per prompt until the step's completions are trained on for the last time.

The phase switch is the method's: `Rollouts.prepare` runs the rollout phase through a
`RolloutEngine` (fsdp_utils/parallel/generate.py: the sharded policy itself, its parameters
gathered for the phase), one micro-batch of prompts x G at a time, then hands the update the
teacher-forced batches. Between micro-batches, and again between the rollout and the update,
it asks whether to stop (`StepParts.stop`): a stop request ends the step before its update
(`StepInterrupted`), with what was sampled and scored kept in the checkpoint
(`RolloutBuffer`), so that the next leg samples only the rest: no rollout is replayed (trained
on twice) or lost.

Every completion's tokens come from a generator seeded by (seed, the step's batch, the prompt's
row, the completion's number): a prompt gets the same completions on 1 or 2 processes, in any
micro-batch, and in a resumed leg.

The buffer is kept by prompt (its index in the training split), not by rank, so that a leg on
another number of processes continues it; it holds each completion's tokens, whether it ran out
of tokens, its rewards, and once computed its log-probabilities at the rollout's weights (the
`old` ones, for --num_iterations > 1) and the reference's (--beta > 0).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdp_utils.chess_eval.judge import EngineGaveUp
from fsdp_utils.chess_eval.rewards import take_restart_notes
from fsdp_utils.data.prompts import PROMPT_COLUMN, PROMPT_INDEX, PromptSet, is_messages
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.generate import Rollout, RolloutEngine, row_seed
from fsdp_utils.train.step import Batch, StepFailed, StepInterrupted

from .loss import GrpoSettings, combine_rewards, group_advantages, nanstd
from .rewards import (
    RewardError,
    RewardFunction,
    RewardLog,
    TrainerState,
    engine_gave_up_anywhere,
    score,
)

BUFFER_FILE = "grpo_rollouts.pt"  # in a checkpoint's folder, when it holds rollouts
OLD_LOGPS, REF_LOGPS, ADVANTAGES, LOSS_MASK = "old_logps", "ref_logps", "advantages", "loss_mask"
LOGGED_COMPLETIONS = 4  # of rank 0's first micro-batch, with their rewards, for the log


@dataclass
class PromptRollout:
    """A prompt's G completions as sampled and scored, and their log-probabilities once
    computed (completion tokens only)."""

    completions: list[list[int]]
    truncated: list[bool]
    rewards: list[list[float]]  # [G][functions], NaN where a function said None
    old_logps: list[list[float]] | None = None
    ref_logps: list[list[float]] | None = None


@dataclass
class RolloutBuffer:
    """The rollouts of one batch of prompts (`batch`: the step sampler's batch number)."""

    batch: int
    prompts: dict[int, PromptRollout] = field(default_factory=dict)

    def state(self) -> dict[str, Any]:
        return {"batch": self.batch, "prompts": {i: vars(p) for i, p in self.prompts.items()}}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RolloutBuffer:
        prompts = {int(i): PromptRollout(**p) for i, p in state["prompts"].items()}
        return cls(int(state["batch"]), prompts)


def completion_texts(
    tokenizer: Any, prompts: Sequence[list[int]], completions: Sequence[list[int]]
) -> list[str]:
    """Each completion as text, as it reads after its prompt: the decoded prompt + completion
    less the decoded prompt (a tokenizer whose words carry their space at the end, or drop a
    first word's, would lose a completion's leading space decoded alone), special tokens
    skipped as TRL decodes them; decoded alone where the prompt does not come back whole."""
    texts = []
    for prompt, completion in zip(prompts, completions, strict=True):
        head = tokenizer.decode(prompt, skip_special_tokens=True)
        whole = tokenizer.decode([*prompt, *completion], skip_special_tokens=True)
        texts.append(
            whole[len(head) :]
            if whole.startswith(head)
            else tokenizer.decode(completion, skip_special_tokens=True)
        )
    return texts


@dataclass
class RolloutStats:
    """The step's rollout, over every rank: TRL's metric names (`as_metrics`)."""

    rewards: torch.Tensor  # [completions, functions], NaN where skipped, in prompt order
    combined: torch.Tensor  # [completions]
    std_is_zero: torch.Tensor  # [completions]
    lengths: torch.Tensor  # [completions]
    truncated: torch.Tensor  # [completions]
    seconds: float  # the rollout phase (sampling and rewards); 0 when nothing was sampled
    reward_log: dict[str, float]
    # The rewards' chess engines restarted in this rollout (died or hung: each a log line).
    engine_notes: list[str] = field(default_factory=list)
    has_engine: bool = False

    def as_metrics(self, names: Sequence[str]) -> dict[str, float]:
        metrics: dict[str, float] = {
            "reward": float(torch.nanmean(self.combined)),
            "reward_std": float(nanstd(self.combined)),
            "frac_reward_zero_std": float(self.std_is_zero.float().mean()),
        }
        for j, name in enumerate(names):
            metrics[f"rewards/{name}/mean"] = float(torch.nanmean(self.rewards[:, j]))
            metrics[f"rewards/{name}/std"] = float(nanstd(self.rewards[:, j]))
        lengths = self.lengths.double()
        metrics.update(
            {
                "completions/mean_length": float(lengths.mean()),
                "completions/min_length": float(lengths.min()),
                "completions/max_length": float(lengths.max()),
                "completions/clipped_ratio": float(self.truncated.double().mean()),
            }
        )
        if self.seconds > 0:
            metrics["rollout/seconds"] = self.seconds
            metrics["rollout/tokens_per_s"] = float(lengths.sum()) / self.seconds
        metrics.update({f"reward_log/{k}": v for k, v in self.reward_log.items()})
        if self.has_engine:
            metrics["engine/restarts"] = float(len(self.engine_notes))
        return {k: v for k, v in metrics.items() if math.isfinite(v)}


class Rollouts:
    """The rollout phase of each step and the buffer it fills (collective: every rank)."""

    def __init__(
        self,
        *,
        prompts: PromptSet,
        engine: RolloutEngine,
        rewards: Sequence[RewardFunction],
        weights: Sequence[float],
        settings: GrpoSettings,
        tokenizer: Any,
        pad_token_id: int,
        seed: int,
        num_iterations: int,
        mask_truncated: bool,
        max_steps: int,
        steps_per_epoch: int,
        stop: Callable[[], str | None],
    ) -> None:
        self.prompts = prompts
        self.engine = engine
        self.rewards = list(rewards)
        self.weights = torch.tensor(list(weights), dtype=torch.float32)
        self.settings = settings
        self.tokenizer = tokenizer
        self.pad = pad_token_id
        self.seed = seed
        self.num_iterations = num_iterations
        self.mask_truncated = mask_truncated
        self.max_steps = max_steps
        self.steps_per_epoch = steps_per_epoch
        self.stop = stop
        self.buffer: RolloutBuffer | None = None
        self.reward_log = RewardLog()  # what the reward functions logged in this step's rollout
        self.engine_notes: list[str] = []  # this step's restarts of the rewards' chess engines
        self.has_engine = any(r.needs_engine for r in self.rewards)
        self.last_texts: list[dict[str, Any]] = []  # this rank's first completions, for the log

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def seeds(self, batch: int, prompt: int) -> list[int]:
        """The G completions' seeds of a prompt (its dataset row) in a step's batch."""
        row = self.prompts.row(prompt)
        return [
            row_seed(self.seed, "grpo", batch, row, g) for g in range(self.settings.num_generations)
        ]

    # --- the rollout phase --------------------------------------------------------------------

    def sample(self, step: int, micro: Sequence[list[int]]) -> float:
        """Collective: sample and score every prompt of `micro` (this rank's micro-batches'
        prompt indices) not in the buffer yet; returns the seconds it took (0: nothing to do).
        Asks `stop` after each micro-batch: StepInterrupted, what is done kept."""
        batch = (step - 1) // self.num_iterations
        if self.buffer is None or self.buffer.batch != batch:
            self.buffer = RolloutBuffer(batch)
        buffer = self.buffer
        self.reward_log = RewardLog()
        self.engine_notes = []
        self.last_texts = []
        missing = [[i for i in indices if i not in buffer.prompts] for indices in micro]
        counts = dist_utils.all_reduce_host_sum([float(len(m)) for m in missing])
        if not any(counts):
            return 0.0
        started = time.perf_counter()
        with self.engine.rollout_phase():
            for m, todo in enumerate(missing):
                if counts[m] == 0:  # every rank has this micro-batch's prompts already
                    continue
                keep = bool(todo)
                self._sample_micro_batch(step, batch, todo if keep else micro[m][:1], keep=keep)
                if m < len(missing) - 1 and (reason := self.stop()) is not None:
                    raise StepInterrupted(reason, f"the rollout of step {step}")
        return time.perf_counter() - started

    def _sample_micro_batch(self, step: int, batch: int, indices: list[int], *, keep: bool) -> None:
        """Sample G completions of each prompt and score them. A rank with nothing left to
        sample in this micro-batch samples one prompt anyway and drops it (`keep=False`): the
        sharded forwards are collective. A reward function's failure on any rank stops every
        rank (rank 0 reports it: exit 2)."""
        g = self.settings.num_generations
        prompt_ids = [self.prompts.prompt_ids(i) for i in indices]
        rollout = self.engine.generate(
            [ids for ids in prompt_ids for _ in range(g)],
            [s for i in indices for s in self.seeds(batch, i)],
        )
        error, gave_up = None, None
        scores = None
        if keep:
            try:
                scores = self._score(step, indices, rollout)
            except RewardError as err:
                error = str(err)
            except EngineGaveUp as err:
                gave_up = str(err)
            self.engine_notes.extend(take_restart_notes())
        failed = engine_gave_up_anywhere(error, gave_up)  # a RewardError raises: exit 2
        if failed is not None:  # the engine's fault: what is sampled stays, the run stops
            raise StepFailed(
                f"{failed}. The run stops: the rollout of step {step} so far is saved with step "
                f"{step - 1}'s weights, as at a time limit, and the same command goes on from "
                "there once the engine runs again (by hand it should answer `uci` with "
                "`uciok`; $FSDP_UTILS_STOCKFISH points the rewards at another one).",
                f"the rollout of step {step}",
            )
        if not keep:
            return
        assert scores is not None
        for k, index in enumerate(indices):
            rows = range(k * g, (k + 1) * g)
            self.buffer.prompts[index] = PromptRollout(  # type: ignore[union-attr]
                completions=[rollout.completion_ids[r] for r in rows],
                truncated=[rollout.truncated[r] for r in rows],
                rewards=scores[k * g : (k + 1) * g].tolist(),
            )

    def _score(self, step: int, indices: list[int], rollout: Rollout) -> torch.Tensor:
        g = self.settings.num_generations
        rows = [self.prompts.columns(i) for i in indices for _ in range(g)]
        texts = completion_texts(self.tokenizer, rollout.prompt_ids, rollout.completion_ids)
        prompts = [row[PROMPT_COLUMN] for row in rows]
        completions: list[Any] = [
            [{"role": "assistant", "content": t}] if is_messages(p) else t
            for p, t in zip(prompts, texts, strict=True)
        ]
        names = [k for k in rows[0] if k != PROMPT_COLUMN] if rows else []
        columns = {k: [row.get(k) for row in rows] for k in names}
        state = TrainerState(
            global_step=step - 1,
            max_steps=self.max_steps,
            epoch=(step - 1) / max(self.steps_per_epoch * self.num_iterations, 1),
        )
        scores = score(
            self.rewards, prompts=prompts, completions=completions,
            completion_ids=rollout.completion_ids, columns=columns, state=state,
            log=self.reward_log,
        )  # fmt: skip
        for r in range(min(len(texts), LOGGED_COMPLETIONS - len(self.last_texts))):
            self.last_texts.append(
                {"prompt": prompts[r], "completion": completions[r], "rewards": scores[r].tolist()}
            )
        return scores

    # --- after the rollout ---------------------------------------------------------------------

    def statistics(
        self, micro: Sequence[list[int]], seconds: float
    ) -> tuple[RolloutStats, dict[int, list[float]]]:
        """Collective: every rank's rollouts of this step gathered (the rewards of a prompt's
        group are all on one rank, but --scale_rewards batch and the metrics need them all):
        the step's statistics, and this rank's prompts' advantages."""
        assert self.buffer is not None
        mine = {i: self.buffer.prompts[i] for indices in micro for i in indices}
        local = {
            i: (p.rewards, [len(c) for c in p.completions], p.truncated) for i, p in mine.items()
        }
        gathered: dict[int, Any] = {}
        for part in dist_utils.all_gather_objects(local):
            gathered.update(part)
        order = sorted(gathered)  # prompt order: the same numbers on any number of processes
        rewards = torch.tensor([r for i in order for r in gathered[i][0]], dtype=torch.float32)
        rewards = rewards.view(-1, len(self.rewards))
        combined = combine_rewards(rewards, self.weights)
        advantages, zero = group_advantages(
            combined, self.settings.num_generations, self.settings.scale_rewards
        )
        g = self.settings.num_generations
        by_prompt = {i: advantages[k * g : (k + 1) * g].tolist() for k, i in enumerate(order)}
        gathered_logs = dist_utils.all_gather_objects((self.reward_log.metrics, self.engine_notes))
        logged = [metrics for metrics, _ in gathered_logs]
        reward_log = {}
        for name in sorted({n for part in logged for n in part}):
            values = [v for part in logged for v in part.get(name, [])]
            reward_log[name] = sum(values) / len(values)
        stats = RolloutStats(
            rewards=rewards,
            combined=combined,
            std_is_zero=zero,
            lengths=torch.tensor([n for i in order for n in gathered[i][1]]),
            truncated=torch.tensor([t for i in order for t in gathered[i][2]]),
            seconds=seconds,
            reward_log=reward_log,
            engine_notes=[note for _, notes in gathered_logs for note in notes],
            has_engine=self.has_engine,
        )
        return stats, {i: by_prompt[i] for i in mine}

    def training_batches(
        self, micro: Sequence[list[int]], advantages: dict[int, list[float]]
    ) -> list[Batch]:
        """The update's micro-batches: each prompt's G completions, teacher-forced, with their
        advantages, loss mask and stored log-probabilities (`OLD_LOGPS`, `REF_LOGPS`)."""
        assert self.buffer is not None
        batches = []
        for indices in micro:
            entries = [(i, k) for i in indices for k in range(self.settings.num_generations)]
            rollout = Rollout(
                [self.prompts.prompt_ids(i) for i, _ in entries],
                [self.buffer.prompts[i].completions[k] for i, k in entries],
                [[] for _ in entries],
                [self.buffer.prompts[i].truncated[k] for i, k in entries],
            )
            batch = rollout.training_batch(self.pad)
            mask = batch["labels"][:, 1:] != -100
            if self.mask_truncated:  # DAPO: no loss on completions that ran out of tokens
                mask &= ~torch.tensor(rollout.truncated)[:, None]
            batch[LOSS_MASK] = mask
            batch[ADVANTAGES] = torch.tensor(
                [advantages[i][k] for i, k in entries], dtype=torch.float32
            )
            for key, attr in ((OLD_LOGPS, "old_logps"), (REF_LOGPS, "ref_logps")):
                stored = [getattr(self.buffer.prompts[i], attr) for i, _ in entries]
                if all(s is not None for s in stored):
                    values = [s[k] for s, (_, k) in zip(stored, entries, strict=True)]  # type: ignore[index]
                    batch[key] = self._placed(rollout, values, mask.shape)
            batches.append(batch)
        return batches

    @staticmethod
    def _placed(rollout: Rollout, values: list[list[float]], shape: torch.Size) -> torch.Tensor:
        """Completion-token values at their places among the shifted labels' positions."""
        out = torch.zeros(shape, dtype=torch.float32)
        for b, (prompt, v) in enumerate(zip(rollout.prompt_ids, values, strict=True)):
            out[b, len(prompt) - 1 : len(prompt) - 1 + len(v)] = torch.tensor(
                v, dtype=torch.float32
            )
        return out

    def store_logps(
        self, micro: Sequence[list[int]], attr: str, logps: Sequence[torch.Tensor]
    ) -> None:
        """Keep [rows, seq - 1] log-probabilities of each micro-batch's completions in the
        buffer (completion tokens only), by prompt."""
        assert self.buffer is not None
        g = self.settings.num_generations
        for indices, values in zip(micro, logps, strict=True):
            for n, i in enumerate(indices):
                prompt = self.prompts.prompt_ids(i)
                entry = self.buffer.prompts[i]
                rows = []
                for k in range(g):
                    start = len(prompt) - 1
                    rows.append(
                        values[n * g + k, start : start + len(entry.completions[k])].tolist()
                    )
                setattr(entry, attr, rows)

    def lacks(self, micro: Sequence[list[int]], attr: str) -> bool:
        """Collective: whether any rank's prompts lack `attr` (their log-probabilities)."""
        assert self.buffer is not None
        missing = sum(getattr(self.buffer.prompts[i], attr) is None for ix in micro for i in ix)
        return dist_utils.all_reduce_host_sum([float(missing)])[0] > 0

    # --- the checkpoint -----------------------------------------------------------------------

    def finished(self, step: int) -> None:
        """After the update of `step`: its batch's last iteration drops the buffer."""
        if step % self.num_iterations == 0:
            self.buffer = None

    def checkpoint_state(self) -> dict[str, Any] | None:
        """Collective: every rank's part of the buffer, merged (None without one)."""
        if not any(dist_utils.all_gather_objects(self.buffer is not None)):
            return None
        parts = dist_utils.all_gather_objects(self.buffer.state() if self.buffer else None)
        merged: dict[str, Any] = {"batch": None, "prompts": {}}
        for part in parts:
            if part is not None:
                merged["batch"] = part["batch"]
                merged["prompts"].update(part["prompts"])
        return merged

    def restore(self, state: dict[str, Any] | None) -> None:
        self.buffer = RolloutBuffer.from_state(state) if state is not None else None


def prompt_indices(micro_batches: Sequence[Batch]) -> list[list[int]]:
    return [[int(i) for i in batch[PROMPT_INDEX].tolist()] for batch in micro_batches]
