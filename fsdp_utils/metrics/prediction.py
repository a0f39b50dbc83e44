"""The run's speed and peak memory beside what the planner predicted.

The prediction comes down as data (`Prediction`: made by fsdp_utils/run/speed.py from the
step-time model and the memory plan, which live above this stage); after a few steps the
trainer's log says how the measurement compares, once:

    speed: measured 5,720 tokens/s per GPU, predicted 5,900: -3% (median of steps 4-8);
        peak 20.55 GiB allocated, predicted 20.49: +0.3%

and, when the throughput is more than `OFF_BY` from the prediction, one line more saying so.
Tokens here are sequence positions (what a step computes, padding included), as the model
counts them; metrics.jsonl's tokens_per_s counts real tokens.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

WARMUP_STEPS = 3  # compilation, the allocator's growth, the first all-gathers
MEASURED_STEPS = 5  # logged steps after the warm-up that make the comparison
OFF_BY = 0.25


@dataclass
class Prediction:
    tokens_per_s_per_gpu: float
    step_seconds: float
    positions_per_gpu_step: float  # what a step computes on one GPU
    basis: str  # on what the prediction rests (device, fitted rows)
    peak_gib: float | None = None  # the memory plan's peak, where one was made for this run
    terms: dict[str, float] = field(default_factory=dict)
    # "wall": the step's seconds (GPUs); "cpu": rank 0's CPU seconds a step, as --calibrate
    # measures a CPU (a shared machine's load left out)
    clock: str = "wall"


@dataclass
class SpeedCheck:
    """Collects the logged steps' times and peaks; says once how they compare."""

    prediction: Prediction
    step_times: list[float] = field(default_factory=list)
    peaks: list[float] = field(default_factory=list)
    first_step: int | None = None
    reported: bool = False
    _seen: int = 0
    _last: tuple[int, float] | None = None  # (step, process CPU seconds) of the last record

    def observe(self, record: dict[str, Any]) -> list[str]:
        """A logged step's record; the comparison lines when it is due (else nothing)."""
        self._seen += 1
        last, self._last = self._last, (int(record["step"]), float(record["process_cpu_s"]))
        if self._seen <= WARMUP_STEPS:
            return []
        if self.first_step is None:
            self.first_step = int(record["step"])
        if self.prediction.clock == "cpu":
            if last is None or self._last[0] <= last[0]:
                return []
            steps = self._last[0] - last[0]
            self.step_times.append((self._last[1] - last[1]) / steps)
        else:
            self.step_times.append(float(record["step_time_s"]))
        peak = record.get("cuda_peak_allocated_gib")
        if peak is not None:
            self.peaks.append(float(peak))
        if self.reported or len(self.step_times) < MEASURED_STEPS:
            return []
        return self.report(int(record["step"]))

    def report(self, last_step: int) -> list[str]:
        """The comparison (also at the end of a run too short for `MEASURED_STEPS`)."""
        if self.reported or not self.step_times:
            return []
        self.reported = True
        measured = self.measured_tokens_per_s
        predicted = self.prediction.tokens_per_s_per_gpu
        error = measured / predicted - 1
        per = "per CPU second of rank 0" if self.prediction.clock == "cpu" else "per GPU"
        line = (
            f"speed: measured {measured:,.0f} tokens/s {per}, predicted {predicted:,.0f}: "
            f"{error:+.0%} (median of steps {self.first_step}-{last_step})"
        )
        peak = self.measured_peak_gib
        if peak is not None and self.prediction.peak_gib:
            line += (
                f"; peak {peak:.2f} GiB allocated, predicted {self.prediction.peak_gib:.2f}: "
                f"{peak / self.prediction.peak_gib - 1:+.1%}"
            )
        lines = [line]
        if abs(error) > OFF_BY:
            side = "slower" if error < 0 else "faster"
            lines.append(
                f"speed: {abs(error):.0%} {side} than predicted ({self.prediction.basis}): a busy "
                "or throttled device, a slow file system or network, or a term the model lacks; "
                "this run's figures are added to the site's rows, so the next plan learns it"
            )
        return lines

    @property
    def measured_step_seconds(self) -> float | None:
        return statistics.median(self.step_times) if self.step_times else None

    @property
    def measured_tokens_per_s(self) -> float:
        step = self.measured_step_seconds
        return self.prediction.positions_per_gpu_step / step if step else 0.0

    @property
    def measured_peak_gib(self) -> float | None:
        return max(self.peaks) if self.peaks else None

    def fields(self) -> dict[str, Any]:
        """The comparison's figures, for metrics.jsonl."""
        return {
            "measured_tokens_per_s_per_gpu": self.measured_tokens_per_s,
            "predicted_tokens_per_s_per_gpu": self.prediction.tokens_per_s_per_gpu,
            "measured_step_seconds": self.measured_step_seconds,
            "predicted_step_seconds": self.prediction.step_seconds,
            "measured_peak_gib": self.measured_peak_gib,
            "predicted_peak_gib": self.prediction.peak_gib,
        }
