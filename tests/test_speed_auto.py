"""--auto's search and the planner's fixes, with real traces: the fewest checkpointed layers that
fit, the bound between traced plans, nothing fitting, a flag the user gave, the choice a run
makes once and reads back, and issue 64's 70B case (its first fix a sharding change)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
from pathlib import Path

import pytest
import torch

from fsdp_utils.cli import make_parser
from fsdp_utils.config.parse import parse_config
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.plan import main, plan_memory, site
from fsdp_utils.plan.auto import _Memory, search
from fsdp_utils.plan.estimate import Cluster
from fsdp_utils.plan.hardware import GIB, GPU_PRESETS, Gpu
from fsdp_utils.plan.planner import evaluate as _REAL_EVALUATE
from fsdp_utils.plan.report import Margin
from fsdp_utils.plan.speed import speed_model
from fsdp_utils.synthetic import tiny_model_config

REPO = Path(__file__).resolve().parent.parent
NO_MARGIN = Margin(runtime_bytes=0, allocator_fraction=0.0)
LAYERS = 3
CLUSTER = Cluster(1, 2)

pytestmark = pytest.mark.usefixtures("own_site")  # each test a speed site of its own


_PLANS: dict[tuple, object] = {}


def _evaluate_once(config, cluster, gpu, margin, *, full_trace=False):
    """`planner.evaluate`, each configuration traced once in this module: the search, the
    fixes and the tests plan the same ones again (no and every layer checkpointed, the
    winner), and a trace on fake tensors has no randomness (as tests/test_plan_estimate.py
    does). The key counts the checkpointed layers, however the flags say it."""
    from fsdp_utils.plan.workload import checkpointed_layers

    layers = json.loads((Path(config.model) / "config.json").read_text())["num_hidden_layers"]
    normal = config.replace(
        checkpoint_layers=checkpointed_layers(config, layers),
        gradient_checkpointing=False,
        checkpoint_every_n_layers=1,
        auto=False,
        auto_keep="",
    )
    key = (normal.to_json(), cluster, gpu, margin, full_trace)
    if key not in _PLANS:
        _PLANS[key] = _REAL_EVALUATE(config, cluster, gpu, margin, full_trace=full_trace)
    return _PLANS[key]


@pytest.fixture(autouse=True)
def _trace_each_configuration_once(monkeypatch):
    from fsdp_utils.plan import auto, planner

    monkeypatch.setattr(planner, "evaluate", _evaluate_once)
    monkeypatch.setattr(auto, "evaluate", _evaluate_once)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    tiny_model_config("llama", vocab_size=512, num_layers=LAYERS).save_pretrained(folder)
    return folder


def _config(model: Path, **overrides) -> TrainConfig:
    values = {
        "model": str(model), "total_batch_size": 8, "batch_size_per_device": 2,
        "max_seq_length": 128, "precision": "fp32",
    }  # fmt: skip
    return TrainConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def checkpointing(model) -> dict[int, int]:
    """The exact (traced) peak of the run with 0..LAYERS checkpointed layers."""
    peaks = {}
    for c in range(LAYERS + 1):
        config = _config(model, checkpoint_layers=c)
        peaks[c] = _evaluate_once(config, CLUSTER, None, NO_MARGIN).peak_bytes
    return peaks


def test_the_bound_between_traced_plans_holds_and_falls(model, checkpointing):
    """The search's memory for 1..L-1 checkpointed layers, on the line between the plans with
    none and with every layer checkpointed, is never below the full trace, and never rises
    with more checkpointed layers."""
    memory = _Memory(CLUSTER, Gpu("H100-80GB", 80 * GIB), NO_MARGIN, lambda _: None, False)
    bound = {}
    for c in range(LAYERS + 1):
        candidate = _config(model, checkpoint_layers=c, gradient_checkpointing=c > 0)
        bound[c], _ = memory.of(candidate, LAYERS, pinned_checkpointing=False)
        assert bound[c] >= checkpointing[c]
    assert all(bound[c + 1] <= bound[c] for c in range(LAYERS))
    assert checkpointing[LAYERS] < checkpointing[0]
    assert memory.traced == 2  # none and every layer, each planned once


def test_auto_picks_the_fewest_checkpointed_layers_that_fit(model, checkpointing):
    """A GPU that holds the run only with some layers checkpointed: the winner checkpoints the
    fewest layers whose (bounded) memory fits, and the planner, tracing it, agrees it fits."""
    budget = (checkpointing[0] + checkpointing[LAYERS]) // 2
    gpu = Gpu(GPU_PRESETS["h100-80gb"].name, budget)
    keep = "sharding,batch_size_per_device,sequence_parallel,compile,cpu_offload"
    config = _config(model, auto=True, auto_keep=keep)
    speed = speed_model(config, gpu, required="--auto")
    assert speed is not None
    result = search(config, CLUSTER, gpu, speed, margin=NO_MARGIN)
    winner = result.winner
    assert winner is not None and winner.fits
    chosen = winner.settings()["checkpoint_layers"]
    assert 0 < chosen < LAYERS
    assert checkpointing[chosen - 1] > budget  # one fewer does not fit, even traced exactly
    plan = plan_memory(
        winner.config, nodes=1, gpus_per_node=2, gpu_memory_bytes=budget, margin=NO_MARGIN
    )
    assert plan.fits
    # the settings it was told to keep, kept
    assert winner.settings()["batch_size_per_device"] == 2
    assert winner.settings()["sharding"] == "full"


def test_nothing_fits_exits_1_with_the_planners_fixes(model, capsys):
    argv = [
        "--model", str(model), "--total_batch_size", "8", "--max_seq_length", "64",
        "--gpus_per_node", "2", "--gpu_memory", "h100-80gb", "--margin_runtime", "80GiB", "--auto",
    ]  # fmt: skip
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "--auto: no configuration fits" in out
    assert "verdict: DOES NOT FIT" in out
    assert "combine several of these" in out or "Changes that make it fit" in out


def test_a_flag_auto_would_choose_is_kept(model, capsys):
    """--batch_size_per_device given: --auto keeps it and chooses the rest (documented)."""
    argv = [
        "--model", str(model), "--total_batch_size", "8", "--max_seq_length", "64",
        "--gpus_per_node", "2", "--gpu_memory", "h100-80gb", "--auto", "--json",
        "--batch_size_per_device", "1",
    ]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    assert "batch_size_per_device" in record["kept"]
    assert record["settings"]["batch_size_per_device"] == 1
    assert all(c["settings"]["batch_size_per_device"] == 1 for c in record["candidates"])
    assert record["predicted"]["tokens_per_s_per_gpu"] > 0
    assert record["flags"].startswith("--sharding")


def _in_process(command: list[str]) -> tuple[int, str, str]:
    """The planner's command, run here rather than in a child process (the same `main`)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(command[3:])
    return code, out.getvalue(), err.getvalue()


