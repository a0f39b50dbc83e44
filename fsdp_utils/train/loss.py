"""The causal-LM loss, summed over target tokens (normalised by the caller).

The targets are `data.blocks.next_token_labels`: a whole sequence's labels but the first (position
t predicts token t + 1), or a sequence-parallel slice's labels shifted before the split.

Two ways to the same numbers. Unchunked (`next_token_loss_sum`): the model's forward computes the
logits of every position, [tokens, vocabulary], and the cross-entropy reads them. Chunked
(`chunked_target_nll`, `--loss_chunk_size`, the default): the model's forward stops before its
output layer, and the output layer, the family's logit transform and the cross-entropy run over
chunks of the target tokens only, each chunk under `torch.utils.checkpoint` so that its logits are
freed after the forward and recomputed in backward. The largest logits tensor is then
[chunk, vocabulary]: at 8,192 tokens and Llama 3's 128,256 words the fp32 logits alone take
4.2 GB unchunked, 1.1 GB per chunk of a GPU's default 2,092 tokens and 0.27 GB of a CPU's 523
(`default_chunk_size`). The price is one more output-layer matmul per chunk but the last in
backward (the recompute). With --compile the chunks' elementwise work is compiled
(`_chunk_functions`).

A summed loss through a plain bias-free linear output layer without a logit transform (Llama,
Qwen, Mistral, ... in fp32 or under FSDP's bf16 parameters; `fused_applies`) goes further:
each chunk's gradients are computed in its forward, as Liger's fused linear cross-entropy does,
and the backward only scales them, so nothing is recomputed (`_LinearNLLSum`; 0.7x the
unchunked loss's CPU time at 2,048 tokens and 128,256 words). The weight is then read inside
the root's forward, where FSDP holds it gathered, never outside it.

The checkpointed chunks call the output layer as a module (`output_layer`), never its weight: under FSDP2 the
weight belongs to the root's shard group, which FSDP gathers for the forward and the backward
(train/step.py runs the chunks inside the root's forward for that reason), and a LoRA adapter on
it runs as in the model's own forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint

from fsdp_utils.data.blocks import IGNORE_INDEX, next_token_labels
from fsdp_utils.model.liger import FUSED_NLL_ATTRIBUTE

LogitTransform = Callable[[torch.Tensor], torch.Tensor]


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies of whole sequences: position t predicts labels[t + 1]."""
    return next_token_loss_sum(logits, labels[:, 1:])


