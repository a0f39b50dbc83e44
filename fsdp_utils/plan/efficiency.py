"""The step-time model's fitted shares (`step_time.Efficiency`), from measured rows.

A row is one measured run: its model's counts, its settings, its cluster, the device it ran on
and the measured seconds per optimizer step (`SpeedRow`). The rows come from the toolkit (the
first H100 measurement, `fsdp_utils/plan/measured.py`) and from the site: every finished run
appends one (fsdp_utils/plan/site.py), so the model learns the cluster it runs on.

The fit is a maximum a posteriori one, in logarithms: each share starts from a prior
(`Efficiency`'s defaults, or `CALIBRATED_PRIOR` for a device --calibrate measured) and moves as
far as the rows pull it, weighed against how far the prior's own uncertainty lets it:

    minimise  sum over rows  ((log predicted - log measured) / ROW_SIGMA)^2
            + sum over shares ((log share - log prior) / PRIOR_SIGMA)^2

A share no row depends on stays at its prior (a QLoRA-only term without a QLoRA row). The
leave-one-out error of a row is its prediction by the shares fitted to the other rows
(`leave_one_out`): docs/plan.md lists it for the H100 rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fsdp_utils.plan.estimate import Cluster
from fsdp_utils.plan.step_time import (
    Device,
    Efficiency,
    ModelFacts,
    RunShape,
    StepTime,
    predict,
)

# Run-to-run spread of a measured step time (the H100's two calls of the same rows: 8% and 21%
# apart; steps of one run 5-10%).
ROW_SIGMA = 0.10
# How far a prior may be off: a factor of about 2.
PRIOR_SIGMA = 0.7


@dataclass(frozen=True)
class SpeedRow:
    """One measured run."""

    name: str
    device: Device
    cluster: Cluster
    facts: ModelFacts
    shape: RunShape
    step_seconds: float  # measured, median of the steady steps
    peak_allocated_gib: float | None = None
    predicted_step_seconds: float | None = None  # what the model said when it ran
    predicted_peak_gib: float | None = None
    source: str = ""

    @property
    def tokens_per_s_per_gpu(self) -> float:
        shape = self.shape
        positions = shape.micro_batch * shape.sequences_per_example * self.facts.seq_length
        tokens = positions * shape.accumulation / shape.sequence_parallel
        return tokens / self.step_seconds

    def predict(self, eff: Efficiency) -> StepTime:
        return predict(self.facts, self.shape, self.cluster, self.device, eff)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["cluster"] = {"nodes": self.cluster.nodes, "gpus_per_node": self.cluster.gpus_per_node}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeedRow:
        return cls(
            name=str(data["name"]),
            device=Device.from_dict(data["device"]),
            cluster=Cluster(**data["cluster"]),
            facts=ModelFacts.from_dict(data["facts"]),
            shape=RunShape.from_dict(data["shape"]),
            step_seconds=float(data["step_seconds"]),
            peak_allocated_gib=data.get("peak_allocated_gib"),
            predicted_step_seconds=data.get("predicted_step_seconds"),
            predicted_peak_gib=data.get("predicted_peak_gib"),
            source=str(data.get("source", "")),
        )


def _with(prior: Efficiency, logs: np.ndarray) -> Efficiency:
    values = {
        name: getattr(prior, name) * math.exp(value)
        for name, value in zip(Efficiency.FITTED, logs, strict=True)
    }
    # a share of a data sheet's peak cannot pass it; a share of a rate measured apart may (the
    # products inside a layer can run a little faster than alone)
    for name in ("matmul", "attention"):
        values[name] = min(values[name], 1.0 if getattr(prior, name) < 1.0 else 1.5)
    values["compiled_elementwise"] = min(values["compiled_elementwise"], 1.0)
    return dataclasses.replace(prior, **values)


def _residuals(rows: Sequence[SpeedRow], prior: Efficiency, logs: np.ndarray) -> np.ndarray:
    eff = _with(prior, logs)
    errors = [math.log(row.predict(eff).seconds / row.step_seconds) / ROW_SIGMA for row in rows]
    return np.concatenate([np.asarray(errors), logs / PRIOR_SIGMA])


def fit(rows: Sequence[SpeedRow], prior: Efficiency, *, site_rows: int = 0) -> Efficiency:
    """The shares that best explain `rows` (Levenberg-Marquardt on the objective above); the
    prior itself without rows."""
    if not rows:
        return prior
    logs = np.zeros(len(Efficiency.FITTED))
    damping = 1e-2
    residual = _residuals(rows, prior, logs)
    for _ in range(60):
        jacobian = np.empty((residual.size, logs.size))
        for j in range(logs.size):
            step = np.zeros_like(logs)
            step[j] = 1e-4
            jacobian[:, j] = (_residuals(rows, prior, logs + step) - residual) / 1e-4
        gradient = jacobian.T @ residual
        hessian = jacobian.T @ jacobian
        improved = False
        for _ in range(10):
            delta = np.linalg.solve(hessian + damping * np.diag(np.diag(hessian) + 1e-9), -gradient)
            trial = logs + delta
            trial_residual = _residuals(rows, prior, trial)
            if trial_residual @ trial_residual < residual @ residual:
                logs, residual, improved = trial, trial_residual, True
                damping = max(damping / 3, 1e-6)
                break
            damping *= 4
        if not improved or float(np.max(np.abs(delta))) < 1e-5:
            break
    return dataclasses.replace(_with(prior, logs), rows=len(rows), site_rows=site_rows)


@dataclass(frozen=True)
class LeaveOneOut:
    row: SpeedRow
    predicted_step_seconds: float
    in_sample_step_seconds: float

    @property
    def error(self) -> float:
        """Predicted tokens/s over measured, less 1 (with the other rows' fit)."""
        return self.row.step_seconds / self.predicted_step_seconds - 1

    @property
    def in_sample_error(self) -> float:
        return self.row.step_seconds / self.in_sample_step_seconds - 1


def leave_one_out(rows: Sequence[SpeedRow], prior: Efficiency) -> list[LeaveOneOut]:
    """Each row predicted by the shares fitted to all the others, and by all of them."""
    everything = fit(rows, prior)
    out = []
    for index, row in enumerate(rows):
        others = fit([r for i, r in enumerate(rows) if i != index], prior)
        out.append(LeaveOneOut(row, row.predict(others).seconds, row.predict(everything).seconds))
    return out
