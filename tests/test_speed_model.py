"""The step-time model's structure (fsdp_utils/plan/step_time.py and around it), without traces:
what more checkpointing, larger micro-batches and more GPUs must do to a prediction, the GPU
kinds and fabrics, the fit to measured rows, the site's files, and the run's comparison."""

from __future__ import annotations

import dataclasses
import itertools
import json
import tarfile
from pathlib import Path

import pytest

from fsdp_utils.config.parse import parse_config
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.metrics.prediction import MEASURED_STEPS, WARMUP_STEPS, Prediction, SpeedCheck
from fsdp_utils.plan import site
from fsdp_utils.plan.efficiency import SpeedRow, fit
from fsdp_utils.plan.estimate import Cluster
from fsdp_utils.plan.hardware import GPU_SPECS, INTERCONNECTS, Gpu, fabric_bandwidth, gpu_spec
from fsdp_utils.plan.measured import ROWS
from fsdp_utils.plan.speed import speed_model
from fsdp_utils.plan.step_time import Efficiency, RunShape, predict
from tests.train_helpers import bench_module

REPO = Path(__file__).resolve().parent.parent
SHIPPED = [SpeedRow.from_dict(row) for row in ROWS]
ONE_B = next(r for r in SHIPPED if r.name.startswith("1b-bf16 "))
EIGHT_B = next(r for r in SHIPPED if r.name.startswith("8b-lora-4k"))
H100 = site.sheet_device("h100-80gb", TrainConfig())
EFF = Efficiency()
CLUSTERS = [Cluster(1, 1), Cluster(1, 8), Cluster(16, 8)]

pytestmark = pytest.mark.usefixtures("own_site")  # each test a speed site of its own


def _shape(row: SpeedRow, **changes) -> RunShape:
    return dataclasses.replace(row.shape, **changes)


@pytest.mark.parametrize("row", [ONE_B, EIGHT_B], ids=["1b", "8b-lora"])
@pytest.mark.parametrize("cluster", CLUSTERS, ids=["1", "8", "128"])
@pytest.mark.parametrize("sharding", ["full", "hybrid", "shard_grad_op"])
def test_more_checkpointed_layers_never_predict_less_time(row, cluster, sharding):
    seconds = [
        predict(
            row.facts, _shape(row, checkpointed_layers=c, sharding=sharding), cluster, H100, EFF
        ).seconds
        for c in range(row.facts.layers + 1)
    ]
    assert all(b >= a for a, b in itertools.pairwise(seconds))
    assert seconds[-1] > seconds[0]  # the recompute costs something


