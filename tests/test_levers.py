"""The step levers of issue 60 (docs/levers.md), each against the default path.

Two launches feed the end-to-end checks. One process, bf16-mixed, 4 steps of 4 micro-batches,
activation checkpointing on the first of the 2 layers (so both kinds of layer run): the default
run, and the same run with --single_device_path direct, --sync_free_steps (--log_every 2),
--fused_optimizer, --float8 rowwise (torchao's emulation), and --compile --compile_scope model
(torch.compile's aot_eager backend: dynamo and AOTAutograd as on a GPU, without inductor's
minutes of code generation on a CPU; the module's one compiled run, most of its cost). Two
processes: the default run, --fused_optimizer, --reshard_last_layer, and the direct run's
step-2 checkpoint resumed on FSDP2. In process: the host reads of a step counted (`Reads`),
the compiled loss's chunks, the per-device loss chunk, the refusals and what the planner traces.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from fsdp_utils.config.train_config import TrainConfig, validate_config
from fsdp_utils.data.blocks import IGNORE_INDEX
from fsdp_utils.data.document_masking import known_packing, packing_from_host
from fsdp_utils.model import float8
from fsdp_utils.parallel.compile import BACKEND_VARIABLE, CompileCounts, decoder_stack
from fsdp_utils.synthetic import tiny_model_config
from fsdp_utils.train.loss import LossChunking, Targets, chunked_target_nll, default_chunk_size
from fsdp_utils.train.optim import apply_settings, build_optimizer, implementation
from fsdp_utils.train.step import TrainingDivergedError, build_train_step, forward_loss_sum
from tests.train_helpers import read_metrics, run_finetunes, tiny_args

CPU = torch.device("cpu")
RUN = {
    "precision": "bf16-mixed",
    "gradient_checkpointing": True,
    "checkpoint_every_n_layers": 2,  # layer 0 checkpointed, layer 1 not
    "max_training_steps": 4,
    "no_final_save": False,
}
ONE_PROCESS = {
    "base": {"save_every_steps": 2},
    "direct": {"single_device_path": "direct", "save_every_steps": 2},
    "sync_free": {"sync_free_steps": True, "log_every": 2},
    "fused": {"fused_optimizer": True},
    "float8": {"float8": "rowwise"},
    "compiled_model": {"compile": True, "compile_scope": "model"},
}


def _launch(nproc: int, assets: dict[str, Path], root: Path, runs: dict[str, dict[str, Any]]):
    cache = root / "data_cache"
    argv = {
        name: tiny_args(assets, root / name, cache, **{**RUN, **flags})
        for name, flags in runs.items()
    }
    with pytest.MonkeyPatch.context() as env:
        env.setenv(float8.EMULATE_VARIABLE, "1")
        env.setenv(BACKEND_VARIABLE, "aot_eager")
        results = run_finetunes(nproc, argv, root / "launch")
    for name, outcome in results.items():
        assert outcome["exit_code"] == 0, (name, outcome.get("output_tail"))
    return {name: root / name for name in runs}, (root / "launch" / "output.txt").read_text()


@pytest.fixture(scope="module")
def one_process(tiny_assets, tmp_path_factory):
    return _launch(1, tiny_assets, tmp_path_factory.mktemp("levers_1"), ONE_PROCESS)


@pytest.fixture(scope="module")
def two_processes(tiny_assets, one_process, tmp_path_factory):
    (runs, _) = one_process
    resume = runs["direct"] / "checkpoints" / "step_00000002"
    two = {
        "base": {},
        "fused": {"fused_optimizer": True},
        "reshard": {"reshard_last_layer": True},
        "resumed_direct": {"resume": str(resume)},
    }
    return _launch(2, tiny_assets, tmp_path_factory.mktemp("levers_2"), two)


def _losses(folder: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(folder)}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "final" / "model.safetensors")


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# --- exact levers: the same losses, gradient norms and final weights --------------------------


@pytest.mark.parametrize("lever", ["direct", "sync_free"])
def test_exact_levers_give_the_default_runs_numbers(one_process, lever):
    """--single_device_path direct: FSDP2's numbers without FSDP2 (bf16 compute copies, fp32
    gradients summed over 4 micro-batches, a checkpointed and an unchecked layer);
    --sync_free_steps: the same run, read on log steps only."""
    runs, _ = one_process
    base, other = _losses(runs["base"]), _losses(runs[lever])
    assert len(base) == 4
    expected = {step: base[step] for step in other}
    assert other == expected and len(other) == (2 if lever == "sync_free" else 4)
    assert _largest_difference(_weights(runs["base"]), _weights(runs[lever])) == 0.0


def test_the_direct_path_writes_fsdp2s_checkpoints_which_resume_on_two_processes(
    one_process, two_processes
):
    """The same tensors under the same names, shapes and dtypes (torch.distributed.checkpoint's
    metadata); resumed by FSDP2 on 2 processes, steps 3-4 follow the one-process run's to the
    rounding of a 2-rank gradient sum."""
    from torch.distributed.checkpoint import FileSystemReader

    runs, output = one_process
    assert "one device, direct (no FSDP2" in output
    metadata = {}
    for name in ("base", "direct"):
        meta = FileSystemReader(runs[name] / "checkpoints" / "step_00000004").read_metadata()
        metadata[name] = {
            key: (tuple(value.size), str(value.properties.dtype))
            for key, value in meta.state_dict_metadata.items()
            if hasattr(value, "size")
        }
    assert metadata["direct"] == metadata["base"] and len(metadata["base"]) > 20
    two, output2 = two_processes
    assert "resumed from step 2" in output2
    resumed, base = _losses(two["resumed_direct"]), _losses(runs["base"])
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step][0] == pytest.approx(base[step][0], rel=1e-5)
        assert resumed[step][1] == pytest.approx(base[step][1], rel=1e-3)


class Casts(TorchDispatchMode):
    """Counts casts (`aten._to_copy`) of the given storages."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages, self.count = storages, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.storages:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_direct_paths_casts_with_and_without_gradients():
    """With gradients every forward casts every fp32 weight (the gradient comes back through
    the cast) and leaves the parameters as they were; without, the casts are kept until a
    parameter changes: one cast per update while decoding, not one per token."""
    from fsdp_utils.model.build import find_decoder_layers
    from fsdp_utils.parallel.single_device import apply_direct_path

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_model_config("llama", 96, hidden_size=32))
    params = list(model.parameters())
    config = TrainConfig(precision="bf16-mixed", single_device_path="direct")
    apply_direct_path(model, find_decoder_layers(model), config)
    storages = {p.data_ptr() for p in params}
    ids = _batch(0)["input_ids"]

    def casts(grad: bool) -> int:
        with torch.set_grad_enabled(grad), Casts(storages) as counted:
            logits = model(input_ids=ids, use_cache=False).logits
        assert logits.dtype == torch.bfloat16
        if grad:
            logits.float().sum().backward()
        return counted.count

    assert (casts(False), casts(False)) == (len(params), 0)
    with torch.no_grad():
        model.lm_head.weight.add_(1e-3)  # an update: its version moves
    assert casts(False) == 1
    assert casts(True) == len(params) and casts(True) == len(params)
    assert list(model.parameters()) == params  # the parameters themselves, back after forward
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)


