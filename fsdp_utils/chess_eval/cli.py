"""`python -m fsdp_utils.chess_eval MODEL`: the chess evaluation of a saved model, standalone.

MODEL is a Hugging Face folder (a run's `final/`, an exported checkpoint), a run folder (its
`final/`), a hub id in the offline cache, or a LoRA adapter folder (`adapter_config.json`; its
base model is resolved the same way and the adapter applied as the trainer applies it). The
data and template come, in this order of precedence, from the flags, `--config FILE` (a
training config), the run's own `config.json`, and the trainer's defaults: so a run's `final/`
is evaluated on that run's held-out games without any flag.

One process, or several under torchrun (`torchrun --nproc_per_node N -m fsdp_utils.chess_eval
MODEL`): the model is sharded with FSDP2 as in training (`fsdp_utils.checkpoint.saved_model`),
the games are dealt to the processes, and each process runs its own engine on its own share, so
the engine work is spread over their CPU cores. The engine judge (`--chess_engine`, short
`--engine`: auto, on, off or the engine's path) and the ladder's games (`--ladder RUNGS`) are
described in docs/chess-eval.md. With `--output_dir` (default: `<run>/chess_eval/final` for a
run's model) rank 0 writes the per-move records (moves.jsonl), the games (games.jsonl,
games.pgn) and the summary (summary.json), all four or none.

Exit status: 0; 2 for a user mistake (one paragraph naming the fix: a missing engine with
`--engine on`, an engine path that is not a working UCI engine); 1 if an engine kept failing
after its restarts (the referee's figures are still printed; no records are written, so the
previous ones stay).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import typing
from pathlib import Path
from typing import Any, Literal

from fsdp_utils.arguments import ArgumentParser
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.parse import add_config_arguments, config_from_dict, load_config_file
from fsdp_utils.config.seq_length import fit_seq_length
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.prepare import NotChessData

EXIT_USAGE, EXIT_ENGINE_FAILED = 2, 1

# Trainer options that select and render the games: same names, same meaning (help texts
# come from TrainConfig).
DATA_OPTIONS = (
    "dataset", "dataset_include", "dataset_revision", "cache_dir", "data_cache_dir",
    "template", "seed", "eval_examples", "max_examples", "max_seq_length",
)  # fmt: skip
# Trainer options that decide how the model runs, taken from the run's config like the data's.
MODEL_OPTIONS = ("attn_implementation", "chess_engine", "chess_eval_engine")
# Short spellings of the evaluation's own TrainConfig fields.
EVAL_OPTIONS = {
    "games": "chess_eval_games",
    "plies": "chess_eval_plies",
    "temperature": "chess_eval_temperature",
    "batch_size": "chess_eval_batch_size",
    "depth": "chess_eval_depth",
    "nodes": "chess_eval_nodes",
    "judged_plies": "chess_eval_judged_plies",
    "ladder": "chess_eval_ladder",
    "ladder_games": "chess_eval_ladder_games",
    "masking": "chess_eval_masking",
}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m fsdp_utils.chess_eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model", help="model folder, hub id (offline cache), run folder or LoRA adapter folder"
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="training config (YAML/JSON), or a run folder's config.json, to take data options from",
    )
    parser.add_argument(
        "--tokenizer", metavar="DIR", help="tokenizer folder (default: the model's)"
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--preflight",
        action="store_true",
        help="check the options, the model, the held-out games and the engine in seconds, "
        "load nothing, exit (on the login node before sbatch; slurm/evaluate.sh runs it first)",
    )
    parser.add_argument(
        "--output_dir",
        dest="records_dir",  # not TrainConfig's output_dir: this is not a run folder
        metavar="DIR",
        help="where rank 0 writes moves.jsonl, games.jsonl, games.pgn and summary.json "
        "(default: <run>/chess_eval/final for a run's model; none otherwise)",
    )
    add_config_arguments(parser, only=DATA_OPTIONS + MODEL_OPTIONS)
    parser.add_argument(
        "--engine", dest="chess_engine", metavar="auto|on|off|PATH", default=argparse.SUPPRESS,
        help="short for --chess_engine",
    )  # fmt: skip
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    hints = typing.get_type_hints(TrainConfig)
    kinds: dict[str, Any] = {"chess_eval_temperature": float, "chess_eval_ladder": str}
    for short, name in EVAL_OPTIONS.items():
        f = fields[name]
        extra: dict[str, Any] = {"type": kinds.get(name, int)}
        if typing.get_origin(hints[name]) is Literal:  # its values, from the field's type
            extra = {"choices": list(typing.get_args(hints[name]))}
        parser.add_argument(
            f"--{short}", f"--{name}", dest=name, default=argparse.SUPPRESS,
            help=f"{f.metadata['help']} (default: {f.default})", **extra,
        )  # fmt: skip
    return parser


def run_config_near(model: Path) -> tuple[dict[str, Any], Path | None]:
    """The training config of the run that wrote `model` (`<run>/final` or `<run>` ->
    `<run>/config.json`, which holds the options under "config"; a model's own config.json
    does not) and that file."""
    for path in (model.parent / "config.json", model / "config.json"):
        if not path.is_file():
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        config = record.get("config") if isinstance(record, dict) else None
        if isinstance(config, dict):
            return dict(config), path
    return {}, None


def resolve_config(args: argparse.Namespace, model: Path) -> tuple[TrainConfig, str]:
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    values: dict[str, Any] = {}
    source = "the trainer's defaults"
    run_values, run_file = run_config_near(model)
    if run_values:
        values.update({k: v for k, v in run_values.items() if k in known})
        source = f"the run's {run_file}"
    if args.config:  # a config file, or a run folder's config.json (its options)
        values.update(load_config_file(args.config))
        source = args.config
    values.update({k: v for k, v in vars(args).items() if k in known})
    values.pop("chess_eval_every", None)
    return config_from_dict(values, source="the command line and config file"), source


def not_games(err: NotChessData, config: TrainConfig, source: str, model: str) -> ValueError:
    """A dataset that is not games, said with the fix: a GRPO run trained on chess prompts
    (fsdp_utils/chess_eval/prompt_set.py), whose games are those of the run it started from."""
    if "prompt" not in err.columns:
        return err
    # The run that wrote `model`, and the run whose final model it started from.
    started_from = run_config_near(Path(model).expanduser())[0].get("model")
    games_run = run_config_near(Path(started_from)) if isinstance(started_from, str) else None
    if games_run is not None and games_run[1] is not None:
        fix = (
            f"take them from the run its model came from: python -m fsdp_utils.chess_eval "
            f"{model} --config {games_run[1]}"
        )
    else:
        fix = (
            "give the games its model learned from: --config RUN/config.json (that run's "
            "data and template), or --dataset GAMES with the --template the model learned"
        )
    return ValueError(
        f"The data and template come from {source}, whose dataset {config.dataset} holds "
        f"prompts (columns {err.columns}: a GRPO run's chess prompts), not games; the chess "
        f"evaluation plays on from held-out games. To judge this model, {fix}."
    )


def default_output_dir(model: Path) -> Path | None:
    """`<run>/chess_eval/final` when `model` is a run folder or its final/; None otherwise."""
    for run in (model, model.parent):
        layout = RunLayout.of(run)
        is_run = layout.config.is_file() and layout.final_model.is_dir()
        if is_run and model.resolve() in (run.resolve(), layout.final_model.resolve()):
            return layout.chess_eval / "final"
    return None


def preflight(args: argparse.Namespace) -> str:
    """The checks a job would fail on, without loading the model: the options, the model's
    folders, the held-out games, the engine (started once, its version printed)."""
    from fsdp_utils.checkpoint.saved_model import resolve_model_source
    from fsdp_utils.chess_eval.evaluator import EngineSettings
    from fsdp_utils.chess_eval.games import require_games
    from fsdp_utils.data.prepare import held_out_games

    config, source_text = resolve_config(args, Path(args.model).expanduser())
    settings, note = EngineSettings.from_config(config)
    source = resolve_model_source(args.model, config.cache_dir)
    try:
        games = held_out_games(config, limit=config.chess_eval_games)
    except NotChessData as err:
        raise not_games(err, config, source_text, args.model) from err
    require_games(games)
    if settings is not None:
        note += f" ({settings.check()})"
    return (
        f"preflight OK: model {source.adapter_dir or source.weights_dir}; {len(games)} held-out "
        f"games (data and template from {source_text}); {note}"
    )


def evaluate_saved_model(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse, load (sharded), evaluate; collective under torchrun. Returns {"model",
    "config_source", "metrics", "written"} (the same metrics on every rank; files on rank 0)."""
    from fsdp_utils.checkpoint.saved_model import (
        default_precision,
        eval_config,
        load_sharded_model,
        resolve_model_source,
    )
    from fsdp_utils.chess_eval.evaluator import ChessEvaluator, EngineSettings, write_records
    from fsdp_utils.hub.resolve import load_model_config
    from fsdp_utils.parallel import distributed as dist_utils

    args = build_parser().parse_args(argv)
    model_path = Path(args.model).expanduser()
    config, source_text = resolve_config(args, model_path)
    EngineSettings.from_config(config)  # a required engine that is missing: before any loading
    env = dist_utils.init_distributed(args.device)
    source = resolve_model_source(args.model, config.cache_dir)
    if args.tokenizer:
        source = dataclasses.replace(source, tokenizer_dir=Path(args.tokenizer))
    tokenizer = load_tokenizer(source.tokenizer_dir)
    hf_config = load_model_config(source.weights_dir)
    config = fit_seq_length(config, hf_config)[0]  # a default length fits the model's context
    # The games and the engine before the weights: a dataset that is not chess fails in seconds.
    try:
        evaluator = ChessEvaluator.from_config(
            config, tokenizer, rank=env.rank, world_size=env.world_size, device=env.device
        )
    except NotChessData as err:
        raise not_games(err, config, source_text, args.model) from err
    precision = default_precision(hf_config)
    loaded = eval_config(
        source, precision=precision, attn_implementation=config.attn_implementation,
        cache_dir=config.cache_dir,
    )  # fmt: skip
    model = load_sharded_model(source, loaded, env)
    metrics = evaluator.run(model)
    del model
    gc.collect()
    out = Path(args.records_dir) if args.records_dir else default_output_dir(model_path)
    written = write_records(out, metrics, step=None) if out is not None and env.is_main else []
    folder = source.adapter_dir or source.weights_dir
    return {
        "model": str(folder), "config_source": source_text, "metrics": metrics,
        "written": written, "engine_note": evaluator.engine_note, "is_main": env.is_main,
        "records_dir": out,
    }  # fmt: skip


