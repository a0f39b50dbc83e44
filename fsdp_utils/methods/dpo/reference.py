"""The DPO reference model's log-probabilities, three ways, none of them a second model on the
wrong device or a table read by rank:

- `AdaptersOff` (--lora): the trained model itself with its LoRA adapters switched off, under
  no_grad: the base model, with no second copy in memory;
- `StartingAdapter` (--lora --lora_from ADAPTER, a LoRA fine-tune continued): the model with
  a frozen copy of the starting adapter active instead of the trained one (TRL's
  `ref_adapter_name`): the model the user fine-tuned, for the adapter's few megabytes;
- `CachedReference` (the default otherwise): computed once before training, sharded with FSDP2
  like the training forward (`compute_reference_cache`), and written beside the prepared data
  under a key of the model's files, the prepared data and the settings that change the numbers
  (`cache_key`). Each pair's log-probabilities are stored by the pair's row in the dataset, and
  a batch looks its pairs up by row (`PAIR_ROWS`), so a cache written at one world size is read
  at any other, and a requeued job or a second run with the same data reuses it;
- `LiveReference` (--reference live): a frozen sharded copy of the starting model, run at
  every step (one more forward per step and one more model's parameters in memory).

Each gives the summed log-probabilities of the answer tokens, [chosen..., rejected...] like the
batch, fp32 on the device, computed through the same forward as the policy's (train/loss.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.preference import PAIR_ROWS, PreferencePairs
from fsdp_utils.data.sequence_slices import slice_batch
from fsdp_utils.model.lora import adapters_disabled, reference_adapter_active
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.parallel.parallelize import no_grad_pass
from fsdp_utils.parallel.sequence import SequenceParallel
from fsdp_utils.train.loss import LossChunking
from fsdp_utils.train.step import Batch

from .loss import sequence_logps

CACHE_VERSION = 1  # bump when what the cache holds, or how it is computed, changes
CACHE_SUBDIR = "reference"  # beside the prepared arrays: <prepared folder>/reference/<key>/


class Reference(Protocol):
    def logps(self, batch: Batch) -> torch.Tensor:
        """[sequences] the reference's summed answer log-probabilities, fp32 on the device."""
        ...