def test_reshard_last_layer_changes_when_it_gathers_not_what_it_computes(two_processes):
    runs, output = two_processes
    assert "the last layer resharded after forward" in output
    assert _losses(runs["reshard"]) == _losses(runs["base"])
    assert _largest_difference(_weights(runs["base"]), _weights(runs["reshard"])) == 0.0


# --- levers within a stated tolerance -----------------------------------------------------------


@pytest.mark.parametrize("nproc", [1, 2])
def test_fused_adamw_within_a_rounding_of_foreach(one_process, two_processes, nproc):
    """torch's fused kernel computes AdamW's update in another order than foreach: the weights
    differ by a rounding of the fp32 update (docs/levers.md: below 1e-7 here, lr 3e-3), the
    losses not at all over 4 steps."""
    runs, output = one_process if nproc == 1 else two_processes
    assert "optimizer: AdamW, fused (torch's kernel for cpu float32 parameters)" in output
    assert "optimizer: AdamW, foreach" in output  # the default runs' line
    base, fused = _losses(runs["base"]), _losses(runs["fused"])
    for step in base:
        assert fused[step][0] == pytest.approx(base[step][0], rel=1e-6)
    assert _largest_difference(_weights(runs["base"]), _weights(runs["fused"])) < 1e-6


def test_float8_within_its_rounding(one_process):
    """rowwise float8 (emulated: the same float8 round trips as on the GPU, the products in
    high precision): every linear layer of the decoder layers converted, the output layer not;
    the losses within 1e-3 of bf16's (float8's 3 mantissa bits, 4% per product on this model,
    average out over a loss of 500 tokens), the gradient norms within 3%."""
    runs, output = one_process
    assert "float8: rowwise scaling on 14 linear layers of the decoder layers, emulated" in output
    base, f8 = _losses(runs["base"]), _losses(runs["float8"])
    assert base != f8  # float8 did change the products
    for step in base:
        assert f8[step][0] == pytest.approx(base[step][0], rel=1e-3)
        assert f8[step][1] == pytest.approx(base[step][1], rel=3e-2)
    assert _weights(runs["float8"]).keys() == _weights(runs["base"]).keys()


