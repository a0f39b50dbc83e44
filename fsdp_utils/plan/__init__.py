"""The memory planner: will a fine-tune fit in GPU memory, before it waits in the queue?

    python -m fsdp_utils.plan --model codellama/CodeLlama-7b-hf --nodes 1 --gpus_per_node 4 \
        --gpu_memory 80GiB [--find_max_batch] [any chess_finetune.py training flags]

`plan_memory` traces one training step of the exact configuration on fake tensors (config.json
only, no weights, no GPU) and measures it with PyTorch's FSDP memory tracker; see estimate.py.
Beside it, how fast the run will go: the step-time model (step_time.py, its rates in
hardware.py and site.py, its fitted shares in efficiency.py), `--auto`'s search for the fastest
configuration that fits (auto.py), `--scaling` (scaling.py) and `--calibrate` (calibrate.py).
"""

from fsdp_utils.model.transforms import ModelInfo
from fsdp_utils.plan.cli import main
from fsdp_utils.plan.estimate import Cluster
from fsdp_utils.plan.hardware import GPU_PRESETS, Gpu, parse_gpu_memory
from fsdp_utils.plan.planner import find_max_batch, max_batch_plan, plan_memory
from fsdp_utils.plan.report import Fix, Margin, MemoryPlan, format_plan
from fsdp_utils.plan.tracking import Breakdown, StepMemory

__all__ = [
    "GPU_PRESETS",
    "Breakdown",
    "Cluster",
    "Fix",
    "Gpu",
    "Margin",
    "MemoryPlan",
    "ModelInfo",
    "StepMemory",
    "find_max_batch",
    "format_plan",
    "main",
    "max_batch_plan",
    "parse_gpu_memory",
    "plan_memory",
]
