"""The training loop: `train` -> `train_step` (one optimizer step) -> `forward_backward_step`
(one micro-batch), as in torchtitan.

Setup order is chosen so mistakes fail fast: batch arithmetic and asset resolution come before
any model or data is loaded; the model is built on `meta`, parallelized, materialised shard by
shard and only then filled with weights.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from fsdp_utils.checkpoint.sharded import (
    Checkpointer,
    CheckpointError,
    CheckpointInfo,
    run_identity,
)
from fsdp_utils.chess_eval.training import TrainingChessEval
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import IGNORE_INDEX, StepSampler, batch_position_ids, eval_batches
from fsdp_utils.data.document_masking import attention_implementation, check_document_masking
from fsdp_utils.data.prepare import PreparedData, prepare_dataset
from fsdp_utils.metrics.logger import RunLogger, Stopwatch
from fsdp_utils.metrics.profile import StepProbes
from fsdp_utils.metrics.throughput import (
    detect_peak_tflops,
    memory_snapshot,
    training_flops_per_token,
)
from fsdp_utils.metrics.trackers import open_trackers
from fsdp_utils.model import freeze, lora
from fsdp_utils.model.build import build_meta_model, materialize
from fsdp_utils.model.transforms import load_initial_weights
from fsdp_utils.model.weights import checkpoint_key_map
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.parallel.parallelize import (
    autocast_context,
    build_parallel_model,
    fsdp_group_names,
    gradient_sync_context,
    wrap_ddp,
)
from fsdp_utils.run.preflight import check_batch_and_model
from fsdp_utils.run.shared_paths import check_shared_paths
from fsdp_utils.run.start import prepare_run_folder
from fsdp_utils.train.loss import count_targets, token_loss_sum
from fsdp_utils.train.optim import (
    apply_settings,
    build_optimizer,
    build_scheduler,
    describe_changes,
    optimizer_settings,
    settings_in_optimizer,
)
from fsdp_utils.train.timelimit import LegEnd, StopController, remaining_work


class TrainingDivergedError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite."""


@dataclass
class TrainState:
    """What changes as training goes; checkpointed with the model and optimizer (the step is
    also the data position and the random state: see StepSampler and `_seed_step`)."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0


def check_output_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"The output folder {path} is not writable ({err.strerror}). Choose another "
            "--output_dir, e.g. on project or scratch storage."
        ) from err


def _local_counts(batches: list[dict[str, torch.Tensor]]) -> list[float]:
    """[target tokens, non-pad tokens] of this rank's micro-batches (host tensors: no sync)."""
    targets = sum(count_targets(b["labels"]) for b in batches)
    tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    return [float(targets), float(tokens)]


