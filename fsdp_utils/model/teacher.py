"""A distillation teacher (`--method distill --teacher MODEL`) on the meta device: built as the
trained model is (`build_meta_model` -> `transform_model`), with the options a frozen model
needs, and checked to share the student's vocabulary.

- **Precision**: the teacher is stored in the precision it computes in, since it has no
  optimizer to keep fp32 master weights for: bf16 under bf16-mixed and bf16-true (2 bytes per
  parameter, not the trained model's 4), fp32 under fp32; under fp16-mixed in fp32 and cast to
  fp16 by FSDP2's policy, as the student. `--teacher_quantize nf4` stores its decoder layers'
  linear weights in 4 bits with QLoRA's transform and loader (`fsdp_utils.model.qlora`).
- **No LoRA, no frozen-layer transform, no activation checkpointing** (nor `--checkpoint_layers`
  or `--checkpoint_mode`), **no liger-kernel**: it runs forward only, under no_grad, so nothing
  is saved for a backward. (liger's function also rebinds module-level names of the family's
  modeling file, for the process: a teacher of the student's family built after it runs liger's
  rotary, norms and MLPs all the same.)
- **The vocabulary**: distillation compares the two models' probabilities token by token, so
  the tokenizers must agree on every token's id (`check_same_vocabulary`). Their output layers
  may still differ in width (Qwen2.5's small models have 151,936 rows, its 7B and up 152,064,
  for one tokenizer of 151,665 tokens): the losses read the first `shared_vocab` columns of
  both, which hold every token the tokenizer has.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_utils.config.train_config import Precision, TrainConfig
from fsdp_utils.model.build import build_meta_model
from fsdp_utils.model.transforms import MetaModel, transform_model
from fsdp_utils.model.weights import WeightSource, checkpoint_key_map


def teacher_precision(precision: Precision) -> Precision:
    """The precision a frozen model is stored and computed in under a run of `precision`."""
    return "bf16-true" if precision in ("bf16-mixed", "bf16-true") else precision


def teacher_build_config(config: TrainConfig) -> TrainConfig:
    """The run's options as the teacher is built and sharded with them (see the docstring)."""
    return config.replace(
        precision=teacher_precision(config.precision),
        quantize=config.teacher_quantize,
        lora=False,
        freeze_layers=0,
        gradient_checkpointing=False,
        checkpoint_layers=None,  # --auto's count of checkpointed layers: the student's
        checkpoint_mode="layer",
        liger_kernels=False,  # its layers' kernels and fused loss are for a trained model
        compile=False,
        compile_scope="layers",
        float8="none",  # a frozen forward: float8 training's recipes are for trained layers
        single_device_path="fsdp",
    )


@dataclass(frozen=True)
class MetaTeacher:
    """The teacher on meta with its transforms, and its checkpoint key map (taken before)."""

    meta: MetaModel
    key_map: dict[str, WeightSource]
    config: TrainConfig  # what it is built, sharded and loaded with (`teacher_build_config`)


def meta_teacher(hf_config: Any, model_dir: Path | None, config: TrainConfig) -> MetaTeacher:
    """The teacher as it will run, on meta. `model_dir` None: no key map (the planner's)."""
    built = teacher_build_config(config)
    model = build_meta_model(
        hf_config, built.precision, attn_implementation=config.attn_implementation
    )
    key_map = checkpoint_key_map(model, model_dir) if model_dir is not None else {}
    return MetaTeacher(transform_model(model, built), key_map, built)


def _vocabulary(model_dir: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(model_dir).get_vocab())


def output_width(hf_config: Any) -> int:
    return int(hf_config.get_text_config().vocab_size)


def check_same_vocabulary(student: tuple[str, Path, Any], teacher: tuple[str, Path, Any]) -> int:
    """The output width both models' losses read (`shared_vocab`), or a ValueError naming both
    models and where their tokenizers differ. Each of `student`, `teacher`: (name, folder,
    transformers config)."""
    (s_name, s_dir, s_config), (t_name, t_dir, t_config) = student, teacher
    s_vocab, t_vocab = _vocabulary(s_dir), _vocabulary(t_dir)
    if s_vocab != t_vocab:
        differ = sorted(
            token for token in s_vocab.keys() | t_vocab.keys()
            if s_vocab.get(token) != t_vocab.get(token)
        )  # fmt: skip
        shown = ", ".join(
            f"{token!r} (id {s_vocab.get(token)} in the student, {t_vocab.get(token)} in the "
            "teacher)"
            for token in differ[:2]
        )
        raise ValueError(
            f"The teacher {t_name} has another vocabulary than the student {s_name}: "
            f"{len(t_vocab):,} tokens against {len(s_vocab):,}, {len(differ):,} of them with "
            f"another id or in one only, e.g. {shown}. Distillation compares the two models' "
            "probabilities token by token, so both must use one tokenizer: choose a teacher of "
            "the student's family (Qwen2.5-7B for Qwen2.5-0.5B, Llama-3.1-70B for Llama-3.1-8B)."
        )
    width = min(output_width(s_config), output_width(t_config))
    if width < len(s_vocab):
        raise ValueError(
            f"The student {s_name} and the teacher {t_name} share a tokenizer of "
            f"{len(s_vocab):,} tokens, but one of them has only {width:,} output rows: its "
            "config.json's vocab_size does not cover its own tokenizer. Check the model folder."
        )
    return width
