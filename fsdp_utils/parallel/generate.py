"""Batched decoding and teacher-forced scoring that are safe under FSDP.

With FSDP every forward pass is a collective (each layer's parameters are all-gathered), so
all ranks must run the same number of forwards. Callers give every rank the same number of
batches of the same size (padding with dummy rows); here, a batch decodes until every row on
*every* rank is done (one tiny all-reduce per token), so the forward counts match. No rank
ever holds more than FSDP's one gathered layer at a time.

Sampling (`Sampling`: temperature, then top-k, then top-p, as transformers' `generate` filters
the logits) draws each row's tokens from a generator of the row's own, seeded by the caller per
item (`row_seed`): one uniform number per token, from that generator alone. An item samples the
same tokens whichever batch, place or rank it lands in, so a run on one process and one on two
agree token for token (up to the rounding of the logits themselves: a forward of another batch
shape may differ in the last bits, which changes a token only when a draw falls within that
distance of a boundary between two tokens' probabilities).

Rollouts (`Rollout`, `RolloutEngine`, `PolicyEngine`): completions sampled by the policy that
is being trained, for methods that learn from their own samples (GRPO: fsdp_utils/methods/grpo/;
on-policy distillation). Prompts' token ids and a seed per row go in; the completions' ids (the
stop token that ended one included), the log-probability of each sampled token, and whether it
ran out of tokens come out, with the masks and the teacher-forced batch a training step reads.
`PolicyEngine` samples in the training processes themselves, its parameters gathered for the
whole rollout phase (`gathered_parameters`: one all-gather per shard group, not one per token);
an inference server (vLLM) would be another `RolloutEngine` behind the same two calls.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from fsdp_utils.data.blocks import IGNORE_INDEX
from fsdp_utils.model.sdpa import generation_kernels
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.parallelize import gathered_parameters, no_grad_pass


@dataclass
class Generated:
    tokens: list[int]  # the continuation, without the EOS
    eos: bool  # the model wrote EOS
    stop_token: int | None = None  # which EOS (one of `eos_token_id`'s), when it wrote one
    # With `logprobs=True`: log p of each token of `tokens`, then of the EOS when it wrote one,
    # under the sampling temperature (`Sampling.logprobs`).
    logprobs: list[float] = field(default_factory=list)


def _accepts(model: nn.Module, name: str) -> bool:
    return name in inspect.signature(type(model).forward).parameters


def _cache_of(out: Any) -> dict[str, Any]:
    """The KV cache a forward returned, as the keyword the next forward takes it by.
    transformers 5.x calls it `cache` (its outputs have that field, and `past_key_values` in or
    out warns of its removal); earlier releases, and models that return plain tuples or
    namespaces, call it `past_key_values`. Decided from the output, not the model's signature:
    a PEFT wrapper's forward takes **kwargs and names neither."""
    if "cache" in getattr(type(out), "__dataclass_fields__", {}):
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


def _everyone_done(done: bool, device: torch.device) -> bool:
    flag = torch.tensor([1.0 if done else 0.0], device=device)
    return bool(dist_utils.all_reduce_min(flag).item() > 0)


@dataclass(frozen=True)
class Sampling:
    """Sampled decoding as transformers' `generate(do_sample=True, ...)` does it: the logits
    divided by `temperature`, then only the `top_k` most likely tokens kept (0: all), then only
    the smallest set whose probabilities reach `top_p` (1.0: all), then one token drawn."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(
                f"Sampling needs a temperature above 0, not {self.temperature} (0 is greedy "
                "decoding: leave sampling off)."
            )
        if self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(
                f"Sampling needs top_k >= 0 (0: off) and 0 < top_p <= 1, not top_k={self.top_k}, "
                f"top_p={self.top_p}."
            )

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """(rows, vocab) logits -> (rows, vocab) float64 probabilities after the filters, on
        the CPU (where the draws are)."""
        scores = logits.double().cpu() / self.temperature
        if self.top_k:
            k = min(self.top_k, scores.shape[-1])
            kth = torch.topk(scores, k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            # transformers' TopPLogitsWarper: drop the least likely tokens whose summed
            # probability stays within 1 - top_p; the most likely token always stays.
            ascending, order = torch.sort(scores, dim=-1)
            cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative <= 1 - self.top_p
            drop[..., -1] = False
            scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return scores.softmax(dim=-1)

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(rows,) float64 log p(token) under the logits divided by `temperature`, before the
        top-k and top-p filters: the distribution a policy-gradient method's training forward
        computes for the same token (TRL's GRPOTrainer scores its completions so)."""
        logp = torch.log_softmax(logits.double() / self.temperature, dim=-1)
        return logp.gather(-1, tokens.to(logp.device).view(-1, 1)).view(-1)


GREEDY_LOGPROBS = Sampling(1.0)  # greedy decoding's log-probabilities: the plain softmax's