def _auto_run(model: Path, output_dir: Path) -> TrainConfig:
    """A training command's config with --auto, as the run parses it."""
    config, _ = parse_config(
        ["--model", str(model), "--total_batch_size", "8", "--max_seq_length", "64",
         "--precision", "fp32", "--device", "cpu", "--output_dir", str(output_dir), "--auto"],
        make_parser(),
    )  # fmt: skip
    return config


def test_a_run_chooses_once_and_reads_the_choice_back(model, tmp_path, monkeypatch):
    from fsdp_utils.run import speed as run_speed

    calls: list[list[str]] = []

    def planner(command: list[str]) -> tuple[int, str, str]:
        calls.append(command)
        return _in_process(command)

    monkeypatch.setattr(run_speed, "_run_planner", planner)
    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
    config = _auto_run(model, tmp_path / "run")
    resolved, notes = run_speed.resolve_auto(config, env)
    assert len(calls) == 1 and "--auto" in calls[0]
    assert notes[0].startswith("auto: chose --sharding")
    record = json.loads((tmp_path / "run" / "auto.json").read_text())
    assert resolved.batch_size_per_device == record["settings"]["batch_size_per_device"]
    assert resolved.checkpoint_layers == record["settings"]["checkpoint_layers"]
    # a requeued leg: the same request, read back, no search
    again, notes = run_speed.resolve_auto(config, env)
    assert len(calls) == 1 and "read back" in notes[0] and again == resolved
    # another request (more sequences a step): searched again, and said
    _, notes = run_speed.resolve_auto(config.replace(total_batch_size=16), env)
    assert len(calls) == 2 and "searching again" in notes[0]


