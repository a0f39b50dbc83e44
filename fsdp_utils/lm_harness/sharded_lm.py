"""`ShardedLM`: lm-evaluation-harness's model interface over the FSDP2 model, every rank at work.

lm-eval sees one process: every rank builds every task's requests, in the same order, and
hands all of them to this model. Here they are split: sorted longest first (as lm-eval's
`HFLM` sorts them, so that a batch pads little), dealt round-robin to the ranks, each rank
padding its share with copies of a request up to the same count, so that every rank runs the
same number of forward passes of the same batch size (each forward is a collective under
FSDP: every layer's parameters are all-gathered). The answers are gathered back into request
order on every rank, and lm-eval computes the metrics as on one process.

Tokenisation and scoring follow `HFLM` (lm_eval/models/huggingface.py) step by step, so each
request's log-likelihood is HFLM's within floating-point rounding:

- context/continuation: `TemplateLM.loglikelihood` and `_encode_pair` (inherited), `tok_encode`
  as HFLM's (the tokenizer's special tokens unless the text already starts with BOS);
- loglikelihood: the input is `(context + continuation)[-(max_length + 1):][:-1]`, right
  padded, no attention mask (causal); the continuation's log-probabilities are summed and
  `is_greedy` says whether every continuation token is the argmax. Requests whose inputs are
  the same token sequence share one row (HFLM's "one-token continuation" cache, generalised:
  a multiple-choice question with one-token answers is one forward, not one per choice);
- loglikelihood_rolling: lm-eval's own rolling windows (`get_rolling_token_windows`,
  `make_disjoint_window`, context length 1, prefix token = BOS or EOS), scored as above;
- generate_until: prompts tokenised as HFLM's batch encoding does, left-truncated to
  `max_length - max_gen_toks`, decoded through `fsdp_utils.parallel.generate` (KV cache; a
  batch decodes until every row on every rank is done), greedy, or sampled as transformers'
  `generate` samples (temperature, then top-k, then top-p; those a task or `--gen_kwargs`
  leaves out come from the model's generation_config, else transformers' defaults: top-k 50),
  each request drawing from a generator seeded by (`seed`, its task, document and repeat), so
  that any number of ranks samples the same text; decoded without special tokens and cut at
  the first stop sequence (lm-eval's `postprocess_generated_text`);
- chat templates (`apply_chat_template`, `chat_template`, `tokenizer_name`): HFLM's hooks, the
  tokenizer's template rendering lm-eval's turns, a template's system turn dropped when the
  template refuses one (as HFLM retries); a named template (`--apply_chat_template NAME`) is
  the one rendered, where HFLM records the name but renders the tokenizer's default.

And on purpose: log-softmax runs in float32 on the continuation's positions only
(HFLM: in the model's dtype over every position). On an fp32 model the two are the same; on a
bf16 model this one is the more exact.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import jinja2
import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    configure_pad_token,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from torch import nn

from fsdp_utils.lm_harness.scoring import check_gen_kwargs
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.generate import Sampling, continue_prompts, row_seed

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_MAX_GEN_TOKS = 256  # HFLM's max_gen_toks
TRANSFORMERS_TOP_K = 50  # transformers' top_k when neither the settings nor the model give one
# A rolling window or a (context, continuation) pair, as token ids.
TokenPair = tuple[list[int], list[int]]


@dataclass(frozen=True)
class Share:
    """This rank's part of a list of work items: their indices (padded to the same count on
    every rank with copies of one item, whose answers are dropped) and how many are real."""

    indices: list[int]
    real: int


def deal(order: Sequence[int], rank: int, world_size: int) -> Share:
    """Items in `order` (longest first), dealt round-robin: rank r takes order[r::world_size],
    padded to ceil(n / world_size) items with copies of the last (shortest) item of `order`, so
    that at every place rank 0's item is the longest of all ranks'."""
    per_rank = -(-len(order) // world_size)
    mine = list(order[rank::world_size])
    real = len(mine)
    if order:
        mine += [order[-1]] * (per_rank - real)
    return Share(mine, real)


def batch_sizes(longest: Sequence[int], rows_for: Callable[[int], int]) -> list[int]:
    """Consecutive batches over places whose longest item (over all ranks) is `longest[j]`,
    longest first: each batch takes `rows_for(length of its first place)` places."""
    sizes, start = [], 0
    while start < len(longest):
        size = min(max(1, rows_for(longest[start])), len(longest) - start)
        sizes.append(size)
        start += size
    return sizes


def run_sharded(
    items: Sequence[T],
    *,
    length: Callable[[T], int],
    work: Callable[[list[T]], list[R]],
    rows_for: Callable[[int], int],
    rank: int,
    world_size: int,
) -> list[R]:
    """`work` on batches of this rank's share of `items`; every result, in item order, on
    every rank. `rows_for(length)`: the rows of a batch whose longest item has that length.
    Every rank calls `work` equally often with batches of equal sizes (the sizes follow from
    the order every rank computes alike)."""
    order = sorted(range(len(items)), key=lambda i: (-length(items[i]), i))
    share = deal(order, rank, world_size)
    longest = [length(items[order[j * world_size]]) for j in range(len(share.indices))]
    results: list[R] = []
    start = 0
    for size in batch_sizes(longest, rows_for):
        batch = [items[i] for i in share.indices[start : start + size]]
        results += work(batch)
        start += size
    everyone = dist_utils.all_gather_objects(
        list(zip(share.indices, results, strict=True))[: share.real]
    )
    by_index: dict[int, R] = {}
    for pairs in everyone:
        by_index.update(pairs)
    assert len(by_index) == len(items), "a request was lost between the ranks"
    return [by_index[i] for i in range(len(items))]


@dataclass
class Row:
    """One forward row: an input sequence and the continuations scored on its last positions
    (requests whose inputs are the same tokens share it)."""

    tokens: list[int]
    continuations: list[list[int]]

    @property
    def scored(self) -> int:
        """How many of the last positions are scored: the longest continuation's length."""
        return min(len(self.tokens), max(len(c) for c in self.continuations))


