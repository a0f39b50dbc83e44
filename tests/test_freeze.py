"""`--freeze_layers N` (fsdp_utils/model/freeze.py): the transform on meta models, the storage
check and the planner, and one real 2-process FSDP2 run read several ways: frozen weights
bit-identical, checkpoints and optimizer state of what trains only, their size on disk against
the estimate, exact resume, and an export of the whole model. (The planner traces the frozen
model with the trainer's own step and tracker, as for LoRA, whose plan test_lora.py compares
with a real run's.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from fsdp_utils.checkpoint.sharded import list_checkpoints, read_checkpoint
from fsdp_utils.checkpoint.storage import plan_storage
from fsdp_utils.config.parse import build_parser, parse_config
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.hub.resolve import load_model_config
from fsdp_utils.model.build import build_meta_model, find_decoder_layers
from fsdp_utils.model.freeze import describe, frozen_dtype
from fsdp_utils.model.transforms import apply_transforms, transform_model
from fsdp_utils.plan.estimate import Cluster, estimate
from fsdp_utils.synthetic import tiny_model_config
from tests.train_helpers import check_ok, read_metrics, run_finetune, tiny_args

CODELLAMA_7B = Path(__file__).parent / "fixtures" / "configs" / "codellama-7b"


def _storage(config, hf_config, model_dir, world_size=1):
    """The storage plan as the Trainer and the preflight make it: on the transformed meta model."""
    meta = transform_model(build_meta_model(hf_config, config.precision), config)
    return plan_storage(meta.model, config, hf_config, model_dir, existing=0, world_size=world_size)


def _frozen_meta_model(hf_config, **options):
    config = TrainConfig(**options)
    model = build_meta_model(hf_config, config.precision)
    apply_transforms(model, find_decoder_layers(model), hf_config, config)
    return model, config


# --- the transform, on meta models (fast) -----------------------------------------------------


def test_the_embeddings_and_the_first_layers_freeze():
    model, config = _frozen_meta_model(tiny_model_config("llama", 512), freeze_layers=1)
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    assert frozen == sorted(
        ["model.embed_tokens.weight"]
        + [n for n, _ in model.named_parameters() if n.startswith("model.layers.0.")]
    )
    assert "lm_head" not in describe(config, model)  # untied: it trains
    # GPT-2's learned positions are embeddings too.
    gpt2, _ = _frozen_meta_model(tiny_model_config("gpt2", 512), freeze_layers=1)
    assert not gpt2.get_submodule("transformer.wpe").weight.requires_grad


def test_a_tied_lm_head_is_frozen_with_the_embeddings():
    model, config = _frozen_meta_model(tiny_model_config("qwen2", 512), freeze_layers=1)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.lm_head.weight.requires_grad
    assert "lm_head is tied to the token embeddings, so it is frozen too" in describe(config, model)


@pytest.mark.parametrize(
    ("checkpoint_dtype", "precision", "frozen", "trained"),
    [
        (torch.bfloat16, "bf16-mixed", torch.bfloat16, torch.float32),  # no master copy needed
        (torch.float32, "bf16-mixed", torch.float32, torch.float32),  # bf16 would round them
        (torch.float16, "bf16-mixed", torch.float32, torch.float32),  # fp16 values are not bf16
        (torch.float16, "fp16-mixed", torch.float16, torch.float32),
        (torch.bfloat16, "bf16-true", torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, "fp32", torch.float32, torch.float32),
    ],
)
def test_frozen_weights_keep_the_pretrained_values_in_the_fewest_bytes(
    checkpoint_dtype, precision, frozen, trained
):
    hf_config = tiny_model_config("llama", 512)
    hf_config.dtype = checkpoint_dtype
    model, config = _frozen_meta_model(hf_config, freeze_layers=1, precision=precision)
    assert frozen_dtype(hf_config, config) == frozen
    for name, param in model.named_parameters():
        assert param.dtype == (trained if param.requires_grad else frozen), name


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match="--freeze_layers must be >= 0"):
        parse_config(["--freeze_layers", "-1"])
    with pytest.raises(ValueError, match="LoRA already freezes every pretrained weight"):
        parse_config(["--freeze_layers", "2", "--lora"])
    with pytest.raises(ValueError, match=r"the model has 2 decoder layers\. Freeze at most 2"):
        _frozen_meta_model(tiny_model_config("llama", 512), freeze_layers=3)


def test_the_storage_check_counts_what_trains_and_the_whole_final_model(tmp_path):
    """CodeLlama-7B (bf16) with the bottom 16 of 32 layers frozen: checkpoints hold the top 16
    layers, the final norm and lm_head in fp32 with AdamW's two states; the final model is the
    whole model in bf16, as without --freeze_layers."""
    hf_config = load_model_config(CODELLAMA_7B)
    config = TrainConfig(freeze_layers=16, output_dir=str(tmp_path / "run"))
    plan = _storage(config, hf_config, CODELLAMA_7B)
    full = _storage(config.replace(freeze_layers=0), hf_config, CODELLAMA_7B)
    model = build_meta_model(hf_config, "bf16-mixed")
    layer = sum(p.numel() for p in find_decoder_layers(model)[0].parameters())
    trained = 16 * layer + model.lm_head.weight.numel() + model.model.norm.weight.numel()
    assert plan.size.model_bytes == 4 * trained
    assert plan.size.optimizer_bytes == 8 * trained
    assert plan.final_bytes == full.final_bytes  # the whole model, in bf16


def test_the_planner_counts_only_what_trains(tiny_assets):
    """State at the optimizer step, per rank of 2: frozen weights 4 bytes each (fp32: the tiny
    model is saved in fp32), trained ones 16 (fp32 weight and gradient, AdamW's two states)."""
    config = TrainConfig(
        model=str(tiny_assets["model"]), max_seq_length=64, total_batch_size=4,
        batch_size_per_device=2, precision="bf16-mixed", freeze_layers=1,
    )  # fmt: skip
    cluster = Cluster(nodes=1, gpus_per_node=2)
    planned = estimate(config, cluster).memory
    full = estimate(config.replace(freeze_layers=0), cluster).memory
    model, _ = _frozen_meta_model(load_model_config(tiny_assets["model"]), **vars(config))
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert planned.state_bytes == pytest.approx((4 * frozen + 16 * trained) / 2, rel=1e-3)
    assert full.state_bytes == pytest.approx(16 * (frozen + trained) / 2, rel=1e-3)
    # Layer 0 runs forward only: none of its activations are kept for backward.
    assert planned.breakdown().activations < full.breakdown().activations


# --- one real 2-process run (slow) ----------------------------------------------------------

STEPS, SAVE_AT = 8, 4
FREEZE = {"freeze_layers": 1, "max_training_steps": STEPS, "learning_rate": 1e-2}


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="module")
def freeze_run(tiny_assets, data_cache, tmp_path_factory) -> dict:
    """2 processes, FSDP2, fp32, embeddings and layer 0 of 2 frozen, checkpoints at 4 and 8."""
    out = tmp_path_factory.mktemp("freeze") / "run"
    args = tiny_args(tiny_assets, out, data_cache, save_every_steps=SAVE_AT, **FREEZE)
    result = run_finetune(2, args)
    check_ok(result)
    return {"out": out, "args": args, "stdout": result.stdout}


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


