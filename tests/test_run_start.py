"""How a run starts: `--resume never` sets the previous run aside, a requeued leg resumes its
own job's checkpoint. Units (no training); the end-to-end checks are in test_checkpoint.py,
test_slurm_finetune.py and test_slurm_submitit.py. The storage check is in test_storage.py,
the choice between finishing in this job and requeueing in test_timelimit.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp_utils.checkpoint.sharded import MARKER, Checkpointer, CheckpointError
from fsdp_utils.config.job import JobLeg
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.run.start import SET_ASIDE_PREFIX, set_aside_previous_run, starts_fresh


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


def test_resume_auto_with_nothing_to_resume_starts_over_apart(tmp_path: Path, monkeypatch) -> None:
    """An earlier run trained here and stopped before its first save (a crash, a second Ctrl-C):
    `--resume auto` starts at step 0, says so, and sets the earlier records aside instead of
    appending the new steps to them. A leg that stopped before its first step is continued."""
    from fsdp_utils.parallel.distributed import DistEnv
    from fsdp_utils.run.start import start_run

    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SUBMITIT_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
    layout = RunLayout.of(tmp_path / "run")
    layout.root.mkdir()
    config = TrainConfig(output_dir=str(layout.root), cache_dir=str(tmp_path / "hub"),
                         data_cache_dir=str(tmp_path / "data"))  # fmt: skip
    earlier = '{"kind": "start", "step": 0}\n{"kind": "train", "step": 1, "loss": 6.2}\n'
    layout.metrics.write_text('{"kind": "stopping", "step": 0}\n')  # stopped before step 1
    assert start_run(config, env) == [] and layout.metrics.is_file()
    layout.metrics.write_text(earlier)
    layout.status.write_text('{"status": "aborted"}\n')
    (note,) = start_run(config, env)
    assert note.startswith("starting over at step 0: no checkpoint in") and "metrics.jsonl" in note
    aside = next(layout.root.glob(f"{SET_ASIDE_PREFIX}*"))
    assert (aside / "metrics.jsonl").read_text() == earlier and (aside / "status.json").is_file()
    assert not layout.metrics.exists() and not layout.status.exists()
    # A checkpoint to resume, or another --resume, is no start over.
    layout.metrics.write_text(earlier)
    _checkpoint(layout.checkpoints, 1)
    assert start_run(config, env) == []
    assert start_run(config.replace(resume=str(layout.checkpoints / "step_00000001")), env) == []
    assert layout.metrics.read_text() == earlier


def test_a_cpu_run_nothing_configured_computes_with_the_idle_cpus(monkeypatch) -> None:
    """One process on a busy CPU (no torchrun, no Slurm plan, no OMP_NUM_THREADS): the CPUs
    that are idle, at least 1, never more than torch chose; said in the log's line."""
    from fsdp_utils.parallel.distributed import DistEnv
    from fsdp_utils.run import host_threads

    cpu = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(host_threads, "usable_cpus", lambda: 4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        monkeypatch.setattr(host_threads.os, "getloadavg", lambda: (2.6, 2.0, 1.0))
        line = host_threads.choose_cpu_threads(cpu)
        assert torch.get_num_threads() == 1 and line is not None
        assert "1 compute thread(s) instead of torch's 4" in line and "load average of 2.6" in line
        torch.set_num_threads(4)
        monkeypatch.setattr(host_threads.os, "getloadavg", lambda: (0.2, 0.2, 0.2))
        assert host_threads.choose_cpu_threads(cpu) is None and torch.get_num_threads() == 4
        monkeypatch.setattr(host_threads.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
        monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's choice
        assert host_threads.choose_cpu_threads(cpu) is None and torch.get_num_threads() == 4
        monkeypatch.delenv("OMP_NUM_THREADS")
        gpu = DistEnv(0, 0, 1, 1, torch.device("cuda"), "nccl")
        assert host_threads.choose_cpu_threads(gpu) is None and torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)
