"""`python -m fsdp_utils.chess_eval MODEL`: the chess evaluation of a saved model, standalone.

MODEL is a Hugging Face folder (a run's `final/`, an exported checkpoint), a hub id in the
offline cache, or a LoRA adapter folder (`adapter_config.json`; its base model is resolved
the same way and the adapter applied with peft). The data and template come, in this order
of precedence, from the flags, `--config FILE` (a training config), the run's own
`config.json` beside a `final/` folder, and the trainer's defaults: so `final/` of a run is
evaluated on that run's held-out games without any flag. One process (a GPU if there is one);
during training use `--chess_eval_every` instead, which runs under FSDP on every rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from fsdp_utils.arguments import ArgumentParser
from fsdp_utils.config.model_path import model_path
from fsdp_utils.config.parse import add_config_arguments, config_from_dict, load_config_file
from fsdp_utils.config.train_config import TrainConfig

EXIT_USAGE = 2
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# Trainer options that select and render the games: same names, same meaning (help texts
# come from TrainConfig).
DATA_OPTIONS = (
    "dataset", "dataset_include", "dataset_revision", "cache_dir", "data_cache_dir",
    "template", "seed", "eval_examples", "max_examples", "max_seq_length",
)  # fmt: skip
# Trainer options that decide how the model runs, taken from the run's config like the data's.
MODEL_OPTIONS = ("attn_implementation",)
# Short spellings of the evaluation's own TrainConfig fields.
EVAL_OPTIONS = {
    "games": "chess_eval_games",
    "plies": "chess_eval_plies",
    "temperature": "chess_eval_temperature",
    "batch_size": "chess_eval_batch_size",
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
    add_config_arguments(parser, only=DATA_OPTIONS + MODEL_OPTIONS)
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for short, name in EVAL_OPTIONS.items():
        f = fields[name]
        kind = float if name == "chess_eval_temperature" else int
        parser.add_argument(
            f"--{short}", f"--{name}", dest=name, type=kind, default=argparse.SUPPRESS,
            help=f"{f.metadata['help']} (default: {f.default})",
        )  # fmt: skip
    return parser


def run_config_near(model: Path) -> dict[str, Any]:
    """The training config of the run that wrote `model` (`<run>/final` -> `<run>/config.json`)."""
    path = model.parent / "config.json"
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    config = record.get("config") if isinstance(record, dict) else None
    return dict(config) if isinstance(config, dict) else {}


def resolve_config(args: argparse.Namespace, model: Path) -> tuple[TrainConfig, str]:
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    values: dict[str, Any] = {}
    source = "the trainer's defaults"
    run_values = run_config_near(model)
    if run_values:
        values.update({k: v for k, v in run_values.items() if k in known})
        source = f"the run's {model.parent / 'config.json'}"
    if args.config:
        loaded = load_config_file(args.config)
        # A run folder's config.json holds the options under "config".
        values.update(loaded["config"] if isinstance(loaded.get("config"), dict) else loaded)
        source = args.config
    values.update({k: v for k, v in vars(args).items() if k in known})
    values.pop("chess_eval_every", None)
    return config_from_dict(values, source="the command line and config file"), source


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_MARKERS)


def load_model_and_tokenizer(
    model: str,
    *,
    tokenizer: str | None,
    device: Any,
    cache_dir: str | None,
    attn_implementation: str = "sdpa",
) -> tuple[Any, Any, Path]:
    """(model, tokenizer, folder). `model` is read as every command reads `--model`
    (`fsdp_utils.config.model_path`): a run folder is its final model, and a LoRA adapter is
    merged into its base. The model runs the trainer's attention implementation
    (`--attn_implementation`, by default the run's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_utils.hub.resolve import resolve_model_dir
    from fsdp_utils.model.attention import transformers_argument

    found = model_path(model)  # a run folder's final model; an adapter over its base
    base_dir = resolve_model_dir(found.model, None, cache_dir)
    folder = found.adapter or base_dir
    tokenizer_dir = (
        Path(tokenizer) if tokenizer else (folder if _has_tokenizer(folder) else base_dir)
    )
    if not _has_tokenizer(tokenizer_dir):
        raise ValueError(
            f"The model folder {tokenizer_dir} has no tokenizer ({', '.join(TOKENIZER_MARKERS)}): "
            "the evaluation writes prompts and reads moves with the model's own tokenizer. "
            "Pass --tokenizer <folder of the tokenizer the model was trained with> (a run's "
            "final/ folder and an exported checkpoint carry theirs)."
        )
    from transformers.utils import logging as hf_logging

    # A per-tensor progress bar per load is noise in a job log (and in the demo's summary).
    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    lm = AutoModelForCausalLM.from_pretrained(
        base_dir, dtype="auto", attn_implementation=transformers_argument(attn_implementation)
    )
    if found.adapter is not None:
        from peft import PeftModel

        lm = PeftModel.from_pretrained(lm, folder).merge_and_unload()
    return lm.to(device).eval(), tok, folder


def evaluate_saved_model(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse, load, evaluate; returns {"config_source", "model", "metrics"}."""
    import torch

    from fsdp_utils.chess_eval.evaluator import ChessEvaluator

    args = build_parser().parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "python -m fsdp_utils.chess_eval runs as one process (it loads the whole model); "
            "to evaluate under torchrun with FSDP, train with --chess_eval_every N."
        )
    found = model_path(args.model)
    config, source = resolve_config(args, found.adapter or Path(found.model).expanduser())
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is visible.")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    model, tokenizer, folder = load_model_and_tokenizer(
        args.model,
        tokenizer=args.tokenizer,
        device=device,
        cache_dir=config.cache_dir,
        attn_implementation=config.attn_implementation,
    )
    evaluator = ChessEvaluator.from_config(config, tokenizer, device=device)
    metrics = evaluator.run(model)
    return {"model": str(folder), "config_source": source, "metrics": metrics}


def main(argv: list[str] | None = None) -> int:
    from fsdp_utils.chess_eval.evaluator import format_table, log_record

    try:
        result = evaluate_saved_model(argv)
    except ValueError as err:
        print(f"\nerror: {err}\n", file=sys.stderr, flush=True)
        return EXIT_USAGE
    metrics = result["metrics"]
    if "--json" in (sys.argv[1:] if argv is None else argv):
        examples = [
            {"phase": e.phase, "prompt": e.prompt, "continuation": e.continuation,
             "legal_plies": e.verdict.legal_plies, "failure": e.verdict.failure}
            for e in metrics["examples"]
        ]  # fmt: skip
        document = {
            "model": result["model"],
            "config_source": result["config_source"],
            **{k: v for k, v in log_record(metrics, step=0).items() if k != "step"},
            "examples": examples,
        }
        print(json.dumps(document, indent=2))
    else:
        print(f"model: {result['model']} (data and template from {result['config_source']})")
        print(format_table(metrics, step=None))
    return 0