def row_seed(seed: int, *item: object) -> int:
    """The seed of the item named `item` (an index, or a task, document and repeat) in a run
    seeded `seed`: a hash of both, so that neighbouring items (and seeds) get unrelated
    streams."""
    digest = hashlib.sha256(":".join(map(str, (seed, *item))).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: any torch seed


def _draw(probabilities: torch.Tensor, generators: Sequence[torch.Generator]) -> list[int]:
    """One token per row by inverse transform: the row's uniform draw against its cumulative
    probabilities (one number per token from the row's generator, whatever the others do).
    The rows' cumulative sums and searches run batched; each row's numbers are its own."""
    draws = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    cumulative = probabilities.cumsum(dim=-1)
    targets = (draws * cumulative[:, -1]).unsqueeze(-1)
    picked = torch.searchsorted(cumulative, targets, right=True).squeeze(-1)
    return picked.clamp(max=probabilities.shape[-1] - 1).tolist()


@torch.no_grad()
def _left_padded(
    rows: Sequence[Sequence[int]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, attention mask, position ids) of `rows` left-padded to the longest, on the
    host: every row's last token in the last column, its positions counted from its first."""
    length = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, length - len(row) :] = torch.tensor(list(row), dtype=torch.long)
        mask[b, length - len(row) :] = 1
    return input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def continue_prompts(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    eos_token_id: int | Collection[int],
    max_new_tokens: int,
    is_done: Callable[[int, list[int]], bool] | None = None,
    device: torch.device,
    sampling: Sampling | None = None,
    seeds: Sequence[int] | None = None,
    autocast: Callable[[], Any] | None = None,
    logprobs: bool = False,
) -> list[Generated]:
    """Continue each prompt token by token (greedy, or drawn as `sampling` says from a
    generator per row seeded with `seeds[b]`), with a KV cache. Row b stops at an EOS (any of
    `eos_token_id`'s), when `is_done(b, tokens)` says its verdict is known, or after
    `max_new_tokens`. `logprobs`: record each token's log-probability (`Generated.logprobs`).
    Collective under FSDP: every rank must call it equally often."""
    stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    scoring = sampling or GREEDY_LOGPROBS
    rows = len(prompts)
    input_ids, mask, position_ids = (t.to(device) for t in _left_padded(prompts, pad_token_id))
    keep = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}
    context = autocast or contextlib.nullcontext

    with context(), generation_kernels():
        out = model(
            input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
            use_cache=True, **keep,
        )  # fmt: skip
    next_position = position_ids[:, -1:] + 1
    results = [Generated([], False) for _ in range(rows)]
    done = [False] * rows
    generators = []
    if sampling is not None:
        row_seeds = list(seeds) if seeds is not None else list(range(rows))
        assert len(row_seeds) == rows, "one seed per row"
        generators = [torch.Generator().manual_seed(seed) for seed in row_seeds]
    for step in range(max_new_tokens):
        last = out.logits[:, -1, :]
        if sampling is None:
            picked = [int(t) for t in last.argmax(dim=-1).tolist()]
        else:
            picked = _draw(sampling.probabilities(last), generators)
        scores = scoring.logprobs(last, torch.tensor(picked)).tolist() if logprobs else None
        for b, token in enumerate(picked):
            if done[b]:
                continue
            if scores is not None:
                results[b].logprobs.append(scores[b])
            if token in stops:
                results[b].eos = True
                results[b].stop_token = token
                done[b] = True
                continue
            results[b].tokens.append(token)
            done[b] = is_done is not None and is_done(b, results[b].tokens)
        if step == max_new_tokens - 1 or _everyone_done(all(done), device):
            break
        feed = torch.tensor(
            [[pad_token_id if done[b] else picked[b]] for b in range(rows)], device=device
        )
        mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=device)], dim=1)
        with context(), generation_kernels():
            out = model(
                input_ids=feed, attention_mask=mask, position_ids=next_position,
                use_cache=True, **_cache_of(out), **keep,
            )  # fmt: skip
        next_position = next_position + 1
    return results


