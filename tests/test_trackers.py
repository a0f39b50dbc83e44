"""TensorBoard and W&B as sinks of the run's log: what they hold, read back with their own
formats, equals metrics.jsonl; W&B runs offline with no network at all (`unshare --net`) and
continues the same W&B run after a resume; a missing wandb package is one clear paragraph."""

from __future__ import annotations

import glob
import json
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from fsdp_utils.cli import main as cli_main
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.metrics import plot
from fsdp_utils.metrics.logger import RunLogger, latest_history, read_metrics
from fsdp_utils.metrics.trackers import WANDB_INSTALL, TensorBoardSink, check_trackers
from tests.prefork import launch
from tests.train_helpers import check_ok, tiny_args

# --- reading the trackers' own files --------------------------------------------------------


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar as TensorBoard shows it (its own reader, which applies restart purges)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(folder), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_texts(folder: Path) -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(folder), size_guidance={ea.TENSORS: 0})
    acc.Reload()
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("config/text_summary")]  # fmt: skip


def expected_scalars(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """`<kind>/<field>` -> (step, value) for every number in the records, by step."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if not isinstance(r.get("step"), int):
            continue
        for key, value in r.items():
            if (
                key in ("step", "time")
                or isinstance(value, bool)
                or not isinstance(value, int | float)
            ):
                continue
            out.setdefault(f"{r['kind']}/{key}", []).append((r["step"], float(value)))
    return {tag: sorted(points) for tag, points in out.items()}


def assert_same_scalars(got: dict[str, list[tuple[int, float]]], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for tag, points in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        # TensorBoard stores float32.
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag


def wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a W&B transaction log (`run-<id>.wandb`): a LevelDB-style log
    of 32 KiB blocks after a 7-byte header, records split into full/first/middle/last pieces
    with a 7-byte header each (checksum, length, type). wandb 0.31 ships no Python reader."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    records, pos, pieces = [], 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or kind == 0:  # block padding
            pos += left
            continue
        pieces += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def wandb_history(path: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {
            i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item
        }
        for key, value in items.items():
            if not key.startswith("_"):  # W&B's own _step, _timestamp, _runtime
                out.setdefault(key, []).append((record.history.step.num, float(value)))
    return out


# --- quick: the sinks and the checks, without training -----------------------------------------


def _two_legs(run: Path, sinks: Any) -> None:
    """Leg 1 logs steps 1-5 (evals at 2 and 4, a checkpoint at 4); leg 2 resumes from step 3's
    checkpoint and logs 4-6: what leg 1 logged after step 3 is abandoned."""
    null = open(os.devnull, "w")  # noqa: SIM115
    run.mkdir(parents=True, exist_ok=True)
    for leg, (first, last) in enumerate([(1, 5), (4, 6)], start=1):
        log = RunLogger(run / "metrics.jsonl", True, 6, stream=null, sinks=sinks())
        if first > 1:
            log.event("resumed", "checkpoint: resumed", step=first - 1, path="x")
        log.config({"config": {"learning_rate": 0.001 * leg}, "resolved": {"world_size": leg}})
        log.event("start", "training", step=first - 1)
        for step in range(first, last + 1):
            log.step({"step": step, "loss": 6 - step / 10 + leg / 100, "lr": 1e-3, "grad_norm": None,
                      "tokens_per_s": 1000.0 * leg, "tokens_per_s_per_device": 500.0,
                      "mfu_pct": None, "step_time_s": 0.5, "batch_id": "abc"})  # fmt: skip
            if step % 2 == 0:
                log.eval({"step": step, "eval_loss": 7 - step / 10, "eval_perplexity": 9.0,
                          "eval_tokens": 100})  # fmt: skip
        log.event("checkpoint", "saved", step=last, seconds=0.25 * leg)
        log.close()


def test_tensorboard_shows_metrics_jsonl_and_the_later_leg_wins(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _two_legs(run, lambda: [TensorBoardSink(RunLayout.of(run).tensorboard)])
    history = latest_history(read_metrics(run))
    want = expected_scalars(history)
    assert want["train/tokens_per_s"] == [(1, 1000.0), (2, 1000.0), (3, 1000.0), (4, 2000.0),
                                          (5, 2000.0), (6, 2000.0)]  # fmt: skip
    assert_same_scalars(tensorboard_scalars(RunLayout.of(run).tensorboard), want)
    texts = tensorboard_texts(RunLayout.of(run).tensorboard)
    assert [step for step, _ in texts] == [0, 3]  # each leg's resolved config, at its start
    assert '"learning_rate": 0.002' in texts[1][1]


def test_wandb_without_the_package_names_the_install_command(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails
    with pytest.raises(ValueError, match="needs the wandb package") as err:
        check_trackers(TrainConfig(wandb="chess"))
    assert WANDB_INSTALL in str(err.value)
    # The trainer's command line (here its preflight: the same checks) turns it into exit 2.
    assert cli_main(["--preflight", "--world_size", "1", "--wandb", "chess"]) == 2
    message = capsys.readouterr().err.strip()
    assert (
        message.startswith("error: --wandb chess needs the wandb package") and "\n" not in message
    )
    assert "pip install -e '.[wandb]'" in message
    check_trackers(TrainConfig(tensorboard=True))  # nothing else needs wandb
    with pytest.raises(ValueError, match="not a W&B project name"):
        check_trackers(TrainConfig(wandb="me/chess"))


# --- slow: a real 2-process run with both trackers, in a network namespace ----------------------

NO_NETWORK_PROBE = """
import socket
try:
    socket.create_connection(("1.1.1.1", 443), timeout=3)
    print("NETWORK")
except OSError:
    print("NO-NETWORK")
"""


@pytest.fixture(scope="module")
def offline_run(tiny_assets, tmp_path_factory) -> dict[str, Any]:
    """Leg 1 stops after step 5 (checkpoints at 2, 4, 5); leg 2 resumes from step 4, as a
    requeued job would after a crash before its last save, and logs 5 and 6 again. Each leg's
    2 processes run in a network namespace with only loopback (for their process group):
    forked from tests/prefork.py's server started under `unshare --net`, where the probe
    before each leg finds no network."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root for unshare --net")
    base = tmp_path_factory.mktemp("trackers")
    run, cache = base / "run", base / "cache"
    args = tiny_args(
        tiny_assets, run, cache, max_training_steps=6, eval_every=3, save_every_steps=2,
        no_final_save=True, tensorboard=True, wandb="fsdp-utils-test",
    )  # fmt: skip
    probe = base / "probe.py"
    probe.write_text(NO_NETWORK_PROBE)
    # W&B must stay offline whatever the environment says.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "online"}
    outputs = []
    for extra in (["--stop_after_steps", "5"], ["--resume", str(run / "checkpoints" / "step_00000004")]):  # fmt: skip
        network = launch(1, str(probe), [], env=env, timeout=60, network=False)
        result = launch(
            2, "chess_finetune.py", [*args, *extra], env=env, timeout=300, network=False
        )
        check_ok(result)
        outputs.append(network.stdout + result.stdout)
    return {"run": run, "outputs": outputs}


