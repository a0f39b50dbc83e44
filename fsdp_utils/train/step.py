"""One optimizer step: forward and backward over the micro-batches, gradient clipping, the
non-finite checks, the optimizer and scheduler step (torchtitan's `train_step` ->
`forward_backward_step`).

`TrainStep` holds what a step needs (model, optimizer, scheduler, gradient scaler) and nothing
about where the batches come from, the run folder or the log: the Trainer, the memory planner's
tracer (`fsdp_utils.plan.estimate`, on fake tensors) and the tests build it through its
constructor and hand it the micro-batches.

The loss is normalised by the target tokens of the whole step (all micro-batches, all ranks), so
any split of the same total batch gives the same update.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import IGNORE_INDEX, batch_position_ids, next_token_labels
from fsdp_utils.data.document_masking import known_packing, packing_from_host
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.parallelize import gradient_sync_context
from fsdp_utils.parallel.sequence import FORWARD_KEYWORD as SEQUENCE_PARALLEL_KEYWORD
from fsdp_utils.parallel.sequence import SequenceParallel
from fsdp_utils.train.loss import (
    LossChunking,
    Targets,
    batch_targets,
    chunked_target_nll,
    entropy_from_logits,
    logprobs_from_logits,
    next_token_loss_sum,
    output_layer,
    run_chunking,
    scatter_logprobs,
)
from fsdp_utils.train.optim import (
    apply_settings,
    build_optimizer,
    build_scheduler,
    describe_changes,
    optimizer_settings,
    settings_in_optimizer,
)
from fsdp_utils.train.router_loss import RouterLoss

Batch = dict[str, torch.Tensor]


class TrainingDivergedError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite."""


class StepInterrupted(Exception):
    """A stop request honoured inside a step, before its update: a method whose step does long
    work first (GRPO's rollout) asks for stops as it goes. The weights are as before the step;
    what the step did is in its checkpoint state (`TrainStep.checkpoint_files`); the trainer
    saves it and ends the leg, and the next leg's step goes on from there."""

    def __init__(self, reason: str, during: str) -> None:
        super().__init__(f"{reason} during {during}")
        self.reason = reason
        self.during = during


class StepFailed(StepInterrupted):
    """Something outside the run that a step needs failed for good (a reward's chess engine
    that kept dying after its restarts): the trainer saves what the step did, as for a stop,
    then the run ends with `message` (one paragraph naming what failed; exit 1, not a user
    mistake's 2), and the same command resumes once the outside thing works again."""

    def __init__(self, message: str, during: str) -> None:
        super().__init__("an outside failure", during)
        self.message = message

    def __str__(self) -> str:
        return self.message


def model_forward(
    model: nn.Module,
    batch: Batch,
    device: torch.device,
    autocast: Callable[[], Any],
    **extra: Any,
) -> Any:
    """The model's outputs for a batch, as training and evaluation call it: with the batch's
    per-document position ids when it has them, and never an attention mask or a KV cache
    (either makes transformers ignore the position ids for packing: data/document_masking.py).
    `extra`: keyword arguments of the forward (`output_router_logits` for the router loss, a
    sequence-parallel slice's `sequence_parallel`: fsdp_utils/parallel/sequence.py)."""
    input_ids = batch["input_ids"].to(device, non_blocking=True)
    host_packing = (
        contextlib.nullcontext()
        if SEQUENCE_PARALLEL_KEYWORD in extra
        else known_packing(batch.get("position_ids"))
    )
    with autocast(), host_packing:
        return model(
            input_ids=input_ids,
            position_ids=batch_position_ids(batch, device),
            use_cache=False,
            **extra,
        )


HiddenLoss = Callable[[nn.Module, torch.Tensor, Targets], torch.Tensor]


