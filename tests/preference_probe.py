"""DPO runs in one process group, each with what a test cannot read from the run folder.

    torchrun --nproc_per_node 2 tests/preference_probe.py RUNS.json

RUNS.json is a list of {"args": [chess_finetune.py flags], "probe": null | "step" | "lora",
"out": path}. Without a probe, the run trains as chess_finetune.py does. With "step": two real
steps, then the third step's forward and backward only, and rank 0 saves that step's loss, the
gathered gradients, the gathered weights before it and every rank's micro-batches (the test
recomputes them in one process, eagerly). With "lora": two real steps, then rank 0 saves the
reference's log-probabilities of a few held-out pairs (the adapters switched off), the policy's,
and those of the base model loaded by transformers in this process, without FSDP.
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


def _clean(name: str) -> str:
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def _step_probe(trainer: Any, out: Path) -> None:
    from fsdp_utils.checkpoint.hf_folder import gather_full_state_dict
    from fsdp_utils.parallel import distributed as dist_utils

    step = trainer.train_step
    first = step(trainer.step_batches(0), step=1)["loss"]
    step(trainer.step_batches(1), step=2)
    state = gather_full_state_dict(trainer.model)
    batches = trainer.step_batches(2)
    pairs, _ = dist_utils.all_reduce_host_sum(step.local_counts(batches))
    total = torch.zeros((), dtype=torch.float64)
    for batch in batches:
        total += step.forward_backward(batch, pairs)
    loss = float(dist_utils.all_reduce_sum(total)) / pairs
    grads = {}
    for name, param in trainer.model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            grads[_clean(name)] = (
                grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            ).cpu()
    every = dist_utils.all_gather_objects(batches)
    if trainer.env.is_main:
        batches_all = [b for rank in every for b in rank]
        torch.save(
            {"first_loss": first, "loss": loss, "grads": grads, "state": state,
             "batches": batches_all, "beta": trainer.config.dpo_beta},
            out,
        )  # fmt: skip


def _lora_probe(trainer: Any, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    from fsdp_utils.preference.loss import sequence_logps

    step = trainer.train_step
    for s in range(2):
        step(trainer.step_batches(s), step=s + 1)
    batch = trainer.eval_blocks.batch([0, 1, 2])
    reference = step.pair_loss.reference.logps(batch)
    trainer.model.eval()
    with torch.no_grad():
        policy = sequence_logps(
            trainer.model, batch, chunking=step.chunking, device=trainer.env.device
        )
    if trainer.env.is_main:
        base = AutoModelForCausalLM.from_pretrained(trainer.model_dir, dtype=torch.float32)
        base.eval()
        with torch.no_grad():
            eager = sequence_logps(base, batch, chunking=step.chunking, device=trainer.env.device)
        torch.save({"reference": reference, "policy": policy, "base": eager}, out)


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
            if run.get("probe") == "step":
                _step_probe(trainer, Path(run["out"]))
            elif run.get("probe") == "lora":
                _lora_probe(trainer, Path(run["out"]))
            else:
                summary = trainer.train()
                if summary["status"] == "completed":
                    trainer.save_final_model()
                trainer.write_status(summary["status"], summary["reason"])
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
