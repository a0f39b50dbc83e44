"""DPO (fsdp_utils/preference/): the loss against TRL's formula, and real 2-process FSDP2 runs
(gloo) against a single-process eager DPO, the LoRA reference against the base model, a
learnable preference set, and the reference cache across world sizes against a live reference.

One torchrun (`probe_runs`, through tests/trainer_runs.py) feeds most checks; the cache
across world sizes takes two more (`cache_runs`, slow).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import IGNORE_INDEX
from fsdp_utils.data.preference import PAIR_ROWS
from fsdp_utils.methods.dpo.loss import DpoSettings, dpo_loss
from fsdp_utils.metrics.plot import RunCurves, plot_runs
from fsdp_utils.synthetic import preference_pairs, save_chat_model
from tests.chat_helpers import write_jsonl
from tests.train_helpers import check_ok, read_metrics, run_script, tiny_args

# --- TRL's DPO loss, copied as the independent reference -------------------------------------
# From https://github.com/huggingface/trl/blob/v1.16.0/trl/trainer/dpo_trainer.py
# (DPOTrainer._compute_loss; f_divergence_type "reverse_kl", precomputed reference log-probs),
# the lines that turn the sequence log-probabilities into the loss and the rewards, unchanged but
# for `self.` and the removed branches. TRL itself is not a test dependency: its datasets>=4.7
# cannot install beside the datasets floor (3.0) that `make test-floor` tests. These lines were
# checked against trl 1.16.0's own _compute_loss when they were copied.


def trl_dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
    loss_type: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_scores = chosen_logratios
    rejected_scores = rejected_logratios
    delta_score = chosen_scores - rejected_scores
    if loss_type == "sigmoid":
        per_sequence_loss = -F.logsigmoid(beta * delta_score)
    elif loss_type == "ipo":
        chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
        chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
        rejected_avg_score = rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0)
        ipo_delta = chosen_avg_score - rejected_avg_score
        per_sequence_loss = (ipo_delta - 1 / (2 * beta)) ** 2
    loss = per_sequence_loss.mean()
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    metrics = {
        "rewards/chosen": chosen_rewards.mean().item(),
        "rewards/rejected": rejected_rewards.mean().item(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
    }
    return loss, metrics


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_the_loss_and_rewards_equal_trls(loss_type):
    gen = torch.Generator().manual_seed(0)
    pairs, seq = 16, 12
    completion_mask = (torch.rand(2 * pairs, seq, generator=gen) < 0.6).float()
    completion_mask[:, 0] = 1  # every answer has a token
    tokens = completion_mask.sum(dim=1)
    policy = -torch.rand(2 * pairs, generator=gen, dtype=torch.float64) * tokens * 3
    reference = policy - torch.randn(2 * pairs, generator=gen, dtype=torch.float64)
    settings = DpoSettings(beta=0.3, loss_type=loss_type)
    expected, trl_metrics = trl_dpo_loss(
        policy[:pairs], policy[pairs:], reference[:pairs], reference[pairs:],
        completion_mask, settings.beta, loss_type,
    )  # fmt: skip
    # Ours takes the length-averaged log-probabilities for IPO (PairLoss divides them)
    ours_policy = policy / tokens if settings.averaged else policy
    ours_ref = reference / tokens if settings.averaged else reference
    losses, chosen, rejected = dpo_loss(
        ours_policy[:pairs], ours_policy[pairs:], ours_ref[:pairs], ours_ref[pairs:], settings
    )
    assert losses.mean().item() == pytest.approx(expected.item(), rel=1e-12, abs=1e-12)
    if loss_type == "sigmoid":  # TRL's rewards are on the summed log-probabilities
        assert chosen.mean().item() == pytest.approx(trl_metrics["rewards/chosen"], abs=1e-12)
        assert rejected.mean().item() == pytest.approx(trl_metrics["rewards/rejected"], abs=1e-12)
        accuracy = (chosen > rejected).double().mean().item()
        assert accuracy == pytest.approx(trl_metrics["rewards/accuracies"])


def test_label_smoothing_is_conservative_dpo():
    # cDPO (Mitchell, 2023), as TRL's sigmoid loss had it: a fraction eps of flipped labels
    logits = torch.linspace(-3, 3, 7, dtype=torch.float64)
    zero = torch.zeros_like(logits)
    losses, _, _ = dpo_loss(logits, zero, zero, zero, DpoSettings(0.5, "sigmoid", 0.2))
    expected = -F.logsigmoid(0.5 * logits) * 0.8 - F.logsigmoid(-0.5 * logits) * 0.2
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-15)


# --- real runs --------------------------------------------------------------------------------

TRAIN = {
    "max_seq_length": 32, "total_batch_size": 8, "batch_size_per_device": 2,
    "learning_rate": 3e-3, "eval_examples": 40, "eval_batches": 10, "method": "dpo",
}  # fmt: skip


@pytest.fixture(scope="module")
def pref_assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("preference")
    model = save_chat_model(root / "model", "chatml")
    data = write_jsonl(root / "prefs.jsonl", preference_pairs(300))
    return {"model": model, "data": data, "root": root}


def _args(assets: dict[str, Path], out: Path, **overrides: Any) -> list[str]:
    options = {**TRAIN, **overrides}
    return tiny_args(assets, out, assets["root"] / "data_cache", **options)


def _torchrun(nproc: int, runs: list[dict[str, Any]], root: Path) -> subprocess.CompletedProcess:
    root.mkdir(parents=True, exist_ok=True)
    (root / "runs.json").write_text(json.dumps(runs, default=str))
    result = run_script(nproc, "tests/trainer_runs.py", [str(root / "runs.json")])
    check_ok(result)
    return result


@pytest.fixture(scope="module")
def probe_runs(pref_assets) -> dict[str, Path]:
    """One torchrun of 2 processes: the step probe (full fine-tuning, cached reference), the LoRA
    probe, and a 30-step run on the learnable set."""
    root = pref_assets["root"] / "probe"
    out = {"step": root / "step.pt", "lora": root / "lora.pt", "learn": root / "learn"}
    runs = [
        {"args": _args(pref_assets, root / "step_run"), "dpo_probe": "step", "out": out["step"]},
        {
            "args": _args(pref_assets, root / "lora_run", lora=True, lora_dropout=0),
            "dpo_probe": "lora",
            "out": out["lora"],
        },
        {"args": _args(pref_assets, out["learn"], max_training_steps=30, total_batch_size=16,
                       batch_size_per_device=4, eval_every=30)},
    ]  # fmt: skip
    _torchrun(2, runs, root)
    return out


@pytest.mark.slow
def test_the_first_step_loss_is_ln2(probe_runs):
    # policy = reference: every pair's logits are 0, whatever the data
    first = torch.load(probe_runs["step"])["first_loss"]
    assert first == pytest.approx(math.log(2), abs=1e-6)


def _eager_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed log-probabilities of the answer tokens from the full logits (no chunks, no FSDP)."""
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    picked = torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    return picked.masked_fill(labels == IGNORE_INDEX, 0.0).sum(dim=1)


