"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save, find, resume, prune.

    <output_dir>/checkpoints/step_00000120/
        __0_0.distcp ...     every rank writes its own shards of model and optimizer state
                             (with --lora or --freeze_layers: of what trains only; the frozen
                             rest is the pretrained model's)
        .metadata            DCP's index: lets any world size load (resharding)
        hf/                  model config + tokenizer files (what export needs)
        checkpoint.json      written last: step, scheduler, scaler, file sizes, identity

A checkpoint is written to `step_XXXXXXXX.tmp` and renamed only once `checkpoint.json` is in
place, so a save interrupted by a kill, a full disk or the time limit is never picked up and
the previous checkpoint stays untouched (older ones are deleted only after a successful save).

What makes a resume exact: the data order is a pure function of the step (StepSampler) and
the random state is re-derived from (seed, step, rank) at every step (Trainer), so besides
model and optimizer shards a checkpoint needs only the step, the scheduler and the scaler.
That also holds when resuming on a different number of processes.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fsdp_utils.atomic import write_json_atomic
from fsdp_utils.checkpoint.hf_folder import copy_tokenizer_files
from fsdp_utils.config.job import JobLeg
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.formats import data_identity
from fsdp_utils.model import freeze
from fsdp_utils.model.lora import checkpoint_kind_mismatch, lora_identity, state_dict_options
from fsdp_utils.parallel import distributed as dist_utils

MARKER = "checkpoint.json"
HF_SUBDIR = "hf"
_NAME = re.compile(r"^step_(\d{8})$")

# Settings that must match for a checkpoint to continue a run: the model and its storage, the
# data and its order, and the optimizer. Batch per device, world size, learning rate and the
# number of steps may change.
IDENTITY_FIELDS = (
    "model",
    "revision",
    "dataset",
    "dataset_revision",
    "template",
    "text_field",
    "max_seq_length",
    "no_packing",
    "max_examples",
    "eval_examples",
    "seed",
    "optimizer",
    "precision",
)


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message says why and what to do."""


def run_identity(
    config: TrainConfig, total_batch_size: int, method: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """What a checkpoint must share with the run that resumes it. `method`: what the training
    method adds (`Method.identity`: DPO's name, so that an SFT checkpoint is not a DPO run's to
    continue, nor the reverse; DPO's beta and loss may change on resume, as the learning rate
    may)."""
    identity = {name: getattr(config, name) for name in IDENTITY_FIELDS}
    identity["dataset_include"] = config.resolved_dataset_include
    identity["total_batch_size"] = total_batch_size
    # LoRA and --freeze_layers runs only: a full fine-tune's identity stays as it always was.
    identity.update(lora_identity(config))
    identity.update(freeze.identity(config))
    identity.update(data_identity(config))  # masked formats' settings, when not the defaults
    identity.update(method or {})
    return identity


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    meta: dict[str, Any]


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def read_checkpoint(path: Path) -> CheckpointInfo:
    """A complete checkpoint, checked for missing or truncated files."""
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {MARKER}): it was being written when the "
            "job stopped. Resume from an older one, or use --resume auto."
        )
    try:
        meta = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{marker} is unreadable ({err}).") from err
    problems = []
    for name, size in meta.get("files", {}).items():
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != size:
            problems.append(f"{name} has {file.stat().st_size} bytes instead of {size}")
    if problems:
        raise CheckpointError(
            f"Checkpoint {path} is damaged: {'; '.join(problems[:5])}. Delete it to resume from "
            "the previous one (or pass --resume <older checkpoint>)."
        )
    return CheckpointInfo(path, int(meta["step"]), meta)


def list_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Complete checkpoints (marker present), oldest first. Damage is checked on load."""
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            match = _NAME.match(entry.name)
            if match and (entry / MARKER).is_file():
                try:
                    meta = json.loads((entry / MARKER).read_text())
                except (OSError, json.JSONDecodeError):
                    continue
                found.append(CheckpointInfo(entry, int(match.group(1)), meta))
    return sorted(found, key=lambda c: c.step)


def newest_intact_checkpoint(
    root: Path,
    warn: Any = print,
    *,
    accept: Callable[[CheckpointInfo], bool] = lambda _: True,
) -> CheckpointInfo | None:
    """The newest checkpoint in `root` that `accept`s and whose files are all there; a damaged
    one is reported through `warn` and skipped, never deleted."""
    for candidate in reversed(list_checkpoints(root)):
        if not accept(candidate):
            continue
        try:
            return read_checkpoint(candidate.path)
        except CheckpointError as err:
            warn(f"checkpoint: skipping {candidate.path}: {err}")
    return None


def requeued_leg_checkpoint(root: Path, job: JobLeg, warn: Any = print) -> CheckpointInfo | None:
    """On a requeued leg, the newest intact checkpoint this very job saved (its id is in
    checkpoint.json): the leg continues its own job, whatever `--resume` said at submission."""
    if not job.requeued:
        return None
    return newest_intact_checkpoint(
        root, warn, accept=lambda c: (c.meta.get("job") or {}).get("id") == job.job_id
    )


def _describe_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    return [
        f"{key}: checkpoint {saved.get(key)!r}, now {current.get(key)!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]


class Checkpointer:
    def __init__(
        self,
        root: Path,
        config: TrainConfig,
        identity: dict[str, Any],
        is_main: bool,
        device: torch.device,
        *,
        job: JobLeg | None = None,
    ) -> None:
        self.root = root
        self.job = job or JobLeg.from_env()  # recorded in checkpoint.json: whose save it is
        self.config = config
        self.identity = identity
        self.is_main = is_main
        self.device = device  # for the agreement all-reduces (nccl needs CUDA tensors)
        if is_main:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob("step_*.tmp"):  # an interrupted save of an earlier run
                shutil.rmtree(stale, ignore_errors=True)
        dist_utils.barrier()

    # --- which checkpoint to resume from -----------------------------------------------------

    def to_resume(self, warn: Any = print) -> CheckpointInfo | None:
        """The checkpoint `--resume` asks for; with `auto`, the newest intact one (a damaged
        newest checkpoint is reported and skipped, never deleted). A requeued leg resumes its
        own job's newest checkpoint instead: replaying `never` or a PATH on every leg would
        start each leg over."""
        choice = self.config.resume
        own = requeued_leg_checkpoint(self.root, self.job, warn)
        if own is not None:
            if choice != "auto":
                warn(
                    f"checkpoint: requeued leg ({self.job.describe()}): resuming this job's "
                    f"newest checkpoint {own.path}, not --resume {choice} again"
                )
            self.check_identity(own)
            return own
        if choice == "never":  # the previous run was set aside (fsdp_utils.run.start.start_run)
            return None
        if choice == "auto":
            newest = newest_intact_checkpoint(self.root, warn)
            if newest is not None:
                self.check_identity(newest)
            return newest
        path = Path(choice)
        if not path.is_dir():
            raise CheckpointError(
                f"--resume {choice}: no such checkpoint folder. Use --resume auto (the newest "
                f"in {self.root}) or --resume never."
            )
        info = read_checkpoint(path)
        self.check_identity(info)
        return info

    def check_identity(self, info: CheckpointInfo) -> None:
        mismatch = checkpoint_kind_mismatch(info.path, info.meta.get("identity", {}), self.identity)
        if mismatch:
            raise CheckpointError(mismatch)
        differences = _describe_differences(info.meta.get("identity", {}), self.identity)
        if differences:
            raise CheckpointError(
                f"Checkpoint {info.path} belongs to a different run: "
                + "; ".join(differences)
                + ". Use another --output_dir for a new run, or --resume never to start over "
                "in this one."
            )

    # --- save and load ----------------------------------------------------------------------

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, Any],
        hf_files: tuple[Any, Path],
        files: Mapping[str, Any] | None = None,
    ) -> tuple[Path, float]:
        """Collective. Returns (path, seconds). `files`: rank 0's {name: object} to keep beside
        the shards (torch.save; a method's state: `TrainStep.checkpoint_files`), counted in the
        sizes checked on resume. On failure the partial folder is removed and the previous
        checkpoints are untouched; raises CheckpointError."""
        started = time.perf_counter()
        final = self.root / checkpoint_name(step)
        tmp = final.with_name(final.name + ".tmp")
        ok = torch.tensor([1], device=self.device)
        error = ""
        try:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            dist_utils.barrier()
            model_state, optim_state = get_state_dict(
                model, optimizer, options=self._state_dict_options()
            )
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
        # CheckpointException is a BaseException: DCP's way of carrying every rank's failure.
        # Any failure must reach all ranks (below), not leave some of them in a collective.
        except (Exception, CheckpointException) as err:
            ok[0], error = 0, _root_cause(err)
        # Every rank must agree the shards are written before rank 0 seals the checkpoint.
        if int(dist_utils.all_reduce_min(ok).item()) == 1 and self.is_main:
            try:
                for name, value in (files or {}).items():
                    torch.save(value, tmp / name)
                self._seal(tmp, final, step, extra, hf_files, time.perf_counter() - started)
            except OSError as err:
                ok[0], error = 0, f"{type(err).__name__}: {err}"
        if int(dist_utils.all_reduce_min(ok).item()) == 0:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            previous = list_checkpoints(self.root)
            kept = f"; {previous[-1].path} is kept" if previous else ""
            raise CheckpointError(
                f"Saving the checkpoint of step {step} failed ({error or 'on another rank'})"
                f"{kept}. Check free space and quota of {self.root}."
            )
        if self.is_main:
            self._prune(keep=self.config.keep_last)
        dist_utils.barrier()
        return final, time.perf_counter() - started

    def _seal(
        self,
        tmp: Path,
        final: Path,
        step: int,
        extra: dict[str, Any],
        hf_files: tuple[Any, Path],
        seconds: float,
    ) -> None:
        hf_config, tokenizer_dir = hf_files
        (tmp / HF_SUBDIR).mkdir(exist_ok=True)
        hf_config.save_pretrained(tmp / HF_SUBDIR)
        copy_tokenizer_files(tokenizer_dir, tmp / HF_SUBDIR)
        files = {
            str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        meta = {
            "step": step,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seconds": round(seconds, 3),
            "world_size": dist_utils.world_size_from_env(),
            "job": self.job.to_dict(),
            "identity": self.identity,
            "files": files,
            **extra,
        }
        write_json_atomic(tmp / MARKER, meta)  # last: its presence marks the checkpoint whole
        if final.exists():  # the same step saved again (e.g. a rerun): replace it
            shutil.rmtree(final)
        tmp.rename(final)

    def load(
        self, info: CheckpointInfo, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        """Collective: load model and optimizer shards (resharding to this world size)."""
        options = self._state_dict_options()
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        try:
            dcp.load(state, checkpoint_id=str(info.path))
        except (Exception, CheckpointException) as err:
            raise CheckpointError(
                f"Checkpoint {info.path} could not be read ({_root_cause(err)[:500]}). Delete it "
                "to resume from the previous one."
            ) from err
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )

    def _state_dict_options(self) -> Any:
        """Only what trains for LoRA and --freeze_layers: the frozen rest is the pretrained
        model's, loaded from it on resume."""
        return state_dict_options(trainable_only=freeze.trains_a_subset(self.config))

    def _prune(self, keep: int) -> None:
        complete = list_checkpoints(self.root)
        for old in complete[: max(len(complete) - max(keep, 1), 0)]:
            shutil.rmtree(old.path, ignore_errors=True)


def _root_cause(err: BaseException) -> str:
    """`OSError: [Errno 28] No space left on device` rather than DCP's wrapper around it."""
    if isinstance(err, CheckpointException):
        for failure in err.failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, BaseException):
                return f"{type(cause).__name__}: {cause}"
    return f"{type(err).__name__}: {err}"
