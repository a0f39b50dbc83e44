"""`--attn_implementation`: which attention kernel transformers runs, checked before the job waits.

The name goes to transformers (`from_config(..., attn_implementation=...)`), which picks the
kernel in every attention layer; the trainer, the memory planner and the standalone chess
evaluation all build through `transformers_argument`. `sdpa`, the default, is passed as
transformers' own default (None): a model without SDPA support (Gemma 2, whose attention
soft-capping SDPA cannot do) then falls back to eager exactly as `from_pretrained` does, and the
log names the implementation the model really runs (`model.config._attn_implementation`).

`check_attn_implementation` refuses, in the preflight and at the start of training, what would
fail later or silently do something else:

- the model does not support it, or its package is missing: transformers' own checks, run by a
  meta build (no memory);
- flash_attention_2 computes in fp16/bf16 only (transformers merely warns) and needs CUDA;
- flex_attention has no backward on CPU (torch 2.13's `_validate_device`);
- with `--document_masking`, an implementation that would let packed documents see each other
  (the rule lives in `fsdp_utils.data.document_masking`);
- a `--sdpa_backend` kernel this device or this attention cannot run (`fsdp_utils.model.sdpa`).
"""

from __future__ import annotations

from typing import Any, get_args

from fsdp_utils.config.train_config import AttnImplementation, TrainConfig
from fsdp_utils.data.document_masking import check_isolates_documents
from fsdp_utils.model.sdpa import check_sdpa_backend

IMPLEMENTATIONS: tuple[str, ...] = get_args(AttnImplementation)
# What the memory planner traces in their place on its fake CPU tensors (flash-attn has no CPU
# kernel, flex attention no CPU backward). SDPA's CPU kernel is a flash kernel too: it saves
# the output and the log-sum-exp for backward, O(T) per head like both, never the T x T scores.
PLANNED_AS = {"flash_attention_2": "sdpa", "flex_attention": "sdpa"}


def transformers_argument(implementation: str) -> str | None:
    """`attn_implementation=` for transformers: None (its default: sdpa, else eager) for sdpa."""
    return None if implementation == "sdpa" else implementation


def check_attn_implementation(
    hf_config: Any, config: TrainConfig, *, device_type: str | None
) -> None:
    """Raise ValueError (one paragraph, naming the fix) if `config.attn_implementation` cannot
    train this model on `device_type` ("cuda" or "cpu"; None: GPUs this machine does not have,
    the login node's preflight)."""
    implementation = config.attn_implementation
    if config.document_masking:
        check_isolates_documents(implementation, batch_size_per_device=config.batch_size_per_device)
    if config.sdpa_backend != "auto":
        supports = "sdpa" in supported_implementations(hf_config)
        check_sdpa_backend(config, device_type=device_type, supports_sdpa=supports)
    if implementation == "sdpa":  # transformers' default: always available (else eager)
        return
    if implementation == "flash_attention_2":
        if config.precision == "fp32":
            raise ValueError(
                "--attn_implementation flash_attention_2 computes in fp16 or bf16 only, and "
                "--precision fp32 computes in fp32. Use --precision bf16-mixed (fp32 master "
                "weights, bf16 compute), or --attn_implementation sdpa."
            )
        if device_type == "cpu":
            raise ValueError(
                "--attn_implementation flash_attention_2 needs a CUDA GPU, and this run is on "
                "the CPU. Use --attn_implementation sdpa (or eager) here."
            )
    if implementation == "flex_attention" and device_type == "cpu":
        raise ValueError(
            "--attn_implementation flex_attention cannot train on the CPU: torch's "
            "FlexAttention has no backward pass there. Use --attn_implementation sdpa (or "
            "eager) on the CPU, flex_attention on GPUs."
        )
    _check_with_transformers(hf_config, config)


def _check_with_transformers(hf_config: Any, config: TrainConfig) -> None:
    """transformers' own checks (does the model class support it, is its package installed),
    which run when the model is built: a meta build, no memory."""
    from fsdp_utils.model.build import build_meta_model

    implementation = config.attn_implementation
    try:
        build_meta_model(hf_config, config.precision, attn_implementation=implementation)
    except ImportError as err:  # the model supports it; its package is missing or unusable
        raise ValueError(
            f"--attn_implementation {implementation} is not usable in this environment: "
            f"{' '.join(str(err).split())} Install it into the environment the job runs in "
            "(for flash_attention_2: pip install flash-attn --no-build-isolation, on the login "
            "node), or use --attn_implementation sdpa."
        ) from err
    except ValueError as err:  # the model class does not support it
        supported = supported_implementations(hf_config)
        raise ValueError(
            f"--attn_implementation {implementation} cannot serve this model "
            f"({hf_config.model_type}): {' '.join(str(err).split())} Implementations "
            f"{hf_config.model_type} supports: {', '.join(supported)}; choose one with "
            "--attn_implementation, or leave the option out for sdpa."
        ) from err


def model_class(hf_config: Any) -> Any:
    """The class `AutoModelForCausalLM` builds for this config."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]


def supported_implementations(hf_config: Any) -> list[str]:
    """The implementations the model's class declares (transformers' `_supports_*`)."""
    cls = model_class(hf_config)
    flags = {
        "sdpa": cls._supports_sdpa,
        "eager": True,
        "flash_attention_2": cls._supports_flash_attn,
        "flex_attention": cls._supports_flex_attn,
    }
    return [name for name in IMPLEMENTATIONS if flags[name]]


def planned_implementation(implementation: str) -> str:
    """What the memory planner traces for `implementation` (see PLANNED_AS)."""
    return PLANNED_AS.get(implementation, implementation)
