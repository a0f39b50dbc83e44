"""A run's speed: `--auto`'s choice made (or read back) before the model is built, the step-time
model's prediction handed to the trainer as data, and, when the run ends, its measurement added
to the site's rows (fsdp_utils/plan/site.py) so that the next plan learns this cluster.

`--auto` on a training command. The choice is made once per run and kept in its folder,
`<output_dir>/auto.json`: by the sbatch preflight (`python -m fsdp_utils.plan --auto
--save_json <output_dir>/auto.json`, before torchrun starts), or here, on rank 0, by the same
command in a child process (the planner traces in a process group of its own), while the
other ranks wait. A later leg of the run (a requeued job, a rerun of the same command) finds
the file and, when it was made for the same request (the same settings as given, a default
sequence length fitted to the model as the preflight's, nodes, GPUs per node and GPU kind),
reads it back instead of searching again; a changed request searches again, and says so. Rank 0
alone reads the file; every rank applies the settings it sends them through the process group,
and they are in the run's config.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_utils.atomic import write_json_atomic
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.metrics.prediction import Prediction, SpeedCheck
from fsdp_utils.parallel.distributed import DistEnv, broadcast_object, on_main_rank
from fsdp_utils.plan.auto import apply_settings, request_of
from fsdp_utils.plan.efficiency import SpeedRow
from fsdp_utils.plan.estimate import Cluster
from fsdp_utils.plan.hardware import GIB, Gpu, planner_flags, spec_key
from fsdp_utils.plan.site import append_run, calibrated_device, cpu_key
from fsdp_utils.plan.speed import SpeedModel, speed_model
from fsdp_utils.plan.workload import workload

AUTO_FILE = "auto.json"
# A search on a 70B model takes ~30 s on a quiet node, minutes on a busy one.
SEARCH_TIMEOUT_S = 1200


def auto_file(config: TrainConfig) -> Path:
    return RunLayout.of(config.output_dir).root / AUTO_FILE


def _normalized(data: Any) -> Any:
    return json.loads(json.dumps(data))


def _this_gpu(env: DistEnv) -> Gpu | None:
    if env.device.type != "cuda":
        return None
    import torch

    props = torch.cuda.get_device_properties(env.device)
    return Gpu(props.name, int(props.total_memory))


def _gpu_flag(gpu: Gpu | None) -> list[str]:
    """The planner's --gpu_memory (this GPU's own size) and --gpu_kind (its name) for this node."""
    return [] if gpu is None else planner_flags(gpu)


def _as_checked(config: TrainConfig) -> TrainConfig:
    """`config` as the preflight's search gets it (`check_run`'s): a default --max_seq_length
    fitted to the model's context, so that the request made there is the one asked here."""
    from fsdp_utils.config.seq_length import fit_seq_length
    from fsdp_utils.hub.resolve import config_folder, load_model_config

    folder = config_folder(config.model, config.revision, config.cache_dir)
    return fit_seq_length(config, load_model_config(folder))[0]


def _request(config: TrainConfig, env: DistEnv, gpu: Gpu | None) -> dict[str, Any]:
    cluster = Cluster(env.num_nodes, env.local_world_size)
    key = cpu_key() if gpu is None else (spec_key(gpu) or f"gpu:{gpu.name}")
    return _normalized(request_of(config, cluster, key))


def planner_command(
    config_file: Path, nodes: int, gpus_per_node: int, flags: list[str]
) -> list[str]:
    """`python -m fsdp_utils.plan` for the settings in `config_file` on `nodes` x
    `gpus_per_node` GPUs, with the planner's `flags`."""
    return [
        sys.executable, "-m", "fsdp_utils.plan", "--config", str(config_file),
        "--nodes", str(nodes), "--gpus_per_node", str(gpus_per_node), *flags,
    ]  # fmt: skip


