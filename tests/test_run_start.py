"""How a run starts and ends its legs: `--resume never` sets the previous run aside, a requeued
leg resumes its own job's checkpoint, the storage check, and the choice between finishing in
this job and requeueing. Units (no training); the end-to-end checks are in test_checkpoint.py,
test_slurm_finetune.py and test_slurm_submitit.py."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_utils.checkpoint.sharded import MARKER, Checkpointer, CheckpointError
from fsdp_utils.checkpoint.storage import CheckpointSize, StoragePlan, checkpoint_size, plan_storage
from fsdp_utils.config.job import JobLeg
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.hub.resolve import load_model_config
from fsdp_utils.model.build import build_meta_model
from fsdp_utils.model.transforms import transform_model
from fsdp_utils.run.start import SET_ASIDE_PREFIX, set_aside_previous_run, starts_fresh
from fsdp_utils.train.timelimit import RemainingWork, choose_leg_end, remaining_work

CODELLAMA_7B = Path(__file__).parent / "fixtures" / "configs" / "codellama-7b"


def _checkpoint(root: Path, step: int, job: JobLeg | None = None, identity=None) -> Path:
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x" * 10)
    meta = {"step": step, "identity": identity or {}, "files": {"__0_0.distcp": 10}}
    if job is not None:
        meta["job"] = job.to_dict()
    (path / MARKER).write_text(json.dumps(meta))
    return path


def _resume(root: Path, resume: str, job: JobLeg) -> tuple[int | None, list[str]]:
    notes: list[str] = []
    checkpointer = Checkpointer(
        root, TrainConfig(resume=resume), {}, True, torch.device("cpu"), job=job
    )
    info = checkpointer.to_resume(notes.append)
    return (info.step if info else None), notes


def test_job_leg_from_the_launcher_or_slurm() -> None:
    assert JobLeg.from_env({}) == JobLeg(None, 0)
    slurm = JobLeg.from_env({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2"})
    assert slurm == JobLeg("77", 2) and slurm.requeued
    # submitit's local executor has no restart counter: the launcher says it.
    launcher = {"FSDP_UTILS_JOB_ID": "4012", "FSDP_UTILS_RESTART_COUNT": "1", "SLURM_JOB_ID": "9"}
    assert JobLeg.from_env(launcher) == JobLeg("4012", 1)
    assert not JobLeg("77", 0).requeued and not JobLeg(None, 3).requeued


@pytest.mark.parametrize("resume", ["never", "auto", "PATH"])
def test_a_requeued_leg_resumes_its_own_newest_checkpoint(tmp_path: Path, resume: str) -> None:
    """Whatever --resume said at submission, leg 2 of job 77 continues job 77: not from
    scratch (never), not from the given checkpoint again (PATH), not from another job's save."""
    root = tmp_path / "checkpoints"
    elsewhere = _checkpoint(tmp_path / "other", 100, JobLeg("5", 0))
    _checkpoint(root, 30, JobLeg("77", 0))
    _checkpoint(root, 60, JobLeg("77", 1))
    _checkpoint(root, 90, JobLeg("76", 0))  # e.g. a job that shared the folder: not ours
    choice = str(elsewhere) if resume == "PATH" else resume
    step, notes = _resume(root, choice, JobLeg("77", 2))
    assert step == 60
    assert (resume == "auto") == (not notes)
    if notes:
        assert f"resuming this job's newest checkpoint {root / 'step_00000060'}" in notes[0]
        assert f"not --resume {choice} again" in notes[0]


