"""LoRA fine-tuning with `peft`, as a model transform applied before `parallelize`.

`apply_lora` runs inside `fsdp_utils.model.transforms.transform_model` on the meta model, after
the decoder layers are found and before activation checkpointing and FSDP2 (as torchtitan's
model converters run before its parallelize function), so the trainer, the memory planner and the
storage check all get it:

- peft's `inject_adapter_in_model` replaces each targeted linear layer by a `lora.Linear` that
  holds the original layer as `base_layer` plus `lora_A` / `lora_B`; every base parameter (and
  the embeddings, norms and lm_head) is frozen.
- Frozen parameters are stored in the compute dtype (bf16 for bf16-mixed, fp16 for fp16-mixed):
  they need no fp32 master copy, gradient or optimizer state. The adapters keep the trainer's
  storage dtype (fp32 master weights). FSDP2 requires one original dtype among the *trainable*
  parameters of a shard group only (torch 2.13 `FSDPParamGroup._init_mp_dtypes`), so the frozen
  base and its adapters share each decoder layer's group.
- Every decoder layer group holds trainable adapters from the start and the root group
  (embeddings, norm, lm_head) is frozen for good: no group's first forward runs frozen and is
  unfrozen later, which would make FSDP2 reduce its gradients in the wrong dtype (pytorch 186998).

After `to_empty`, `init_adapters` fills the adapters as peft does (A: Kaiming-uniform, B: zero,
so training starts from the base model's outputs), from generators seeded by (seed, parameter
name) over the full shape: every world size starts from the same adapters. Base weights load
as in full fine-tuning, each rank reading its own slices (`base_key_map` adds `.base_layer`).
Then `finish_adapters`: DoRA's magnitudes (`--lora_dora`) from the loaded base, and with
`--lora_from` every adapter tensor from the adapter folder, whose settings (`lora_settings`)
decide rank, alpha, targets and DoRA.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

import numpy as np
import torch
from torch import nn

from fsdp_utils.model import qlora
from fsdp_utils.model.build import _all_named_parameters, compute_dtype, param_dtype_for
from fsdp_utils.model.peft_adapter import ADAPTER, REFERENCE_ADAPTER

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from fsdp_utils.config.train_config import TrainConfig

__all__ = ["ADAPTER", "LoraSettings", "apply_lora", "lora_settings"]
_Source = TypeVar("_Source")  # where a weight is in the checkpoint (`model.weights`)


def linear_types() -> tuple[type[nn.Module], ...]:
    """What peft's LoRA can wrap as a linear layer: nn.Linear, and transformers' Conv1D (GPT-2's
    projections, whose weight is stored transposed)."""
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


# --- which layers -------------------------------------------------------------------------


def _requested(text: str | None) -> list[str]:
    return [name.strip() for name in (text or "").split(",") if name.strip()]


class LoraTargets(NamedTuple):
    """What LoRA adapts: linear layers (peft's `target_modules`) and fused expert tensors of
    mixture-of-experts layers (peft's `target_parameters`), by full name."""

    modules: list[str]
    parameters: list[str]


def _moe_blocks(layer: nn.Module) -> list[str]:
    """Names (in the layer) of its mixture-of-experts blocks: the modules holding `experts`."""
    return [name for name, module in layer.named_modules() if hasattr(module, "experts")]


def _expert_tensors(layer: nn.Module) -> list[str]:
    """The fused expert weights in a decoder layer (`mlp.experts.gate_up_proj`, [experts, out,
    in]): 3-D parameters of the `experts` modules (their biases are 2-D)."""
    return [
        f"{name}.{param_name}"
        for name, module in layer.named_modules()
        if name.rpartition(".")[2] == "experts"
        for param_name, param in module.named_parameters(recurse=False)
        if param.dim() == 3
    ]


def lora_targets(
    layers: list[nn.Module], layer_names: list[str], requested: str | None
) -> LoraTargets:
    """Full names of the linear modules and expert tensors to adapt, inside the decoder layers.

    `requested` is a comma-separated list of names relative to a decoder layer, matched as peft
    matches them (the whole name or its last parts: `q_proj`, `self_attn.q_proj`); a name also
    matches the fused expert tensors it names (`gate_up_proj`, `experts.down_proj`), or all of
    them (`experts`). None: every linear layer of the decoder layers outside their
    mixture-of-experts blocks (for MoE models the attention projections: adapting the routers
    would move the load balance, and the experts hold most of the weights). A name that matches
    nothing is a ValueError listing what there is.
    """
    linear = linear_types()
    relative, experts = [], []
    for layer in layers:
        blocks = _moe_blocks(layer)
        relative.append(
            [
                (name, any(name.startswith(block + ".") for block in blocks))
                for name, module in layer.named_modules()
                if name and isinstance(module, linear)
            ]
        )
        experts.append(_expert_tensors(layer))
    wanted = _requested(requested)
    if not wanted:
        return LoraTargets(
            [
                f"{prefix}.{name}"
                for prefix, names in zip(layer_names, relative, strict=True)
                for name, in_moe_block in names
                if not in_moe_block
            ],
            [],
        )

    def matches(name: str, target: str) -> bool:
        return name == target or name.endswith("." + target)

    def matches_tensor(name: str, target: str) -> bool:
        return matches(name, target) or matches(name.rpartition(".")[0], target)

    available = list(dict.fromkeys(name for names in relative for name, _ in names))
    tensors = list(dict.fromkeys(name for names in experts for name in names))
    unknown = [
        t
        for t in wanted
        if not any(matches(name, t) for name in available)
        and not any(matches_tensor(name, t) for name in tensors)
    ]
    if unknown:
        short = list(dict.fromkeys(name.rpartition(".")[2] for name in available))
        expert_note = (
            f" The fused expert tensors are {', '.join(tensors)} (`experts` names all of them)."
            if tensors
            else ""
        )
        raise ValueError(
            f"--lora_target_modules {','.join(unknown)}: no linear layer of that name inside "
            f"the decoder layers ({type(layers[0]).__name__}). The linear layers there are: "
            f"{', '.join(short)} ({', '.join(available)} with their paths).{expert_note} Give "
            f"some of these, e.g. --lora_target_modules {','.join(short[:2])}, or leave the "
            "option out to adapt all of them"
            + (" outside the mixture-of-experts blocks." if tensors else ".")
        )
    return LoraTargets(
        [
            f"{prefix}.{name}"
            for prefix, names in zip(layer_names, relative, strict=True)
            for name, _ in names
            if any(matches(name, t) for t in wanted)
        ],
        [
            f"{prefix}.{name}"
            for prefix, names in zip(layer_names, experts, strict=True)
            for name in names
            if any(matches_tensor(name, t) for t in wanted)
        ],
    )


def target_modules(
    layers: list[nn.Module], layer_names: list[str], requested: str | None
) -> list[str]:
    """The linear modules of `lora_targets`."""
    return lora_targets(layers, layer_names, requested).modules


def _check_expert_options(targets: LoraTargets, config: TrainConfig) -> None:
    if targets.parameters and config.lora_dropout:
        raise ValueError(
            f"--lora_target_modules {config.lora_target_modules} adapts fused expert tensors, "
            "which peft adapts by adding B @ A to the weight (lora.ParamWrapper): it cannot "
            "apply dropout to their input. Add --lora_dropout 0."
        )


@dataclass(frozen=True)
class LoraSettings:
    """What the adapters are: the --lora_* flags, or with --lora_from the adapter's own."""

    r: int
    alpha: float
    dropout: float
    target_modules: str | None  # as --lora_target_modules takes them; None: every linear layer
    dora: bool
    adapter: Path | None = None  # --lora_from's folder, whose weights the adapters start from
    adapter_modules: tuple[str, ...] = ()  # the modules its weights adapt
    note: str = ""  # for the log: what the adapter's settings replaced

    def identity(self) -> dict[str, Any]:
        """The checkpoint identity's `lora` entry (`dora` only when on, so that earlier LoRA
        checkpoints keep theirs)."""
        entry: dict[str, Any] = {
            "r": self.r,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "target_modules": self.target_modules,
        }
        return {**entry, "dora": True} if self.dora else entry


def lora_settings(config: TrainConfig) -> LoraSettings:
    """The run's LoRA settings. With --lora_from the adapter folder decides rank, alpha, targets
    and DoRA (as PeftModel.from_pretrained(..., is_trainable=True) would); the dropout stays the
    flag's, a training choice like the learning rate."""
    if not config.lora_from:
        return LoraSettings(
            config.lora_r,
            config.lora_alpha,
            config.lora_dropout,
            config.lora_target_modules,
            config.lora_dora,
        )
    from fsdp_utils.hub.resolve import resolve_adapter_dir
    from fsdp_utils.model.peft_adapter import (
        adapter_settings_note,
        describe_base,
        read_adapter_folder,
    )

    folder = read_adapter_folder(resolve_adapter_dir(config.lora_from, config.cache_dir))
    notes = [f"continuing the adapter {folder.path}"]
    replaced = adapter_settings_note(folder, vars(config))
    if replaced:
        notes.append(f"its adapter_config.json wins over the flags: {replaced}")
    base = describe_base(folder, config.model)
    if base:
        notes.append(base)
    return LoraSettings(
        folder.r,
        int(folder.alpha) if folder.alpha.is_integer() else folder.alpha,
        config.lora_dropout,
        ",".join(folder.short_names),
        folder.dora,
        adapter=folder.path,
        adapter_modules=folder.modules,
        note="; ".join(notes),
    )


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def check_target_modules(hf_config: Any, config: TrainConfig, *, shards: int | None = None) -> None:
    """Apply LoRA to a meta build of the model (no memory, ~1 s for 7B), so that a wrong
    --lora_target_modules, or a --lora_from adapter that does not fit the model, fails before
    any data or weights are read; with --quantize, on the 4-bit base, whose weights must split
    over `shards` ranks (None: not known yet, checked when the model is sharded)."""
    from fsdp_utils.model.build import build_meta_model, find_decoder_layers

    model = build_meta_model(hf_config, config.precision)
    layers = find_decoder_layers(model)
    if config.quantize != "none":
        qlora.quantize_base(model, layers, config)
        if shards is not None:
            qlora.check_shardable(qlora.quantized_shapes(model), shards)
    apply_lora(model, layers, config)


def _module_names(model: nn.Module, modules: list[nn.Module]) -> list[str]:
    names = {id(module): name for name, module in model.named_modules()}
    return [names[id(module)] for module in modules]


def peft_config(
    settings: LoraSettings,
    targets: list[str],
    *,
    fan_in_fan_out: bool = False,
    parameters: list[str] | None = None,
) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=settings.r,
        lora_alpha=cast(Any, settings.alpha),  # annotated int; peft scales by any number
        lora_dropout=settings.dropout,
        target_modules=targets,
        target_parameters=parameters or None,
        fan_in_fan_out=fan_in_fan_out,
        use_dora=settings.dora,
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: nn.Module, layers: list[nn.Module], config: TrainConfig) -> None:
    """Inject LoRA adapters (on meta), freeze the rest, and set the dtypes. In place."""
    import warnings

    from peft import inject_adapter_in_model

    settings = lora_settings(config)
    targets = lora_targets(layers, _module_names(model, layers), settings.target_modules)
    _check_expert_options(targets, config)
    if settings.adapter is not None and set(targets.modules) != set(settings.adapter_modules):
        _adapter_mismatch(settings, targets.modules)
    conv1d = any(not isinstance(model.get_submodule(t), nn.Linear) for t in targets.modules)
    lora_config = peft_config(
        settings, targets.modules, fan_in_fan_out=conv1d, parameters=targets.parameters
    )
    with warnings.catch_warnings():  # peft warns when it sets fan_in_fan_out for Conv1D itself
        warnings.simplefilter("ignore", UserWarning)  # ... and when it adds a second adapter
        inject_adapter_in_model(lora_config, model, low_cpu_mem_usage=True)
        if config.reference_adapter:
            _add_reference_adapter(model, lora_config)
    # The frozen base is kept in the dtype it computes in: no fp32 master copy.
    frozen, adapter = compute_dtype(config.precision), param_dtype_for(config.precision)
    for module in model.modules():
        for param in module.parameters(recurse=False):
            wanted = adapter if param.requires_grad else frozen
            if param.dtype != wanted:  # on meta: no memory, no time
                param.data = param.data.to(wanted)
    for layer in layers:
        # Every decoder-layer group must be trainable from its first forward (pytorch 186998).
        assert any(p.requires_grad for p in layer.parameters()), "a decoder layer has no adapter"


def _add_reference_adapter(model: nn.Module, lora_config: Any) -> None:
    """A second adapter of the same shape, `REFERENCE_ADAPTER`, in every adapted module (peft's
    multi-adapter layers; TRL loads the adapter twice for its `ref_adapter_name` the same way):
    frozen, filled from --lora_from's folder like the trained one (`finish_adapters`), and
    active only inside `reference_adapter_active`. peft makes the adapter it adds active and
    trainable: the trained one is made active again, which freezes the other."""
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    inject_adapter_in_model(
        lora_config, model, adapter_name=REFERENCE_ADAPTER, low_cpu_mem_usage=True
    )
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.set_adapter(ADAPTER)


@contextlib.contextmanager
def _tuner_layers_with(model: nn.Module, attribute: str, value: Any) -> Iterator[None]:
    """Every peft tuner layer's `attribute` set to `value` inside the block, then restored. Set
    directly: peft's own setters (`set_adapter`, `enable_adapters`) also flip the adapters'
    requires_grad, which FSDP2 tracks on its sharded parameters."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    assert layers, "LoRA but no adapter in the model"
    before = [getattr(layer, attribute) for layer in layers]
    for layer in layers:
        setattr(layer, attribute, value)
    try:
        yield
    finally:
        for layer, was in zip(layers, before, strict=True):
            setattr(layer, attribute, was)


def adapters_disabled(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """The model with its peft adapters off (peft's `disable_adapter`, for a model that is not
    a PeftModel: ours injects the adapters into the transformers model): the base model."""
    return _tuner_layers_with(model, "_disable_adapters", True)


def reference_adapter_active(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """The model computing with its frozen reference adapter instead of the trained one (TRL's
    `set_adapter(ref_adapter_name)`)."""
    return _tuner_layers_with(model, "_active_adapter", REFERENCE_ADAPTER)


def _adapter_mismatch(settings: LoraSettings, targets: list[str]) -> None:
    missing = sorted(set(settings.adapter_modules) - set(targets))
    extra = sorted(set(targets) - set(settings.adapter_modules))
    if missing and not extra:
        why = (
            f"it adapts modules that are not linear layers of this model's decoder layers: "
            f"{', '.join(missing[:4])}"
        )
    else:
        why = (
            f"it adapts {settings.target_modules} in some decoder layers only (e.g. not "
            f"{', '.join(extra[:2])}), and continuing it adapts every layer's"
        )
    raise ValueError(
        f"--lora_from {settings.adapter}: {why}. Is it an adapter of this model (--model)? "
        "Continue it with peft itself, or start a fresh adapter without --lora_from."
    )


def adapted_modules(model: nn.Module) -> dict[str, Any]:
    """The LoRA-wrapped modules by name, as in the checkpoint (no activation-checkpoint prefix)."""
    from peft.tuners.lora import LoraLayer
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    return {
        name.replace(_CHECKPOINT_PREFIX, ""): module
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    }


def is_tensor_adapter(module: Any) -> bool:
    """peft's adapter of a fused expert tensor (lora.ParamWrapper), not of a linear layer."""
    from peft.tuners.lora import ParamWrapper

    return isinstance(module, ParamWrapper)


def adapted_tensor_name(name: str, module: Any) -> str:
    """The expert tensor a ParamWrapper named `name` adapts, as named before LoRA."""
    return f"{without_base_layer(name + '.')[:-1]}.{module.parameter_name}"


def expert_delta(a: torch.Tensor, b: torch.Tensor, module: Any) -> torch.Tensor:
    """The update scaling x B @ A of a fused expert tensor, as peft's ParamWrapper computes it:
    A is (experts x r, in) and B (out, r x experts), one rank-r pair per expert, and the result
    is laid out as the tensor is ([experts, out, in] for transformers' experts, [experts, in,
    out] for transposed ones such as gpt-oss's)."""
    experts = module.num_experts
    a = a.reshape(experts, -1, a.shape[-1])
    b = b.reshape(b.shape[0], -1, experts)
    layout = "e o i" if module._did_swap_in_out_features else "e i o"
    return torch.einsum(f"o r e, e r i -> {layout}", b, a) * module.scaling[ADAPTER]


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# --- weights --------------------------------------------------------------------------------


def _generator(seed: int, name: str) -> torch.Generator:
    state = np.random.SeedSequence([seed, zlib.crc32(name.encode())]).generate_state(1)
    return torch.Generator().manual_seed(int(state[0]))


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Fill the adapters after `to_empty`, identically on any world size.

    Each adapter matrix is drawn whole on the CPU from its own generator (seed, name), as peft
    initialises it (A: Kaiming-uniform with a = sqrt(5), B: zero), and each rank copies the slice
    its shard holds (`distribute_tensor` with `src_data_rank=None` slices locally: no traffic).
    DoRA's magnitudes depend on the base weights: `init_dora_magnitudes`, once they are loaded.
    """
    for name, param in _all_named_parameters(model):
        if not param.requires_grad or ".lora_magnitude_vector." in name:
            continue
        full = torch.zeros(param.shape, dtype=torch.float32)
        if ".lora_A." in name:
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=_generator(seed, name))
        elif ".lora_B." not in name:
            raise AssertionError(f"unexpected trainable parameter {name} in a LoRA model")
        _copy_into(param, full)


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a whole tensor into a parameter: each rank its own shard of it (no traffic)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (an all-gather under FSDP2: collective), an NF4 base weight
    dequantized."""
    return qlora.full_weight(tensor)


@torch.no_grad()
def init_dora_magnitudes(model: nn.Module) -> None:
    """DoRA's magnitude of each adapted layer, as peft initialises it: the norm of each output
    row of W + scaling x B @ A (with B = 0 at the start: of the pretrained W), computed by
    peft's own `get_weight_norm`. Collective under FSDP2: one weight matrix is gathered at a
    time (as FSDP2 gathers a layer for its forward); every rank keeps its shard of the result.
    A no-op without DoRA."""
    for module in adapted_modules(model).values():
        if ADAPTER not in module.lora_magnitude_vector:
            continue
        dora = module.lora_magnitude_vector[ADAPTER]
        weight = _full(module.get_base_layer().weight).float()
        a, b = _full(module.lora_A[ADAPTER].weight), _full(module.lora_B[ADAPTER].weight)
        norm = dora.get_weight_norm(weight, (b.float() @ a.float()), module.scaling[ADAPTER])
        _copy_into(dora.weight, norm)


def without_base_layer(name: str) -> str:
    """A LoRA model's name as in the model before LoRA: peft puts each adapted module's weights
    under `base_layer`, and nests wrappers when it adapts several tensors of one module
    (`mlp.experts.base_layer.base_layer.gate_up_proj` -> `mlp.experts.gate_up_proj`)."""
    return re.sub(r"(\.base_layer)+(?=\.)", "", name)


def base_key_map(model: nn.Module, key_map: dict[str, _Source]) -> dict[str, _Source]:
    """The pretrained-weights key map (model key -> checkpoint key) of the model before LoRA,
    renamed for the LoRA model, where the weights of an adapted `m` are `m.base_layer.*`."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    names = [name for name, _ in _all_named_parameters(model)]
    names += [name.replace(_CHECKPOINT_PREFIX, "") for name, _ in model.named_buffers()]
    lora_name = {without_base_layer(name): name for name in names}
    return {lora_name.get(key, key): source for key, source in key_map.items()}


def init_adapters_and_key_map(
    model: nn.Module, key_map: dict[str, _Source], *, seed: int
) -> dict[str, _Source]:
    """After `to_empty`: initialise the adapters; return the key map to load the base with."""
    init_adapters(model, seed)
    return base_key_map(model, key_map)


def finish_adapters(model: nn.Module, config: TrainConfig) -> None:
    """Once the base is loaded: DoRA's magnitudes from it, then --lora_from's adapter weights
    (each rank reading its slices of them, as for the base)."""
    init_dora_magnitudes(model)
    settings = lora_settings(config)
    if settings.adapter is None:
        return
    from fsdp_utils.model.peft_adapter import adapter_key_map
    from fsdp_utils.model.weights import load_pretrained_weights

    keys = [name for name, _ in _all_named_parameters(model)]
    load_pretrained_weights(model, settings.adapter, adapter_key_map(keys))


# --- checkpoints ----------------------------------------------------------------------------


def lora_identity(config: TrainConfig) -> dict[str, Any]:
    """What the checkpoint identity adds for a LoRA run (nothing for full fine-tuning, so that
    checkpoints of full fine-tunes keep the identity they always had), and `quantize` for a
    4-bit base: adapters trained on NF4 weights continue on NF4 weights only."""
    if not config.lora:
        return {}
    quantized = {"quantize": config.quantize} if config.quantize != "none" else {}
    return {"lora": lora_settings(config).identity(), **quantized}


def checkpoint_kind_mismatch(
    path: Any, saved: dict[str, Any], current: dict[str, Any]
) -> str | None:
    """One paragraph if a LoRA run meets a full fine-tune's checkpoint, or the reverse."""
    saved_lora, lora = "lora" in saved, "lora" in current
    if saved_lora == lora:
        return None
    if lora:
        return (
            f"Checkpoint {path} is from a full fine-tune, and this run has --lora: a LoRA run "
            "cannot continue it (the checkpoint holds the whole model, not adapters). Drop "
            "--lora to continue the full fine-tune, or start the LoRA run in another "
            "--output_dir (or with --resume never). To fine-tune the result with LoRA, export it "
            "first (python -m fsdp_utils.export CHECKPOINT FOLDER) and pass --model FOLDER."
        )
    return (
        f"Checkpoint {path} is from a LoRA run (it holds the adapters only), and this run is a "
        "full fine-tune: add --lora with the same --lora_* settings to continue it, or start the "
        "full fine-tune in another --output_dir (or with --resume never). To fine-tune the "
        "merged model fully, export it first (python -m fsdp_utils.export --merge CHECKPOINT "
        "FOLDER) and pass --model FOLDER."
    )


def state_dict_options(*, trainable_only: bool) -> StateDictOptions:
    """DCP state-dict options of a training checkpoint. `trainable_only` (LoRA, --freeze_layers:
    `fsdp_utils.model.freeze.trains_a_subset`): what trains, never the frozen weights, which are
    the pretrained model's and load from it again on resume. Loading is then not strict about the
    frozen keys; `dcp.load` still fails on any trained tensor missing from the checkpoint."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def describe(config: TrainConfig, model: nn.Module | None = None) -> str:
    settings = lora_settings(config)
    targets = settings.target_modules or (
        "every linear layer of the decoder layers outside mixture-of-experts blocks"
    )
    text = (
        f"{'DoRA' if settings.dora else 'LoRA'} r={settings.r}, alpha={settings.alpha:g}, "
        f"dropout={settings.dropout:g} on {targets}"
    )
    if model is not None:
        adapted = len(adapted_modules(model))
        text += f": {adapted} adapted modules, {trainable_parameters(model) / 1e6:,.3f}M trainable"
        if config.quantize != "none":
            text += f"\nqlora: {qlora.describe(model)}"
    if settings.note:
        text += f"\nlora: {settings.note}"
    return text
