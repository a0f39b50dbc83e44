"""Knowing when to stop (`fsdp_utils.train.timelimit`): the job's end time as Slurm reports it,
the margin, the step budget, the choice between finishing in this job and requeueing, Ctrl-C
(once: the stop file's stop; twice: the end, at once), and real runs stopped by the time limit,
a signal, the stop file or Ctrl-C under torchrun on all ranks together. (The stop vote's
precedence and its shared all-reduce are in test_step.py.)"""

from __future__ import annotations

import calendar
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fsdp_utils.checkpoint.sharded import read_checkpoint
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.train.timelimit import (
    END_TIME_ENV,
    FIRST_INTERRUPT,
    INTERRUPT,
    INTERRUPT_AFTER_TRAINING,
    MIN_MARGIN_SECONDS,
    SECOND_INTERRUPT,
    RemainingWork,
    StopController,
    _SignalFlag,
    choose_leg_end,
    job_end_time,
    parse_slurm_time,
    remaining_work,
)
from tests.train_helpers import (
    REPO_ROOT,
    BackgroundFinetune,
    check_ok,
    finetune_command,
    read_metrics,
    run_finetune,
    tiny_args,
)

# --- the job's end time ------------------------------------------------------------------------


@pytest.fixture
def madrid(monkeypatch) -> Iterator[None]:
    """The controller's local time zone is not UTC (MareNostrum 5's is Europe/Madrid)."""
    monkeypatch.setenv("TZ", "Europe/Madrid")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_squeue_end_time_is_read_in_the_local_time_zone(madrid):
    # 23:00 in Madrid in November (CET, UTC+1) is 22:00 UTC; squeue ends its line with a newline.
    assert parse_slurm_time("2026-11-21T23:00:00\n") == calendar.timegm((2026, 11, 21, 22, 0, 0))
    for no_limit in ("UNLIMITED", "N/A", "NONE", "Unknown", "", "soon"):
        assert parse_slurm_time(no_limit) is None, no_limit


def _fake_squeue(folder: Path, output: str, status: int = 0) -> Path:
    """A `squeue` that records its arguments and prints `output`."""
    folder.mkdir(exist_ok=True)
    script = folder / "squeue"
    script.write_text(
        f'#!/bin/sh\necho "$@" > {folder / "args"}\nprintf "{output}"\nexit {status}\n'
    )
    script.chmod(0o755)
    return folder


def test_job_end_time_asks_squeue_for_this_job(tmp_path, monkeypatch, madrid):
    fake = _fake_squeue(tmp_path / "bin", "2026-11-21T23:00:00\\n")
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    assert job_end_time({"SLURM_JOB_ID": "4242"}) == calendar.timegm((2026, 11, 21, 22, 0, 0))
    assert (fake / "args").read_text().split() == ["-h", "-j", "4242", "-o", "%e"]
    # The variable (set by slurm/finetune.sh, or by a test) wins; no job, no end time.
    assert job_end_time({"SLURM_JOB_ID": "4242", END_TIME_ENV: "1234.5"}) == 1234.5
    assert job_end_time({}) is None
    _fake_squeue(fake, "slurm_load_jobs error: Invalid job id specified\\n", status=1)
    assert job_end_time({"SLURM_JOB_ID": "4242"}) is None


# --- the stop controller (one process: the vote is its own) ------------------------------------


def _controller(tmp_path: Path, **options) -> StopController:
    settings = {"save_every_steps": 0, "save_every_minutes": 0, "stop_after_steps": None,
                "margin_minutes": None, "is_main": True, **options}  # fmt: skip
    return StopController(tmp_path / "STOP", **settings)


