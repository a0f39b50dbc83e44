"""`chess_finetune.py --eval_tasks arc_easy,... --eval_limit N`: the benchmarks on the model the
run ends with, in the same job, after the final model is saved.

The trained model is scored as it is in memory, sharded (no reload): every rank takes part, as
in `python -m fsdp_utils.evaluate`. lm-eval's results go to `<run>/lm_eval/`, its table to the
log, and the main score of each task to the end-of-run summary. The tasks' data must be in the
offline cache (`download_models.py --eval_tasks`); the run's preflight checks that before any
training (`fsdp_utils.run.preflight`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.hub.cache import hub_cache_dir
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.parallel.parallelize import no_grad_pass

RESULTS_FOLDER = "lm_eval"


def eval_task_names(config: TrainConfig) -> list[str]:
    return [t.strip() for t in (config.eval_tasks or "").split(",") if t.strip()]


def check_eval_tasks(config: TrainConfig) -> None:
    """Before training: every task's data is cached (ValueError naming the download)."""
    from fsdp_utils.lm_harness.tasks import cached_leaves

    names = eval_task_names(config)
    if names:
        cached_leaves(names, hub_cache_dir(config.cache_dir))


def score_final_model(
    model: nn.Module,
    config: TrainConfig,
    env: DistEnv,
    *,
    tokenizer_dir: Path,
    log: Any,
) -> dict[str, dict[str, float]] | None:
    """Collective. {task: {metric: value}} on rank 0 (None elsewhere)."""
    from lm_eval import simple_evaluate
    from transformers import AutoTokenizer

    from fsdp_utils.lm_harness.cli import write_results
    from fsdp_utils.lm_harness.sharded_lm import ShardedLM
    from fsdp_utils.lm_harness.task_cache import use_cached_nltk
    from fsdp_utils.lm_harness.tasks import (
        offline_tasks,
        provenance,
        quiet_task_logs,
        task_manager,
    )

    names = eval_task_names(config)
    cache = hub_cache_dir(config.cache_dir)
    quiet_task_logs()
    use_cached_nltk(cache)
    folder = Path(tempfile.mkdtemp(prefix="fsdp-utils-lm-eval-tasks-"))
    leaves = offline_tasks(names, cache, folder)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    lm = ShardedLM(
        inner,
        AutoTokenizer.from_pretrained(tokenizer_dir),
        device=env.device,
        rank=env.rank,
        world_size=env.world_size,
        batch_size=config.batch_size_per_device,
        model_info={"model": config.model, "run_dir": config.output_dir, "final": True},
        log=log if env.is_main else None,
    )
    with no_grad_pass(inner):
        results = simple_evaluate(
            lm,
            tasks=names,
            limit=config.eval_limit,
            task_manager=task_manager(names, leaves, folder),
        )
    if not env.is_main or results is None:
        return None
    results["fsdp_utils"] = {
        "model": {"run_dir": config.output_dir, "world_size": env.world_size},
        "datasets": provenance(leaves),
    }
    out = RunLayout.of(config.output_dir).root / RESULTS_FOLDER
    out.mkdir(parents=True, exist_ok=True)
    write_results(results, out, log_samples=False, log=log)
    return {
        task: {
            key: float(value)
            for key, value in scores.items()
            if "," in key and "_stderr," not in key and isinstance(value, int | float)
        }
        for task, scores in results["results"].items()
    }