def test_whole_model_compile_counts_its_graph_breaks(one_process):
    """--compile_scope model: FSDP2's hooks break the decoder stack's graph, and dynamo leaves
    the loop's frame eager (counted in the log and metrics.jsonl); the loss's chunks compiled
    too. bf16 gradients differ by rounding (the compiled embedding backward sums in fp32), the
    losses within 1e-4."""
    runs, output = one_process
    (first, *_) = read_metrics(runs["compiled_model"], "compile")
    assert first["step"] == 1 and first["scope"] == "model"
    assert first["graph_breaks"] >= 1 and first["eager_frames"] >= 1 and first["graphs"] >= 2
    assert "compile (model): " in output and "; compiled)" in output  # the loss's line
    base, compiled = _losses(runs["base"]), _losses(runs["compiled_model"])
    for step in base:
        assert compiled[step][0] == pytest.approx(base[step][0], rel=1e-4)


# --- host reads of a step, counted ----------------------------------------------------------


class Reads(TorchDispatchMode):
    """Counts reads of tensor values on the host: `_local_scalar_dense` (`.item()`, `float()`,
    `bool()`) and `Tensor.tolist`, except of the tensors in `host` (AdamW's step counters, which
    torch keeps on the host for its foreach kernel: not device reads on a GPU either)."""

    def __init__(self, host: set[int]) -> None:
        super().__init__()
        self.host = host
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and id(args[0]) not in self.host:
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counted_reads(optimizer: torch.optim.Optimizer) -> Iterator[Reads]:
    host = {
        id(state["step"])
        for state in optimizer.state.values()
        if "step" in state and not optimizer.defaults.get("fused")
    }
    reads = Reads(host)
    tolist = torch.Tensor.tolist

    def counted_tolist(tensor: torch.Tensor) -> Any:
        reads.count += 1
        return tolist(tensor)

    torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign]
    try:
        with reads:
            yield reads
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]


def _batch(seed: int, documents: bool = False) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(seed))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if documents:  # row 0 packs two documents, row 1 one
        positions = torch.arange(24).repeat(2, 1)
        positions[0, 10:] -= 10
        batch["position_ids"] = positions
    return batch


