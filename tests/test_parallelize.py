"""Activation checkpointing: it really recomputes, only where asked, and gives the same
gradients."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

from fsdp_utils.model.build import find_decoder_layers
from fsdp_utils.parallel.parallelize import apply_activation_checkpointing
from fsdp_utils.synthetic import tiny_model_config


def _count_forwards(layers: list[torch.nn.Module]) -> list[int]:
    counts = [0] * len(layers)
    for index, layer in enumerate(layers):
        # A pre-hook: the recomputation stops early once it has what backward needs, so a
        # post-forward hook would not see it.
        layer.register_forward_pre_hook(lambda *_, i=index: counts.__setitem__(i, counts[i] + 1))
    return counts


def test_checkpointed_layers_recompute_and_gradients_match():
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(tiny_model_config("llama", 100, num_layers=4))
    checkpointed = copy.deepcopy(reference)
    inner_layers = find_decoder_layers(checkpointed)  # the modules that do the work
    wrapped = apply_activation_checkpointing(
        checkpointed, find_decoder_layers(checkpointed), every_n=2
    )
    assert [type(m).__name__ for m in wrapped] == [
        "CheckpointWrapper", "LlamaDecoderLayer", "CheckpointWrapper", "LlamaDecoderLayer",
    ]  # fmt: skip
    counts = _count_forwards(inner_layers)

    ids = torch.randint(0, 100, (2, 16))
    for model in (reference, checkpointed):
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()

    # Layers 0 and 2 ran forward twice (once more in backward); 1 and 3 once.
    assert counts == [2, 1, 2, 1]
    for (name, expected), (_, got) in zip(
        reference.named_parameters(), checkpointed.named_parameters(), strict=True
    ):
        assert torch.allclose(expected.grad, got.grad, rtol=1e-5, atol=1e-7), name
