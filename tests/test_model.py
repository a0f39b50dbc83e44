"""Model construction: decoder-layer detection, meta build, sharded-ready weight loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdp_utils.config.seq_length import check_seq_length
from fsdp_utils.hub.resolve import load_model_config
from fsdp_utils.model.build import (
    build_meta_model,
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


def test_a_default_sequence_length_fits_the_models_context():
    """Not given, --max_seq_length is 1024 or the model's context where shorter (with the log's
    line); given, it is checked; what depends on it is checked again."""
    from fsdp_utils.config.seq_length import fit_seq_length
    from fsdp_utils.config.train_config import TrainConfig

    short = tiny_model_config("llama", vocab_size=100, max_positions=256)
    fitted, note = fit_seq_length(TrainConfig(), short)
    assert fitted.max_seq_length == fitted.seq_length == 256
    assert note is not None and "the model's context length (--max_seq_length not given" in note
    assert fit_seq_length(fitted, short) == (fitted, None)  # fitted once, the same again
    assert fit_seq_length(TrainConfig(max_seq_length=128), short)[0].max_seq_length == 128
    with pytest.raises(ValueError, match="--max_seq_length 512 is above the model's context"):
        fit_seq_length(TrainConfig(max_seq_length=512), short)
    long = tiny_model_config("llama", vocab_size=100, max_positions=4096)
    assert fit_seq_length(TrainConfig(), long) == (TrainConfig(max_seq_length=1024), None)
    grpo = TrainConfig(method="grpo", reward_funcs="length", max_completion_length=300)
    with pytest.raises(ValueError, match="leaves no room for the prompt in --max_seq_length 256"):
        fit_seq_length(grpo, short)


def test_the_trainer_takes_the_models_context_as_its_default(tiny_assets, tmp_path, capsys):
    from transformers import AutoTokenizer

    from fsdp_utils.cli import main

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    short = save_tiny_model(tmp_path / "short", tokenizer, max_position_embeddings=256)
    args = ["--model", str(short), "--dataset", str(tiny_assets["data"]), "--dataset_include", "",
            "--output_dir", str(tmp_path / "run"), "--preflight", "--gpu_memory", "off"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "256 tokens per sequence" in out
    assert "sequence length: 256 tokens, the model's context length" in out
    assert main([*args, "--max_seq_length", "1024"]) == 2  # given: the user's, checked
    assert "--max_seq_length 1024 is above the model's context length of 256" in (
        capsys.readouterr().err
    )


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


def test_tiny_models_take_transformers_names_for_their_sizes():
    """The docs' short names and transformers' own (as a user writes them from a config.json)."""
    short = tiny_model_config("llama", vocab_size=100, num_layers=3, num_heads=2, max_positions=96)
    named = tiny_model_config(
        "llama", vocab_size=100, num_hidden_layers=3, num_attention_heads=2,
        max_position_embeddings=96,
    )  # fmt: skip
    assert named.to_dict() == short.to_dict() and named.num_hidden_layers == 3
    assert tiny_model_config("gpt2", vocab_size=100, n_layer=3, n_embd=32).n_embd == 32
    with pytest.raises(TypeError, match=r"the sizes it takes: .*num_hidden_layers"):
        tiny_model_config("llama", vocab_size=100, num_layer=3)
