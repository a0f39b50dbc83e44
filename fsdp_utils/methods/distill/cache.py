"""`--teacher_cache DIR`: the teacher's top-K log-probabilities of every target token of the
prepared data, written once (a job of the teacher's own) and read by the student's job without
the teacher, as DPO's reference cache is (fsdp_utils/methods/dpo/reference.py): computed
sharded with FSDP2 before the first step, each rank a share of the blocks, written by rank 0,
indexed by the block's row in its split (so any world size reads it), and resumed after a stop
(the time limit's stop file or signal): the blocks done are kept and the next leg computes the
rest.

The folder:

    meta.json              what the numbers depend on (`CacheKey`: the prepared data, the
                           teacher's files, the temperature, the vocabulary), K, each split's
                           shape, and whether it is complete
    <split>_ids.npy        (blocks, positions, K) int32: the K most likely tokens, most likely
                           first, at each position with a target (0 elsewhere)
    <split>_logps.npy      (blocks, positions, K) float32: their log-probabilities at the
                           run's --distill_temperature
    <split>_rest.npy       (blocks, positions) float32: the log of the other tokens' mass
    <split>_done.npy       (blocks,) bool: the blocks written (after their rows are flushed)

8 K + 4 bytes per position: 516 MB per million tokens at K = 64 (docs/distillation.md). The
arrays are memory-mapped: a batch reads its blocks' rows only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from fsdp_utils.data.blocks import TokenBlocks
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.distributed import DistEnv

CACHE_VERSION = 1  # bump when what the cache holds, or how it is computed, changes
META = "meta.json"
# The batch's keys for the cache's rows (`CachedBlocks`), in the order the chunks read them.
CACHE_KEYS = ("teacher_ids", "teacher_logps", "teacher_rest")
# ... and for its rows' block indices in their split: what names a row's samples (--lmbda)
BLOCK_ROWS = "block_rows"
_ARRAYS = dict(zip(CACHE_KEYS, ("ids", "logps", "rest"), strict=True))
_COMMIT = re.compile(r"[0-9a-f]{40}")


def teacher_files(folder: Path) -> dict[str, Any]:
    """What identifies a teacher's weights: the hub commit of a snapshot from the offline
    cache, and its files' names and sizes (with their times for a local folder, which has no
    commit)."""
    resolved = Path(folder).resolve()
    commit = resolved.name if resolved.parent.name == "snapshots" else None
    if commit is not None and not _COMMIT.fullmatch(commit):
        commit = None
    files = []
    for path in sorted(resolved.iterdir()):
        if path.is_file() and path.suffix in (".safetensors", ".json"):
            stat = path.stat()
            files.append([path.name, stat.st_size, *([] if commit else [int(stat.st_mtime)])])
    return {"commit": commit, "files": files}


@dataclass(frozen=True)
class CacheKey:
    """What the cached numbers depend on; a cache of another key is not this run's."""

    data: str  # the prepared data's folder name (its own key: files, tokenizer, settings)
    teacher: str  # --teacher as the cache's job gave it
    teacher_files: dict[str, Any]
    temperature: float
    vocab: int
    version: int = CACHE_VERSION


def read_meta(folder: Path) -> dict[str, Any] | None:
    path = Path(folder) / META
    return json.loads(path.read_text()) if path.is_file() else None


def describe_progress(folder: Path, meta: dict[str, Any]) -> str:
    done, total = progress(folder, meta)
    return f"{done:,} of {total:,} blocks"


def progress(folder: Path, meta: dict[str, Any]) -> tuple[int, int]:
    """(blocks written, blocks) of the cache in `folder` (its done flags, read)."""
    done = total = 0
    for split, info in meta["splits"].items():
        total += info["blocks"]
        flags = folder / f"{split}_done.npy"
        if flags.is_file():
            done += int(np.load(flags, mmap_mode="r").sum())
    return done, total


def _teacher(name: str, files: dict[str, Any]) -> str:
    commit = files.get("commit")
    return f"{name} (commit {commit[:10]})" if commit else f"{name} (a local folder)"