@torch.no_grad()
def top1_hits(
    model: nn.Module,
    sequences: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    device: torch.device,
    autocast: Callable[[], Any] | None = None,
) -> list[list[bool]]:
    """Teacher forcing: hits[b][j] says whether token j of sequence b (j >= 1) is the model's
    top-1 prediction given tokens 0..j-1 (hits[b][0] is False). One forward pass; right
    padding needs no mask under causal attention. Collective under FSDP."""
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    for b, seq in enumerate(sequences):
        input_ids[b, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
    input_ids = input_ids.to(device)
    with (autocast or contextlib.nullcontext)():
        logits = model(input_ids=input_ids, use_cache=False).logits
    predicted = logits[:, :-1].argmax(dim=-1)
    match = (predicted == input_ids[:, 1:]).cpu().tolist()
    return [[False, *row[: len(seq) - 1]] for row, seq in zip(match, sequences, strict=True)]


@torch.no_grad()
def continuation_logprobs(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    candidates: Sequence[Sequence[Sequence[int]]],
    *,
    pad_token_id: int,
    device: torch.device,
    batch_size: int,
    autocast: Callable[[], Any] | None = None,
) -> list[list[float]]:
    """log p(candidate | prompt), summed over the candidate's tokens, for each prompt's
    candidates (e.g. every legal move after a game's moves): the model's own probabilities of
    writing exactly those tokens next. Teacher-forced: one row per prompt and distinct longest
    prefix a candidate needs (candidates of one token all read the prompt's own row, so a
    tokenizer that spells every move as one token needs one row per prompt), left-padded in
    chunks of `batch_size` rows, only the last positions' logits kept. Collective under FSDP:
    every rank runs as many forwards as the rank with the most rows (padding with a dummy
    row), whatever its own share, even none."""
    rows: list[list[int]] = []  # prompt + the candidates' tokens but their last
    where: list[list[tuple[int, int]]] = []  # per candidate: (row, its first token's position)
    extras: list[int] = []  # per row: its tokens after the prompt
    for prompt, cands in zip(prompts, candidates, strict=True):
        needs = sorted({tuple(c[:-1]) for c in cands}, key=len, reverse=True)
        own: list[tuple[int, ...]] = []
        for need in needs:  # a prefix of a longer row reads that row
            if not any(r[: len(need)] == need for r in own):
                own.append(need)
        first = len(rows)
        rows.extend([*prompt, *r] for r in own)
        extras.extend(len(r) for r in own)
        placed = []
        for c in cands:
            assert len(c) >= 1, "a candidate has at least one token"
            k = next(j for j, r in enumerate(own) if r[: len(c) - 1] == tuple(c[:-1]))
            placed.append((first + k, len(prompt) - 1))
        where.append(placed)
    chunks = [
        list(range(i, min(i + batch_size, len(rows)))) for i in range(0, len(rows), batch_size)
    ]
    count = torch.tensor([float(len(chunks))], device=device)
    total = int(dist_utils.all_reduce_max(count).item())
    logps: list[torch.Tensor] = []  # per row: [positions, vocab] log-probabilities
    keeps: list[int] = []  # per row: how many of its last positions those are
    context = autocast or contextlib.nullcontext
    for n in range(total):
        chunk = [rows[r] for r in chunks[n]] if n < len(chunks) else [[pad_token_id]]
        ids, mask, positions = _left_padded(chunk, pad_token_id)
        # The candidates' tokens sit in the last positions: keep only those logits (a large
        # vocabulary over whole prompts would not fit).
        keep = 1 + max((extras[r] for r in chunks[n]), default=0) if n < len(chunks) else 1
        extra = {"logits_to_keep": keep} if _accepts(model, "logits_to_keep") else {}
        with context(), generation_kernels():
            out = model(
                input_ids=ids.to(device), attention_mask=mask.to(device),
                position_ids=positions.to(device), use_cache=False, **extra,
            )  # fmt: skip
        logits = out.logits[:, -keep:].double().cpu()
        if n < len(chunks):
            for b in range(len(chunk)):
                logps.append(torch.log_softmax(logits[b], dim=-1))
                keeps.append(keep)
    results: list[list[float]] = []
    for cands, placed in zip(candidates, where, strict=True):
        scores = []
        for c, (r, start) in zip(cands, placed, strict=True):
            # Row r's token at position start + j is predicted by the logits at start + j; the
            # kept window starts at len(row) - keep (left padding ends every row there).
            offset = len(rows[r]) - keeps[r]
            scores.append(float(sum(logps[r][start + j - offset, t] for j, t in enumerate(c))))
        results.append(scores)
    return results


# --- rollouts: completions sampled by the policy, for methods that learn from them ---------


@dataclass(frozen=True)
class Rollout:
    """Completions of prompts, one per row, as the policy sampled them."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # the sampled tokens; the stop token last when one ended it
    # log p of each completion token when it was sampled (`Sampling.logprobs`: under the
    # temperature, before top-k/top-p), computed by the decoding forward with its KV cache
    logprobs: list[list[float]]
    truncated: list[bool]  # no stop token within the maximum number of new tokens

    def __len__(self) -> int:
        return len(self.completion_ids)

    @classmethod
    def concat(cls, parts: Sequence[Rollout]) -> Rollout:
        return cls(
            [p for r in parts for p in r.prompt_ids],
            [c for r in parts for c in r.completion_ids],
            [lp for r in parts for lp in r.logprobs],
            [t for r in parts for t in r.truncated],
        )

    def select(self, rows: Sequence[int]) -> Rollout:
        return Rollout(
            [self.prompt_ids[i] for i in rows],
            [self.completion_ids[i] for i in rows],
            [self.logprobs[i] for i in rows],
            [self.truncated[i] for i in rows],
        )

    @property
    def lengths(self) -> list[int]:
        return [len(c) for c in self.completion_ids]

    def completion_mask(self) -> torch.Tensor:
        """[rows, longest completion] bool: which positions hold a completion token."""
        width = max(self.lengths, default=0)
        return torch.arange(width)[None, :] < torch.tensor(self.lengths)[:, None]

    def padded_completions(self, pad_token_id: int) -> torch.Tensor:
        """[rows, longest completion] int64, right-padded with `pad_token_id`."""
        out = torch.full(self.completion_mask().shape, pad_token_id, dtype=torch.long)
        for b, ids in enumerate(self.completion_ids):
            out[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out

    def padded_logprobs(self) -> torch.Tensor:
        """[rows, longest completion] float64 sampling log-probabilities, 0 on padding."""
        out = torch.zeros(self.completion_mask().shape, dtype=torch.float64)
        for b, values in enumerate(self.logprobs):
            out[b, : len(values)] = torch.tensor(values, dtype=torch.float64)
        return out

    def training_batch(self, pad_token_id: int) -> dict[str, torch.Tensor]:
        """The teacher-forced batch of prompt + completion: `input_ids` [rows, longest prompt +
        completion], right-padded (causal attention needs no mask: padding only follows), and
        `labels` holding the completion tokens only (IGNORE_INDEX on prompts and padding), so
        that the training forward's log-probabilities of `next_token_labels` are exactly the
        completion's tokens, positions [prompt length - 1, ...) of the shifted labels."""
        pairs = list(zip(self.prompt_ids, self.completion_ids, strict=True))
        width = max((len(p) + len(c) for p, c in pairs), default=0)
        input_ids = torch.full((len(self), width), pad_token_id, dtype=torch.long)
        labels = torch.full((len(self), width), IGNORE_INDEX, dtype=torch.long)
        for b, (prompt, completion) in enumerate(pairs):
            sequence = torch.tensor([*prompt, *completion], dtype=torch.long)
            input_ids[b, : len(sequence)] = sequence
            labels[b, len(prompt) : len(sequence)] = sequence[len(prompt) :]
        return {"input_ids": input_ids, "labels": labels}


@dataclass(frozen=True)
class RolloutSettings:
    """How completions are sampled: at most `max_new_tokens`, ended by any of `stop_token_ids`
    (the tokenizer's EOS, the chat template's end of turn), drawn as `sampling` says (None:
    greedy), rows padded with `pad_token_id`."""

    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    pad_token_id: int
    sampling: Sampling | None


class RolloutEngine(Protocol):
    """Where a method's completions come from. `rollout_phase()` brackets a phase of
    generation (the policy's current weights made available to the sampler; given back to
    training at its end) and `generate` samples one batch inside it. Both are collective
    when the engine is the sharded policy itself. An inference server (vLLM, SGLang) would
    implement the same two: weights synced into it on entering the phase, `generate` sent
    to it; none is built here (nothing here could test it)."""

    def rollout_phase(self) -> contextlib.AbstractContextManager[None]: ...

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int]) -> Rollout: ...


