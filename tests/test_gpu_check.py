"""The GPU validation kit's logic, on CPU: no GPU is at hand in CI (bench/gpu_check.py), and the
carried wheels' tooling (bench/device_stack.py) on wheels built here."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from unittest import mock

import pytest

from tests.prefork import launch
from tests.train_helpers import bench_module

REPO = Path(__file__).resolve().parent.parent

kit = bench_module("gpu_check")
stack = bench_module("device_stack")


def test_shapes_have_the_sizes_they_are_named_after() -> None:
    # Count against transformers itself on meta (no memory), not against our own formula.
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    for name, low, high in [("1b", 1.0e9, 1.2e9), ("3b", 2.8e9, 3.4e9), ("8b", 7.0e9, 8.1e9)]:
        shape = kit.SHAPES[name]
        config = LlamaConfig(
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads,
            vocab_size=shape.vocab,
            tie_word_embeddings=False,
        )
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        real = sum(p.numel() for p in model.parameters())
        assert real == shape.parameters(), name
        assert low < real < high, (name, real)


def test_the_rows_are_the_measurements_issue_43_asks_for() -> None:
    rows = {r.name: r for r in kit.ROWS}
    small = [r for r in rows.values() if r.kind == "train" and r.role == "small"]
    assert {r.seq for r in small} == {2048}
    flags = {r.name: set(r.flags) for r in small}
    assert "--gradient_checkpointing" not in flags["1b-bf16"]
    assert "--gradient_checkpointing" in flags["1b-bf16-ac"]
    assert "--cpu_offload" in flags["1b-bf16-offload"]
    assert all({"--precision", "bf16-mixed"} <= flags[n] for n in ("1b-bf16", "1b-bf16-ac"))
    lora = rows["8b-lora-4k"]
    assert (lora.role, lora.seq, "--lora" in lora.flags) == ("large", 4096, True)
    long = rows["8b-lora-32k"]
    assert (long.role, long.seq) == ("large", 32768)
    qlora = rows["8b-qlora-4k"]
    assert qlora.flags[-3:] == kit.QLORA and qlora.seq == 4096
    kinds = {"train", "best", "auto", "checkpoint", "masking", "evaluate", "grpo", "distill"}
    assert {r.kind for r in rows.values()} == kinds
    grpo = rows["1b-grpo"]  # issue 50's: GRPO on the 1B shape with G = 8
    assert grpo.role == "small" and grpo.flags[grpo.flags.index("--num_generations") + 1] == "8"
    distill = rows["1b-distill"]  # issue 63's: a 1B student, the 8B shape its NF4 teacher
    assert distill.roles == ("small", "large") and "nf4" in distill.flags
    # The checkpoint row comes before the evaluation of its export.
    names = list(rows)
    assert names.index("1b-checkpoint") < names.index("1b-evaluate")


# Issue 60's A/B rows, in its order (the attention kernels, the world-size-1 pair and the
# float8 pair each a group), then what the issue names beside them.
ISSUE_60 = [
    "1b-mb8-compile", "1b-mb16-compile", "1b-fused-adamw", "1b-sdpa-cudnn", "1b-sdpa-flash",
    "1b-sdpa-efficient", "1b-loss-2097", "1b-direct", "1b-reshard-last", "1b-sync-free",
    "1b-float8-rowwise", "1b-float8-tensorwise", "1b-compile-model", "1b-liger", "1b-ac-op",
]  # fmt: skip


def test_the_rows_follow_issue_63s_order() -> None:
    """The quick rows (the first profiled), issue 60's A/B rows against the compiled 1.1B row,
    the best combination, --auto's rows after the hand rows they are measured beside, GRPO and
    distillation, then the first call's rows."""
    names = [r.name for r in kit.ROWS]
    rows = {r.name: r for r in kit.ROWS}
    assert names[:3] == ["1b-bf16", "1b-bf16-ac", "1b-bf16-compile"]
    assert names[3 : 3 + len(ISSUE_60)] == ISSUE_60
    after = names[3 + len(ISSUE_60) :]
    assert after[:6] == [
        "1b-best",
        "1b-auto",
        "8b-lora-4k",
        "8b-lora-auto",
        "1b-grpo",
        "1b-distill",
    ]
    assert rows["1b-bf16"].profile_step and rows["1b-best"].profile_step
    assert rows["1b-bf16"].priority == rows["1b-best"].priority == rows["1b-auto"].priority == 1
    for name in ISSUE_60:
        row = rows[name]
        ref = rows[row.ref]
        assert names.index(row.ref) < names.index(name), name  # measured before, as its base
        assert (row.steps, row.timed_steps, row.log_every) == (25, 15, 5), name
        assert (row.lever and row.adds) or row.batch != ref.batch, name
        # its flags are its reference's, less what it drops, with what it adds
        assert row.flags == (*[f for f in ref.flags if f not in row.drops], *row.adds), name
        # the timed window starts after the profiled step and the compilation
        assert row.steps - row.timed_steps >= kit.gpu_rows.PROFILED_STEP
    assert {rows[n].lever for n in ISSUE_60} - {"checkpointing"} == set(kit.gpu_rows.LEVER_GROUPS)
    assert rows["1b-mb16-compile"].batch == 16 and "--compile" in rows["1b-mb16-compile"].flags
    assert "--gradient_checkpointing" not in rows["1b-mb16-compile"].flags
    assert "--compile" not in rows["1b-liger"].flags  # liger-kernel beside compile, not with it
    for auto in ("1b-auto", "8b-lora-auto"):
        row = rows[auto]
        assert row.kind == "auto" and row.batch == 0 and row.ref in names[: names.index(auto)]
        # --auto chooses these: given, they would be kept (docs/plan.md, "--auto")
        assert not {"--gradient_checkpointing", "--compile"} & set(row.flags)
    assert rows["1b-auto"].total_batch == rows["1b-mb16-compile"].batch


def test_quick_is_the_five_most_promising_levers_with_their_base_and_combination() -> None:
    quick = kit.select_rows(kit.ROWS, quick=True)
    levers = [r.name for r in quick if r.ref]
    assert levers == [
        "1b-mb16-compile", "1b-fused-adamw", "1b-sdpa-cudnn", "1b-direct", "1b-sync-free",
        "1b-best",
    ]  # fmt: skip
    assert quick[0].name == "1b-bf16-compile"


