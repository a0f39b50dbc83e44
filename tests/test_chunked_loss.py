"""The loss in chunks (train/loss.py, train/step.forward_target_nll) gives the unchunked loss's
numbers: the summed token loss, every gradient and the per-token log-probabilities of every
family, with answers-only masks, packed documents, LoRA on the output layer, the router loss and
bf16 autocast. Under FSDP2 on 2 processes: test_families.py (a chunked and an unchunked run)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import IGNORE_INDEX
from fsdp_utils.synthetic import TINY_ARCHITECTURES, tiny_model_config
from fsdp_utils.train.loss import LossChunking, count_targets, fused_applies, logit_transform
from fsdp_utils.train.optim import build_optimizer, build_scheduler
from fsdp_utils.train.router_loss import RouterLoss
from fsdp_utils.train.step import TrainStep, forward_loss_sum, token_logprobs

CPU = torch.device("cpu")
VOCAB, SEQ = 96, 40
CHUNK = 7  # several chunks, the last one short


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two rows: an answers-only mask (the first 12 labels ignored) and two packed documents
    (position ids restart at 25) with padding at the end."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :12] = IGNORE_INDEX
    labels[1, 33:] = IGNORE_INDEX
    positions = torch.arange(SEQ).repeat(2, 1)
    positions[1, 25:] -= 25
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _model(arch: str, **overrides) -> torch.nn.Module:
    config = tiny_model_config(arch, vocab_size=VOCAB, hidden_size=32)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    # eval: no dropout (GPT-2's), so that the two losses see the same network
    return AutoModelForCausalLM.from_config(config).float().eval()


def _loss_and_grads(model, batch, chunk_size, autocast=contextlib.nullcontext, **extra):
    model.zero_grad(set_to_none=True)
    chunking = LossChunking.build(chunk_size, model.config)
    assert chunking.chunk_size == chunk_size, chunking.note
    _, loss = forward_loss_sum(model, batch, CPU, autocast, chunking, **extra)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    diff = torch.stack([(a[k] - b[k]).norm() for k in a]).norm()
    return float(diff / torch.stack([b[k].norm() for k in b]).norm())


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_every_family_chunked_equals_unchunked_in_fp32(arch):
    """Gemma 2/3's soft-capping and Granite's logit scaling included, tied embeddings (Gemma,
    Qwen, GPT-2, Granite) too; MoE families with their router logits returned."""
    model = _model(arch)
    batch = _batch()
    extra = RouterLoss.forward_kwargs if hasattr(model.config, "output_router_logits") else {}
    loss, grads = _loss_and_grads(model, batch, 0, **extra)
    chunked_loss, chunked_grads = _loss_and_grads(model, batch, CHUNK, **extra)
    assert float(abs(chunked_loss - loss) / loss) < 1e-6
    assert _relative(chunked_grads, grads) < 1e-6
    head = model.get_output_embeddings().weight
    assert head.grad is not None and head.grad.abs().sum() > 0

    with torch.no_grad():
        plain = token_logprobs(model, batch, chunking=LossChunking(0), device=CPU)
        chunked = token_logprobs(model, batch, chunking=LossChunking.build(CHUNK, model.config), device=CPU)  # fmt: skip
    assert chunked.shape == (2, SEQ - 1)
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    assert float(-plain.sum()) == pytest.approx(float(loss), rel=1e-6)
    ignored = batch["labels"][:, 1:] == IGNORE_INDEX
    assert bool((chunked[ignored] == 0).all()) and bool((chunked[~ignored] < 0).all())


def test_the_transforms_are_the_families_own():
    """A soft-cap of 5 and a logit scale of 8 make the losses differ from the plain head's, so
    the equality above holds because the chunks apply them, not by chance."""
    for arch, setting in [("gemma2", {"final_logit_softcapping": 5.0}), ("granite", {})]:
        model, batch = _model(arch, **setting), _batch()
        with torch.no_grad():  # logits well away from 0, where capping and scaling show
            model.get_output_embeddings().weight.mul_(50.0)
        loss, _ = _loss_and_grads(model, batch, 0)
        chunked_loss, _ = _loss_and_grads(model, batch, CHUNK)
        assert float(abs(chunked_loss - loss) / loss) < 1e-6
        chunking = LossChunking(CHUNK)  # no transform
        with torch.no_grad():
            _, untransformed = forward_loss_sum(model, batch, CPU, contextlib.nullcontext, chunking)
        assert abs(float(untransformed) - float(loss)) > 0.1 * float(loss)
    assert logit_transform(tiny_model_config("llama", VOCAB)) == (None, None)


def test_an_unknown_family_keeps_the_full_logits_and_says_why():
    config = tiny_model_config("llama", VOCAB)
    config.model_type = "newfamily"
    chunking = LossChunking.build(512, config)
    assert chunking.chunk_size == 0
    assert "newfamily" in chunking.note and "unchunked" in chunking.note
    assert LossChunking.build(0, config).note == "loss: unchunked (--loss_chunk_size 0)"
    # the default: 64 Mi logits per chunk
    assert LossChunking.build(None, tiny_model_config("llama", 128_256)).chunk_size == 523
    assert LossChunking.build(None, tiny_model_config("gemma2", 256_000)).chunk_size == 262
    with pytest.raises(ValueError, match="--loss_chunk_size must be >= 0"):
        from fsdp_utils.config.train_config import validate_config

        validate_config(TrainConfig(loss_chunk_size=-1))


def test_lora_on_the_output_layer_goes_through_the_chunks():
    """peft wraps lm_head in a LoRA layer: the chunks call that module, so the adapter's
    gradients are the unchunked loss's."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _model("llama"), LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    )  # fmt: skip
    batch = _batch(1)
    loss, grads = _loss_and_grads(model, batch, 0)
    chunked_loss, chunked_grads = _loss_and_grads(model, batch, CHUNK)
    assert any("lm_head.lora_B" in name for name in grads)
    assert float(abs(chunked_loss - loss) / loss) < 1e-6
    assert _relative(chunked_grads, grads) < 1e-6


