"""Real training runs that also record their first step's gradients and their last weights.

    torchrun --nproc_per_node 2 tests/sequence_parallel_runs.py RUNS.json OUT_DIR

RUNS.json is a list of {"name": ..., "argv": [chess_finetune.py flags]}, run one after another
in this torchrun's process group (as tests/finetune_runs.py does: the interpreter and torch
start once). Each runs the real Trainer as `chess_finetune.py` does (setup, train; no final
model),
and writes OUT_DIR/<name>.pt on rank 0: the gradients the optimizer's first step read (whole
tensors, gathered from the shards) and the whole state dict after the last step. A run that
stops early (--stop_after_steps) records its weights at that step.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter's or gradient's whole tensor (collective for FSDP2's DTensors)."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().float().cpu().clone()


def record_first_gradients(model: torch.nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """The gradients the optimizer's first step reads, filled in when it runs."""
    grads: dict[str, torch.Tensor] = {}
    original = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        if not grads:  # the first step: every rank gathers, in the same order
            for name, param in model.named_parameters():
                if param.grad is not None:
                    grads[name] = whole(param.grad)
        return original(*args, **kwargs)

    optimizer.step = step
    return grads


def run(argv: list[str], out: Path) -> None:
    from fsdp_utils.checkpoint.hf_folder import gather_full_state_dict
    from fsdp_utils.config.parse import build_parser, parse_config
    from fsdp_utils.parallel import distributed as dist_utils
    from fsdp_utils.run.session import open_trainer

    config, _ = parse_config(argv, build_parser())
    env = dist_utils.init_distributed(config.device)
    trainer = open_trainer(config, env)
    try:
        trainer.setup()
        grads = record_first_gradients(trainer.model, trainer.train_step.optimizer)
        trainer.train()
        state = gather_full_state_dict(trainer.model)
        if env.is_main:
            torch.save({"grads": grads, "state": state}, out)
    finally:
        trainer.close()
        del trainer
        gc.collect()


def main() -> int:
    from fsdp_utils.hub.offline import enable_offline_mode

    enable_offline_mode()
    from fsdp_utils.parallel import distributed as dist_utils

    runs, out_dir = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    env = dist_utils.init_distributed("cpu", timeout_minutes=5)
    clean = False
    try:
        for entry in runs:
            run(entry["argv"], out_dir / f"{entry['name']}.pt")
        clean = True
    finally:
        dist_utils.destroy(synchronize=clean)
    del env
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
