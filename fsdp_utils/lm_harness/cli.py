"""`python -m fsdp_utils.evaluate --model MODEL --tasks arc_easy,hellaswag,...`: standard
benchmarks with lm-evaluation-harness, the model sharded with FSDP2 as in training.

Under torchrun (one process per GPU; gloo on CPU) or as one process. MODEL is a hub id in the
offline cache, a model folder, a run folder (its final model) or a LoRA adapter folder (over its
base). The tasks' datasets come from the offline cache (`download_models.py --eval_tasks`);
nothing is fetched. lm-eval's results JSON (and with --log_samples its per-sample files) go to
--output_dir (default: <run>/lm_eval for a run folder, else ./lm_eval_results), its table to the
log; --compare BASE_RESULTS prints the base model's scores against these.

lm-eval's prompt and generation options keep its names and meanings: --apply_chat_template
[TEMPLATE_NAME], --fewshot_as_multiturn, --system_instruction, --gen_kwargs, --seed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_utils.arguments import ArgumentParser

if TYPE_CHECKING:
    from fsdp_utils.lm_harness.scoring import Scoring

DEFAULT_OUTPUT = "lm_eval_results"
AUTO = "auto"
CPU_BATCH = 8  # --batch_size auto on CPU: memory is rarely the limit there, time is
AUTO_MAX_ROWS = 64  # --batch_size auto on GPUs: at most this many rows (lm-eval's own cap)
# (eval TrainConfig, tokens per row) -> (tokens one forward may hold, a line for the log)
Planner = Callable[[Any, int], tuple[int, str]]
RESULTS_FOLDER = "lm_eval"  # inside a run folder


def build_parser() -> argparse.ArgumentParser:
    from fsdp_utils.lm_harness.scoring import add_scoring_arguments

    p = ArgumentParser(
        prog="python -m fsdp_utils.evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        required=True,
        help="hub id (offline cache), model folder, run folder or LoRA adapter folder",
    )
    p.add_argument(
        "--tasks", required=True, help="comma-separated lm-eval tasks or groups (arc_easy,mmlu)"
    )
    p.add_argument("--limit", type=float, help="at most N documents per task (a fraction if < 1)")
    p.add_argument("--num_fewshot", type=int, help="few-shot examples (default: each task's own)")
    p.add_argument(
        "--batch_size",
        type=batch_size_option,
        default=AUTO,
        help="rows per forward pass per rank, or auto (default): on GPUs as many as the memory "
        f"plan fits (at most {AUTO_MAX_ROWS}), on CPU {CPU_BATCH}",
    )
    p.add_argument(
        "--include_path",
        metavar="DIR",
        help="extra task YAMLs (lm-eval's --include_path); their datasets must be local folders",
    )
    p.add_argument("--output_dir", metavar="DIR", help="where the results JSON goes")
    p.add_argument("--log_samples", action="store_true", help="also write per-sample files")
    p.add_argument(
        "--compare",
        metavar="BASE_RESULTS",
        help="a results JSON (or its folder) of the base model: print base against this",
    )
    p.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "bf16-true", "bf16-mixed", "fp16-mixed", "fp32"],
        help="auto: the checkpoint's dtype (bf16 weights stay bf16, as lm-eval loads them)",
    )
    p.add_argument("--max_length", type=int, help="context length (default: the model's)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--cache_dir", metavar="DIR", help="offline cache (default: the HF cache)")
    p.add_argument(
        "--bootstrap_iters",
        type=int,
        default=100_000,
        help="bootstrap resamples for the standard errors of non-mean metrics (lm-eval's default)",
    )
    add_scoring_arguments(p)
    return p


def batch_size_option(text: str) -> int | str:
    if text == AUTO:
        return AUTO
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a number of rows (1 or more) or auto, not {text!r}")


def task_names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError("--tasks names no task. Pass e.g. --tasks arc_easy,hellaswag.")
    return names


def output_folder(args: argparse.Namespace, run_dir: Path | None) -> Path:
    if args.output_dir:
        return Path(args.output_dir).expanduser()
    return run_dir / RESULTS_FOLDER if run_dir else Path(DEFAULT_OUTPUT)


def evaluate(
    args: argparse.Namespace, log: Any = print, *, planner: Planner | None = None
) -> dict[str, Any] | None:
    """Collective. Returns lm-eval's results dict on rank 0 (None elsewhere). `planner`: the
    memory plan that sizes the forwards of `--batch_size auto` on GPUs (it traces the model in
    a fake process group of its own, so it runs before this process joins the real one)."""
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from fsdp_utils.checkpoint.saved_model import (
        default_precision,
        eval_config,
        load_sharded_model,
        resolve_model_source,
    )
    from fsdp_utils.hub.cache import hub_cache_dir
    from fsdp_utils.hub.resolve import load_model_config
    from fsdp_utils.lm_harness.compare import check_same_way, comparison_table, load_results
    from fsdp_utils.lm_harness.scoring import Scoring, template_name_for
    from fsdp_utils.lm_harness.sharded_lm import ShardedLM
    from fsdp_utils.lm_harness.task_cache import use_cached_nltk
    from fsdp_utils.lm_harness.tasks import (
        LeafTask,
        offline_tasks,
        provenance,
        quiet_task_logs,
        task_manager,
    )
    from fsdp_utils.parallel import distributed as dist_utils

    quiet_task_logs()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    scoring = Scoring.resolve(
        apply_chat_template=args.apply_chat_template,
        fewshot_as_multiturn=args.fewshot_as_multiturn,
        system_instruction=args.system_instruction,
        gen_kwargs=args.gen_kwargs,
        seed=args.seed,
    )
    batch_size, token_budget = args.batch_size, None
    if args.batch_size == AUTO:
        cuda = dist_utils.device_type(args.device) == "cuda"
        batch_size = AUTO_MAX_ROWS if cuda else CPU_BATCH
        if cuda and planner is not None:
            token_budget = planned_budget(args, planner, log)
        elif int(os.environ.get("RANK", "0")) == 0:
            log(f"batch: auto on CPU: {CPU_BATCH} rows per forward")
    env = dist_utils.init_distributed(args.device)
    names = task_names(args.tasks)
    cache = hub_cache_dir(args.cache_dir)
    use_cached_nltk(cache)
    overrides = Path(tempfile.mkdtemp(prefix="fsdp-utils-lm-eval-tasks-"))

    user_tasks: set[str] = set()
    if args.include_path:  # the user's own tasks read local data: nothing to look up
        user = TaskManager(include_path=args.include_path, include_defaults=False)
        user_tasks = set(user.all_tasks)

    def prepare() -> tuple[Any, list[LeafTask], Path, str | None]:
        # A wrong path or another way of scoring fails now, not after the evaluation.
        if args.compare:
            check_same_way(load_results(args.compare), scoring.way, base_name=args.compare)
        source = resolve_model_source(args.model, args.cache_dir)
        template = None
        if scoring.apply_chat_template:
            fix = (
                "Score it as plain text (without --apply_chat_template), or give the tokenizer "
                "the template the model was trained with: a chat_template.jinja beside its "
                "tokenizer_config.json (a run trained with --chat_template FILE saves it in "
                "final/)."
            )
            tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_dir)
            template = template_name_for(
                tokenizer, scoring.apply_chat_template, folder=source.tokenizer_dir, fix=fix
            )
        leaves = offline_tasks([n for n in names if n not in user_tasks], cache, overrides)
        out = output_folder(args, source.run_dir)
        out.mkdir(parents=True, exist_ok=True)
        return source, leaves, out, template

    # Rank 0 checks (one message for a mistake); every rank then writes its own task files
    # (the temporary folder is per process).
    checked = dist_utils.on_main_rank(prepare)
    source, leaves, out, template_name = dist_utils.broadcast_object(checked)  # type: ignore[misc]
    if not env.is_main:
        prepare()
    hf_config = load_model_config(source.weights_dir)
    precision = default_precision(hf_config) if args.precision == "auto" else args.precision
    config = eval_config(source, precision=precision, cache_dir=args.cache_dir)
    started = time.monotonic()
    model = load_sharded_model(source, config, env)
    log(
        f"model: {source.requested} ({hf_config.model_type}), {precision}"
        + (", the adapter over its NF4 base as it trained" if source.quantize != "none" else "")
        + ", FSDP2 over "
        f"{env.world_size} process(es) on {env.device.type}, loaded in "
        f"{time.monotonic() - started:.1f}s"
    )
    identity = source.identity() | {"precision": precision, "world_size": env.world_size}
    lm = ShardedLM(
        model,
        AutoTokenizer.from_pretrained(source.tokenizer_dir),
        device=env.device,
        rank=env.rank,
        world_size=env.world_size,
        batch_size=batch_size,
        token_budget=token_budget,
        max_length=args.max_length,
        template_name=template_name,
        seed=scoring.sampling_seed,
        model_info=identity,
        log=log if env.is_main else None,
    )
    if env.is_main:
        log(scoring_line(scoring, lm, template_name))
    manager = task_manager(
        names, leaves, overrides, [args.include_path] if args.include_path else None
    )
    with torch.no_grad():
        results = simple_evaluate(
            lm,
            tasks=names,
            num_fewshot=args.num_fewshot,
            limit=args.limit,
            log_samples=args.log_samples,
            bootstrap_iters=args.bootstrap_iters,
            task_manager=manager,
            **scoring.evaluate_kwargs(),
        )
    record = scoring_record(scoring, lm)
    del lm, model
    gc.collect()
    if not env.is_main or results is None:
        return None
    results["config"]["model"] = source.requested
    results.update(record)
    results["fsdp_utils"] = {
        "model": identity,
        "datasets": provenance(leaves),
        "scoring": scoring.way.describe(),
    }
    write_results(results, out, log_samples=args.log_samples, log=log)
    if args.compare:
        log(comparison_table(load_results(args.compare), results, base_name=args.compare))
    return results


def scoring_line(scoring: Scoring, lm: Any, template_name: str | None, why: str = "") -> str:
    """The log's line on how the prompts are written, and `why` (the end of training says it);
    without a template and a why, whether the model has one chat models are scored with."""
    line = f"scoring: {scoring.way.describe()}{why}"
    if scoring.apply_chat_template:
        chosen = f" {template_name!r}" if template_name else ""
        line += f"; the tokenizer's chat template{chosen} ({lm.tokenizer_name})"
        if isinstance(scoring.apply_chat_template, str) and not template_name:
            name = scoring.apply_chat_template
            line += f", its only one: the name {name!r} is ignored, as lm-eval ignores it"
    elif not why and getattr(lm.tokenizer, "chat_template", None):
        line += (
            "; the model has a chat template: chat models are usually scored with it "
            "(--apply_chat_template, docs/evaluate.md)"
        )
    return line


def scoring_record(scoring: Scoring, lm: Any) -> dict[str, Any]:
    """lm-eval's record of the prompt format (its keys), with the template's text as lm-eval
    picks it."""
    template = (
        lm.chat_template(scoring.apply_chat_template) if scoring.apply_chat_template else None
    )
    return scoring.record(template)


def planned_budget(args: argparse.Namespace, planner: Planner, log: Any) -> int:
    """The tokens one forward may hold on this GPU, from the memory plan (every rank plans the
    same model alike, so they agree; rank 0 logs it)."""
    from fsdp_utils.checkpoint.saved_model import (
        default_precision,
        eval_config,
        resolve_model_source,
    )
    from fsdp_utils.hub.resolve import load_model_config

    source = resolve_model_source(args.model, args.cache_dir)
    hf_config = load_model_config(source.weights_dir)
    precision = default_precision(hf_config) if args.precision == "auto" else args.precision
    config = eval_config(source, precision=precision, cache_dir=args.cache_dir)
    seq_len = args.max_length or int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
    budget, line = planner(config, seq_len)
    if int(os.environ.get("RANK", "0")) == 0:
        log(line)
    return budget


def write_results(
    results: dict[str, Any], out: Path, *, log_samples: bool, log: Any = print
) -> Path:
    """lm-eval's files, named as its own command names them: results_<date>.json and
    samples_<task>_<date>.jsonl."""
    from lm_eval.utils import handle_non_serializable, make_table

    samples = results.pop("samples", None)
    stamp = time.strftime("%Y-%m-%dT%H-%M-%S")
    path = out / f"results_{stamp}.json"
    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    path.write_text(text + "\n")
    if log_samples and samples:
        for task, rows in samples.items():
            with (out / f"samples_{task}_{stamp}.jsonl").open("w") as f:
                for row in rows:
                    f.write(json.dumps(row, default=handle_non_serializable) + "\n")
    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    log(f"{table}\nresults: {path}")
    return path


def main(argv: list[str] | None = None, *, planner: Planner | None = None) -> int:
    from fsdp_utils.hub.offline import enable_offline_mode

    enable_offline_mode()  # before any Hugging Face import: nothing is fetched from here on
    from fsdp_utils.parallel import distributed as dist_utils

    args = build_parser().parse_args(argv)
    code, _ = dist_utils.run_command(
        lambda: evaluate(args, log=lambda line: print(line, flush=True), planner=planner)
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
