"""The measured rows the step-time model is fitted to, from the GPU kit's raw results, and the
leave-one-out error of each (docs/plan.md, "Choosing a configuration").

    python bench/speed_rows.py            # print the rows and their leave-one-out errors
    python bench/speed_rows.py --write    # (re)write fsdp_utils/plan/measured.py from them

Every training row of `docs/gpu-check-results/*/call*-gpu_check.json` that ran (a plain row, the
best combination, an `*-auto` row; not GRPO's or distillation's, whose rollout and teacher the
model does not time): its command's shape and flags (bench/gpu_check.py's SHAPES and the flags
the row ran with), its model's counts from a meta build of that shape
(`fsdp_utils.plan.workload.facts_from_meta`: LoRA, NF4 as the run had them), the GPU kind it was
planned for, and its measured step time: the kit's timed window where the row has one (the last
15 of 25 steps), else the median of `step_time_s` over its steps after the third (after the
first when it ran fewer than six), from the call's `logs.tar.gz` metrics.jsonl. Tokens/s here
are sequence positions per second (the step's compute), not the kit's real-token count, which
leaves out a block's padding (the 32k row's second step was half padding).
tests/test_speed_model.py checks that fsdp_utils/plan/measured.py holds what this derives.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tarfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "gpu-check-results"
MEASURED = REPO / "fsdp_utils" / "plan" / "measured.py"
TIMED_KINDS = ("train", "best", "auto")


def _kit() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def steady_step_seconds(records: list[dict[str, Any]]) -> float:
    steps = [r["step_time_s"] for r in records if r.get("kind") == "train"]
    steady = steps[3:] if len(steps) >= 6 else steps[1:] or steps
    return float(statistics.median(steady))


def _metrics(archive: Path, row: str) -> list[dict[str, Any]]:
    with tarfile.open(archive) as tar:
        member = tar.extractfile(f"logs/{row}.metrics.jsonl")
        assert member is not None
        return [json.loads(line) for line in member.read().decode().splitlines() if line]


def collect() -> list[dict[str, Any]]:
    """The rows as plain data (what fsdp_utils/plan/measured.py holds)."""
    sys.path.insert(0, str(REPO))
    from transformers import LlamaConfig

    from fsdp_utils.config.batch import plan_batch
    from fsdp_utils.model.build import build_meta_model
    from fsdp_utils.model.transforms import transform_model
    from fsdp_utils.plan.hardware import GPU_SPECS
    from fsdp_utils.plan.site import sheet_device
    from fsdp_utils.plan.workload import facts_from_meta, run_shape

    kit = _kit()
    out = []
    for result in sorted(RESULTS.glob("*/call*-gpu_check.json")):
        call = json.loads(result.read_text())
        archive = result.with_name(result.name.replace("gpu_check.json", "logs.tar.gz"))
        # the kind the call planned for (the H100 calls predate the field: one H100 80GB)
        gpu = call.get("planned_for", "h100-80gb")
        assert gpu in GPU_SPECS, f"{result}: planned for {gpu}, a size: no GPU kind to fit to"
        for measured in call["rows"]:
            if measured.get("kind") not in TIMED_KINDS or measured.get("status") != "ok":
                continue
            shape = kit.SHAPES[measured["shape"]]
            hf_config = LlamaConfig(
                hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                max_position_embeddings=max(4096, measured["seq"]), tie_word_embeddings=False,
            )  # fmt: skip
            config = row_config(measured, shape.name)
            meta = transform_model(build_meta_model(hf_config, config.precision), config)
            facts = facts_from_meta(meta, hf_config, config, name=shape.name)
            batch = plan_batch(config, 1)
            if measured.get("timed"):  # the kit's window: the last steps, from the records
                step = measured["step_time_s"]
            else:
                step = steady_step_seconds(_metrics(archive, measured["name"]))
            call_name = result.name.split("-")[0]
            out.append(
                {
                    "name": f"{measured['name']} ({call_name})",
                    "device": sheet_device(gpu, config).to_dict(),
                    "cluster": {"nodes": 1, "gpus_per_node": 1},
                    "facts": facts.__dict__,
                    "shape": run_shape(config, batch, facts.layers).__dict__,
                    "step_seconds": round(step, 5),
                    "peak_allocated_gib": round(measured["peak_allocated_gib"], 3),
                    "source": str(result.relative_to(REPO)),
                }
            )
    return out


def row_config(measured: dict[str, Any], shape: str) -> Any:
    """The TrainConfig a measured row ran: its flags read by the training command's own parser
    (numbers as numbers: `--loss_chunk_size 2097`, an *-auto row's `--batch_size_per_device
    16`), after its sequence length, micro-batch and total batch per GPU."""
    from fsdp_utils.config.parse import parse_config

    argv = [
        "--model", f"{shape} (bench/gpu_check.py)", "--precision", "bf16-mixed",
        "--max_seq_length", str(measured["seq"]),
        "--batch_size_per_device", str(measured["batch"]),
        "--total_batch_size", str(measured.get("total", measured["batch"])),
        *measured["flags"],
    ]  # fmt: skip
    config, _ = parse_config(argv)
    return config


def write(rows: list[dict[str, Any]]) -> None:
    body = json.dumps(rows, indent=1)
    MEASURED.write_text(
        '"""The measured rows shipped with the toolkit: the first H100 measurement\'s training\n'
        "rows (docs/gpu-check.md), with their models' counts and settings, written by\n"
        "`python bench/speed_rows.py --write` from docs/gpu-check-results/ (and checked against\n"
        'it by tests/test_speed_model.py). The step-time model is fitted to them."""\n\n'
        "# fmt: off\n"
        f"ROWS = {body}\n".replace("true", "True")
        .replace("false", "False")
        .replace("null", "None")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="Rewrite fsdp_utils/plan/measured.py.")
    args = parser.parse_args()
    from fsdp_utils.plan.efficiency import SpeedRow

    rows = collect()
    if args.write:
        write(rows)
        print(f"wrote {len(rows)} rows to {MEASURED.relative_to(REPO)}")
    print(loo_table([SpeedRow.from_dict(row) for row in rows]))


def loo_table(rows: list[Any]) -> str:
    """Each row's measured and predicted tokens/s per GPU: fitted to every row, and fitted to
    the others only (leave-one-out)."""
    from fsdp_utils.plan.efficiency import fit, leave_one_out
    from fsdp_utils.plan.step_time import Efficiency

    prior = Efficiency()
    fitted = fit(rows, prior)
    lines = [
        "| row | tokens/s/GPU measured | fitted to all rows | error | leave-one-out | error |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for item in leave_one_out(rows, prior):
        tokens = item.row.tokens_per_s_per_gpu * item.row.step_seconds
        lines.append(
            f"| {item.row.name} | {item.row.tokens_per_s_per_gpu:,.0f} | "
            f"{tokens / item.in_sample_step_seconds:,.0f} | {item.in_sample_error:+.1%} | "
            f"{tokens / item.predicted_step_seconds:,.0f} | {item.error:+.1%} |"
        )
    shares = ", ".join(
        f"{name} {getattr(fitted, name):.3g} (prior {getattr(prior, name):.3g})"
        for name in Efficiency.FITTED
    )
    return "\n".join(lines) + f"\n\nfitted to all {len(rows)} rows: {shares}"


if __name__ == "__main__":
    main()
