"""Every model family we support, end to end: one short 2-process FSDP2 run of each (the loss
falls; one shard group per decoder layer plus the root), its export (from_pretrained loads it
with the source's keys and shapes), and a LoRA run (peft loads the adapter folder). All runs
share one torchrun (tests/finetune_runs.py runs chess_finetune.py's main once per run), so that
the interpreter, torch and transformers start once per process instead of once per run.

The plan of every family is checked in test_plan_estimate.py
(`test_every_architecture_plans_with_16_bytes_per_parameter_of_state`); deeper checks (exact
resume, logits of the trained model against the export, LoRA merges) stay on a few families in
test_lora.py, test_checkpoint.py and test_export.py.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdp_utils.synthetic import TINY_ARCHITECTURES, save_tiny_model
from tests.train_helpers import read_metrics, run_finetunes, tiny_args

pytestmark = pytest.mark.slow

STEPS, LORA_STEPS = 16, 2
# The tests' total batch of 8 as one micro-batch of 4 per process: the same sequences per step
# as 2 x 2, with half the forward and backward passes and FSDP2 gathers. Nothing here is about
# gradient accumulation, which the other tiny runs do (tiny_args: 2 x 2 per step; the two-node
# tests hold 4-way accumulation to one process's losses). 16 steps of the tiny Llama: 3.5 s of
# run as 2 x 2 and 2.5 s as 4 x 1, with the same last loss (5.8531).
BATCH_PER_PROCESS = 4
# Enough for 16 steps to take every family's tiny random model well below its first losses,
# Granite's too (its logits are divided by 8: it starts slower).
LEARNING_RATE = 2e-2
# The full runs compute the loss in chunks; Llama (its gradients computed in the chunks' forward)
# and Gemma 2 (tied, soft-capped logits: chunks recomputed in backward) also train with the full
# logits, for test_the_chunked_loss_trains_as_the_full_logits.
CHUNK, UNCHUNKED_TWINS = 16, ("llama", "gemma2")


@pytest.fixture(scope="module")
def family_runs(tiny_assets, tmp_path_factory) -> dict[str, Any]:
    """A tiny model of each family (the tests' chess tokenizer, so that all share one prepared
    data set), trained STEPS steps in full and LORA_STEPS with LoRA, all in one torchrun."""
    root = tmp_path_factory.mktemp("families")
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    data_cache = root / "data_cache"
    runs: dict[str, list[str]] = {}
    models = {}
    for arch in TINY_ARCHITECTURES:
        models[arch] = save_tiny_model(root / arch / "model", tokenizer, arch=arch)
        assets = {"model": models[arch], "data": tiny_assets["data"]}
        kinds: dict[str, dict[str, Any]] = {
            # the loss in chunks of 16 target tokens: several per micro-batch
            "full": {"max_training_steps": STEPS, "loss_chunk_size": CHUNK},
            "lora": {"max_training_steps": LORA_STEPS, "lora": True, "loss_chunk_size": CHUNK},
        }
        if arch in UNCHUNKED_TWINS:
            kinds["unchunked"] = {"max_training_steps": STEPS, "loss_chunk_size": 0}
        for name, extra in kinds.items():
            argv = tiny_args(
                assets, root / arch / name, data_cache, learning_rate=LEARNING_RATE,
                batch_size_per_device=BATCH_PER_PROCESS, **extra,
            )  # fmt: skip
            runs[f"{arch} {name}"] = argv
    results = run_finetunes(2, runs, root)
    return {"root": root, "models": models, "results": results}


def _ran(family_runs: dict[str, Any], name: str) -> Path:
    assert family_runs["results"][name]["exit_code"] == 0, family_runs["results"][name]
    arch, kind = name.split()
    return Path(family_runs["root"]) / arch / kind


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_two_processes_train_it_and_the_loss_falls(family_runs, arch):
    losses = [record["loss"] for record in read_metrics(_ran(family_runs, f"{arch} full"))]
    assert len(losses) == STEPS
    # From ln(vocabulary) ~ 6.2 for random weights; a falling trend, not one lucky batch.
    assert statistics.mean(losses[-4:]) < statistics.mean(losses[:2]) - 0.2, losses


@pytest.mark.parametrize("arch", UNCHUNKED_TWINS)
def test_the_chunked_loss_trains_as_the_full_logits(family_runs, arch):
    """2 processes, FSDP2, fp32: the same losses and gradient norms, chunked or not (the first
    step's within 1e-6 relative)."""
    for kind, chunk in (("full", CHUNK), ("unchunked", 0)):
        resolved = json.loads((_ran(family_runs, f"{arch} {kind}") / "config.json").read_text())
        assert resolved["resolved"]["loss_chunk_size"] == chunk
    chunked = read_metrics(_ran(family_runs, f"{arch} full"))
    full = read_metrics(_ran(family_runs, f"{arch} unchunked"))
    assert len(chunked) == len(full) == STEPS
    # Later steps: AdamW at lr 2e-2 amplifies the first steps' rounding (Llama's gradient norms
    # drift up to 5e-4 apart by step 16); a wrong gradient differs by far more from step 1 on.
    for key, later in (("loss", 1e-4), ("grad_norm", 2e-3)):
        assert chunked[0][key] == pytest.approx(full[0][key], rel=1e-6)
        assert [r[key] for r in chunked] == pytest.approx([r[key] for r in full], rel=later)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_one_shard_group_per_decoder_layer_plus_the_root(family_runs, arch):
    """The root group holds the embeddings and lm_head, tied ones too (torch 2.13 fails at the
    first forward when tied weights are split over groups)."""
    resolved = json.loads((_ran(family_runs, f"{arch} full") / "config.json").read_text())
    groups = resolved["resolved"]["fsdp_groups"]
    assert groups[0] == "" and len(groups) == 3, groups  # 2 decoder layers
    assert all(".layers." in g or ".h." in g for g in groups[1:]), groups


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_the_export_loads_with_the_sources_keys_and_shapes(family_runs, arch):
    exported = AutoModelForCausalLM.from_pretrained(_ran(family_runs, f"{arch} full") / "final")
    source = AutoModelForCausalLM.from_pretrained(family_runs["models"][arch])
    assert type(exported) is type(source)
    trained, initial = exported.state_dict(), source.state_dict()
    assert {k: v.shape for k, v in trained.items()} == {k: v.shape for k, v in initial.items()}
    assert any(not torch.equal(trained[k], initial[k]) for k in initial), "nothing was trained"
    tied = source.get_output_embeddings().weight is source.get_input_embeddings().weight
    assert (exported.get_output_embeddings().weight is exported.get_input_embeddings().weight) == (
        tied
    )


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_lora_trains_and_peft_loads_the_adapter_folder(family_runs, arch):
    from peft import PeftModel

    from fsdp_utils.model.build import find_decoder_layers
    from fsdp_utils.model.lora import linear_types

    adapter = _ran(family_runs, f"{arch} lora") / "final"
    base = AutoModelForCausalLM.from_pretrained(family_runs["models"][arch]).eval()
    # The default targets: every linear layer (GPT-2: Conv1D) of every decoder layer, outside
    # the mixture-of-experts blocks (the modules holding `experts`) of MoE families.
    layer = find_decoder_layers(base)[0]
    moe = [name for name, module in layer.named_modules() if hasattr(module, "experts")]
    linear = {
        name.rpartition(".")[2]
        for name, module in layer.named_modules()
        if isinstance(module, linear_types()) and not any(name.startswith(f"{b}.") for b in moe)
    }
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert {name.rpartition(".")[2] for name in saved["target_modules"]} == linear
    ids = torch.arange(32)[None] % base.config.vocab_size
    with torch.no_grad():
        before = base(input_ids=ids).logits
        after = PeftModel.from_pretrained(base, adapter).eval()(input_ids=ids).logits
    # LoRA's B starts at zero: logits that moved mean trained adapters, loaded where they belong.
    assert not torch.allclose(before, after, atol=1e-4)