def test_bf16_autocast_within_its_rounding():
    model, batch = _model("llama"), _batch(2)

    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    loss, grads = _loss_and_grads(model, batch, 0, autocast)
    chunked_loss, chunked_grads = _loss_and_grads(model, batch, CHUNK, autocast)
    assert float(abs(chunked_loss - loss) / loss) < 1e-3
    assert _relative(chunked_grads, grads) < 1e-2


def test_a_batch_without_targets_has_zero_loss_and_zero_head_gradient():
    model, batch = _model("llama"), _batch()
    batch["labels"][:] = IGNORE_INDEX
    loss, grads = _loss_and_grads(model, batch, CHUNK)
    assert float(loss) == 0.0
    assert float(grads["lm_head.weight"].abs().sum()) == 0.0


def test_the_train_step_with_accumulation_and_the_router_loss():
    """TrainStep over two micro-batches, token-normalised, with Mixtral's router loss: the
    chunked step's loss, router loss and updated weights are the unchunked step's."""
    results = []
    for chunk_size in (0, CHUNK):
        model = _model("mixtral")
        config = TrainConfig(learning_rate=1e-2, warmup_steps=0)
        optimizer = build_optimizer(model, config)
        step = TrainStep(
            model, optimizer, build_scheduler(optimizer, config), config=config, world_size=1,
            device=CPU, router_loss=RouterLoss(0.5),
            chunking=LossChunking.build(chunk_size, model.config),
        )  # fmt: skip
        batches = [_batch(3), _batch(4)]
        metrics = step(batches, step=1)
        assert metrics["tokens"] == sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
        results.append((metrics, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (plain, plain_weights), (chunked, chunked_weights) = results
    assert chunked["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert chunked["aux_loss"] == pytest.approx(plain["aux_loss"], rel=1e-6)
    assert chunked["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
    # AdamW's first update is about lr x sign(gradient): rounding in near-zero gradients shows
    # up to lr, a wrong gradient as lr (1e-2) everywhere
    for name, weight in plain_weights.items():
        torch.testing.assert_close(chunked_weights[name], weight, rtol=0, atol=1e-4, msg=name)
    assert sum(count_targets(b["labels"]) for b in [_batch(3), _batch(4)]) > 0


def test_which_heads_compute_their_gradients_in_the_forward():
    """A plain Linear head in fp32 or under FSDP's bf16 parameters: gradients in the chunks'
    forward (nothing recomputed); a transform, LoRA, autocast or no gradient: checkpointed chunks.
    Both are compared with the unchunked loss above (Llama: the first; Gemma 2, LoRA, bf16
    autocast: the second)."""
    model = _model("llama")
    hidden = torch.zeros(2, 3, 32, requires_grad=True)
    head = model.get_output_embeddings()
    assert fused_applies(head, None, hidden)
    assert not fused_applies(head, lambda x: x, hidden)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fused_applies(head, None, hidden)
    with torch.no_grad():
        assert not fused_applies(head, None, hidden)