def run_planner(command: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    """The planner's `command` in a child process with CUDA hidden: it traces on fake CPU
    tensors and must not touch the GPUs the job is about to use. subprocess.TimeoutExpired
    after `timeout` seconds."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def resolve_auto(config: TrainConfig, env: DistEnv) -> tuple[TrainConfig, list[str]]:
    """Collective. `config` with --auto's choice (made, or read back), and the log's lines."""
    if not config.auto:
        return config, []
    path = auto_file(config)

    def choose() -> tuple[list[str], dict[str, Any]]:
        gpu = _this_gpu(env)
        checked = _as_checked(config)
        request = _request(checked, env, gpu)
        record = _read(path)
        if record is not None and _normalized(record.get("request")) == request:
            return [
                f"auto: the choice made before the first leg, read back from {path}: "
                f"{record['flags']} (predicted {record['predicted']['tokens_per_s_per_gpu']:,.0f}"
                " tokens/s per GPU)"
            ], record["settings"]
        again = (
            f"auto: {path} was made for another request (settings, nodes or GPUs changed): "
            "searching again"
            if record is not None
            else None
        )
        _search(checked, env, gpu, path)
        record = _read(path)
        assert record is not None
        # the next leg asks exactly this (the child read the settings back from a file)
        record["request"] = request
        write_json_atomic(path, record)
        return [line for line in (again,) if line] + [
            f"auto: chose {record['flags']} ({record['considered']:,} configurations timed, "
            f"{record['traced']} memory plans traced, {record['seconds']:.1f} s)",
            *record["report"].splitlines(),
        ], record["settings"]

    # Rank 0's settings reach the others through the process group, not the shared file: a
    # node's file system may still serve it the file rank 0 just replaced (NFS caches).
    notes, settings = on_main_rank(choose) or ([], {})
    return apply_settings(config, broadcast_object(settings)), notes


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and "settings" in data else None


def _search(config: TrainConfig, env: DistEnv, gpu: Gpu | None, out: Path) -> None:
    """The planner's --auto in a child process (CUDA hidden: it traces on the CPU); a
    ValueError with its output when nothing fits or it cannot plan."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        config_file = Path(tmp) / "config.json"
        config_file.write_text(config.to_json())
        flags = [*_gpu_flag(gpu), "--auto", "--save_json", str(out)]
        command = planner_command(config_file, env.num_nodes, env.local_world_size, flags)
        code, stdout, stderr = _run_planner(command)
    if code == 1:
        raise ValueError(f"--auto: no configuration fits.\n{stdout.strip()}")
    if code != 0:
        error = stderr.strip()
        error = error[error.rfind("error:") :] if "error:" in error else error[-2000:]
        raise ValueError(f"--auto could not choose: {error}")


def _run_planner(command: list[str]) -> tuple[int, str, str]:
    """`run_planner` within the search's time: (exit status, stdout, stderr)."""
    try:
        result = run_planner(command, timeout=SEARCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return 3, "", f"error: the search did not finish in {SEARCH_TIMEOUT_S} s"
    return result.returncode, result.stdout, result.stderr


# --- the prediction, and the measurement beside it ------------------------------------------------


def _speed_for_run(config: TrainConfig, env: DistEnv) -> SpeedModel | None:
    """The step-time model of this run's device: a GPU kind (data sheet or calibrated), or
    this CPU only once --calibrate has measured it (rough defaults predict nothing useful)."""
    if env.device.type == "cpu":
        if calibrated_device(cpu_key(), config) is None:
            return None
        return speed_model(config.replace(device="cpu"), None)
    return speed_model(config, _this_gpu(env))


@dataclass
class RunSpeed:
    """The prediction of a run (rank 0), what the trainer checks it against, and what it rests
    on (to add the run's measurement to the site's rows at the end)."""

    check: SpeedCheck
    speed: SpeedModel
    cluster: Cluster
    line: str


def predict_run(config: TrainConfig, env: DistEnv) -> tuple[RunSpeed | None, str | None]:
    """The run's predicted step (and peak, from --auto's choice) and the log's line; (None,
    why) when there is nothing to predict with (an uncalibrated CPU: None, None)."""
    try:
        speed = _speed_for_run(config, env)
        if speed is None:
            return None, None
        cluster = Cluster(env.num_nodes, env.local_world_size)
        step = speed.predict(config, cluster)
    except (ValueError, OSError) as err:  # no prediction is no reason to stop a run
        return None, f"speed: no prediction ({str(err).splitlines()[0]})"
    peak = None
    if config.auto and (record := _read(auto_file(config))) is not None:
        peak_bytes = record["predicted"].get("peak_bytes")
        peak = peak_bytes / GIB if peak_bytes else None
    prediction = Prediction(
        tokens_per_s_per_gpu=step.tokens_per_s_per_gpu,
        step_seconds=step.seconds,
        positions_per_gpu_step=step.tokens_per_gpu,
        basis=speed.describe(),
        peak_gib=peak,
        terms={t.name: t.seconds for t in step.terms},
        clock="cpu" if env.device.type == "cpu" else "wall",
    )
    line = (
        f"speed: predicted {step.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
        f"{step.seconds:,.3f} s a step, MFU {step.mfu:.1%} ({speed.describe()})"
        + (f"; peak {peak:.2f} GiB" if peak else "")
    )
    return RunSpeed(SpeedCheck(prediction), speed, cluster, line), None


def record_run(config: TrainConfig, run: RunSpeed | None, env: DistEnv) -> str | None:
    """Rank 0: the run's measurement beside the prediction, appended to the site's rows (when
    it measured at least 3 steps after the warm-up). The log's line, or None."""
    if run is None or not env.is_main or len(run.check.step_times) < 3:
        return None
    facts, shape = workload(config, run.cluster.world_size)
    measured = run.check.measured_step_seconds
    assert measured is not None
    row = SpeedRow(
        name=str(config.output_dir),
        device=run.speed.device,
        cluster=run.cluster,
        facts=facts,
        shape=shape,
        step_seconds=measured,
        peak_allocated_gib=run.check.measured_peak_gib,
        predicted_step_seconds=run.check.prediction.step_seconds,
        predicted_peak_gib=run.check.prediction.peak_gib,
        source="finished run",
    )
    try:
        path = append_run(row, run.speed.key)
    except OSError as err:
        return f"speed: the measurement was not added to the site's rows ({err})"
    return f"speed: this run's measurement added to {path} (the next plan fits to it)"