def forward_target_chunks(
    model: nn.Module,
    batch: Batch,
    device: torch.device,
    autocast: Callable[[], Any],
    loss_of_hidden: HiddenLoss,
    **extra: Any,
) -> tuple[Any, torch.Tensor, Targets]:
    """`model_forward` whose output layer runs on the target positions only, through
    `loss_of_hidden(output layer, last hidden states, targets)` (train/loss.py's chunks): the
    model's outputs (logits of no position), what `loss_of_hidden` returned, and where the
    targets are.

    Two hooks for the length of the forward: the output layer gets no positions (the hidden
    states it would have got are kept), and `loss_of_hidden` runs at the end of the outermost
    module's forward, before FSDP's post-forward hook: FSDP still holds the root's parameters
    (the output layer's among them) gathered, and the result joins the outputs (as `loss`), on
    which FSDP hangs its pre-backward hook that gathers them again for the chunks'
    recompute."""
    targets = Targets.of(next_token_labels(batch), batch["input_ids"].shape[1]).to(device)
    head = output_layer(model)
    hidden: list[torch.Tensor] = []

    def stop_before_head(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden.append(args[0])
        return (args[0][:, :0], *args[1:])

    def chunks_in_forward(module: nn.Module, args: Any, outputs: Any) -> Any:
        assert len(hidden) == 1, "the output layer ran more than once in a forward"
        stop.remove()  # the chunks call the output layer themselves
        # In the outputs' `loss` field (None without labels): FSDP hooks only dataclass fields
        outputs["loss"] = loss_of_hidden(head, hidden[0], targets)
        return outputs

    stop = head.register_forward_pre_hook(stop_before_head)
    run = model.register_forward_hook(chunks_in_forward, prepend=True)
    try:
        outputs = model_forward(model, batch, device, autocast, **extra)
    finally:
        stop.remove()
        run.remove()
    return outputs, outputs.loss, targets


def forward_target_nll(
    model: nn.Module,
    batch: Batch,
    device: torch.device,
    autocast: Callable[[], Any],
    chunking: LossChunking,
    *,
    summed: bool = False,
    entropy: list[torch.Tensor] | None = None,
    **extra: Any,
) -> tuple[Any, torch.Tensor, Targets]:
    """`model_forward` with the loss in chunks (train/loss.py, `forward_target_chunks`): the
    model's outputs, -log p of each target token (`summed`: their sum), where the targets are.
    `entropy`: a list that gets the targets' entropies (`chunked_target_nll`)."""

    def nll(head: nn.Module, hidden: torch.Tensor, targets: Targets) -> torch.Tensor:
        return chunked_target_nll(
            head, hidden, targets, chunk_size=chunking.chunk_size,
            transform=chunking.transform, summed=summed, entropy=entropy,
            compiled=chunking.compiled,
        )  # fmt: skip

    return forward_target_chunks(model, batch, device, autocast, nll, **extra)


def forward_loss_sum(
    model: nn.Module,
    batch: Batch,
    device: torch.device,
    autocast: Callable[[], Any],
    chunking: LossChunking,
    **extra: Any,
) -> tuple[Any, torch.Tensor]:
    """The model's outputs and the summed token loss of a batch, in chunks or not (`chunking`)."""
    if chunking.chunk_size:
        outputs, total, _ = forward_target_nll(
            model, batch, device, autocast, chunking, summed=True, **extra
        )
        return outputs, total
    outputs = model_forward(model, batch, device, autocast, **extra)
    following = next_token_labels(batch).to(device, non_blocking=True)
    return outputs, next_token_loss_sum(outputs.logits, following)


def token_logprobs(
    model: nn.Module,
    batch: Batch,
    *,
    chunking: LossChunking,
    device: torch.device,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    **extra: Any,
) -> torch.Tensor:
    """[batch, seq - 1] fp32 (a sequence-parallel slice: [batch, slice]): log p(labels[:, t + 1])
    given the tokens up to t, 0 where the label is ignored (-100), through the same forward and
    chunks as the training loss; differentiable (preference tuning) unless called under
    torch.no_grad (evaluation). `extra`: keyword arguments of the forward."""
    following = next_token_labels(batch)
    if chunking.chunk_size:
        _, nll, targets = forward_target_nll(model, batch, device, autocast, chunking, **extra)
        return scatter_logprobs(nll, targets, following.shape)
    logits = model_forward(model, batch, device, autocast, **extra).logits
    return logprobs_from_logits(logits, following.to(device))


def token_logprobs_and_entropy(
    model: nn.Module,
    batch: Batch,
    *,
    chunking: LossChunking,
    device: torch.device,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` at a sampling `temperature` (the logits divided by it), and the entropy
    of each position's distribution beside it (detached: a metric), both [batch, seq - 1] fp32,
    0 where the label is ignored: what a policy-gradient loss reads (GRPO)."""
    following = next_token_labels(batch)
    if chunking.chunk_size:
        entropies: list[torch.Tensor] = []
        _, nll, targets = forward_target_nll(
            model, batch, device, autocast, chunking.at_temperature(temperature), entropy=entropies
        )
        (entropy,) = entropies
        logps = scatter_logprobs(nll, targets, following.shape)
        return logps, -scatter_logprobs(entropy, targets, following.shape)
    logits = model_forward(model, batch, device, autocast).logits / temperature
    following = following.to(device)
    return logprobs_from_logits(logits, following), entropy_from_logits(logits, following)


def local_counts(batches: list[Batch]) -> list[float]:
    """[target tokens, non-pad tokens] of this rank's micro-batches (host tensors: no sync)."""
    targets = sum(batch_targets(b) for b in batches)
    tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    return [float(targets), float(tokens)]


def describe_sync_free(config: TrainConfig, step: TrainStep) -> str:
    """The log's line on --sync_free_steps: what is read when, and what still waits."""
    line = (
        f"sync-free steps: the loss and gradient norm read back on log steps only (every "
        f"{config.log_every}), after their update is queued; non-finite values found there or "
        "before a save"
    )
    if config.log_every == 1:
        line += "; --log_every 1 reads every step: raise it to leave steps without a read"
    if step.scaler is not None and not getattr(step.optimizer, "_step_supports_amp_scaling", False):
        line += (
            "; fp16-mixed's gradient scaler still reads its inf check every step (torch's "
            "GradScaler), unless the optimizer is fused (--fused_optimizer: its kernel skips "
            "the step on the device)"
        )
    if config.liger_kernels:  # its FLCE counts the targets on the device (liger-kernel 0.8.5)
        line += (
            "; --liger_kernels' fused linear cross-entropy reads its target count once per "
            "micro-batch (target_mask.sum().item() in its forward)"
        )
    return line


def make_grad_scaler(config: TrainConfig, device: torch.device) -> Any:
    """fp16-mixed needs a gradient scaler; on sharded gradients each rank sees only its shard,
    so the found-inf flag is all-reduced (ShardedGradScaler)."""
    if config.precision != "fp16-mixed":
        return None
    if config.no_fsdp:
        return torch.amp.GradScaler(device.type)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device.type)


def build_train_step(
    model: nn.Module,
    config: TrainConfig,
    *,
    world_size: int,
    device: torch.device,
    hf_config: Any,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    grad_scaler: bool = True,
    step_class: type[TrainStep] | None = None,
    **step_options: Any,
) -> TrainStep:
    """The step of a run: its optimizer (`optim.build_optimizer`), schedule, gradient scaler
    (fp16-mixed, unless `grad_scaler` is False) and router loss (mixture of experts).
    `step_class` and `step_options`: another TrainStep and its own arguments, or other values of
    TrainStep's (preference tuning: fsdp_utils/methods/dpo/step.py)."""
    optimizer = build_optimizer(model, config)
    options = {
        "router_loss": RouterLoss.build(config, hf_config),
        "chunking": run_chunking(config, hf_config, device),
        **step_options,
    }
    return (step_class or TrainStep)(
        model,
        optimizer,
        build_scheduler(optimizer, config),
        config=config,
        world_size=world_size,
        device=device,
        scaler=make_grad_scaler(config, device) if grad_scaler else None,
        autocast=autocast,
        **options,
    )


@dataclass
class PendingScalars:
    """A log step's loss sum, gradient norm and record of non-finite steps under
    --sync_free_steps, on their way to the host: copied without blocking (into pinned memory
    on CUDA, with an event), read by `TrainStep.read_pending` once the update is queued."""

    step: int
    global_targets: float
    values: torch.Tensor  # [loss sum, grad norm (nan: none), first non-finite step (nan: none)]
    done: Any = None  # a torch.cuda.Event after the copy; None on the CPU

    @classmethod
    def copy(cls, parts: list[torch.Tensor], step: int, global_targets: float) -> PendingScalars:
        stacked = torch.stack(parts)
        if stacked.device.type != "cuda":
            return cls(step, global_targets, stacked)
        host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
        host.copy_(stacked, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(step, global_targets, host, done)

    def read(self) -> list[float]:
        """The host's one wait for the device: for this copy, queued before the update."""
        if self.done is not None:
            self.done.synchronize()
        return [float(v) for v in self.values.tolist()]


class TrainStep:
    """Runs optimizer steps; `__call__` is one.

    A non-finite gradient norm on a step that is not checked on the host (`check=False`: no
    host-device sync) is recorded on the device and found on the next checked step or before
    any save (`check_weights_finite`), so no non-finite weights are ever saved. With
    --sync_free_steps no step is checked before its update: a log step's values come back
    without blocking (`PendingScalars`) and are read after its update is queued
    (`read_pending`), with the same record.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        *,
        config: TrainConfig,
        world_size: int,
        device: torch.device,
        scaler: Any = None,
        autocast: Callable[[], Any] = contextlib.nullcontext,
        router_loss: RouterLoss | None = None,
        chunking: LossChunking | None = None,
        sequence_parallel: SequenceParallel | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.config = config
        self.world_size = world_size
        self.device = device
        self.scaler = scaler
        self.autocast = autocast
        self.router_loss = router_loss  # mixture of experts: load balancing (train/router_loss.py)
        # The loss in chunks of target tokens (train/loss.py); unchunked unless given.
        self.chunking = chunking or LossChunking(0)
        # Micro-batches of sequence-parallel slices split their attention over this group; the
        # loss needs nothing else: each target token is on one rank, counted in global_targets.
        self.sequence_parallel = sequence_parallel or SequenceParallel()
        # Step (1-based) of the first non-finite gradient norm among the steps not checked on
        # the host, as a 0-d float64 tensor on the device (inf: none); None before any such step.
        self._nonfinite_step: torch.Tensor | None = None
        # The newest checkpoint's step, for the messages of a diverged run (-1: none).
        self.last_saved_step = -1

    def __call__(
        self,
        micro_batches: list[Batch],
        *,
        step: int,
        global_counts: list[float] | None = None,
        check: bool = True,
    ) -> dict[str, Any]:
        """Optimizer step number `step` (1-based, as logged) over this rank's micro-batches.

        global_counts: [target tokens, non-pad tokens] of the step summed over all ranks, when
        the caller has reduced them already (the Trainer does, with the stop decision); else one
        all-reduce of host scalars here.
        check: read the step's loss and gradient norm on the host and check them before the
        update (one host-device sync: log steps); with --sync_free_steps, copy them back
        without waiting instead, as `metrics["pending"]`, for `read_pending` after the update
        is queued.
        """
        if global_counts is None:
            global_counts = dist_utils.all_reduce_host_sum(self.local_counts(micro_batches))
        global_targets, global_tokens = global_counts

        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        # --sync_free_steps: the forwards take their packing from the host (known_packing)
        host_packing = (
            packing_from_host() if self.config.sync_free_steps else contextlib.nullcontext()
        )
        with host_packing:
            for index, batch in enumerate(micro_batches):
                sync = index == len(micro_batches) - 1 or not self.config.defer_grad_sync
                with gradient_sync_context(self.model, sync):
                    loss_sum += self.forward_backward(batch, global_targets)

        grad_norm = self.clip_gradients()
        loss = norm = None
        pending = None
        deferred = check and self.config.sync_free_steps
        if check and not deferred:
            loss, norm = self._check(loss_sum, grad_norm, global_targets, step)
        elif grad_norm is not None and self.scaler is None:
            self._record_nonfinite(grad_norm, step)
        if deferred:  # queued before the update: the copy does not wait for it
            pending = PendingScalars.copy(self._scalars(loss_sum, grad_norm), step, global_targets)
        if self.scaler is not None:  # skips steps with inf/NaN gradients itself
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, Any] = {
            "loss": loss, "grad_norm": norm, "lr": lr, "tokens": int(global_tokens)
        }  # fmt: skip
        if pending is not None:
            metrics["pending"] = pending
        if self.router_loss is not None:  # its own all-reduce, on checked steps only
            if check:
                metrics["aux_loss"] = self.router_loss.step_value(global_targets)
            else:
                self.router_loss.reset()
        return metrics

    def local_counts(self, batches: list[Batch]) -> list[float]:
        """What the step's loss is normalised by, and its tokens: `local_counts` (preference
        tuning counts pairs: fsdp_utils/methods/dpo/step.py)."""
        return local_counts(batches)

    def forward_backward(self, batch: Batch, global_targets: float) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its summed token loss (detached)."""
        router = self.router_loss
        extra = {
            **(router.forward_kwargs if router is not None else {}),
            **self.sequence_parallel.forward_kwargs(),
        }
        outputs, loss_sum = forward_loss_sum(
            self.model, batch, self.device, self.autocast, self.chunking, **extra
        )
        objective = loss_sum
        if router is not None:  # weighted by this micro-batch's targets (train/router_loss.py)
            objective = loss_sum + router.objective_term(outputs, batch_targets(batch))
        self.backward(objective, global_targets)
        return loss_sum.detach().to(torch.float64)

    def backward(self, objective: torch.Tensor, global_targets: float) -> None:
        """Backward of a micro-batch's summed objective, normalised by the step's count (of all
        micro-batches and ranks) and scaled for fp16-mixed. FSDP and DDP average gradients over
        ranks; multiplying by the world size turns that average into the sum over all ranks'
        tokens, divided by the global token count."""
        loss = objective * (self.world_size / max(global_targets, 1.0))
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def clip_gradients(self) -> torch.Tensor | None:
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

    # --- checkpointed state ---------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the step besides the optimizer's tensors: the settings the
        optimizer ran with (so a resume can say what changed) and the gradient scaler's."""
        return {
            "optimizer_settings": optimizer_settings(self.config),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def checkpoint_files(self) -> dict[str, Any]:
        """Collective: files the checkpoint keeps beside the shards ({name: picklable object},
        rank 0's written with torch.save): a method's work between steps (GRPO's rollouts
        reused over several steps, or done before a stop). Nothing by default."""
        return {}

    def resume(
        self, saved: dict[str, Any], start_step: int, *, folder: Path | None = None
    ) -> list[str]:
        """After the optimizer's tensors are loaded: the current config decides the learning
        rate, weight decay, betas and the schedule from `start_step` on (the loaded param groups
        carry the checkpoint's); the scaler continues. `folder`: the checkpoint's, where its
        `checkpoint_files` are. Returns what changed, one line each."""
        settings = saved.get("optimizer_settings") or settings_in_optimizer(self.optimizer)
        apply_settings(self.optimizer, self.config)
        self.scheduler = build_scheduler(self.optimizer, self.config, start_step=start_step)
        if self.scaler is not None and saved.get("scaler"):
            self.scaler.load_state_dict(saved["scaler"])
        return describe_changes(settings, self.config, start_step)

    # --- non-finite loss and gradients ----------------------------------------------------

    def _scalars(
        self, loss_sum: torch.Tensor, grad_norm: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """[the step's loss sum over all ranks (one all-reduce, on the device), its gradient
        norm, the first unchecked non-finite step], float64 on the device; nan where none."""
        loss_sum = dist_utils.all_reduce_sum(loss_sum)
        device = loss_sum.device
        nan = torch.full((), math.nan, dtype=torch.float64, device=device)
        return [
            loss_sum,
            nan if grad_norm is None else grad_norm.to(device, torch.float64),
            nan if self._nonfinite_step is None else self._nonfinite_step.to(device),
        ]

    def _check(
        self,
        loss_sum: torch.Tensor,
        grad_norm: torch.Tensor | None,
        global_targets: float,
        step: int,
    ) -> tuple[float, float | None]:
        """The checked step's scalars, before the update: one all-reduce (the loss) and one
        host-device sync for the loss, the gradient norm and the record of unchecked steps."""
        total, norm, unchecked_bad = torch.stack(self._scalars(loss_sum, grad_norm)).tolist()
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

    def read_pending(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """`metrics` of a --sync_free_steps log step with its loss and gradient norm read (the
        one wait for the device), after its update was queued: a non-finite value now means
        that update was applied, and the weights are not saved (`check_weights_finite` reads
        the same record before any save)."""
        pending: PendingScalars | None = metrics.pop("pending", None)
        if pending is None:
            return metrics
        total, norm, first_bad = pending.read()
        if math.isfinite(first_bad):
            raise self._diverged_earlier(int(first_bad), f"at step {pending.step}")
        loss = total / max(pending.global_targets, 1)
        if not math.isfinite(loss):
            raise TrainingDivergedError(
                f"The loss is {loss} at step {pending.step}, and with --sync_free_steps its "
                "update was applied before the loss was read: the weights may not be finite "
                f"since, and were not saved{self._last_checkpoint_note()}. Resume with a lower "
                "--learning_rate, use bf16-mixed instead of fp16-mixed, or check the data; "
                "without --sync_free_steps a log step's loss is checked before its update."
            )
        return {**metrics, "loss": loss, "grad_norm": None if math.isnan(norm) else norm}

    def _record_nonfinite(self, grad_norm: torch.Tensor, step: int) -> None:
        """Remember the first unchecked step whose gradient norm is not finite, on the device:
        no sync. The norm is global, so every rank records the same step."""
        if self._nonfinite_step is None:
            self._nonfinite_step = torch.full(
                (), math.inf, dtype=torch.float64, device=grad_norm.device
            )
        seen = self._nonfinite_step
        clean = torch.isfinite(grad_norm) | torch.isfinite(seen)
        self._nonfinite_step = torch.where(clean, seen, float(step))

    def check_weights_finite(self, before: str, step: int) -> None:
        """Collective-safe guard (every rank holds the same record): raise before `before`
        (a save, the final model) at `step` if an unchecked step had a non-finite gradient
        norm."""
        if self._nonfinite_step is None:
            return
        first = float(self._nonfinite_step)  # a host-device sync, but saves are rare
        if math.isfinite(first):
            raise self._diverged_earlier(int(first), f"before {before} at step {step}")

    def _diverged_earlier(self, first: int, found: str) -> TrainingDivergedError:
        if self.config.sync_free_steps:
            unchecked = "no step is checked before its update with --sync_free_steps"
            fix = (
                "drop --sync_free_steps (with --log_every 1) to check every step before its update"
            )
        else:
            unchecked = "steps between log steps are checked without waiting for the device"
            fix = "use --log_every 1 to check every step before its update"
        return TrainingDivergedError(
            f"The gradient norm was not finite at step {first} (found {found}: {unchecked}; "
            f"--log_every {self.config.log_every}). The weights are not finite since that "
            f"update and were not saved{self._last_checkpoint_note()}. Resume with a lower "
            f"--learning_rate, keep --grad_clip on, or {fix}."
        )

    def _last_checkpoint_note(self) -> str:
        if self.last_saved_step > 0:
            return f"; the last checkpoint (step {self.last_saved_step}) is good"
        return ""
