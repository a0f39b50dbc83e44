"""What `--model` names, read from the folder it points at before anything is loaded. Every
command that takes a model (`chess_finetune.py` and its `--plan`, `python -m fsdp_utils.plan`,
`.evaluate`, `.chess_eval`, `.data`) reads it here, so they all take the same four things:

- a hub id, or a model folder (`config.json` + weights): as it is;
- a run folder (`--output_dir` of a finished run): its final model, `final_merged/` where
  `--merge` wrote one (a full model), else `final/`;
- a PEFT LoRA adapter folder (`adapter_config.json`, a LoRA run's `final/`): its base model,
  from `base_model_name_or_path` (a hub id or a folder, looked up as `--model` is), and the
  adapter over it.

A training run continues the adapter of an adapter folder (`--model ADAPTER --lora` is
`--model BASE --lora --lora_from ADAPTER`; `with_model_path` rewrites the config so, and
config.json records it); without `--lora` there is no adapter to train, and the message says how to get a
full model to fine-tune instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig

ADAPTER_CONFIG = "adapter_config.json"  # a PEFT adapter folder's settings (peft's name)


@dataclass(frozen=True)
class ModelPath:
    """`--model`, read: the full model (`model`: a hub id or a folder; an adapter's base),
    the adapter over it, and the run folder it came from."""

    requested: str
    model: str
    adapter: Path | None = None
    run_dir: Path | None = None


def is_run_folder(path: Path) -> bool:
    """A run's `--output_dir` (its config.json is the run's record, not a model's)."""
    layout = RunLayout.of(path)
    model_config = path / "config.json"
    return (layout.final_model.is_dir() or layout.merged_model.is_dir()) and not (
        model_config.is_file() and "model_type" in _json(model_config)
    )


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def run_quantize(run_dir: Path) -> str:
    """`--quantize` of the run in `run_dir` (none when its config.json says nothing)."""
    return str(_json(RunLayout.of(run_dir).config).get("config", {}).get("quantize", "none"))


def model_path(model: str) -> ModelPath:
    """Read what `model` names (see the module docstring). ValueError for an adapter folder
    that names no base, or a run folder with no final model yet."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return ModelPath(model, model)  # a hub id, or a path the resolver reports missing
    run_dir = None
    if is_run_folder(path):
        layout = RunLayout.of(path)
        # A QLoRA run's merged model is dequantized: not the model it trained (the adapter
        # over the 4-bit base), so its final/ stands for it.
        merged = layout.merged_model.is_dir() and run_quantize(path) == "none"
        run_dir, path = path, layout.merged_model if merged else layout.final_model
    elif RunLayout.of(path).checkpoints.is_dir() and "model_type" not in _json(
        path / "config.json"
    ):
        raise ValueError(
            f"--model {model}: a run folder without a final model (the run has not finished). "
            "Give a finished run, or export one of its checkpoints: python -m "
            f"fsdp_utils.export {RunLayout.of(path).checkpoints}/step_<N> FOLDER, then --model "
            "FOLDER."
        )
    if not (path / ADAPTER_CONFIG).is_file():  # a model folder: as it is, unless a run's
        return ModelPath(model, str(path) if run_dir else model, None, run_dir)
    base = _json(path / ADAPTER_CONFIG).get("base_model_name_or_path")
    if not base:
        raise ValueError(
            f"{path / ADAPTER_CONFIG} names no base_model_name_or_path: which model the adapter "
            "belongs to is unknown. Add it to the file (the hub id or folder of the base model)."
        )
    return ModelPath(model, str(base), path, run_dir)


def with_model_path(config: TrainConfig) -> TrainConfig:
    """The config with `--model` read (`model_path`): a run folder becomes its final model; an
    adapter folder its base, the adapter continued (`--lora_from`). ValueError where that
    cannot train: an adapter without `--lora`, or two adapters."""
    found = model_path(config.model)
    if found.adapter is None:
        return config if found.model == config.model else config.replace(model=found.model)
    if not config.lora:
        raise ValueError(_adapter_without_lora(found))
    if (
        config.lora_from
        and Path(config.lora_from).expanduser().resolve() != found.adapter.resolve()
    ):
        raise ValueError(
            f"--model {found.requested} is a LoRA adapter, and --lora_from {config.lora_from} "
            "names another: a run continues one adapter. Give the base model as --model (here "
            f"{found.model}) with --lora_from, or the adapter as --model alone."
        )
    return config.replace(model=found.model, lora_from=str(found.adapter))


def _adapter_without_lora(found: ModelPath) -> str:
    assert found.adapter is not None
    run = found.run_dir or found.adapter.parent
    steps = sorted(RunLayout.of(run).checkpoints.glob("step_*"))
    if steps:
        merge = (
            f"python -m fsdp_utils.export --merge {steps[-1]} {RunLayout.of(run).merged_model}, "
            f"then --model {run}"
        )
    else:
        merge = (
            "merge it into its base with peft (PeftModel.from_pretrained(base, adapter)"
            ".merge_and_unload().save_pretrained(FOLDER)), then --model FOLDER"
        )
    return (
        f"--model {found.requested} is a LoRA adapter over {found.model}, and without --lora "
        "there is no adapter to train. Add --lora to continue training it (the base stays "
        "frozen; with --method dpo the adapter as it starts is the reference), or fine-tune "
        f"every weight of the merged model: {merge}."
    )
