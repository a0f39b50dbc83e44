"""`chess_finetune.py --eval_tasks arc_easy,... --eval_limit N`: the benchmarks on the model the
run ends with, in the same job, after the final model is saved.

The trained model is scored as it is in memory, sharded (no reload): every rank takes part, as
in `python -m fsdp_utils.evaluate`. lm-eval's results go to `<run>/lm_eval/`, its table to the
log, and the main score of each task to the end-of-run summary. The tasks' data must be in the
offline cache (`download_models.py --eval_tasks`); the run's preflight checks that before any
training (`fsdp_utils.run.preflight`).

lm-eval's prompt and generation options are the config's `eval_apply_chat_template`,
`eval_fewshot_as_multiturn`, `eval_system_instruction`, `eval_gen_kwargs` and `eval_seed`
(`fsdp_utils.lm_harness.scoring`). Unset, the chat template follows the data: a run that
trained on chat data (rows rendered with a chat template) is scored through the template the
final model carries, with the few-shot examples as turns, as chat models are scored; any other
run as plain text. The log and the results file say which, and why.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.hub.cache import hub_cache_dir
from fsdp_utils.lm_harness.scoring import Scoring, parse_apply_chat_template, template_name_for
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.parallel.parallelize import no_grad_pass

RESULTS_FOLDER = "lm_eval"


def eval_task_names(config: TrainConfig) -> list[str]:
    return [t.strip() for t in (config.eval_tasks or "").split(",") if t.strip()]


def check_eval_tasks(config: TrainConfig, model_dir: Path) -> None:
    """Before training: every task's data is cached (ValueError naming the download), the
    scoring options read as lm-eval reads them, and a chat template asked for is there (the
    model's, or the one --chat_template gives the final model)."""
    from fsdp_utils.lm_harness.tasks import cached_leaves

    names = eval_task_names(config)
    if names:
        cached_leaves(names, hub_cache_dir(config.cache_dir))
    scoring = training_scoring(config, chat_data=None)[0]
    if scoring.apply_chat_template and config.chat_template is None:
        from transformers import AutoTokenizer

        template_name_for(
            AutoTokenizer.from_pretrained(model_dir),
            scoring.apply_chat_template,
            folder=model_dir,
            fix=NO_TEMPLATE_FIX,
            flag=FLAG,
        )


FLAG = "--eval_apply_chat_template"
NO_TEMPLATE_FIX = (
    "Score it as plain text (drop --eval_apply_chat_template, or set it false), or train with "
    "--chat_template FILE (a Jinja chat template), which the final model then carries."
)


def training_scoring(config: TrainConfig, *, chat_data: str | None) -> tuple[Scoring, str]:
    """The run's lm-eval options, and why the chat template is used or not. `chat_data`: the
    source of the template the training rows were rendered with (None: not chat data)."""
    apply = config.eval_apply_chat_template
    if apply is not None:
        why = f" ({FLAG}{'' if parse_apply_chat_template(apply) else ' false'})"
    elif chat_data is not None:
        apply = True
        why = (
            f" (the default for a run on chat data, rendered with {chat_data}; "
            "--eval_apply_chat_template false scores plain text)"
        )
    else:
        why = (
            " (the run's data is not chat; --eval_apply_chat_template scores through the template)"
        )
    scoring = Scoring.resolve(
        apply_chat_template=apply,
        fewshot_as_multiturn=config.eval_fewshot_as_multiturn,
        system_instruction=config.eval_system_instruction,
        gen_kwargs=config.eval_gen_kwargs,
        seed=None if config.eval_seed is None else str(config.eval_seed),
    )
    return scoring, why


def score_final_model(
    model: nn.Module,
    config: TrainConfig,
    env: DistEnv,
    *,
    tokenizer_dir: Path,
    chat_data: str | None,
    log: Any,
) -> dict[str, dict[str, float]] | None:
    """Collective. {task: {metric: value}} on rank 0 (None elsewhere). `tokenizer_dir`: the
    tokenizer the final model was saved with; `chat_data`: the source of the chat template the
    training rows were rendered with (None: not chat data)."""
    from lm_eval import simple_evaluate
    from transformers import AutoTokenizer

    from fsdp_utils.lm_harness.cli import scoring_line, scoring_record, write_results
    from fsdp_utils.lm_harness.sharded_lm import ShardedLM
    from fsdp_utils.lm_harness.task_cache import use_cached_nltk
    from fsdp_utils.lm_harness.tasks import (
        offline_tasks,
        provenance,
        quiet_task_logs,
        task_manager,
    )

    names = eval_task_names(config)
    scoring, why = training_scoring(config, chat_data=chat_data)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    template_name = None
    if scoring.apply_chat_template:
        template_name = template_name_for(
            tokenizer,
            scoring.apply_chat_template,
            folder=tokenizer_dir,
            fix=NO_TEMPLATE_FIX,
            flag=FLAG,
        )
    cache = hub_cache_dir(config.cache_dir)
    quiet_task_logs()
    use_cached_nltk(cache)
    folder = Path(tempfile.mkdtemp(prefix="fsdp-utils-lm-eval-tasks-"))
    leaves = offline_tasks(names, cache, folder)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    lm = ShardedLM(
        inner,
        tokenizer,
        device=env.device,
        rank=env.rank,
        world_size=env.world_size,
        batch_size=config.batch_size_per_device,
        template_name=template_name,
        seed=scoring.sampling_seed,
        model_info={"model": config.model, "run_dir": config.output_dir, "final": True},
        log=log if env.is_main else None,
    )
    if env.is_main:
        log(scoring_line(scoring, lm, template_name, why))
    with no_grad_pass(inner):
        results = simple_evaluate(
            lm,
            tasks=names,
            limit=config.eval_limit,
            task_manager=task_manager(names, leaves, folder),
            **scoring.evaluate_kwargs(),
        )
    record = scoring_record(scoring, lm)
    if not env.is_main or results is None:
        return None
    results.update(record)
    results["fsdp_utils"] = {
        "model": {"run_dir": config.output_dir, "world_size": env.world_size},
        "datasets": provenance(leaves),
        "scoring": scoring.way.describe() + why,
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