class ShardedLM(TemplateLM):
    """lm-eval's `LM` over a model sharded with FSDP2 (or a plain model on one process).

    Collective: every rank must make the same calls with the same requests (lm-eval does,
    since this model reports one process to it). `log` receives progress lines (rank 0's)."""

    backend = "causal"

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        batch_size: int = 8,
        token_budget: int | None = None,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        add_bos_token: bool | None = None,
        template_name: str | None = None,
        seed: int | None = 1234,
        model_info: dict[str, Any] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        """`template_name`: which of the tokenizer's named chat templates renders the prompts
        (None: its default), when lm-eval applies one. `seed`: what sampled generation draws
        from (lm-eval's torch seed; None: a seed drawn afresh, the same on every rank)."""
        super().__init__()  # rank 0 of 1, as lm-eval sees it
        if batch_size < 1:
            raise ValueError(f"--batch_size must be at least 1, not {batch_size}.")
        self.model = model
        self.config = getattr(model, "config", None)
        self.tokenizer = configure_pad_token(tokenizer, model_config=self.config)
        self._device = device
        self.shard_rank = rank
        self.shard_world_size = world_size
        self.batch_size = batch_size
        # --batch_size auto on a GPU: rows per forward from the memory plan's token budget (at
        # most `batch_size`), so that a forward of long requests takes fewer rows.
        self.token_budget = token_budget
        self._max_length = max_length
        self._max_gen_toks = max_gen_toks
        self.add_bos_token = add_bos_token
        self.template_name = template_name
        self.seed = seed
        self.model_info = dict(model_info or {})
        self.log = log if log is not None else (lambda _line: None)
        self.forward_passes = 0  # this rank's, for the tests and the log

    # --- what lm-eval asks about the model ---------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        if self.tokenizer.bos_token_id is not None:
            return int(self.tokenizer.bos_token_id)
        return self.eot_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        return resolve_max_length(self.config, self.tokenizer)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        return dict(self.model_info)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """HFLM's: the tokenizer's template (the named one, if any) over lm-eval's turns; a
        template that refuses a system turn (Gemma's) gets the turns without it."""
        named = {"chat_template": self.template_name} if self.template_name else {}

        def render(history: list[dict[str, str]]) -> str:
            return str(
                self.tokenizer.apply_chat_template(
                    history,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=not add_generation_prompt,
                    **named,
                )
            )

        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            return render([m for m in chat_history if m["role"] != "system"])

    def tok_encode(
        self,
        string: str,
        add_special_tokens: bool | None = None,
        left_truncate_len: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """HFLM's: the tokenizer's own special tokens, unless told, or unless `string`
        already starts with the BOS text."""
        if add_special_tokens is not None:
            special: dict[str, bool] = {"add_special_tokens": add_special_tokens}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        else:
            special = {}
        if add_special_tokens is None and has_bos_prefix(
            string, self.tokenizer.decode(self.prefix_token_id)
        ):
            special["add_special_tokens"] = False
        encoding = list(self.tokenizer.encode(string, **special))
        if left_truncate_len:
            encoding = encoding[-left_truncate_len:]
        return encoding

    def _batch_special_tokens(self, first: str) -> dict[str, bool]:
        """HFLM's `tok_batch_encode` decides special tokens for a whole batch by its first
        string; generation batches here are formed differently, so by each prompt."""
        if has_bos_prefix(first, getattr(self.tokenizer, "bos_token", None)):
            return {"add_special_tokens": False}
        if self.add_bos_token is not None:
            return {"add_special_tokens": self.add_bos_token}
        return {}

    # --- sharded forward passes --------------------------------------------------------------

    def _sharded(
        self, items: Sequence[T], length: Callable[[T], int], work: Callable[[list[T]], list[R]]
    ) -> list[R]:
        return run_sharded(
            items,
            length=length,
            work=work,
            rows_for=self.rows_for,
            rank=self.shard_rank,
            world_size=self.shard_world_size,
        )

    def rows_for(self, longest: int) -> int:
        """Rows of a forward whose longest row has `longest` tokens."""
        if self.token_budget is None:
            return self.batch_size
        return max(1, min(self.batch_size, self.token_budget // max(1, longest)))

    @torch.no_grad()
    def _score_rows(self, rows: list[Row]) -> list[list[tuple[float, bool]]]:
        """One forward over right-padded inputs; for each row, each of its continuations'
        (summed log-probability, is greedy) from the float32 log-softmax of its positions."""
        width = max(len(row.tokens) for row in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, : len(row.tokens)] = torch.tensor(row.tokens, dtype=torch.long)
        # Only the scored positions' logits are needed: keep from the earliest of them on.
        first = min(len(row.tokens) - row.scored for row in rows)
        keep = width - first
        kwargs: dict[str, Any] = {"use_cache": False}
        if _accepts(self.model, "logits_to_keep"):
            kwargs["logits_to_keep"] = keep
        logits = self.model(input_ids=ids.to(self.device), **kwargs).logits[:, -keep:]
        self.forward_passes += 1
        answers = []
        for b, row in enumerate(rows):
            end = len(row.tokens) - first  # past the row's last real position in the window
            logprobs = F.log_softmax(logits[b, end - row.scored : end].float(), dim=-1).cpu()
            greedy = logprobs.argmax(dim=-1)
            per_row = []
            for continuation in row.continuations:
                target = torch.tensor(continuation, dtype=torch.long)
                picked = logprobs[-len(continuation) :].gather(1, target.unsqueeze(1))
                per_row.append(
                    (float(picked.sum()), bool((greedy[-len(continuation) :] == target).all()))
                )
            answers.append(per_row)
        return answers

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **_: Any
    ) -> list[tuple[float, bool]]:
        """Score (request, context tokens, continuation tokens) triples, in their order."""
        rows: dict[tuple[int, ...], Row] = {}  # one row per distinct input sequence
        plan: list[tuple[tuple[int, ...], int]] = []  # per request: its row, its continuation
        for _, context, continuation in requests:
            assert context and continuation, "lm-eval gives a non-empty context and continuation"
            key = tuple((context + continuation)[-(self.max_length + 1) :][:-1])
            row = rows.setdefault(key, Row(list(key), []))
            if continuation not in row.continuations:
                row.continuations.append(continuation)
            plan.append((key, row.continuations.index(continuation)))

        started = time.monotonic()
        distinct = list(rows.values())
        scored = self._sharded(distinct, lambda r: len(r.tokens), self._score_rows)
        by_key = dict(zip(rows, scored, strict=True))
        # Milliseconds: bench/gpu_check.py's requests/s reads these (a small model on an idle
        # machine answers a task's requests in under 0.05 s).
        self.log(
            f"loglikelihood: {len(requests)} requests as {len(distinct)} distinct inputs on "
            f"{self.shard_world_size} rank(s), {time.monotonic() - started:.3f}s"
        )
        return [by_key[key][j] for key, j in plan]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[Any, list[int], list[int]]] = []
        owner: list[int] = []
        for index, (string,) in enumerate(req.args for req in requests):
            pairs = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(lm_utils.make_disjoint_window, pairs):
                windows.append((None, context, continuation))
                owner.append(index)
        scores = self._loglikelihood_tokens(windows)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, scores, strict=True):
            totals[index] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- generation ----------------------------------------------------------------------------

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Continuations, grouped by generation settings (one group's batches have the same
        settings on every rank, so that their decoding loops meet). A request samples from a
        generator of its own, seeded by (seed, its task, document, answer index and repeat):
        the same on any number of ranks, in any batch, beside any other tasks."""
        groups: dict[str, list[int]] = {}
        for index, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(index)
        answers: list[str] = [""] * len(requests)
        started = time.monotonic()
        seed = self.seed
        if seed is None and any(_sampling_kwargs(r.args[1]) for r in requests):
            seed = dist_utils.broadcast_object(random.SystemRandom().randrange(2**63))
        names = _request_names(requests)
        for indices in groups.values():
            gen_kwargs = requests[indices[0]].args[1]
            seeds = [row_seed(seed, *names[i]) for i in indices] if seed is not None else None
            texts = self._generate_group([requests[i].args[0] for i in indices], gen_kwargs, seeds)
            for i, text in zip(indices, texts, strict=True):
                answers[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        self.log(
            f"generate_until: {len(requests)} requests on {self.shard_world_size} rank(s), "
            f"{time.monotonic() - started:.3f}s"
        )
        return answers

    def _generate_group(
        self, contexts: list[str], gen_kwargs: dict[str, Any], seeds: list[int] | None
    ) -> list[str]:
        check_gen_kwargs(gen_kwargs, where=f"generation settings {gen_kwargs}")
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        eos_text = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
        max_new = int(kwargs.pop("max_gen_toks"))
        sampling = self._sampling(kwargs)
        max_context = self.max_length - max_new
        if max_context <= 0:
            raise ValueError(
                f"A task asks for {max_new} new tokens, not fewer than the model's context "
                f"of {self.max_length}."
            )
        special = self._batch_special_tokens(contexts[0])
        prompts = [
            list(self.tokenizer(text, **special)["input_ids"])[-max_context:] for text in contexts
        ]
        row_seeds = seeds if seeds is not None else [0] * len(prompts)
        stop_ids = set(_eos_ids(self.config)) | {self.eot_token_id}
        window = max(len(self.tokenizer.encode(s, add_special_tokens=False)) for s in until) + 2

        def work(batch: list[tuple[list[int], int]]) -> list[str]:
            def stopped(row: int, tokens: list[int]) -> bool:
                if tokens[-1] in stop_ids:
                    return True
                tail = self.tokenizer.decode(tokens[-window:], skip_special_tokens=False)
                return any(s and s in tail for s in until)

            generated = continue_prompts(
                self.model,
                [prompt for prompt, _ in batch],
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.eot_token_id,
                max_new_tokens=max_new,
                is_done=stopped,
                device=self.device,
                sampling=sampling,
                seeds=[seed for _, seed in batch],
            )
            self.forward_passes += 1
            return [
                postprocess_generated_text(
                    self.tokenizer.decode(g.tokens, skip_special_tokens=True), until, None
                )
                for g in generated
            ]

        # A row's memory is its prompt and everything it may generate.
        items = list(zip(prompts, row_seeds, strict=True))
        return self._sharded(items, lambda item: len(item[0]) + max_new, work)

    def _sampling(self, kwargs: dict[str, Any]) -> Sampling | None:
        """Greedy (None) unless the settings sample; then the filters transformers' `generate`
        would apply: the settings', else the model's generation_config's, else its defaults."""
        if not _sampling_kwargs(kwargs):
            return None
        defaults = getattr(self.model, "generation_config", None)
        top_k = kwargs.get("top_k", getattr(defaults, "top_k", None))
        top_p = kwargs.get("top_p", getattr(defaults, "top_p", None))
        return Sampling(
            float(kwargs["temperature"]),
            top_k=int(TRANSFORMERS_TOP_K if top_k is None else top_k),
            top_p=float(1.0 if top_p is None else top_p),
        )