@pytest.mark.parametrize("row", [ONE_B, EIGHT_B], ids=["1b", "8b-lora"])
@pytest.mark.parametrize("cluster", CLUSTERS, ids=["1", "8", "128"])
@pytest.mark.parametrize("checkpointed", [0, 7])
def test_a_larger_micro_batch_never_predicts_fewer_tokens_per_s(row, cluster, checkpointed):
    """The total batch held: b sequences per micro-batch, 32 / b micro-batches a step."""
    speeds = [
        predict(
            row.facts,
            _shape(row, micro_batch=b, accumulation=32 // b, checkpointed_layers=checkpointed),
            cluster, H100, EFF,
        ).tokens_per_s_per_gpu
        for b in (1, 2, 4, 8, 16, 32)
    ]  # fmt: skip
    assert all(b >= a for a, b in itertools.pairwise(speeds))


def test_terms_sum_to_the_step_and_say_what_they_count():
    step = ONE_B.predict(EFF)
    assert step.seconds == pytest.approx(sum(t.seconds for t in step.terms))
    assert step.tokens_per_gpu == 4 * 2048
    assert step.tokens_per_s_per_gpu == pytest.approx(8192 / step.seconds)
    names = [t.name for t in step.terms]
    assert names[:5] == ["compute", "elementwise", "dispatch", "FSDP2 copies", "collectives"]
    text = "\n".join(step.lines())
    assert "989.0 TFLOP/s" in text and "tokens/s per GPU" in text
    # LoRA on one GPU: no optimizer traffic to speak of, no collectives
    lora = EIGHT_B.predict(EFF)
    assert lora.term("optimizer") < 0.01 * lora.seconds
    assert lora.term("collectives") == 0


def test_offload_sequence_parallel_and_qlora_add_their_terms():
    base = ONE_B.predict(EFF)
    offloaded = predict(ONE_B.facts, _shape(ONE_B, cpu_offload=True), Cluster(1, 1), H100, EFF)
    assert offloaded.seconds > 5 * base.seconds  # the host's AdamW over 1.1B parameters
    split = predict(ONE_B.facts, _shape(ONE_B, sequence_parallel=2), Cluster(1, 2), H100, EFF)
    assert split.term("all-to-all") > 0
    qlora = next(r for r in SHIPPED if r.name.startswith("8b-qlora"))
    assert qlora.predict(EFF).term("dequantize") > 0


def test_fabric_and_sharding_scale_as_they_should():
    """Full sharding over 16 nodes moves every layer over the fabric; hybrid moves a node's
    shard; a slower fabric never helps."""
    shape = _shape(EIGHT_B, micro_batch=1)
    full = predict(
        EIGHT_B.facts, dataclasses.replace(shape, sharding="full"), Cluster(16, 8), H100, EFF
    )
    hybrid = predict(
        EIGHT_B.facts, dataclasses.replace(shape, sharding="hybrid"), Cluster(16, 8), H100, EFF
    )
    slow = dataclasses.replace(H100, fabric_bandwidth=H100.fabric_bandwidth / 8)
    slower = predict(
        EIGHT_B.facts, dataclasses.replace(shape, sharding="full"), Cluster(16, 8), slow, EFF
    )
    assert slower.seconds >= full.seconds
    assert full.term("collectives") >= hybrid.term("collectives")


def test_unknown_gpu_kinds_and_interconnects_name_the_known_ones():
    with pytest.raises(ValueError) as kind:
        gpu_spec("b300")
    assert all(name in str(kind.value) for name in GPU_SPECS)
    with pytest.raises(ValueError) as fabric:
        fabric_bandwidth("myrinet", None, GPU_SPECS["h100-80gb"])
    assert all(name in str(fabric.value) for name in INTERCONNECTS)
    assert "--fabric_gbps" in str(fabric.value)
    assert fabric_bandwidth(None, 100, GPU_SPECS["h100-80gb"]) == 12.5e9
    with pytest.raises(ValueError, match="h100-80gb"):  # a size says the memory, not the kind
        speed_model(TrainConfig(), Gpu("", 80 * 2**30), required="--auto")
    assert speed_model(TrainConfig(), Gpu("", 80 * 2**30)) is None


def test_the_shipped_rows_are_the_gpu_kits_measurements():
    """fsdp_utils/plan/measured.py against the raw results (bench/speed_rows.py writes it)."""
    rows_script = bench_module("speed_rows")
    for row in ROWS:
        result = REPO / row["source"]
        archive = result.with_name(result.name.replace("gpu_check.json", "logs.tar.gz"))
        name = row["name"].split(" (")[0]
        with tarfile.open(archive) as tar:
            member = tar.extractfile(f"logs/{name}.metrics.jsonl")
            assert member is not None
            records = [json.loads(line) for line in member.read().decode().splitlines()]
        assert row["step_seconds"] == pytest.approx(
            rows_script.steady_step_seconds(records), abs=1e-5
        )
        measured = next(r for r in json.loads(result.read_text())["rows"] if r["name"] == name)
        assert row["peak_allocated_gib"] == pytest.approx(measured["peak_allocated_gib"], abs=1e-3)
        assert row["facts"]["seq_length"] == measured["seq"]
        assert row["shape"]["micro_batch"] == measured["batch"]
    assert len(ROWS) >= 8


def test_a_measured_rows_flags_are_read_as_the_training_command_reads_them():
    """bench/speed_rows.py after the next call: an *-auto row's chosen micro-batch and
    1b-loss-2097's chunk are numbers (not "16", "2097": plan_batch's TypeError), read by the
    project's own parser."""
    from fsdp_utils.config.batch import plan_batch

    rows_script = bench_module("speed_rows")
    auto = {"seq": 2048, "batch": 16, "total": 16, "flags": [
        "--precision", "bf16-mixed", "--sharding", "full", "--checkpoint_layers", "0",
        "--batch_size_per_device", "16", "--compile"]}  # fmt: skip
    config = rows_script.row_config(auto, "1b")
    assert (config.batch_size_per_device, config.checkpoint_layers, config.compile) == (16, 0, True)
    assert plan_batch(config, 1).gradient_accumulation_steps == 1
    chunk = {"seq": 2048, "batch": 4, "flags": [
        "--precision", "bf16-mixed", "--compile", "--loss_chunk_size", "2097"]}  # fmt: skip
    config = rows_script.row_config(chunk, "1b")
    assert config.loss_chunk_size == 2097 and config.total_batch_size == 4
    assert plan_batch(config, 1).batch_size_per_device == 4


def test_the_fit_moves_the_shares_toward_the_rows():
    prior = Efficiency()

    def error(eff: Efficiency) -> float:
        return sum(abs(r.step_seconds / r.predict(eff).seconds - 1) for r in SHIPPED)

    fitted = fit(SHIPPED, prior)
    assert error(fitted) < error(prior)
    assert fitted.rows == len(SHIPPED) and fitted.site_rows == 0
    assert fit([], prior) == prior  # nothing to fit: the priors


def test_the_site_remembers_calibrations_and_runs(tmp_path):
    config = TrainConfig()
    assert site.calibrated_device("h100-80gb", config) is None
    measured = dataclasses.replace(
        H100, matmul_table=((1024.0, 4096.0, 7e14),), source="calibrated"
    )
    site.write_calibration("h100-80gb", measured, {"processes": 8})
    assert site.calibrated_device("h100-80gb", config) == measured
    # a faster fabric given on the command line wins over the one node's guess
    faster = site.calibrated_device("h100-80gb", config.replace(fabric_gbps=800.0))
    assert faster is not None and faster.fabric_bandwidth == 100e9
    row = dataclasses.replace(ONE_B, device=H100)
    site.append_run(row, "h100-80gb")
    site.append_run(row, "h100-80gb")
    (site.runs_file()).open("a").write('{"device_key": "h100-80gb", "cut sh')  # a killed job
    assert len(site.site_rows("h100-80gb", calibrated=False)) == 2
    assert site.site_rows("a100-80gb", calibrated=False) == []
    eff = site.efficiency_for("h100-80gb", H100)
    assert (eff.rows, eff.site_rows) == (len(SHIPPED) + 2, 2)


def test_auto_keeps_what_the_user_gave(tmp_path):
    from fsdp_utils.plan.cli import make_parser

    config, _ = parse_config(
        ["--auto", "--batch_size_per_device", "2", "--gradient_checkpointing"], make_parser()
    )
    assert config.auto_keep == "checkpoint_layers,batch_size_per_device"
    config, _ = parse_config(
        ["--auto", "--auto_keep", "compile", "--sharding", "full"], make_parser()
    )
    assert config.auto_keep == "compile,sharding"  # yours first, then what you gave
    # a config file written by the toolkit (every field) pins only what is not a default
    written = tmp_path / "config.json"
    written.write_text(TrainConfig(auto=True, batch_size_per_device=4).to_json())
    config, _ = parse_config(["--config", str(written)], make_parser())
    assert config.auto_keep == "batch_size_per_device"
    for argv, message in [
        (["--auto_keep", "sharding"], "--auto_keep says what --auto must not change"),
        (["--auto", "--auto_keep", "learning_rate"], "not a setting --auto chooses"),
        (["--checkpoint_layers", "2", "--checkpoint_every_n_layers", "2"], "give one of the two"),
        (["--checkpoint_layers", "-1"], "0 or more"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_config(argv, make_parser())


def test_checkpoint_layers_wraps_the_first_layers():
    from torch import nn

    from fsdp_utils.parallel.parallelize import apply_activation_checkpointing

    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])
    layers = apply_activation_checkpointing(model, list(model), first_n=2)
    wrapped = [type(layer).__name__ == "CheckpointWrapper" for layer in layers]
    assert wrapped == [True, True, False, False, False]


def _records(times: list[float], cpu: list[float]) -> list[dict]:
    return [
        {"step": i + 1, "step_time_s": t, "process_cpu_s": c, "cuda_peak_allocated_gib": 10.0}
        for i, (t, c) in enumerate(zip(times, cpu, strict=True))
    ]


def test_the_run_says_once_how_the_measurement_compares():
    prediction = Prediction(1000.0, 1.0, 1000.0, "H100 data sheet", peak_gib=10.0)
    check = SpeedCheck(prediction)
    steps = WARMUP_STEPS + MEASURED_STEPS
    times = [9.0] * WARMUP_STEPS + [1.5] * MEASURED_STEPS
    said = [check.observe(r) for r in _records(times, list(range(steps)))]
    assert all(not lines for lines in said[:-1])
    first, off = said[-1]
    assert "measured 667 tokens/s per GPU, predicted 1,000: -33%" in first
    assert "peak 10.00 GiB allocated, predicted 10.00: +0.0%" in first
    assert "33% slower than predicted" in off
    assert check.report(steps) == []  # once
    close = SpeedCheck(prediction)
    times = [9.0] * WARMUP_STEPS + [1.2] * MEASURED_STEPS
    lines = [line for r in _records(times, list(range(steps))) for line in close.observe(r)]
    assert len(lines) == 1 and "-17%" in lines[0]  # within 25%: no second line


def test_a_cpu_run_is_measured_in_cpu_seconds():
    check = SpeedCheck(Prediction(1000.0, 1.0, 1000.0, "this CPU", clock="cpu"))
    records = _records([5.0] * 9, [0.0, 1, 2, 3, 4.0, 5.0, 6.0, 7.0, 8.0])
    lines = [line for r in records for line in check.observe(r)]
    assert check.measured_step_seconds == 1.0  # the wall clock's 5 s of a loaded machine left out
    assert lines and "+0%" in lines[0] and "per CPU second" in lines[0]


def test_a_calibrated_kind_without_a_data_sheet_takes_the_fabric_given_or_a_named_one():
    """One node cannot measure the fabric: a GPU kind without a data sheet is not assumed as
    fast between nodes as NVLink (what a calibration of it once stored), the flags set it, and
    without them InfiniBand NDR is assumed and said."""
    key = "gpu:NVIDIA GH200 480GB"
    measured = dataclasses.replace(H100, name="NVIDIA GH200 480GB", fabric_bandwidth=450e9)
    site.write_calibration(key, measured, {"processes": 4})
    config = TrainConfig()
    assumed = site.calibrated_device(key, config)
    assert assumed is not None and assumed.fabric_bandwidth == 400e9 / 8
    assert "InfiniBand NDR" in assumed.source and "assumed" in assumed.source
    hdr = site.calibrated_device(key, config.replace(interconnect="hdr"))
    assert hdr is not None and hdr.fabric_bandwidth == 200e9 / 8 and "assumed" not in hdr.source
    given = site.calibrated_device(key, config.replace(fabric_gbps=100.0))
    assert given is not None and given.fabric_bandwidth == 100e9 / 8


def test_an_fp32_run_on_a_calibrated_gpu_is_timed_at_the_sheets_fp32_rate():
    """--calibrate measures a GPU's products in bf16: an fp32 run on that kind takes its data
    sheet (and says so); a kind without a sheet cannot be timed in fp32, and --auto says why."""
    measured = dataclasses.replace(
        H100, matmul_table=((1024.0, 4096.0, 7e14),), source="calibrated"
    )
    site.write_calibration("h100-80gb", measured, {"processes": 8})
    gpu = Gpu("NVIDIA H100 80GB HBM3", 80 * 2**30)
    bf16 = speed_model(TrainConfig(precision="bf16-mixed"), gpu)
    assert bf16 is not None and bf16.device.matmul_table
    fp32 = speed_model(TrainConfig(precision="fp32"), gpu)
    assert fp32 is not None and not fp32.device.matmul_table
    assert fp32.device.matmul_flops == GPU_SPECS["h100-80gb"].fp32_flops
    assert "fp32" in fp32.describe()
    other = Gpu("NVIDIA GH200 480GB", 96 * 2**30)
    site.write_calibration(f"gpu:{other.name}", dataclasses.replace(measured, name=other.name), {})
    assert speed_model(TrainConfig(precision="bf16-mixed"), other) is not None
    assert speed_model(TrainConfig(precision="fp32"), other) is None
    with pytest.raises(ValueError, match="bf16"):
        speed_model(TrainConfig(precision="fp32"), other, required="--auto")


def test_scaling_holds_the_batch_per_gpu_of_the_planned_nodes(tmp_path):
    """--scaling on 2 nodes x 8 GPUs keeps each GPU's batch as the run has it on 16 GPUs (1
    sequence, not the 2 it would have on one node of 8)."""
    from fsdp_utils.plan.scaling import scaling_rows
    from fsdp_utils.synthetic import tiny_model_config

    tiny_model_config("llama", vocab_size=512, num_layers=2).save_pretrained(tmp_path)
    config = TrainConfig(
        model=str(tmp_path), total_batch_size=16, batch_size_per_device=1, max_seq_length=1024
    )
    speed = speed_model(config, Gpu("H100-80GB", 80 * 2**30))
    assert speed is not None
    planned = Cluster(2, 8)
    rows = scaling_rows(config, planned, speed)
    here = speed.predict(config, planned).tokens_per_gpu
    assert here == 1024 and all(row.full.tokens_per_gpu == here for row in rows)


def test_ulysses_pays_four_latencies_a_layer_pass():
    """q, k, v and the attention's output: four all-to-alls around every attention, in the
    forward, the backward and each recompute (parallel/ulysses.py), as docs/plan.md counts."""
    instant = dataclasses.replace(H100, link_bandwidth=1e30)  # the latencies alone
    shape = _shape(ONE_B, sequence_parallel=2, checkpointed_layers=3)
    step = predict(ONE_B.facts, shape, Cluster(1, 2), instant, EFF)
    passes = shape.accumulation * (2 * ONE_B.facts.layers + 3)
    assert step.term("all-to-all") == pytest.approx(passes * 4 * instant.link_latency)
