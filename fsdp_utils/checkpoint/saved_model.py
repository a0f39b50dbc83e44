"""What `--model` names, and that model built, sharded and loaded as the trainer does it.

`--model` is a hub id in the offline cache, a model folder, a run folder (its final model:
`<run>/final_merged`, else `<run>/final`) or a PEFT LoRA adapter folder (over the base its
`adapter_config.json` names), as every command reads it (`fsdp_utils.config.model_path`).
The model then takes the trainer's steps (`fsdp_utils.trainer.trainer`): built on the meta
device, transformed (the LoRA adapters of an adapter folder, exactly as `--lora_from` continues
one), sharded with FSDP2 per decoder layer, materialised rank by rank, its weights read slice by
slice. No rank ever holds the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.model_path import model_path, run_quantize
from fsdp_utils.config.train_config import Precision, TrainConfig
from fsdp_utils.hub.resolve import load_model_config, resolve_model_dir
from fsdp_utils.model.build import build_meta_model, config_dtype
from fsdp_utils.model.transforms import transform_model
from fsdp_utils.model.weights import checkpoint_key_map
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.parallel.materialize import build_model

TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ModelSource:
    """Where the evaluated model's pieces are on this machine."""

    requested: str  # what --model said
    weights_dir: Path  # the full model (an adapter's base)
    adapter_dir: Path | None  # a LoRA adapter over weights_dir
    tokenizer_dir: Path
    run_dir: Path | None  # when --model named a run folder
    # The adapter's base as the run trained it: "nf4" for a QLoRA run's final/ (its config.json)
    quantize: str = "none"

    def identity(self) -> dict[str, Any]:
        """For the results file: what was evaluated, down to the cached commit."""
        return {
            "model": self.requested,
            "model_dir": str(self.weights_dir),
            "model_commit": _snapshot_commit(self.weights_dir),
            "adapter_dir": str(self.adapter_dir) if self.adapter_dir else None,
            "run_dir": str(self.run_dir) if self.run_dir else None,
            **({"quantize": self.quantize} if self.quantize != "none" else {}),
        }


def _snapshot_commit(folder: Path) -> str | None:
    """A hub snapshot folder is `.../snapshots/<commit>`."""
    return folder.name if folder.parent.name == "snapshots" else None


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_MARKERS)


def resolve_model_source(model: str, cache_dir: str | None = None) -> ModelSource:
    """`--model` -> its folders. ValueError (MissingAssetError: with the download command)
    when something is not here."""
    found = model_path(model)
    weights_dir = resolve_model_dir(found.model, None, cache_dir)
    adapter_dir = found.adapter
    tokenizer_dir = weights_dir
    if adapter_dir is not None and _has_tokenizer(adapter_dir):
        tokenizer_dir = adapter_dir
    if not _has_tokenizer(tokenizer_dir):
        raise ValueError(
            f"{tokenizer_dir} has no tokenizer ({', '.join(TOKENIZER_MARKERS)}): evaluations "
            "write their prompts with the model's own tokenizer. A run's final/ folder and an "
            "exported checkpoint carry theirs; copy it beside the weights."
        )
    quantize = _run_quantize(adapter_dir) if adapter_dir else "none"
    return ModelSource(model, weights_dir, adapter_dir, tokenizer_dir, found.run_dir, quantize)


def _run_quantize(adapter_dir: Path) -> str:
    """A run's final/ adapter over a 4-bit base (--qlora) is evaluated over that base, as it
    trained and as --eval_tasks scores it: the run folder's config.json says so."""
    run = adapter_dir.parent
    is_final = RunLayout.of(run).final_model.resolve() == adapter_dir.resolve()
    return run_quantize(run) if is_final else "none"


def default_precision(hf_config: Any) -> Precision:
    """The checkpoint's own dtype, as lm-eval's HFLM loads it (dtype="auto"): bf16 weights
    stay bf16 (bf16-true), fp16 computes in fp16 over fp32 weights, anything else fp32."""
    dtype = str(config_dtype(hf_config) or "float32")
    if dtype.endswith("bfloat16"):
        return "bf16-true"
    if dtype.endswith("float16"):
        return "fp16-mixed"
    return "fp32"


def eval_config(
    source: ModelSource,
    *,
    precision: Precision,
    attn_implementation: str = "sdpa",
    cache_dir: str | None = None,
) -> TrainConfig:
    """The trainer's settings that decide how the model is built and sharded: FSDP2 per
    decoder layer, no activation checkpointing (no backward), the adapter as --lora_from."""
    return TrainConfig(
        model=str(source.weights_dir),
        precision=precision,
        attn_implementation=attn_implementation,  # type: ignore[arg-type]
        cache_dir=cache_dir,
        gradient_checkpointing=False,
        lora=source.adapter_dir is not None,
        lora_from=str(source.adapter_dir) if source.adapter_dir else None,
        quantize=source.quantize,  # type: ignore[arg-type]
    )


def load_sharded_model(source: ModelSource, config: TrainConfig, env: DistEnv) -> nn.Module:
    """Collective: meta build -> transforms -> FSDP2 -> to_empty -> weights, in eval mode."""
    hf_config = load_model_config(source.weights_dir)
    model = build_meta_model(
        hf_config, config.precision, attn_implementation=config.attn_implementation
    )
    key_map = checkpoint_key_map(model, source.weights_dir)
    meta = transform_model(model, config)
    sharded = build_model(meta, config, env, source.weights_dir, key_map, load_weights=True)
    sharded.requires_grad_(False)
    return sharded.eval()
