"""Sequence parallelism (`--sequence_parallel N`, DeepSpeed-Ulysses): each rank's slice of a
batch, the split attention of every family against the unsplit model, what is refused and how,
the planner's view; and, in the slow end-to-end tests, real training runs with N = 2 against
the unsplit run (Llama, Qwen2 with LoRA, Gemma 2 with packed documents, QLoRA, DPO; 2 x 2
processes against 2 data-parallel ones; a resume on another N), all made in three torchruns.

Every rule sequence parallelism rests on (global position ids, labels shifted before the
split, the loss over the global target count) is broken on purpose in
tests/sequence_parallel_probe.py, and the comparison here fails for each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fsdp_utils.config.batch import plan_batch
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import IGNORE_INDEX, SHIFT_LABELS, next_token_labels
from fsdp_utils.data.sequence_slices import describe_padding, slice_batch
from fsdp_utils.parallel.sequence import FORWARD_KEYWORD, SPLIT_FAMILIES, check_splittable
from fsdp_utils.synthetic import (
    TINY_ARCHITECTURES,
    preference_pairs,
    save_chat_model,
    tiny_model_config,
)
from tests.chat_helpers import write_jsonl
from tests.train_helpers import read_metrics, run_finetune, run_script, tiny_args

# --- each rank's slice ---------------------------------------------------------------------


def _batch(length: int = 10, packed: bool = False) -> dict[str, torch.Tensor]:
    ids = torch.arange(100, 100 + 2 * length).reshape(2, length)
    labels = ids.clone()
    labels[0, :3] = IGNORE_INDEX  # a prompt
    out = {"input_ids": ids, "labels": labels}
    if packed:
        positions = torch.arange(length).repeat(2, 1)
        positions[1, 4:] -= 4
        out["position_ids"] = positions
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_the_slices_put_back_together_are_the_batch_shifted_before_the_split(packed):
    batch = _batch(packed=packed)
    slices = [slice_batch(batch, rank=r, size=2) for r in range(2)]
    joined = {key: torch.cat([s[key] for s in slices], dim=1) for key in slices[0]}
    assert torch.equal(joined["input_ids"], batch["input_ids"])
    assert torch.equal(joined["labels"], batch["labels"])
    # global position ids: rank 1's start where rank 0's end (or as the documents say)
    expected = batch.get("position_ids", torch.arange(10).repeat(2, 1))
    assert torch.equal(joined["position_ids"], expected)
    assert slices[1]["position_ids"][0, 0] == 5
    # each position's target is the next token of the whole sequence: the last of rank 0's
    # slice predicts the first of rank 1's, and only the very last position predicts nothing
    assert torch.equal(joined[SHIFT_LABELS][:, :-1], batch["labels"][:, 1:])
    assert (joined[SHIFT_LABELS][:, -1] == IGNORE_INDEX).all()
    assert slices[0][SHIFT_LABELS][0, -1] == batch["input_ids"][0, 5]
    # every target once over the ranks, as the unsplit batch counts them
    counted = sum(int((next_token_labels(s) != IGNORE_INDEX).sum()) for s in slices)
    assert counted == int((next_token_labels(batch) != IGNORE_INDEX).sum())


def test_a_length_that_n_does_not_divide_is_padded_at_the_end():
    batch = _batch(length=9, packed=True)
    slices = [slice_batch(batch, rank=r, size=4) for r in range(4)]
    assert [s["input_ids"].shape[1] for s in slices] == [3, 3, 3, 3]
    last = slices[-1]
    # 3 padding positions: no label, no target, positions continuing the last document's
    assert (last["labels"][:, 0:] == IGNORE_INDEX).sum() == 2 * 3
    assert (last[SHIFT_LABELS] == IGNORE_INDEX).all()
    assert last["position_ids"][1].tolist() == [5, 6, 7]
    assert describe_padding(9, 4) is not None and "padded to 12" in describe_padding(9, 4)
    assert describe_padding(8, 4) is None
    assert slice_batch(batch, rank=0, size=1) is batch  # N = 1: nothing changes


# --- what is refused -----------------------------------------------------------------------


def test_n_must_divide_the_world_size_and_the_message_names_the_valid_values():
    with pytest.raises(ValueError, match=r"does not divide the 6 processes.*1, 2, 3, 6"):
        plan_batch(TrainConfig(sequence_parallel=4, total_batch_size=12), 6)
    plan = plan_batch(TrainConfig(sequence_parallel=2, total_batch_size=8), 4)
    assert (plan.world_size, plan.devices, plan.gradient_accumulation_steps) == (2, 4, 4)
    assert "2 data-parallel groups of 2 devices" in plan.describe()


def test_what_cannot_be_split_is_refused_by_name():
    llama = tiny_model_config("llama", 96, num_heads=4)

    def check(config=llama, size=2, **kw):
        options = {"attn_implementation": "sdpa", "max_seq_length": 64, "world_size": 8, **kw}
        check_splittable(config, size, **options)

    check()  # 4 heads, 2 key-value heads, over 2
    check(size=4)  # key-value heads repeated
    with pytest.raises(ValueError, match=r"does not divide the 4 attention heads.*1, 2, 4"):
        check(size=8)
    with pytest.raises(ValueError, match="flash_attention_2"):
        check(attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="flex_attention"):
        check(attn_implementation="flex_attention")
    other = tiny_model_config("llama", 96)
    other.model_type = "newfamily"
    with pytest.raises(ValueError, match="newfamily models is not known to split"):
        check(other)
    with pytest.raises(ValueError, match=r"padded to 1026.*context length of 1024"):
        check(max_seq_length=1024, size=3, world_size=6)


def test_every_tested_family_is_on_the_list_of_families_that_split():
    names = {tiny_model_config(arch, 96).model_type for arch in TINY_ARCHITECTURES}
    assert names == SPLIT_FAMILIES


def test_preflight_refuses_with_one_paragraph_and_exit_2(tiny_assets, tmp_path):
    base = tiny_args(tiny_assets, tmp_path / "run", tmp_path / "cache")
    result = run_finetune(
        1, [*base, "--preflight", "--world_size", "4", "--sequence_parallel", "3"]
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "--sequence_parallel 3 does not divide the 4 processes" in result.stderr
    assert "Valid values for 4 processes: 1, 2, 4" in result.stderr


# --- split attention, every family (torchrun, 2 processes) ---------------------------------


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict[str, dict[str, float]]:
    out = tmp_path_factory.mktemp("sp_probe") / "probe.json"
    result = run_script(2, "tests/sequence_parallel_probe.py", [str(out)])
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_split_attention_is_the_unsplit_models(probe, arch):
    """Loss and every gradient of the 2 ranks' slices, summed, against the whole batch:
    sliding windows (Mistral, Gemma 2/3, Phi-3, gpt-oss), soft-capping (Gemma 2), sinks
    (gpt-oss), learned positions (GPT-2), routers (the mixtures of experts) included; and with
    packed documents whose position ids restart (gpt-oss ignores them, unsplit or not)."""
    cases = [arch] if arch == "gpt_oss" else [arch, f"{arch} packed"]
    for case in cases:
        result = probe[case]
        assert result["loss"] < 1e-6 and result["grads"] < 1e-5, (case, result)
        assert result["targets"] == result["whole_targets"]


def test_fewer_key_value_heads_than_ranks_are_repeated(probe):
    result = probe["llama 1 kv head"]
    assert result["loss"] < 1e-6 and result["grads"] < 1e-5, result


@pytest.mark.parametrize(
    "mistake",
    ["positions per slice", "labels shifted per slice", "mean of the ranks' means"],
)
def test_each_broken_rule_is_caught(probe, mistake):
    """The same comparison fails by orders of magnitude when a rule is broken: position ids
    restarted per slice (the rotary embeddings), labels shifted per slice (the border's target
    lost), the ranks' mean losses averaged instead of one sum over the global count."""
    result = probe[f"mistake: {mistake}"]
    assert result["grads"] > 1e-2, result
    assert result["loss"] > 1e-5 or result["targets"] != result["whole_targets"], result