def test_the_prepared_call_runs_the_most_important_rows_first_within_its_budget() -> None:
    """By the estimates (the first H100 call's wall times): every row of priority 1 runs, the
    call ends within the default budget with some slack for the last row (1b-auto), and the
    call's timeout_s 570 keeps at least 15 s beyond the budget for the interpreter and the last
    writes; the skipped rows say why, naming the rows kept; --quick fits what 15 minutes leave
    after a failed first try."""
    plan = kit.gpu_rows.schedule(kit.select_rows(kit.ROWS), kit.DEFAULT_BUDGET_S)
    ran = [row for row, start, _ in plan if start is not None]
    assert {r.name for r in ran} >= {r.name for r in kit.ROWS if r.priority == 1}
    assert ran[-1].name == "1b-auto"
    end = max(start + row.estimate_s for row, start, _ in plan if start is not None)
    assert end <= kit.DEFAULT_BUDGET_S - 15
    assert kit.DEFAULT_BUDGET_S <= kit.gpu_rows.CALL_TIMEOUT_S - 15 == 570 - 15
    starts = [start for _, start, _ in plan if start is not None]
    assert starts == sorted(starts)  # in the rows' order
    reasons = {row.name: reason for row, _, reason in plan}
    assert "kept for the more important rows after it" in reasons["1b-mb8-compile"]
    assert "1b-best" in reasons["1b-mb8-compile"]
    assert all(reason for row, start, reason in plan if start is None)
    quick = kit.select_rows(kit.ROWS, quick=True)
    assert all(start is not None for _, start, _ in kit.gpu_rows.schedule(quick, 420))
    assert kit.estimate_s(quick) <= 900 - 60 - 120 - 60 - 60  # a start, a failed try, a start


def test_the_budget_keeps_time_for_the_more_important_rows_and_learns_its_pace() -> None:
    rows = {r.name: r for r in kit.ROWS}
    budget = kit.Budget(300)
    later = [rows["1b-best"], rows["1b-auto"], rows["1b-ac-op"]]
    kept = rows["1b-best"].estimate_s + rows["1b-auto"].estimate_s  # not the less important
    lever = rows["1b-loss-2097"]  # priority 3: waits for the two of priority 1
    left = lever.estimate_s + kept - 1
    reason = budget.skip_reason(lever, later, elapsed=300 - left, written={"small"})
    assert reason and f"{kept:.0f} s are kept" in reason and "1b-best, 1b-auto" in reason
    assert budget.skip_reason(rows["1b-best"], later, elapsed=300 - left, written={"small"}) is None
    # weights not yet written count with the row
    weights = budget.skip_reason(rows["8b-lora-4k"], [], elapsed=300 - 60, written={"small"})
    assert f"about {rows['8b-lora-4k'].estimate_s + kit.gpu_rows.LARGE_WEIGHTS_S:.0f} s" in weights
    # rows running at 0.7 of their estimates: the same row fits
    for row in (rows["1b-bf16"], rows["1b-bf16-ac"], rows["1b-bf16-compile"]):
        budget.ran(row, 0.7 * row.estimate_s)
    assert budget.scale == pytest.approx(0.7)
    assert budget.skip_reason(lever, later, elapsed=300 - left, written={"small"}) is None
    budget.ran(rows["1b-bf16"], 100 * rows["1b-bf16"].estimate_s)
    budget.ran(rows["1b-bf16"], 100 * rows["1b-bf16"].estimate_s)
    budget.ran(rows["1b-bf16"], 100 * rows["1b-bf16"].estimate_s)
    assert budget.scale == 1.5  # bounded: one slow row does not stop the call
    assert kit.Budget(0).skip_reason(lever, later, elapsed=1e9, written=set()) is None


def _measured(**tokens: float) -> dict[str, dict[str, object]]:
    return {
        name.replace("_", "-"): {"status": "ok", "tokens_per_s_per_gpu": value}
        for name, value in tokens.items()
    }


def test_the_best_combination_takes_each_levers_winner_from_the_measured_rows() -> None:
    from fsdp_utils.config.parse import parse_config

    measured = _measured(
        **{"1b_bf16_compile": 40_000, "1b_mb8_compile": 44_000, "1b_mb16_compile": 46_000},
        **{"1b_fused_adamw": 41_200, "1b_sdpa_cudnn": 40_300, "1b_sdpa_flash": 42_000},
        **{"1b_direct": 41_600, "1b_reshard_last": 42_400, "1b_float8_rowwise": 36_000},
        **{"1b_sync_free": 40_700, "1b_liger": 30_000, "1b_ac_op": 60_000},
    )
    measured["1b-loss-2097"] = {"status": "skipped", "reason": "the budget"}
    best = kit.best_combination(kit.ROWS, measured)
    assert best.batch == 16
    assert best.flags == (
        "--precision", "bf16-mixed", "--compile", "--fused_optimizer", "--sdpa_backend", "flash",
        "--reshard_last_layer",
    )  # fmt: skip
    notes = "\n".join(best.notes)
    assert (
        "micro-batch 16" in notes
        and "optimizer: 1b-fused-adamw joins (1b-fused-adamw +3.0%)" in notes
    )
    assert "sync-free: none joins, under +2% (1b-sync-free +1.8%)" in notes
    assert "loss chunk: not measured (1b-loss-2097 skipped)" in notes
    assert "checkpointing" not in notes  # the best combination checkpoints nothing
    parse_config(["--model", "m", "--dataset", "d", *best.flags])  # a command that parses
    # liger-kernel faster than the compiler: it replaces --compile, float8 and the whole-model
    # scope (measured compiled) leave with it
    measured.update(_measured(**{"1b_liger": 44_000, "1b_float8_rowwise": 44_000}))
    measured.update(_measured(**{"1b_compile_model": 43_000}))
    best = kit.best_combination(kit.ROWS, measured)
    assert "--compile" not in best.flags and "--liger_kernels" in best.flags
    assert "--float8" not in best.flags and "--compile_scope" not in best.flags
    assert any("float8: leaves with --compile" in n for n in best.notes)
    # nothing measured: the base as it is
    assert kit.best_combination(kit.ROWS, {}).flags == kit.gpu_rows.BASE_FLAGS