@pytest.mark.slow
def test_loss_and_gradients_equal_an_eager_dpo_on_one_process(probe_runs, pref_assets):
    """2 processes, FSDP2, chunked loss, cached reference, after two real steps (the policy is
    no longer the reference) == one process, eager, full logits, the DPO formula by hand."""
    probe = torch.load(probe_runs["step"])
    policy = AutoModelForCausalLM.from_pretrained(pref_assets["model"], dtype=torch.float32)
    policy.load_state_dict(probe["state"])
    reference = AutoModelForCausalLM.from_pretrained(pref_assets["model"], dtype=torch.float32)
    policy.eval()  # the trainer's model trains, but the tiny Llama has no dropout
    losses = []
    for batch in probe["batches"]:
        pairs = batch[PAIR_ROWS].numel()
        logps = _eager_logps(policy, batch)
        with torch.no_grad():
            ref = _eager_logps(reference, batch)
        logits = (logps[:pairs] - logps[pairs:]) - (ref[:pairs] - ref[pairs:])
        losses.append(-F.logsigmoid(probe["beta"] * logits))
    loss = torch.cat(losses).mean()
    loss.backward()
    assert loss.item() == pytest.approx(probe["loss"], abs=1e-5)
    assert loss.item() != pytest.approx(math.log(2), abs=1e-4)  # the policy has moved
    grads = {name: p.grad for name, p in policy.named_parameters() if p.grad is not None}
    assert set(grads) == set(probe["grads"])
    for name, grad in grads.items():
        torch.testing.assert_close(probe["grads"][name], grad, rtol=0, atol=1e-5, msg=name)
    assert max(g.abs().max().item() for g in grads.values()) > 1e-3  # not all zero


@pytest.mark.slow
def test_the_lora_reference_is_the_base_model_exactly(probe_runs):
    probe = torch.load(probe_runs["lora"])
    assert torch.equal(probe["reference"], probe["base"])
    assert not torch.allclose(probe["policy"], probe["base"])  # the adapters did train


