"""Process groups and device meshes (`fsdp_utils.parallel.distributed`): a plain process gets a
1-process gloo group, and the meshes of every sharding on a fake world of 8 processes on 2
nodes (torch's `fake` backend: collectives do nothing, no processes are started). The backend
choice is tested in test_step.py; real multi-process collectives run in every training test."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from fsdp_utils.parallel.distributed import (
    DistEnv,
    all_reduce_host_sum,
    all_reduce_max,
    all_reduce_min,
    build_mesh,
    destroy,
    init_distributed,
    is_distributed,
    world_size_from_env,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_plain_process_is_a_one_process_gloo_group(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # and restored after the test
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    assert not dist.is_initialized()
    env = init_distributed("cpu", timeout_minutes=1)
    try:
        assert env == DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
        assert (env.is_main, env.num_nodes, world_size_from_env()) == (True, 1, 1)
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
        assert not is_distributed()  # one process: the collectives are skipped
        # Host scalars come back as Python floats; float64 keeps a token count above 2**24
        # (where float32 starts rounding) exact.
        count = 2**40 + 1
        summed = all_reduce_host_sum([float(count), 0.5])
        assert summed == [count, 0.5] and all(type(v) is float for v in summed)
        assert all_reduce_max(torch.tensor([3])).item() == 3
        assert all_reduce_min(torch.tensor([3])).item() == 3
        # A second call joins the group that exists instead of failing.
        assert init_distributed("cpu") == env
    finally:
        destroy(synchronize=True)
    assert not dist.is_initialized()


def test_a_cuda_request_without_a_gpu_names_the_problem():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        init_distributed("cuda")


@pytest.fixture
def fake_world() -> Iterator[None]:
    """8 ranks of which this process is rank 0; the meshes need nothing else."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _env(world_size: int, per_node: int) -> DistEnv:
    return DistEnv(0, 0, world_size, per_node, torch.device("cpu"), "fake")


@pytest.mark.parametrize(
    ("sharding", "shape", "names"),
    [
        ("full", (8,), ("shard",)),
        ("shard_grad_op", (8,), ("shard",)),
        ("hybrid", (2, 4), ("replicate", "shard")),  # shard within a node, replicate across
        ("no_shard", (8, 1), ("replicate", "shard")),  # HSDP with shards of one: replicas
    ],
)
def test_mesh_of_each_sharding_on_two_nodes_of_four(fake_world, sharding, shape, names):
    env = _env(8, per_node=4)
    assert env.num_nodes == 2
    mesh = build_mesh(env, sharding)
    assert (tuple(mesh.shape), mesh.mesh_dim_names, mesh.device_type) == (shape, names, "cpu")


def test_hybrid_needs_the_same_processes_on_every_node(fake_world):
    with pytest.raises(ValueError, match="world size 8 is not a multiple of 3 processes per node"):
        build_mesh(_env(8, per_node=3), "hybrid")


def test_every_rank_that_fails_for_a_user_mistake_carries_the_message(
    tmp_path, monkeypatch, capsys
):
    """torchrun's closing report shows the error file of the first rank to exit, which on a
    loaded machine need not be rank 0: rank 1 writes the message there too, and prints nothing
    (rank 0 prints it)."""
    from fsdp_utils import cli

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(cli, "PEER_EXIT_DELAY_S", 0.0)
    assert cli.main(["--collective_timeout_minutes", "0"]) == 2  # found by every rank
    report = json.loads(error_file.read_text())["message"]
    assert report["message"].startswith("error: --collective_timeout_minutes must be positive")
    assert report["extraInfo"]["py_callstack"] == report["message"]
    assert capsys.readouterr().err == ""


def test_cpu_offload_creates_the_shards_on_the_host_and_the_buffers_on_the_device(fake_world):
    """--cpu_offload on a GPU: FSDP2's CPUOffloadPolicy needs its shards in host memory.
    `materialize` once made them on the GPU, and the first H100 run failed loading the weights
    ("Attempted to set the storage of a tensor on device cpu to a storage on different device
    cuda:0"). Here the meta device stands for the GPU: the shards must land on the CPU, the
    buffers (rotary frequencies) on the compute device, and without offload everything there."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from fsdp_utils.model.build import find_decoder_layers, materialize
    from fsdp_utils.synthetic import tiny_model_config

    mesh = build_mesh(_env(8, per_node=4), "full")
    for offload in (True, False):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny_model_config("llama", 64))
        policy = CPUOffloadPolicy(pin_memory=False) if offload else None
        kwargs = {"mesh": mesh, **({"offload_policy": policy} if policy else {})}
        for layer in find_decoder_layers(model):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        # The buffers' real values are made on the CPU before (build_meta_model does so).
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = torch.ones(buf.shape, dtype=buf.dtype)
        assert any(True for _ in model.buffers())
        materialize(model, torch.device("meta"), offload=offload)
        params = list(model.parameters())
        assert params and all(isinstance(p, DTensor) for p in params)
        shards_on = {p.to_local().device.type for p in params}
        assert shards_on == ({"cpu"} if offload else {"meta"}), (offload, shards_on)
        assert {b.device.type for b in model.buffers()} == {"meta"}
