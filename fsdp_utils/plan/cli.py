"""`python -m fsdp_utils.plan`: will this fine-tune fit in GPU memory, before it waits in the queue.

Exit status: 0 it fits (or no GPU size was given), 1 it does not fit, 2 it cannot plan this run
(a mistake in the command, or a model it cannot trace: the message names the fix), 3 it crashed
(a bug in the planner: the traceback is on stderr). The preflight stops a job only on 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from dataclasses import dataclass

from fsdp_utils.config.parse import build_parser, parse_config
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.plan.hardware import GIB, Gpu, detect_gpu, parse_gpu_memory, parse_size
from fsdp_utils.plan.planner import max_batch_plan, plan_memory
from fsdp_utils.plan.report import Margin, MemoryPlan, format_plan
from fsdp_utils.plan.search import batch_candidates, resolved_total_batch

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_CANNOT_PLAN, EXIT_CRASHED = 0, 1, 2, 3
DEFAULT_MARGIN = Margin()  # its defaults live in report.Margin, the one place to calibrate

DESCRIPTION = """Plan the per-GPU memory of a chess_finetune.py run without a GPU: the model is
built from its config.json only (no weights) and one training step of the exact configuration
is traced on fake tensors, in a fake process group of the planned size.

examples:
  python -m fsdp_utils.plan --model codellama/CodeLlama-7b-hf --nodes 1 --gpus_per_node 4 \\
      --gpu_memory 80GiB --batch_size_per_device 8
  python -m fsdp_utils.plan --model codellama/CodeLlama-7b-hf --gpus_per_node 4 \\
      --gpu_memory a100-80gb --gradient_checkpointing --find_max_batch"""


def make_parser() -> argparse.ArgumentParser:
    # `python -m fsdp_utils.plan` (argparse would say `__main__.py`), or `chess_finetune.py --plan`.
    module = os.path.basename(sys.argv[0]) == "__main__.py"
    parser = build_parser(DESCRIPTION, prog="python -m fsdp_utils.plan" if module else None)
    # Underscores, as every training flag; the dashed spellings work too (fsdp_utils.arguments).
    where = parser.add_argument_group("the GPUs the run will have")
    where.add_argument(
        "--nodes", type=int, default=None, help="Nodes (default: $SLURM_JOB_NUM_NODES, else 1)."
    )
    where.add_argument(
        "--gpus_per_node",
        type=int,
        default=None,
        help="GPUs (processes) per node (default: $SLURM_GPUS_ON_NODE; required elsewhere).",
    )
    where.add_argument(
        "--gpu_memory",
        metavar="SIZE|GPU",
        help="Memory of one GPU: 80GiB, 81920MiB, or a100-40gb, a100-80gb, h100-64gb, "
        "h100-80gb, h200, l40s (default: the GPU of this node, if any).",
    )
    what = parser.add_argument_group("planning")
    what.add_argument(
        "--find_max_batch",
        action="store_true",
        help="Report the largest --batch_size_per_device that fits (the total batch is kept).",
    )
    what.add_argument(
        "--no_fixes",
        action="store_true",
        help="When it does not fit, do not plan the changes that would make it fit.",
    )
    runtime = f"{DEFAULT_MARGIN.runtime_bytes / GIB:g}GiB"
    what.add_argument(
        "--margin_runtime",
        default=runtime,
        metavar="SIZE",
        help=f"Memory outside PyTorch's allocator: CUDA context, NCCL buffers ({runtime}).",
    )
    what.add_argument(
        "--margin_allocator",
        type=float,
        default=DEFAULT_MARGIN.allocator_fraction,
        metavar="FRACTION",
        help="Allocator overhead (rounding, fragmentation) as a fraction of the peak "
        f"({DEFAULT_MARGIN.allocator_fraction:g}).",
    )
    what.add_argument(
        "--full_trace",
        action="store_true",
        help="Trace every decoder layer instead of extrapolating from 3-5 layer copies of the "
        "model (same result when its layers are alike, several times slower).",
    )
    what.add_argument("--json", action="store_true", help="Print the plan as JSON.")
    return parser


@dataclass(frozen=True)
class Target:
    """Where the run will go: the cluster, one GPU's memory, and the margin to keep."""

    nodes: int
    gpus_per_node: int
    gpu: Gpu | None
    margin: Margin
    full_trace: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Target:
        nodes = args.nodes or int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
        gpus = args.gpus_per_node or os.environ.get("SLURM_GPUS_ON_NODE")
        if gpus is None:
            raise ValueError(
                "How many GPUs per node will the run have? Give --gpus_per_node (e.g. 4), and "
                "--nodes if more than one."
            )
        gpu = parse_gpu_memory(args.gpu_memory) if args.gpu_memory else detect_gpu()
        margin = Margin(parse_size(args.margin_runtime, "--margin_runtime"), args.margin_allocator)
        return cls(nodes, int(gpus), gpu, margin, args.full_trace)

    def plan(self, config: TrainConfig, *, suggest_fixes: bool) -> MemoryPlan:
        return plan_memory(
            config,
            nodes=self.nodes,
            gpus_per_node=self.gpus_per_node,
            gpu_memory_bytes=self.gpu.memory_bytes if self.gpu else None,
            gpu_name=self.gpu.name if self.gpu else None,
            margin=self.margin,
            suggest_fixes=suggest_fixes,
            progress=_progress,
            full_trace=self.full_trace,
        )


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def find_max_batch_report(
    config: TrainConfig, target: Target, *, suggest_fixes: bool
) -> tuple[MemoryPlan, str]:
    """The plan of the largest batch per device that fits, and a line saying what was found."""
    if target.gpu is None:
        raise ValueError("--find_max_batch needs the GPU's memory: give --gpu_memory (e.g. 80GiB).")
    world = target.nodes * target.gpus_per_node
    total = resolved_total_batch(config, world)
    allowed = batch_candidates(total, world)
    listed = ", ".join(map(str, allowed))
    best = max_batch_plan(
        config,
        nodes=target.nodes,
        gpus_per_node=target.gpus_per_node,
        gpu_memory_bytes=target.gpu.memory_bytes,
        gpu_name=target.gpu.name,
        margin=target.margin,
        progress=_progress,
        full_trace=target.full_trace,
    )
    if best is None:  # show why batch 1 does not fit, and what would help
        one = config.replace(
            batch_size_per_device=1, total_batch_size=total, gradient_accumulation_steps=None
        )
        summary = f"Not even --batch_size_per_device 1 fits (the total batch allows {listed})."
        return target.plan(one, suggest_fixes=suggest_fixes), summary
    found = best.batch.batch_size_per_device
    summary = (
        f"Largest --batch_size_per_device that fits: {found} (the total batch allows {listed})"
    )
    if found == allowed[-1]:
        summary += (
            f".\nNo larger one divides --total_batch_size {total} over {world} GPUs: a larger "
            "total batch would allow more"
        )
    return best, summary + "."


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    try:
        config, args = parse_config(argv, parser)
        if args.print_config:
            print(config.to_json())
            return EXIT_FITS
        target = Target.from_args(args)
        if args.find_max_batch:
            plan, summary = find_max_batch_report(config, target, suggest_fixes=not args.no_fixes)
        else:
            plan, summary = target.plan(config, suggest_fixes=not args.no_fixes), ""
    except ValueError as err:
        print(f"\nerror: {err}\n", file=sys.stderr, flush=True)
        return EXIT_CANNOT_PLAN
    except Exception as err:  # a bug: keep its traceback, and tell it apart from "does not fit"
        traceback.print_exc()
        print(
            f"\nerror: the memory planner crashed ({type(err).__name__}: {err}). This is a bug in "
            "fsdp_utils.plan, not in your command: please report it with the traceback above. "
            "The run itself may still be fine.\n",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_CRASHED
    if args.json:
        print(plan.to_json())
    else:
        print(f"{summary}\n\n{format_plan(plan)}" if summary else format_plan(plan))
    return EXIT_DOES_NOT_FIT if plan.fits is False else EXIT_FITS
