"""Real multi-process runs of chess_finetune.py on CPU (gloo): sharding, the fixed total batch,
learning, saving, and the errors users meet."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.train_helpers import check_ok, read_metrics, run_finetune, run_finetunes, tiny_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


def test_root_only_sharding(tmp_path, data_cache, tiny_assets):
    out = tmp_path / "run"
    args = tiny_args(
        tiny_assets,
        out,
        data_cache,
        max_training_steps=1,
        no_layer_wrap_policy=True,
        no_final_save=True,
    )
    check_ok(run_finetune(2, args))
    assert json.loads((out / "config.json").read_text())["resolved"]["fsdp_groups"] == [""]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


def _all_ok(results: dict[str, dict[str, float]]) -> None:
    failed = {name: r for name, r in results.items() if r["exit_code"] != 0}
    assert not failed, failed


def test_same_total_batch_same_losses_on_1_and_2_processes(tmp_path, data_cache, tiny_assets):
    """Total batch 8 as 1x4x2, 2x2x2, 2x1x4 (FSDP), 2x2x2 (DDP) and with activation
    checkpointing + deferred sync: fp32 losses agree step by step, the loss in one chunk per
    micro-batch or (DDP, AC) in chunks of 16 tokens."""
    runs = {
        "1 proc, 4 per device": (1, {"batch_size_per_device": 4}),
        "2 procs, 2 per device": (2, {"batch_size_per_device": 2}),
        "2 procs, 1 per device": (2, {"batch_size_per_device": 1}),
        # these two with the loss in chunks of 16 tokens (the others' micro-batch is one chunk)
        "2 procs, DDP": (2, {"batch_size_per_device": 2, "no_fsdp": True, "loss_chunk_size": 16}),
        "2 procs, AC + defer sync": (
            2,
            {
                "batch_size_per_device": 2,
                "gradient_checkpointing": True,
                "defer_grad_sync": True,
                "loss_chunk_size": 16,
            },
        ),
    }
    folders = {name: tmp_path / name.replace(" ", "_").replace(",", "") for name in runs}
    argv = {
        name: tiny_args(
            tiny_assets, folders[name], data_cache, max_training_steps=5, no_final_save=True,
            **overrides,
        )
        for name, (_, overrides) in runs.items()
    }  # fmt: skip
    for nproc in (1, 2):
        batch = {name: argv[name] for name, (n, _) in runs.items() if n == nproc}
        _all_ok(run_finetunes(nproc, batch, tmp_path / f"{nproc}-process runs"))
    losses = {name: _losses(folder) for name, folder in folders.items()}
    reference = losses["1 proc, 4 per device"]
    assert len(reference) == 5 and reference[-1] < reference[0]  # it does learn
    for name, values in losses.items():
        assert values == pytest.approx(reference, rel=2e-5, abs=2e-5), name


def test_loss_falls_and_the_saved_model_reloads_and_generates(tmp_path, data_cache, tiny_assets):
    out = tmp_path / "run"
    args = tiny_args(
        tiny_assets, out, data_cache, precision="bf16-mixed", max_training_steps=30,
        eval_every=15, log_every=1, gradient_checkpointing=True,
    )  # fmt: skip
    result = run_finetune(2, args)
    check_ok(result)
    train = read_metrics(out)
    assert [r["step"] for r in train] == list(range(1, 31))
    # From ln(512) = 6.24 (uniform over the vocabulary) towards the unigram entropy (~5.7).
    assert train[0]["loss"] == pytest.approx(math.log(512), abs=0.05)
    assert train[-1]["loss"] < train[0]["loss"] - 0.3
    evals = read_metrics(out, "eval")
    assert [e["step"] for e in evals] == [15, 30] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    for key in (
        "tokens_per_s",
        "tokens_per_s_per_device",
        "grad_norm",
        "lr",
        "host_rss_gib",
        "step_time_s",
    ):
        assert train[-1][key] is not None and train[-1][key] > 0, key
    assert train[-1]["mfu_pct"] is None  # no GPU peak known on CPU
    assert "tokens per optimizer step" in result.stdout and "run folder" in result.stdout

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    prompt = tokenizer("[Result 1-0] [Termination CHECKMATE] e2e4", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=10, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    # The saved weights are the trained ones, not the initial ones.
    initial = AutoModelForCausalLM.from_pretrained(tiny_assets["model"])
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(model.state_dict()[name], initial.state_dict()[name])


@pytest.mark.parametrize(
    ("overrides", "nproc", "expected"),
    [
        ({"model": "/nonexistent/model"}, 1, "--model /nonexistent/model: no such file or folder"),
        (
            {"model": "some-org/never-downloaded"},
            1,
            "python download_models.py --model some-org/never-downloaded",
        ),
        ({"dataset": "/nonexistent/data.parquet"}, 1, "no such file or folder. / holds"),
        (
            {"dataset": "laion/not-cached"},
            1,
            "python download_models.py --dataset laion/not-cached",
        ),
        ({"max_seq_length": 5000}, 1, "above the model's context length of 1024"),
        ({"total_batch_size": 7}, 2, "total_batch_size=7 must be a multiple"),
        ({"learning_rate": 1e30, "max_training_steps": 6}, 1, "The loss is nan at step"),
    ],
)
def test_bad_input_gives_one_clear_message(
    tmp_path, data_cache, tiny_assets, overrides, nproc, expected
):
    args = tiny_args(tiny_assets, tmp_path / "run", data_cache, **overrides)
    result = run_finetune(nproc, args, torchrun=nproc > 1)  # torchrun's report is checked
    assert result.returncode != 0
    assert expected in result.stderr, result.stderr[-3000:]
    workers, torchrun = _split_torchrun_report(result.stderr)
    # Printed once, by rank 0 (with 2 ranks that each find the mistake, torchrun may stop rank 0
    # before it prints, if rank 1 exits first on a loaded machine: then only the report has it).
    assert workers.count(expected) == 1 if nproc == 1 else workers.count(expected) <= 1
    assert (
        "Traceback" not in workers
    )  # torchrun reports a failed worker with a traceback of its own
    if nproc > 1:  # ... which ends with the message too, whichever rank it names
        assert expected in _last_lines(torchrun), torchrun[-3000:]
    if "total_batch_size" in overrides:
        assert "model:" not in result.stdout  # failed before any model was loaded


def _split_torchrun_report(stderr: str) -> tuple[str, str]:
    """(what the workers wrote, torchrun's own closing report)."""
    match = re.search(r"Traceback \(most recent call last\):\n  File \"[^\"]*torchrun\"", stderr)
    return (stderr, "") if match is None else (stderr[: match.start()], stderr[match.start() :])


def _last_lines(text: str, count: int = 8) -> str:
    return "\n".join([line for line in text.splitlines() if line.strip()][-count:])


def test_a_data_error_on_rank_0_ends_every_rank_quietly_with_the_message_last(
    tmp_path, data_cache, tiny_assets
):
    """Rank 0 prepares the data while the others wait. When it finds a mistake, every rank
    ends; only rank 0's paragraph is printed (no gloo "Connection closed by peer" traceback
    from the others), and torchrun's closing report ends with it."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"foo": f"row {i}"}) + "\n" for i in range(50)))
    args = tiny_args(tiny_assets, tmp_path / "run", data_cache, dataset=data)
    result = run_finetune(2, args, torchrun=True)  # torchrun's closing report is checked
    assert result.returncode != 0
    workers, torchrun = _split_torchrun_report(result.stderr)
    assert workers.count("error: ") == 1, result.stderr[-4000:]
    message = workers[workers.index("error: ") :].strip().splitlines()[0]
    assert "foo" in message  # names what the data has
    for noise in ("Traceback", "Connection closed", "ProcessGroupGloo", "[rank1]"):
        assert noise not in workers, noise
    # The report's root cause, exit 2, has the message as its last lines (rank 0, or rank 1,
    # which carries the message too). Rank 1 exits 2 too, unless torchrun, which stops the
    # remaining workers once one has failed, terminates it first (SIGTERM: -15).
    root = torchrun[torchrun.index("Root Cause") :]
    assert re.search(r"rank\s*: [01] .*\n.*exitcode\s*: (2|-15) ", root), root
    others = torchrun[: torchrun.index("Root Cause")]
    assert set(re.findall(r"exitcode\s*: (-?\d+)", others)) <= {"2", "-15"}, others
    assert message in _last_lines(torchrun), torchrun[-3000:]
    # ... and status.json keeps it for slurm/finetune.sh, which repeats it last.
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "failed" and f"error: {status['user_error']}" == message


def test_sharding_strategies_and_offload_change_memory_not_the_math(
    tmp_path, data_cache, tiny_assets
):
    """fp32: full, shard_grad_op, hybrid (2-D mesh), no_shard and CPU offload give the same
    losses; the low-precision modes stay close."""
    variants = {
        "full": {},
        "shard_grad_op": {"sharding": "shard_grad_op"},
        "hybrid": {"sharding": "hybrid"},
        "no_shard": {"sharding": "no_shard"},
        "cpu_offload": {"cpu_offload": True},
        "bf16-mixed": {"precision": "bf16-mixed"},
        "fp16-mixed": {"precision": "fp16-mixed"},
        "bf16-true + sgd": {"precision": "bf16-true", "optimizer": "sgd"},
    }
    folders = {name: tmp_path / name.replace(" ", "").replace("+", "_") for name in variants}
    argv = {
        name: tiny_args(
            tiny_assets, folders[name], data_cache, max_training_steps=3, no_final_save=True,
            **overrides,
        )
        for name, overrides in variants.items()
    }  # fmt: skip
    _all_ok(run_finetunes(2, argv, tmp_path / "runs"))
    losses = {name: _losses(folder) for name, folder in folders.items()}
    assert len(losses["full"]) == 3
    for name in ("shard_grad_op", "hybrid", "no_shard", "cpu_offload"):
        assert losses[name] == pytest.approx(losses["full"], rel=1e-5), name
    for name in ("bf16-mixed", "fp16-mixed"):
        assert losses[name] == pytest.approx(losses["full"], rel=5e-3), name
    assert losses["bf16-true + sgd"][0] == pytest.approx(losses["full"][0], rel=5e-3)