def test_only_selects_rows_in_order_and_names_a_typo() -> None:
    chosen = kit.select_rows(kit.ROWS, only="8b-lora-32k,1b-bf16")
    assert [r.name for r in chosen] == ["1b-bf16", "8b-lora-32k"]
    with pytest.raises(ValueError, match=r"unknown row\(s\) \['8b-lora'\]"):
        kit.select_rows(kit.ROWS, only="8b-lora")


def test_rows_are_skipped_with_their_reason() -> None:
    rows = {r.name: r for r in kit.ROWS}
    small = {"small"}
    assert kit.Budget(100).skip_reason(rows["1b-bf16"], [], elapsed=0, written=small) is None
    assert "budget" in kit.Budget(10).skip_reason(rows["1b-bf16"], [], elapsed=0, written=small)
    weights = kit.Budget(50).skip_reason(rows["8b-lora-4k"], [], elapsed=0, written=small)
    assert "about 76 s" in weights  # 40 s of row + 36 s of weights (LARGE_WEIGHTS_S)
    for name in ("1b-sdpa-cudnn", "1b-sdpa-efficient", "1b-liger"):  # a dry run says why not
        assert kit.static_skip(rows[name], device="cpu").startswith("GPU only: ")
    assert kit.static_skip(rows["1b-sdpa-flash"], device="cpu") is None
    assert "CUDA" in kit.static_skip(rows["1b-bf16-offload"], device="cpu")
    qlora = rows["8b-qlora-4k"]
    for large in ("8b", "tiny"):  # the dry run's tiny shape runs QLoRA too
        assert kit.static_skip(qlora, device="cpu", shapes={"large": large}) is None
    narrow = dataclasses.replace(kit.SHAPES["tiny"], name="narrow", hidden=64, intermediate=128)
    assert not kit.nf4_holds(narrow)  # a 64 x 128 projection: 8,192 elements, half a block group
    with mock.patch.dict(kit.SHAPES, narrow=narrow):
        reason = kit.static_skip(qlora, device="cpu", shapes={"large": "narrow"})
    assert "NF4" in reason and "16,384" in reason


def test_tiny_shapes_shorten_the_sequences() -> None:
    rows = {r.name: r for r in kit.ROWS}
    tiny = {"small": "tiny", "large": "tiny"}
    assert kit.scaled(rows["1b-bf16"], tiny).seq == 64
    assert kit.scaled(rows["8b-lora-32k"], tiny).seq == 1024
    assert kit.scaled(rows["8b-lora-32k"], {"small": "1b", "large": "8b"}).seq == 32768


def test_summary_medians_after_warmup_and_peaks_over_all_steps() -> None:
    records = [{"kind": "start", "step": 0}]
    for step in range(1, 7):
        records.append(
            {
                "kind": "train",
                "step": step,
                "loss": 10.0 - step,
                "tokens_per_s_per_device": 100.0 * step,
                "mfu_pct": float(step),
                "step_time_s": 1.0,
                "cuda_peak_allocated_gib": 5.0 if step != 2 else 9.0,
                "cuda_peak_reserved_gib": 6.0,
            }
        )
    records.append({"kind": "checkpoint", "seconds": 2.5, "step": 6})
    summary = kit.summarize(records, warmup=3)
    assert summary["tokens_per_s_per_gpu"] == 500.0  # median of steps 4, 5, 6
    assert summary["mfu_pct"] == 5.0
    assert summary["peak_allocated_gib"] == 9.0  # the peak of step 2 counts
    assert summary["checkpoint_save_s"] == 2.5
    assert summary["final_loss"] == 4.0


def test_the_last_steps_are_timed_from_the_log_records() -> None:
    """--log_every 5 over 25 steps: the last 15 timed from the records of steps 10 and 25
    (time and tokens seen), MFU at that rate, the three intervals as the spread."""
    records = [{"kind": "start", "step": 0, "time": 100.0}]
    times = {5: 110.0, 10: 112.0, 15: 113.0, 20: 114.5, 25: 115.0}
    for step, at in times.items():
        records.append(
            {"kind": "train", "step": step, "time": at, "tokens_seen": 1000 * step, "loss": 1.0,
             "tokens_per_s_per_device": 2000.0, "mfu_pct": 20.0, "step_time_s": 0.2,
             "cuda_peak_allocated_gib": 3.0 if step != 5 else 4.0}
        )  # fmt: skip
    records.append({"kind": "attention_kernels", "step": 1, "kernels": {"flash": 44}})
    summary = kit.summarize(records, timed_steps=15)
    assert summary["timed"] == {"from_step": 10, "to_step": 25, "seconds": 3.0}
    assert summary["tokens_per_s_per_gpu"] == pytest.approx(15_000 / 3.0)
    assert summary["mfu_pct"] == pytest.approx(20.0 * 5000 / 2000)
    assert summary["step_time_s"] == pytest.approx(0.2)
    assert summary["interval_tokens_per_s"] == pytest.approx([5000, 5000 / 1.5, 10_000])
    assert summary["peak_allocated_gib"] == 4.0  # over all steps, the timed ones or not
    assert summary["attention_kernels"] == ["flash"]
    halved = kit.summarize(records, timed_steps=15, gpus=2)
    assert halved["tokens_per_s_per_gpu"] == pytest.approx(2500)
    # a run that logged too little: the medians, as the first call's rows
    assert "timed" not in kit.summarize(records[:3], timed_steps=15)


