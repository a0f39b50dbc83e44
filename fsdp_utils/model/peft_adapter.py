"""PEFT LoRA adapter folders: their file names, their tensor names, and reading one back
(`--lora_from`, llama-recipes' from_peft_checkpoint).

    adapter_config.json          peft's LoraConfig: r, lora_alpha, target_modules, use_dora, ...
    adapter_model.safetensors    base_model.model.<module>.lora_A.weight, .lora_B.weight
                                 (and .lora_magnitude_vector with DoRA)

What `--lora_from` continues is what the weights hold: the adapted modules are read from the
tensor names (whatever form `target_modules` took in the config: names, a regex, with
`layers_to_transform`), their rank from the tensor shapes. Settings that change the function an
adapter computes and that this trainer does not reproduce (rsLoRA scaling, per-module ranks,
fully trained `modules_to_save`, bias training) are refused by name rather than dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_utils.config.model_path import ADAPTER_CONFIG

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER = "default"  # peft's adapter name inside a model; the saved names leave it out
# DPO's reference when it continues an adapter (--lora --lora_from): a second, frozen copy of
# the starting adapter beside the trained one, as TRL's DPOTrainer takes `ref_adapter_name`.
# It is never saved: checkpoints keep what trains, the final folder the trained adapter.
REFERENCE_ADAPTER = "reference"
_PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
# adapter_config.json keys whose non-default values change what the adapter computes.
_UNSUPPORTED = {
    "use_rslora": "rsLoRA scaling (alpha / sqrt(r))",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "lora_bias": "LoRA biases (lora_bias)",
    "layer_replication": "layer replication",
}


def is_adapter_key(key: str) -> bool:
    """A LoRA tensor of a model's state dict (adapters, DoRA magnitudes), not a base weight."""
    return any(part in key for part in (".lora_A.", ".lora_B.", ".lora_magnitude_vector."))


def is_reference_key(key: str) -> bool:
    """A tensor of the frozen reference adapter (`REFERENCE_ADAPTER`): never written out."""
    return f".{REFERENCE_ADAPTER}." in key or key.endswith(f".{REFERENCE_ADAPTER}")


def peft_key(model_key: str) -> str:
    """A model's adapter tensor under the name PEFT saves it with:
    `model.layers.0.self_attn.q_proj.lora_A.default.weight` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`; a DoRA magnitude
    (`...q_proj.lora_magnitude_vector.default.weight`) loses its `.weight` too, as peft saves it.
    The reference adapter's tensors map to the same names: both start from one file."""
    for name in (ADAPTER, REFERENCE_ADAPTER):
        if model_key.endswith(f"lora_magnitude_vector.{name}.weight"):
            model_key = model_key.removesuffix(".weight")
        model_key = model_key.replace(f".{name}.", ".").removesuffix(f".{name}")
    return _PEFT_PREFIX + model_key


@dataclass(frozen=True)
class AdapterFolder:
    """What a PEFT LoRA adapter folder holds, as the trainer continues it."""

    path: Path
    r: int
    alpha: float
    dropout: float
    dora: bool
    modules: tuple[str, ...]  # the adapted modules, named as in the transformers model
    base_model: str | None  # base_model_name_or_path: the model it was trained on

    @property
    def short_names(self) -> list[str]:
        """The adapted modules' own names (q_proj, ...), as --lora_target_modules takes them."""
        return sorted({name.rpartition(".")[2] for name in self.modules})


