"""Measure a real training step with the same tracker the planner uses, to validate the planner.

    torchrun --standalone --nproc_per_node 2 -m fsdp_utils.plan.measure --out step.json \
        [chess_finetune.py training flags]

Every rank builds the real `Trainer` (weights, data, FSDP2 over gloo or nccl), runs one
untracked warm-up step, then its second step under `FSDPMemTracker` (`tracking.track_train_step`).
Rank 0 writes its `StepMemory` as JSON, to compare with `plan_memory` for the same flags.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_utils.config.parse import build_parser, parse_config
from fsdp_utils.plan.tracking import StepMemory, track_train_step

if TYPE_CHECKING:
    from fsdp_utils.trainer.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    from fsdp_utils.config.batch import plan_batch
    from fsdp_utils.config.seq_length import fit_seq_length
    from fsdp_utils.hub.resolve import resolve_assets
    from fsdp_utils.parallel import distributed as dist_utils
    from fsdp_utils.parallel.single_device import uses_direct_path
    from fsdp_utils.trainer.trainer import Trainer

    parser = build_parser(__doc__)
    parser.add_argument("--out", required=True, type=Path, help="JSON file for rank 0's result.")
    try:
        config, args = parse_config(argv, parser)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if uses_direct_path(config, dist_utils.world_size_from_env()):
        print(
            "error: --single_device_path direct has no FSDP2 groups for the tracker to follow. "
            "Measure the run the planner traces in its place: drop --single_device_path and add "
            "--sharding shard_grad_op (or, with --gradient_checkpointing, --reshard_last_layer).",
            file=sys.stderr,
        )
        return 2
    env = dist_utils.init_distributed(config.device)
    clean, trainer = False, None
    try:
        assets = resolve_assets(config)
        config = fit_seq_length(config, assets.model_config)[0]
        plan = plan_batch(config, env.world_size)
        trainer = Trainer(config, env, plan=plan, assets=assets)
        trainer.setup()
        memory = _measure(trainer)
        clean = True
    finally:
        if trainer is not None:
            trainer.close()
        trainer = None  # and its model's hold on the group, before the group (see destroy)
        gc.collect()
        dist_utils.destroy(synchronize=clean)
    if env.is_main:
        record = {"world_size": env.world_size, "device": str(env.device), **memory.to_dict()}
        args.out.write_text(json.dumps(record, indent=2))
    return 0


def _measure(trainer: Trainer) -> StepMemory:
    """A warm-up step (it creates the optimizer state, untracked), then one tracked step."""
    trainer.train_step(trainer.step_batches(0), step=1)
    return track_train_step(trainer.train_step, lambda: trainer.step_batches(1), step=2)


if __name__ == "__main__":
    raise SystemExit(main())
