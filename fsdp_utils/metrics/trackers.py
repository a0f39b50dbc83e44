"""TensorBoard and W&B as sinks behind the run's log (`RunLogger(sinks=...)`), like torchtitan's
LoggerContainer: each gets every record that metrics.jsonl gets, so all three hold the same
numbers. Neither needs a network, since compute nodes have none:

- `--tensorboard`: event files in `<run>/tensorboard`; on the login node
  `tensorboard --logdir runs/` shows them.
- `--wandb PROJECT`: W&B in offline mode, into `<run>/wandb`; the run id is kept there, so a
  requeued job continues the same W&B run, and the end of the log gives the `wandb sync` command
  to upload it from the login node.

A tracker's scalars are named `<kind>/<field>`: `train/loss`, `eval/eval_loss`,
`chess_eval/legal_move_rate`, `checkpoint/seconds`, ...
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fsdp_utils.atomic import write_text_atomic
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.metrics.logger import MetricSink, scalar_fields

WANDB_INSTALL = "pip install -e '.[wandb]'"
# W&B refuses these in project names (and the name becomes part of a URL).
_WANDB_BAD_CHARS = set("/\\#?%:")


def check_trackers(config: TrainConfig) -> None:
    """Fail before anything is loaded (every rank, and the preflight) if a tracker cannot run."""
    if config.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError as err:
            raise ValueError(
                "--tensorboard needs the tensorboard package, which is not installed in this "
                "environment: run `pip install tensorboard` (a dependency of fsdp-utils: "
                "`pip install -e .` installs it) on the login node, or drop --tensorboard."
            ) from err
    if config.wandb is None:
        return
    project = config.wandb
    if not project.strip() or len(project) > 128 or _WANDB_BAD_CHARS & set(project):
        raise ValueError(
            f"--wandb {project!r} is not a W&B project name: give 1-128 characters without "
            "/ \\ # ? % :, e.g. --wandb chess-finetune."
        )
    try:
        import wandb  # noqa: F401
    except ImportError as err:
        raise ValueError(
            f"--wandb {project} needs the wandb package, which is not installed in this "
            f"environment: run `{WANDB_INSTALL}` (or `pip install wandb`) on the login node, "
            "where there is internet, then resubmit; or drop --wandb (metrics.jsonl and "
            "--tensorboard need nothing more)."
        ) from err


def open_trackers(config: TrainConfig, layout: RunLayout, *, enabled: bool) -> list[MetricSink]:
    """The sinks this run asked for; none where `enabled` is false (ranks other than 0)."""
    if not enabled:
        return []
    sinks: list[MetricSink] = []
    if config.tensorboard:
        sinks.append(TensorBoardSink(layout.tensorboard))
    if config.wandb is not None:
        sinks.append(WandbSink(layout, project=config.wandb))
    return sinks


def _config_text(record: dict[str, Any]) -> str:
    # TensorBoard renders text as Markdown: an indented block keeps the JSON as it is.
    body = json.dumps(record, indent=2, default=str)
    return "\n".join("    " + line for line in body.splitlines())


class TensorBoardSink:
    """Event files in `folder`; one more file per leg of a resumed run.

    A leg resumed from step k opens its writer with `purge_step=k + 1`: TensorBoard then hides
    what earlier legs logged from that step on, so where a run resumed from a checkpoint older
    than its last logged step, the later leg wins, as in `fsdp_utils.metrics.logger.latest_history`.
    A fresh start purges from step 1 (`--resume never` in a used folder starts a new curve)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._writer: Any = None
        self._start_step = 0

    def _open(self) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        if self._writer is not None:
            self._writer.close()
        # flush_secs: someone watching with `tensorboard --logdir` sees the run within 30 s.
        self._writer = SummaryWriter(
            str(self.folder), purge_step=self._start_step + 1, flush_secs=30
        )
        return self._writer

    def write(self, record: dict[str, Any]) -> None:
        if record.get("kind") == "resumed":
            # Always the first record of a resumed leg (Trainer.setup); reopen all the same if
            # something came earlier, so that the purge still starts at the right step.
            self._start_step = int(record["step"])
            self._open()
            return
        step, scalars = record.get("step"), scalar_fields(record)
        if not isinstance(step, int) or not scalars:
            return
        writer = self._writer or self._open()
        kind = record.get("kind", "event")
        for name, value in scalars.items():
            writer.add_scalar(
                f"{kind}/{name}", value, global_step=step, walltime=record.get("time")
            )

    def write_config(self, record: dict[str, Any]) -> None:
        writer = self._writer or self._open()
        writer.add_text("config", _config_text(record), global_step=self._start_step)

    def close(self) -> str | None:
        if self._writer is None:
            return None
        self._writer.close()
        self._writer = None
        return (
            f"TensorBoard: event files in {self.folder.resolve()}; on the login node: "
            f"tensorboard --logdir {self.folder.resolve().parent.parent}"
        )


class WandbSink:
    """W&B, always offline (no network call: compute nodes have none), into `<run>/wandb`.

    The W&B run starts at the first record: a leg that resumed the training run (its first
    record is "resumed") continues the W&B run whose id is stored in `<run>/wandb/run_id`;
    a fresh start gets a new id. Each leg writes its own `offline-run-<time>-<id>` folder;
    `wandb sync` (0.31) uploads the folders of one id in order as one run."""

    def __init__(self, layout: RunLayout, *, project: str) -> None:
        self.layout = layout
        self.project = project
        self._run: Any = None

    @property
    def id_file(self) -> Path:
        return self.layout.wandb / "run_id"

    def _open(self, *, resumed: bool) -> Any:
        import wandb

        run_id = None
        if resumed and self.id_file.is_file():
            run_id = self.id_file.read_text().strip() or None
        self.layout.wandb.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=self.project,
            name=self.layout.root.resolve().name,
            dir=str(self.layout.root),  # W&B adds the `wandb/` itself
            mode="offline",
            id=run_id,
            resume="allow" if run_id else None,
            # Our own log already goes to the job's output: W&B must not wrap stdout/stderr.
            settings=wandb.Settings(console="off", quiet=True),
        )
        write_text_atomic(self.id_file, self._run.id + "\n")
        return self._run

    def write(self, record: dict[str, Any]) -> None:
        run = self._run or self._open(resumed=record.get("kind") == "resumed")
        step, scalars = record.get("step"), scalar_fields(record)
        if not isinstance(step, int) or not scalars:
            return
        kind = record.get("kind", "event")
        # Records of one step (train, eval, checkpoint) share one W&B row.
        run.log({f"{kind}/{name}": value for name, value in scalars.items()}, step=step)

    def write_config(self, record: dict[str, Any]) -> None:
        run = self._run or self._open(resumed=False)
        # The options at the top level, so that runs compare by them in the W&B table; a
        # resumed leg may change some (world size, batch per device, learning rate).
        flat = {**record.get("config", {}), **{k: v for k, v in record.items() if k != "config"}}
        run.config.update(flat, allow_val_change=True)

    def close(self) -> str | None:
        if self._run is None:
            return None
        run_id = self._run.id
        self._run.finish()
        self._run = None
        folder = self.layout.wandb.resolve()
        return (
            f"W&B: offline run {run_id} (project {self.project}) in {folder}; upload it from "
            f"the login node with:\n  wandb sync {folder}/offline-run-*-{run_id}"
        )