def _reads_per_step(**options: Any) -> list[tuple[int, int]]:
    """(reads during the step, reads when its metrics are read) of steps 2 (a log step) and 3
    of a tiny Llama's TrainStep, after a first step that makes the optimizer state."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_model_config("llama", 96, hidden_size=32))
    config = TrainConfig(log_every=2, no_fsdp=True, **options)
    step = build_train_step(model, config, world_size=1, device=CPU, hf_config=model.config)
    counts = []
    for number in range(1, 4):
        batches = [_batch(number), _batch(number + 10, documents=True)]
        targets = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches)
        with counted_reads(step.optimizer) as during:
            metrics = step(
                batches, step=number, global_counts=[targets, 96.0], check=number % 2 == 0
            )
        with counted_reads(step.optimizer) as after:
            metrics = step.read_pending(metrics)
        if number > 1:
            counts.append((during.count, after.count))
        assert metrics["loss"] is None or math.isfinite(metrics["loss"])
    return counts


def test_sync_free_steps_read_nothing_but_the_log_steps_values_after_their_update():
    """Default: every step reads transformers' packing check once per micro-batch (2), and a
    log step its loss and norm before the update (1). --sync_free_steps: nothing during any step;
    on log steps one read of the values copied back, after the update is queued. fp16-mixed's
    scaler reads its inf check every step with foreach AdamW; with the fused kernel, never."""
    assert _reads_per_step() == [(3, 0), (2, 0)]
    assert _reads_per_step(sync_free_steps=True) == [(0, 1), (0, 0)]
    fp16 = {"sync_free_steps": True, "precision": "fp16-mixed"}
    assert _reads_per_step(**fp16) == [(1, 1), (1, 0)]
    assert _reads_per_step(**fp16, fused_optimizer=True) == [(0, 1), (0, 0)]


def test_the_sync_free_line_names_the_read_of_liger_loss():
    """liger's fused linear cross-entropy reads its target count per micro-batch (its kernels
    need a GPU, so the read is not counted here): the log's line says so."""
    from types import SimpleNamespace

    from fsdp_utils.train.step import describe_sync_free

    step: Any = SimpleNamespace(scaler=None, optimizer=None)
    config = TrainConfig(sync_free_steps=True, log_every=10)
    assert "liger" not in describe_sync_free(config, step)
    line = describe_sync_free(config.replace(liger_kernels=True), step)
    assert line.endswith("reads its target count once per micro-batch (target_mask.sum().item() "
                         "in its forward)")  # fmt: skip


def test_sync_free_steps_never_save_a_non_finite_update():
    """Step 2's gradient is infinite and step 3 is the log step: step 2's update was applied (no
    step waits), the read at step 3 stops the run, and so would a save."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_model_config("llama", 96, hidden_size=32))
    config = TrainConfig(log_every=3, no_fsdp=True, sync_free_steps=True)
    step = build_train_step(model, config, world_size=1, device=CPU, hf_config=model.config)
    for number in (1, 2, 3):
        poison = None
        if number == 2:
            poison = model.lm_head.weight.register_hook(lambda grad: grad * math.inf)
        metrics = step([_batch(number)], step=number, global_counts=[46.0, 48.0], check=number == 3)
        if poison is not None:
            poison.remove()
    with pytest.raises(TrainingDivergedError, match=r"at step 2 \(found at step 3: no step is"):
        step.read_pending(metrics)
    with pytest.raises(TrainingDivergedError, match="before saving a checkpoint at step 3"):
        step.check_weights_finite("saving a checkpoint", 3)


def test_packing_from_the_host_gives_transformers_masks():
    """Packed documents and single ones: the loss with the packing taken from the host is the
    loss with transformers' own check, bit for bit."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_model_config("llama", 96, hidden_size=32)).eval()
    chunking = LossChunking(7)

    def loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return forward_loss_sum(model, batch, CPU, contextlib.nullcontext, chunking)[1]

    packed, single = _batch(1, documents=True), _batch(2)
    for batch in (packed, single):
        plain = loss(batch)
        with packing_from_host():
            assert torch.equal(loss(batch), plain)
    whole = {k: v for k, v in packed.items() if k != "position_ids"}
    assert not torch.equal(loss(whole), loss(packed))  # the documents' masks were used
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])
    with known_packing(None), counted_reads(optimizer) as reads:  # transformers' own: a read
        loss(single)
    assert reads.count == 1


# --- the optimizer's kernel -----------------------------------------------------------------