class PolicyEngine:
    """Rollouts from the policy being trained, in its own processes: under FSDP2 with every
    shard group's parameters gathered for the whole phase, a KV cache, one tiny all-reduce per
    token (every rank decodes until every rank's rows are done). Row b's tokens come from a
    generator seeded with `seeds[b]`, so a row samples the same completion whichever batch,
    place, rank or world size it lands in (`continue_prompts`)."""

    def __init__(
        self,
        model: nn.Module,
        settings: RolloutSettings,
        *,
        device: torch.device,
        autocast: Callable[[], Any] | None = None,
    ) -> None:
        self.model = model
        self.settings = settings
        self.device = device
        self.autocast = autocast

    @contextlib.contextmanager
    def rollout_phase(self) -> Iterator[None]:
        """Eval mode, no gradients, parameters gathered; resharded and back in training mode
        after (`no_grad_pass`)."""
        with no_grad_pass(self.model), gathered_parameters(self.model):
            yield

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int]) -> Rollout:
        s = self.settings
        generated = continue_prompts(
            self.model, prompts, pad_token_id=s.pad_token_id, eos_token_id=s.stop_token_ids,
            max_new_tokens=s.max_new_tokens, device=self.device, sampling=s.sampling,
            seeds=seeds, autocast=self.autocast, logprobs=True,
        )  # fmt: skip
        return Rollout(
            [list(p) for p in prompts],
            [g.tokens + ([g.stop_token] if g.stop_token is not None else []) for g in generated],
            [g.logprobs for g in generated],
            [not g.eos for g in generated],
        )
