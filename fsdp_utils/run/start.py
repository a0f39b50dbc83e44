"""What happens to the run folder before a run starts (rank 0, before anything is written).

- `--resume never` starts a run that can never be confused with the previous one in the same
  folder: the previous run's checkpoints, final model, metrics, config, status and tracker logs are moved to
  `<output_dir>/previous-<date-time>/`. Left in place, an old `step_00005000` would outlive
  every new save (pruning keeps the highest steps) and the next `--resume auto` (a requeued
  leg!) would silently continue the abandoned run. Moving rather than refusing: the user asked
  to start over, a refusal would cost another wait in the queue, and a rename within the folder
  is instant and deletes nothing. A requeued leg of the same job is not a new start: it resumes
  its own checkpoint (`checkpoint.requeued_leg_checkpoint`).
- The storage check (`fsdp_utils.checkpoint.storage`): fail now if not even one checkpoint fits on the run
  folder's file system, warn if `--keep_last` + 1 of them do not.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from fsdp_utils.checkpoint.storage import plan_storage
from fsdp_utils.config.job import JobLeg
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.hub.cache import format_bytes

SET_ASIDE_PREFIX = "previous-"


def starts_fresh(config: TrainConfig, layout: RunLayout, job: JobLeg) -> bool:
    """`--resume never`, unless this is a requeued leg that has a checkpoint of its own."""
    from fsdp_utils.checkpoint.sharded import requeued_leg_checkpoint

    if config.resume != "never":
        return False
    return requeued_leg_checkpoint(layout.checkpoints, job, warn=lambda _: None) is None


def previous_run_files(layout: RunLayout) -> list[Path]:
    """What a previous run left that a new one could be confused with (the job's own
    gpu_samples/ and logs/ stay)."""
    candidates = [layout.final_model, layout.metrics, layout.config, layout.status]
    # Tracker logs too: TensorBoard would draw both runs on one curve, W&B would resume the
    # old run's id.
    candidates += [layout.tensorboard, layout.wandb]
    found = [p for p in candidates if p.exists()]
    if layout.checkpoints.is_dir() and any(layout.checkpoints.iterdir()):
        found.insert(0, layout.checkpoints)
    return found


def set_aside_previous_run(layout: RunLayout, now: float | None = None) -> str | None:
    """Move the previous run's files to `previous-<date-time>/`; the log line, or None if the
    folder held no previous run."""
    files = previous_run_files(layout)
    if not files:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    target = layout.root / f"{SET_ASIDE_PREFIX}{stamp}"
    suffix = 1
    while target.exists():  # two fresh starts within a second
        suffix += 1
        target = layout.root / f"{SET_ASIDE_PREFIX}{stamp}-{suffix}"
    target.mkdir()
    steps = (
        sorted(p.name for p in layout.checkpoints.glob("step_*"))
        if layout.checkpoints.is_dir()
        else []
    )
    size = sum(
        f.stat().st_size
        for p in files
        for f in ([p] if p.is_file() else p.rglob("*"))
        if f.is_file()
    )
    for path in files:
        shutil.move(str(path), str(target / path.name))
    what = ", ".join(p.name for p in files)
    newest = f" (newest {steps[-1]})" if steps else ""
    return (
        f"fresh start (--resume never): moved the previous run's {what}{newest} to {target}, "
        f"so that nothing resumes it; delete that folder to free {format_bytes(size)}"
    )


def prepare_run_folder(
    config: TrainConfig,
    layout: RunLayout,
    hf_config: Any,
    model_dir: Path,
    *,
    world_size: int = 1,
) -> list[str]:
    """Rank 0, before the run writes anything: lines for the log. Raises ValueError when not
    even one checkpoint fits."""
    from fsdp_utils.checkpoint.sharded import list_checkpoints

    notes = []
    if starts_fresh(config, layout, JobLeg.from_env()):
        moved = set_aside_previous_run(layout)
        if moved:
            notes.append(moved)
    plan = plan_storage(
        config,
        hf_config,
        model_dir,
        existing=len(list_checkpoints(layout.checkpoints)),
        world_size=world_size,
    )
    notes.append(plan.check())
    return notes


def storage_preflight(config: TrainConfig, world_size: int) -> str:
    """The storage line of `--preflight` (before a `--resume never` start moves anything: the
    checkpoints it will set aside are not counted as reusable)."""
    from fsdp_utils.checkpoint.sharded import list_checkpoints
    from fsdp_utils.hub.resolve import load_model_config, resolve_model_dir

    model_dir = resolve_model_dir(config.model, config.revision, config.cache_dir)
    hf_config = load_model_config(model_dir)

    layout = RunLayout.of(config.output_dir)
    fresh = starts_fresh(config, layout, JobLeg.from_env())
    existing = 0 if fresh else len(list_checkpoints(layout.checkpoints))
    try:
        plan = plan_storage(config, hf_config, model_dir, existing=existing, world_size=world_size)
    except Exception as err:  # as with the memory plan: a model we cannot build is not a verdict
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return (
            f"storage check skipped: the model could not be built from its config "
            f"({type(err).__name__}: {first[:300]}); training will say more if it fails"
        )
    return plan.check()
