"""chess_finetune.py with one step's gradients made non-finite while its loss stays finite.

    POISON_GRADIENT_AT_STEP=3 python tests/poison_gradient.py <chess_finetune.py options>

What a bf16/fp32 run without a gradient scaler can meet: a finite loss whose backward
overflows. A forward pre-hook on `lm_head` (added through `cli.main`'s `after_setup`) passes
its input, the last hidden states, through unchanged but multiplies their gradient by infinity
at that step (1-based, as logged): the loss in chunks reads those hidden states, not the
layer's output; nothing else differs from a real run.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_utils.hub.offline import enable_offline_mode

enable_offline_mode()

import torch  # noqa: E402

from fsdp_utils import cli  # noqa: E402
from fsdp_utils.trainer.trainer import Trainer  # noqa: E402

POISON_STEP = int(os.environ["POISON_GRADIENT_AT_STEP"])


class _InfiniteGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.inf


def poison(trainer: Trainer) -> None:
    """`cli.main`'s after-setup hook: from now on, the gradient of lm_head's input is infinite
    at step POISON_STEP."""

    def hook(module: torch.nn.Module, inputs: tuple[Any, ...]) -> Any:
        if module.training and trainer.state.step + 1 == POISON_STEP:
            return (_InfiniteGradient.apply(inputs[0]), *inputs[1:])
        return None

    trainer.model.get_submodule("lm_head").register_forward_pre_hook(hook)


if __name__ == "__main__":
    sys.exit(cli.main(after_setup=poison))
