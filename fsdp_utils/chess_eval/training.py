"""The trainer's hook: `--chess_eval_every N` runs the evaluator on the FSDP model itself.

Every rank takes part and no rank gathers the full model: the forward passes are FSDP's own
(one gathered layer at a time), and the evaluator gives every rank the same number of them.
Results go to the log (a small table) and to metrics.jsonl as `kind: chess_eval` records with
`step` and flat numeric fields; with the engine judge, rank 0 writes the per-move and per-game
records into `<output_dir>/chess_eval/step_NNNNNN/` (`write_records`). An engine that fails
is reported in the table and the record (`engine_error`); training goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from fsdp_utils.chess_eval.evaluator import ChessEvaluator, format_table, log_record, write_records
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.hub.resolve import ResolvedAssets
from fsdp_utils.parallel.distributed import DistEnv


class TrainingChessEval:
    def __init__(
        self, evaluator: ChessEvaluator, every: int, log: Any, *, records: Path | None = None
    ) -> None:
        self.evaluator = evaluator
        self.every = every
        self.log = log
        self.records = records  # rank 0: where the per-move records go
        self.last_step: int | None = None

    @classmethod
    def build(
        cls, config: TrainConfig, env: DistEnv, assets: ResolvedAssets, log: Any
    ) -> TrainingChessEval | None:
        """None when `--chess_eval_every` is 0. Loads the held-out games now, so a dataset
        that is not chess fails before the model is built."""
        if not config.chess_eval_every:
            return None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
        evaluator = ChessEvaluator.from_config(
            config, tokenizer, rank=env.rank, world_size=env.world_size, device=env.device,
            files=assets.dataset_files,
        )  # fmt: skip
        log.info(
            f"chess eval: every {config.chess_eval_every} steps and at the end, "
            f"{len(evaluator.games)} held-out games x 3 prefixes, {evaluator.plies} plies; "
            f"{evaluator.engine_note}"
        )
        records = RunLayout.of(config.output_dir).chess_eval if env.is_main else None
        return cls(evaluator, config.chess_eval_every, log, records=records)

    def maybe_run(
        self,
        model: nn.Module,
        step: int,
        *,
        final: bool = False,
        autocast: Callable[[], Any] | None = None,
    ) -> dict[str, Any] | None:
        """Collective. Runs every `every` steps, and at the end unless it just ran."""
        due = step % self.every == 0 if not final else self.last_step != step
        if not due:
            return None
        # DDP's forward would synchronise buffers: evaluate the module it wraps.
        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        metrics = self.evaluator.run(inner, autocast=autocast)
        self.last_step = step
        self.log.event(
            "chess_eval", format_table(metrics, step=step), **log_record(metrics, step=step)
        )
        if self.records is not None:
            write_records(self.records / f"step_{step:06d}", metrics, step=step)
        return metrics
