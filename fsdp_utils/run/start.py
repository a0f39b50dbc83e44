"""What happens to the run folder before a run starts (before anything is written).

- Every node must see the run folder and the caches (`fsdp_utils.run.shared_paths`), and the
  folder must be writable.
- `--resume never` starts a run that can never be confused with the previous one in the same
  folder: the previous run's checkpoints, final model, metrics, config, status and tracker logs
  are moved to `<output_dir>/previous-<date-time>/`. Left in place, an old `step_00005000` would outlive
  every new save (pruning keeps the highest steps) and the next `--resume auto` (a requeued
  leg!) would silently continue the abandoned run. Moving rather than refusing: the user asked
  to start over, a refusal would cost another wait in the queue, and a rename within the folder
  is instant and deletes nothing. A requeued leg of the same job is not a new start: it resumes
  its own checkpoint (`fsdp_utils.checkpoint.sharded.requeued_leg_checkpoint`).
- `--resume auto` (the default) with no checkpoint to resume, in a folder where an earlier run
  trained (its metrics.jsonl has steps: a run stopped before its first save, by a crash or a
  second Ctrl-C), starts over at step 0: its files are set aside the same way and the log says
  so, so that metrics.jsonl never holds the abandoned steps mixed with the new ones.
- The storage check (`fsdp_utils.checkpoint.storage`): fail if not even one checkpoint fits on the
  run folder's file system, warn if `--keep_last` + 1 of them do not. The Trainer runs it on the
  meta model it builds anyway; `--preflight` here (`storage_preflight`).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from fsdp_utils.checkpoint.sharded import list_checkpoints, requeued_leg_checkpoint
from fsdp_utils.checkpoint.storage import plan_storage
from fsdp_utils.config.job import JobLeg
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.hub.cache import format_bytes
from fsdp_utils.hub.resolve import ResolvedAssets
from fsdp_utils.model.build import build_meta_model
from fsdp_utils.model.transforms import transform_model
from fsdp_utils.parallel.distributed import DistEnv, on_main_rank
from fsdp_utils.run.shared_paths import check_shared_paths

SET_ASIDE_PREFIX = "previous-"


def starts_fresh(config: TrainConfig, layout: RunLayout, job: JobLeg) -> bool:
    """`--resume never`, unless this is a requeued leg that has a checkpoint of its own."""
    if config.resume != "never":
        return False
    return requeued_leg_checkpoint(layout.checkpoints, job, warn=lambda _: None) is None


def starts_over(config: TrainConfig, layout: RunLayout, job: JobLeg) -> bool:
    """`--resume auto` that finds no checkpoint, where an earlier run logged training steps."""
    if config.resume != "auto" or list_checkpoints(layout.checkpoints):
        return False
    if requeued_leg_checkpoint(layout.checkpoints, job, warn=lambda _: None) is not None:
        return False
    return logged_steps(layout.metrics)


def logged_steps(metrics: Path) -> bool:
    """Whether metrics.jsonl holds a training step (a leg that stopped before its first step
    logged only events: the next leg goes on from there, nothing to set aside)."""
    try:
        with metrics.open() as lines:
            return any('"kind": "train"' in line for line in lines)
    except OSError:
        return False


def previous_run_files(layout: RunLayout) -> list[Path]:
    """What a previous run left that a new one could be confused with (the job's own
    gpu_samples/ and logs/ stay)."""
    candidates = [layout.final_model, layout.metrics, layout.config, layout.status, layout.samples]
    candidates.append(layout.chess_eval)  # the chess evaluation's per-step records
    # Tracker logs too: TensorBoard would draw both runs on one curve, W&B would resume the
    # old run's id.
    candidates += [layout.tensorboard, layout.wandb]
    found = [p for p in candidates if p.exists()]
    if layout.checkpoints.is_dir() and any(layout.checkpoints.iterdir()):
        found.insert(0, layout.checkpoints)
    return found


def set_aside_previous_run(
    layout: RunLayout, now: float | None = None, *, why: str = "fresh start (--resume never)"
) -> str | None:
    """Move the previous run's files to `previous-<date-time>/`; the log line (which starts
    with `why`), or None if the folder held no previous run."""
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
        f"{why}: moved the previous run's {what}{newest} to {target}, so that nothing resumes "
        f"it or mixes with this run; delete that folder to free {format_bytes(size)}"
    )


def check_output_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"The output folder {path} is not writable ({err.strerror}). Choose another "
            "--output_dir, e.g. on project or scratch storage."
        ) from err


def start_run(config: TrainConfig, env: DistEnv) -> list[str]:
    """Collective, before the run writes anything: every node must see the run folder and the
    caches; rank 0 checks the folder is writable and, on a fresh start (`--resume never`), sets
    the previous run aside. Returns lines for the log. A failure on rank 0 ends every rank
    (`on_main_rank`), with the message once, from rank 0."""
    check_shared_paths(config, env)
    layout = RunLayout.of(config.output_dir)

    def prepare_folder() -> list[str]:
        check_output_dir(layout.root)
        job = JobLeg.from_env()
        if starts_fresh(config, layout, job):
            moved = set_aside_previous_run(layout)
            return [moved] if moved else []
        if starts_over(config, layout, job):
            why = (
                f"starting over at step 0: no checkpoint in {layout.checkpoints} to resume, and "
                "an earlier run's metrics.jsonl has training steps"
            )
            moved = set_aside_previous_run(layout, why=why)
            return [moved] if moved else []
        return []

    return on_main_rank(prepare_folder) or []


def storage_preflight(config: TrainConfig, assets: ResolvedAssets, world_size: int) -> str:
    """The storage line of `--preflight` (before a `--resume never` start moves anything: the
    checkpoints it will set aside are not counted as reusable)."""
    layout = RunLayout.of(config.output_dir)
    fresh = starts_fresh(config, layout, JobLeg.from_env())
    existing = 0 if fresh else len(list_checkpoints(layout.checkpoints))
    try:
        meta = transform_model(build_meta_model(assets.model_config, config.precision), config)
        plan = plan_storage(
            meta.model,
            config,
            assets.model_config,
            assets.model_dir,
            existing=existing,
            world_size=world_size,
        )
    except Exception as err:  # as with the memory plan: a model we cannot build is not a verdict
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return (
            f"storage check skipped: the model could not be built from its config "
            f"({type(err).__name__}: {first[:300]}); training will say more if it fails"
        )
    return plan.check()
