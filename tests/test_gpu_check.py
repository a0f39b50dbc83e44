"""The GPU validation kit's logic, on CPU: no GPU is at hand in CI (bench/gpu_check.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_check.py"


def _kit():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


kit = _kit()


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


def test_largest_fitting_shape_is_chosen() -> None:
    plans = {"13b": {"fits": False}, "8b": {"fits": True}, "3b": {"fits": True}}
    assert kit.choose_large_shape(plans) == "8b"
    assert (
        kit.choose_large_shape({"13b": None, "8b": {"fits": False}, "3b": {"fits": True}}) == "3b"
    )
    assert kit.choose_large_shape({"13b": {"fits": False}}) is None


def test_every_configuration_the_issue_asks_for_runs_on_the_small_shape() -> None:
    specs = kit.run_specs(["1b", "3b"], steps=30, seq_length=2048, batch=4)
    small = {s.name: s for s in specs if s.shape == "1b"}
    assert set(small) == {"bf16-mixed", "bf16-mixed + AC", "fp16-mixed", "bf16-mixed + CPU offload"}
    assert "--gradient_checkpointing" in small["bf16-mixed + AC"].flags
    assert "--cpu_offload" in small["bf16-mixed + CPU offload"].flags
    assert small["fp16-mixed"].flags[:2] == ("--precision", "fp16-mixed")
    large = {s.name: s for s in specs if s.shape == "3b"}
    assert set(large) == {"bf16-mixed", "bf16-mixed + AC", "QLoRA bf16-mixed + AC"}
    assert {"--qlora", "--gradient_checkpointing"} <= set(large["QLoRA bf16-mixed + AC"].flags)


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


def test_margin_suggestion_and_table() -> None:
    runs = [
        {"shape": "1b", "name": "bf16-mixed", "parameters": 1.1e9, "tokens_per_s_per_gpu": 20000.0,
         "mfu_pct": 41.0, "peak_allocated_gib": 20.0, "peak_reserved_gib": 22.0,
         "smi_peak_gib": 23.5, "planned_peak_gib": 19.5, "allocated_over_plan": 20 / 19.5,
         "reserved_over_plan": 22 / 19.5, "used_over_required": 0.9},
        {"shape": "1b", "name": "fp16-mixed", "error": "exit 1"},
    ]  # fmt: skip
    margin = kit.margin_suggestion(runs)
    assert margin is not None
    assert margin["allocator_fraction"] == pytest.approx(0.1)
    assert margin["runtime_gib"] == pytest.approx(1.5)
    table = kit.render_table(
        {"gpu": "H100", "gpus": 1, "torch": "x", "seq_length": 2048, "batch_size_per_device": 4,
         "runs": runs, "checkpoint": None, "margin_suggestion": margin}
    )  # fmt: skip
    assert "| 20,000 | 41.0 |" in table
    assert "failed: exit 1" in table
    assert "allocator +10.0%" in table


def test_without_cuda_one_line_and_exit_2() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0]


@pytest.mark.slow
def test_the_whole_flow_runs_on_cpu(tmp_path: Path) -> None:
    """Data, model, a training configuration against the planner, and the save/resume/export
    cycle, with the tiny shape on CPU: what runs on a GPU, minus the GPU."""
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--allow-cpu", "--shapes", "tiny", "--configs",
         "bf16-mixed", "--steps", "4", "--seq-length", "64", "--batch", "2", "--games", "120",
         "--output", str(out), "--work", str(tmp_path / "work")],
        capture_output=True, text=True, cwd=REPO, timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    (run,) = report["runs"]
    assert run["name"] == "bf16-mixed" and run["steps_logged"] == 4
    assert run["tokens_per_s_per_gpu"] > 0
    assert run["planned_peak_gib"] and run["planned_peak_gib"] > 0  # the planner ran
    cycle = report["checkpoint"]
    assert cycle["exit_codes"] == [0, 0] and cycle["resumed"] is True
    assert None not in (cycle["save_s"], cycle["load_s"], cycle["export_s"])
    assert Path(cycle["final_model"], "config.json").is_file()
    assert "| tiny" in (out / "gpu_check.md").read_text()
