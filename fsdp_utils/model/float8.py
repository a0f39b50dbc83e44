"""`--float8 tensorwise|rowwise`: float8 matrix products for the decoder layers' linear layers,
through torchao's float8 training (`convert_to_float8_training`, which swaps `nn.Linear` for
its `Float8Linear`), as torchtitan's float8 converter does.

What runs: each converted layer casts its input, its weight and, in backward, the output's
gradient to float8 (e4m3; rowwise casts the gradient to e4m3 too, tensorwise to e5m2) with a
scale per tensor (tensorwise) or per row (rowwise, scales rounded to powers of 2), and
multiplies them with `torch._scaled_mm`, accumulating in higher precision; the weights, their
gradients and the optimizer stay as they were (fp32 masters under bf16-mixed). What it does
not convert:

- the output layer (`lm_head`), as torchtitan leaves it: the logits' precision is the loss's;
- linear layers with a dimension that is not a multiple of 16 (`torch._scaled_mm` needs it),
  and the routers of mixture-of-experts layers (`gate`, `router`: a few outputs whose choice
  float8's rounding would change); the experts of transformers' MoE layers are fused tensors,
  not linear layers, and stay as they are;
- LoRA and QLoRA runs are refused (`fsdp_utils.config.train_config.validate_config`): their
  trained matrices are the small adapters, and the frozen base is bf16 or NF4.

The parameter names and shapes are the `nn.Linear`'s, so checkpoints, resume and export are
unchanged. Not done: float8 all-gathers of FSDP2 (torchao's `enable_fsdp_float8_all_gather`,
tensorwise only): the weights travel in bf16 and are cast per forward.

Hardware: `torch._scaled_mm` needs compute capability 8.9 (Ada: L4, L40; Hopper: H100, H200;
Blackwell). Older GPUs and the CPU are refused before the run (`check_float8_device`), except
that torchao's emulation (a float8 round trip, then the matrix product in high precision) runs
anywhere: `FSDP_UTILS_FLOAT8_EMULATE=1` turns it on, for the tests and for numerics checks on
a CPU (slow; not a speed-up).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch import nn

from fsdp_utils.config.train_config import TrainConfig

EMULATE_VARIABLE = "FSDP_UTILS_FLOAT8_EMULATE"
FLOAT8_CAPABILITY = (8, 9)  # torch._scaled_mm's floor (sm89)


def emulated() -> bool:
    """torchao's float8 emulation (`EMULATE_VARIABLE`): the tests' way on a CPU."""
    return os.environ.get(EMULATE_VARIABLE, "") not in ("", "0")


def check_float8_device(config: TrainConfig, device_type: str | None) -> None:
    """Refuse --float8 where `torch._scaled_mm` has no float8 kernel: the CPU (unless emulated)
    and GPUs below compute capability 8.9. `device_type` None, or CUDA with no GPU visible:
    the run's GPUs are not on this machine (the login node), and the trainer checks them at
    its start (`fsdp_utils.run.preflight.run_device_type`)."""
    if config.float8 == "none" or emulated() or device_type is None:
        return
    if device_type == "cuda" and not torch.cuda.is_available():
        return
    if device_type != "cuda":
        raise ValueError(
            f"--float8 {config.float8} needs a GPU with float8 matrix products (compute "
            "capability 8.9 or newer: L4, L40, H100, H200, B200), and this run is on the CPU. "
            "Drop --float8 here; use it on such GPUs."
        )
    capability = torch.cuda.get_device_capability()
    if capability < FLOAT8_CAPABILITY:
        name = torch.cuda.get_device_name()
        raise ValueError(
            f"--float8 {config.float8} needs a GPU with float8 matrix products (compute "
            f"capability 8.9 or newer: L4, L40, H100, H200, B200), and this {name} has "
            f"{capability[0]}.{capability[1]} (an A100 is 8.0, a V100 7.0). Drop --float8 on "
            "these GPUs: bf16-mixed is their fastest precision."
        )


def float8_config(recipe: str) -> Any:
    """torchao's `Float8LinearConfig` of a recipe, emulated under `EMULATE_VARIABLE`."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulated())


def converts(module: nn.Module, name: str) -> bool:
    """A linear layer of a decoder layer that float8 takes (see the module's docstring)."""
    if type(module) is not nn.Linear:
        return False
    leaf = name.rpartition(".")[2]
    if leaf in ("gate", "router") or "router" in name:
        return False
    out_features, in_features = module.weight.shape
    return out_features % 16 == 0 and in_features % 16 == 0


def convert_to_float8(layers: list[nn.Module], recipe: str) -> int:
    """Swap the linear layers of `layers` (the decoder layers, on meta) for torchao's
    Float8Linear, in place; returns how many."""
    from torchao.float8 import convert_to_float8_training

    config = float8_config(recipe)
    count = 0
    for layer in layers:
        chosen = frozenset(name for name, m in layer.named_modules() if converts(m, name))
        count += len(chosen)
        convert_to_float8_training(
            layer, module_filter_fn=lambda m, name, chosen=chosen: name in chosen, config=config
        )
    return count


def describe_float8(model: nn.Module, config: TrainConfig) -> str:
    """The log's line: which recipe, how many linear layers, emulated or not."""
    converted = sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
    how = (
        "emulated (a float8 round trip, products in high precision)"
        if emulated()
        else ("torch._scaled_mm")
    )
    advice = "" if config.compile else "; without --compile its casts run unfused (slower)"
    return (
        f"float8: {config.float8} scaling on {converted} linear layers of the decoder layers, "
        f"{how}; the output layer in the compute dtype{advice}"
    )
