"""Will the run's checkpoints fit on its disk? (`fsdp_utils.checkpoint.storage`) The size of a
checkpoint from a meta build (CodeLlama-7B's config.json: no weights), the verdicts of the
plan, and the size against what real saves of the tiny model write on 2 processes and on 1."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from fsdp_utils.checkpoint.sharded import CheckpointInfo, list_checkpoints
from fsdp_utils.checkpoint.storage import (
    CheckpointSize,
    StoragePlan,
    checkpoint_size,
    model_export_bytes,
    optimizer_states_per_parameter,
    plan_storage,
)
from fsdp_utils.config.parse import parse_config
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.hub.resolve import load_model_config
from fsdp_utils.model.build import build_meta_model
from fsdp_utils.model.transforms import transform_model
from fsdp_utils.synthetic import tiny_model_config
from tests.train_helpers import check_ok, run_finetune, tiny_args

CODELLAMA_7B = Path(__file__).parent / "fixtures" / "configs" / "codellama-7b"


def _storage_plan(
    config: TrainConfig, hf_config: Any, model_dir: Path, world_size: int = 1
) -> StoragePlan:
    """The storage plan as the Trainer and the preflight make it: on the transformed meta
    model."""
    meta = transform_model(build_meta_model(hf_config, config.precision), config)
    return plan_storage(meta.model, config, hf_config, model_dir, existing=0, world_size=world_size)


@pytest.mark.parametrize(
    ("optimizer", "momentum", "states"), [("adamw", 0.0, 2), ("sgd", 0.9, 1), ("sgd", 0.0, 0)]
)
def test_optimizer_states_per_parameter(optimizer, momentum, states):
    config = TrainConfig(optimizer=optimizer, momentum=momentum)
    assert optimizer_states_per_parameter(config) == states


def test_checkpoint_size_is_derived_from_what_it_holds() -> None:
    """CodeLlama-7B: fp32 master weights 4 B + AdamW's two states 8 B per parameter (the issue's
    "about 80 GB"); bf16-true halves both; SGD without momentum has no state."""
    hf_config = load_model_config(CODELLAMA_7B)
    with torch.device("meta"):
        n = AutoModelForCausalLM.from_config(hf_config).num_parameters()
    totals = {}
    for precision, optimizer, per_param, states in [
        ("bf16-mixed", "adamw", 4, 2),
        ("bf16-true", "adamw", 2, 2),
        ("fp32", "sgd", 4, 0),
    ]:
        config = TrainConfig(precision=precision, optimizer=optimizer)
        size = checkpoint_size(build_meta_model(hf_config, precision), config, CODELLAMA_7B)
        assert size.model_bytes == per_param * n
        assert size.optimizer_bytes == states * per_param * n
        assert 0 < size.other_bytes < 1e-3 * size.total
        totals[precision] = size.total
    assert 80e9 < totals["bf16-mixed"] < 82e9


@functools.cache
def _codellama_size() -> CheckpointSize:
    model = build_meta_model(load_model_config(CODELLAMA_7B), "bf16-mixed")
    return checkpoint_size(model, TrainConfig(), CODELLAMA_7B)


def _plan(free: float, keep_last: int = 2, existing: int = 0) -> StoragePlan:
    size = _codellama_size()
    return StoragePlan(size, keep_last, existing, size.model_bytes, int(free), Path("/home/me"))


def test_storage_check_fails_when_not_one_checkpoint_fits() -> None:
    with pytest.raises(ValueError, match=r"Not even one checkpoint of this run fits") as error:
        _plan(free=50e9).check()
    assert "80.9 GB" in str(error.value) and "--output_dir /scratch/" in str(error.value)
    # One fits, three (keep_last 2 + the one being written) + the final model do not: a warning.
    line = _plan(free=100e9).check()
    assert line.startswith("warning: storage:") and "lower --keep_last" in line
    assert "3 more checkpoint(s)" in line
    assert _plan(free=1e12).check().startswith("storage: a checkpoint is 80.9 GB")
    # Checkpoints of this run already on disk are replaced by pruning, not added to.
    assert _plan(free=1e12, keep_last=2, existing=5).checkpoints_to_write == 1
    assert _plan(free=1e12, keep_last=1, existing=0).checkpoints_to_write == 2


def test_the_plan_needs_keep_last_checkpoints_plus_the_one_being_written() -> None:
    size = _codellama_size()
    plan = StoragePlan(size, 3, 0, final_bytes=10**9, free=10**13, folder=Path("/scratch"))
    assert plan.checkpoints_to_write == 4
    assert plan.needed == 4 * size.total + 10**9
    # keep_last 0 still keeps one: the newest is never deleted before the next one is sealed.
    assert StoragePlan(size, 0, 0, 0, 10**13, Path("/scratch")).checkpoints_to_write == 2


def test_the_final_model_counts_tied_weights_once_in_the_export_dtype() -> None:
    tied = tiny_model_config("qwen2", 100, hidden_size=32, num_layers=2, tie_word_embeddings=True)
    untied = tiny_model_config(
        "qwen2", 100, hidden_size=32, num_layers=2, tie_word_embeddings=False
    )
    with torch.device("meta"):
        models = [AutoModelForCausalLM.from_config(c) for c in (tied, untied)]
    tied_count, untied_count = (m.num_parameters() for m in models)
    assert untied_count - tied_count == 100 * 32  # the output embedding, once
    assert model_export_bytes(models[0], torch.bfloat16) == 2 * tied_count
    assert model_export_bytes(models[1], torch.float32) == 4 * untied_count


def test_a_lora_checkpoint_is_counted_as_adapters_only(tmp_path: Path) -> None:
    """LoRA saves the adapters and their AdamW state, not the frozen base (megabytes for 7B);
    the final folder is the adapters, plus the whole model with --merge."""
    hf_config = load_model_config(CODELLAMA_7B)
    config = TrainConfig(lora=True, output_dir=str(tmp_path / "run"))
    plan = _storage_plan(config, hf_config, CODELLAMA_7B)
    # r=8 on every linear layer of the 32 blocks: 8 x (in + out) fp32 values per layer.
    h, m = hf_config.hidden_size, hf_config.intermediate_size
    per_block = 4 * 8 * (h + h) + 3 * 8 * (h + m)
    assert plan.size.model_bytes == 4 * hf_config.num_hidden_layers * per_block  # 80 MB
    assert plan.size.optimizer_bytes == 2 * plan.size.model_bytes
    assert plan.final_bytes == plan.size.model_bytes
    merged = _storage_plan(config.replace(merge=True), hf_config, CODELLAMA_7B)
    # A full fine-tune's final model is written in the source model's dtype (bf16 here).
    full = _storage_plan(config.replace(lora=False), hf_config, CODELLAMA_7B)
    assert full.final_bytes == full.size.model_bytes // 2  # fp32 master weights, bf16 export
    fp32 = config.replace(lora=False, export_dtype="float32")
    assert _storage_plan(fp32, hf_config, CODELLAMA_7B).final_bytes == (full.size.model_bytes)
    assert merged.final_bytes > 13e9  # the merged model (7B in bf16) beside the adapters


# --- against real saves ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_checkpoints(tiny_assets, tmp_path_factory) -> dict[int, tuple[list[str], CheckpointInfo]]:
    """One step of the tiny model, saved by 2 processes and by 1: {world size: (flags, its
    checkpoint)}."""
    data_cache = tmp_path_factory.mktemp("data_cache")
    saved = {}
    for world_size in (2, 1):
        out = tmp_path_factory.mktemp(f"world_size_{world_size}") / "run"
        args = tiny_args(
            tiny_assets, out, data_cache, max_training_steps=1, save_every_steps=1,
            no_final_save=True,
        )  # fmt: skip
        check_ok(run_finetune(world_size, args))
        (checkpoint,) = list_checkpoints(out / "checkpoints")
        saved[world_size] = args, checkpoint
    return saved


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 1])
def test_the_size_is_what_a_real_save_writes(real_checkpoints, tiny_assets, world_size):
    """Every byte counts for the tiny model: DCP's framing of each tensor (per rank), the
    config and tokenizer files."""
    args, checkpoint = real_checkpoints[world_size]
    assert checkpoint.meta["world_size"] == world_size
    config, _ = parse_config(args)
    hf_config = load_model_config(tiny_assets["model"])
    plan = _storage_plan(config, hf_config, tiny_assets["model"], world_size=world_size)
    on_disk = sum(f.stat().st_size for f in checkpoint.path.rglob("*") if f.is_file())
    assert plan.size.total == pytest.approx(on_disk, rel=0.03)
