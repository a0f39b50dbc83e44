"""A run's start on this process, as `chess_finetune.py` makes it: the checks once
(`preflight.check_run`: batch plan, assets, model config), the run folder ready for every rank
(`start.start_run`), then the Trainer, which gets both. Tools and tests that need a real Trainer
open it here too."""

from __future__ import annotations

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.run.host_threads import choose_cpu_threads
from fsdp_utils.run.preflight import check_run
from fsdp_utils.run.start import start_run
from fsdp_utils.trainer.trainer import Trainer


def open_trainer(config: TrainConfig, env: DistEnv) -> Trainer:
    """Collective. The run's Trainer, its log open, not yet set up (`Trainer.setup`)."""
    config, plan, assets, checks = check_run(config, env.world_size)
    notes = start_run(config, env)
    threads = choose_cpu_threads(env)  # a CPU run nothing configured: the CPUs that are idle
    trainer = Trainer(config, env, plan=plan, assets=assets)
    for note in [*checks, *notes, *([threads] if threads else [])]:
        trainer.log.info(note)
    return trainer