def test_a_forward_without_the_keyword_runs_the_inner_kernel():
    """Generation and whole-sequence scoring (the chess evaluation, --sample_prompts) call the
    model without the keyword: the registered implementation then computes what its inner
    kernel computes, padding masks and the KV cache included."""
    from transformers import AutoModelForCausalLM

    from fsdp_utils.parallel.ulysses import use_split_attention

    config = tiny_model_config("llama", 96)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 96, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        assert use_split_attention(model) == "sdpa"
        assert model.config._attn_implementation == "sequence_parallel_sdpa"
        after = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert FORWARD_KEYWORD == "sequence_parallel"


# --- the planner ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """A tiny Llama whose activations at 4,096 tokens are most of its memory."""
    folder = tmp_path_factory.mktemp("long_llama")
    tiny_model_config("llama", 96, hidden_size=64, num_heads=8, max_positions=4096).save_pretrained(
        folder
    )
    return folder


def test_the_plan_divides_the_activations_by_n_and_suggests_the_smallest_n(long_model):
    from fsdp_utils.plan import Margin, plan_memory

    def plan(size: int, gpu_memory: int | None = None, **kw: Any):
        config = TrainConfig(
            model=str(long_model), max_seq_length=4096, total_batch_size=4,
            batch_size_per_device=1, sequence_parallel=size, precision="fp32",
        )  # fmt: skip
        return plan_memory(
            config, nodes=1, gpus_per_node=4, gpu_memory_bytes=gpu_memory,
            margin=Margin(runtime_bytes=0, allocator_fraction=0.0), **kw,
        )  # fmt: skip

    one, two = plan(1), plan(2)
    assert two.batch.sequence_parallel == 2 and two.batch.gradient_accumulation_steps == 2
    # about half: 0.53 here, where the tiny model's per-sequence tensors weigh more than in a
    # large one (the Llama-3-8B shape at 32k: 4.01 against 8.02 GiB, bench/plan_table.py)
    assert two.activation_bytes == pytest.approx(one.activation_bytes / 2, rel=0.1)
    assert two.peak_bytes < one.peak_bytes
    # between what N = 2 and N = 4 need: --plan names 4, the smallest N that fits, and not 2
    four = plan(4)
    budget = (four.required_bytes + two.required_bytes) // 2
    suggested = plan(1, budget)
    assert suggested.fits is False
    fixes = {fix.flags: fix.fits for fix in suggested.fixes}
    assert fixes.get("--sequence_parallel 2") is False
    assert fixes.get("--sequence_parallel 4") is True


