"""`--method grpo`: the Method the trainer composes. Its examples are prompts (fsdp_utils/data/
prompts.py); its step samples G completions of each with the policy itself, scores them with the
reward functions and trains on them with GRPO's loss (step.py, rollouts.py, loss.py); its
evaluation samples the held-out prompts and reports their rewards."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from fsdp_utils.chess_eval.judge import EngineGaveUp
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.options.method import reward_names, reward_weights
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import eval_batches, steps_per_epoch
from fsdp_utils.data.prepare import PreparedData
from fsdp_utils.data.prompts import PROMPT_COLUMN, PromptSet
from fsdp_utils.model.lora import adapters_disabled
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.generate import (
    PolicyEngine,
    RolloutEngine,
    RolloutSettings,
    Sampling,
    row_seed,
)
from fsdp_utils.train.loss import run_chunking
from fsdp_utils.train.step import TrainStep, build_train_step

from ..base import Examples, Method, MethodContext, StepParts
from .loss import GrpoSettings, combine_rewards
from .rewards import (
    RewardError,
    RewardLog,
    TrainerState,
    engine_gave_up_anywhere,
    load_reward_function,
    score,
)
from .rollouts import Rollouts, completion_texts
from .step import GrpoStep, PlannedUpdate, reference_logps


def reward_engine(config: TrainConfig) -> str:
    """The engine of the rewards that call one: --chess_engine's (auto: the first found, and
    required here; a path: checked to be a working UCI engine). A ValueError (exit 2) names
    the fix when there is none."""
    from fsdp_utils.chess_eval.judge import choose_engine
    from fsdp_utils.config.options.evaluation import engine_choice

    choice = engine_choice(config)
    if choice == "off":
        raise ValueError(
            "A reward of --reward_funcs calls the chess engine (chess_engine, or an "
            "EngineReward), and --chess_engine off turns it off: drop that reward, or give "
            "--chess_engine auto (or the engine's path)."
        )
    path = choose_engine("on" if choice == "auto" else choice)
    assert path is not None  # on and a path are required: EngineNotFound otherwise
    return path


class GRPO(Method):
    name: ClassVar[str] = "grpo"
    step: GrpoStep  # set by build_step

    def __init__(self, config: TrainConfig, context: MethodContext) -> None:
        super().__init__(config, context)
        self.settings = GrpoSettings.of(config)
        # Loaded first: a missing file or function stops the run before any data or model work.
        self.rewards = [load_reward_function(spec) for spec in reward_names(config)]
        self.weights = reward_weights(config)
        if any(r.needs_engine for r in self.rewards):  # the engine --chess_engine chose
            from fsdp_utils.chess_eval.rewards import use_engine_path

            use_engine_path(reward_engine(config))
        self.prepared: PreparedData | None = None
        self.train_prompts: PromptSet | None = None
        self.frozen: nn.Module | None = None  # the reference of a full fine-tune at beta > 0
        self.tokenizer: Any = None

    @property
    def steps_per_batch(self) -> int:
        return self.config.num_iterations

    @classmethod
    def preflight(cls, config: TrainConfig) -> None:
        """The reward functions import (a missing file or function is named), and a reward
        that calls the chess engine finds one here: on the login node with --preflight, and
        on the compute node before any work (it has no internet to install one from)."""
        rewards = [load_reward_function(spec) for spec in reward_names(config)]
        if any(r.needs_engine for r in rewards):
            reward_engine(config)

    def use_data(self, prepared: PreparedData) -> tuple[Examples, Examples]:
        splits = [prepared.split(name) for name in ("train", "eval")]
        assert all(isinstance(s, PromptSet) for s in splits), "GRPO reads prompts"
        self.prepared = prepared
        self.train_prompts = splits[0]  # type: ignore[assignment]
        return splits[0], splits[1]

    def identity(self) -> dict[str, Any]:
        """A checkpoint's rollouts have G completions of each prompt and serve --num_iterations
        steps: another G or another number of iterations cannot continue it."""
        c = self.config
        return {"method": self.name, "num_generations": c.num_generations,
                "num_iterations": c.num_iterations}  # fmt: skip

    def describe(self) -> str:
        c, s = self.config, self.settings
        sampling = f"temperature {c.temperature:g}" + (f", top-k {c.top_k}" if c.top_k else "")
        sampling += f", top-p {c.top_p:g}" if c.top_p < 1 else ""
        rewards = ", ".join(
            f"{r.name} x{w:g}" for r, w in zip(self.rewards, self.weights, strict=True)
        )
        if s.beta == 0:
            reference = "none (--beta 0)"
        elif c.lora:
            reference = "the model with its LoRA adapters off"
        else:
            reference = "a frozen sharded copy of the starting model"
        return (
            f"grpo: {c.num_generations} completions per prompt ({sampling}), at most "
            f"{c.max_completion_length} tokens each; loss {s.loss_type}, epsilon "
            f"{s.epsilon_low:g}/{s.epsilon_high:g}, {s.importance_sampling_level}-level ratios, "
            f"rewards scaled by {s.scale_rewards}, beta {s.beta:g}"
            + (f", {c.num_iterations} steps per rollout" if c.num_iterations > 1 else "")
            + f"; rewards: {rewards}; reference: {reference}; batch sizes count prompts"
        )

    @classmethod
    def needs_frozen_copy(cls, config: TrainConfig) -> bool:
        return config.beta != 0 and not config.lora

    # --- the step --------------------------------------------------------------------------------

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            assert self.prepared is not None
            self.tokenizer = AutoTokenizer.from_pretrained(
                self.prepared.tokenizer_dir(self.context.model_dir)
            )
        return self.tokenizer

    def _engine(
        self, model: nn.Module, parts: StepParts, *, sampling: Sampling | None
    ) -> RolloutEngine:
        assert self.prepared is not None
        stats = self.prepared.meta["stats"]
        stops = {*self.prepared.stop_token_ids(self.context.model_dir), int(stats["eos_token_id"])}
        settings = RolloutSettings(
            max_new_tokens=self.config.max_completion_length,
            stop_token_ids=tuple(sorted(stops)),
            pad_token_id=int(stats["pad_token_id"]),
            sampling=sampling,
        )
        return PolicyEngine(model, settings, device=self.env.device, autocast=parts.autocast)

    def _sampling(self) -> Sampling:
        c = self.config
        return Sampling(c.temperature, top_k=c.top_k, top_p=c.top_p)

    def build_step(self, model: nn.Module, parts: StepParts) -> TrainStep:
        assert self.prepared is not None and self.train_prompts is not None
        c = self.config
        chunking = run_chunking(c, self.context.hf_config, self.env.device)
        reference = None
        if self.settings.beta != 0:
            target = model
            context: Any = contextlib.nullcontext
            if c.lora:
                context = lambda: adapters_disabled(model)  # noqa: E731
            else:
                self.frozen = target = parts.frozen_copy()
                self.frozen.requires_grad_(False)
            reference = reference_logps(
                target, chunking=chunking, device=self.env.device, autocast=parts.autocast,
                temperature=c.temperature, context=context,
            )  # fmt: skip
        plan = self.context.plan
        rollouts = Rollouts(
            prompts=self.train_prompts,
            engine=self._engine(model, parts, sampling=self._sampling()),
            rewards=self.rewards, weights=self.weights, settings=self.settings,
            tokenizer=self._tokenizer(), pad_token_id=int(self.prepared.meta["stats"]["pad_token_id"]),
            seed=c.seed, num_iterations=c.num_iterations,
            mask_truncated=c.mask_truncated_completions, max_steps=c.max_training_steps,
            steps_per_epoch=steps_per_epoch(len(self.train_prompts), plan.total_batch_size),
            stop=parts.stop,
        )  # fmt: skip
        layout = RunLayout.of(c.output_dir)
        step = build_train_step(
            model, c, world_size=self.env.world_size, device=self.env.device,
            hf_config=self.context.hf_config, autocast=parts.autocast,
            grad_scaler=parts.grad_scaler, step_class=GrpoStep, router_loss=None,
            chunking=chunking, rollouts=rollouts, settings=self.settings,
            temperature=c.temperature, reference=reference,
            completions_log=layout.completions if self.env.is_main else None,
            log_completions_every=c.log_completions_every, log=self.context.log,
        )  # fmt: skip
        assert isinstance(step, GrpoStep)
        self.step = step
        return step

    def planned_step(self, model: nn.Module, parts: StepParts) -> TrainStep:
        """The planner's: the update phase (GRPO's loss over G full-length sequences per
        prompt), without prompts, rewards or a rollout; the rollout phase is planned beside it
        (fsdp_utils/plan/rollout.py)."""
        c = self.config
        step = build_train_step(
            model, c, world_size=self.env.world_size, device=self.env.device,
            hf_config=self.context.hf_config, autocast=parts.autocast,
            grad_scaler=parts.grad_scaler, step_class=PlannedUpdate, router_loss=None,
            chunking=run_chunking(c, self.context.hf_config, self.env.device),
            settings=self.settings, temperature=c.temperature,
        )  # fmt: skip
        return step

    # --- the evaluation --------------------------------------------------------------------------

    def evaluate(
        self, model: nn.Module, examples: Examples, *, batch_size: int, max_batches: int
    ) -> dict[str, Any] | None:
        """Collective: one sampled completion (the training's sampling, seeded per prompt: the
        same draws at every evaluation) and one greedy completion of each held-out prompt,
        scored by the reward functions: eval_reward (the policy's expected reward, what GRPO
        raises), eval_greedy_reward, and each function's means."""
        assert isinstance(examples, PromptSet)
        if len(examples) == 0:
            return None
        parts = StepParts(self.step.autocast, lambda: model)
        sampled_engine = self._engine(model, parts, sampling=self._sampling())
        greedy_engine = self._engine(model, parts, sampling=None)
        batches = eval_batches(
            len(examples), batch_size, self.env.rank, self.env.world_size, max_batches
        )
        sums = torch.zeros(2 + 2 * len(self.rewards) + 1, dtype=torch.float64)
        names = [r.name for r in self.rewards]
        for indices in batches:
            ids = [examples.prompt_ids(int(i)) for i in indices]
            seeds = [row_seed(self.config.seed, "grpo-eval", examples.row(int(i))) for i in indices]
            for which, engine in enumerate((sampled_engine, greedy_engine)):
                with engine.rollout_phase():
                    rollout = engine.generate(ids, seeds)
                error, gave_up, scores = None, None, None
                try:
                    scores = self._score_eval(examples, indices, rollout)
                except RewardError as err:
                    error = str(err)
                except EngineGaveUp as err:  # the engine's fault: this evaluation is skipped
                    gave_up = str(err)
                failed = engine_gave_up_anywhere(error, gave_up)
                if failed is not None:
                    self.context.log(f"evaluation skipped (training goes on): {failed}")
                    return None
                assert scores is not None
                combined = combine_rewards(scores, torch.tensor(self.weights))
                sums[which] += float(torch.nansum(combined))
                per = torch.nansum(scores, dim=0).double()
                sums[2 + which * len(names) : 2 + (which + 1) * len(names)] += per
            sums[-1] += len(indices)
        total = dist_utils.all_reduce_host_sum(sums.tolist())
        count = total[-1]
        if count == 0:
            return None
        out: dict[str, Any] = {
            "eval_reward": total[0] / count,
            "eval_greedy_reward": total[1] / count,
        }
        for j, name in enumerate(names):
            out[f"eval_rewards/{name}/mean"] = total[2 + j] / count
            out[f"eval_greedy_rewards/{name}/mean"] = total[2 + len(names) + j] / count
        out["eval_prompts"] = int(count)
        return out

    def _score_eval(self, examples: PromptSet, indices: np.ndarray, rollout: Any) -> torch.Tensor:
        rows = [examples.columns(int(i)) for i in indices]
        texts = completion_texts(self._tokenizer(), rollout.prompt_ids, rollout.completion_ids)
        prompts = [row[PROMPT_COLUMN] for row in rows]
        completions = [
            [{"role": "assistant", "content": t}] if isinstance(p, list) else t
            for p, t in zip(prompts, texts, strict=True)
        ]
        columns = {k: [row.get(k) for row in rows] for k in rows[0] if k != PROMPT_COLUMN}
        state = TrainerState(global_step=0, max_steps=self.config.max_training_steps, epoch=0.0)
        return score(
            self.rewards, prompts=prompts, completions=completions,
            completion_ids=rollout.completion_ids, columns=columns, state=state, log=RewardLog(),
        )  # fmt: skip

    def before_export(self) -> None:
        if self.frozen is not None:  # the reference's shards are not needed any more
            self.step.reference = None
            self.frozen = None

    def close(self) -> None:
        """The rewards' engines (chess_engine's, or an EngineReward of a reward file)."""
        from fsdp_utils.chess_eval.rewards import close_shared

        for reward in self.rewards:
            closer = getattr(reward.function, "close", None)
            if callable(closer):
                closer()
        close_shared()
