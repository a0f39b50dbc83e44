"""The interface of a training method (an objective): what the trainer asks of SFT, of DPO, and
of any method registered beside them (`fsdp_utils.methods.registry`).

A method says what it trains on, what it computes for a micro-batch and what it needs around
the steps; the trainer (`fsdp_utils.trainer`) composes it and never asks which method it is.
The step machinery every method shares lives below, in `fsdp_utils.train`: `TrainStep` runs the
micro-batches, normalises the loss by the step's count (target tokens, or pairs), accumulates
gradients, clips and checks for non-finite values; a method subclasses it for its own loss of
one micro-batch (`forward_backward`) and its own counts (`local_counts`), as DPO does.

The hooks, in the order the trainer calls them:

    use_data(prepared)           the train and eval examples, from the prepared data
    preflight(config)            its own checks before any work (also `--preflight`'s)
    identity()                   what it adds to the checkpoint's identity (resume refuses others)
    describe()                   its line in the log
    needs_starting_weights()     load the starting weights even when resuming (DPO's cache)
    before_first_step(...)       work before the first step (DPO's reference pass); may stop
    trains()                     False: that work was the whole job (a distillation teacher's
                                 cache, --teacher_cache_only): no step, no final model
    build_step(model, parts)     its TrainStep: the loss and metrics of a micro-batch
    evaluate(model, examples)    the held-out loss and metrics
    before_export()              drop what it holds before the final model is written
    close()                      end what it started (every exit path)

and, for the memory planner (`fsdp_utils.plan`, on fake tensors): `needs_frozen_copy`,
`planned_step`, `frozen_models` (what it holds beside the trained model) and `memory_fixes`
(changes of its own to try when a run does not fit). Methods whose examples are preference
pairs are named in `fsdp_utils.config.options.method.PAIRED_METHODS`, which the stages below
read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
from torch import nn

from fsdp_utils.config.batch import BatchPlan
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.prepare import PreparedData
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.parallel.sequence import SequenceParallel
from fsdp_utils.train.step import Batch, TrainStep


class Examples(Protocol):
    """A split the step sampler draws from: its length counts examples (blocks, or pairs)."""

    def __len__(self) -> int: ...

    def batch(self, indices: np.ndarray) -> Batch: ...


@dataclass(frozen=True)
class MethodContext:
    """What a method is built with besides the config: this process's place in the run (and
    in its data x sequence mesh: --sequence_parallel; None: off), the batch plan and the model's
    config. The planner builds methods too, on a fake world (`model_dir` may hold only a
    config.json there)."""

    env: DistEnv
    plan: BatchPlan
    hf_config: Any
    model_dir: Path
    log: Callable[[str], None]
    sequence_parallel: SequenceParallel | None = None


# Asked by the work before the first step between its pieces, and by a step that does long
# work before its update (GRPO's rollout): the reason of a stop request (time limit, signal,
# stop file), or None. Collective: every rank asks, all get one answer.
StopCheck = Callable[[], str | None]


def _never() -> str | None:
    return None


@dataclass(frozen=True)
class StepParts:
    """What a method's step is built from besides the model: the forward's autocast, a
    builder of a frozen copy of the starting model (sharded like the trained one), whether
    fp16-mixed gets its gradient scaler (not in the planner's trace), and the stop check a
    step may ask inside itself (raising `fsdp_utils.train.step.StepInterrupted`)."""

    autocast: Callable[[], Any]
    frozen_copy: Callable[[], nn.Module]
    grad_scaler: bool = True
    stop: StopCheck = _never


class Method:
    """A training method. Subclasses set `name` and implement `use_data`, `build_step` and
    `evaluate`; the other hooks have defaults that do nothing."""

    name: ClassVar[str] = ""

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps each sampled batch of examples serves (GRPO: --num_iterations, the
        same rollouts trained on again); the step sampler moves on every that many steps."""
        return 1

    def __init__(self, config: TrainConfig, context: MethodContext) -> None:
        # The trainer replaces it once the data is prepared when --num_epochs sets the steps.
        self.config = config
        self.context = context
        self.env = context.env
        # Its step's and evaluation's forwards split attention over this group, and the
        # evaluation reads the data-parallel rank's share (fsdp_utils/parallel/sequence.py).
        self.sequence_parallel = context.sequence_parallel or SequenceParallel.off(context.env)

    # --- data -----------------------------------------------------------------------------

    def use_data(self, prepared: PreparedData) -> tuple[Examples, Examples]:
        """Collective: the train and eval examples of the prepared data."""
        raise NotImplementedError

    @classmethod
    def preflight(cls, config: TrainConfig) -> None:
        """Checks of what the method needs besides the model and data, run once per process
        before any work and by `--preflight` on the login node (GRPO: its reward functions
        import, and a chess engine is there for the rewards that call one; distillation: the
        teacher in the offline cache, of the student's vocabulary). ValueError: a user mistake
        (exit 2)."""

    # --- the run's identity and log ------------------------------------------------------

    def identity(self) -> dict[str, Any]:
        """Entries of the checkpoint's run identity: a checkpoint of another method is not
        this one's to continue (its steps count other examples, its loss is another)."""
        return {"method": self.name}

    def describe(self) -> str | None:
        """Its line in the log at start, if it has something to say."""
        return None

    # --- before the first step ------------------------------------------------------------

    def needs_starting_weights(self) -> bool:
        """Load the starting weights even when a checkpoint's follow (work before the first
        step reads them)."""
        return False

    @classmethod
    def needs_frozen_copy(cls, config: TrainConfig) -> bool:
        """Whether its step keeps a frozen copy of the starting model (`StepParts.frozen_copy`):
        the planner plans its parameters too (before it builds the method's step)."""
        return False

    def before_first_step(self, model: nn.Module, parts: StepParts, stop: StopCheck) -> str | None:
        """Collective: work before the first step, with the model as it starts (loaded, or
        with the starting weights: `needs_starting_weights`). It asks `stop` between pieces of
        work; None when done (ready to train), else the reason of the stop request that came
        first, what it finished kept (the next leg carries on from there)."""
        return None

    def trains(self) -> bool:
        """False when the work before the first step is the whole job (a distillation
        teacher's cache written in a job of its own): the trainer then builds no step, trains
        nothing and writes no final model, and the run ends "completed"."""
        return True

    # --- the step and the evaluation ------------------------------------------------------

    def build_step(self, model: nn.Module, parts: StepParts) -> TrainStep:
        """Collective: the step of the run (`fsdp_utils.train.step.build_train_step`, with this
        method's TrainStep and options)."""
        raise NotImplementedError

    def planned_step(self, model: nn.Module, parts: StepParts) -> TrainStep:
        """The step the planner traces on fake tensors: `build_step` unless the method has
        state it cannot trace (DPO's cache of reference log-probabilities)."""
        return self.build_step(model, parts)

    def frozen_models(self) -> list[nn.Module]:
        """Models it holds beside the trained one, built by itself (a distillation teacher):
        the planner counts their shards as resident, since its tracker sees the trained
        model's only."""
        return []

    @classmethod
    def memory_fixes(cls, config: TrainConfig) -> list[tuple[str, str, TrainConfig]]:
        """Changes of its own the planner tries, each planned, when a run does not fit:
        (the flags, what they cost, the changed config). None by default."""
        return []

    def evaluate(
        self, model: nn.Module, examples: Examples, *, batch_size: int, max_batches: int
    ) -> dict[str, Any] | None:
        """Collective: the held-out loss and metrics (eval_loss, ...), None without examples."""
        raise NotImplementedError

    # --- the end --------------------------------------------------------------------------

    def before_export(self) -> None:
        """Drop what the method holds (a frozen reference copy) before the final model is
        gathered and written."""

    def close(self) -> None:
        """On every exit path, the run's end or its failure: end the processes and threads the
        method started (GRPO: a chess engine behind a reward; python-chess's engine thread
        would keep the interpreter from exiting, as Python joins threads before its atexit
        handlers)."""