# --- end to end: real training runs against the unsplit run --------------------------------

STEPS = 5
# (run name, family, flags): the families of the issue, each with one more thing to split
# exactly: LoRA's adapters (Qwen2), packed documents kept apart (Gemma 2: sliding windows and
# soft-capped attention, eager, tied embeddings), LoRA over a 4-bit base (QLoRA: its NF4 weights
# split over both ranks by FSDP2 with N = 2, held whole by the one unsplit process).
CASES = {
    "llama": ("llama", {}),
    "qwen2 lora": ("qwen2", {"lora": True, "lora_dropout": 0}),
    "gemma2 packed": ("gemma2", {"document_masking": True}),
    "llama qlora": ("llama-256", {"qlora": True, "lora_dropout": 0}),
}
# Models other than a family's tiny one: NF4 quantizes weights of a multiple of 16,384 elements
# (tests/test_qlora.py's model; the 64-wide tiny Llama has none).
MODELS = {"llama-256": {"arch": "llama", "hidden_size": 256, "num_layers": 2, "num_heads": 4}}


def options_for_steps() -> dict[str, Any]:
    """STEPS steps at a constant learning rate, no clipping (the gradients compared are raw)."""
    return {"max_training_steps": STEPS, "warmup_steps": 0, "grad_clip": 0, "no_final_save": True}