@pytest.mark.slow
def test_a_learnable_preference_set_is_learned(probe_runs, pref_assets):
    out = probe_runs["learn"]
    evals = read_metrics(out, "eval")
    assert evals[-1]["eval_rewards/accuracies"] > 0.9, evals
    train = read_metrics(out)
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected"} <= set(train[-1])  # fmt: skip
    assert train[-1]["loss"] < math.log(2) - 0.1
    # The run's plot draws its DPO metrics as logged, train and eval split.
    _, drawn = plot_runs([RunCurves.load(out, "learn")])
    lines = {d.series: d.points() for d in drawn}
    for field in ("rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert lines[field] == [(r["step"], r[field]) for r in train]
        assert lines[f"eval_{field}"] == [(r["step"], r[f"eval_{field}"]) for r in evals]
    # The exported model, through transformers alone: on the held-out pairs its implicit reward
    # beta (log p - log p_ref) prefers the chosen answer.
    from fsdp_utils.data.prepare import PreparedData

    config = json.loads((out / "config.json").read_text())
    prepared = PreparedData.load(Path(config["resolved"]["prepared_data"]))
    held_out = prepared.split("eval")
    batch = held_out.batch(np.arange(len(held_out)))
    trained = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(pref_assets["model"], dtype=torch.float32)
    with torch.no_grad():
        gain = _eager_logps(trained, batch) - _eager_logps(base, batch)
    pairs = len(held_out)
    preferred = (gain[:pairs] > gain[pairs:]).double().mean().item()
    assert pairs >= 30 and preferred >= 0.9, preferred


@pytest.mark.slow
def test_a_cache_written_on_4_processes_reads_on_2_and_equals_the_live_reference(pref_assets):
    """The cache written on 4 processes, read on 2: the losses of 20 steps equal those of a
    live reference. A run stopped at step 8 whose cache is then deleted resumes on 1 process,
    computes the cache again from the starting weights, and ends with the same losses."""
    root = pref_assets["root"] / "cache"
    # Its own data cache: the cache of the other runs (written on 2 processes) is not reused
    steps = {"max_training_steps": 20, "log_every": 1, "data_cache_dir": root / "data"}
    four = _args(pref_assets, root / "four", batch_size_per_device=1, max_training_steps=2,
                 data_cache_dir=root / "data")  # fmt: skip
    _torchrun(4, [{"args": four}], root / "w4")
    split = _args(pref_assets, root / "split", stop_after_steps=8, **steps)
    runs = [
        {"args": _args(pref_assets, root / "cached", **steps)},
        {"args": _args(pref_assets, root / "live", reference="live", **steps)},
        {"args": split},
    ]
    _torchrun(2, runs, root / "w2")
    cached, live = read_metrics(root / "cached"), read_metrics(root / "live")
    assert len(cached) == len(live) == 20
    losses = [r["loss"] for r in cached]
    np.testing.assert_allclose(losses, [r["loss"] for r in live], rtol=0, atol=1e-6)
    assert losses[-1] < losses[0]
    caches = list((root / "data").glob("*/reference/*/meta.json"))
    assert len(caches) == 1 and json.loads(caches[0].read_text())["world_size"] == 4

    assert json.loads((root / "split" / "status.json").read_text())["step"] == 8
    shutil.rmtree(caches[0].parent)
    _torchrun(1, [{"args": _args(pref_assets, root / "split", **steps)}], root / "w1")
    resumed = read_metrics(root / "split")
    assert [r["batch_id"] for r in resumed] == [r["batch_id"] for r in cached]
    np.testing.assert_allclose([r["loss"] for r in resumed], losses, rtol=1e-5, atol=1e-6)
    assert json.loads(next((root / "data").glob("*/reference/*/meta.json")).read_text()) == {
        "pairs": 300, "world_size": 1
    }  # fmt: skip


@pytest.mark.slow
def test_a_stop_in_the_reference_pass_keeps_its_pairs_and_the_next_leg_goes_on(pref_assets):
    """The time limit's stop file comes after 2 reference batches on each of 2 ranks (written
    by the test's hook, whatever the machine's load): the leg ends before its first step,
    "interrupted" (the sbatch script requeues such a leg), its 8 pairs kept. The next leg
    computes only the other 292, and trains as a run whose cache was computed in one go."""
    root = pref_assets["root"] / "stop"
    steps = {"max_training_steps": 3, "log_every": 1}
    split = _args(pref_assets, root / "split", data_cache_dir=root / "data", **steps)
    whole = _args(pref_assets, root / "whole", data_cache_dir=root / "whole_data", **steps)
    early = _args(pref_assets, root / "early", data_cache_dir=root / "early_data", **steps)
    runs = [
        {"args": split, "stop_after_reference_batches": 2}, {"args": split}, {"args": whole},
        # issue 47's requeue defect: stops before any work, then before the first pair
        {"args": early, "stop_at_start": True},
        {"args": early, "stop_after_reference_batches": 0},
        {"args": early},
    ]  # fmt: skip
    out = _torchrun(2, runs, root / "w2").stdout
    assert "dpo: the reference pass stopped at 8 of 300 pairs; they are kept" in out
    assert "stopping before the first step: stop file during --method dpo's work" in out
    assert "dpo: 8 pairs' reference log-probabilities kept by an earlier leg" in out
    assert "computing the other 292" in out
    records = read_metrics(root / "split", None)
    kinds = [r["kind"] for r in records if r["kind"] in ("stopping", "start", "train")]
    assert kinds == ["stopping", "start", "train", "train", "train"]
    assert records[[r["kind"] for r in records].index("stopping")]["reason"] == "stop file"
    tables = []
    for data in ("data", "whole_data"):
        (cache,) = (root / data).glob("*/reference/*/logps.npz")
        with np.load(cache) as saved:
            tables.append((saved["rows"], saved["logps"]))
        assert not list((root / data).glob("*/reference/*.partial.npz"))
    np.testing.assert_array_equal(tables[0][0], tables[1][0])
    np.testing.assert_allclose(tables[0][1], tables[1][1], rtol=0, atol=1e-5)
    resumed, whole_run = read_metrics(root / "split"), read_metrics(root / "whole")
    assert [r["batch_id"] for r in resumed] == [r["batch_id"] for r in whole_run]
    np.testing.assert_allclose(
        [r["loss"] for r in resumed], [r["loss"] for r in whole_run], rtol=0, atol=1e-6
    )
    _check_the_early_stops(root, out, whole_run)


def _check_the_early_stops(root: Path, out: str, whole_run: list[dict[str, Any]]) -> None:
    """The stop file before the run started: the leg ends before the data and the model, both
    ranks return (torchrun goes on to the next run), "interrupted", the stop file consumed. Then
    written as the reference pass begins: it stops before its first pair, nothing kept. The
    third leg computes every pair and trains as the run whose cache was made in one go."""
    started = out.index("stopping before the first step: stop file during the start, before")
    assert started < out.index(f"data: preparing 1 file(s) -> {root / 'early_data'}")
    assert "dpo: the reference pass stopped before its first pair" in out
    early = root / "early"
    records = read_metrics(early, None)
    stops = [r for r in records if r["kind"] == "stopping"]
    assert [r["reason"] for r in stops] == ["stop file", "stop file"]
    kinds = [r["kind"] for r in records if r["kind"] in ("stopping", "start", "train")]
    assert kinds == ["stopping", "stopping", "start", "train", "train", "train"]
    assert not (early / "STOP").exists()
    assert not list((root / "early_data").glob("*/reference/*.partial.npz"))
    trained = read_metrics(early)
    assert [r["batch_id"] for r in trained] == [r["batch_id"] for r in whole_run]
    np.testing.assert_allclose(
        [r["loss"] for r in trained], [r["loss"] for r in whole_run], rtol=0, atol=1e-6
    )
    assert json.loads((early / "status.json").read_text())["status"] == "completed"


@pytest.mark.slow
def test_the_planner_plans_a_dpo_step(tmp_path):
    """Two sequences per pair: more activations than the same batch of sequences; the live
    reference adds a sharded copy of the parameters, the cache nothing."""
    from fsdp_utils.plan import plan_memory
    from fsdp_utils.plan.report import Margin
    from fsdp_utils.synthetic import tiny_model_config

    tiny_model_config("llama", vocab_size=512).save_pretrained(tmp_path)

    def plan(**overrides):
        config = TrainConfig(model=str(tmp_path), total_batch_size=8, batch_size_per_device=2,
                             max_seq_length=64, **overrides)  # fmt: skip
        return plan_memory(config, nodes=1, gpus_per_node=2, gpu_memory_bytes=None,
                           margin=Margin(runtime_bytes=0, allocator_fraction=0.0))  # fmt: skip

    sft, cached, live = plan(), plan(method="dpo"), plan(method="dpo", reference="live")
    assert cached.batch.tokens_per_step == 2 * sft.batch.tokens_per_step
    assert cached.activation_bytes > 1.2 * sft.activation_bytes  # the tiny model: 1.32x
    assert cached.breakdown.parameters == sft.breakdown.parameters
    assert live.breakdown.parameters == pytest.approx(2 * cached.breakdown.parameters, rel=0.01)
