"""The final model and `python -m fsdp_utils.export` are written in the source model's dtype by
default, `--export_dtype` to choose, and the config written says what the files hold."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fsdp_utils.checkpoint.export import main as export_main
from fsdp_utils.checkpoint.hf_folder import resolve_export_dtype
from fsdp_utils.config.train_config import TrainConfig
from tests.train_helpers import check_ok, run_finetune, tiny_args


def _weight_dtypes(folder: Path) -> set[torch.dtype]:
    dtypes = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            dtypes |= {f.get_tensor(name).dtype for name in f.keys()}  # noqa: SIM118
    return dtypes


def _config_dtype(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype"))


def test_export_dtype_follows_the_source_config_or_the_choice() -> None:
    class Config:
        dtype = torch.bfloat16

    class OldConfig:  # transformers 4 spelling, as a string
        torch_dtype = "float16"

    assert resolve_export_dtype("auto", Config()) == torch.bfloat16
    assert resolve_export_dtype("auto", OldConfig()) == torch.float16
    assert resolve_export_dtype("auto", object()) == torch.float32  # no dtype: fp32
    assert resolve_export_dtype("float32", Config()) == torch.float32
    with pytest.raises(ValueError, match="auto, float32, bfloat16, float16"):
        resolve_export_dtype("fp8", Config())
    assert TrainConfig().export_dtype == "auto"


@pytest.mark.slow
def test_a_bf16_model_is_exported_in_bf16(tmp_path: Path, tiny_assets: dict[str, Path]) -> None:
    """Trained with fp32 master weights, a bf16 model comes out in bf16 (half the bytes), both
    at the end of training and from a checkpoint; --export_dtype float32 gives fp32."""
    from transformers import AutoModelForCausalLM

    source = tmp_path / "bf16-model"
    model = AutoModelForCausalLM.from_pretrained(tiny_assets["model"], dtype=torch.bfloat16)
    model.save_pretrained(source)
    for tokenizer_file in tiny_assets["model"].glob("tokenizer*"):
        shutil.copy(tokenizer_file, source)
    assert _weight_dtypes(source) == {torch.bfloat16} and _config_dtype(source) == "bfloat16"

    out = tmp_path / "run"
    args = tiny_args(
        {**tiny_assets, "model": source}, out, tmp_path / "data", max_training_steps=2,
        save_every_steps=2,
    )  # fmt: skip
    check_ok(run_finetune(1, args))
    final = out / "final"
    assert _weight_dtypes(final) == {torch.bfloat16} and _config_dtype(final) == "bfloat16"

    checkpoint = out / "checkpoints" / "step_00000002"
    assert export_main([str(checkpoint), str(tmp_path / "auto")]) == 0
    assert _weight_dtypes(tmp_path / "auto") == {torch.bfloat16}
    assert _config_dtype(tmp_path / "auto") == "bfloat16"
    assert export_main([str(checkpoint), str(tmp_path / "fp32"), "--export_dtype", "float32"]) == 0
    assert _weight_dtypes(tmp_path / "fp32") == {torch.float32}
    assert _config_dtype(tmp_path / "fp32") == "float32"

    # The same weights every way: the final model is the last checkpoint, rounded once.
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32").state_dict()
    exported = AutoModelForCausalLM.from_pretrained(final).state_dict()
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k].to(torch.bfloat16)) for k in trained)
