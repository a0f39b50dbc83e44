"""Process group and device setup: nccl on CUDA (with gloo beside it for host tensors), gloo on
CPU, or a plain single process.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE; without them we run as one process
(still with a process group, so the same code path is exercised).
"""

from __future__ import annotations

import datetime
import gc
import itertools
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_utils.config.train_config import Sharding
from fsdp_utils.error_report import EXIT_USAGE, PEER_EXIT_DELAY_S, report_error

T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_group_backend(device_type: str) -> str:
    """The backend string for `init_process_group` on `device_type` ("cuda" or "cpu").

    On CUDA a device-mapped backend, as torchtitan and torchtune use: collectives on CUDA tensors
    go to nccl, those on CPU tensors to gloo. Two things need the CPU half. With --cpu_offload,
    FSDP2 keeps the sharded gradients in host memory, so the gradient-norm all-reduce meets CPU
    tensors, which nccl alone refuses ("No backend type associated with device type cpu",
    pytorch #148532). And the step's host-side scalars (target counts, the stop decision)
    travel over gloo without entering the GPU's queue, so they cost no host-device sync.
    """
    if device_type == "cuda":
        return "cuda:nccl,cpu:gloo"
    if device_type == "cpu":
        return "gloo"
    raise ValueError(f"No process-group backend for device type {device_type!r}: use cuda or cpu.")


def device_type(preference: str) -> str:
    """--device as a device type: cuda if asked for, or if available with `auto`; else cpu."""
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    return "cuda" if use_cuda else "cpu"


def init_distributed(device_preference: str = "auto", timeout_minutes: float = 30) -> DistEnv:
    """Initialise the default process group for this process and pick its device.

    `timeout_minutes` (--collective_timeout_minutes) bounds every collective: a rank that waits
    longer for a dead or frozen peer fails (gloo raises; NCCL's watchdog aborts the process), so
    torchrun and srun end the job instead of leaving it hanging until the time limit."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = world_size_from_env()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))

    use_cuda = device_type(device_preference) == "cuda"
    if use_cuda:
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was requested but no CUDA device is visible.")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"Local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible on this "
                "node. Start as many processes per node as GPUs (torchrun --nproc_per_node)."
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = process_group_backend(device.type)

    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # plain `python chess_finetune.py`
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            device_id=device if use_cuda else None,
        )
    return DistEnv(rank, local_rank, world_size, local_world_size, device, backend)


def build_mesh(env: DistEnv, sharding: Sharding) -> DeviceMesh:
    """A 1-D mesh for full/shard_grad_op; 2-D (replicate, shard) for hybrid and no_shard.

    hybrid shards within a node and replicates across nodes (HSDP); no_shard replicates
    everywhere, which FSDP2 expresses as HSDP with a shard dimension of 1.
    """
    device_type = env.device.type  # "cpu" explicitly on CPU: a gloo mesh must not meet GPUs
    if sharding == "hybrid":
        shard = env.local_world_size
        if env.world_size % shard != 0:
            raise ValueError(
                f"--sharding hybrid needs the same number of processes on every node: world size "
                f"{env.world_size} is not a multiple of {shard} processes per node."
            )
        return init_device_mesh(
            device_type, (env.world_size // shard, shard), mesh_dim_names=("replicate", "shard")
        )
    if sharding == "no_shard":
        return init_device_mesh(
            device_type, (env.world_size, 1), mesh_dim_names=("replicate", "shard")
        )
    return init_device_mesh(device_type, (env.world_size,), mesh_dim_names=("shard",))


def is_distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def all_reduce_host_sum(values: list[float]) -> list[float]:
    """Sum host scalars over all ranks, as a CPU tensor: gloo on CPU, and on CUDA the gloo half
    of the device-mapped backend, so the GPU's queue is neither waited for nor entered. float64
    keeps integer counts exact (up to 2**53)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    return [float(v) for v in all_reduce_sum(tensor).tolist()]


