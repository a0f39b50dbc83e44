"""`--method grpo` end to end on CPU: real torchrun runs (2 processes, gloo, FSDP2) of the tiny
chess model on prompts made from the tiny games, with reward functions in a file of their own.

One torchrun runs them all (tests/finetune_runs.py), each run through chess_finetune.py's main:

    base      4 steps, 2 micro-batches per rank, --num_iterations 2 (each rollout trained on
              twice, with its old log-probabilities), --beta 0.04 (a frozen sharded reference)
    legs 1-4  the same run in four legs: stopped after step 1 (mid-iteration: the rollout and
              its old log-probabilities kept), inside step 3's rollout (after its first
              micro-batch), between step 3's rollout and its update, then to the end
    constant  a constant reward: no advantage, so at beta 0 the weights do not move (and the
              chess engine's reward beside it, weighted 0: Stockfish starts and is ended)
    learns    30 steps of a reward the model rarely meets at first, judged on held-out prompts
    raises    a reward function that raises on rank 1 only: rank 0 says so, exit 2
    engine_dies  a chess engine reward whose engine dies once in step 2 (restarted, counted)
              and at every search from step 3 on: the run saves and stops, exit 1

and in this process, one step of `base` on one process: the same completions, rewards and
first loss as on two.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.grpo_helpers import grpo_args, write_prompts, write_rewards
from tests.train_helpers import read_metrics, run_finetunes

pytestmark = pytest.mark.slow


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.fixture(scope="module")
def grpo(tiny_assets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("grpo")
    prompts = write_prompts(tiny_assets["data"], root / "prompts.jsonl")
    cache = root / "cache"
    model = tiny_assets["model"]
    base_rewards = write_rewards(root / "base_rewards")
    legs_dir = root / "legs"
    # Leg 2 stops inside step 3's rollout (the first reward call of that step, global_step 2,
    # on rank 0), leg 3 after the rest of it: between the rollout and the update.
    stop = str(legs_dir / "STOP")
    legs_rewards = write_rewards(root / "legs_rewards", stops=[[2, 0, stop], [2, 0, stop]])

    def args(out: Path, rewards: Path, function: str = "scored", **more: Any) -> list[str]:
        return grpo_args(
            model, prompts, out, cache, reward_funcs=f"{rewards}:{function},chess_format",
            **more,
        )  # fmt: skip

    same = {"num_iterations": 2, "beta": 0.04}
    runs = {
        "base": args(root / "base", base_rewards, **same),
        "leg1": args(legs_dir, legs_rewards, **same, save_every_steps=1, stop_after_steps=1),
        "leg2": args(legs_dir, legs_rewards, **same, save_every_steps=1),
        "leg3": args(legs_dir, legs_rewards, **same, save_every_steps=1),
        "leg4": args(legs_dir, legs_rewards, **same, save_every_steps=1),
        # the engine's reward beside, weighted 0: it runs (and must end with the run, or the
        # process would not exit) and changes nothing
        "constant": grpo_args(
            model,
            prompts,
            root / "constant",
            cache,
            reward_funcs=f"{base_rewards}:constant,chess_engine",
            reward_weights="1,0",
            max_training_steps=2,
        ),
        "learns": grpo_args(
            model,
            prompts,
            root / "learns",
            cache,
            reward_funcs=f"{base_rewards}:first_token_class",
            num_generations=8,
            max_completion_length=2,
            total_batch_size=8,
            batch_size_per_device=4,
            max_training_steps=30,
            eval_every=10,
            eval_examples=64,
            eval_batches=8,
            log_completions_every=0,
            lr_schedule="constant",
        ),
        "raises": grpo_args(
            model,
            prompts,
            root / "raises",
            cache,
            reward_funcs=f"{base_rewards}:raises_on_rank_1",
            max_training_steps=1,
        ),
        # A chess engine that dies once in step 2 (restarted), then at every search.
        "engine_dies": grpo_args(
            model,
            prompts,
            root / "engine_dies",
            cache,
            reward_funcs=f"{write_rewards(root / 'engine_rewards')}:engine_dies",
            max_training_steps=4,
            max_completion_length=2,
        ),
    }
    results = run_finetunes(2, runs, root / "runs")
    return {"root": root, "results": results, "model": model, "prompts": prompts,
            "cache": cache, "base_rewards": base_rewards}  # fmt: skip


def _ok(grpo: dict[str, Any], *names: str) -> None:
    for name in names:
        outcome = grpo["results"][name]
        assert outcome["exit_code"] == 0, (name, outcome.get("output_tail"))


def test_a_run_logs_trls_metrics_every_step(grpo):
    _ok(grpo, "base")
    train = read_metrics(grpo["root"] / "base")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    fresh = [r for r in train if r["step"] in (1, 3)]  # a rollout each; 2 and 4 reuse it
    for record in fresh:
        for key in ("reward", "reward_std", "frac_reward_zero_std", "rewards/scored/mean",
                    "rewards/chess_format/std", "completions/mean_length",
                    "completions/clipped_ratio", "rollout/seconds", "rollout/tokens_per_s"):  # fmt: skip
            assert key in record, key
        assert 1 <= record["completions/min_length"] <= record["completions/max_length"] <= 4
    for record in train:
        for key in ("loss", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                    "update/seconds", "update/tokens_per_s", "grad_norm"):  # fmt: skip
            assert record[key] is not None and record[key] == record[key], key
        assert record["entropy"] > 0 and record["kl"] >= 0
    assert all("reward" not in r for r in train if r["step"] in (2, 4))
    # The second step of a rollout starts off the policy: some ratios leave the clip range
    # only then (the first step's ratios are exactly 1).
    assert train[0]["clip_ratio/region_mean"] == 0
    completions = [
        json.loads(line)
        for line in (grpo["root"] / "base" / "completions.jsonl").read_text().splitlines()
    ]
    assert {c["step"] for c in completions} == {1, 3}
    assert set(completions[0]["rewards"]) == {"scored", "chess_format"}
    assert completions[0]["completion"].startswith(" ")  # as it reads after the prompt
    evals = read_metrics(grpo["root"] / "base", "eval")
    assert evals[-1]["step"] == 4 and 0 <= evals[-1]["eval_reward"] <= 1.25


def test_a_run_stopped_anywhere_and_resumed_ends_with_the_same_weights(grpo):
    _ok(grpo, "base", "leg1", "leg2", "leg3", "leg4")
    legs, base = grpo["root"] / "legs", grpo["root"] / "base"
    events = read_metrics(legs, None)
    stops = [e["message"] for e in events if e.get("kind") == "stopping"]
    assert any("stop_after_steps" in m for m in stops) or any(
        e.get("reason") == "stop_after_steps" for e in events
    )
    inside = [m for m in stops if "stopping inside step 3" in m]
    assert len(inside) == 2, stops
    assert "during the rollout of step 3" in inside[0]
    assert "between its rollout and its update" in inside[1]
    assert sum(e.get("kind") == "resumed" for e in events) == 3
    # Every step trained once, in order, on what the uninterrupted run trained on.
    logged = [r for r in events if r.get("kind") == "train"]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    for ours, theirs in zip(logged, read_metrics(base), strict=True):
        assert ours["batch_id"] == theirs["batch_id"]
        for key in ("loss", "reward", "kl", "rewards/scored/mean", "completions/mean_length"):
            if key in theirs:  # the reward's only where the step sampled (1 and 3)
                assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-9), key
    resumed_weights, base_weights = _weights(legs / "final"), _weights(base / "final")
    assert resumed_weights.keys() == base_weights.keys()
    for name, tensor in base_weights.items():
        assert torch.equal(resumed_weights[name], tensor), name


def test_a_constant_reward_leaves_the_weights_where_they_were(grpo):
    _ok(grpo, "constant")
    train = read_metrics(grpo["root"] / "constant")
    assert "rewards/chess_engine/mean" in train[0]  # the engine judged the moves
    assert all(
        r["reward_std"] == 0 and r["frac_reward_zero_std"] == 1 for r in train if "reward" in r
    )
    start, end = _weights(grpo["model"]), _weights(grpo["root"] / "constant" / "final")
    for name, tensor in end.items():
        assert torch.equal(tensor, start[name]), name


def test_it_learns_a_rewarded_behaviour_on_held_out_prompts(grpo):
    _ok(grpo, "learns")
    train = read_metrics(grpo["root"] / "learns")
    evals = read_metrics(grpo["root"] / "learns", "eval")
    first = train[0]["reward"]  # the first batch's completions, sampled before any update
    assert [e["step"] for e in evals] == [10, 20, 30]
    # About a tenth of the vocabulary is rewarded: the untrained model's share of first tokens.
    assert first < 0.3
    assert evals[-1]["eval_reward"] > max(0.5, 2 * first), (first, evals)
    assert evals[-1]["eval_reward"] > evals[0]["eval_reward"]


def test_a_reward_that_raises_on_one_rank_stops_every_rank_with_its_name(grpo):
    outcome = grpo["results"]["raises"]
    assert outcome["exit_code"] == 2
    tail = outcome["output_tail"]
    assert "The reward function raises_on_rank_1 raised RuntimeError" in tail
    assert "the judge is out to lunch" in tail and "rewards.py:" in tail


def test_a_dying_engine_is_restarted_and_one_that_keeps_dying_saves_and_stops_the_run(grpo):
    """The reward's engine dies once in step 2: restarted, the step goes on, the restart is
    counted in the step's metrics and said in the log. From step 3 on it dies at every search:
    restarted twice on the same position, then the run saves step 3's rollout so far with step
    2's weights and stops, exit 1, with a paragraph that names the engine and what it did (not
    the reward function)."""
    outcome = grpo["results"]["engine_dies"]
    assert outcome["exit_code"] == 1, outcome["output_tail"]
    run = grpo["root"] / "engine_dies"
    first, second = read_metrics(run)
    assert (first["step"], first["engine/restarts"]) == (1, 0)
    assert second["step"] == 2 and second["engine/restarts"] >= 1  # each rank's engine may die
    assert (
        "step 2: chess engine" in outcome["output_tail"] and "restarted" in outcome["output_tail"]
    )
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and status["reason"].startswith("StepFailed")
    message = status["reason"]  # the paragraph the run ended with
    assert f"error: {message.removeprefix('StepFailed: ')}" in outcome["output_tail"]
    assert "The chess engine" in message and "engine_rewards/engine" in message
    assert "failed 3 times in a row" in message and "the process exited" in message
    assert "saved with step 2's weights" in message and "Fix the function" not in message
    assert (run / "checkpoints" / "step_00000002").is_dir()


def test_one_process_samples_scores_and_loses_what_two_do(grpo, tmp_path):
    """The first step of `base` again on one process (in this one): the same completions
    (their rewards and lengths, over the whole batch) and the same first loss."""
    from fsdp_utils.cli import main

    _ok(grpo, "base")
    out = tmp_path / "one"
    args = grpo_args(
        grpo["model"], grpo["prompts"], out, grpo["cache"],
        reward_funcs=f"{grpo['base_rewards']}:scored,chess_format", num_iterations=2,
        beta=0.04, max_training_steps=1, eval_examples=16,
    )  # fmt: skip
    assert main([*args, "--no_final_save"]) == 0
    (one,) = read_metrics(out)
    two = read_metrics(grpo["root"] / "base")[0]
    for key in ("reward", "reward_std", "rewards/scored/mean", "rewards/chess_format/mean",
                "completions/mean_length", "completions/max_length", "frac_reward_zero_std"):  # fmt: skip
        assert one[key] == two[key], key
    assert one["loss"] == pytest.approx(two["loss"], abs=1e-6)
    assert one["batch_id"] == two["batch_id"]