def test_issue_64_the_70b_hybrid_plan_is_told_to_shard_fully_first(capsys):
    """Llama-2-70B's shape, 64 nodes x 8 H100s, hybrid sharding: the state alone does not fit
    a node's 8 GPUs; full sharding over 512 does, and is the first fix; offload comes last;
    what cannot help (a smaller batch, sequence parallelism, more nodes for hybrid) is skipped
    before any trace, one line each."""
    config = TrainConfig(
        model=str(REPO / "tests/fixtures/configs/codellama-70b"), total_batch_size=1024,
        max_seq_length=4096, batch_size_per_device=2, sharding="hybrid",
        gradient_checkpointing=True,
    )  # fmt: skip
    gpu = GPU_PRESETS["h100-80gb"]
    plan = plan_memory(
        config, nodes=64, gpus_per_node=8, gpu_memory_bytes=gpu.memory_bytes, gpu_name=gpu.name,
        speed=speed_model(config, gpu),
    )  # fmt: skip
    assert plan.fits is False
    fitting = [fix for fix in plan.fixes if fix.fits]
    assert fitting[0].flags == "--sharding full"
    assert fitting[-1].flags == "--cpu_offload"
    assert all(fix.tokens_per_s for fix in fitting)
    assert fitting[0].tokens_per_s > fitting[-1].tokens_per_s
    assert not any(fix.flags.startswith(("--sequence_parallel", "--nodes")) for fix in plan.fixes)
    skipped = "\n".join(plan.skipped)
    assert "--sequence_parallel" in skipped and "more --nodes" in skipped
    assert "a smaller --batch_size_per_device" in skipped
    assert "--sharding no_shard" in skipped