@pytest.mark.slow
def test_offline_run_tensorboard_wandb_and_plot_hold_the_metrics(offline_run, tmp_path) -> None:
    run, outputs = offline_run["run"], offline_run["outputs"]
    assert all(out.startswith("NO-NETWORK\n") for out in outputs)
    assert "resumed from step 4" in outputs[1]
    records = read_metrics(run)
    history = latest_history(records)
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4, 5, 5, 6]

    # TensorBoard: the same scalars as metrics.jsonl (the later leg for step 5), and the config.
    layout = RunLayout.of(run)
    assert_same_scalars(tensorboard_scalars(layout.tensorboard), expected_scalars(history))
    texts = tensorboard_texts(layout.tensorboard)
    assert [s for s, _ in texts] == [0, 4] and '"world_size": 2' in texts[0][1]

    # W&B: one offline folder per leg, both of the run whose id the run folder keeps; each holds
    # its leg's metrics. The log ends with the command that uploads both.
    run_id = (layout.wandb / "run_id").read_text().strip()
    folders = sorted(glob.glob(str(layout.wandb / f"offline-run-*-{run_id}")))
    assert len(folders) == 2
    legs: list[list[dict[str, Any]]] = []
    for r in records:
        if r["kind"] == "start":
            legs.append([])
        if legs:
            legs[-1].append(r)
    for folder, leg in zip(folders, legs, strict=True):
        history_of_leg = wandb_history(Path(folder) / f"run-{run_id}.wandb")
        assert_same_scalars(history_of_leg, expected_scalars(leg))
    config = [r for r in wandb_records(Path(folders[1]) / f"run-{run_id}.wandb")
              if r.WhichOneof("record_type") == "config"]  # fmt: skip
    keys = {item.key for r in config for item in r.config.update}
    assert {"learning_rate", "total_batch_size", "resolved", "versions"} <= keys
    sync = f"wandb sync {layout.wandb.resolve()}/offline-run-*-{run_id}"
    for out in outputs:
        assert out.rstrip().endswith(sync)
        assert f"tensorboard --logdir {run.resolve().parent}" in out

    # The plot of the resumed run: one curve, the later leg's step 5, resumed at 4.
    png = tmp_path / "run.png"
    assert plot.main([str(run), "-o", str(png)]) == 0
    rows = png.with_suffix(".csv").read_text().splitlines()
    tokens = [(int(r.split(",")[3]), float(r.split(",")[4])) for r in rows if ",tokens/s," in r]
    assert tokens == [(r["step"], r["tokens_per_s"]) for r in history if r["kind"] == "train"]
    assert plot.RunCurves.load(run, "run").resumed_at == [4]