def load_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    # A per-tensor progress bar per load is noise in a job log (and in the demo's summary).
    hf_logging.disable_progress_bar()
    return AutoTokenizer.from_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    from fsdp_utils.chess_eval.evaluator import RECORDS, format_table, log_record
    from fsdp_utils.parallel import distributed as dist_utils

    args = build_parser().parse_args(argv)
    if args.preflight:  # no process group: a user mistake is one paragraph, exit 2
        try:
            print(preflight(args), flush=True)
        except ValueError as err:
            dist_utils.report_error(str(err))
            return EXIT_USAGE
        return 0
    code, result = dist_utils.run_command(lambda: evaluate_saved_model(argv))
    if code or result is None:
        return code
    metrics = result["metrics"]
    failed = bool(metrics.get("engine_error"))
    if not result["is_main"]:
        return EXIT_ENGINE_FAILED if failed else 0
    if args.json:
        examples = [
            {"phase": e.phase, "prompt": e.prompt, "continuation": e.continuation,
             "legal_plies": e.verdict.legal_plies, "failure": e.verdict.failure}
            for e in metrics["examples"]
        ]  # fmt: skip
        record = log_record(metrics, step=0)
        document = {
            "model": result["model"],
            "config_source": result["config_source"],
            **{k: v for k, v in record.items() if k != "step" and k not in RECORDS},
            "examples": examples,
            "written": [str(p) for p in result["written"]],
        }
        print(json.dumps(document, indent=2))
    else:
        print(f"model: {result['model']} (data and template from {result['config_source']})")
        print(result["engine_note"])
        print(format_table(metrics, step=None))
        if result["written"]:
            names = ", ".join(p.name for p in result["written"])
            print(f"records: {result['written'][0].parent} ({names})")
        elif failed and result["records_dir"] is not None:
            print(
                f"records: none written (the engine failed); {result['records_dir']} keeps "
                "what it held"
            )
    if failed:
        print(f"\nerror: the engine judge failed: {metrics['engine_error']}\n", file=sys.stderr)
    return EXIT_ENGINE_FAILED if failed else 0
