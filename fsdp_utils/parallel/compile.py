"""`--compile`: what torch.compile compiles (`--compile_scope`), with which backend, and what it
did (graph breaks and recompiles, for the log).

Two scopes, applied after activation checkpointing and before FSDP2 (`parallelize`):

- `layers` (the default, torchtitan's way): each decoder layer on its own. The layers are
  alike, so they share one compiled graph and compile once; FSDP2's hooks around each layer
  run eagerly, outside the graphs.
- `model`: the module that holds the decoder layers (the embeddings, every layer, the final
  norm: Llama's `model.model`) as one compiled forward. FSDP2's hooks are excluded from tracing
  (`_dynamo_disable`), so the graph still breaks at each sharded layer's entry and exit: two
  breaks per layer, which the log counts. The output layer and the loss stay outside it: they
  run in chunks inside the root's forward (fsdp_utils/train/loss.py), whose chunks are compiled
  on their own with --compile.

`Module.compile` keeps the module and its parameter names (no `_orig_mod.` wrapper), so
checkpoints, weight loading and export see the same model.

`FSDP_UTILS_COMPILE_BACKEND` chooses the backend (default inductor, torch.compile's): the test
suite sets `aot_eager`, the same graph capture (dynamo, AOTAutograd: the same graph breaks,
recompiles and autograd) without inductor's code generation, which takes minutes of a cold CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

BACKEND_VARIABLE = "FSDP_UTILS_COMPILE_BACKEND"


def compile_backend() -> str:
    """The backend every torch.compile of this toolkit uses (`BACKEND_VARIABLE`)."""
    return os.environ.get(BACKEND_VARIABLE) or "inductor"


def compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compile(function)` with the toolkit's backend (the loss's chunks)."""
    return torch.compile(function, backend=compile_backend())


def decoder_stack(model: nn.Module, layers: list[nn.Module]) -> nn.Module:
    """The innermost module that holds every decoder layer (Llama's `model.model`, GPT-2's
    `transformer`): what `--compile_scope model` compiles."""
    inner = [
        module
        for module in model.modules()
        if not isinstance(module, nn.ModuleList | nn.ModuleDict)  # no forward of their own
        and all(any(child is layer for child in module.modules()) for layer in layers)
    ]
    # modules() lists parents before children: the last one that holds them all is innermost
    return inner[-1]


def apply_compile(model: nn.Module, layers: list[nn.Module], scope: str) -> list[nn.Module]:
    """`torch.compile` in place (`Module.compile`) at `scope` ("layers" or "model"); returns
    the modules compiled."""
    backend = compile_backend()
    targets = layers if scope == "layers" else [decoder_stack(model, layers)]
    for module in targets:
        module.compile(backend=backend)
    return targets


@dataclass(frozen=True)
class CompileCounts:
    """What torch.compile has done in this process so far (torch._dynamo's counters): graphs
    compiled, graph breaks (by reason: the first line of dynamo's message), frames it gave up on
    (they run eagerly: a graph break inside a loop makes dynamo skip the loop's whole frame, as
    FSDP2's hooks do in the decoder loop with --compile_scope model; their layers are then
    compiled one by one as they are called) and recompiles (a frame compiled again: a guard
    failed, such as a new shape)."""

    graphs: int
    graph_breaks: dict[str, int]
    eager_frames: int
    recompiles: int

    @classmethod
    def now(cls) -> CompileCounts:
        from torch._dynamo.utils import counters, get_compilation_metrics

        breaks: dict[str, int] = {}
        for message, n in counters["graph_break"].items():
            reason = message.strip().splitlines()[0] if message.strip() else "unknown"
            breaks[reason] = breaks.get(reason, 0) + int(n)
        frames = counters["frames"]
        recompiles = sum(
            1 for m in get_compilation_metrics() if getattr(m, "recompile_reason", None)
        )
        return cls(
            graphs=int(counters["stats"]["unique_graphs"]),
            graph_breaks={reason: n for reason, n in breaks.items() if n > 0},
            eager_frames=max(0, int(frames["total"]) - int(frames["ok"])),
            recompiles=recompiles,
        )

    @property
    def breaks(self) -> int:
        return sum(self.graph_breaks.values())

    def record(self) -> dict[str, Any]:
        return {
            "graphs": self.graphs,
            "graph_breaks": self.breaks,
            "eager_frames": self.eager_frames,
            "recompiles": self.recompiles,
            "graph_break_reasons": self.graph_breaks,
        }

    def describe(self, scope: str) -> str:
        """'compile (layers): 2 graphs, 0 graph breaks, 0 frames left eager, 0 recompiles';
        the commonest break reasons after."""

        def plural(n: int, word: str) -> str:
            return f"{n:,} {word}{'' if n == 1 else 's'}"

        line = (
            f"compile ({scope}): {plural(self.graphs, 'graph')}, "
            f"{plural(self.breaks, 'graph break')}, {plural(self.eager_frames, 'frame')} left "
            f"eager, {plural(self.recompiles, 'recompile')}"
        )
        top = sorted(self.graph_breaks.items(), key=lambda item: -item[1])[:3]
        if top:
            line += " (breaks: " + "; ".join(f"{n} x {reason[:100]}" for reason, n in top) + ")"
        return line
