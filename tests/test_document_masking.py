"""Document masking: inside a packed block a document's logits equal those of the document
run alone, for every tiny architecture and attention implementation that claims to honour it;
and the two traps (an all-ones mask, a KV cache) that silently let documents see each other."""

from __future__ import annotations

import contextlib
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.document_masking import (
    IGNORES_POSITION_IDS,
    check_document_masking,
    document_position_ids,
)
from fsdp_utils.data.prepare import PreparedData, prepare_dataset
from fsdp_utils.synthetic import TINY_ARCHITECTURES, save_tiny_model
from fsdp_utils.train.loss import token_loss_sum
from fsdp_utils.train.optim import build_optimizer, build_scheduler
from fsdp_utils.train.step import TrainStep, model_forward

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def prepared(tiny_assets, tmp_path_factory) -> PreparedData:
    config = TrainConfig(
        model=str(tiny_assets["model"]), dataset=str(tiny_assets["data"]), dataset_include="",
        data_cache_dir=str(tmp_path_factory.mktemp("prepared")), max_seq_length=512,
        eval_examples=20,
    )  # fmt: skip
    folder = prepare_dataset(config, log=lambda _: None)
    return PreparedData(folder, json.loads((folder / "meta.json").read_text()))


@pytest.fixture(scope="module")
def models(tiny_assets, tmp_path_factory) -> dict[str, Path]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    root = tmp_path_factory.mktemp("archs")
    return {arch: save_tiny_model(root / arch, tokenizer, arch=arch) for arch in TINY_ARCHITECTURES}


def _segments(row: torch.Tensor, eos: int) -> list[tuple[int, int]]:
    """[start, end) of each document piece in a block: EOS closes a piece."""
    ends = [int(i) + 1 for i in torch.nonzero(row == eos).flatten()]
    bounds = [0, *[e for e in ends if e < len(row)], len(row)]
    return list(itertools.pairwise(bounds))


def _complete_document(batch: dict[str, torch.Tensor], eos: int) -> tuple[int, int, int]:
    """(row, start, end) of a document that starts after an EOS and ends with one."""
    for r, row in enumerate(batch["input_ids"]):
        for start, end in _segments(row, eos)[1:]:
            if row[end - 1] == eos and end - start > 8:
                return r, start, end
    raise AssertionError("no complete document inside a block")


def test_position_ids_restart_after_each_eos(prepared):
    eos = 9
    ids = torch.tensor([[5, 7, eos, 3, 4, eos, 8], [eos, 1, 2, 3, eos, eos, 6]])
    assert document_position_ids(ids, eos).tolist() == [
        [0, 1, 2, 0, 1, 2, 0],
        [0, 0, 1, 2, 3, 0, 0],
    ]
    blocks = prepared.split("train", document_masking=True)
    batch = blocks.batch(np.arange(3))
    eos = prepared.meta["stats"]["eos_token_id"]
    for row, positions in zip(batch["input_ids"], batch["position_ids"], strict=True):
        for start, end in _segments(row, eos):
            assert positions[start:end].tolist() == list(range(end - start))
    # Off by default, and for unpacked rows (one document each): no position ids at all.
    assert "position_ids" not in prepared.split("train").batch(np.arange(3))


# None: the implementation the family runs with in training (transformers' default: sdpa,
# eager where the model cannot use sdpa: Gemma 2's soft-capping, gpt-oss's attention sinks).
@pytest.mark.parametrize(
    "arch,attention",
    [(arch, None) for arch in TINY_ARCHITECTURES] + [("llama", "eager")],
    ids=lambda value: value or "default",
)
def test_packed_document_logits_equal_the_document_alone(prepared, models, arch, attention):
    model = AutoModelForCausalLM.from_pretrained(models[arch], attn_implementation=attention).eval()
    if arch in IGNORES_POSITION_IDS:  # refused: its documents see each other
        with pytest.raises(ValueError, match="without the position ids"):
            check_document_masking(model, batch_size_per_device=2)
    eos = prepared.meta["stats"]["eos_token_id"]
    batch = prepared.split("train", document_masking=True).batch(np.arange(4))
    r, start, end = _complete_document(batch, eos)
    with torch.no_grad():
        packed = model_forward(model, batch, CPU, contextlib.nullcontext).logits  # as trained
        alone = model(input_ids=batch["input_ids"][r : r + 1, start:end], use_cache=False).logits
        leaky = model(input_ids=batch["input_ids"], use_cache=False).logits
    if arch in IGNORES_POSITION_IDS:
        assert (packed[r, start:end] - alone[0]).abs().max() > 1e-3
        return
    torch.testing.assert_close(packed[r, start:end], alone[0], rtol=1e-4, atol=1e-5)
    # Without document masking the same document sees the one before it.
    assert (leaky[r, start:end] - alone[0]).abs().max() > 1e-3


@pytest.mark.parametrize("trap", ["all-ones attention mask", "use_cache=True"])
def test_the_traps_let_documents_see_each_other(prepared, models, trap):
    """transformers looks for packed sequences only without an attention mask and without a
    KV cache; either one silently gives plain causal attention over the whole block."""
    model = AutoModelForCausalLM.from_pretrained(models["llama"]).eval()
    eos = prepared.meta["stats"]["eos_token_id"]
    batch = prepared.split("train", document_masking=True).batch(np.arange(4))
    r, start, end = _complete_document(batch, eos)
    extra = (
        {"attention_mask": torch.ones_like(batch["input_ids"]), "use_cache": False}
        if trap == "all-ones attention mask"
        else {"use_cache": True}
    )
    with torch.no_grad():
        trapped = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], **extra
        ).logits
        alone = model(input_ids=batch["input_ids"][r : r + 1, start:end], use_cache=False).logits
    assert (trapped[r, start:end] - alone[0]).abs().max() > 1e-3


def test_the_trainers_forward_keeps_documents_apart(prepared, models):
    """The trainer's own step (TrainStep.forward_backward) on a packed micro-batch gives the loss of its
    document pieces each run alone: it passes the position ids, and no mask or cache."""
    model = AutoModelForCausalLM.from_pretrained(models["llama"])
    config = TrainConfig(document_masking=True)
    optimizer = build_optimizer(model, config)
    step = TrainStep(
        model, optimizer, build_scheduler(optimizer, config),
        config=config, world_size=1, device=CPU,
    )  # fmt: skip
    eos = prepared.meta["stats"]["eos_token_id"]
    batch = prepared.split("train", document_masking=True).batch(np.arange(2))
    loss_sum = step.forward_backward(batch, 1.0)

    with torch.no_grad():
        pieces = []
        for row in batch["input_ids"]:
            logits = [
                model(input_ids=row[None, start:end], use_cache=False).logits[0]
                for start, end in _segments(row, eos)
            ]
            pieces.append(torch.cat(logits))
        reference = token_loss_sum(torch.stack(pieces), batch["labels"])
    torch.testing.assert_close(loss_sum.float(), reference.float(), rtol=1e-5, atol=1e-4)


def test_attention_implementations_that_would_mix_documents_are_refused(models):
    model = AutoModelForCausalLM.from_pretrained(models["llama"])
    check_document_masking(model, batch_size_per_device=4)  # sdpa
    model.config._attn_implementation = "flash_attention_2"
    check_document_masking(model, batch_size_per_device=1)
    with pytest.raises(ValueError, match="--batch_size_per_device 1"):
        check_document_masking(model, batch_size_per_device=2)
    model.config._attn_implementation = "paged|sdpa"
    with pytest.raises(ValueError, match="not known to honour packed position ids"):
        check_document_masking(model, batch_size_per_device=1)
