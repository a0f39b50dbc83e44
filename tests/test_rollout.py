"""Rollouts (`fsdp_utils.parallel.generate`: `PolicyEngine`, `Rollout`): completions sampled by the
sharded policy with a KV cache, seeded per row, with parameters gathered once per rollout phase.

One 2-process run (`tests/rollout_probe.py`) is compared with the same rows sampled here in one
process by the plain transformers model (no FSDP): the same completions, whatever the batch or
rank a row lands in; each token's log-probability equals the training forward's at the same
temperature; FSDP2 all-gathers each shard group once per rollout phase, where plain decoding
all-gathers a resharding layer at every token. Greedy decoding equals transformers' `generate`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import rollout_probe as probe
from tests.train_helpers import check_ok, run_script


@pytest.fixture(scope="module")
def sharded(tiny_assets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("rollout") / "rollout.json"
    # 2 processes forked as torchrun's workers (tests/prefork.py): the launcher is not the point.
    result = run_script(2, "tests/rollout_probe.py", [str(tiny_assets["model"]), str(out)], 300)
    check_ok(result)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_assets: dict[str, Path]) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_assets["model"], dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(tiny_assets["model"])


def _unsharded_rollout(model: Any, tokenizer: Any) -> dict[str, list[int]]:
    """Every row of the probe in one batch, on one process, without FSDP."""
    from fsdp_utils.parallel.generate import PolicyEngine, RolloutSettings

    rows = [(p, g) for p in range(len(probe.PROMPTS)) for g in range(probe.GENERATIONS)]
    settings = RolloutSettings(
        max_new_tokens=probe.MAX_NEW_TOKENS, stop_token_ids=probe.stop_tokens(tokenizer),
        pad_token_id=int(tokenizer.pad_token_id), sampling=probe.sampling(),
    )  # fmt: skip
    engine = PolicyEngine(model, settings, device=torch.device("cpu"))
    with engine.rollout_phase():
        rollout = engine.generate(
            [tokenizer(probe.PROMPTS[p])["input_ids"] for p, _ in rows],
            [probe.seed_of(p, g) for p, g in rows],
        )
    return {f"{p}/{g}": rollout.completion_ids[i] for i, (p, g) in enumerate(rows)}


@pytest.mark.slow  # the 2-process probe
def test_two_processes_sample_what_one_unsharded_process_samples(sharded, model_and_tokenizer):
    assert sharded["world_size"] == 2
    alone = _unsharded_rollout(*model_and_tokenizer)
    assert set(alone) == set(sharded["rows"])
    for key, row in sharded["rows"].items():
        # One batch of all 20 rows here, 10 per rank there, in two orders, and plain decoding.
        assert row["completion"] == alone[key], key
        assert row["reversed"] == row["completion"] == row["plain"], key
    # The rows differ from each other (the seeds are per prompt and generation).
    assert len({tuple(c) for c in alone.values()}) > len(alone) // 2


@pytest.mark.slow  # the 2-process probe
def test_completions_end_at_a_stop_token_or_the_limit(sharded):
    stops, limit = set(sharded["stop_tokens"]), sharded["max_new_tokens"]
    truncated = [row["truncated"] for row in sharded["rows"].values()]
    assert any(truncated) and not all(truncated)  # both kinds among the probe's rows
    for key, row in sharded["rows"].items():
        completion = row["completion"]
        assert not stops & set(completion[:-1]), key  # nothing after a stop token
        if row["truncated"]:
            assert len(completion) == limit and completion[-1] not in stops, key
        else:
            assert completion[-1] in stops and len(completion) <= limit, key


@pytest.mark.slow  # the 2-process probe
def test_each_tokens_logprob_is_the_training_forwards(sharded):
    for key, row in sharded["rows"].items():
        assert len(row["logprobs"]) == len(row["completion"]) == len(row["forced"]), key
        # The KV-cache decoding (left-padded batch) and the teacher-forced forward (right
        # padding, another batch) agree to rounding, at the same temperature.
        assert row["logprobs"] == pytest.approx(row["forced"], abs=2e-5), key
        assert all(lp < 0 for lp in row["logprobs"]), key


@pytest.mark.slow  # the 2-process probe
def test_a_rollout_phase_all_gathers_each_shard_group_once(sharded):
    groups = sharded["shard_groups"]  # the root and each of the 2 decoder layers
    assert groups == 3
    for rank in sharded["ranks"]:
        assert rank["decode_steps"] == sharded["max_new_tokens"]
        # Gathered for the phase: one all-gather per group, however many tokens.
        assert rank["gathered_all_gathers"] == groups
        # Plain decoding: the first layer reshards after each forward (the last layer and
        # the root do not), so it is gathered again at every token.
        assert rank["plain_all_gathers"] == rank["decode_steps"] + groups - 1


def test_greedy_decoding_is_transformers_generate(model_and_tokenizer):
    from fsdp_utils.parallel.generate import PolicyEngine, RolloutSettings

    model, tokenizer = model_and_tokenizer
    prompts = [tokenizer(p)["input_ids"] for p in probe.PROMPTS[:3]]
    settings = RolloutSettings(
        max_new_tokens=8, stop_token_ids=(int(tokenizer.eos_token_id),),
        pad_token_id=int(tokenizer.pad_token_id), sampling=None,
    )  # fmt: skip
    engine = PolicyEngine(model, settings, device=torch.device("cpu"))
    with engine.rollout_phase():
        rollout = engine.generate(prompts, [0] * len(prompts))
    for prompt, completion in zip(prompts, rollout.completion_ids, strict=True):
        expected = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )[0, len(prompt) :].tolist()  # fmt: skip
        assert completion == expected


def test_rollout_tensors_and_the_training_batch():
    from fsdp_utils.parallel.generate import Rollout

    rollout = Rollout(
        prompt_ids=[[1, 2, 3], [4]],
        completion_ids=[[5, 6], [7, 8, 9]],
        logprobs=[[-0.5, -1.0], [-0.1, -0.2, -0.3]],
        truncated=[False, True],
    )
    assert rollout.completion_mask().tolist() == [[True, True, False], [True, True, True]]
    assert rollout.padded_completions(0).tolist() == [[5, 6, 0], [7, 8, 9]]
    assert rollout.padded_logprobs().tolist() == [[-0.5, -1.0, 0.0], [-0.1, -0.2, -0.3]]
    batch = rollout.training_batch(0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 5, 6], [4, 7, 8, 9, 0]]
    assert batch["labels"].tolist() == [[-100, -100, -100, 5, 6], [-100, 7, 8, 9, -100]]
    both = Rollout.concat([rollout.select([1]), rollout.select([0])])
    assert both.completion_ids == [[7, 8, 9], [5, 6]] and both.truncated == [True, False]