def test_the_time_limit_stops_within_the_margin(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv(END_TIME_ENV, str(time.time() + 100))
    assert _controller(tmp_path, margin_minutes=1).poll(1, 0.1).stop is None  # 100 s > 60 s
    stopping = _controller(tmp_path)  # the default margin is at least 120 s
    assert stopping.margin() == MIN_MARGIN_SECONDS
    assert stopping.end_time_known() and stopping.poll(1, 0.1).stop == "time limit"
    monkeypatch.delenv(END_TIME_ENV)
    unlimited = _controller(tmp_path)
    assert not unlimited.end_time_known() and unlimited.time_left() is None
    assert unlimited.poll(1, 0.1).stop is None


def test_the_margin_grows_with_the_measured_save_and_step_times(tmp_path):
    controller = _controller(tmp_path)
    controller.saved(50.0)
    controller.poll(1, 10.0)
    assert controller.margin() == 2 * 50.0 + 3 * 10.0  # room for a slow save, and the step
    assert _controller(tmp_path, margin_minutes=0.5).margin() == 30.0  # --time_limit_margin_minutes


def test_the_step_time_is_the_median_of_recent_steps_after_the_first(tmp_path):
    controller = _controller(tmp_path)
    for step, seconds in enumerate([100.0, 1.0, 9.0, 2.0], start=1):  # the first warms up
        controller.poll(step, seconds)
    assert controller.typical_step_seconds() == 2.0


def test_step_budget_and_periodic_saves(tmp_path):
    controller = _controller(tmp_path, stop_after_steps=3, save_every_steps=2)
    decisions = [controller.poll(step, 0.1) for step in (11, 12, 13)]
    assert [d.stop for d in decisions] == [None, None, "stop_after_steps"]
    assert [d.save for d in decisions] == [False, True, False]  # every 2 steps of the run's count


def test_finishing_in_this_job_ignores_further_stop_requests(tmp_path, monkeypatch):
    monkeypatch.delenv(END_TIME_ENV, raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    controller = _controller(tmp_path)
    controller.stop_file.touch()
    assert controller.poll(10, 0.1).stop == "stop file"
    work = remaining_work(
        TrainConfig(max_training_steps=10), step=10, step_seconds=0.1, save_seconds=1.0,
        eval_seconds=None, has_eval=False, accumulation=1,
    )  # fmt: skip
    end = controller.leg_end("stop file", work)  # at the last step: finish here
    assert end.finish and "last step" in end.why
    assert not controller.stop_file.exists()  # consumed: the next leg must not stop at once
    controller.stop_file.touch()
    controller.flag.received = signal.SIGUSR1
    assert controller.poll(11, 0.1).stop is None


def test_ctrl_c_stops_as_the_stop_file_does_and_is_never_deferred(tmp_path, monkeypatch):
    monkeypatch.delenv(END_TIME_ENV, raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    before = signal.getsignal(signal.SIGINT)
    controller = _controller(tmp_path)
    try:
        controller.deferred = True  # finishing in this job: the stop file and SIGUSR1 wait
        controller.flag.received = signal.SIGUSR1
        assert controller.poll(1, 0.1).stop is None
        controller.flag.interrupts = 1  # what the SIGINT handler counts
        assert controller.poll(2, 0.1).stop == INTERRUPT
    finally:
        controller.close()
    assert signal.getsignal(signal.SIGINT) == before  # the handler from before the run, again
    # A stop by Ctrl-C before the last step ends the run here whatever time is left.
    assert not choose_leg_end(INTERRUPT, _work(5, 0.01), 1e6, 120.0).finish
    assert choose_leg_end(INTERRUPT, _work(0), None, 120.0).finish  # the last step: finish


def test_ctrl_c_after_the_last_step_skips_the_benchmarks_and_says_so(tmp_path, capfd):
    """After the last step a Ctrl-C keeps the final save (the run's own work) and skips the
    benchmarks: `interrupted` is the ranks' agreed answer (a stop file there is no Ctrl-C), and
    the first Ctrl-C's line says what is left instead of "the next step boundary"."""
    controller = _controller(tmp_path)
    try:
        controller.flag.training_over = True
        controller.stop_file.touch()
        assert not controller.interrupted()
        controller.flag.announce = True
        os.kill(os.getpid(), signal.SIGINT)  # the installed handler: recorded and said, once
        assert controller.flag.interrupts == 1 and controller.interrupted()
    finally:
        controller.close()
    said = capfd.readouterr().err
    assert said == INTERRUPT_AFTER_TRAINING and "without the benchmarks" in said


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_ctrl_c_ends_the_process_at_once_and_says_why(tmp_path, second):
    """In a forked process (the abort ends it): the first Ctrl-C only records and says one
    line; a second, or torchrun's SIGTERM after it (its answer to a second Ctrl-C), records
    the abort and ends the process by that signal, at once."""
    record, first = tmp_path / "aborted", tmp_path / "first"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(write, 2)
            flag = _SignalFlag(announce=True)
            flag.on_abort = lambda: record.write_text("aborted")
            flag.install()
            os.kill(os.getpid(), signal.SIGINT)
            first.write_text(f"{flag.interrupts} {record.exists()}")
            os.kill(os.getpid(), second)
        finally:
            os._exit(3)  # only if the second signal did not end it
    os.close(write)
    _, status = os.waitpid(pid, 0)
    said = os.read(read, 65536).decode()
    os.close(read)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == second, status
    assert first.read_text() == "1 False" and record.read_text() == "aborted"
    assert said == FIRST_INTERRUPT + SECOND_INTERRUPT


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


# --- real runs --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


def _status(out: Path) -> dict:
    return json.loads((out / "status.json").read_text())


def _wait_for_step(out: Path, step: int, running: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (out / "metrics.jsonl").exists() and any(r["step"] >= step for r in read_metrics(out)):
            return
        assert running(), "the run ended before it was stopped"
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached")


def _stopped_by_a_signal(args: list[str], out: Path) -> tuple[int, str, str]:
    """SIGUSR1 to each rank, as `#SBATCH --signal=USR1@...` (no B:) delivers it to torchrun's
    workers (torchrun itself passes none on): its 2 processes forked (tests/prefork.py)."""
    run = BackgroundFinetune(2, args)
    try:
        _wait_for_step(out, 2, run.running)
        ranks = run.ranks()
        assert len(ranks) == 2
        for pid in ranks:
            os.kill(pid, signal.SIGUSR1)
        result = run.result(timeout=120)
    finally:
        run.kill()
    return result.returncode, result.stdout, result.stderr


def _stopped_by_the_stop_file(args: list[str], out: Path) -> tuple[int, str, str]:
    """The stop file is the run's own business: its 2 processes forked (tests/prefork.py)."""
    run = BackgroundFinetune(2, args)
    try:
        _wait_for_step(out, 2, run.running)
        (out / "STOP").touch()  # what slurm/finetune.sh does when the batch shell gets the signal
        result = run.result(timeout=120)
    finally:
        run.kill()
    return result.returncode, result.stdout, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("how", ["signal", "stop file"])
def test_signal_or_stop_file_saves_and_exits_cleanly_on_all_ranks(
    how, tmp_path, tiny_assets, data_cache
):
    out = tmp_path / "run"
    args = tiny_args(
        tiny_assets, out, data_cache, max_training_steps=100000, save_every_steps=0, log_every=1
    )
    stop = _stopped_by_a_signal if how == "signal" else _stopped_by_the_stop_file
    returncode, stdout, stderr = stop(args, out)
    assert returncode == 0, stderr[-3000:]
    status = _status(out)
    assert status["status"] == "interrupted" and status["reason"] == how
    saved = read_checkpoint(out / "checkpoints" / f"step_{status['step']:08d}")
    assert saved.meta["world_size"] == 2 and len(list(saved.path.glob("*.distcp"))) == 2
    assert f"stopping at step {status['step']}: {how}" in stdout


@pytest.mark.slow
def test_time_limit_stops_with_a_margin(tmp_path, tiny_assets, data_cache):
    out = tmp_path / "run"
    # The job "ends" in 100 s; the default margin is at least 120 s: stop after the first step.
    env = {END_TIME_ENV: str(time.time() + 100)}
    result = run_finetune(
        1, tiny_args(tiny_assets, out, data_cache, max_training_steps=50), env=env
    )
    check_ok(result)
    assert _status(out)["reason"] == "time limit" and _status(out)["step"] == 1
    assert "time limit: the job ends at" in result.stdout


@pytest.mark.slow
def test_ctrl_c_under_torchrun_saves_and_says_one_line_without_tracebacks(
    tmp_path, tiny_assets, data_cache
):
    """Ctrl-C at a terminal: SIGINT to the foreground process group, which under torchrun is
    torchrun's alone (its workers have sessions of their own); torchrun passes it on to each
    worker. Every rank stops as the stop file would have them, saves, exits; torchrun ends
    with its own report of the signal (exit 1: docs/training.md)."""
    out = tmp_path / "run"
    args = tiny_args(
        tiny_assets, out, data_cache, max_training_steps=100000, save_every_steps=0, log_every=1
    )
    proc = subprocess.Popen(
        finetune_command(2, args), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for_step(out, 2, lambda: proc.poll() is None)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    status = _status(out)
    assert status["status"] == "interrupted" and status["reason"] == INTERRUPT, stderr[-3000:]
    saved = read_checkpoint(out / "checkpoints" / f"step_{status['step']:08d}")
    assert saved.meta["world_size"] == 2 and len(list(saved.path.glob("*.distcp"))) == 2
    assert stderr.count(FIRST_INTERRUPT.strip()) == 1  # rank 0's line, once
    assert f"stopping at step {status['step']}: Ctrl-C; the checkpoint is saved" in stdout
    assert "KeyboardInterrupt" not in stderr and "[rank" not in stderr, stderr[-3000:]
    assert proc.returncode == 1  # torchrun's SignalException