def test_fused_where_torch_has_the_kernel_and_foreach_otherwise():
    params = [torch.nn.Parameter(torch.zeros(4))]
    fused = TrainConfig(fused_optimizer=True)
    assert implementation(params, fused).fused
    assert not implementation(params, TrainConfig()).fused
    on_meta = [torch.nn.Parameter(torch.zeros(4, device="meta"))]
    choice = implementation(on_meta, fused)
    assert not choice.fused and "no fused kernel" in choice.note and "meta" in choice.note


def test_a_resume_keeps_the_kernel_the_run_asked_for():
    """torch's load_state_dict takes `fused` from the checkpoint's param groups: a run saved
    with --fused_optimizer resumed without it would stay fused."""
    model = torch.nn.Linear(4, 4)
    saved = build_optimizer(model, TrainConfig(fused_optimizer=True))
    model(torch.randn(2, 4)).sum().backward()
    saved.step()
    resumed = build_optimizer(model, TrainConfig())
    resumed.load_state_dict(saved.state_dict())
    assert resumed.param_groups[0]["fused"]
    apply_settings(resumed, TrainConfig())
    assert not resumed.param_groups[0]["fused"] and resumed.param_groups[0]["foreach"]


# --- the loss: per-device chunks, compiled chunks ----------------------------------------------


def test_the_loss_chunk_default_per_device():
    assert default_chunk_size(32_000, "cuda")[0] == 8192  # torchtitan's 8,192 tokens
    assert default_chunk_size(128_256, "cuda")[0] == 2092  # at most 256 Mi logits
    assert default_chunk_size(256_000, "cuda")[0] == 1048
    assert default_chunk_size(128_256, "cpu")[0] == 523  # 64 Mi logits, as before
    assert default_chunk_size(32_000, "cpu")[0] == 2097
    chunking = LossChunking.build(None, tiny_model_config("llama", 32_000), device_type="cuda")
    assert chunking.chunk_size == 8192 and "the GPU default" in chunking.note


def test_the_planner_traces_the_gpus_chunk():
    from fsdp_utils.config.batch import plan_batch
    from fsdp_utils.plan.estimate import _direct_to_trace, _loss_chunks_to_trace

    hf = tiny_model_config("llama", 128_256)
    config = TrainConfig(max_seq_length=4096, batch_size_per_device=4, total_batch_size=4)
    traced, note = _loss_chunks_to_trace(config, hf, plan_batch(config, 1))
    assert traced.loss_chunk_size == 2092 and "2,092 tokens (cuda's default)" in note
    on_cpu, _ = _loss_chunks_to_trace(config.replace(device="cpu"), hf, plan_batch(config, 1))
    assert on_cpu.loss_chunk_size == 523
    direct = config.replace(single_device_path="direct")
    assert _direct_to_trace(direct, 1)[0].sharding == "shard_grad_op"
    checkpointed, note = _direct_to_trace(direct.replace(gradient_checkpointing=True), 1)
    assert checkpointed.reshard_last_layer and checkpointed.single_device_path == "fsdp"
    assert _direct_to_trace(direct, 2) == (direct, "")


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_the_compiled_chunks_give_the_eager_loss_and_gradients(arch, monkeypatch):
    """--compile's chunks (aot_eager here), fp32: Llama's plain head computes its gradients in
    the forward (`_nll_sum_and_logit_grad` compiled), Gemma 2's soft-capped one in checkpointed
    chunks (`_logits_nll` compiled); a shorter last chunk is one recompile."""
    monkeypatch.setenv(BACKEND_VARIABLE, "aot_eager")
    config = tiny_model_config(arch, 96, hidden_size=32)
    torch.manual_seed(0)
    head = AutoModelForCausalLM.from_config(config).get_output_embeddings().float()
    transform = LossChunking.build(7, config).transform
    hidden = torch.randn(2, 20, 32)
    labels = torch.randint(0, 96, (2, 20))
    targets = Targets.of(labels, 20)
    results = []
    recompiles = CompileCounts.now().recompiles
    for compiled in (False, True):
        head.zero_grad()
        h = hidden.clone().requires_grad_(True)
        loss = chunked_target_nll(
            head, h, targets, chunk_size=16, transform=transform, summed=True, compiled=compiled
        )
        loss.backward()
        results.append((loss.detach(), h.grad, head.weight.grad.clone()))
    assert CompileCounts.now().recompiles == recompiles + 1  # chunks of 16, 16, then 8
    (eager, *eager_grads), (compiled, *compiled_grads) = results
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=0)
    for a, b in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_whole_model_compile_is_the_decoder_stack():
    model = AutoModelForCausalLM.from_config(tiny_model_config("llama", 96))
    from fsdp_utils.model.build import find_decoder_layers

    assert decoder_stack(model, find_decoder_layers(model)) is model.model
    with pytest.raises(ValueError, match="--compile_scope model chooses what --compile compiles"):
        validate_config(TrainConfig(compile_scope="model"))
    with pytest.raises(ValueError, match="--single_device_path direct replaces FSDP2"):
        validate_config(TrainConfig(single_device_path="direct", cpu_offload=True))