def test_a_training_run_with_auto_on_a_calibrated_cpu(tiny_assets, tmp_path):
    """chess_finetune.py --auto on 1 CPU process whose CPU the site has figures for: the choice
    is made before the model (its table in the log, the values in config.json, auto.json in the
    run folder), the prediction printed at the start, the measurement beside it at the end, and
    the run's row added to the site's rows."""
    from fsdp_utils.plan.speed import UNCALIBRATED_CPU
    from tests.train_helpers import run_finetune

    site_dir = Path(os.environ[site.SITE_ENV])  # this test's own (`own_site`)
    site.write_calibration(site.cpu_key(), UNCALIBRATED_CPU, {"processes": 1})
    env = {site.SITE_ENV: str(site_dir)}
    out = tmp_path / "run"
    result = run_finetune(
        1,
        ["--model", str(tiny_assets["model"]), "--dataset", str(tiny_assets["data"]),
         "--dataset_include", "", "--output_dir", str(out), "--data_cache_dir", str(tmp_path / "cache"),
         "--max_seq_length", "64", "--total_batch_size", "4", "--max_training_steps", "6",
         "--log_every", "1", "--eval_every", "0", "--eval_examples", "0", "--no_final_save",
         "--device", "cpu", "--auto"],
        env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    log = result.stdout
    assert "auto: chose --sharding" in log and "chosen:" in log
    record = json.loads((out / "auto.json").read_text())
    config = json.loads((out / "config.json").read_text())
    resolved = config.get("config", config)
    assert resolved["batch_size_per_device"] == record["settings"]["batch_size_per_device"]
    assert resolved["checkpoint_layers"] == record["settings"]["checkpoint_layers"]
    assert "speed: predicted" in log and "speed: measured" in log
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    check = next(e for e in events if e.get("kind") == "speed_check")
    assert (
        check["predicted_tokens_per_s_per_gpu"] > 0 and check["measured_tokens_per_s_per_gpu"] > 0
    )
    rows = (site_dir / "runs.jsonl").read_text().splitlines()
    assert len(rows) == 1 and json.loads(rows[0])["device_key"] == site.cpu_key()


def test_a_calibrated_gpu_without_a_data_sheet_is_timed_by_the_runs_search():
    """The child search of a training run's --auto gets the GPU's name with its own memory, and
    finds the kind --calibrate stored (`gpu:<name>`): a GH200 is timed, its 95.6 GiB planned."""
    from fsdp_utils.plan.cli import Target
    from fsdp_utils.plan.cli import make_parser as plan_parser
    from fsdp_utils.plan.hardware import MIB
    from fsdp_utils.plan.speed import UNCALIBRATED_CPU
    from fsdp_utils.run.speed import _gpu_flag

    gpu = Gpu("NVIDIA GH200 480GB", 97871 * MIB)
    device = dataclasses.replace(UNCALIBRATED_CPU, name=gpu.name, kind="gpu")
    site.write_calibration(f"gpu:{gpu.name}", device, {"processes": 1})
    target = Target.from_args(plan_parser().parse_args(["--gpus_per_node", "4", *_gpu_flag(gpu)]))
    assert target.gpu == gpu
    speed = speed_model(TrainConfig(), target.gpu, required="--auto")
    assert speed is not None and speed.key == f"gpu:{gpu.name}"


def test_a_run_reads_back_the_preflights_choice_without_max_seq_length(
    tiny_assets, tmp_path, monkeypatch
):
    """--max_seq_length not given: the preflight's search gets check_run's config (the length
    fitted to the model), and the run asks the same request, so its first leg reads the choice
    back instead of searching again."""
    import subprocess

    from fsdp_utils.run import preflight
    from fsdp_utils.run import speed as run_speed

    def planner_here(command: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        code, out, err = _in_process(command)
        return subprocess.CompletedProcess(command, code, out, err)

    def no_search(command: list[str]) -> tuple[int, str, str]:
        raise AssertionError(f"searched again: {command}")

    config, _ = parse_config(
        ["--model", str(tiny_assets["model"]), "--dataset", str(tiny_assets["data"]),
         "--dataset_include", "", "--total_batch_size", "4", "--precision", "fp32",
         "--device", "cpu", "--output_dir", str(tmp_path / "run"), "--auto"],
        make_parser(),
    )  # fmt: skip
    assert config.max_seq_length is None
    checked = preflight.check_run(config, 1).config
    monkeypatch.setattr(preflight.subprocess, "run", planner_here)
    line = preflight.check_memory(checked, 1, 1, ["--gpu_memory", "4GiB"])
    assert line.startswith("auto: chosen:"), line
    monkeypatch.setattr(run_speed, "_run_planner", no_search)
    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
    resolved, notes = run_speed.resolve_auto(config, env)
    assert "read back" in notes[0]
    assert resolved.max_seq_length is None  # fitted again, with its note, by check_run


def test_the_settings_applied_are_rank_0s_not_the_file_read_again(model, tmp_path, monkeypatch):
    """Every rank applies the settings rank 0 chose, sent through the process group: a node
    whose file system still serves an older auto.json (NFS caches) must not apply that one.
    Here any read of the file once rank 0 has written its choice sees a stale one (one
    process: the other ranks' side is `broadcast_object`, rank 0's value on every rank)."""
    from fsdp_utils.run import speed as run_speed

    monkeypatch.setattr(run_speed, "_run_planner", _in_process)
    write, read = run_speed.write_json_atomic, run_speed._read
    chosen: dict[str, object] = {}

    def written(path: Path, record: dict) -> None:
        write(path, record)
        chosen.update(record["settings"])

    def stale_once_chosen(path: Path) -> dict | None:
        record = read(path)
        if record is not None and chosen:
            other = 1 if chosen["batch_size_per_device"] != 1 else 2
            record["settings"] = {**chosen, "batch_size_per_device": other}
        return record

    monkeypatch.setattr(run_speed, "write_json_atomic", written)
    monkeypatch.setattr(run_speed, "_read", stale_once_chosen)
    config = _auto_run(model, tmp_path / "run")
    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
    resolved, _ = run_speed.resolve_auto(config, env)
    assert chosen and resolved.batch_size_per_device == chosen["batch_size_per_device"]


def test_offload_is_tried_when_the_first_round_spent_its_traces(model, monkeypatch):
    """The first round's traces do not use up offload's: with a budget of 2 traces a round, a
    run that fits only with --cpu_offload is still found (the memory is a stand-in here:
    nothing fits without offload, everything with it)."""
    from types import SimpleNamespace

    from fsdp_utils.plan import auto

    gpu = Gpu("H100-80GB", 80 * GIB)

    def evaluate(config, cluster, gpu_, margin, *, full_trace=False):
        peak = GIB if config.cpu_offload else 2 * gpu.memory_bytes
        return SimpleNamespace(
            peak_bytes=peak, required_bytes=peak, forward_backward_peak_bytes=peak,
            update_peak_bytes=peak, peak_in_optimizer_step=False, rollout=None,
        )  # fmt: skip

    monkeypatch.setattr(auto, "evaluate", evaluate)
    monkeypatch.setattr(auto, "MAX_TRACES", 2)
    config = _config(model, precision="bf16-mixed")
    speed = speed_model(config, gpu)
    assert speed is not None
    result = search(config, CLUSTER, gpu, speed, margin=NO_MARGIN)
    assert result.winner is not None and result.winner.config.cpu_offload
    assert result.traced > 2
