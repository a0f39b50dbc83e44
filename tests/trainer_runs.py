"""Several real training runs in one process group, to spare the tests a start-up per run.

    torchrun --nproc_per_node 2 tests/trainer_runs.py RUNS.json   (or: python ... for 1 process)

RUNS.json is a list of {"args": [chess_finetune.py flags], "probe": path or null, "measure": path
or null}, run in order, each as `chess_finetune.py` runs it (Trainer setup, train, final model,
status), so that later runs can resume from the checkpoints of earlier ones. With "probe", rank 0
also saves what a test cannot read from the run folder: the trained (sharded) model's logits on
the first two held-out blocks and its whole state dict, gathered. With "measure", the run is
instead one warm-up step and one step under the planner's tracker (`fsdp_utils.plan.measure`),
whose `StepMemory` rank 0 writes as JSON.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch

# Run as a script (tests/ is then sys.path[0]): import this checkout's package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _probe(trainer: Any, path: Path) -> None:
    from fsdp_utils.checkpoint.hf_folder import gather_full_state_dict

    input_ids = trainer.eval_blocks.batch([0, 1])["input_ids"].to(trainer.env.device)
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(input_ids=input_ids, use_cache=False).logits
    state = gather_full_state_dict(trainer.model)
    if trainer.env.is_main:
        record = {"input_ids": input_ids.cpu(), "logits": logits.float().cpu(), "state": state}
        torch.save(record, path)


def _measure(trainer: Any, path: Path) -> None:
    from fsdp_utils.plan.tracking import track_train_step

    # Warm-up: creates the optimizer state, untracked (as fsdp_utils.plan.measure does).
    trainer.train_step(trainer.step_batches(0), step=1)
    memory = track_train_step(trainer.train_step, lambda: trainer.step_batches(1), step=2)
    if trainer.env.is_main:
        record = {"world_size": trainer.env.world_size, **memory.to_dict()}
        path.write_text(json.dumps(record, indent=2))


def main() -> int:
    from fsdp_utils.config.parse import build_parser, parse_config
    from fsdp_utils.parallel import distributed as dist_utils
    from fsdp_utils.run.session import open_trainer

    runs = json.loads(Path(sys.argv[1]).read_text())
    env = None
    clean = False
    try:
        for run in runs:
            config, _ = parse_config(run["args"], build_parser())
            env = env or dist_utils.init_distributed(config.device)
            trainer = open_trainer(config, env)
            trainer.setup()
            if run.get("measure"):
                _measure(trainer, Path(run["measure"]))
            else:
                summary = trainer.train()
                if summary["status"] == "completed":
                    trainer.save_final_model()
                trainer.write_status(summary["status"], summary["reason"])
                if run.get("probe"):
                    _probe(trainer, Path(run["probe"]))
            trainer.close()
            del trainer
            gc.collect()
        clean = True
    finally:
        if env is not None:
            dist_utils.destroy(synchronize=clean)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