def test_margin_suggestion_and_table() -> None:
    rows = [
        {"name": "1b-bf16", "kind": "train", "status": "ok", "shape": "1b", "parameters": 1.1e9,
         "seq": 2048, "batch": 4, "total": 4, "flags": ["--precision", "bf16-mixed"],
         "tokens_per_s_per_gpu": 20000.0, "mfu_pct": 41.0,
         "peak_allocated_gib": 20.0, "peak_reserved_gib": 22.0, "smi_peak_gib": 23.5,
         "planned_peak_gib": 19.5, "allocated_over_plan": 20 / 19.5,
         "reserved_over_plan": 22 / 19.5, "used_over_required": 0.9,
         "prediction": {"tokens_per_s_per_gpu": 25000.0}, "predicted_tokens_error": -0.2},
        {"name": "1b-fused-adamw", "kind": "train", "status": "ok", "shape": "1b",
         "parameters": 1.1e9, "seq": 2048, "batch": 4, "total": 4, "flags": [],
         "tokens_per_s_per_gpu": 21000.0, "ref": "1b-bf16", "lever": "optimizer",
         "adds": ["--fused_optimizer"], "gain": 0.05, "interval_tokens_per_s": [20500.0, 21500.0]},
        {"name": "1b-best", "kind": "best", "status": "ok", "shape": "1b", "parameters": 1.1e9,
         "seq": 2048, "batch": 16, "total": 16, "flags": ["--compile", "--fused_optimizer"],
         "tokens_per_s_per_gpu": 30000.0, "mfu_pct": 41.5,
         "combination": ["optimizer: 1b-fused-adamw joins (1b-fused-adamw +5.0%)"]},
        {"name": "1b-fp16", "kind": "train", "status": "failed", "reason": "exit 1"},
        {"name": "8b-qlora-4k", "kind": "train", "status": "skipped", "reason": "no --quantize"},
        {"name": "1b-evaluate", "kind": "evaluate", "status": "ok",
         "summary": "arc_easy: 400 requests in 2.0 s (200.0 requests/s)"},
    ]  # fmt: skip
    margin = kit.margin_suggestion(rows)
    assert margin is not None
    assert margin["allocator_fraction"] == pytest.approx(0.1)
    assert margin["runtime_gib"] == pytest.approx(1.5)
    # 19.5 GiB planned, 22 reserved: a share of 13% (19.5 x 1.13 = 22.035) misses by 0.16%.
    assert margin["fitted_fraction"] == pytest.approx(0.13)
    assert margin["fitted_error"] == pytest.approx(abs(19.5 * 1.13 - 22) / 22)
    table = kit.render_table(
        {"gpu": "H200", "gpus": 1, "torch": "2.11.0+cu130", "rows": rows, "seconds": 300,
         "environment": {"driver": "580.159.04", "transformers": "5.21.0"},
         "margin_suggestion": margin}
    )  # fmt: skip
    assert "| 1b-bf16 | 1b (1.10B) | 2048 x 4 | 20,000 | 25,000 | -20.0% | 41.0 |" in table
    assert (
        "| 1b-fused-adamw | optimizer | --fused_optimizer | 1b-bf16 | 20,000 | 21,000 | +5.0% "
        "| 20,500, 21,500 |"
    ) in table
    assert "Best combination (ok): `--compile --fused_optimizer` at micro-batch 16" in table
    assert "- MFU 41.5% (goal 40%: met)" in table
    assert "- 1b-fp16: failed: exit 1" in table
    assert "- 8b-qlora-4k: skipped: no --quantize" in table
    assert "- 1b-evaluate: arc_easy: 400 requests" in table
    assert "driver 580.159.04" in table and "allocator +10.0%" in table
    assert "nearest every reserved peak: +13.0%" in table


def _plan(tokens: float) -> dict[str, object]:
    step = {"tokens_per_s_per_gpu": tokens, "step_seconds": 0.5, "mfu": 0.3, "terms": {}}
    return {"peak_bytes": 2 * kit.GIB, "required_bytes": 4 * kit.GIB, "fits": True,
            "step_time": step, "speed_basis": "the test's"}  # fmt: skip


def test_each_prediction_is_on_disk_before_its_row_starts(tmp_path: Path, monkeypatch) -> None:
    """The kit's loop with its commands stood in for: every training row finds its prediction
    (the planner's peak and the step-time model's tokens/s; --auto's choice) already in
    gpu_check.json when it starts, never written after; the best combination is chosen from
    the rows measured before it, the attention row that would repeat its base's kernel is
    skipped, the auto row runs its choice and is set beside the fastest hand row."""
    args = kit.parse_args(["--output", str(tmp_path / "out"), "--budget", "0"])
    args.output.mkdir()
    bench = kit.Kit(args, tmp_path / "work", "cuda", 1, "h200")
    ran: dict[str, dict[str, object]] = {}
    measured = {"1b-bf16": 30_000.0, "1b-bf16-compile": 40_000.0, "1b-fused-adamw": 42_000.0,
                "1b-best": 43_000.0, "1b-auto": 41_000.0}  # fmt: skip

    def plan_later(key: str, task: object, *a: object, urgent: bool = False, **k: object) -> None:
        assert key not in bench.plans or key == "1b-best"
        bench.plans[key] = urgent  # type: ignore[assignment]

    def planned(key: str, timeout: float) -> dict[str, object]:
        if key == "1b-auto":
            flags = "--sharding full --checkpoint_layers 0 --batch_size_per_device 16 --compile"
            predicted = {"tokens_per_s_per_gpu": 44_000.0, "step_seconds": 0.7, "mfu": 0.33,
                         "peak_bytes": 3 * kit.GIB, "required_bytes": 5 * kit.GIB}  # fmt: skip
            return {"choice": {"flags": flags, "predicted": predicted}, "plan": _plan(44_000)}
        return _plan(50_000.0)

    def train_row(model: Path, row: object, timeout: float, **kw: object) -> dict[str, object]:
        on_disk = json.loads((args.output / "gpu_check.json").read_text())
        entry = next(r for r in on_disk["rows"] if r["name"] == row.name)
        assert entry["prediction"]["tokens_per_s_per_gpu"] > 0, row.name
        assert entry["prediction"]["peak_gib"] == 2.0, row.name
        assert entry["prediction"]["written_at"] <= time.time()
        assert "tokens_per_s_per_gpu" not in entry  # nothing measured yet
        ran[row.name] = {"flags": row.flags, "batch": row.batch, **kw}
        kernels = ["cudnn"] if row.name == "1b-bf16-compile" else ["flash"]
        return {"wall_s": 1.0, "tokens_per_s_per_gpu": measured[row.name], "mfu_pct": 30.0,
                "peak_allocated_gib": 2.1, "attention_kernels": kernels}  # fmt: skip

    monkeypatch.setattr(bench, "plan_later", plan_later)
    monkeypatch.setattr(bench, "planned", planned)
    monkeypatch.setattr(bench, "train_row", train_row)
    monkeypatch.setattr(bench, "write_weights", lambda *a, **k: (0, ""))
    monkeypatch.setattr(bench, "evaluate_row", lambda row, timeout: {"summary": "evaluated"})
    configs = {"small": tmp_path / "c", "large": tmp_path / "c"}
    monkeypatch.setattr(kit, "prepare", lambda *a, **k: (configs, {"small": 64, "large": 64}))
    only = "1b-bf16,1b-bf16-compile,1b-fused-adamw,1b-sdpa-cudnn,1b-best,1b-auto,1b-evaluate"
    rows = kit.select_rows(kit.ROWS, only=only)
    report = kit.Report(
        args.output, bench.logs, {"gpu": "H200", "gpus": 1, "torch": "x", "rows": []}
    )
    shapes = {"small": "1b", "large": "8b"}
    assert kit.run_rows(bench, rows, shapes, report, time.time()) == 0
    result = json.loads((args.output / "gpu_check.json").read_text())
    entries = {r["name"]: r for r in result["rows"]}
    for name in ran:
        entry = entries[name]
        assert entry["prediction"]["written_at"] <= entry["started_at"] < entry["finished_at"]
    assert entries["1b-sdpa-cudnn"]["status"] == "skipped"
    assert (
        "1b-bf16-compile ran cudnn under --sdpa_backend auto" in entries["1b-sdpa-cudnn"]["reason"]
    )
    assert "1b-evaluate" not in ran and entries["1b-evaluate"]["status"] == "ok"
    assert ran["1b-best"]["flags"] == (
        "--precision",
        "bf16-mixed",
        "--compile",
        "--fused_optimizer",
    )
    assert entries["1b-best"]["gain"] == pytest.approx(43 / 40 - 1)
    assert ran["1b-auto"]["chosen"] == tuple(planned("1b-auto", 0)["choice"]["flags"].split())
    assert entries["1b-auto"]["batch"] == 16
    assert entries["1b-auto"]["predicted_tokens_error"] == pytest.approx(41 / 44 - 1)
    assert entries["1b-bf16"]["predicted_tokens_error"] == pytest.approx(30 / 50 - 1)
    assert entries["1b-bf16"]["allocated_over_plan"] == pytest.approx(2.1 / 2.0)
    assert result["auto_against"]["1b-auto"]["best_hand"] == "1b-best"
    assert result["auto_against"]["1b-auto"]["auto_over_best_hand"] == pytest.approx(41 / 43 - 1)
    assert "Best combination (ok)" in (args.output / "gpu_check.md").read_text()


