"""Model construction: decoder-layer detection, meta build, sharded-ready weight loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdp_utils.hub.resolve import load_model_config
from fsdp_utils.model.build import (
    build_meta_model,
    check_seq_length,
    find_decoder_layers,
    materialize,
    tied_parameter_names,
)
from fsdp_utils.model.weights import checkpoint_key_map, load_pretrained_weights
from fsdp_utils.synthetic import (
    TIED_FAMILIES,
    TINY_ARCHITECTURES,
    save_tiny_model,
    tiny_model_config,
)

EXPECTED_LAYER_CLASS = {
    "llama": "LlamaDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "mistral": "MistralDecoderLayer",
    "gemma": "GemmaDecoderLayer",
    "gpt2": "GPT2Block",
    "gpt_neox": "GPTNeoXLayer",
    "qwen3": "Qwen3DecoderLayer",
    "gemma2": "Gemma2DecoderLayer",
    "gemma3": "Gemma3DecoderLayer",
    "phi3": "Phi3DecoderLayer",
    "olmo2": "Olmo2DecoderLayer",
    "granite": "GraniteDecoderLayer",
    "mixtral": "MixtralDecoderLayer",
    "qwen3_moe": "Qwen3MoeDecoderLayer",
    "qwen2_moe": "Qwen2MoeDecoderLayer",
    "olmoe": "OlmoeDecoderLayer",
    "gpt_oss": "GptOssDecoderLayer",
}
TIED = TIED_FAMILIES


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets["model"])


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {
        arch: save_tiny_model(root / arch, tokenizer, arch=arch, num_layers=3)
        for arch in TINY_ARCHITECTURES
    }


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_decoder_layers_found_from_the_model(arch):
    config = tiny_model_config(arch, vocab_size=100, num_layers=3)
    model = build_meta_model(config, "fp32")
    layers = find_decoder_layers(model)
    assert [type(m).__name__ for m in layers] == [EXPECTED_LAYER_CLASS[arch]] * 3
    assert all(p.device.type == "meta" for p in model.parameters())


def test_repeated_block_fallback_without_no_split_modules():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

    class Net(nn.Module):
        _no_split_modules = None

        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])  # mixed: not the blocks
            self.blocks = nn.ModuleList([Block() for _ in range(5)])

    layers = find_decoder_layers(Net())
    assert len(layers) == 5 and all(isinstance(m, Block) for m in layers)


def test_no_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match="--no_layer_wrap_policy"):
        find_decoder_layers(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_meta_build_and_load_equals_from_pretrained(arch, saved_models):
    folder = saved_models[arch]
    model = build_meta_model(load_model_config(folder), "fp32")
    assert bool(tied_parameter_names(model)) == (arch in TIED)
    key_map = checkpoint_key_map(model, folder)
    materialize(model, torch.device("cpu"))
    load_pretrained_weights(model, folder, key_map)
    reference = AutoModelForCausalLM.from_pretrained(folder)
    model.eval()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    if arch in TIED:  # still one tensor after to_empty
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_bf16_true_builds_bf16_parameters(saved_models):
    model = build_meta_model(load_model_config(saved_models["llama"]), "bf16-true")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_sequence_length_above_the_model_limit():
    config = tiny_model_config("llama", vocab_size=100, max_positions=128)
    check_seq_length(config, 128)
    with pytest.raises(ValueError, match="context length of 128 tokens"):
        check_seq_length(config, 129)


def test_missing_weights_are_named(tmp_path, saved_models):
    folder = saved_models["llama"]
    model = build_meta_model(load_model_config(folder), "fp32")
    bigger = tiny_model_config(
        "llama", vocab_size=len(AutoTokenizer.from_pretrained(folder)), num_layers=4
    )
    with pytest.raises(ValueError, match=r"lacks .* weight"):
        checkpoint_key_map(build_meta_model(bigger, "fp32"), folder)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="No safetensors weights"):
        checkpoint_key_map(model, empty)
