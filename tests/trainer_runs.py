"""Several real training runs in one process group, to spare the tests a start-up per run.

    torchrun --nproc_per_node 2 tests/trainer_runs.py RUNS.json   (or: python ... for 1 process)

RUNS.json is a list of {"args": [chess_finetune.py flags], "probe": path or null, "measure": path
or null}, run in order, each as `chess_finetune.py` runs it (Trainer setup, train, final model,
status), so that later runs can resume from the checkpoints of earlier ones. With "probe", rank 0
also saves what a test cannot read from the run folder: the trained (sharded) model's logits on
the first two held-out blocks and its whole state dict, gathered. With "measure", the run is
instead one warm-up step and one step under the planner's tracker (`fsdp_utils.plan.measure`),
whose `StepMemory` rank 0 writes as JSON. With "dpo_probe" (and "out": a path), a DPO run
(tests/test_preference.py): "step" runs two real steps, then the third step's forward and
backward only, and rank 0 saves that step's loss, the gathered gradients, the gathered weights
before it and every rank's micro-batches (the test recomputes them in one process, eagerly);
"lora" runs two real steps, then rank 0 saves the reference's log-probabilities of a few
held-out pairs (the adapters off), the policy's, and those of the base model loaded by
transformers in this process, without FSDP. With "stop_after_reference_batches": K, the stop
file is written on rank 0 after its K-th batch of the DPO reference pass, as slurm/finetune.sh
writes it when Slurm signals the time limit: the pass asks before every batch, so it stops
after K batches on every rank, whatever the machine's load; K = 0: as the pass begins, before
its first pair; "stop_after_teacher_cache_batches" does the same in a distillation teacher's cache
pass. With "stop_at_start": the stop file is there before the Trainer is opened, as when Slurm's
signal came while the job was starting.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
from collections.abc import Iterator
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


def _clean(name: str) -> str:
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def _dpo_step(trainer: Any, out: Path) -> None:
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


def _dpo_lora(trainer: Any, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    from fsdp_utils.methods.dpo.loss import sequence_logps

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


# Work before the first step that asks the stop controller between its batches: the function
# each batch calls, by the runs.json key that counts them (tests/test_preference.py,
# tests/test_distill.py).
_STOP_HOOKS = {
    "stop_after_reference_batches": ("fsdp_utils.methods.dpo.reference", "ForwardSettings", "logps"),
    "stop_after_teacher_cache_batches": (
        "fsdp_utils.methods.distill.teacher", "LiveTeacher", "cache_entries"
    ),
}  # fmt: skip


@contextlib.contextmanager
def _stop_in_pass(run: dict[str, Any], config: Any, rank: int) -> Iterator[None]:
    import importlib

    from fsdp_utils.config.layout import RunLayout

    hooks = [(key, run[key]) for key in _STOP_HOOKS if run.get(key) is not None]
    if not hooks:
        yield
        return
    (key, batches), *_ = hooks
    if key == "stop_after_reference_batches" and batches == 0:
        # As the pass begins: DPO's before_first_step, before the pass first asks.
        from fsdp_utils.methods.dpo.method import DPO

        begin = DPO.before_first_step

        def stopped_first(self: Any, *args: Any) -> Any:
            if rank == 0:
                RunLayout.of(config.output_dir).stop_file(config.stop_file).touch()
            return begin(self, *args)

        DPO.before_first_step = stopped_first  # type: ignore[method-assign]
        try:
            yield
        finally:
            DPO.before_first_step = begin  # type: ignore[method-assign]
        return
    module_name, class_name, attribute = _STOP_HOOKS[key]
    owner = getattr(importlib.import_module(module_name), class_name)
    original = getattr(owner, attribute)
    done = 0

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal done
        result = original(self, *args, **kwargs)
        done += 1
        if done == batches and rank == 0:
            RunLayout.of(config.output_dir).stop_file(config.stop_file).touch()
        return result

    setattr(owner, attribute, counted)
    try:
        yield
    finally:
        setattr(owner, attribute, original)


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
            if run.get("stop_at_start") and env.is_main:
                from fsdp_utils.config.layout import RunLayout

                stop_file = RunLayout.of(config.output_dir).stop_file(config.stop_file)
                stop_file.parent.mkdir(parents=True, exist_ok=True)
                stop_file.touch()
            trainer = open_trainer(config, env)
            with _stop_in_pass(run, config, env.rank):
                trainer.setup()
            if run.get("measure"):
                _measure(trainer, Path(run["measure"]))
            elif run.get("dpo_probe"):  # tests/test_preference.py
                probe = {"step": _dpo_step, "lora": _dpo_lora}[run["dpo_probe"]]
                probe(trainer, Path(run["out"]))
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
