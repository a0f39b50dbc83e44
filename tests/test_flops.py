"""The FLOPs MFU counts (`metrics.throughput`) against torch's FlopCounterMode, and
`--flop_counter`'s own counting (`metrics.flop_count`).

What is compared, for every tiny family of the tests: the forward and backward of one sequence of
T tokens (the loss summed over it, every weight trainable), counted by FlopCounterMode with eager
attention (plain matmuls: 2 for the scores and values forward, 4 backward, the 12·L·H·Q·T the
estimate counts), against `flops_per_token(config, non-embedding parameters, T) x T` (for a mixture of experts, the
active ones: top-k of the routed experts). Elementwise
work (norms, activations, softmax, the loss) is in neither. SDPA's backward formula counts the
scores' recomputation too (see metrics/flop_count.py), which is why eager is the reference here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_utils.metrics.flop_count import FlopCount, format_flops, missing_formulas
from fsdp_utils.metrics.throughput import (
    flops_per_token,
    frozen_layers_flops_per_token,
    lora_flops_per_token,
    tied_output_parameters,
)
from fsdp_utils.model.build import active_parameters, count_parameters
from fsdp_utils.synthetic import TINY_ARCHITECTURES, tiny_model_config

VOCAB, T = 512, 256
TOLERANCE = 0.05  # what the estimate may miss: biases, norms' weights (counted in N, no matmul)


def _model(arch: str, attention: str = "eager") -> tuple[nn.Module, object]:
    from transformers import AutoModelForCausalLM

    config = tiny_model_config(arch, VOCAB, special_ids={"bos": 0, "eos": 1, "pad": 2})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention), config


def _counted(model: nn.Module) -> int:
    input_ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(0))
    count = FlopCount()
    with count.counting():
        logits = model(input_ids=input_ids, use_cache=False).logits
        nn.functional.cross_entropy(logits[0], input_ids[0], reduction="sum").backward()
    return count.total


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_flops_per_token_matches_torchs_count(arch):
    model, config = _model(arch)
    _, non_embedding = count_parameters(model)
    # A mixture of experts: the parameters a token passes through (its top-k routed experts).
    active = active_parameters(model, config, non_embedding)
    estimated = flops_per_token(config, active, T) * T
    assert _counted(model) == pytest.approx(estimated, rel=TOLERANCE)


def test_a_tied_output_projection_is_counted():
    """The fix: a tied lm_head multiplies like any linear layer; leaving it out (the non-embedding
    count subtracts the embedding it shares) put Qwen2, Gemma and GPT-2 about 23% low here."""
    model, config = _model("qwen2")
    assert config.tie_word_embeddings and tied_output_parameters(config) == VOCAB * 64
    _, non_embedding = count_parameters(model)
    without = flops_per_token(config, non_embedding, T) * T - 6 * tied_output_parameters(config) * T
    assert _counted(model) > (1 + 4 * TOLERANCE) * without
    assert tied_output_parameters(tiny_model_config("llama", VOCAB)) == 0  # untied


def test_frozen_bottom_layers_run_forward_only():
    """--freeze_layers 1: embeddings and layer 0 frozen, so nothing below layer 1 needs a
    gradient and layer 0 runs forward only."""
    model, config = _model("llama")
    _, non_embedding = count_parameters(model)
    frozen = [model.model.embed_tokens, model.model.layers[0]]
    for module in frozen:
        module.requires_grad_(False)
    layer_params = sum(p.numel() for p in model.model.layers[0].parameters())
    full = flops_per_token(config, non_embedding, T)
    estimated = frozen_layers_flops_per_token(
        full, config, T, frozen_layers=1, frozen_layer_params=layer_params, tied_output_frozen=False
    )
    assert estimated < 0.8 * full
    assert _counted(model) == pytest.approx(estimated * T, rel=TOLERANCE)


def test_lora_counts_no_weight_gradients_for_the_frozen_base():
    """The default targets (every linear layer of the blocks). The estimate leaves one thing out:
    the first layer's q, k and v projections need no input gradient (the frozen embeddings need
    none), 2% of this 2-layer model's count, a fraction of a percent of a deep one's."""
    from peft import LoraConfig, get_peft_model

    model, config = _model("qwen2")  # tied: its frozen lm_head gets no weight gradient either
    _, non_embedding = count_parameters(model)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(model, LoraConfig(r=8, target_modules=targets))
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    full = flops_per_token(config, non_embedding, T)
    estimated = lora_flops_per_token(full, config, non_embedding, trainable)
    assert _counted(peft) == pytest.approx(estimated * T, rel=TOLERANCE)


def test_cpu_attention_and_grouped_matmuls_are_counted():
    """torch 2.11 and 2.13 count neither the CPU's SDPA kernel nor `_grouped_mm` (mixture-of-
    experts layers): FlopCounterMode alone reports 0 for both. torch 2.15 counts the CPU kernel
    itself (pytorch#195801), with the formula ours gives it. With `missing_formulas` both count
    what the same shapes cost on CUDA, and what a loop of plain matmuls costs."""
    from torch.utils.flop_counter import (
        FlopCounterMode,
        flop_registry,
        sdpa_backward_flop_count,
        sdpa_flop_count,
    )

    assert missing_formulas(), "torch counts these now: drop them from missing_formulas"
    q, k, v = (torch.randn(2, 4, 64, 16, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as plain:
        nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    count = FlopCount()
    with count.counting():
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
    shapes = (q.shape, k.shape, v.shape)
    expected = sdpa_flop_count(*shapes) + sdpa_backward_flop_count(out.shape, *shapes)
    torch_counts_it = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in flop_registry
    assert plain.get_total_flops() == (expected if torch_counts_it else 0)
    assert count.total == expected

    tokens, weights = torch.randn(16, 8), torch.randn(3, 8, 8)
    offsets = torch.tensor([4, 8, 16], dtype=torch.int32)
    grouped, looped = FlopCount(), FlopCount()
    with grouped.counting():
        torch._grouped_mm(tokens, weights, offsets)
    with looped.counting():
        for group, (start, end) in enumerate([(0, 4), (4, 8), (8, 16)]):
            tokens[start:end] @ weights[group]
    assert grouped.total == looped.total == 2 * 16 * 8 * 8


def test_grouped_query_attention_counts_and_a_failing_formula_never_stops_the_step():
    """Torch before 2.13 asserted equal query and key/value heads in its SDPA formula, which
    stopped the first step of a GQA model (seen on an H100 with torch 2.11): the count broadcasts
    the key/value heads as the kernels do, and any formula that still fails counts 0, by name."""
    from torch.utils.flop_counter import sdpa_flop_count

    q, kv = torch.randn(1, 8, 32, 16), torch.randn(1, 2, 32, 16)
    count = FlopCount()
    with count.counting():
        nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    assert count.total == sdpa_flop_count(q.shape, q.shape, q.shape) > 0
    assert not count.skipped
    broken = count._safe("aten.broken", lambda *args, **kwargs: 1 // 0, raw=True)
    assert broken(q) == 0 and count.skipped == {"aten.broken"}


def test_format_flops():
    assert format_flops(1.234e14) == "123.4 TFLOP"
    assert format_flops(4.614e8) == "461.4 MFLOP"
    assert format_flops(12) == "12 FLOP"


def test_an_in_place_addmm_counts_as_addmm():
    """The fused chunked loss adds its weight gradients with `addmm_`, which torch 2.13 does not
    count: FlopCount counts it as torch counts `addmm`."""
    from torch.utils.flop_counter import FlopCounterMode

    grad, h = torch.randn(8, 4), torch.randn(4, 16)
    with FlopCounterMode(display=False) as plain:
        torch.zeros(8, 16).addmm_(grad, h)
    out_of_place = FlopCount()
    with out_of_place.counting():
        torch.addmm(torch.zeros(8, 16), grad, h)
    in_place = FlopCount()
    with in_place.counting():
        torch.zeros(8, 16).addmm_(grad, h)
    assert plain.get_total_flops() == 0, "torch counts addmm_ now: drop it from our_formulas"
    assert in_place.total == out_of_place.total == 2 * 8 * 4 * 16
