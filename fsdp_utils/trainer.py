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

from fsdp_utils import distributed as dist_utils
from fsdp_utils.checkpoint import Checkpointer, CheckpointError, CheckpointInfo, run_identity
from fsdp_utils.config import TrainConfig
from fsdp_utils.data import PreparedData, StepSampler, eval_batches, prepare_dataset
from fsdp_utils.distributed import DistEnv
from fsdp_utils.layout import RunLayout
from fsdp_utils.loss import IGNORE_INDEX, count_targets, token_loss_sum
from fsdp_utils.metrics import (
    RunLogger,
    Stopwatch,
    detect_peak_tflops,
    flops_per_token,
    memory_snapshot,
)
from fsdp_utils.model import (
    build_meta_model,
    checkpoint_key_map,
    load_pretrained_weights,
    materialize,
)
from fsdp_utils.optim import build_optimizer, build_scheduler
from fsdp_utils.parallelize import (
    autocast_context,
    build_parallel_model,
    fsdp_group_names,
    gradient_sync_context,
    wrap_ddp,
)
from fsdp_utils.preflight import check_batch_and_model
from fsdp_utils.timelimit import StopController


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or infinite."""


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


class Trainer:
    def __init__(self, config: TrainConfig, env: DistEnv) -> None:
        self.config = config
        self.env = env
        self.layout = RunLayout.of(config.output_dir)
        self.state = TrainState()
        # Fail fast, before any model or data is loaded: the preflight's own checks.
        self.plan, self.model_dir, self.hf_config = check_batch_and_model(config, env.world_size)
        if env.is_main:
            check_output_dir(self.layout.root)
        dist_utils.barrier()
        self.log = RunLogger(self.layout.metrics, env.is_main, config.max_training_steps)

    # --- setup ----------------------------------------------------------------------------

    def setup(self) -> None:
        config, env = self.config, self.env
        torch.manual_seed(config.seed)
        self._print_header()
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
        self.autocast = autocast_context(config, env.device)
        self.optimizer = build_optimizer(self.model, config)
        self.scheduler = build_scheduler(self.optimizer, config)
        self.scaler = self._grad_scaler()
        if resume_from is not None:
            self._resume(resume_from)
        self.stop = StopController(
            Path(config.stop_file) if config.stop_file else self.layout.default_stop_file,
            save_every_steps=config.save_every_steps,
            save_every_minutes=config.save_every_minutes,
            stop_after_steps=config.stop_after_steps,
            margin_minutes=config.time_limit_margin_minutes,
            is_main=env.is_main,
            device=env.device,
        )
        if self.stop.end_time_known():
            self.log.info(
                f"time limit: the job ends at {self.stop.end_time_text()}; saving and stopping "
                f"at least {self.stop.margin() / 60:.1f} min before"
            )
        self.flops_per_token = flops_per_token(
            self.hf_config, self.model_info.non_embedding_parameters, config.max_seq_length
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
        self.train_blocks = prepared.split("train")
        self.eval_blocks = prepared.split("eval")
        return prepared

    def _resume(self, info: CheckpointInfo) -> None:
        watch = Stopwatch()
        self.checkpointer.load(info, self.model, self.optimizer)
        meta = info.meta
        self.scheduler.load_state_dict(meta["scheduler"])
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

    def save_checkpoint(self) -> None:
        """Collective. A failed save is reported; the previous checkpoint stays usable."""
        extra = {
            "tokens_seen": self.state.tokens_seen,
            "scheduler": self.scheduler.state_dict(),
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
        if load_weights:  # a resumed run gets its weights from the checkpoint instead
            load_pretrained_weights(model, self.model_dir, key_map)
        if config.no_fsdp:
            model = wrap_ddp(model, env.device)
        info = self.model_info
        self.fsdp_groups = fsdp_group_names(model)
        self.log.info(
            f"model: {info.model_type}, {info.parameters / 1e6:,.2f}M parameters "
            f"({info.non_embedding_parameters / 1e6:,.2f}M non-embedding), "
            f"{info.decoder_layers} x {info.decoder_layer_class}; "
            f"{len(self.fsdp_groups)} FSDP shard group(s)"
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
        watch = Stopwatch()
        started = time.perf_counter()
        last: dict[str, Any] = {}
        while self.state.step < config.max_training_steps:
            self._seed_step()
            metrics = self.train_step()
            step_time = watch.lap()
            self.state.step += 1
            self.state.tokens_seen += metrics["tokens"]
            if (
                self.state.step % config.log_every == 0
                or self.state.step == config.max_training_steps
            ):
                last = self._log_step(metrics, step_time)
            if config.eval_every and self.state.step % config.eval_every == 0:
                self.evaluate()
            decision = self.stop.poll(self.state.step, step_time)
            if decision.stop:
                self.log.event(
                    "stopping",
                    f"stopping at step {self.state.step}: {decision.stop}; saving a checkpoint "
                    "(rerun the same command to resume)",
                    step=self.state.step,
                    reason=decision.stop,
                )
                if self.last_saved_step != self.state.step:
                    self.save_checkpoint()
                self.stop.consume_stop_file()  # handled: the next run must not stop at once
                return {
                    "status": "interrupted",
                    "reason": decision.stop,
                    "last": last,
                    "eval": None,
                    "seconds": time.perf_counter() - started,
                }
            if decision.save:
                self._periodic_save()
            watch.lap()  # eval and save time is not step time
        final_eval = None
        if not config.eval_every or self.state.step % config.eval_every:
            final_eval = self.evaluate()
        if self.checkpointing and self.last_saved_step != self.state.step:
            self.save_checkpoint()
        return {
            "status": "completed",
            "reason": "max_training_steps",
            "last": last,
            "eval": final_eval,
            "seconds": time.perf_counter() - started,
        }

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

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over `gradient_accumulation_steps` micro-batches."""
        micro = self.sampler.micro_batches(self.state.step, self.env.rank)
        batches = [self.train_blocks.batch(indices) for indices in micro]
        # Normalise by the target tokens of the whole step (all micro-batches, all ranks), so
        # any split of the same total batch gives the same update (torchtitan does the same).
        counts = torch.tensor(
            [
                sum(count_targets(b["labels"]) for b in batches),
                sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches),
            ],
            dtype=torch.float64,
            device=self.env.device,
        )
        global_targets, global_tokens = dist_utils.all_reduce_sum(counts).tolist()

        loss_sum = torch.zeros((), dtype=torch.float64, device=self.env.device)
        for index, batch in enumerate(batches):
            sync = index == len(batches) - 1 or not self.config.defer_grad_sync
            with gradient_sync_context(self.model, sync):
                loss_sum += self.forward_backward_step(batch, global_targets)

        loss = dist_utils.all_reduce_sum(loss_sum).item() / max(global_targets, 1)
        if not math.isfinite(loss):
            raise TrainingDivergedError(
                f"The loss is {loss} at step {self.state.step + 1} (before the update, so the "
                "weights are still finite). Lower --learning_rate, use bf16-mixed instead of "
                "fp16-mixed, or check the data."
            )
        grad_norm = self._clip_gradients()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": int(global_tokens),
            "batch_id": self.sampler.batch_fingerprint(self.state.step),
        }

    def forward_backward_step(
        self, batch: dict[str, torch.Tensor], global_targets: float
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its summed token loss (detached)."""
        input_ids = batch["input_ids"].to(self.env.device, non_blocking=True)
        labels = batch["labels"].to(self.env.device, non_blocking=True)
        with self.autocast():
            logits = self.model(input_ids=input_ids, use_cache=False).logits
        loss_sum = token_loss_sum(logits, labels)
        # FSDP and DDP average gradients over ranks; multiplying by the world size turns that
        # average into the sum over all ranks' tokens, divided by the global token count.
        loss = loss_sum * (self.env.world_size / max(global_targets, 1.0))
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()
        return loss_sum.detach().to(torch.float64)

    def _clip_gradients(self) -> float | None:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return None
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if hasattr(norm, "full_tensor"):  # DTensor (FSDP2): combine the shards' norms
            norm = norm.full_tensor()
        return float(norm)

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
                logits = self.model(input_ids=input_ids, use_cache=False).logits
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
        from fsdp_utils.export import save_hf_model

        watch = Stopwatch()
        model = cast(nn.Module, self.model.module) if self.config.no_fsdp else self.model
        path = save_hf_model(
            model, self.hf_config, self.layout.final_model, self.model_dir, self.env.is_main,
            export_dtype=self.config.export_dtype,
        )  # fmt: skip
        dist_utils.barrier()
        self.log.event(
            "final_model", f"model: saved to {path} in {watch.lap():.1f}s", path=str(path)
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