def check_key(folder: Path, meta: dict[str, Any], key: CacheKey, *, teacher_known: bool) -> None:
    """A ValueError naming what differs when the cache in `folder` is not this run's: another
    data set, another teacher (when the run names one), another temperature or vocabulary."""
    saved = meta["key"]
    other = (
        f"point --teacher_cache at another (empty) folder to write this run's, or delete "
        f"{folder} if its cache is no longer needed."
    )
    if saved.get("version") != key.version:
        raise ValueError(
            f"--teacher_cache {folder} was written by another version of this code (cache "
            f"format {saved.get('version')}, this one reads {key.version}). Rerun the teacher's "
            f"job, or {other}"
        )
    if saved["data"] != key.data:
        raise ValueError(
            f"--teacher_cache {folder} holds the teacher's log-probabilities of another data "
            f"set (prepared as {saved['data']}; this run's is {key.data}: other files, "
            "tokenizer or preparation options such as --max_seq_length), whose rows are not "
            f"this run's tokens. Give this run the data flags of the teacher's job, or {other}"
        )
    if teacher_known and (
        saved["teacher_files"] != key.teacher_files or saved["teacher"] != key.teacher
    ):
        raise ValueError(
            f"--teacher_cache {folder} was written by another teacher, "
            f"{_teacher(saved['teacher'], saved['teacher_files'])}, than this run's --teacher "
            f"{_teacher(key.teacher, key.teacher_files)} (or its files have changed since). Drop "
            f"--teacher to train from the cache as it is, or {other}"
        )
    if saved["temperature"] != key.temperature:
        raise ValueError(
            f"--teacher_cache {folder} holds log-probabilities at --distill_temperature "
            f"{saved['temperature']:g}, this run asks for {key.temperature:g}. Run with "
            f"--distill_temperature {saved['temperature']:g}, or {other}"
        )
    if saved["vocab"] != key.vocab:
        raise ValueError(
            f"--teacher_cache {folder} covers {saved['vocab']:,} output columns, this run's "
            f"student and teacher share {key.vocab:,}: {other}"
        )


def missing_cache_message(folder: Path, meta: dict[str, Any] | None) -> str:
    """The paragraph for a run that must read `folder` (no --teacher) and cannot."""
    job = (
        "sbatch slurm/finetune.sh <this run's data and model flags> --method distill "
        f"--teacher MODEL --teacher_cache {folder} --teacher_cache_only"
    )
    if meta is None:
        return (
            f"--teacher_cache {folder} holds no teacher cache (no {META}), and without "
            "--teacher there is no teacher to compute it. Write it first with the teacher's "
            f"job, on a partition with the memory for the teacher:\n  {job}\nor give --teacher "
            "MODEL to this run (it then computes the cache before training)."
        )
    return (
        f"--teacher_cache {folder} is not complete ({describe_progress(folder, meta)} written): the "
        "teacher's job stopped before the end (its time limit?). Run it again, it goes on "
        f"where it stopped:\n  {job}\nor give --teacher MODEL to this run to finish it here."
    )