def all_reduce_max(value: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


def all_reduce_min(value: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return value


class PeerFailure(Exception):
    """Rank 0 failed in work the other ranks were waiting for (`on_main_rank`): this rank stops
    too, quietly, since rank 0 reports the error. `user_error`: rank 0's was a user mistake
    (exit 2) rather than a crash."""

    def __init__(self, user_error: bool) -> None:
        super().__init__("rank 0 failed (its error is in the log)")
        self.user_error = user_error


class ReportedError(ValueError):
    """A user mistake that rank 0 has already reported (`report_error`): the command exits 2
    without printing it again."""


# on_main_rank's calls, counted alike on every rank (it is collective): each outcome's key.
_main_rank_calls = itertools.count()
# How often a waiting rank looks for rank 0's outcome: soon at first (most work takes
# milliseconds), then every few seconds (preparing a large dataset takes hours).
_POLL_FIRST_S, _POLL_MAX_S = 0.005, 2.0


def on_main_rank(
    work: Callable[[], T], *, user_errors: tuple[type[BaseException], ...] = (ValueError,)
) -> T | None:
    """Run `work` on rank 0 while the other ranks wait; its result on rank 0, None elsewhere.

    Collective. If `work` raises, every rank stops: rank 0 reports a user mistake (`user_errors`)
    at once and raises `ReportedError`, or re-raises anything else (a crash, with its
    traceback); every other rank raises `PeerFailure`, carrying the message into its error file
    (`report_error`, not printed). Reporting before the others learn of it keeps the message
    even if torchrun stops rank 0 when the first of them exits.

    The others wait on the process group's store (rank 0 sets a key with the outcome), not in a
    collective: a collective times out after --collective_timeout_minutes, and `work` may be
    preparing a dataset for hours. A rank 0 that dies is noticed by torchrun, which ends the
    others; one that hangs holds them as it would hold a collective's peers.
    """
    if not is_distributed():
        try:
            return work()
        except user_errors as err:
            report_error(str(err))
            raise ReportedError(str(err)) from err
    store = dist.distributed_c10d._get_default_store()
    # A restarted torchrun round meets the previous round's keys in the agent's store.
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"fsdp_utils/on_main_rank/{restart}/{next(_main_rank_calls)}"
    if dist.get_rank() == 0:
        outcome: dict[str, object] = {"failed": False}
        try:
            return work()
        except user_errors as err:
            report_error(str(err))
            outcome = {"failed": True, "user_error": str(err)}
            raise ReportedError(str(err)) from err
        except BaseException:  # every failure must reach the other ranks
            outcome = {"failed": True, "user_error": None}
            raise
        finally:
            store.set(key, json.dumps(outcome))
    pause = _POLL_FIRST_S
    while not store.check([key]):  # check() does not block: no store timeout to trip either
        time.sleep(pause)
        pause = min(2 * pause, _POLL_MAX_S)
    outcome = json.loads(store.get(key))
    if outcome["failed"]:
        message = outcome["user_error"]
        if isinstance(message, str):
            report_error(message, show=False)
        raise PeerFailure(user_error=message is not None)
    return None


def raise_from_any_rank(message: str | None) -> None:
    """Collective: a user mistake that some rank found in work every rank does (a reward
    function failing on its own batch) stops every rank. Rank 0 raises it as a ValueError
    (the command prints it once and exits 2); the others put it in their error file and raise
    `PeerFailure`. None on every rank: nothing happens."""
    messages = all_gather_objects(message)
    first = next((m for m in messages if m), None)
    if first is None:
        return
    if not is_distributed() or dist.get_rank() == 0:
        raise ValueError(first)
    report_error(first, show=False)
    raise PeerFailure(user_error=True)


def broadcast_object(value: T, src: int = 0) -> T:
    """Rank `src`'s picklable `value` on every rank, over the CPU (gloo) half of the group."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src, device=torch.device("cpu"))
    return box[0]


def all_gather_objects(value: T) -> list[T]:
    """Every rank's picklable `value`, in rank order, on every rank (over the CPU half of the
    group, as `broadcast_object`)."""
    if not is_distributed():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def destroy(*, synchronize: bool = False) -> None:
    """Tear the process group down. `synchronize` (on a clean end, never after an error, where a
    peer may be gone): all ranks meet at a barrier first. A gloo peer that tears its connections
    down while another rank is still at work (rank 0 writing files) can make that rank abort in
    its own teardown ("terminate called without an active exception", SIGABRT, exit 1 from
    torchrun after a run that completed): seen in this project's tests and benchmark. Free
    the model, its optimizer and meshes (and `gc.collect()`) before calling this, as
    `fsdp_utils.cli.run` does: a group they still reference outlives this call, and is torn
    down at exit, after its peer may be gone, with the same abort."""
    if dist.is_initialized():
        if synchronize and is_distributed():
            dist.barrier()
        dist.destroy_process_group()


def run_command(work: Callable[[], T]) -> tuple[int, T | None]:
    """A collective command's work, run to its exit status: (0, result), or (2, None) for a user
    mistake (a ValueError every rank finds: rank 0 reports it, the others wait for its message
    to be out first), or the status of rank 0's failure that ended this rank (`PeerFailure`).
    The process group is torn down on every way out (`destroy`, synchronised after a clean end)."""
    clean = False
    try:
        result = work()
        clean = True
        return 0, result
    except ReportedError:
        return EXIT_USAGE, None
    except PeerFailure as err:
        time.sleep(PEER_EXIT_DELAY_S)
        return (EXIT_USAGE if err.user_error else 1), None
    except ValueError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            report_error(str(err))
        else:  # after rank 0, so that torchrun does not stop it before its message is out
            time.sleep(PEER_EXIT_DELAY_S)
        return EXIT_USAGE, None
    finally:
        gc.collect()
        destroy(synchronize=clean)