def read_adapter_folder(path: Path) -> AdapterFolder:
    """Read and check an adapter folder; ValueError (one paragraph) for anything unusable."""
    config_file, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not config_file.is_file():
        hint = (
            " It holds a config.json: a full model, which --model takes (without --lora_from)."
            if (path / "config.json").is_file()
            else ""
        )
        raise ValueError(
            f"--lora_from {path}: no {ADAPTER_CONFIG} there, so it is not a PEFT adapter folder."
            f"{hint} Give the folder PeftModel.save_pretrained wrote (a LoRA run's final/)."
        )
    settings = json.loads(config_file.read_text())
    kind = settings.get("peft_type")
    if kind != "LORA":
        raise ValueError(
            f"--lora_from {path}: a {kind} adapter; only LoRA (and DoRA) adapters can be "
            "continued. Start a fresh LoRA run without --lora_from."
        )
    used = [what for key, what in _UNSUPPORTED.items() if settings.get(key)]
    if settings.get("bias", "none") != "none":
        used.append(f"trained biases (bias={settings['bias']!r})")
    if used:
        raise ValueError(
            f"--lora_from {path}: the adapter uses {', '.join(used)}, which this trainer does "
            "not reproduce, so continuing it would change what it computes. Continue it with "
            "peft itself, or start a fresh adapter without --lora_from."
        )
    if not weights.is_file():
        others = sorted(p.name for p in path.glob("adapter_model.*"))
        raise ValueError(
            f"--lora_from {path}: no {ADAPTER_WEIGHTS} there"
            + (f" (found {', '.join(others)})" if others else "")
            + ". Save the adapter in safetensors: PeftModel.from_pretrained(base, folder)"
            ".save_pretrained(new_folder) writes it."
        )
    modules, rank = _adapted_modules(weights)
    if not modules:
        raise ValueError(f"--lora_from {path}: {ADAPTER_WEIGHTS} holds no LoRA tensors.")
    if rank is None or rank != settings.get("r"):
        raise ValueError(
            f"--lora_from {path}: {ADAPTER_CONFIG} says r={settings.get('r')} but the weights "
            f"have rank {rank if rank is not None else 'differing between modules'}. Save the "
            "adapter again with peft (per-module ranks cannot be continued here)."
        )
    return AdapterFolder(
        path=path,
        r=rank,
        alpha=float(settings.get("lora_alpha", 8)),
        dropout=float(settings.get("lora_dropout", 0.0)),
        dora=bool(settings.get("use_dora", False)),
        modules=tuple(modules),
        base_model=settings.get("base_model_name_or_path"),
    )


def _adapted_modules(weights: Path) -> tuple[list[str], int | None]:
    """The modules named by the lora_A tensors, and their rank (None if they differ)."""
    from safetensors import safe_open

    modules, ranks = [], set()
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            if key.endswith(".lora_A.weight"):
                modules.append(key.removeprefix(_PEFT_PREFIX).removesuffix(".lora_A.weight"))
                ranks.add(f.get_slice(key).get_shape()[0])
    return sorted(modules), (ranks.pop() if len(ranks) == 1 else None)


def adapter_key_map(model_keys: list[str]) -> dict[str, str]:
    """model key -> the adapter file's key, for the model's adapter tensors."""
    return {key: peft_key(key) for key in model_keys if is_adapter_key(key)}


def describe_base(folder: AdapterFolder, model: str) -> str | None:
    """A note when the adapter names another base model than --model (a local copy of the same
    model is fine: the shapes are checked when the adapter loads)."""
    if folder.base_model and folder.base_model != model:
        return (
            f"the adapter was trained on {folder.base_model!r}; --model is {model!r} "
            "(fine if they are the same model)"
        )
    return None


def adapter_settings_note(folder: AdapterFolder, flags: dict[str, Any]) -> str:
    """Which --lora_* flags the adapter's own settings replaced: 'r 8 -> 16, ...'."""
    own = {
        "lora_r": folder.r,
        "lora_alpha": folder.alpha,
        "lora_target_modules": ",".join(folder.short_names),
        "lora_dora": folder.dora,
    }
    changed = [
        f"--{name} {_shown(flags[name])} -> {_shown(value)}"
        for name, value in own.items()
        if _shown(flags[name]) != _shown(value)
    ]
    return ", ".join(changed)


def _shown(value: Any) -> str:
    if value is None:
        return "(every linear layer)"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
