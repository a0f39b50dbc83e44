"""The training loop: `train` -> `train_step` (one optimizer step, `fsdp_utils.train.step`) ->
`forward_backward` (one micro-batch), as in torchtitan.

The Trainer composes the stages: it receives the run's batch plan and resolved assets (checked
once per process: `fsdp_utils.run.preflight.check_run`), builds the model on `meta` (the
storage check and the checkpoint key map read it there), prepares the data, parallelizes,
materialises shard by shard and only then fills in the weights. What a step, an evaluation, a
checkpoint or the final model is lives in their own modules; what the run trains on, its loss
and what it needs before the first step come from its method (`fsdp_utils.methods`, chosen by
--method), which the Trainer composes without knowing which it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fsdp_utils.checkpoint.final_model import save_final_model
from fsdp_utils.checkpoint.sharded import (
    Checkpointer,
    CheckpointError,
    CheckpointInfo,
    run_identity,
)
from fsdp_utils.chess_eval.training import TrainingChessEval
from fsdp_utils.config.batch import BatchPlan
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import StepSampler, describe_epochs, epoch_steps
from fsdp_utils.data.document_masking import check_document_masking
from fsdp_utils.data.prepare import PreparedData
from fsdp_utils.data.sequence_slices import slice_batch
from fsdp_utils.hub.resolve import ResolvedAssets
from fsdp_utils.methods.base import Examples, Method, MethodContext, StepParts
from fsdp_utils.methods.registry import build_method
from fsdp_utils.metrics.logger import RunLogger, Stopwatch
from fsdp_utils.metrics.prediction import SpeedCheck
from fsdp_utils.metrics.profile import StepProbes
from fsdp_utils.metrics.records import run_config_record, write_run_config, write_status
from fsdp_utils.metrics.throughput import (
    detect_peak_tflops,
    memory_snapshot,
    reset_memory_peaks,
    throughput,
    training_flops_per_token,
)
from fsdp_utils.metrics.trackers import open_trackers
from fsdp_utils.model.transforms import MetaModel
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.compile import CompileCounts
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.parallel.parallelize import (
    autocast_context,
)
from fsdp_utils.parallel.sequence import SequenceParallel, init_sequence_parallel
from fsdp_utils.startup import resume_collector
from fsdp_utils.train.optim import optimizer_note
from fsdp_utils.train.router_loss import RouterLoss
from fsdp_utils.train.samples import SamplePrompts
from fsdp_utils.train.step import (
    Batch,
    StepFailed,
    StepInterrupted,
    TrainStep,
    describe_sync_free,
)
from fsdp_utils.train.timelimit import (
    LegEnd,
    StopController,
    StoppedBeforeFirstStep,
    remaining_work,
)
from fsdp_utils.trainer.parts import RunModel, describe_run, prepare_data


@dataclass
class TrainState:
    """What changes as training goes; checkpointed with the model and optimizer (the step is
    also the data position and the random state: see StepSampler and `_seed_step`)."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0