def _launch(nproc: int, runs: dict[str, list[str]], root: Path) -> None:
    """tests/sequence_parallel_runs.py on `nproc` processes: each run's gradients and weights."""
    root.mkdir(parents=True, exist_ok=True)
    spec = root / f"runs_{nproc}.json"
    spec.write_text(
        json.dumps([{"name": n, "argv": [str(a) for a in argv]} for n, argv in runs.items()])
    )
    result = run_script(
        nproc, "tests/sequence_parallel_runs.py", [str(spec), str(root)], timeout=900
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


@pytest.fixture(scope="module")
def sp_runs(tiny_assets, tmp_path_factory) -> Path:
    """Every run of the end-to-end checks, in three torchruns (1, 2 and 4 processes)."""
    from transformers import AutoTokenizer

    from fsdp_utils.synthetic import save_tiny_model

    root = tmp_path_factory.mktemp("sp_runs")
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    cache = root / "data_cache"

    def argv(name: str, family: str, **flags: Any) -> list[str]:
        model = tiny_assets["model"] if family == "llama" else root / family
        if family != "llama" and not model.exists():
            save_tiny_model(model, tokenizer, **MODELS.get(family, {"arch": family}))
        options = {**options_for_steps(), "loss_chunk_size": 16, **flags}
        assets = {"model": model, "data": tiny_assets["data"]}
        return tiny_args(assets, root / name, cache, **options)

    one = {name: argv(name, family, **flags) for name, (family, flags) in CASES.items()}
    two = {f"{name} sp2": argv(f"{name} sp2", family, sequence_parallel=2, **flags)
           for name, (family, flags) in CASES.items()}  # fmt: skip
    # DPO (IPO's loss: length-averaged log-probabilities, so the answers' token counts are summed
    # over the slices too) on chat pairs, the reference cached before the first step: each run
    # computes its own cache (its own data folder), the split one over its slices. The pairs'
    # sequences take 4 to 13 tokens: slices of 8 cut half of them, their answers mostly in
    # the second slice.
    pairs = {"model": save_chat_model(root / "chat", "chatml"),
             "data": write_jsonl(root / "prefs.jsonl", preference_pairs(120))}  # fmt: skip
    for name, table, extra in (("dpo", one, {}), ("dpo sp2", two, {"sequence_parallel": 2})):
        table[name] = tiny_args(
            pairs, root / name, root / f"{name} data", max_seq_length=16, method="dpo",
            dpo_loss="ipo", eval_examples=16, **{**options_for_steps(), **extra},
        )  # fmt: skip
    two["llama dp2"] = argv("llama dp2", "llama")
    # A leg of 2 steps with N = 2, then the rest resumed with N = 1 (same folder), as after a
    # time limit: --stop_after_steps saves and stops the way the time limit does.
    two["resume sp2"] = argv("resume", "llama", sequence_parallel=2, stop_after_steps=2)
    two["resume dp2"] = argv("resume", "llama")
    _launch(1, one, root)
    _launch(2, two, root)
    _launch(4, {"llama 2x2": argv("llama 2x2", "llama", sequence_parallel=2)}, root)
    return root


def _probe(root: Path, name: str) -> dict[str, Any]:
    return torch.load(root / f"{name}.pt")


def _same_run(root: Path, name: str, reference: str, *, folder: str | None = None) -> None:
    """Losses, first-step gradients, weights after the last step and the final eval of run
    `name` against run `reference`."""
    got, want = _probe(root, name), _probe(root, reference)
    losses = [r["loss"] for r in read_metrics(root / (folder or name))]
    expected = [r["loss"] for r in read_metrics(root / reference)]
    assert len(losses) == len(expected) == STEPS
    assert losses[0] == pytest.approx(expected[0], rel=1e-6)
    assert losses == pytest.approx(expected, rel=1e-5)
    batches = [r["batch_id"] for r in read_metrics(root / (folder or name))]
    assert batches == [r["batch_id"] for r in read_metrics(root / reference)]
    assert got["grads"].keys() == want["grads"].keys() and want["grads"]
    for key, grad in want["grads"].items():
        error = float((got["grads"][key] - grad).norm() / grad.norm().clamp_min(1e-12))
        assert error < 1e-5, (key, error)
    assert got["state"].keys() == want["state"].keys()
    for key, weight in want["state"].items():
        torch.testing.assert_close(got["state"][key], weight, rtol=0, atol=1e-4, msg=key)
    evals = [read_metrics(root / r, "eval")[-1]["eval_loss"] for r in (folder or name, reference)]
    assert evals[0] == pytest.approx(evals[1], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_with_n_2_train_as_one_unsplit_process(sp_runs, case):
    _same_run(sp_runs, f"{case} sp2", case)
    config = json.loads((sp_runs / f"{case} sp2" / "config.json").read_text())
    assert config["config"]["sequence_parallel"] == 2


@pytest.mark.slow
def test_dpo_splits_both_sequences_of_a_pair_alike(sp_runs):
    """DPO on 2 processes with N = 2 against one unsplit process: a pair's loss is computed on
    the group's first rank from the log-probabilities summed over the slices, its pairs counted
    once; the reference cache computed over slices holds the unsplit run's values."""
    lengths = np.load(next((sp_runs / "dpo sp2 data").rglob("train_lengths.npy")))
    assert (lengths > 8).mean() > 0.3  # the slices' border cuts sequences, answers included
    _same_run(sp_runs, "dpo sp2", "dpo")
    caches = [sorted((sp_runs / f"{name} data").rglob("logps.npz")) for name in ("dpo", "dpo sp2")]
    assert all(len(found) == 1 for found in caches), caches
    one, two = (np.load(found[0]) for found in caches)
    assert np.array_equal(one["rows"], two["rows"])
    np.testing.assert_allclose(two["logps"], one["logps"], rtol=1e-5)


@pytest.mark.slow
def test_2_x_2_processes_train_as_2_data_parallel_ones(sp_runs):
    """Both read the same sequences per data-parallel rank (the eval split's too: it is
    divided among the data-parallel ranks, 2 here and 1 in the unsplit runs)."""
    _same_run(sp_runs, "llama 2x2", "llama dp2")


@pytest.mark.slow
def test_a_run_resumes_on_another_n_where_it_stopped(sp_runs):
    """The checkpoint of an N = 2 leg continues with N = 1: the same data order, losses and
    weights as the uninterrupted unsplit run (the checkpoint holds nothing of N)."""
    legs = read_metrics(sp_runs / "resume")
    reference = read_metrics(sp_runs / "llama")
    assert [r["step"] for r in legs] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in legs] == pytest.approx([r["loss"] for r in reference], rel=1e-5)
    assert [r["batch_id"] for r in legs] == [r["batch_id"] for r in reference]
    assert read_metrics(sp_runs / "resume", "resumed")[0]["step"] == 2
    final, want = _probe(sp_runs, "resume dp2")["state"], _probe(sp_runs, "llama")["state"]
    for key, weight in want.items():
        torch.testing.assert_close(final[key], weight, rtol=0, atol=1e-4, msg=key)