@pytest.mark.slow
def test_frozen_weights_stay_bit_identical_and_the_rest_learns(freeze_run, tiny_assets):
    losses = _losses(freeze_run["out"])
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.01
    assert "freeze: the embeddings and decoder layer 0 frozen" in freeze_run["stdout"]
    pretrained = load_file(tiny_assets["model"] / "model.safetensors")
    final = load_file(freeze_run["out"] / "final" / "model.safetensors")
    assert final.keys() == pretrained.keys()  # the whole model, frozen layers included
    frozen = {k for k in pretrained if k.startswith(("model.embed_tokens.", "model.layers.0."))}
    for key, value in pretrained.items():
        assert torch.equal(final[key], value) == (key in frozen), key


@pytest.mark.slow
def test_checkpoints_hold_what_trains_and_the_storage_check_knows_their_size(
    freeze_run, tiny_assets
):
    out = freeze_run["out"]
    checkpoint = read_checkpoint(out / "checkpoints" / f"step_{STEPS:08d}")
    keys = dcp.FileSystemReader(str(checkpoint.path)).read_metadata().state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    trained = {k for k in load_file(tiny_assets["model"] / "model.safetensors")}
    trained = {k for k in trained if not k.startswith(("model.embed_tokens.", "model.layers.0."))}
    assert model_keys == trained
    # AdamW's state: exp_avg and exp_avg_sq (and the step) of the trained parameters only.
    states = {k.split(".", 2)[2].rsplit(".", 1)[0] for k in keys if k.startswith("optim.state.")}
    assert states == trained
    assert checkpoint.meta["identity"]["freeze_layers"] == 1

    config, _ = parse_config(freeze_run["args"], build_parser())
    hf_config = load_model_config(tiny_assets["model"])
    plan = _storage(config, hf_config, tiny_assets["model"], world_size=2)
    on_disk = sum(f.stat().st_size for f in checkpoint.path.rglob("*") if f.is_file())
    assert plan.size.total == pytest.approx(on_disk, rel=0.03)


@pytest.mark.slow
def test_resume_is_exact(freeze_run, tiny_assets, data_cache, tmp_path):
    """From step 4 on 2 processes: the frozen layers from --model, the rest and the optimizer
    from the checkpoint; the uninterrupted run's losses exactly. (Resuming on another world
    size is the same resharding as full fine-tuning's, tested in test_checkpoint.py.)"""
    reference = _losses(freeze_run["out"])
    saved = freeze_run["out"] / "checkpoints" / f"step_{SAVE_AT:08d}"
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(saved, out / "checkpoints" / saved.name)
    result = run_finetune(2, tiny_args(tiny_assets, out, data_cache, no_final_save=True, **FREEZE))
    check_ok(result)
    assert f"resumed from step {SAVE_AT} " in result.stdout
    assert reference[:SAVE_AT] + _losses(out) == reference


@pytest.mark.slow
def test_the_export_of_a_checkpoint_is_the_final_model(freeze_run, tmp_path):
    """The checkpoint lacks the frozen layers: export takes them from the run's --model."""
    from fsdp_utils.checkpoint.export import main as export_main

    out = freeze_run["out"]
    (last,) = [c for c in list_checkpoints(out / "checkpoints") if c.step == STEPS]
    assert export_main([str(last.path), str(tmp_path / "exported")]) == 0
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    final = load_file(out / "final" / "model.safetensors")
    assert exported.keys() == final.keys()
    for key in final:
        assert torch.equal(exported[key], final[key]), key