def next_token_loss_sum(logits: torch.Tensor, following: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropies of `following` ([rows, positions]: the token each position
    predicts, `data.blocks.next_token_labels`: a whole sequence's all but its last, a
    sequence-parallel slice's all) given the logits of those positions. In fp32, whatever the
    compute dtype, so that bf16 logits do not cost accuracy in the loss."""
    return F.cross_entropy(
        logits[:, : following.shape[1]].flatten(0, 1).float(),
        following.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def count_targets(labels: torch.Tensor) -> int:
    """Target tokens in a batch of whole sequences' labels, as `token_loss_sum` counts them."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def batch_targets(batch: dict[str, torch.Tensor]) -> int:
    """Target tokens of a batch, of whole sequences or of sequence-parallel slices (each target
    on the one rank whose position predicts it)."""
    return int((next_token_labels(batch) != IGNORE_INDEX).sum())


# --- what each family's forward does to the output layer's result -------------------------

# Model types whose causal-LM forward returns the output layer's result as the logits.
_PLAIN_LOGITS = frozenset(
    {
        "llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo2", "gpt2", "gpt_neox",
        "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "phi", "starcoder2", "olmo",
    }
)  # fmt: skip


def _softcap(cap: float) -> LogitTransform:
    def transform(logits: torch.Tensor) -> torch.Tensor:  # Gemma 2 and 3's forward, op for op
        return torch.tanh(logits / cap) * cap

    return transform


def _divide(by: float) -> LogitTransform:
    return lambda logits: logits / by


def _multiply(by: float) -> LogitTransform:
    return lambda logits: logits * by


def logit_transform(hf_config: Any) -> tuple[LogitTransform | None, str | None]:
    """(transform, None): what the family's forward applies to the output layer's result
    (None: nothing), for the chunks to apply the same; (None, reason): a family whose forward
    this module does not know, which keeps the unchunked loss."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _PLAIN_LOGITS:
        return None, None
    if model_type in ("gemma2", "gemma3", "gemma3_text"):
        cap = getattr(hf_config, "final_logit_softcapping", None)
        return (_softcap(float(cap)) if cap is not None else None), None
    if model_type in ("granite", "granitemoe", "granitemoeshared"):
        return _divide(float(hf_config.logits_scaling)), None
    if model_type in ("cohere", "cohere2"):
        return _multiply(float(hf_config.logit_scale)), None
    return None, (
        f"{model_type}'s forward is not known to leave the output layer's logits as they are"
    )


# The default chunk depends on the device (`default_chunk_size`). On a CPU: as many target
# tokens as make 64 Mi logits (256 MiB in fp32): 523 tokens of Llama 3's 128,256 words, 262 of
# Gemma's 256,000; a small vocabulary's micro-batch is one chunk, which recomputes nothing
# (`chunked_target_nll`).
LOGITS_PER_CHUNK = 64 * 2**20
# On a GPU the chunk is the output layer's matrix product, and small ones starve it:
# torchtitan/docs/chunked_loss.md (Qwen3-14B, 151,936 words, 8 x H100) measured 37.2% MFU with
# 1,024-token chunks, 38.4% with 8,192 (its default, the best measured), and 32.3% with 8 chunks
# of 40,960 tokens, whose eager cross-entropy backward made a logits-sized fp32 temporary
# (5.8 GiB). So 8,192 target tokens, and at most 256 Mi logits (1 GiB in fp32): a chunk's
# product is then at least 256 Mi x hidden x 2 FLOP (1.1 TFLOP at hidden 2,048: a bf16 8192^3
# matmul, which runs at full speed on an H100), and the fp32 logits stay within 1 GiB where
# 8,192 tokens of Llama 3's 128,256 words would hold 4 GiB. 8,192 tokens up to 32,768 words
# (the 1.1B shape's 32,000: one chunk per 4 x 2,048 micro-batch), 2,092 of Llama 3's, 1,048 of
# Gemma's 256,000.
GPU_TOKENS_PER_CHUNK = 8192
GPU_LOGITS_PER_CHUNK = 256 * 2**20


def default_chunk_size(vocab: int, device_type: str) -> tuple[int, str]:
    """--loss_chunk_size's default for a vocabulary of `vocab` words on `device_type` ("cuda"
    or "cpu"), and how it was chosen (for the log)."""
    vocab = max(vocab, 1)
    if device_type == "cuda":
        tokens = max(1, min(GPU_TOKENS_PER_CHUNK, GPU_LOGITS_PER_CHUNK // vocab))
        return tokens, (
            f"the GPU default: {GPU_TOKENS_PER_CHUNK:,} tokens, at most 256 Mi logits of "
            f"{vocab:,} words; --loss_chunk_size sets it"
        )
    tokens = max(1, LOGITS_PER_CHUNK // vocab)
    return tokens, f"64 Mi logits of {vocab:,} words; --loss_chunk_size sets it"


@dataclass(frozen=True)
class LossChunking:
    """How a run computes its loss: `chunk_size` target tokens per chunk (0: unchunked), the
    family's logit transform, and whether the chunks' loss is compiled (`compiled`: --compile)."""

    chunk_size: int
    transform: LogitTransform | None = None
    note: str = ""
    compiled: bool = False

    @classmethod
    def build(
        cls,
        chunk_size: int | None,
        hf_config: Any,
        *,
        device_type: str = "cpu",
        compiled: bool = False,
    ) -> LossChunking:
        """`chunk_size`: --loss_chunk_size (None: `default_chunk_size` for `device_type`, the
        device the loss runs on). `compiled`: --compile (the chunks' elementwise work through
        torch.compile: `_chunk_functions`)."""
        if chunk_size == 0:
            return cls(0, note="loss: unchunked (--loss_chunk_size 0)")
        transform, reason = logit_transform(hf_config)
        if reason is not None:
            return cls(0, note=f"loss: unchunked ({reason}; the full logits are computed)")
        how = "--loss_chunk_size"
        if chunk_size is None:
            vocab = int(getattr(hf_config, "vocab_size", 0) or 1)
            chunk_size, how = default_chunk_size(vocab, device_type)
        if compiled:
            how += "; compiled"
        note = f"loss: in chunks of {chunk_size:,} target tokens ({how})"
        return cls(chunk_size, transform, note=note, compiled=compiled)

    def at_temperature(self, temperature: float) -> LossChunking:
        """The same chunks with the logits divided by `temperature` after the family's own
        transform: the sampling distribution a policy-gradient loss scores (GRPO)."""
        if temperature == 1.0 or not self.chunk_size:
            return self
        family = self.transform

        def scaled(logits: torch.Tensor) -> torch.Tensor:
            return (family(logits) if family is not None else logits) / temperature

        return LossChunking(self.chunk_size, scaled, self.note, self.compiled)


def run_chunking(config: Any, hf_config: Any, device: torch.device) -> LossChunking:
    """The chunks of a run (a TrainConfig's --loss_chunk_size and --compile) on `device`."""
    return LossChunking.build(
        config.loss_chunk_size, hf_config, device_type=device.type, compiled=config.compile
    )


def output_layer(model: nn.Module) -> nn.Module:
    """The module that turns the last hidden states into logits (`lm_head`, GPT-NeoX's
    `embed_out`), through the DDP and PEFT wrappers."""
    inner: Any = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    head = inner.get_output_embeddings()
    assert isinstance(head, nn.Module), f"{type(inner).__name__} has no output layer"
    return head


# --- the chunks ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Targets:
    """The positions with a next-token target, found on the host (no device sync): `rows` index
    the [batch x positions] hidden states, `shifted` the [batch x predicting positions] of
    `next_token_labels` (a whole sequence's all but the last, a slice's all)."""

    rows: torch.Tensor
    shifted: torch.Tensor
    tokens: torch.Tensor

    @classmethod
    def of(cls, following: torch.Tensor, positions: int) -> Targets:
        """`following`: `next_token_labels` of a batch whose hidden states have `positions`."""
        batch, predicting = following.shape
        if is_fake(
            following
        ):  # the memory planner's trace: no values, so every position (the most)
            b = torch.arange(batch).repeat_interleave(predicting)
            t = torch.arange(predicting).repeat(batch)
        else:
            b, t = (following != IGNORE_INDEX).nonzero(as_tuple=True)
        return cls(rows=b * positions + t, shifted=b * predicting + t, tokens=following[b, t])

    def to(self, device: torch.device) -> Targets:
        moved = (x.to(device, non_blocking=True) for x in (self.rows, self.shifted, self.tokens))
        return Targets(*moved)


def _chunk_nll(
    head: nn.Module,
    transform: LogitTransform | None,
    nll: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    tokens: torch.Tensor,
) -> torch.Tensor:
    return nll(head(hidden), tokens, transform)


def _logits_nll(
    logits: torch.Tensor, tokens: torch.Tensor, transform: LogitTransform | None
) -> torch.Tensor:
    """-log p(token) of each row of a chunk's logits, after the family's transform; in fp32 as
    in token_loss_sum: bf16 logits do not cost accuracy in the loss."""
    if transform is not None:
        logits = transform(logits)
    return F.cross_entropy(logits.float(), tokens, reduction="none")


def _nll_sum_and_logit_grad(
    logits: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's summed -log p(token) and its gradient with respect to the logits (softmax -
    one-hot), in the logits' dtype, computed in fp32. Eager, log_softmax is one pass over the
    logits, in place of logsumexp's several, and the gradient overwrites log p in place;
    compiled (--compile), inductor fuses it all into a pass or two without the fp32 logits-sized
    temporaries (torchtitan/docs/chunked_loss.md: the eager loss's fp32 temporary was 5.8 GiB
    of 40,960-token chunks)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(1, tokens[:, None])
    probs = logp.exp_().scatter_add_(1, tokens[:, None], torch.full_like(picked, -1.0))
    return -picked.sum(), probs.to(logits.dtype)


# The chunks' elementwise work through torch.compile (--compile), built at its first use, per
# backend: one graph per function and dtype, and one recompile when a chunk of another length
# first comes (the last chunk of a batch: torch.compile then makes the length dynamic).
_COMPILED: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}


def _chunk_functions(compiled: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(`_logits_nll`, `_nll_sum_and_logit_grad`), compiled or eager."""
    if not compiled:
        return _logits_nll, _nll_sum_and_logit_grad
    from fsdp_utils.parallel.compile import compile_backend
    from fsdp_utils.parallel.compile import compiled as compile_function

    backend = compile_backend()
    if backend not in _COMPILED:
        _COMPILED[backend] = (
            compile_function(_logits_nll),
            compile_function(_nll_sum_and_logit_grad),
        )
    return _COMPILED[backend]


def _chunk_nll_entropy(
    head: nn.Module, transform: LogitTransform | None, hidden: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_chunk_nll` and the entropy of each target position's distribution (no gradient: a
    metric), from the same logits."""
    logits = head(hidden)
    if transform is not None:
        logits = transform(logits)
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(1, tokens[:, None]).squeeze(1)
    detached = logp.detach()
    return nll, -(detached.exp() * detached).sum(-1)


def _chunk_nll_entropy_columns(
    head: nn.Module, transform: LogitTransform | None, hidden: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """[chunk, 2]: `_chunk_nll_entropy`'s two, side by side (`chunked_over_targets`' shape)."""
    return torch.stack(_chunk_nll_entropy(head, transform, hidden, tokens), dim=1)


def entropy_from_logits(logits: torch.Tensor, following: torch.Tensor) -> torch.Tensor:
    """[batch, predicting positions] entropy of each position's next-token distribution (no
    gradient), 0 where the label is ignored: the unchunked counterpart of the chunks'."""
    logp = torch.log_softmax(logits[:, : following.shape[1]].detach().float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return entropy.masked_fill(following == IGNORE_INDEX, 0.0)


def chunked_target_nll(
    head: nn.Module,
    hidden: torch.Tensor,
    targets: Targets,
    *,
    chunk_size: int,
    transform: LogitTransform | None = None,
    summed: bool = False,
    entropy: list[torch.Tensor] | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """-log p(target) of each target token ([targets], fp32; `summed`: their sum, without
    recomputing any chunk where `fused_applies`; `entropy`: a list that gets the [targets]
    entropies of the same distributions, detached), from the last hidden states
    [batch, seq, hidden] (those the output layer would get) through `head` and `transform`,
    `chunk_size` target tokens at a time (`chunked_over_targets`).

    Only positions with a target go through the output layer (answers-only masks and padding
    cost nothing). A batch without targets still runs one position through the output layer
    (its loss dropped), so that the layer takes part in every backward, as with the unchunked
    loss (DDP expects it)."""
    if entropy is not None:
        assert not summed, "entropies are per target"
        compute = functools.partial(_chunk_nll_entropy_columns, head, transform)
        both = chunked_over_targets(compute, hidden, targets, chunk_size=chunk_size)
        entropy.append(both[:, 1].detach())
        # A copy, not a view: it becomes the forward's output, and FSDP2 warns of views there
        return both[:, 0].contiguous()
    logits_nll, nll_and_grad = _chunk_functions(compiled)
    if summed and targets.rows.numel() and fused_applies(head, transform, hidden):
        picked = hidden.flatten(0, 1).index_select(0, targets.rows)
        # --liger_kernels: liger's fused linear cross-entropy, the same sum in Triton
        fused = getattr(head, FUSED_NLL_ATTRIBUTE, None)
        if fused is not None:
            return fused(picked, head.weight, targets.tokens, chunk_size)  # type: ignore[no-any-return]
        return _LinearNLLSum.apply(picked, head.weight, targets.tokens, chunk_size, nll_and_grad)
    compute = functools.partial(_chunk_nll, head, transform, logits_nll)
    nll = chunked_over_targets(compute, hidden, targets, chunk_size=chunk_size)
    return nll.sum() if summed else nll


ChunkCompute = Callable[..., torch.Tensor]


def chunked_over_targets(
    compute: ChunkCompute,
    hidden: torch.Tensor,
    targets: Targets,
    *,
    chunk_size: int,
    per_target: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:
    """`compute(hidden chunk [c, hidden], target tokens [c], *per_target chunks)` -> [c, ...]
    for every target token ([targets, ...]), from the last hidden states [batch, seq, hidden],
    `chunk_size` target tokens at a time, each chunk but the last under `torch.utils.checkpoint`
    (its logits freed after the forward and recomputed in backward). `per_target`: tensors with
    a row per target token that `compute` reads beside them (a teacher's hidden states or
    cached log-probabilities: fsdp_utils/methods/distill/).

    Only positions with a target are computed (answers-only masks and padding cost nothing); a
    batch without targets computes one position, dropped."""
    flat = hidden.flatten(0, 1)
    rows, tokens = targets.rows, targets.tokens
    if rows.numel() == 0:
        pads = (x.new_zeros((1, *x.shape[1:])) for x in per_target)
        return compute(flat[:1], tokens.new_zeros(1), *pads)[:0]
    picked = flat.index_select(0, rows)
    starts = range(0, rows.numel(), chunk_size)
    checkpointed = functools.partial(checkpoint, compute, use_reentrant=False)
    pieces = [
        # The last chunk keeps its logits for backward, which begins right after it: the peak
        # is the same as recomputing them, and a batch of one chunk recomputes nothing.
        (compute if start == starts[-1] else checkpointed)(
            picked[start : start + chunk_size],
            tokens[start : start + chunk_size],
            *(x[start : start + chunk_size] for x in per_target),
        )
        for start in starts
    ]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class _LinearNLLSum(torch.autograd.Function):
    """sum(-log p(target)) over the chunks of a plain linear output layer (no bias, no
    transform), with the gradients computed chunk by chunk in the forward (Liger's fused linear
    cross-entropy): the backward only scales them by the loss's gradient, so no chunk is
    recomputed. Exact for a summed loss, whose gradient is one number for every token."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        tokens: torch.Tensor,
        chunk: int,
        nll_and_grad: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h, t = hidden[start : start + chunk], tokens[start : start + chunk]
            # the chunk's loss, and d/dlogits of it (`_nll_sum_and_logit_grad`)
            nll, grad = nll_and_grad(F.linear(h, weight), t)
            total += nll
            grad_hidden[start : start + chunk] = grad @ weight
            if weight.dtype == torch.float32:  # summed in the matmul: no [vocab, hidden] temporary
                grad_weight.addmm_(grad.t(), h)
            else:  # bf16 products, summed over the chunks in fp32
                grad_weight += (grad.t() @ h.to(weight.dtype)).float()
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * grad.to(grad_hidden.dtype),
            grad_weight * grad.to(grad_weight.dtype),
            None,
            None,
            None,
        )


def fused_applies(head: nn.Module, transform: LogitTransform | None, hidden: torch.Tensor) -> bool:
    """The gradients-in-forward sum fits: a plain bias-free Linear (not a LoRA layer), no logit
    transform, no autocast (the forward's matmuls would then not be autocast's), grads wanted."""
    return (
        type(head) is nn.Linear
        and head.bias is None
        and transform is None
        and torch.is_grad_enabled()
        and (hidden.requires_grad or head.weight.requires_grad)
        and not torch.is_autocast_enabled(hidden.device.type)
    )


def scatter_logprobs(nll: torch.Tensor, targets: Targets, shape: torch.Size) -> torch.Tensor:
    """[batch, predicting positions] (`shape`, that of `next_token_labels`) log-probabilities of
    each next token, 0 where the label is ignored."""
    batch, predicting = shape
    out = nll.new_zeros(batch * predicting)
    return out.index_put((targets.shifted,), -nll).view(batch, predicting)


def logprobs_from_logits(logits: torch.Tensor, following: torch.Tensor) -> torch.Tensor:
    """The unchunked counterpart of `scatter_logprobs(chunked_target_nll(...))`; `following` as
    for `next_token_loss_sum`."""
    logp = torch.log_softmax(logits[:, : following.shape[1]].float(), dim=-1)
    picked = logp.gather(-1, following.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(following == IGNORE_INDEX, 0.0)