class Trainer:
    # Set by `setup`, in this order.
    sequence_parallel: SequenceParallel  # which sequences this rank reads, which slice of them
    stop: StopController  # asked before the first step too
    method: Method  # --method (fsdp_utils/methods/): what it trains on, its step, its evaluation
    chess_eval: TrainingChessEval | None
    models: RunModel
    data: PreparedData
    train_blocks: Examples  # the method's examples: blocks, or pairs
    eval_blocks: Examples
    sampler: StepSampler
    checkpointer: Checkpointer
    model: nn.Module
    fsdp_groups: list[str]
    autocast: Any
    optimizer: torch.optim.Optimizer
    train_step: TrainStep
    flops_per_token: float
    peak_tflops: float | None
    eval_seconds: float | None = None  # the last evaluation's, for the time-limit estimate
    stopped_early: str | None = None  # why setup stopped before the first step (`setup`)
    # Set when the method's work before the first step was the whole job (`Method.trains`)
    work_only: str | None = None
    samples: SamplePrompts | None = None  # --sample_prompts
    _compile_counts: CompileCounts | None = None  # --compile: the last ones logged
    # The step-time model's prediction, given by the run (fsdp_utils/run/speed.py, rank 0)
    speed_check: SpeedCheck | None = None

    def __init__(
        self, config: TrainConfig, env: DistEnv, *, plan: BatchPlan, assets: ResolvedAssets
    ) -> None:
        """`plan` and `assets` come from `fsdp_utils.run.preflight.check_run`; the run folder
        is ready (`fsdp_utils.run.start.start_run`)."""
        self.config = config
        self.env = env
        self.plan = plan
        self.assets = assets
        self.model_dir = assets.model_dir
        self.hf_config = assets.model_config
        self.layout = RunLayout.of(config.output_dir)
        self.state = TrainState()
        if env.is_main:  # `start_run` made it under the CLI; other callers need it too
            self.layout.root.mkdir(parents=True, exist_ok=True)
        self.log = RunLogger(
            self.layout.metrics,
            env.is_main,
            config.max_training_steps,
            sinks=open_trackers(config, self.layout, enabled=env.is_main),
        )

    # --- setup ----------------------------------------------------------------------------

    def setup(self) -> None:
        """Collective. A stop requested before the first step (the time limit during the data
        preparation or the method's work) ends it early, what that work finished kept: `train`
        then returns at once, "interrupted", and the next leg goes on from there."""
        try:
            self._setup()
        except StoppedBeforeFirstStep as stopped:
            self.stopped_early = stopped.reason
            self.stop.consume_stop_file()  # handled: the next leg must not stop at once
            self.log.event(
                "stopping",
                f"stopping before the first step: {stopped.reason} during {stopped.during}; "
                "what it finished is kept (rerun the same command to go on; a requeued job "
                "does)",
                step=self.state.step,
                reason=stopped.reason,
            )

    def _setup(self) -> None:
        config, env = self.config, self.env
        torch.manual_seed(config.seed)
        self.log.info(describe_run(config, self.plan, env, self.layout.root))
        # First: the work before the first step asks it, and its signal handlers are in place.
        self.stop = StopController.for_run(config, self.layout, is_main=env.is_main)
        self.stop.flag.on_abort = lambda: self.write_status(
            "aborted", "Ctrl-C twice: ended at once, without saving"
        )
        if (limit := self.stop.describe_time_limit()) is not None:
            self.log.info(limit)
        # A request that came before this process started (Slurm's signal while the job was
        # starting: the stop file is already there) ends the leg now, not after the data and
        # the model: on a loaded node those took the rest of the job's time, and Slurm's
        # TIMEOUT then ended a leg that was never requeued (issue 47).
        if (early := self.stop.requested_at_start()) is not None:
            raise StoppedBeforeFirstStep(early, "the start, before the data and the model")
        self.sequence_parallel = sp = init_sequence_parallel(env, config.sequence_parallel)
        context = MethodContext(
            env, self.plan, self.hf_config, self.model_dir, self.log.info, sequence_parallel=sp
        )
        self.method = build_method(config, context)
        self.chess_eval = TrainingChessEval.build(config, env, self.assets, self.log)
        # The model on meta first (no memory): the storage check, the checkpoint key map and
        # the log read it there, and a run that cannot fit on the disk stops before any data work.
        self.models = RunModel(config, env, self.assets, self.layout, self.log.info)
        meta = self.models.meta()
        resume_collector()  # the start-up ends here: fsdp_utils/startup.py
        self.data = prepare_data(
            config, self.assets, env, self.log.info, stop=self.stop.requested_here
        )
        self.train_blocks, self.eval_blocks = self.method.use_data(self.data)
        self.sampler = StepSampler(len(self.train_blocks), self.plan, config.seed)
        if config.num_epochs is not None:  # the steps follow from the data: before the schedule
            blocks, total = len(self.train_blocks), self.plan.total_batch_size
            repeat = self.method.steps_per_batch
            self.config = self.method.config = config = epoch_steps(config, blocks, total, repeat)
            self.log.max_steps = config.max_training_steps
            self.log.info(describe_epochs(config, blocks, total, repeat))
        self.samples = self._sample_prompts()

        self.checkpointer = Checkpointer(
            self.layout.checkpoints,
            config,
            run_identity(config, self.plan.total_batch_size, self.method.identity()),
            is_main=env.is_main,
            device=env.device,
        )
        resume_from = self.checkpointer.to_resume(warn=self.log.info)
        self.state.step = resume_from.step if resume_from is not None else 0  # for status.json
        if (line := self.method.describe()) is not None:
            self.log.info(line)

        watch = Stopwatch()
        # Work before the first step may read the starting weights even when resuming; a job
        # that trains nothing needs none.
        load = resume_from is None or self.method.needs_starting_weights()
        load = load and self.method.trains()
        self.model = self.models.build(meta, load_weights=load)
        self.fsdp_groups = self.models.fsdp_groups
        self.log.info(f"model: built, sharded and loaded in {watch.lap():.1f}s")
        if config.document_masking:
            check_document_masking(self.model, batch_size_per_device=config.batch_size_per_device)
        if (router := RouterLoss.describe(config, self.hf_config)) is not None:
            self.log.info(router)
        self.autocast = autocast_context(config, env.device)
        parts = StepParts(self.autocast, self.models.frozen_copy, stop=self.stop.requested)
        stopped = self.method.before_first_step(self.model, parts, self.stop.requested)
        if stopped is not None:
            raise StoppedBeforeFirstStep(stopped, f"--method {config.method}'s work")
        if not self.method.trains():  # that work was the job: no step, no final model
            self.work_only = f"--method {config.method}'s work before the first step was the job"
            return
        self.train_step = self.method.build_step(self.model, parts)
        self.log.info(self.train_step.chunking.note)
        self.optimizer = self.train_step.optimizer
        self.log.info(optimizer_note(self.optimizer, config))
        if config.sync_free_steps:
            self.log.info(describe_sync_free(config, self.train_step))
        if resume_from is not None:
            self._resume(resume_from)
        # MFU counts useful work: no weight gradients for frozen weights (LoRA, --freeze_layers)
        self.flops_per_token = training_flops_per_token(
            self.hf_config, self.model, meta.info.active_parameters, config
        )
        self.peak_tflops = config.peak_tflops or detect_peak_tflops(env.device)
        self._write_run_config(meta)

    def _resume(self, info: CheckpointInfo) -> None:
        watch = Stopwatch()
        self.checkpointer.load(info, self.model, self.optimizer)
        changes = self.train_step.resume(info.meta, start_step=info.step, folder=info.path)
        self.state.step = info.step
        self.state.tokens_seen = int(info.meta.get("tokens_seen", 0))
        self.log.event(
            "resumed",
            f"checkpoint: resumed from step {info.step} ({info.path}, saved on "
            f"{info.meta.get('world_size')} process(es)) in {watch.lap():.1f}s",
            step=info.step,
            path=str(info.path),
        )
        if changes:
            self.log.event(
                "resume_changes",
                "resume: changed since the checkpoint:\n  " + "\n  ".join(changes),
                step=info.step,
                changes=changes,
            )

    def _write_run_config(self, meta: MetaModel) -> None:
        if not self.env.is_main:
            return
        record = run_config_record(
            self.config,
            env=self.env,
            plan=self.plan,
            info=meta.info,
            model_dir=self.model_dir,
            fsdp_groups=self.fsdp_groups,
            flops_per_token=self.flops_per_token,
            data=self.data,
            loss_chunk_size=self.train_step.chunking.chunk_size,
            optimizer_kernel="fused" if self.optimizer.defaults.get("fused") else "foreach",
        )
        write_run_config(self.layout, record)
        self.log.config(record)

    # --- training ------------------------------------------------------------------------

    @property
    def checkpointing(self) -> bool:
        return self.config.save_every_steps > 0 or self.config.save_every_minutes > 0

    def step_batches(self, step: int) -> list[Batch]:
        """This rank's micro-batches of optimizer step `step` (counted from 0), on the host: its
        data-parallel rank's examples, its slice of their sequences (--sequence_parallel)."""
        sp = self.sequence_parallel
        micro = self.sampler.micro_batches(step // self.method.steps_per_batch, sp.data_rank)
        return [slice_batch(self.train_blocks.batch(i), rank=sp.rank, size=sp.size) for i in micro]

    def train(self) -> dict[str, Any]:
        """Steps until max_training_steps, or until a stop (time limit, signal, stop file):
        then save and return with status "interrupted" so the next run resumes."""
        config = self.config
        if self.stopped_early is not None:  # setup saved what it did; the next leg goes on
            return _summary("interrupted", self.stopped_early, {}, None, time.perf_counter())
        if self.work_only is not None:
            self.log.info(f"training: none ({self.work_only})")
            return _summary("completed", self.work_only, {}, None, time.perf_counter())
        self.log.event(
            "start",
            f"training: steps {self.state.step} -> {config.max_training_steps}, "
            f"{self.plan.tokens_per_step:,} tokens per step, "
            f"{self.sampler.steps_per_epoch} steps per epoch",
            step=self.state.step,
        )
        self.train_step.last_saved_step = self.state.step if self.state.step else -1
        watch = Stopwatch()
        started = time.perf_counter()
        last: dict[str, Any] = {}
        batches = self.step_batches(self.state.step)
        global_counts: list[float] | None = None  # the first step reduces its own
        self.probes = self._step_probes()  # --profile_steps, --flop_counter
        reset_memory_peaks(self.env.device)  # the first logged peaks are the steps', not setup's
        while self.state.step < config.max_training_steps:
            self._seed_step()
            step = self.state.step + 1
            log_now = step % config.log_every == 0 or step == config.max_training_steps
            try:
                with self.probes.around(step):
                    metrics = self.train_step(
                        batches, step=step, global_counts=global_counts, check=log_now
                    )
            except StepInterrupted as stopped:  # before its update: the weights are unchanged
                self._stop_inside_step(stopped)
                if isinstance(stopped, StepFailed):  # saved: now the run ends with its message
                    raise
                return _summary("interrupted", stopped.reason, last, None, started)
            if log_now:  # --sync_free_steps: the step's values read here, its update queued
                metrics = self.train_step.read_pending(metrics)
            self.state.step = step
            self.state.tokens_seen += metrics["tokens"]
            more = step < config.max_training_steps
            batches = self.step_batches(step) if more else []
            step_time = watch.lap()
            # The next step's target counts ride on the stop decision's all-reduce.
            decision = self.stop.poll(step, step_time, add=self.train_step.local_counts(batches))
            global_counts = decision.sums
            if log_now:
                last = self._log_step(metrics, step_time)
                self._log_compile_counts()
            if config.eval_every and step % config.eval_every == 0:
                self._timed_evaluate()
            if self.chess_eval:
                self.chess_eval.maybe_run(self.model, step, autocast=self.autocast)
            if decision.stop and not self._end_of_leg(decision.stop).finish:
                self.stop.consume_stop_file()  # handled: the next run must not stop at once
                self.probes.close()
                return _summary("interrupted", decision.stop, last, None, started)
            if decision.save and self.train_step.last_saved_step != step:
                self._periodic_save()
            watch.lap()  # eval and save time is not step time
        self.probes.close()
        if self.speed_check is not None:  # a run too short for the usual comparison
            self._compare_speed(self.speed_check.report(self.state.step))
        final_eval = None
        if not config.eval_every or self.state.step % config.eval_every:
            final_eval = self.evaluate()
        if self.chess_eval:
            self.chess_eval.maybe_run(
                self.model, self.state.step, final=True, autocast=self.autocast
            )
        if self.checkpointing and self.train_step.last_saved_step != self.state.step:
            self.save_checkpoint()
        return _summary("completed", "max_training_steps", last, final_eval, started)

    def _log_compile_counts(self) -> None:
        """--compile: what torch.compile did (graphs, graph breaks, recompiles), logged when it
        changed since the last log step (the first step compiles; a recompile later is news)."""
        if not self.config.compile:
            return
        counts = CompileCounts.now()
        if counts == self._compile_counts:
            return
        self._compile_counts = counts
        self.log.event(
            "compile", counts.describe(self.config.compile_scope), step=self.state.step,
            scope=self.config.compile_scope, **counts.record(),
        )  # fmt: skip

    def _step_probes(self) -> StepProbes:
        tokens_per_rank = self.plan.tokens_per_step / self.env.world_size
        return StepProbes.from_config(
            self.config,
            self.layout.root,
            rank=self.env.rank,
            world_size=self.env.world_size,
            device=self.env.device,
            start=self.state.step,
            flops_per_rank_step=self.flops_per_token * tokens_per_rank,
            log=self.log,
        )

    def _seed_step(self) -> None:
        """Random state as a pure function of (seed, step, rank): dropout masks of a resumed
        run are those of the uninterrupted one, without saving RNG states."""
        seed = np.random.SeedSequence([self.config.seed, self.state.step, self.env.rank])
        torch.manual_seed(int(seed.generate_state(1, dtype=np.uint64)[0] >> 1))

    def _log_step(self, metrics: dict[str, Any], step_time: float) -> dict[str, Any]:
        record = {
            "step": self.state.step,
            "loss": metrics["loss"],
            **({"aux_loss": metrics["aux_loss"]} if "aux_loss" in metrics else {}),
            "lr": metrics["lr"],
            "grad_norm": metrics["grad_norm"],
            **metrics.get("logged", {}),  # the method's own (DPO's rewards and log-probabilities)
            **throughput(
                metrics["tokens"],
                step_time,
                world_size=self.env.world_size,
                flops_per_token=self.flops_per_token,
                peak_tflops=self.peak_tflops,
            ),
            "step_time_s": step_time,
            # Rank 0's CPU seconds so far: against the step time, how host-bound the loop is
            # (and a load-independent figure for bench/throughput.py).
            "process_cpu_s": time.process_time(),
            "tokens_seen": self.state.tokens_seen,
            # Which blocks the step trained on: two runs (or a run and its resumption) that
            # log the same ids saw the same data in the same order.
            "batch_id": self.sampler.batch_fingerprint(
                (self.state.step - 1) // self.method.steps_per_batch
            ),
            **memory_snapshot(self.env.device),
        }
        self.log.step(record)
        if self.speed_check is not None:
            self._compare_speed(self.speed_check.observe(record))
        return record

    def _compare_speed(self, lines: list[str]) -> None:
        """The measured throughput and peak beside the prediction, once (metrics.jsonl too)."""
        if lines and self.speed_check is not None:
            self.log.event(
                "speed_check", "\n".join(lines), step=self.state.step, **self.speed_check.fields()
            )

    def evaluate(self) -> dict[str, Any] | None:
        """Collective: the held-out loss and metrics now (the method's `evaluate`), logged; and
        the answers to --sample_prompts (`fsdp_utils.train.samples`)."""
        metrics = self.method.evaluate(
            self.model, self.eval_blocks, batch_size=self.plan.batch_size_per_device,
            max_batches=self.config.eval_batches,
        )  # fmt: skip
        record = None if metrics is None else {"step": self.state.step, **metrics}
        if record is not None:
            self.log.eval(record)
        if self.samples is not None:
            self.samples.run(
                self.model, self.state.step, env=self.env, autocast=self.autocast,
                out=self.layout.samples, log=self.log.info,
            )  # fmt: skip
        return record

    def _sample_prompts(self) -> SamplePrompts | None:
        """--sample_prompts, encoded with the tokenizer the model is trained (and exported) with."""
        if not self.config.sample_prompts:
            return None
        from transformers import AutoTokenizer

        samples = SamplePrompts.load(
            self.config.sample_prompts,
            AutoTokenizer.from_pretrained(self.data.tokenizer_dir(self.model_dir)),
            stop_ids=self.data.stop_token_ids(self.model_dir),
            max_new_tokens=self.config.sample_max_new_tokens,
        )
        self.log.info(samples.describe())
        return samples

    def _timed_evaluate(self) -> None:
        watch = Stopwatch()
        self.evaluate()
        self.eval_seconds = watch.lap()  # for the estimate of the work left (_end_of_leg)

    # --- checkpoints and the end of a leg -------------------------------------------------

    def save_checkpoint(self) -> None:
        """Collective. A failed save is reported; the previous checkpoint stays usable."""
        step = self.train_step
        step.check_weights_finite("saving a checkpoint", self.state.step)
        extra = {"tokens_seen": self.state.tokens_seen, **step.checkpoint_state()}
        path, seconds = self.checkpointer.save(
            self.state.step, self.model, self.optimizer, extra,
            (self.hf_config, self.data.tokenizer_dir(self.model_dir)),
            files=step.checkpoint_files(),
        )  # fmt: skip
        step.last_saved_step = self.state.step
        self.stop.saved(seconds)
        self.log.event(
            "checkpoint",
            f"checkpoint: saved step {self.state.step} to {path} in {seconds:.1f}s",
            step=self.state.step,
            seconds=seconds,
            path=str(path),
        )

    def _periodic_save(self) -> None:
        try:
            self.save_checkpoint()
        except CheckpointError as err:  # keep training: the next save may succeed
            self.log.event("checkpoint_failed", f"checkpoint: {err}", step=self.state.step)

    def _stop_inside_step(self, stopped: StepInterrupted) -> None:
        """Collective: a stop honoured inside step `self.state.step + 1` (`StepInterrupted`):
        its work so far is saved with the weights of step `self.state.step`, and the leg ends
        (the next one's step goes on with it)."""
        self.save_checkpoint()
        self.stop.consume_stop_file()  # handled: the next leg must not stop at once
        self.probes.close()
        self.log.event(
            "stopping",
            f"stopping inside step {self.state.step + 1}: {stopped.reason} during "
            f"{stopped.during}; saved with step {self.state.step}'s weights (rerun the same "
            "command to go on; a requeued job does)",
            step=self.state.step,
            reason=stopped.reason,
        )

    def _end_of_leg(self, reason: str) -> LegEnd:
        """Collective. A stop was requested: save this step, then either finish the run in this
        job (the stop came at the last step, or the rest fits in the time left) or end the leg
        so that the next one resumes. Saving first keeps the work if a preemption, not the
        time limit, sent the request."""
        step = self.state.step
        if self.train_step.last_saved_step != step:
            self.save_checkpoint()
        work = remaining_work(
            self.config,
            step=step,
            step_seconds=self.stop.typical_step_seconds(),
            save_seconds=self.stop.save_seconds,
            eval_seconds=self.eval_seconds,
            has_eval=len(self.eval_blocks) > 0,
            accumulation=self.plan.gradient_accumulation_steps,
        )
        leg = self.stop.leg_end(reason, work)
        kind, message = leg.event(step, reason)
        self.log.event(kind, message, step=step, reason=reason)
        return leg

    # --- end ------------------------------------------------------------------------------

    def save_final_model(self) -> Path | None:
        """Collective: the final model (`fsdp_utils.checkpoint.final_model`), timed, logged."""
        if self.config.no_final_save or self.work_only is not None:
            return None
        self.train_step.check_weights_finite("writing the final model", self.state.step)
        self.method.before_export()
        watch = Stopwatch()
        path = save_final_model(
            self.model, self.config, self.hf_config, self.layout,
            self.data.tokenizer_dir(self.model_dir), is_main=self.env.is_main,
        )  # fmt: skip
        dist_utils.barrier()
        seconds = watch.lap()
        self.log.event(
            "final_model",
            f"model: saved to {path} in {seconds:.1f}s",
            seconds=seconds,
            path=str(path),
        )
        return path

    def write_status(self, status: str, reason: str, *, user_error: str | None = None) -> None:
        """How this run ended, for the sbatch script (requeue or not) and for people."""
        if not self.env.is_main:
            return
        warning = write_status(
            self.layout, status, reason, step=self.state.step,
            max_training_steps=self.config.max_training_steps, user_error=user_error,
        )  # fmt: skip
        if warning:
            self.log.info(warning)

    def close(self) -> None:
        """Every exit path (the CLI's `finally`): the method's outside resources (a chess
        engine behind a reward), then the log."""
        method = getattr(self, "method", None)
        if method is not None:
            method.close()
        stop = getattr(self, "stop", None)
        if stop is not None:  # Ctrl-C is the caller's again
            stop.close()
        self.log.close()


def _summary(
    status: str, reason: str, last: dict[str, Any], final_eval: Any, started: float
) -> dict[str, Any]:
    """What `Trainer.train` returns: how it ended, the last step's and the final eval's
    records, and the seconds it took."""
    seconds = time.perf_counter() - started
    return {"status": status, "reason": reason, "last": last, "eval": final_eval,
            "seconds": seconds}  # fmt: skip
