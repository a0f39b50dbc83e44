"""`--attn_implementation`: what reaches the model build, the preflight's refusals (one paragraph,
before the job waits), the planner, and the standalone chess evaluation."""

from __future__ import annotations

import pytest
import transformers

from fsdp_utils.config.parse import parse_config
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.document_masking import HONOURS_PACKING, isolates_documents
from fsdp_utils.model.attention import (
    IMPLEMENTATIONS,
    check_attn_implementation,
    supported_implementations,
)
from fsdp_utils.model.build import build_meta_model
from fsdp_utils.synthetic import tiny_model_config


def _gemma2() -> transformers.Gemma2Config:
    """Gemma 2: attention logits soft-capped, which SDPA cannot do (`_supports_sdpa = False`)."""
    return transformers.Gemma2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip


def _error(hf_config, device_type="cpu", **options) -> str:
    config = TrainConfig(**options)
    with pytest.raises(ValueError) as err:
        check_attn_implementation(hf_config, config, device_type=device_type)
    message = str(err.value)
    assert "\n" not in message  # one paragraph
    return message


def test_the_implementation_reaches_the_model_and_sdpa_falls_back_as_transformers_does():
    assert TrainConfig().attn_implementation == "sdpa"
    assert parse_config(["--attn_implementation", "eager"])[0].attn_implementation == "eager"
    llama = tiny_model_config("llama", 512)
    for name in ("sdpa", "eager"):
        model = build_meta_model(llama, "fp32", attn_implementation=name)
        assert model.config._attn_implementation == name
    # A model that cannot run SDPA gets eager for the default, as from_pretrained gives it.
    assert build_meta_model(_gemma2(), "fp32").config._attn_implementation == "eager"
    assert "sdpa" not in supported_implementations(_gemma2())
    assert supported_implementations(tiny_model_config("gpt2", 512)) == [
        "sdpa", "eager", "flash_attention_2",
    ]  # fmt: skip
    for name in ("sdpa", "eager"):  # nothing to refuse
        check_attn_implementation(llama, TrainConfig(attn_implementation=name), device_type="cpu")


def test_what_cannot_train_is_refused_with_the_fix():
    llama = tiny_model_config("llama", 512)
    flash = {"attn_implementation": "flash_attention_2"}
    assert "--precision bf16-mixed" in _error(llama, "cuda", precision="fp32", **flash)
    assert "needs a CUDA GPU" in _error(llama, "cpu", **flash)
    assert "no backward pass there" in _error(llama, "cpu", attn_implementation="flex_attention")
    # On a GPU node, transformers' own checks: GPT-2 has no flex attention; flash-attn is not
    # installed here.
    message = _error(tiny_model_config("gpt2", 512), "cuda", attn_implementation="flex_attention")
    assert message.startswith("--attn_implementation flex_attention cannot serve this model (gpt2)")
    assert "gpt2 supports: sdpa, eager, flash_attention_2" in message
    if not transformers.utils.is_flash_attn_2_available():
        message = _error(llama, "cuda", **flash)
        assert message.startswith("--attn_implementation flash_attention_2 is not usable")
        assert "doesn't seem to be installed" in message and "pip install flash-attn" in message
    # --document_masking with flash attention and 2 sequences per pass: the rule of
    # data/document_masking.py, checked by name before anything is built.
    masked = _error(llama, "cuda", document_masking=True, batch_size_per_device=2, **flash)
    assert "--batch_size_per_device 1" in masked


def test_which_implementations_keep_packed_documents_apart():
    assert set(HONOURS_PACKING) <= set(IMPLEMENTATIONS)
    for name in IMPLEMENTATIONS:
        assert isolates_documents(name, batch_size_per_device=1)
        assert isolates_documents(name, batch_size_per_device=2) == (name != "flash_attention_2")


def test_the_preflight_refuses_before_the_job_waits(tiny_assets, tmp_path, capsys):
    from fsdp_utils.cli import main

    common = ["--model", str(tiny_assets["model"]), "--dataset", str(tiny_assets["data"]),
              "--dataset_include", "", "--output_dir", str(tmp_path / "run"),
              "--max_seq_length", "64", "--total_batch_size", "8", "--preflight",
              "--world_size", "2", "--gpu_memory", "off", "--device", "cpu"]  # fmt: skip
    assert main([*common, "--attn_implementation", "flex_attention"]) == 2
    err = capsys.readouterr().err
    assert "error: --attn_implementation flex_attention cannot train on the CPU" in err
    assert "Traceback" not in err
    assert main([*common, "--attn_implementation", "eager"]) == 0
    assert "preflight OK" in capsys.readouterr().out


def test_the_planner_traces_the_implementation_or_its_stand_in(tiny_assets):
    from fsdp_utils.plan.estimate import Cluster, estimate

    config = TrainConfig(
        model=str(tiny_assets["model"]), max_seq_length=256, total_batch_size=2,
        batch_size_per_device=1, precision="bf16-mixed", loss_chunk_size=0,
    )  # fmt: skip
    # Unchunked, the step's peak is at the loss, where every layer's saved tensors are alive; with
    # the loss in chunks it can move to where part of them are already freed.
    cluster = Cluster(nodes=1, gpus_per_node=1)
    sdpa = estimate(config, cluster)
    eager = estimate(config.replace(attn_implementation="eager"), cluster)
    flash = estimate(config.replace(attn_implementation="flash_attention_2"), cluster)
    math = estimate(config.replace(sdpa_backend="math"), cluster)
    # Eager keeps each layer's T x T attention probabilities (and their dropout copy) for
    # backward, and so does SDPA's math kernel (--sdpa_backend math); its flash kernel keeps O(T).
    heads, layers = 4, 2
    scores = layers * heads * 256 * 256 * 2  # bf16
    for unfused in (eager, math):
        gained = unfused.memory.breakdown().activations - sdpa.memory.breakdown().activations
        assert gained >= scores
    assert flash.memory.peak_bytes == sdpa.memory.peak_bytes
    assert "flash_attention_2 traced as sdpa" in flash.method


def test_the_chess_evaluation_loads_the_runs_implementation(tiny_assets):
    """`python -m fsdp_utils.chess_eval` builds the model with the run's implementation."""
    from fsdp_utils.checkpoint.saved_model import (
        eval_config,
        load_sharded_model,
        resolve_model_source,
    )
    from fsdp_utils.parallel import distributed as dist_utils

    source = resolve_model_source(str(tiny_assets["model"]))
    env = dist_utils.init_distributed("cpu")
    try:
        config = eval_config(source, precision="fp32", attn_implementation="eager")
        model = load_sharded_model(source, config, env)
    finally:
        dist_utils.destroy()
    assert model.config._attn_implementation == "eager"


def test_the_docs_table_is_what_transformers_declares(repo_root):
    """docs/attention.md's family table against transformers' own class attributes, so that a
    transformers upgrade that changes them fails here rather than leaving the docs wrong."""
    from transformers import AutoConfig

    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in (repo_root / "docs" / "attention.md").read_text().splitlines()
        if line.startswith("| `") and line.count("|") == 7
    ]
    assert len(rows) >= 10
    for family, sdpa, flash, flex, default, _ in rows:
        hf_config = AutoConfig.for_model(family.strip("`"))
        supported = supported_implementations(hf_config)
        declared = [name in supported for name in ("sdpa", "flash_attention_2", "flex_attention")]
        assert [sdpa, flash, flex] == ["yes" if d else "no" for d in declared], family
        assert default == ("sdpa" if "sdpa" in supported else "eager"), family