def _request_names(requests: list[Any]) -> list[tuple[object, ...]]:
    """What names each request whatever else the run holds: (task, document, answer index,
    repeat), the repeat counting lm-eval's copies of one request (a task's `repeats`); the
    request's place for one without a task (built by hand)."""
    seen: dict[tuple[object, ...], int] = {}
    names: list[tuple[object, ...]] = []
    for index, req in enumerate(requests):
        doc = getattr(req, "doc_id", None)
        key = (req.task_name, doc, req.idx) if doc is not None else ("request", index)
        names.append((*key, seen.get(key, 0)))
        seen[key] = seen.get(key, 0) + 1
    return names


def _sampling_kwargs(kwargs: dict[str, Any]) -> bool:
    """Whether generation settings sample, as lm-eval's `normalize_gen_kwargs` reads them:
    do_sample if given, else a temperature above 0."""
    do_sample = kwargs.get("do_sample")
    if do_sample is None:
        return float(kwargs.get("temperature") or 0.0) > 0.0
    return bool(do_sample)


def _accepts(model: nn.Module, name: str) -> bool:
    import inspect

    return name in inspect.signature(type(model).forward).parameters


def _eos_ids(hf_config: Any) -> list[int]:
    """The ids generation stops at (a config may list several, as Llama 3's does)."""
    value = getattr(hf_config, "eos_token_id", None)
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]