# --- float8: what converts, what is refused ---------------------------------------------------


def test_float8_converts_the_decoder_layers_linears_only():
    from fsdp_utils.model.build import build_meta_model
    from fsdp_utils.model.transforms import transform_model

    hf = tiny_model_config("mixtral", 96, hidden_size=64)
    meta = transform_model(build_meta_model(hf, "bf16-mixed"), TrainConfig(float8="tensorwise"))
    converted = {n for n, m in meta.model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert converted and all(".layers." in name for name in converted)
    assert not any(name.endswith(".gate") for name in converted)  # the routers
    assert type(meta.model.lm_head) is torch.nn.Linear


def test_float8_refusals(monkeypatch):
    monkeypatch.delenv(float8.EMULATE_VARIABLE, raising=False)
    config = TrainConfig(float8="rowwise")
    with pytest.raises(ValueError, match=r"this run is on the CPU\. Drop --float8 here"):
        float8.check_float8_device(config, "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"this NVIDIA A100-SXM4-80GB has 8\.0"):
        float8.check_float8_device(config, "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    float8.check_float8_device(config, "cuda")  # an H100: accepted
    monkeypatch.setenv(float8.EMULATE_VARIABLE, "1")
    float8.check_float8_device(config, "cpu")  # the tests' emulation


def test_the_gpu_checks_wait_where_the_run_has_no_gpu(monkeypatch):
    """`run_device_type`: where the device checks are made, and float8's never asks a GPU
    that is not there for its compute capability (torch raises without one)."""
    from fsdp_utils.run.preflight import run_device_type

    monkeypatch.delenv(float8.EMULATE_VARIABLE, raising=False)

    def kinds(has_gpu: bool) -> dict[tuple[str, bool], str | None]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: has_gpu)
        return {
            (device, run_host): run_device_type(TrainConfig(device=device), run_host=run_host)
            for device in ("auto", "cuda", "cpu")
            for run_host in (True, False)
        }

    assert kinds(has_gpu=True) == {
        ("auto", True): "cuda", ("auto", False): "cuda", ("cuda", True): "cuda",
        ("cuda", False): "cuda", ("cpu", True): "cpu", ("cpu", False): "cpu",
    }  # fmt: skip
    assert kinds(has_gpu=False) == {
        ("auto", True): "cpu", ("auto", False): None, ("cuda", True): None,
        ("cuda", False): None, ("cpu", True): "cpu", ("cpu", False): "cpu",
    }  # fmt: skip

    def no_gpu(*args: Any) -> None:
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_gpu)
    config = TrainConfig(float8="rowwise")
    float8.check_float8_device(config, None)
    float8.check_float8_device(config, "cuda")  # no GPU visible: the trainer's start refuses
    with pytest.raises(ValueError, match="--float8 rowwise with --lora"):
        validate_config(config.replace(lora=True))


def test_the_levers_are_in_the_run_config(one_process):
    runs, _ = one_process
    saved = json.loads((runs["direct"] / "config.json").read_text())
    assert saved["config"]["single_device_path"] == "direct"
    assert saved["resolved"]["optimizer_kernel"] == "foreach"
    fused = json.loads((runs["fused"] / "config.json").read_text())
    assert fused["resolved"]["optimizer_kernel"] == "fused"
