"""The step-time model for one target: which device (a calibrated one, or a GPU kind's data
sheet, or this CPU), which fitted shares, and a prediction for any configuration on it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.plan.estimate import Cluster
from fsdp_utils.plan.hardware import GPU_SPECS, Gpu, spec_key
from fsdp_utils.plan.site import (
    calibrated_device,
    cpu_key,
    efficiency_for,
    sheet_device,
)
from fsdp_utils.plan.step_time import Device, Efficiency, StepTime, predict
from fsdp_utils.plan.workload import workload

# A CPU nobody calibrated: rough figures for a few server cores (gloo through shared memory),
# enough to rank configurations; `python -m fsdp_utils.plan --calibrate --device cpu` measures.
UNCALIBRATED_CPU = Device(
    name="CPU (not calibrated)",
    kind="cpu",
    matmul_flops=50e9,
    memory_bandwidth=10e9,
    link_bandwidth=2e9,
    fabric_bandwidth=1e9,
    host_bandwidth=10e9,
    link_latency=100e-6,
    fabric_latency=200e-6,
    host_optimizer_bandwidth=5e9,
    dispatch_s=20e-6,
    source="rough defaults: run --calibrate",
)


@dataclass(frozen=True)
class SpeedModel:
    key: str  # the calibration key: a GPU kind, or "cpu:<model>"
    device: Device
    efficiency: Efficiency

    def predict(self, config: TrainConfig, cluster: Cluster) -> StepTime:
        facts, shape = workload(config, cluster.world_size)
        return predict(facts, shape, cluster, self.device, self.efficiency)

    def describe(self) -> str:
        eff = self.efficiency
        if eff.rows == 0:
            fitted = "the priors (no measured rows for this device yet)"
        else:
            other = eff.rows - eff.site_rows
            where = (
                "--calibrate's toolkit steps" if self.device.matmul_table else "shipped H100 rows"
            )
            parts = [f"{other} {where}"] if other else []
            parts.append(f"{eff.site_rows} of this site's own runs")
            fitted = "fitted to " + " and ".join(parts)
        return f"{self.device.name} ({self.device.source}); shares {fitted}"


def speed_model(config: TrainConfig, gpu: Gpu | None, *, required: str = "") -> SpeedModel | None:
    """The step-time model for `config`'s device: --device cpu plans this CPU (calibrated, or
    rough defaults); otherwise the GPU named by --gpu_memory (a kind: a100-80gb, h100, ...) or
    detected. None when no GPU kind is known, unless `required` (a flag that needs one) asks,
    then a ValueError naming the kinds."""
    if config.device == "cpu":
        cpu = cpu_key()
        device = calibrated_device(cpu, config) or UNCALIBRATED_CPU
        return SpeedModel(cpu, device, efficiency_for(cpu, device))
    key = spec_key(gpu)
    calibrated = None
    if key is None and gpu is not None and gpu.name:  # a kind without a data sheet here
        calibrated = calibrated_device(f"gpu:{gpu.name}", config)
        key = f"gpu:{gpu.name}" if calibrated else None
    if key is None:
        if not required:
            return None
        raise ValueError(
            f"{required} needs to know the GPU kind for its step time: give --gpu_memory as one "
            f"of {', '.join(sorted(GPU_SPECS))} (a size such as 80GiB says only the memory: "
            "add --gpu_kind with one of them), or --device cpu to plan CPU processes; on a GPU "
            "of another kind, run `python -m fsdp_utils.plan --calibrate --gpus_per_node N` on "
            "one of its nodes, then plan with --gpu_kind '<its name, as nvidia-smi prints it>'."
        )
    known = calibrated or calibrated_device(key, config)
    if known is not None and config.precision == "fp32":
        # --calibrate times a GPU's products in bf16: an fp32 run's come from the data sheet
        if key not in GPU_SPECS:
            if not required:
                return None
            raise ValueError(
                f"{required}: --calibrate measured {gpu.name if gpu else key}'s matrix products "
                "in bf16, and it has no data sheet here for fp32's: time an fp32 run on it "
                f"with --gpu_kind set to a kind that has one ({', '.join(sorted(GPU_SPECS))}), "
                "or plan the run in bf16."
            )
        sheet = sheet_device(key, config)
        known = dataclasses.replace(
            sheet, source=f"{sheet.source}: fp32, which --calibrate does not measure (bf16)"
        )
    device = known or sheet_device(key, config)
    return SpeedModel(key, device, efficiency_for(key, device))
