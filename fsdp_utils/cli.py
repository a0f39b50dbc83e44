"""`chess_finetune.py`'s main: parse, check, train, save. User mistakes end with one clear
paragraph (printed once, by rank 0) and exit code 2, never a bare traceback."""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

from fsdp_utils.config.parse import build_parser, parse_config
from fsdp_utils.config.train_config import TrainConfig

EXIT_USAGE = 2

DESCRIPTION = """Fine-tune a causal LM on chess games (or any text) with FSDP2.
Run with torchrun (one process per GPU; gloo on CPU) or as a plain process."""


def make_parser() -> argparse.ArgumentParser:
    return build_parser(DESCRIPTION, command_options=_add_check_options)


def _add_check_options(checks: argparse._ArgumentGroup) -> None:
    checks.add_argument(
        "--preflight",
        action="store_true",
        help="Check config, batch arithmetic for --world_size processes, offline assets and "
        "sequence length in seconds, without loading weights; exit 0 if all is well.",
    )
    checks.add_argument(
        "--world_size",
        type=int,
        default=None,
        help="With --preflight: the number of processes the run will have.",
    )
    checks.add_argument(
        "--nodes", type=int, default=1, help="With --preflight: the number of nodes (1)."
    )
    checks.add_argument(
        "--gpu_memory",
        default="auto",
        metavar="SIZE",
        help="With --preflight: memory of one GPU for the memory plan (80GiB, a100-80gb, ...); "
        "auto: this node's GPUs (none: no plan); off: no plan.",
    )
    checks.add_argument(
        "--plan",
        action="store_true",
        help="Plan the GPU memory of this run and exit: the same as `python -m fsdp_utils.plan` "
        "(add --nodes, --gpus_per_node, --gpu_memory, --find_max_batch).",
    )


def _rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))


def _fail(message: str) -> int:
    if _rank() == 0:
        print(f"\nerror: {message}\n", file=sys.stderr, flush=True)
    return EXIT_USAGE


def run(config: TrainConfig) -> dict[str, Any]:
    from fsdp_utils.parallel import distributed as dist_utils
    from fsdp_utils.train.trainer import Trainer

    env = dist_utils.init_distributed(config.device, config.collective_timeout_minutes)
    trainer = None
    clean = False
    try:
        trainer = Trainer(config, env)
        trainer.setup()
        summary = trainer.train()
        final = trainer.save_final_model() if summary["status"] == "completed" else None
        summary["final_model"] = str(final) if final else None
        summary["lora"] = config.lora
        summary["output_dir"] = str(trainer.layout.root)
        trainer.write_status(summary["status"], summary["reason"])
        if env.is_main:
            _print_summary(summary)
        clean = True
        return summary
    except BaseException as err:
        if trainer is not None:  # tell the sbatch script not to requeue a failing run
            trainer.write_status("failed", f"{type(err).__name__}: {err}"[:2000])
        raise
    finally:
        if trainer is not None:
            trainer.close()
        # DDP's reducer talks to the process group when it is destroyed: free it first, or
        # gloo can hang or abort at exit.
        del trainer
        gc.collect()
        dist_utils.destroy(synchronize=clean)


def _print_summary(summary: dict[str, Any]) -> None:
    last, ev = summary.get("last") or {}, summary.get("eval")
    if summary["status"] == "completed":
        lines = [f"done in {summary['seconds']:.1f}s"]
    else:
        lines = [
            f"stopped ({summary['reason']}) after {summary['seconds']:.1f}s; the checkpoint is "
            "saved: rerun the same command to continue"
        ]
    if last:
        lines.append(
            f"  final train loss {last['loss']:.4f} | {last['tokens_per_s']:,.0f} tokens/s "
            f"({last['tokens_per_s_per_device']:,.0f} per device)"
        )
    if ev:
        lines.append(f"  eval loss {ev['eval_loss']:.4f} | perplexity {ev['eval_perplexity']:.2f}")
    lines.append(f"  run folder: {summary['output_dir']}")
    if summary.get("final_model") and summary.get("lora"):
        lines.append(f"  LoRA adapters (PeftModel.from_pretrained): {summary['final_model']}")
    elif summary.get("final_model"):
        lines.append(f"  model (from_pretrained): {summary['final_model']}")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    from fsdp_utils.train.trainer import TrainingDivergedError

    argv = sys.argv[1:] if argv is None else argv
    if "--plan" in argv:  # the planner's parser has every training flag and its own
        from fsdp_utils.plan import main as plan_main

        return plan_main([a for a in argv if a != "--plan"])
    parser = make_parser()
    try:
        config, args = parse_config(argv, parser)
    except ValueError as err:
        return _fail(str(err))
    if args.print_config:
        print(config.to_json())
        return 0
    try:
        if args.preflight:
            from fsdp_utils.parallel.distributed import world_size_from_env
            from fsdp_utils.run.preflight import preflight

            world_size = args.world_size or world_size_from_env()
            print(preflight(config, world_size, args.nodes, args.gpu_memory), flush=True)
            from fsdp_utils.run.start import storage_preflight  # after the plan: it must fit first

            print(storage_preflight(config, world_size), flush=True)
            return 0
        run(config)
    except (ValueError, TrainingDivergedError) as err:  # CheckpointError is a ValueError
        return _fail(str(err))
    return 0
