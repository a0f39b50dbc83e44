"""`python -m fsdp_utils.plan`: will this fine-tune fit in GPU memory, before it waits in the queue.

Exit status: 0 it fits (or no GPU size was given), 1 it does not fit, 2 it cannot plan this run
(a mistake in the command, or a model it cannot trace: the message names the fix), 3 it crashed
(a bug in the planner: the traceback is on stderr). The preflight stops a job only on 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_utils.atomic import write_json_atomic
from fsdp_utils.config.parse import build_parser, parse_config
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.plan.estimate import Cluster
from fsdp_utils.plan.hardware import (
    GIB,
    Gpu,
    detect_gpu,
    gpu_kind_name,
    parse_gpu_memory,
    parse_size,
)
from fsdp_utils.plan.planner import max_batch_plan, plan_memory, with_step_time
from fsdp_utils.plan.report import Margin, MemoryPlan, format_plan
from fsdp_utils.plan.search import batch_candidates, resolved_total_batch
from fsdp_utils.plan.speed import SpeedModel, speed_model

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
    where.add_argument(
        "--gpu_kind",
        metavar="GPU",
        help="The GPU's kind for the step time, where --gpu_memory gives a size: a kind above "
        "(h100-80gb) or the name nvidia-smi prints ('NVIDIA H100 NVL'; a kind without a data "
        "sheet needs --calibrate). The memory stays --gpu_memory's.",
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
    speed = parser.add_argument_group("speed (the step-time model: docs/plan.md)")
    speed.add_argument(
        "--scaling",
        action="store_true",
        help="Print the predicted tokens/s per GPU and step time from 1 to 1,024 GPUs, full "
        "against hybrid sharding (the batch per GPU held), and exit.",
    )
    speed.add_argument(
        "--calibrate",
        action="store_true",
        help="Measure this node's matmul rate, memory bandwidth, operator launch time, "
        "collectives between --gpus_per_node processes (NCCL on GPUs, gloo with --device "
        "cpu) and the host's optimizer step, in about a minute, and write them to the site "
        "file the next plan reads ($FSDP_UTILS_SITE_DIR/calibration.json).",
    )
    what.add_argument(
        "--save_json",
        metavar="FILE",
        help="Also write the plan (with --auto: the choice, its predictions and why) to FILE as "
        "JSON (the sbatch preflight writes <output_dir>/auto.json, which the run reads).",
    )
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
    def from_args(cls, args: argparse.Namespace, config: TrainConfig | None = None) -> Target:
        nodes = args.nodes or int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
        gpus = args.gpus_per_node or os.environ.get("SLURM_GPUS_ON_NODE")
        if gpus is None:
            raise ValueError(
                "How many GPUs per node will the run have? Give --gpus_per_node (e.g. 4; with "
                "--device cpu the processes per node), and --nodes if more than one."
            )
        on_cpu = config is not None and config.device == "cpu"
        gpu = parse_gpu_memory(args.gpu_memory) if args.gpu_memory else None
        if gpu is None and not on_cpu:
            gpu = detect_gpu()
        if args.gpu_kind:
            if gpu is None:
                raise ValueError(
                    f"--gpu_kind {args.gpu_kind!r} says the GPU's kind, not its memory: give "
                    "--gpu_memory too (e.g. --gpu_memory 95830MiB)."
                )
            gpu = Gpu(gpu_kind_name(args.gpu_kind), gpu.memory_bytes)
        margin = Margin(parse_size(args.margin_runtime, "--margin_runtime"), args.margin_allocator)
        return cls(nodes, int(gpus), gpu, margin, args.full_trace)

    @property
    def cluster(self) -> Cluster:
        return Cluster(self.nodes, self.gpus_per_node)

    def plan(
        self, config: TrainConfig, *, suggest_fixes: bool, speed: SpeedModel | None = None
    ) -> MemoryPlan:
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
            speed=speed,
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
        target = Target.from_args(args, config)
        if args.calibrate:
            from fsdp_utils.plan.calibrate import calibrate_node

            print(calibrate_node(config, target.gpus_per_node, progress=_progress), flush=True)
            return EXIT_FITS
        required = "--auto" if config.auto else "--scaling" if args.scaling else ""
        speed = speed_model(config, target.gpu, required=required)
        if args.scaling:
            from fsdp_utils.plan.scaling import format_scaling, scaling_rows

            assert speed is not None
            print(format_scaling(scaling_rows(config, target.cluster, speed), speed))
            return EXIT_FITS
        if config.auto:
            assert speed is not None
            return _auto(config, target, speed, args)
        if args.find_max_batch:
            plan, summary = find_max_batch_report(config, target, suggest_fixes=not args.no_fixes)
            if speed is not None:
                plan = with_step_time(plan, speed)
        else:
            plan = target.plan(config, suggest_fixes=not args.no_fixes, speed=speed)
            summary = ""
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
    if args.save_json:
        write_json_atomic(Path(args.save_json), plan.to_dict())
    if args.json:
        print(plan.to_json())
    else:
        print(f"{summary}\n\n{format_plan(plan)}" if summary else format_plan(plan))
    return EXIT_DOES_NOT_FIT if plan.fits is False else EXIT_FITS


def _host_memory_per_process(processes: int) -> Gpu:
    """--device cpu without --gpu_memory: the host's available memory shared by its processes."""
    available = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if not available:
        raise ValueError("--auto --device cpu: give --gpu_memory as the memory per process.")
    return Gpu("host memory per process", available // processes)


def _auto(config: TrainConfig, target: Target, speed: SpeedModel, args: argparse.Namespace) -> int:
    """`--plan --auto`: the search, its table (or JSON), the choice file; exit 1 with the
    planner's cheapest fixes when nothing fits."""
    from fsdp_utils.plan.auto import choice_record, format_search, search

    gpu = target.gpu
    if gpu is None:
        if config.device != "cpu":
            raise ValueError(
                "--auto needs the GPU's memory and kind: give --gpu_memory (a100-80gb, h100, ...)."
            )
        gpu = _host_memory_per_process(target.gpus_per_node)
    cluster = target.cluster
    result = search(
        config, cluster, gpu, speed, margin=target.margin, progress=_progress,
        full_trace=target.full_trace,
    )  # fmt: skip
    if result.winner is None:  # what would make it fit: the planner's fixes on the request
        plan = plan_memory(
            config, nodes=target.nodes, gpus_per_node=target.gpus_per_node,
            gpu_memory_bytes=gpu.memory_bytes, gpu_name=gpu.name, margin=target.margin,
            progress=_progress, full_trace=target.full_trace, speed=speed,
        )  # fmt: skip
        if args.json:
            print(json.dumps({**result.to_dict(), "plan": plan.to_dict()}, indent=2))
        else:
            print(
                "--auto: no configuration fits "
                f"({result.considered:,} timed, {result.traced} traced).\n\n{format_plan(plan)}"
            )
        return EXIT_DOES_NOT_FIT
    record = choice_record(config, result, cluster, gpu, speed)
    if args.save_json:
        write_json_atomic(Path(args.save_json), record)
    print(json.dumps(record, indent=2) if args.json else format_search(result, gpu), flush=True)
    return EXIT_FITS


def auto_choice(argv: list[str]) -> dict[str, Any]:
    """What `--auto` picks for a command line (training flags and the planner's: --nodes,
    --gpus_per_node, --gpu_memory with a GPU kind), as the GPU kit's `*-auto` rows ask before
    they run: the record of `choice_record` (its "flags" to add to the row's command, its
    "predicted" tokens/s per GPU, step seconds and peak bytes). ValueError when nothing fits or
    the command cannot be planned."""
    from fsdp_utils.plan.auto import choice_record, search

    config, args = parse_config([*argv, *([] if "--auto" in argv else ["--auto"])], make_parser())
    target = Target.from_args(args, config)
    speed = speed_model(config, target.gpu, required="--auto")
    assert speed is not None
    if target.gpu is None:
        raise ValueError("auto_choice needs --gpu_memory (a GPU kind: h100-80gb, h200, ...).")
    result = search(config, target.cluster, target.gpu, speed, margin=target.margin)
    if result.winner is None:
        raise ValueError(f"--auto: no configuration of {config.model} fits {target.gpu.name}.")
    return choice_record(config, result, target.cluster, target.gpu, speed)