def _fake_trainer(kernels: dict[str, list[str]], *, cut: dict[str, int], seen: dict[str, Path]):
    """A stand-in for the kit's `run_process` running chess_finetune.py: it notes the command's
    compile cache, writes the metrics.jsonl of 25 steps logged every 5 (up to `cut[row]` and
    exit 124, as a run killed at its limit) with the attention kernels `kernels[row]` ran, and a
    trace the step profile's reader cannot read for a profiled row."""

    def run_process(command, *, env, timeout, log, errors=None) -> int:
        out = Path(command[command.index("--output_dir") + 1])
        seen[out.name] = Path(env["TORCHINDUCTOR_CACHE_DIR"])
        out.mkdir(parents=True)
        last = cut.get(out.name, 25)
        records = [{"kind": "start", "step": 0, "time": 100.0}]
        records += [
            {"kind": "train", "step": step, "time": 100.0 + step, "tokens_seen": 1000 * step,
             "loss": 1.0, "tokens_per_s_per_device": 1000.0, "mfu_pct": 10.0, "step_time_s": 1.0}
            for step in range(5, last + 1, 5)
        ]  # fmt: skip
        ran = {kernel: 22 for kernel in kernels.get(out.name, [])}
        records.append({"kind": "attention_kernels", "step": 1, "kernels": ran})
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        if "--profile_steps" in command:
            (out / "profile").mkdir()
            (out / "profile" / "rank0.1.pt.trace.json").write_text('{"traceEvents": [1]}')
        log.write_text("the run's log\n")
        return 124 if out.name in cut else 0

    return run_process


def test_each_attention_kernel_has_its_compile_cache_and_the_kernel_that_ran_is_checked(
    tmp_path: Path, monkeypatch
) -> None:
    """torch's compile-cache keys leave the SDPA backend out (pytorch #185449): each
    --sdpa_backend compiles into a folder of its own (the best combination into its kernel's),
    and a row whose log names another kernel than the one it asked for is failed, not measured.
    A row killed at its limit keeps what it logged (partial); a trace the reader cannot read
    leaves the row's figures."""
    args = kit.parse_args(["--output", str(tmp_path / "out"), "--budget", "0"])
    args.output.mkdir()
    work = tmp_path / "work"
    bench = kit.Kit(args, work, "cuda", 1, "h200")
    seen: dict[str, Path] = {}
    kernels = {"1b-bf16": ["cudnn"], "1b-bf16-compile": ["cudnn"], "1b-sdpa-flash": ["flash"],
               "1b-sdpa-cudnn": ["flash"], "1b-best": ["cudnn"], "1b-auto": ["cudnn"]}  # fmt: skip
    fake = _fake_trainer(kernels, cut={"1b-sdpa-efficient": 15}, seen=seen)
    monkeypatch.setattr(kit, "run_process", fake)
    rows = {r.name: r for r in kit.ROWS}
    best = dataclasses.replace(
        rows["1b-best"], flags=(*kit.gpu_rows.BASE_FLAGS, "--sdpa_backend", "cudnn")
    )
    chosen = ("--batch_size_per_device", "16", "--compile")
    results = {
        row.name: bench.train_row(tmp_path / "model", row, 60.0, chosen=chosen)
        for row in (rows["1b-bf16"], rows["1b-bf16-compile"], rows["1b-sdpa-flash"],
                    rows["1b-sdpa-cudnn"], rows["1b-sdpa-efficient"], best, rows["1b-auto"])
    }  # fmt: skip
    cache = work / "compile-cache"
    assert seen == {
        "1b-bf16": cache, "1b-bf16-compile": cache, "1b-auto": cache,
        "1b-sdpa-flash": cache / "sdpa-flash", "1b-sdpa-cudnn": cache / "sdpa-cudnn",
        "1b-sdpa-efficient": cache / "sdpa-efficient", "1b-best": cache / "sdpa-cudnn",
    }  # fmt: skip
    assert "status" not in results["1b-sdpa-flash"] and "status" not in results["1b-best"]
    wrong = results["1b-sdpa-cudnn"]
    assert wrong["status"] == "failed" and "but the run ran flash" in wrong["reason"]
    assert kit.kernel_mismatch("flash", ["flash (CPU)"]) is None  # the dry run's flash
    partial = results["1b-sdpa-efficient"]
    assert partial["status"] == "timed out" and partial["partial"] is True
    assert partial["steps_logged"] == 3 and "up to step 15 of 25" in partial["reason"]
    assert (bench.logs / "1b-sdpa-efficient.metrics.jsonl").read_text().count('"train"') == 3
    profiled = results["1b-bf16"]  # the reader's AttributeError: the row's figures stay
    assert "status" not in profiled and profiled["tokens_per_s_per_gpu"] == pytest.approx(1000)
    assert profiled["profile"]["error"].startswith("AttributeError")