class Trainer:
    def __init__(self, config: TrainConfig, env: DistEnv) -> None:
        self.config = config
        self.env = env
        self.layout = RunLayout.of(config.output_dir)
        self.state = TrainState()
        # Before any path is read: every node must see the run folder and the caches.
        check_shared_paths(config, env)
        # Fail fast, before any model or data is loaded: the preflight's own checks.
        self.plan, self.model_dir, self.hf_config = check_batch_and_model(config, env.world_size)
        notes: list[str] = []
        if env.is_main:
            check_output_dir(self.layout.root)
            # Before anything is written: `--resume never` sets the previous run aside; fail
            # now if not even one checkpoint fits on the disk.
            notes = prepare_run_folder(
                config, self.layout, self.hf_config, self.model_dir, world_size=env.world_size
            )
        dist_utils.barrier()
        self.log = RunLogger(
            self.layout.metrics,
            env.is_main,
            config.max_training_steps,
            sinks=open_trackers(config, self.layout, enabled=env.is_main),
        )
        for note in notes:
            self.log.info(note)

    # --- setup ----------------------------------------------------------------------------

    def setup(self) -> None:
        config, env = self.config, self.env
        torch.manual_seed(config.seed)
        self._print_header()
        self.chess_eval = TrainingChessEval.build(config, env, self.model_dir, self.log)
        self.data = self._prepare_data()
        self.sampler = StepSampler(len(self.train_blocks), self.plan, config.seed)

        self.checkpointer = Checkpointer(
            self.layout.checkpoints,
            config,
            run_identity(config, self.plan.total_batch_size),
            env.is_main,
            env.device,
        )
        resume_from = self.checkpointer.to_resume(warn=self.log.info)

        watch = Stopwatch()
        self.model = self._build_model(load_weights=resume_from is None)
        self.log.info(f"model: built, sharded and loaded in {watch.lap():.1f}s")
        if config.document_masking:
            check_document_masking(self.model, batch_size_per_device=config.batch_size_per_device)
        self.autocast = autocast_context(config, env.device)
        self.optimizer = build_optimizer(self.model, config)
        self.scheduler = build_scheduler(self.optimizer, config)
        self.scaler = self._grad_scaler()
        if resume_from is not None:
            self._resume(resume_from)
        self.stop = StopController(
            self.layout.stop_file(config.stop_file),
            save_every_steps=config.save_every_steps,
            save_every_minutes=config.save_every_minutes,
            stop_after_steps=config.stop_after_steps,
            margin_minutes=config.time_limit_margin_minutes,
            is_main=env.is_main,
        )
        if self.stop.end_time_known():
            self.log.info(
                f"time limit: the job ends at {self.stop.end_time_text()}; saving and stopping "
                f"at least {self.stop.margin() / 60:.1f} min before"
            )
        # MFU counts useful work: no weight gradients for frozen weights (LoRA, --freeze_layers)
        self.flops_per_token = training_flops_per_token(
            self.hf_config, self.model, self.model_info.non_embedding_parameters, config
        )
        self.peak_tflops = config.peak_tflops or detect_peak_tflops(env.device)
        self._write_run_config()

    def _print_header(self) -> None:
        c, p, env = self.config, self.plan, self.env
        self.log.info(
            f"run: {c.model} on {c.dataset} -> {self.layout.root}\n"
            f"world: {env.world_size} process(es) on {env.num_nodes} node(s), "
            f"device {env.device.type}, backend {env.backend}\n"
            f"batch: {p.describe()}\n"
            f"parallel: {self._parallel_description()}; precision {c.precision}; "
            f"optimizer {c.optimizer}, lr {c.learning_rate:g} ({c.lr_schedule}, "
            f"{c.resolved_warmup_steps} warmup steps), grad clip {c.grad_clip or 'off'}"
        )

    def _parallel_description(self) -> str:
        c = self.config
        if c.no_fsdp:
            kind = "DDP"
        elif c.no_layer_wrap_policy:
            kind = f"FSDP2 ({c.sharding}) at the root only"
        else:
            kind = f"FSDP2 ({c.sharding}) per decoder layer"
        extras = []
        if c.gradient_checkpointing:
            every = c.checkpoint_every_n_layers
            extras.append(
                "activation checkpointing" + (f" every {every} layers" if every > 1 else "")
            )
        if c.cpu_offload:
            extras.append("CPU offload")
        extras.append(
            "grad sync on last micro-batch" if c.defer_grad_sync else "grad sync every micro-batch"
        )
        return ", ".join([kind, *extras])

    def _prepare_data(self) -> PreparedData:
        # Rank 0 prepares (or finds) the cached data; the others then find it.
        if self.env.is_main:
            folder = prepare_dataset(self.config, log=self.log.info)
        dist_utils.barrier()
        if not self.env.is_main:
            folder = prepare_dataset(self.config, log=lambda _: None)
        meta = json.loads((folder / "meta.json").read_text())
        prepared = PreparedData(folder, meta)
        self.train_blocks = prepared.split("train", document_masking=self.config.document_masking)
        self.eval_blocks = prepared.split("eval", document_masking=self.config.document_masking)
        return prepared

    def _resume(self, info: CheckpointInfo) -> None:
        watch = Stopwatch()
        self.checkpointer.load(info, self.model, self.optimizer)
        meta = info.meta
        # The loaded param groups carry the checkpoint's learning rate, weight decay and betas;
        # the current config decides them, and the schedule, from this step on.
        saved = meta.get("optimizer_settings") or settings_in_optimizer(self.optimizer)
        apply_settings(self.optimizer, self.config)
        self.scheduler = build_scheduler(self.optimizer, self.config, start_step=info.step)
        if self.scaler is not None and meta.get("scaler"):
            self.scaler.load_state_dict(meta["scaler"])
        self.state.step = info.step
        self.state.tokens_seen = int(meta.get("tokens_seen", 0))
        self.log.event(
            "resumed",
            f"checkpoint: resumed from step {info.step} ({info.path}, saved on "
            f"{meta.get('world_size')} process(es)) in {watch.lap():.1f}s",
            step=info.step,
            path=str(info.path),
        )
        changes = describe_changes(saved, self.config, info.step)
        if changes:
            self.log.event(
                "resume_changes",
                "resume: changed since the checkpoint:\n  " + "\n  ".join(changes),
                step=info.step,
                changes=changes,
            )

    def save_checkpoint(self) -> None:
        """Collective. A failed save is reported; the previous checkpoint stays usable."""
        self.check_weights_finite("saving a checkpoint")
        extra = {
            "tokens_seen": self.state.tokens_seen,
            "optimizer_settings": optimizer_settings(self.config),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }
        path, seconds = self.checkpointer.save(
            self.state.step, self.model, self.optimizer, extra, (self.hf_config, self.model_dir)
        )
        self.last_saved_step = self.state.step
        self.stop.saved(seconds)
        self.log.event(
            "checkpoint",
            f"checkpoint: saved step {self.state.step} to {path} in {seconds:.1f}s",
            step=self.state.step,
            seconds=seconds,
            path=str(path),
        )

    def _build_model(self, load_weights: bool = True) -> nn.Module:
        config, env = self.config, self.env
        # Checkpoint names are matched on the unwrapped model: FSDP2 swaps the classes that
        # transformers looks its key conversions up by. A meta build costs no memory.
        key_map = checkpoint_key_map(
            build_meta_model(self.hf_config, config.precision), self.model_dir
        )
        model, self.model_info = build_parallel_model(self.hf_config, config, env)
        materialize(model, env.device)
        # A resumed full fine-tune gets its weights from the checkpoint; LoRA and frozen layers
        # load the pretrained weights always (their checkpoints hold only what trains).
        load_initial_weights(model, self.model_dir, key_map, config, resuming=not load_weights)
        if config.no_fsdp:
            model = wrap_ddp(model, env.device)
        info = self.model_info
        self.fsdp_groups = fsdp_group_names(model)
        self.log.info(
            f"model: {info.model_type}, {info.parameters / 1e6:,.2f}M parameters "
            f"({info.non_embedding_parameters / 1e6:,.2f}M non-embedding), "
            f"{info.decoder_layers} x {info.decoder_layer_class}; "
            f"{len(self.fsdp_groups)} FSDP shard group(s); attention "
            f"{attention_implementation(getattr(model, 'module', model))}"
            + (f"\nlora: {lora.describe(config, model)}" if config.lora else "")
            + (f"\nfreeze: {freeze.describe(config, model)}" if config.freeze_layers else "")
        )
        model.train()
        return model

    def _grad_scaler(self) -> Any:
        if self.config.precision != "fp16-mixed":
            return None
        if self.config.no_fsdp:
            return torch.amp.GradScaler(self.env.device.type)
        # Sharded gradients: each rank sees only its shard, so found-inf is all-reduced.
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.env.device.type)

    def _write_run_config(self) -> None:
        if not self.env.is_main:
            return
        record = {
            "config": self.config.to_dict(),
            "resolved": {
                "world_size": self.env.world_size,
                "num_nodes": self.env.num_nodes,
                "device": self.env.device.type,
                "backend": self.env.backend,
                "total_batch_size": self.plan.total_batch_size,
                "gradient_accumulation_steps": self.plan.gradient_accumulation_steps,
                "tokens_per_step": self.plan.tokens_per_step,
                "warmup_steps": self.config.resolved_warmup_steps,
                "model_dir": str(self.model_dir),
                "decoder_layer_class": self.model_info.decoder_layer_class,
                "num_decoder_layers": self.model_info.decoder_layers,
                "fsdp_groups": self.fsdp_groups,
                "parameters": self.model_info.parameters,
                "non_embedding_parameters": self.model_info.non_embedding_parameters,
                "flops_per_token": self.flops_per_token,
                "prepared_data": str(self.data.folder),
                "data_stats": self.data.meta.get("stats"),
            },
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": _version("transformers"),
            },
        }
        tmp = self.layout.config.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(self.layout.config)
        self.log.config(record)

    # --- training ------------------------------------------------------------------------

    @property
    def checkpointing(self) -> bool:
        return self.config.save_every_steps > 0 or self.config.save_every_minutes > 0

    def train(self) -> dict[str, Any]:
        """Steps until max_training_steps, or until a stop (time limit, signal, stop file):
        then save and return with status "interrupted" so the next run resumes."""
        config = self.config
        self.log.event(
            "start",
            f"training: steps {self.state.step} -> {config.max_training_steps}, "
            f"{self.plan.tokens_per_step:,} tokens per step, "
            f"{self.sampler.steps_per_epoch} steps per epoch",
            step=self.state.step,
        )
        self.last_saved_step = self.state.step if self.state.step else -1
        self.eval_seconds: float | None = None
        watch = Stopwatch()
        started = time.perf_counter()
        last: dict[str, Any] = {}
        batches = self.step_batches(self.state.step)
        global_counts: list[float] | None = None  # the first step reduces its own
        self.probes = self._step_probes()  # --profile_steps, --flop_counter
        while self.state.step < config.max_training_steps:
            self._seed_step()
            log_now = self._is_log_step(self.state.step + 1)
            with self.probes.around(self.state.step + 1):
                metrics = self.train_step(batches, global_counts=global_counts, check=log_now)
            self.state.step += 1
            self.state.tokens_seen += metrics["tokens"]
            more = self.state.step < config.max_training_steps
            batches = self.step_batches(self.state.step) if more else []
            step_time = watch.lap()
            # The next step's target counts ride on the stop decision's all-reduce.
            decision = self.stop.poll(self.state.step, step_time, add=_local_counts(batches))
            global_counts = decision.sums
            if log_now:
                last = self._log_step(metrics, step_time)
            if config.eval_every and self.state.step % config.eval_every == 0:
                self._timed_evaluate()
            if self.chess_eval:
                self.chess_eval.maybe_run(self.model, self.state.step, autocast=self.autocast)
            if decision.stop and not self._end_of_leg(decision.stop).finish:
                self.stop.consume_stop_file()  # handled: the next run must not stop at once
                self.probes.close()
                return {
                    "status": "interrupted",
                    "reason": decision.stop,
                    "last": last,
                    "eval": None,
                    "seconds": time.perf_counter() - started,
                }
            if decision.save and self.last_saved_step != self.state.step:
                self._periodic_save()
            watch.lap()  # eval and save time is not step time
        self.probes.close()
        final_eval = None
        if not config.eval_every or self.state.step % config.eval_every:
            final_eval = self.evaluate()
        if self.chess_eval:
            self.chess_eval.maybe_run(
                self.model, self.state.step, final=True, autocast=self.autocast
            )
        if self.checkpointing and self.last_saved_step != self.state.step:
            self.save_checkpoint()
        return {
            "status": "completed",
            "reason": "max_training_steps",
            "last": last,
            "eval": final_eval,
            "seconds": time.perf_counter() - started,
        }

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

    def _timed_evaluate(self) -> None:
        watch = Stopwatch()
        self.evaluate()
        self.eval_seconds = watch.lap()  # for the estimate of the work left (_end_of_leg)

    def _end_of_leg(self, reason: str) -> LegEnd:
        """Collective. A stop was requested: save this step, then either finish the run in this
        job (the stop came at the last step, or the rest fits in the time left) or end the leg
        so that the next one resumes. Saving first keeps the work if a preemption, not the
        time limit, sent the request."""
        step = self.state.step
        if self.last_saved_step != step:
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
        if leg.finish:
            message = (
                f"finishing in this job instead of requeueing (stop at step {step}: {reason}): "
                f"{leg.why}"
            )
            self.log.event("finishing", message, step=step, reason=reason)
        else:
            message = (
                f"stopping at step {step}: {reason}; not finishing in this job: {leg.why}; "
                "the checkpoint is saved "
                "(rerun the same command to resume; a requeued job does)"
            )
            self.log.event("stopping", message, step=step, reason=reason)
        return leg

    def _periodic_save(self) -> None:
        try:
            self.save_checkpoint()
        except CheckpointError as err:  # keep training: the next save may succeed
            self.log.event("checkpoint_failed", f"checkpoint: {err}", step=self.state.step)

    def _seed_step(self) -> None:
        """Random state as a pure function of (seed, step, rank): dropout masks of a resumed
        run are those of the uninterrupted one, without saving RNG states."""
        seed = np.random.SeedSequence([self.config.seed, self.state.step, self.env.rank])
        torch.manual_seed(int(seed.generate_state(1, dtype=np.uint64)[0] >> 1))

    def _is_log_step(self, step: int) -> bool:
        return step % self.config.log_every == 0 or step == self.config.max_training_steps

    def step_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of optimizer step `step` (counted from 0), on the host."""
        micro = self.sampler.micro_batches(step, self.env.rank)
        return [self.train_blocks.batch(indices) for indices in micro]

    def train_step(
        self,
        micro_batches: list[dict[str, torch.Tensor]] | None = None,
        *,
        global_counts: list[float] | None = None,
        check: bool = True,
    ) -> dict[str, Any]:
        """One optimizer step over `gradient_accumulation_steps` micro-batches.

        micro_batches: this rank's batches (default: those of the current step).
        global_counts: [target tokens, non-pad tokens] of the step summed over all ranks, when
        the caller has reduced them already (`train` does, with the stop decision); else one
        all-reduce of host scalars here.
        check: read the step's loss and gradient norm on the host and check them before the
        update (one host-device sync: log steps). Otherwise nothing waits for the device; a
        non-finite gradient norm is recorded on the device and found on the next checked step
        or before any save (`check_weights_finite`), so no non-finite weights are ever saved.
        """
        batches = self.step_batches(self.state.step) if micro_batches is None else micro_batches
        # Normalise by the target tokens of the whole step (all micro-batches, all ranks), so
        # any split of the same total batch gives the same update (torchtitan does the same).
        if global_counts is None:
            global_counts = dist_utils.all_reduce_host_sum(_local_counts(batches))
        global_targets, global_tokens = global_counts

        loss_sum = torch.zeros((), dtype=torch.float64, device=self.env.device)
        for index, batch in enumerate(batches):
            sync = index == len(batches) - 1 or not self.config.defer_grad_sync
            with gradient_sync_context(self.model, sync):
                loss_sum += self.forward_backward_step(batch, global_targets)

        grad_norm = self._clip_gradients()
        loss = norm = None
        if check:
            loss, norm = self._check_step(loss_sum, grad_norm, global_targets)
        elif grad_norm is not None and self.scaler is None:
            self._record_nonfinite(grad_norm)
        if self.scaler is not None:  # skips steps with inf/NaN gradients itself
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "loss": loss,
            "grad_norm": norm,
            "lr": lr,
            "tokens": int(global_tokens),
            "batch_id": self.sampler.batch_fingerprint(self.state.step) if check else None,
        }

    def forward_backward_step(
        self, batch: dict[str, torch.Tensor], global_targets: float
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its summed token loss (detached)."""
        input_ids = batch["input_ids"].to(self.env.device, non_blocking=True)
        labels = batch["labels"].to(self.env.device, non_blocking=True)
        with self.autocast():
            logits = self.model(
                input_ids=input_ids,
                position_ids=batch_position_ids(batch, self.env.device),
                use_cache=False,
            ).logits
        loss_sum = token_loss_sum(logits, labels)
        # FSDP and DDP average gradients over ranks; multiplying by the world size turns that
        # average into the sum over all ranks' tokens, divided by the global token count.
        loss = loss_sum * (self.env.world_size / max(global_targets, 1.0))
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()
        return loss_sum.detach().to(torch.float64)

    def _clip_gradients(self) -> torch.Tensor | None:
        """Clip to --grad_clip and return the global gradient norm, on the device (no sync)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return None
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if hasattr(norm, "full_tensor"):  # DTensor (FSDP2): combine the shards' norms
            norm = norm.full_tensor()
        return norm

    # --- non-finite loss and gradients ----------------------------------------------------

    # Step (1-based) of the first non-finite gradient norm among the steps not checked on the
    # host, as a 0-d float64 tensor on the device (inf: none); None before the first such step.
    _nonfinite_step: torch.Tensor | None = None
    last_saved_step: int = -1

    def _check_step(
        self, loss_sum: torch.Tensor, grad_norm: torch.Tensor | None, global_targets: float
    ) -> tuple[float, float | None]:
        """The checked step's scalars, before the update: one all-reduce (the loss) and one
        host-device sync for the loss, the gradient norm and the record of unchecked steps."""
        loss_sum = dist_utils.all_reduce_sum(loss_sum)
        device = loss_sum.device
        nan = torch.full((), math.nan, dtype=torch.float64, device=device)
        parts = [
            loss_sum,
            nan if grad_norm is None else grad_norm.to(device, torch.float64),
            nan if self._nonfinite_step is None else self._nonfinite_step.to(device),
        ]
        total, norm, unchecked_bad = torch.stack(parts).tolist()
        step = self.state.step + 1
        if self._nonfinite_step is not None and math.isfinite(unchecked_bad):
            raise self._diverged_earlier(int(unchecked_bad), f"at step {step}")
        loss = total / max(global_targets, 1)
        if not math.isfinite(loss):
            raise TrainingDivergedError(
                f"The loss is {loss} at step {step} (before the update, so the weights are "
                "still finite). Lower --learning_rate, use bf16-mixed instead of fp16-mixed, "
                "or check the data."
            )
        if grad_norm is None:
            return loss, None
        if not math.isfinite(norm) and self.scaler is None:
            raise TrainingDivergedError(
                f"The gradient norm is {norm} at step {step}, with a finite loss ({loss:.4f}). "
                "The update was not applied, so the weights are still finite"
                + self._last_checkpoint_note()
                + ". Lower --learning_rate, keep --grad_clip on, use bf16-mixed instead of "
                "bf16-true, or check the data."
            )
        return loss, norm

    def _record_nonfinite(self, grad_norm: torch.Tensor) -> None:
        """Remember the first unchecked step whose gradient norm is not finite, on the device:
        no sync. The norm is global, so every rank records the same step."""
        if self._nonfinite_step is None:
            self._nonfinite_step = torch.full(
                (), math.inf, dtype=torch.float64, device=grad_norm.device
            )
        seen = self._nonfinite_step
        clean = torch.isfinite(grad_norm) | torch.isfinite(seen)
        self._nonfinite_step = torch.where(clean, seen, float(self.state.step + 1))

    def check_weights_finite(self, before: str) -> None:
        """Collective-safe guard (every rank holds the same record): raise before `before`
        (a save, the final model) if an unchecked step had a non-finite gradient norm."""
        if self._nonfinite_step is None:
            return
        first = float(self._nonfinite_step)  # a host-device sync, but saves are rare
        if math.isfinite(first):
            raise self._diverged_earlier(int(first), f"before {before} at step {self.state.step}")

    def _diverged_earlier(self, first: int, found: str) -> TrainingDivergedError:
        return TrainingDivergedError(
            f"The gradient norm was not finite at step {first} (found {found}: steps between "
            f"log steps are checked without waiting for the device; --log_every "
            f"{self.config.log_every}). The weights are not finite since that update and were "
            f"not saved{self._last_checkpoint_note()}. Resume with a lower --learning_rate, "
            "keep --grad_clip on, or use --log_every 1 to check every step before its update."
        )

    def _last_checkpoint_note(self) -> str:
        if self.last_saved_step > 0:
            return f"; the last checkpoint (step {self.last_saved_step}) is good"
        return ""

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any] | None:
        if len(self.eval_blocks) == 0:
            return None
        self.model.eval()
        batches = eval_batches(
            len(self.eval_blocks),
            self.plan.batch_size_per_device,
            self.env.rank,
            self.env.world_size,
            self.config.eval_batches,
        )
        totals = torch.zeros(2, dtype=torch.float64, device=self.env.device)
        for indices in batches:
            batch = self.eval_blocks.batch(indices)
            input_ids = batch["input_ids"].to(self.env.device)
            labels = batch["labels"].to(self.env.device)
            with self.autocast():
                logits = self.model(
                    input_ids=input_ids,
                    position_ids=batch_position_ids(batch, self.env.device),
                    use_cache=False,
                ).logits
            totals[0] += token_loss_sum(logits, labels)
            totals[1] += count_targets(labels)
        self.model.train()
        loss_sum, tokens = dist_utils.all_reduce_sum(totals).tolist()
        if tokens == 0:
            return None
        loss = loss_sum / tokens
        metrics = {
            "step": self.state.step,
            "eval_loss": loss,
            "eval_perplexity": math.exp(min(loss, 50.0)),
            "eval_tokens": int(tokens),
        }
        self.log.eval(metrics)
        return metrics

    def _log_step(self, metrics: dict[str, Any], step_time: float) -> dict[str, Any]:
        tokens_per_s = metrics["tokens"] / step_time if step_time > 0 else 0.0
        per_device = tokens_per_s / self.env.world_size
        mfu = (
            100.0 * self.flops_per_token * per_device / (self.peak_tflops * 1e12)
            if self.peak_tflops
            else None
        )
        record = {
            "step": self.state.step,
            "loss": metrics["loss"],
            "lr": metrics["lr"],
            "grad_norm": metrics["grad_norm"],
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": per_device,
            "mfu_pct": mfu,
            "step_time_s": step_time,
            # Rank 0's CPU seconds so far: against the step time, how host-bound the loop is
            # (and a load-independent figure for bench/throughput.py).
            "process_cpu_s": time.process_time(),
            "tokens_seen": self.state.tokens_seen,
            "batch_id": metrics["batch_id"],
            **memory_snapshot(self.env.device),
        }
        self.log.step(record)
        return record

    # --- end ------------------------------------------------------------------------------

    def save_final_model(self) -> Path | None:
        if self.config.no_final_save:
            return None
        from fsdp_utils.checkpoint.hf_folder import save_hf_model

        self.check_weights_finite("writing the final model")
        watch = Stopwatch()
        model = cast(nn.Module, self.model.module) if self.config.no_fsdp else self.model
        if self.config.lora:  # a PEFT adapter folder (+ the merged model with --merge)
            from fsdp_utils.checkpoint.lora_adapters import save_lora_model

            path = save_lora_model(
                model, self.config, self.hf_config, self.layout, self.model_dir, self.env.is_main
            )
        else:
            path = save_hf_model(
                model, self.hf_config, self.layout.final_model, self.model_dir, self.env.is_main,
                export_dtype=self.config.export_dtype,
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

    def write_status(self, status: str, reason: str) -> None:
        """How this run ended, for the sbatch script (requeue or not) and for people."""
        if not self.env.is_main:
            return
        record = {"status": status, "reason": reason, "step": self.state.step,
                  "max_training_steps": self.config.max_training_steps,
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
        tmp = self.layout.status.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(record, indent=2))
            tmp.replace(self.layout.status)
        except OSError as err:  # e.g. the disk is full: say so, but keep the real error
            self.log.info(f"warning: could not write {self.layout.status}: {err}")
            tmp.unlink(missing_ok=True)

    def close(self) -> None:
        self.log.close()


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None
