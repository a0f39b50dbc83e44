"""Measure a real training step with the same tracker the planner uses, to validate the planner.

    torchrun --standalone --nproc_per_node 2 -m fsdp_utils.plan.measure --out step.json \
        [chess_finetune.py training flags]

Every rank builds the real `Trainer` (weights, data, FSDP2 over gloo or nccl), runs one
untracked warm-up step, then one step under `FSDPMemTracker` (`tracking.track_train_step`).
Rank 0 writes its `StepMemory` as JSON, to compare with `plan_memory` for the same flags.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fsdp_utils.config.parse import build_parser, parse_config
from fsdp_utils.plan.tracking import track_train_step


def main(argv: list[str] | None = None) -> int:
    from fsdp_utils.parallel import distributed as dist_utils
    from fsdp_utils.train.trainer import Trainer

    parser = build_parser(__doc__)
    parser.add_argument("--out", required=True, type=Path, help="JSON file for rank 0's result.")
    try:
        config, args = parse_config(argv, parser)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    env = dist_utils.init_distributed(config.device)
    clean = False
    try:
        trainer = Trainer(config, env)
        trainer.setup()
        trainer.train_step()  # warm-up: creates the optimizer state, untracked
        trainer.state.step += 1
        memory = track_train_step(trainer)
        trainer.close()
        clean = True
    finally:
        dist_utils.destroy(synchronize=clean)
    if env.is_main:
        record = {"world_size": env.world_size, "device": str(env.device), **memory.to_dict()}
        args.out.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