def test_a_lever_that_overruns_is_killed_in_time_for_the_rows_of_priority_1() -> None:
    """A row's time limit is three times its estimate cut to what the more important rows
    after it keep (for a row of priority 1, the other rows of priority 1 too), never below its
    own estimate: the last lever before the best combination, killed at its limit, leaves
    1b-best and 1b-auto their time."""
    rows = kit.select_rows(kit.ROWS)
    names = [r.name for r in rows]
    starts = {
        row.name: start for row, start, _ in kit.gpu_rows.schedule(rows, kit.DEFAULT_BUDGET_S)
    }
    budget = kit.Budget(kit.DEFAULT_BUDGET_S)
    small = {"small"}
    lever = rows[names.index("1b-sync-free")]
    later = rows[names.index(lever.name) + 1 :]
    limit = budget.time_limit(lever, later, elapsed=starts[lever.name], written=small)
    assert lever.estimate_s <= limit < 3 * lever.estimate_s  # cut, not below its estimate
    best, auto = (rows[names.index(n)] for n in ("1b-best", "1b-auto"))
    clock = starts[lever.name] + limit  # killed there
    after_best = rows[names.index("1b-best") + 1 :]
    assert budget.skip_reason(best, after_best, elapsed=clock, written=small) is None
    clock += best.estimate_s
    after_auto = rows[names.index("1b-auto") + 1 :]
    assert budget.skip_reason(auto, after_auto, elapsed=clock, written=small) is None
    # a row of priority 1 keeps the time of those after it, never below its own estimate
    first = rows[0]
    assert budget.time_limit(first, rows[1:], elapsed=52, written=small) == 3 * first.estimate_s
    short = kit.Budget(250)  # 198 s left, 188 s kept for 1b-bf16-compile, 1b-best and 1b-auto
    assert short.time_limit(first, rows[1:], elapsed=52, written=small) == first.estimate_s
    # never beyond the budget
    assert (
        budget.time_limit(auto, after_auto, elapsed=kit.DEFAULT_BUDGET_S - 10, written=small) == 10
    )


def test_a_rows_own_error_is_recorded_and_the_next_row_runs(tmp_path: Path, monkeypatch) -> None:
    """An exception in the kit's own process (reading a trace, a summary) fails that row with
    its traceback; the call goes on with the next row."""
    args = kit.parse_args(["--output", str(tmp_path / "out"), "--budget", "0"])
    args.output.mkdir()
    bench = kit.Kit(args, tmp_path / "work", "cuda", 1, "h200")

    def train_row(model: Path, row: object, timeout: float, **kw: object) -> dict[str, object]:
        if row.name == "1b-bf16":
            raise RuntimeError("a trace nobody expected")
        return {"wall_s": 1.0, "tokens_per_s_per_gpu": 40_000.0}

    monkeypatch.setattr(bench, "plan_later", lambda *a, **k: None)
    monkeypatch.setattr(bench, "planned", lambda key, timeout: _plan(50_000.0))
    monkeypatch.setattr(bench, "train_row", train_row)
    monkeypatch.setattr(bench, "write_weights", lambda *a, **k: (0, ""))
    configs = {"small": tmp_path / "c", "large": tmp_path / "c"}
    monkeypatch.setattr(kit, "prepare", lambda *a, **k: (configs, {"small": 64, "large": 64}))
    rows = kit.select_rows(kit.ROWS, only="1b-bf16,1b-bf16-compile")
    report = kit.Report(
        args.output, bench.logs, {"gpu": "H200", "gpus": 1, "torch": "x", "rows": []}
    )
    shapes = {"small": "1b", "large": "8b"}
    assert kit.run_rows(bench, rows, shapes, report, time.time()) == 1
    entries = {
        r["name"]: r for r in json.loads((args.output / "gpu_check.json").read_text())["rows"]
    }
    failed = entries["1b-bf16"]
    assert failed["status"] == "failed"
    assert failed["reason"] == "the kit's own error: RuntimeError: a trace nobody expected"
    assert "raise RuntimeError" in failed["traceback"]
    assert entries["1b-bf16-compile"]["status"] == "ok"
    assert "- 1b-bf16: failed: the kit's own error" in (args.output / "gpu_check.md").read_text()


def test_results_are_replaced_whole_and_nothing_starts_after_shutdown(
    tmp_path: Path, monkeypatch
) -> None:
    """A write cut short leaves the previous whole file (and no temporary one); after the kit's
    shutdown no command starts (a planner thread still running would be waited for at exit)."""
    args = kit.parse_args(["--output", str(tmp_path / "out"), "--budget", "0"])
    args.output.mkdir()
    bench = kit.Kit(args, tmp_path / "work", "cuda", 1, "h200")
    (bench.logs / "1b-bf16.log").write_text("first\n")
    report = kit.Report(
        args.output, bench.logs, {"gpu": "H200", "gpus": 1, "torch": "x", "rows": []}
    )
    report.write(time.time())
    before = {p.name: p.read_bytes() for p in args.output.iterdir()}
    assert sorted(before) == ["gpu_check.json", "gpu_check.md", "logs.tar.gz"]
    (bench.logs / "1b-bf16.log").write_text("second\n")

    def killed(*a: object, **k: object) -> None:
        raise OSError("cut short")

    monkeypatch.setattr(kit.tarfile.TarFile, "add", killed)
    with pytest.raises(OSError, match="cut short"):
        report.write(time.time())
    assert (args.output / "logs.tar.gz").read_bytes() == before["logs.tar.gz"]
    assert sorted(p.name for p in args.output.iterdir()) == sorted(before)
    bench.shutdown()
    log = tmp_path / "late.log"
    code = kit.run_process(
        [sys.executable, "-c", "pass"], env=dict(os.environ), timeout=60, log=log
    )
    assert code == 124 and "shutting down" in log.read_text()
    kit.Kit(args, tmp_path / "work2", "cuda", 1, "h200")  # a new call starts commands again
    assert (
        kit.run_process([sys.executable, "-c", "pass"], env=dict(os.environ), timeout=60, log=log)
        == 0
    )


