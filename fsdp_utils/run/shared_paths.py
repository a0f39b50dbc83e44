"""Every node must see the same run folder and caches: find node-local paths before training.

On a cluster, /tmp, /dev/shm and node-local scratch belong to one node. A run folder or data
cache there works on one node and fails on several, late and obscurely: rank 0 prepares the
data on its node and the other nodes' ranks find nothing (or each prepare their own copy), and
checkpoints end up in pieces on different nodes, never loadable. So, once at start, on every
rank (`check_shared_paths`, called from the trainer's setup):

- folders the run writes (the run folder, the data cache): rank 0 writes a token file with a
  random name and content; after a barrier every rank reads it back;
- folders the run only reads (a local model or dataset folder, the hub cache for hub ids):
  every rank lists the folder (names, file sizes) and compares with rank 0's listing, so a copy
  staged on every node's local disk passes, a copy on one node does not;
- one all-gather tells every rank who saw what; any mismatch raises a `ValueError` on every
  rank (nobody waits in a collective for a rank that already failed) naming the path, the
  nodes that do not see it, and the fix.

A single process skips the check (there is nobody to disagree with).
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.parallel.distributed import DistEnv

TOKEN_PREFIX = ".fsdp-utils-shared-check-"
# A token written by rank 0 is normally visible on every node at once (NFS looks a name up on
# the server when it has never seen it; Lustre and GPFS are coherent); a short grace period
# covers slow metadata servers without hiding a node-local folder.
TOKEN_WAIT_SECONDS = 3.0

FIX = (
    "Every node must see the same run folder and caches: put them on shared project or "
    "scratch storage (for example --output_dir /scratch/$USER/runs/<name> and "
    "HF_HOME=/projects/<group>/$USER/hf), not on /tmp, /dev/shm or a node-local disk."
)


@dataclass(frozen=True)
class SharedPath:
    label: str  # what it is and which setting chooses it, for the message
    path: Path
    written: bool  # the run writes there (token check) or only reads it (listing check)


def paths_to_check(config: TrainConfig) -> list[SharedPath]:
    """The folders every rank must see identically (decided on rank 0, which may be the only
    node where a node-local path exists)."""
    from fsdp_utils.data.prepare import default_data_cache_dir
    from fsdp_utils.hub.cache import hub_cache_dir, storage_dir
    from fsdp_utils.hub.specs import looks_local

    paths = [
        SharedPath("run folder (--output_dir)", Path(config.output_dir), written=True),
        SharedPath(
            "data cache (--data_cache_dir; default HF_HOME/fsdp_utils/prepared)",
            default_data_cache_dir(config),
            written=True,
        ),
    ]
    hub = hub_cache_dir(config.cache_dir)
    hub_label = "hub cache (--cache_dir, HF_HUB_CACHE or HF_HOME/hub)"
    # A --dataset_module reads its own files; --dataset is not used then.
    assets = [(config.model, "model")]
    if config.dataset_module is None:
        assets.append((config.dataset, "dataset"))
    for name, kind in assets:
        if looks_local(name):
            if Path(name).is_dir():
                paths.append(SharedPath(f"{kind} folder (--{kind})", Path(name), written=False))
        else:
            # Only this run's repos: the login node may be downloading others meanwhile.
            paths.append(SharedPath(hub_label, storage_dir(hub, name, kind), written=False))
    return paths


def listing(path: Path) -> list[tuple[str, int]] | None:
    """What a node sees in a folder: names with file sizes (0 for folders); None if missing."""
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
        return [(e.name, e.stat().st_size if e.is_file() else 0) for e in entries]
    except OSError:
        return None


def _write_token(path: Path, value: str) -> Path | None:
    """Rank 0's token in `path` (created if needed); None if it cannot write there (the
    folder's own checks report that)."""
    token = path / f"{TOKEN_PREFIX}{value}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        token.write_text(value)
    except OSError:
        return None
    return token


def _sees_token(path: Path, value: str) -> bool:
    token = path / f"{TOKEN_PREFIX}{value}"
    deadline = time.monotonic() + TOKEN_WAIT_SECONDS
    while True:
        try:
            if token.read_text() == value:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def check_shared_paths(config: TrainConfig, env: DistEnv) -> None:
    """Raise ValueError on every rank if some rank does not see the run's folders as rank 0
    does (see the module docstring). Collective: every rank must call it."""
    if env.world_size == 1 or not dist.is_initialized():
        return
    host = socket.gethostname().split(".")[0]
    # Rank 0 decides what to check and what it sees there.
    plan: list[Any] = [None]
    tokens: list[Path] = []
    if env.is_main:
        checks: list[tuple[SharedPath, str, Any]] = []
        for item in paths_to_check(config):
            if item.written:
                value = secrets.token_hex(8)
                token = _write_token(item.path, value)
                if token is not None:
                    tokens.append(token)
                    checks.append((item, "token", value))
                    continue
            checks.append((item, "listing", listing(item.path)))
        plan = [(host, checks)]
    dist.broadcast_object_list(plan, src=0)
    main_host, checks = plan[0]
    missing = []  # indices into checks
    for index, (item, kind, expected) in enumerate(checks):
        if env.is_main:
            seen = True
        elif kind == "token":
            seen = _sees_token(item.path, expected)
        else:
            seen = listing(item.path) == expected
        if not seen:
            missing.append(index)
    views: list[Any] = [None] * env.world_size
    dist.all_gather_object(views, (host, missing))
    for token in tokens:
        token.unlink(missing_ok=True)
    message = describe_mismatch(checks, main_host, views)
    if message:
        raise ValueError(message)


def describe_mismatch(
    checks: list[tuple[SharedPath, str, object]],
    main_host: str,
    views: list[tuple[str, list[int]]],
) -> str | None:
    """The user's message for what the ranks reported (None if all saw everything)."""
    problems = []
    for index, (item, kind, _) in enumerate(checks):
        blind: dict[str, list[int]] = {}
        for rank, (host, missing) in enumerate(views):
            if index in missing:
                blind.setdefault(host, []).append(rank)
        if not blind:
            continue
        where = ", ".join(f"{host} ({_ranks(ranks)})" for host, ranks in blind.items())
        what = (
            "a file rank 0 wrote there"
            if kind == "token"
            else "the same files as rank 0 (it is missing or different there)"
        )
        problems.append(
            f"the {item.label} {item.path} is not shared between the nodes: {where} "
            f"cannot see {what} on {main_host}"
        )
    if not problems:
        return None
    return "Node-local path: " + "; ".join(problems) + ". " + FIX


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
