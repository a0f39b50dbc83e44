"""What the step-time model knows of this site: the devices `--calibrate` measured and the runs
that finished here, in one folder every node of a cluster sees (the home directory, usually):

    $FSDP_UTILS_SITE_DIR (default: $XDG_CACHE_HOME/fsdp_utils/site, else ~/.cache/fsdp_utils/site)
        calibration.json   one entry per device kind (a GPU kind, or "cpu:<model>"): the rates
                           --calibrate measured (fsdp_utils/plan/calibrate.py), and when
        runs.jsonl         one line per finished run (each leg of a requeued one): its model's
                           counts, its settings, its device, the measured step time and peak
                           beside what the model predicted (fsdp_utils/run/speed.py appends it)

The plan uses a calibrated device where there is one (and says so), the data sheet otherwise
(`GPU_SPECS`), and fits the model's shares to the shipped H100 rows and this site's own runs on
devices of the same source (fsdp_utils/plan/efficiency.py): `--plan` says how many it used.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from pathlib import Path
from typing import Any

from fsdp_utils.atomic import write_text_atomic
from fsdp_utils.config.layout import SITE_ENV as SITE_ENV  # re-exported: the tests set it
from fsdp_utils.config.layout import site_calibration_file, site_dir
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.plan.efficiency import SpeedRow, fit
from fsdp_utils.plan.hardware import (
    DEFAULT_FABRIC,
    FABRIC_LATENCY_S,
    GPU_SPECS,
    INTERCONNECTS,
    LINK_LATENCY_S,
    fabric_bandwidth,
)
from fsdp_utils.plan.step_time import CALIBRATED_PRIOR, Device, Efficiency

# A GPU node's host running an offloaded optimizer step: the bytes/s of AdamW's traffic. Not
# published for any kind (it is the host's memory and cores): assumed, --calibrate measures it.
HOST_OPTIMIZER_BANDWIDTH = 20e9
# Seconds to launch one operator from eager PyTorch on a GPU (assumed: the 5-10 us usually
# quoted for a kernel launch through the dispatcher); --calibrate measures it.
GPU_DISPATCH_S = 8e-6
# CPU seconds of FSDP2's hooks per shard group and micro-batch on a GPU node's host (assumed
# from this machine's 2-4 ms under load, on a faster, idle core); --calibrate measures it.
GPU_FSDP_GROUP_S = 0.5e-3


def calibration_file() -> Path:
    return site_calibration_file()


def runs_file() -> Path:
    return site_dir() / "runs.jsonl"


def cpu_key() -> str:
    """This machine's CPU as a calibration key: 'cpu:<model name>' (a login node's CPU is not a
    compute node's)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{model}"


def read_calibrations() -> dict[str, Any]:
    try:
        data = json.loads(calibration_file().read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def write_calibration(key: str, device: Device, details: dict[str, Any]) -> Path:
    """Record `device` as the site's measurement of `key` (replacing an earlier one)."""
    path = calibration_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = read_calibrations()
    data[key] = {
        "device": device.to_dict(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        **details,
    }
    write_text_atomic(path, json.dumps(data, indent=1))
    return path


def sheet_device(key: str, config: TrainConfig) -> Device:
    """A GPU kind from its data sheet (`GPU_SPECS`), the fabric from --interconnect and
    --fabric_gbps."""
    spec = GPU_SPECS[key]
    return Device(
        name=spec.kind,
        kind="gpu",
        matmul_flops=spec.fp32_flops if config.precision == "fp32" else spec.bf16_flops,
        memory_bandwidth=spec.memory_bandwidth,
        link_bandwidth=spec.link_bandwidth,
        fabric_bandwidth=fabric_bandwidth(config.interconnect, config.fabric_gbps, spec),
        host_bandwidth=spec.host_bandwidth,
        link_latency=LINK_LATENCY_S,
        fabric_latency=FABRIC_LATENCY_S,
        host_optimizer_bandwidth=HOST_OPTIMIZER_BANDWIDTH,
        dispatch_s=GPU_DISPATCH_S,
        fsdp_group_s=GPU_FSDP_GROUP_S,
        source=f"{spec.kind} data sheet",
    )


def calibrated_device(key: str, config: TrainConfig) -> Device | None:
    """The site's measurement of `key`, if --calibrate made one. On a GPU the fabric between
    nodes, which one node cannot measure: --interconnect / --fabric_gbps, else the kind's data
    sheet's, else `DEFAULT_FABRIC` (said in the device's source)."""
    entry = read_calibrations().get(key)
    if not isinstance(entry, dict) or "device" not in entry:
        return None
    try:
        device = Device.from_dict(entry["device"])
    except (KeyError, TypeError, ValueError):
        return None
    if device.kind == "gpu":
        spec = GPU_SPECS.get(key)
        given = config.interconnect or config.fabric_gbps
        changes: dict[str, Any] = {
            "fabric_bandwidth": fabric_bandwidth(config.interconnect, config.fabric_gbps, spec),
            "fabric_latency": max(device.link_latency, FABRIC_LATENCY_S),
        }
        if spec is None and not given:
            changes["source"] = (
                f"{device.source}; between nodes {INTERCONNECTS[DEFAULT_FABRIC][1]} assumed: "
                "give --interconnect or --fabric_gbps"
            )
        device = dataclasses.replace(device, **changes)
    return device


def calibration_rows(key: str) -> list[SpeedRow]:
    """The toolkit steps --calibrate measured on `key` (its rows for the shares' fit)."""
    entry = read_calibrations().get(key)
    rows = []
    for data in entry.get("rows", []) if isinstance(entry, dict) else []:
        try:
            rows.append(SpeedRow.from_dict(data))
        except (KeyError, TypeError, ValueError):
            continue
    return rows


def append_run(row: SpeedRow, key: str) -> Path:
    """One finished run's measurement, for the next fit."""
    path = runs_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps({"device_key": key, **row.to_dict()}) + "\n")
    return path


def site_rows(key: str, *, calibrated: bool) -> list[SpeedRow]:
    """This site's finished runs on `key`, those measured against the same kind of device
    description (a calibrated device's shares are not a data sheet's)."""
    rows = []
    try:
        lines = runs_file().read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            data = json.loads(line)
            if data.get("device_key") != key:
                continue
            row = SpeedRow.from_dict(data)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # a line cut short by a killed job, or from another version: skipped
        if bool(row.device.matmul_table) == calibrated:
            rows.append(row)
    return rows


_FITS: dict[tuple[str, bool, int], Efficiency] = {}


def efficiency_for(key: str, device: Device) -> Efficiency:
    """The shares for `device` (key `key`): a data-sheet GPU's fitted to the shipped H100 rows
    and this site's rows of that kind; a calibrated device's to this site's rows of it."""
    from fsdp_utils.plan.measured import ROWS

    calibrated = bool(device.matmul_table)
    own = site_rows(key, calibrated=calibrated)
    cache_key = (key, calibrated, len(own))
    if cache_key not in _FITS:
        if calibrated or device.kind == "cpu":
            rows = [*calibration_rows(key), *own]
            _FITS[cache_key] = fit(rows, CALIBRATED_PRIOR, site_rows=len(own))
        else:
            shipped = [SpeedRow.from_dict(row) for row in ROWS]
            _FITS[cache_key] = fit([*shipped, *own], Efficiency(), site_rows=len(own))
    return _FITS[cache_key]