def test_the_budgets_clock_starts_before_the_wheels_are_installed(
    tmp_path: Path, monkeypatch
) -> None:
    """The budget runs from the script's first start: the run again with the wheels inherits
    a clock set before their installation (SETUP_S counts it)."""
    installing: list[float] = []

    def install(wheels: Path, site: Path) -> list[str]:
        installing.append(time.time())
        return ["installed"]

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        raise SystemExit(env[kit.STARTED_ENV])

    argv = ["--wheels", str(tmp_path / "whl"), "--output", str(tmp_path / "out")]
    monkeypatch.setattr(stack, "install", install)
    monkeypatch.setattr(kit.os, "execve", execve)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", *argv])
    monkeypatch.delenv(kit.STARTED_ENV, raising=False)
    before = time.time()
    with pytest.raises(SystemExit) as started:
        kit.main(argv)
    assert before <= float(str(started.value)) <= installing[0]


def test_evaluation_requests_are_timed_from_the_models_own_log_lines() -> None:
    log = (
        "model: runs/x/final (llama), bf16-true, FSDP2 over 1 process(es) on cuda, loaded in 3.1s\n"
        "loglikelihood: 1600 requests as 1590 distinct inputs on 1 rank(s), 2.5s\n"
        "generate_until: 10 requests on 1 rank(s), 1.5s\n"
        "results: lm_eval/results.json\n"
    )
    assert kit.request_times(log) == (1610, 4.0)
    assert kit.request_times("nothing timed") == (0, 0.0)


def test_without_cuda_one_line_and_exit_2() -> None:
    result = launch(1, "bench/gpu_check.py", [], timeout=120)  # the script as its own process
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0]


# --- the carried wheels ------------------------------------------------------------------------


def _wheel(folder: Path, name: str, version: str, tag: str, requires: list[str]) -> Path:
    """A minimal wheel: the file name and a METADATA with its requirements."""
    path = folder / f"{name}-{version}-{tag}.whl"
    metadata = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}"]
    metadata += [f"Requires-Dist: {line}" for line in requires]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(metadata) + "\n")
    return path


def _carried(tmp_path: Path, skip: str = "") -> Path:
    folder = tmp_path / "whl"
    folder.mkdir(parents=True)
    for carried in stack.CARRIED:
        if carried.name != skip:
            name = carried.name.replace("-", "_")
            _wheel(folder, name, carried.version, "py3-none-any", [])
    return folder


