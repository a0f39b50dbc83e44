"""A real training run that also records what the test cannot read from its outputs.

    torchrun --nproc_per_node 2 tests/lora_probe.py --probe_out probe.pt [chess_finetune.py flags]

Runs the real `Trainer` exactly as `chess_finetune.py` does (setup, train, final save), then,
with the trained (sharded) model still in memory: the logits of the first two held-out blocks
(a collective forward) and the whole state dict, frozen base included, gathered to rank 0, which
writes them to `--probe_out`, with the logits of the same blocks before the first step
(`start_logits`: the model as loaded). The test compares them with the PEFT adapter folder, the
merged model, the pretrained weights and an adapter continued with --lora_from.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

# Run as a script (tests/ is then sys.path[0]): import this checkout's package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    from fsdp_utils.checkpoint.hf_folder import gather_full_state_dict
    from fsdp_utils.config.parse import build_parser, parse_config
    from fsdp_utils.parallel import distributed as dist_utils
    from fsdp_utils.run.session import open_trainer

    parser = build_parser()
    parser.add_argument("--probe_out", type=Path, required=True)
    config, args = parse_config(sys.argv[1:], parser)
    env = dist_utils.init_distributed(config.device)
    clean, trainer = False, None
    try:
        trainer = open_trainer(config, env)
        trainer.setup()
        input_ids = trainer.eval_blocks.batch([0, 1])["input_ids"].to(env.device)
        start_logits = _logits(trainer.model, input_ids)
        summary = trainer.train()
        assert summary["status"] == "completed", summary
        trainer.save_final_model()
        logits = _logits(trainer.model, input_ids)
        state = gather_full_state_dict(trainer.model)
        if env.is_main:
            torch.save(
                {
                    "input_ids": input_ids.cpu(),
                    "start_logits": start_logits.float().cpu(),
                    "logits": logits.float().cpu(),
                    "state": state,
                },
                args.probe_out,
            )
        clean = True
    finally:
        if trainer is not None:
            trainer.close()
        # As fsdp_utils.cli.run does: the model and its process-group references go before the
        # group, or a rank's gloo can abort at exit while its peer is gone (SIGABRT, seen here).
        del trainer
        gc.collect()
        dist_utils.destroy(synchronize=clean)
    return 0


def _logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """A collective forward in eval mode (no dropout); the model goes back to training mode."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False).logits
    model.train()
    return logits


if __name__ == "__main__":
    raise SystemExit(main())