def test_the_first_leg_and_a_new_job_follow_resume(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    elsewhere = _checkpoint(tmp_path / "other", 100, JobLeg("5", 0))
    _checkpoint(root, 30, JobLeg("77", 0))
    assert _resume(root, "never", JobLeg("77", 0)) == (None, [])  # not requeued
    assert _resume(root, "never", JobLeg("78", 1))[0] is None  # requeued, but no own save yet
    assert _resume(root, str(elsewhere), JobLeg("78", 1))[0] == 100
    assert _resume(root, "auto", JobLeg(None, 0))[0] == 30
    # An own checkpoint of another run's identity is still refused, with the differences.
    _checkpoint(root, 40, JobLeg("79", 0), identity={"model": "a"})
    with pytest.raises(CheckpointError, match="model: checkpoint 'a', now None"):
        _resume(root, "never", JobLeg("79", 1))


def test_resume_never_sets_the_previous_run_aside(tmp_path: Path) -> None:
    layout = RunLayout.of(tmp_path / "run")
    old = _checkpoint(layout.checkpoints, 5000, JobLeg("1", 0))
    layout.final_model.mkdir()
    (layout.final_model / "model.safetensors").write_bytes(b"w" * 1000)
    layout.metrics.write_text('{"kind": "train", "step": 5000}\n')
    layout.gpu_samples.mkdir()  # the job's own, not the run's: stays
    (layout.tensorboard / "events.out.tfevents.1").parent.mkdir()
    (layout.tensorboard / "events.out.tfevents.1").write_bytes(b"e")
    (layout.wandb / "run_id").parent.mkdir()
    (layout.wandb / "run_id").write_text("abc")
    config = TrainConfig(resume="never", output_dir=str(layout.root))
    assert starts_fresh(config, layout, JobLeg("2", 0))
    assert not starts_fresh(config.replace(resume="auto"), layout, JobLeg("2", 0))
    # A requeued leg that already saved is not a new start.
    _checkpoint(layout.checkpoints, 3, JobLeg("2", 0))
    assert not starts_fresh(config, layout, JobLeg("2", 1))
    (layout.checkpoints / "step_00000003" / MARKER).unlink()

    note = set_aside_previous_run(layout, now=0)
    aside = next(layout.root.glob(f"{SET_ASIDE_PREFIX}*"))
    assert (aside / "checkpoints" / old.name / MARKER).is_file()
    assert (aside / "final" / "model.safetensors").is_file() and (aside / "metrics.jsonl").is_file()
    assert not layout.checkpoints.exists() and not layout.metrics.exists()
    # The old run's tracker logs go too: a new W&B run must not resume the old run's id.
    assert (aside / "tensorboard").is_dir() and (aside / "wandb" / "run_id").is_file()
    assert not layout.tensorboard.exists() and not layout.wandb.exists()
    assert layout.gpu_samples.is_dir()
    assert note is not None and str(aside) in note and "step_00005000" in note
    assert "nothing resumes it" in note
    # Nothing to move in a fresh folder; a second fresh start in the same second gets its own.
    assert set_aside_previous_run(layout, now=0) is None
    layout.metrics.write_text("{}\n")
    set_aside_previous_run(layout, now=0)
    assert len(list(layout.root.glob(f"{SET_ASIDE_PREFIX}*"))) == 2


def test_checkpoint_size_is_derived_from_what_it_holds() -> None:
    """CodeLlama-7B: fp32 master weights 4 B + AdamW's two states 8 B per parameter (the issue's
    "about 80 GB"); bf16-true halves both; SGD without momentum has no state."""
    from transformers import AutoModelForCausalLM

    hf_config = load_model_config(CODELLAMA_7B)
    with torch.device("meta"):
        n = AutoModelForCausalLM.from_config(hf_config).num_parameters()
    totals = {}
    for precision, optimizer, per_param, states in [
        ("bf16-mixed", "adamw", 4, 2),
        ("bf16-true", "adamw", 2, 2),
        ("fp32", "sgd", 4, 0),
    ]:
        config = TrainConfig(precision=precision, optimizer=optimizer)
        size = checkpoint_size(build_meta_model(hf_config, precision), config, CODELLAMA_7B)
        assert size.model_bytes == per_param * n
        assert size.optimizer_bytes == states * per_param * n
        assert 0 < size.other_bytes < 1e-3 * size.total
        totals[precision] = size.total
    assert 80e9 < totals["bf16-mixed"] < 82e9


@functools.cache
def _codellama_size() -> CheckpointSize:
    model = build_meta_model(load_model_config(CODELLAMA_7B), "bf16-mixed")
    return checkpoint_size(model, TrainConfig(), CODELLAMA_7B)


def _plan(free: float, keep_last: int = 2, existing: int = 0) -> StoragePlan:
    size = _codellama_size()
    return StoragePlan(size, keep_last, existing, size.model_bytes, int(free), Path("/home/me"))


def test_storage_check_fails_when_not_one_checkpoint_fits() -> None:
    with pytest.raises(ValueError, match=r"Not even one checkpoint of this run fits") as error:
        _plan(free=50e9).check()
    assert "80.9 GB" in str(error.value) and "--output_dir /scratch/" in str(error.value)
    # One fits, three (keep_last 2 + the one being written) + the final model do not: a warning.
    line = _plan(free=100e9).check()
    assert line.startswith("warning: storage:") and "lower --keep_last" in line
    assert "3 more checkpoint(s)" in line
    assert _plan(free=1e12).check().startswith("storage: a checkpoint is 80.9 GB")
    # Checkpoints of this run already on disk are replaced by pruning, not added to.
    assert _plan(free=1e12, keep_last=2, existing=5).checkpoints_to_write == 1
    assert _plan(free=1e12, keep_last=1, existing=0).checkpoints_to_write == 2


def _work(steps: int, seconds_per_step: float = 1.0) -> RemainingWork:
    return RemainingWork(steps, seconds_per_step, 1, 5.0, 1 if steps else 0, 10.0, True, 20.0)


def test_finish_or_requeue() -> None:
    margin = 120.0
    # The stop came at the last step: final eval and export now, not after another queue wait.
    assert choose_leg_end("stop file", _work(0), None, margin).finish
    assert choose_leg_end("stop_after_steps", _work(0), None, margin).finish
    last = choose_leg_end("time limit", _work(0), 100.0, margin)
    assert last.finish and "fits in the 100 s left before the job ends" in last.why
    assert not choose_leg_end("time limit", _work(0), 30.0, margin).finish  # 1.5 x 25 s > 30 s
    # Before the last step: the rest must end before the trainer's own margin.
    early = choose_leg_end("stop file", _work(100), 300.0, margin)  # 1.5 x 135 s > 180 s
    assert (
        not early.finish and "does not fit in the 180 s left before the 120 s margin" in early.why
    )
    assert choose_leg_end("stop file", _work(50), 300.0, margin).finish  # 1.5 x 85 s <= 180 s
    # At the margin itself nothing but the last step can finish; a step budget is a budget.
    assert not choose_leg_end("time limit", _work(1, 0.01), 119.0, margin).finish
    assert not choose_leg_end("stop_after_steps", _work(1, 0.01), 1e6, margin).finish
    unknown = choose_leg_end("signal", _work(1, 0.01), None, margin)
    assert not unknown.finish and "end time is unknown" in unknown.why


def test_remaining_work_counts_evals_saves_and_the_export() -> None:
    config = TrainConfig(max_training_steps=100, eval_every=30, save_every_steps=25)
    work = remaining_work(
        config, step=40, step_seconds=2.0, save_seconds=3.0, eval_seconds=None, has_eval=True,
        accumulation=4,
    )  # fmt: skip
    assert (work.steps, work.evals, work.saves, work.export) == (60, 3, 3, True)  # 60, 90, end
    assert work.eval_seconds == 2.0 * 20 / 4  # eval_batches 20 at 4 micro-batches per step
    assert work.seconds == 60 * 2.0 + 3 * 10.0 + 3 * 3.0 + 2 * 3.0
    done = remaining_work(
        config.replace(no_final_save=True, eval_every=0), step=100, step_seconds=2.0,
        save_seconds=3.0, eval_seconds=1.0, has_eval=True, accumulation=4,
    )  # fmt: skip
    assert (done.steps, done.evals, done.saves, done.seconds) == (0, 1, 0, 1.0)


def _storage_plan(config: TrainConfig, hf_config: Any) -> StoragePlan:
    """As the Trainer and the preflight plan it: on the transformed meta model."""
    meta = transform_model(build_meta_model(hf_config, config.precision), config)
    return plan_storage(meta.model, config, hf_config, CODELLAMA_7B, existing=0)


def test_a_lora_checkpoint_is_counted_as_adapters_only(tmp_path: Path) -> None:
    """LoRA saves the adapters and their AdamW state, not the frozen base (megabytes for 7B);
    the final folder is the adapters, plus the whole model with --merge."""
    hf_config = load_model_config(CODELLAMA_7B)
    config = TrainConfig(lora=True, output_dir=str(tmp_path / "run"))
    plan = _storage_plan(config, hf_config)
    # r=8 on every linear layer of the 32 blocks: 8 x (in + out) fp32 values per layer.
    h, m = hf_config.hidden_size, hf_config.intermediate_size
    per_block = 4 * 8 * (h + h) + 3 * 8 * (h + m)
    assert plan.size.model_bytes == 4 * hf_config.num_hidden_layers * per_block  # 80 MB
    assert plan.size.optimizer_bytes == 2 * plan.size.model_bytes
    assert plan.final_bytes == plan.size.model_bytes
    merged = _storage_plan(config.replace(merge=True), hf_config)
    # A full fine-tune's final model is written in the source model's dtype (bf16 here).
    full = _storage_plan(config.replace(lora=False), hf_config)
    assert full.final_bytes == full.size.model_bytes // 2  # fp32 master weights, bf16 export
    fp32 = config.replace(lora=False, export_dtype="float32")
    assert _storage_plan(fp32, hf_config).final_bytes == (full.size.model_bytes)
    assert merged.final_bytes > 13e9  # the merged model (7B in bf16) beside the adapters