def test_a_complete_folder_passes_and_each_fault_is_named(tmp_path: Path) -> None:
    assert stack.check_folder(_carried(tmp_path), "3.12") == []

    missing = _carried(tmp_path / "a", skip="transformers")
    assert stack.check_folder(missing, "3.12") == [
        "missing: transformers==5.21.0 (python bench/device_stack.py download)"
    ]
    twice = _carried(tmp_path / "b")
    _wheel(twice, "transformers", "5.17.0", "py3-none-any", [])
    (problem,) = stack.check_folder(twice, "3.12")
    assert problem.startswith("transformers: 2 wheels")
    extra = _carried(tmp_path / "c")
    _wheel(extra, "torch", "2.11.0", "cp312-cp312-manylinux_2_28_x86_64", [])
    assert stack.check_folder(extra, "3.12") == [
        "not listed in CARRIED: torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    ]


def test_wheels_for_another_python_or_platform_are_refused(tmp_path: Path) -> None:
    folder = _carried(tmp_path, skip="multiprocess")
    wheel = _wheel(folder, "multiprocess", "0.70.19", "py312-none-any", [])
    assert stack.check_folder(folder, "3.12") == []
    assert stack.check_folder(folder, "3.11") == [
        f"{wheel.name}: not installable on CPython 3.11 x86_64"
    ]
    wheel.unlink()
    mac = _wheel(folder, "multiprocess", "0.70.19", "cp312-cp312-macosx_11_0_arm64", [])
    assert stack.check_folder(folder, "3.12") == [
        f"{mac.name}: not installable on CPython 3.12 x86_64"
    ]


def test_every_requirement_of_a_carried_wheel_is_on_the_image_or_carried(tmp_path: Path) -> None:
    folder = _carried(tmp_path, skip="nltk")
    requires = ["click", "joblib", "defusedxml", "ujson>=5", 'pytest; extra == "test"']
    requires.append('tomli; python_version < "3.11"')
    _wheel(folder, "nltk", "3.10.4", "py3-none-any", requires)
    # click and joblib are on the image, defusedxml is carried; extras and markers that do not
    # apply are not needed.
    assert stack.check_folder(folder, "3.12") == ["unmet: nltk needs ujson (on neither list)"]


def test_the_image_list_is_kinds_md_copied() -> None:
    names = stack.IMAGE_PACKAGES
    assert {"torch", "transformers", "huggingface-hub", "peft", "pyarrow", "zipp"} <= names
    assert not names & {"datasets", "lm-eval", "submitit", "chess"}  # what we must carry
    assert len(names) == 197


def test_install_takes_only_what_the_python_lacks(tmp_path: Path, monkeypatch) -> None:
    """Not installed: carried. Installed in the declared range: kept. Installed outside it
    (transformers 5.17 on the image against >=5.21): carried."""
    import importlib.metadata

    versions = {"transformers": "5.17.0", "peft": "0.21.1", "chess": None}

    def version(name: str) -> str:
        found = versions.get(name)
        if found is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return found

    monkeypatch.setattr(stack.importlib.metadata, "version", version)
    folder = tmp_path / "whl"
    folder.mkdir()
    for name, pin in [("transformers", "5.21.0"), ("peft", "0.21.2"), ("chess", "1.10.0")]:
        _wheel(folder, name, pin, "py3-none-any", [])
    chosen = {w.name: why for w, why in stack.choose(stack.read_folder(folder))}
    assert chosen == {
        "transformers": "5.17.0 installed, transformers>=5.21.0 declared",
        "chess": "not installed",
    }


def test_a_command_runs_in_its_own_group_and_is_killed_whole_at_its_time_limit(
    tmp_path: Path,
) -> None:
    """The kit's one way to start a process (the whole-flow test below forks them instead)."""
    log, errors = tmp_path / "log", tmp_path / "errors"
    script = "import os, sys; print(os.getpgid(0) == os.getpid(), flush=True); "
    script += "print('err', file=sys.stderr); sys.exit(3)"
    code = kit.run_process(
        [sys.executable, "-c", script], env=dict(os.environ), timeout=60, log=log
    )
    assert code == 3 and log.read_text().split() == ["True", "err"]
    code = kit.run_process(
        [sys.executable, "-c", script], env=dict(os.environ), timeout=60, log=log, errors=errors
    )
    assert (log.read_text(), errors.read_text()) == ("True\n", "err\n")
    # A child that outlives the limit, with a grandchild in its group: 124, as timeout(1) says.
    sleeper = "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"
    code = kit.run_process(
        [sys.executable, "-c", sleeper], env=dict(os.environ), timeout=1, log=log
    )
    assert code == 124


def _forked(
    command: list[str],
    *,
    env: dict[str, str],
    timeout: float,
    log: Path,
    errors: Path | None = None,
) -> int:
    """The kit's `run_process` through tests/prefork.py: each command (`python -m ...`, `python
    SCRIPT`, `torchrun --standalone --nproc_per_node=N SCRIPT`) is still a process of its own
    with its arguments, environment and exit code, forked from the pre-imported server instead
    of paying torch's imports (and torchrun's agent) each time."""
    if Path(command[0]).name == "torchrun":
        nproc = int(next(a.split("=", 1)[1] for a in command if a.startswith("--nproc_per_node=")))
        start = next(i for i, a in enumerate(command[1:], 1) if not a.startswith("--"))
        target, args, distributed = command[start], command[start + 1 :], True
    else:
        assert command[0] == sys.executable, command
        nproc, target, args, distributed = 1, command[1], command[2:], False
    if target != "-m":
        target = str(Path(target).resolve().relative_to(REPO))
    # One thread per process: the kit asks 4 of a GPU node's cores; this machine has 2.
    env = {**env, "OMP_NUM_THREADS": "1"}
    try:
        result = launch(nproc, target, args, env=env, timeout=timeout, distributed=distributed)
        code, out, err = result.returncode, result.stdout, result.stderr
    except subprocess.TimeoutExpired as expired:
        code, out, err = 124, str(expired.stdout or ""), str(expired.stderr or "")
    log.write_text(out if errors else out + err)
    if errors:
        errors.write_text(err)
    return code


@pytest.mark.slow
def test_the_whole_flow_runs_on_cpu(tmp_path: Path, monkeypatch, capsys) -> None:
    """Every kind of row with the tiny shape on CPU: a training row (25 steps, the last 15
    timed, a step profiled) against the planner's prediction written before it ran, the
    save/resume/export cycle, the masking probe and the evaluation of the export; a GPU-only
    lever and the offload row skipped, saying why (the full dry run, every row, from the
    carried wheels at the device's versions: make gpu-check-dry-run). The kit runs in this
    process and its commands are forked (`_forked`): no interpreter or torchrun agent starts
    per command, 52 s of CPU instead of 159 (2026-11-27)."""
    out = tmp_path / "out"
    monkeypatch.setattr(kit, "run_process", _forked)
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # main() tees it into gpu_check.log
    code = kit.main(
        ["--allow-cpu", "--shapes", "tiny", "--budget", "0",
         "--only", "1b-bf16,1b-sdpa-cudnn,1b-checkpoint,1b-masking,1b-evaluate,1b-bf16-offload",
         "--games", "200", "--output", str(out), "--work", str(tmp_path / "work")],
    )  # fmt: skip
    if isinstance(sys.stdout, kit.Tee):
        sys.stdout.file.close()
    captured = capsys.readouterr()
    report = json.loads((out / "gpu_check.json").read_text())
    outcomes = [(r["name"], r["status"], r.get("reason")) for r in report["rows"]]
    assert code == 0, (outcomes, captured.out[-3000:], captured.err[-3000:])
    rows = {r["name"]: r for r in report["rows"]}
    train = rows["1b-bf16"]
    assert train["status"] == "ok" and train["steps_logged"] == 5  # --log_every 5
    assert train["timed"]["from_step"] == 10 and train["tokens_per_s_per_gpu"] > 0
    assert train["planned_peak_gib"] and train["planned_peak_gib"] > 0  # the planner ran
    predicted = train["prediction"]
    assert predicted["tokens_per_s_per_gpu"] > 0 and predicted["written_at"] < train["started_at"]
    profile = train["profile"]  # the profiled step, against the bare product on this device
    assert profile["busy_ms"] > 0 and profile["buckets_ms"]["matrix products"] > 0
    assert profile["bare_matmul"]["tflops"] > 0 and profile["matmul_of_bare"] > 0
    assert (out / profile["trace"]).is_file()
    assert rows["1b-sdpa-cudnn"]["reason"].startswith("GPU only: ")
    cycle = rows["1b-checkpoint"]
    assert cycle["status"] == "ok" and cycle["resumed"] is True
    assert None not in (cycle["save_s"], cycle["load_s"], cycle["export_s"])
    assert Path(cycle["final_model"], "config.json").is_file()
    masking = rows["1b-masking"]
    assert [c["verdict"] for c in masking["cases"]] == ["pass", "pass"], masking["cases"]
    evaluation = rows["1b-evaluate"]
    assert evaluation["status"] == "ok" and evaluation["requests"] > 0
    assert evaluation["requests_per_s"] > 0
    assert rows["1b-bf16-offload"]["status"] == "skipped"
    table = (out / "gpu_check.md").read_text()
    assert "| 1b-bf16 | tiny" in table and "Profiled step of 1b-bf16" in table
    assert "torch" in (out / "versions.txt").read_text()
    with __import__("tarfile").open(out / "logs.tar.gz") as archive:
        assert "logs/1b-bf16.log" in archive.getnames()
    assert "gpu-check: 1b-evaluate" in (out / "gpu_check.log").read_text()
