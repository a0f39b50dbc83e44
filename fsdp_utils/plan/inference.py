"""The memory of the evaluation's forward passes (`python -m fsdp_utils.evaluate --batch_size
auto` on GPUs): how many tokens one forward may hold on each GPU.

The model is built and sharded as the evaluation builds it (`build_parallel_model` with its
TrainConfig, the adapters of a LoRA folder included), materialised on fake tensors in a fake
process group of the job's world size, as the training plan does (`estimate.py`), and no-grad
forwards of 1, 2, 4, ... rows of `seq_len` tokens are traced with PyTorch's FSDP memory tracker
until the peak grows by the same bytes per row (activations, logits) twice in a row: below that,
a spike that does not grow with the rows (the gathered embedding and output layer) hides the
growth. Then

    rows that fit = (GPU memory - margin - fixed part) / bytes per row

and the token budget is rows x `seq_len`: the evaluation fills each forward with as many rows as
the budget allows for its longest request (a forward of shorter requests takes more rows, never
more tokens). The margin is the training plan's (`report.Margin`: the CUDA context and NCCL
buffers, and the caching allocator's slack over the tensor bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.hub.resolve import load_model_config
from fsdp_utils.model.build import materialize
from fsdp_utils.parallel.parallelize import build_parallel_model
from fsdp_utils.plan.estimate import (
    Cluster,
    _attention_to_trace,
    _transformers_eager_paths,
    _UnitScalarsFakeMode,
    fake_world,
    model_config_dir,
)
from fsdp_utils.plan.hardware import Gpu, format_bytes
from fsdp_utils.plan.report import Margin
from fsdp_utils.plan.tracking import TOTAL, _device_snapshot, memory_tracker

# The length of the traced rows: long enough that the per-token cost is that of real requests,
# short enough to trace in seconds whatever the model's context.
PROBE_TOKENS = 2048
MAX_TRACED_ROWS = 64


@dataclass(frozen=True)
class ForwardPlan:
    """One GPU's memory for the evaluation's forwards."""

    fixed_bytes: int  # the model's shards, the all-gathered layers, buffers
    bytes_per_row: int  # of `seq_len` tokens
    seq_len: int
    gpu: Gpu
    margin: Margin

    @property
    def rows(self) -> int:
        free = self.gpu.memory_bytes - self.fixed_bytes
        free -= self.margin.bytes_for(self.fixed_bytes + self.bytes_per_row)
        return max(0, free // max(1, self.bytes_per_row))

    @property
    def token_budget(self) -> int:
        """Tokens one forward may hold (at least one row of `seq_len`)."""
        return max(1, self.rows) * self.seq_len

    def describe(self) -> str:
        return (
            f"batch: auto from the memory plan on a {format_bytes(self.gpu.memory_bytes)} GPU "
            f"{self.gpu.name}: the model {format_bytes(self.fixed_bytes)}, "
            f"{format_bytes(self.bytes_per_row)} per row of {self.seq_len} tokens, margin "
            f"{self.margin.describe()}: {self.rows} row(s) of {self.seq_len} tokens per forward "
            f"(a budget of {self.token_budget} tokens; shorter requests take more rows)"
        )


def _traced_peak(model: Any, rows: int, seq_len: int, device: torch.device) -> int:
    tracker = memory_tracker(model)
    with tracker, torch.no_grad():
        ids = torch.zeros((rows, seq_len), dtype=torch.long, device=device)
        model(input_ids=ids, use_cache=False)
        return _device_snapshot(tracker.get_tracker_snapshot("peak"), device)[TOTAL]


def plan_forward(
    config: TrainConfig,
    cluster: Cluster,
    gpu: Gpu,
    *,
    seq_len: int,
    margin: Margin | None = None,
) -> ForwardPlan:
    """Trace the evaluation's forward of `config`'s model on `cluster` (rank 0's GPU). Needs a
    process without a process group (run it before torchrun's group is set up)."""
    seq_len = max(1, min(seq_len, PROBE_TOKENS))
    hf_config = load_model_config(model_config_dir(config))
    config, _ = _attention_to_trace(config)
    with fake_world(cluster) as env:
        model, _ = build_parallel_model(hf_config, config, env)
        with _UnitScalarsFakeMode(allow_non_fake_inputs=True), _transformers_eager_paths():
            materialize(model, env.device)
            model.eval()
            rows, peak = 1, _traced_peak(model, 1, seq_len, env.device)
            slopes: list[float] = []
            # The peak is the larger of a spike that does not grow with the rows (the gathered
            # embedding and output layer) and a line that does: double the rows until two
            # successive slopes agree (the line dominates), so the slope is the line's.
            while rows < MAX_TRACED_ROWS:
                more = _traced_peak(model, 2 * rows, seq_len, env.device)
                slopes.append((more - peak) / rows)
                rows, peak = 2 * rows, more
                if len(slopes) > 1 and slopes[-1] > 0 and slopes[-2] >= 0.9 * slopes[-1]:
                    break
    per_row = max(1, round(slopes[-1]))
    return ForwardPlan(max(0, peak - rows * per_row), per_row, seq_len, gpu, margin or Margin())


def eval_token_budget(config: TrainConfig, seq_len: int) -> tuple[int, str]:
    """`python -m fsdp_utils.evaluate --batch_size auto` on a GPU node: the plan for this job's
    GPUs (torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE, the first visible GPU's memory)."""
    import os

    from fsdp_utils.plan.hardware import detect_gpu

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    gpu = detect_gpu()
    if gpu is None:
        raise ValueError("--batch_size auto plans for a GPU, and none is visible: pass a number.")
    plan = plan_forward(config, Cluster(max(1, world // per_node), per_node), gpu, seq_len=seq_len)
    return plan.token_budget, plan.describe()