class CacheArrays:
    """One split's arrays in a cache folder, memory-mapped (read-only unless `writable`)."""

    def __init__(self, folder: Path, split: str, *, writable: bool = False) -> None:
        mode: Literal["r+", "r"] = "r+" if writable else "r"
        self.arrays = {
            key: np.load(folder / f"{split}_{name}.npy", mmap_mode=mode)
            for key, name in _ARRAYS.items()
        }
        self.done = np.load(folder / f"{split}_done.npy", mmap_mode=mode)

    @staticmethod
    def create(folder: Path, split: str, blocks: int, positions: int, k: int) -> None:
        shapes: dict[str, tuple[int, ...]] = {
            "ids": (blocks, positions, k),
            "logps": (blocks, positions, k),
            "rest": (blocks, positions),
        }
        dtypes = {"ids": np.int32, "logps": np.float32, "rest": np.float32}
        for name, shape in shapes.items():
            np.lib.format.open_memmap(
                folder / f"{split}_{name}.npy", "w+", dtype=dtypes[name], shape=shape
            ).flush()
        np.lib.format.open_memmap(
            folder / f"{split}_done.npy", "w+", dtype=np.bool_, shape=(blocks,)
        ).flush()

    def write(self, rows: np.ndarray, values: dict[str, np.ndarray]) -> None:
        """The rows' entries, flushed, then their done flags: a job killed in between leaves
        them to compute again, never marked done without their numbers."""
        for key, array in self.arrays.items():
            array[rows] = values[key]
            array.flush()
        self.done[rows] = True
        self.done.flush()

    def read(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        order = np.sort(rows)  # sequential reads from the memory maps
        restore = np.argsort(np.argsort(rows))
        return {
            key: torch.from_numpy(np.ascontiguousarray(array[order]))[restore]
            for key, array in self.arrays.items()
        }


def _write_meta(folder: Path, meta: dict[str, Any]) -> None:
    tmp = folder / f"{META}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, folder / META)  # a reader sees the old meta.json or the new


def start_cache(
    folder: Path, key: CacheKey, splits: dict[str, TokenBlocks], k: int, world_size: int
) -> dict[str, Any]:
    """Rank 0: a new cache's meta.json and empty arrays in `folder` (its meta, incomplete)."""
    folder.mkdir(parents=True, exist_ok=True)
    shapes = {
        name: {"blocks": len(blocks), "positions": int(blocks.input_ids.shape[1]) - 1}
        for name, blocks in splits.items()
    }
    for name, info in shapes.items():
        CacheArrays.create(folder, name, info["blocks"], info["positions"], k)
    meta = {
        "key": asdict(key),
        "top_k": k,
        "splits": shapes,
        "complete": False,
        "world_size": world_size,
    }
    _write_meta(folder, meta)
    return meta


# The teacher's entries of a batch: ([rows, positions, K] ids, logps; [rows, positions] rest),
# numpy, zeros at positions without a target.
BatchEntries = Callable[[dict[str, torch.Tensor]], dict[str, np.ndarray]]


def compute_teacher_cache(
    entries: BatchEntries,
    splits: dict[str, TokenBlocks],
    folder: Path,
    meta: dict[str, Any],
    *,
    env: DistEnv,
    batch_size: int,
    log: Callable[[str], None],
    stop: Callable[[], str | None] = lambda: None,
) -> str | None:
    """Collective: the teacher's entries of every block of `splits` not yet done, each rank a
    share of them (every rank the same number of forwards, as FSDP's collectives need: the last
    share padded with repeats), gathered after every batch and written by rank 0. `stop`
    (collective) is asked before every batch: on a reason to stop, what is written stays and
    the reason is returned (the next leg computes the rest). None: the cache is complete."""
    stopped: str | None = None
    for name, blocks in splits.items():
        # Rank 0's view of the shared file system decides, for every rank.
        done = dist_utils.broadcast_object(
            np.array(CacheArrays(folder, name).done) if env.is_main else None
        )
        assert done is not None
        todo = np.flatnonzero(~done)
        if len(todo) == 0 or stopped is not None:
            continue
        if done.any():
            log(f"distill: teacher cache {name}: {done.sum():,} blocks kept, {len(todo):,} to go")
        arrays = CacheArrays(folder, name, writable=True) if env.is_main else None
        per_rank = -(-len(todo) // env.world_size)
        mine = todo[np.minimum(np.arange(env.rank, per_rank * env.world_size, env.world_size),
                               len(todo) - 1)]  # fmt: skip
        for start in range(0, len(mine), batch_size):
            if (stopped := stop()) is not None:
                break
            rows = mine[start : start + batch_size]
            values = entries(blocks.batch(rows))
            gathered = dist_utils.all_gather_objects((rows, values))
            if arrays is not None:
                every = np.concatenate([r for r, _ in gathered])
                merged = {k: np.concatenate([v[k] for _, v in gathered]) for k in CACHE_KEYS}
                arrays.write(every, merged)
        if stopped is not None:
            break
    if env.is_main:
        done_blocks, total = progress(folder, meta)
        if stopped is None:
            _write_meta(folder, {**meta, "complete": True, "world_size": env.world_size})
            log(f"distill: teacher cache complete in {folder} ({total:,} blocks)")
        else:
            log(
                f"distill: the teacher cache stopped at {done_blocks:,} of {total:,} blocks; "
                f"they are kept in {folder} for the next leg"
            )
    dist_utils.barrier()
    return stopped


class CachedBlocks:
    """A split's blocks whose batches also carry their block indices (`BLOCK_ROWS`) and the
    teacher cache's rows (`CACHE_KEYS`) once `attach` has opened them: the step reads the
    teacher from the batch, so a batch is whole wherever it is built (the trainer's next step,
    an evaluation)."""

    def __init__(self, blocks: TokenBlocks, split: str) -> None:
        self.blocks = blocks
        self.split = split
        self.arrays: CacheArrays | None = None

    def attach(self, folder: Path) -> None:
        self.arrays = CacheArrays(folder, self.split)

    def __len__(self) -> int:
        return len(self.blocks)

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        batch = self.blocks.batch(indices)
        batch[BLOCK_ROWS] = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        if self.arrays is not None:
            batch.update(self.arrays.read(np.asarray(indices)))
        return batch