@dataclass
class ForwardSettings:
    chunking: LossChunking
    device: torch.device
    autocast: Callable[[], Any]
    # The batches hold this rank's slices of their sequences (--sequence_parallel).
    sequence_parallel: SequenceParallel | None = None

    def logps(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """In eval mode (no dropout), without gradients, every way (`no_grad_pass`)."""
        with no_grad_pass(model):
            return sequence_logps(
                model, batch, chunking=self.chunking, device=self.device,
                autocast=self.autocast, sequence_parallel=self.sequence_parallel,
            )  # fmt: skip


@dataclass
class AdaptersOff:
    model: nn.Module
    forward: ForwardSettings

    def logps(self, batch: Batch) -> torch.Tensor:
        with adapters_disabled(self.model):
            return self.forward.logps(self.model, batch)


@dataclass
class StartingAdapter:
    model: nn.Module  # carrying the frozen reference adapter (`TrainConfig.reference_adapter`)
    forward: ForwardSettings

    def logps(self, batch: Batch) -> torch.Tensor:
        with reference_adapter_active(self.model):
            return self.forward.logps(self.model, batch)


@dataclass
class LiveReference:
    model: nn.Module  # frozen, sharded like the policy
    forward: ForwardSettings

    def logps(self, batch: Batch) -> torch.Tensor:
        return self.forward.logps(self.model, batch)


class CachedStandIn:
    """The cache in the memory planner's traced step: a few host numbers per pair, nothing on
    the device to plan beyond the step's [sequences] fp32 log-probabilities."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def logps(self, batch: Batch) -> torch.Tensor:
        return torch.zeros(batch["input_ids"].shape[0], device=self.device)


class Released:
    """The reference after `DPO.before_export` let the frozen copy go: nothing may ask it."""

    def logps(self, batch: Batch) -> torch.Tensor:
        raise AssertionError("the DPO reference was released before the final model was written")


@dataclass(frozen=True)
class CachedReference:
    rows: np.ndarray  # (pairs,) sorted dataset rows
    values: np.ndarray  # (pairs, 2) float32: chosen, rejected
    device: torch.device

    @classmethod
    def load(cls, folder: Path, device: torch.device) -> CachedReference:
        with np.load(folder / "logps.npz") as saved:
            return cls(saved["rows"], saved["logps"], device)

    def logps(self, batch: Batch) -> torch.Tensor:
        rows = batch[PAIR_ROWS].numpy()
        at = np.searchsorted(self.rows, rows)
        found = at < len(self.rows)
        if not found.all() or not (self.rows[at[found]] == rows[found]).all():
            missing = rows[~found | (self.rows[np.minimum(at, len(self.rows) - 1)] != rows)]
            raise AssertionError(f"reference cache has no log-probabilities for rows {missing}")
        values = self.values[at]  # (pairs, 2)
        both = np.concatenate([values[:, 0], values[:, 1]])
        return torch.from_numpy(both).to(self.device)


def cache_key(config: TrainConfig, model_dir: Path, data_folder: Path, chunk_size: int) -> str:
    """What the reference's numbers depend on: the model's files (their names, sizes and times),
    the prepared data (its folder is named by its own key), and the settings of the forward."""
    files = sorted(
        (p.name, p.stat().st_size, int(p.stat().st_mtime))
        for p in Path(model_dir).iterdir()
        if p.is_file() and p.suffix in (".safetensors", ".bin", ".json")
    )
    spec = {
        "version": CACHE_VERSION,
        "model": str(Path(model_dir).resolve()),
        "files": files,
        "data": data_folder.name,
        "precision": config.precision,
        "attn_implementation": config.attn_implementation,
        "loss_chunk_size": chunk_size,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def cache_folder(config: TrainConfig, model_dir: Path, data_folder: Path, chunk_size: int) -> Path:
    return data_folder / CACHE_SUBDIR / cache_key(config, model_dir, data_folder, chunk_size)


def is_cached(folder: Path) -> bool:
    return (folder / "logps.npz").is_file()


def partial_cache(folder: Path) -> Path:
    """Where a reference pass that was stopped keeps the pairs it finished (beside the cache)."""
    return folder.with_name(f"{folder.name}.partial.npz")


def _read_partial(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    path = partial_cache(folder)
    if not path.is_file():
        return np.zeros(0, np.int64), np.zeros((0, 2), np.float32)
    with np.load(path) as saved:
        return saved["rows"], saved["logps"]


def _write_partial(folder: Path, rows: np.ndarray, values: np.ndarray) -> None:
    path = partial_cache(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}.npz")
    np.savez(tmp, rows=rows, logps=values)
    os.replace(tmp, path)  # a reader sees the old table or the new, never half of one


def compute_reference_cache(
    model: nn.Module,
    splits: list[PreferencePairs],
    folder: Path,
    *,
    env: DistEnv,
    batch_size: int,
    forward: ForwardSettings,
    log: Callable[[str], None],
    stop: Callable[[], str | None] = lambda: None,
) -> str | None:
    """Collective: the reference log-probabilities of every pair of `splits`, each rank a share
    of the pairs (every rank the same number of forwards, as FSDP's collectives need), gathered
    and written by rank 0 as one table indexed by dataset row. With sequence parallelism each
    data-parallel group takes a share, each of its ranks the slices (all get the whole values:
    the table drops the repeats).

    `stop` (collective) is asked before every batch; when it gives a reason to stop, the pairs
    done so far join those an earlier stopped pass kept (`partial_cache`), and the reason is
    returned: the next pass computes only the pairs still missing. None: the cache is whole."""
    sp = forward.sequence_parallel or SequenceParallel.off(env)
    # Rank 0's view of the shared file system decides, for every rank.
    kept = dist_utils.broadcast_object(_read_partial(folder) if env.is_main else None)
    assert kept is not None
    done_rows, done_values = kept
    if len(done_rows):
        pending = sum(int((~np.isin(s.rows, done_rows)).sum()) for s in splits)
        log(
            f"dpo: {len(done_rows):,} pairs' reference log-probabilities kept by an earlier leg "
            f"({partial_cache(folder)}); computing the other {pending:,}"
        )
    rows_parts, value_parts = [done_rows], [done_values]
    stopped: str | None = None
    for pairs in splits:
        todo = np.flatnonzero(~np.isin(pairs.rows, done_rows))
        n = len(todo)
        if n == 0 or stopped is not None:
            continue
        # Every pair once across ranks; the last rank's share padded with repeats so that all
        # ranks run the same number of forwards (the repeats are dropped by np.unique).
        per_rank = -(-n // sp.data_size)
        mine = todo[
            np.minimum(np.arange(sp.data_rank, per_rank * sp.data_size, sp.data_size), n - 1)
        ]
        for start in range(0, len(mine), batch_size):
            if (stopped := stop()) is not None:
                break
            indices = mine[start : start + batch_size]
            batch = slice_batch(pairs.batch(indices), rank=sp.rank, size=sp.size)
            both = forward.logps(model, batch).float().cpu().numpy()
            rows_parts.append(batch[PAIR_ROWS].numpy())
            value_parts.append(np.stack([both[: len(indices)], both[len(indices) :]], axis=1))
    gathered = dist_utils.all_gather_objects(
        (np.concatenate(rows_parts), np.concatenate(value_parts))
    )
    if env.is_main:
        rows = np.concatenate([r for r, _ in gathered])
        values = np.concatenate([v for _, v in gathered]).astype(np.float32)
        rows, first = np.unique(rows, return_index=True)  # sorted; repeats dropped
        if stopped is not None and len(rows) == 0:
            log("dpo: the reference pass stopped before its first pair")
        elif stopped is not None:
            _write_partial(folder, rows, values[first])
            total = len(np.unique(np.concatenate([s.rows for s in splits])))
            log(
                f"dpo: the reference pass stopped at {len(rows):,} of {total:,} pairs; they are "
                f"kept in {partial_cache(folder)} for the next leg"
            )
        else:
            _write_cache(folder, rows, values[first], world_size=env.world_size)
            log(f"dpo: reference log-probabilities of {len(rows):,} pairs cached in {folder}")
    dist_utils.barrier()
    return stopped


def _write_cache(folder: Path, rows: np.ndarray, values: np.ndarray, *, world_size: int) -> None:
    """The whole table, atomically (a reader sees all of it or none); the partial one goes."""
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    np.savez(tmp / "logps.npz", rows=rows, logps=values)
    (tmp / "meta.json").write_text(json.dumps({"pairs": len(rows), "world_size": world_size}))
    if not is_cached(folder):
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(tmp, folder)
    shutil.rmtree(tmp, ignore_errors=True)
    partial_cache(folder).unlink(missing_ok=True)
