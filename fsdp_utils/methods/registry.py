"""`--method NAME` -> its Method: the one list of the methods a run can name.

A new method is a module beside sft.py (or a package beside dpo/) and one line in `METHODS`;
the trainer and the planner look it up here and compose it. A program that brings its own
method registers it before it starts a run (`register_method`: the test of a toy method does).
"""

from __future__ import annotations

from fsdp_utils.config.train_config import TrainConfig

from .base import Method, MethodContext
from .distill.method import Distill
from .dpo.method import DPO
from .grpo.method import GRPO
from .sft import SFT

METHODS: dict[str, type[Method]] = {
    SFT.name: SFT,
    DPO.name: DPO,
    Distill.name: Distill,
    GRPO.name: GRPO,
}


def register_method(method: type[Method]) -> type[Method]:
    """Make `--method <method.name>` train with `method` in this process (usable as a class
    decorator). A name that is taken is an error: no method replaces another silently."""
    if not method.name:
        raise ValueError(f"{method.__name__} has no `name`: set the class attribute.")
    if METHODS.get(method.name, method) is not method:
        raise ValueError(f"--method {method.name} is taken by {METHODS[method.name].__name__}.")
    METHODS[method.name] = method
    return method


def method_class(name: str) -> type[Method]:
    """The Method of `--method name`; a ValueError naming the known methods otherwise."""
    if name not in METHODS:
        known = ", ".join(sorted(METHODS))
        raise ValueError(
            f"--method {name}: no such training method. Known: {known} (docs/preference.md "
            "for dpo, docs/distillation.md for distill, docs/grpo.md for grpo; a method of your "
            "own is registered with fsdp_utils.methods.registry.register_method before the run "
            "starts)."
        )
    return METHODS[name]


def build_method(config: TrainConfig, context: MethodContext) -> Method:
    """The run's method (`config.method`), built."""
    return method_class(config.method)(config, context)
