"""`python slurm/submit.py`: the same fine-tune through submitit, one task per GPU.

    python slurm/submit.py --nodes 2 --gpus-per-node 4 --time 04:00:00 -- --model ... --total_batch_size 64
    python slurm/submit.py --local --gpus-per-node 2 -- --model demo_assets/model ...
    python slurm/submit.py --sweep batch_size_per_device=1,2,4,8 -- --max_training_steps 20 ...

Each submitit task supervises one training process (`python chess_finetune.py ...` with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): a separate process, so that submitit's signal handler
can wait while the trainer saves.

Time limits and preemption: Slurm sends USR2 `signal_delay_s` before the end; submitit runs the
task's `checkpoint()` on global rank 0 only. A sharded checkpoint needs every rank, so
`checkpoint()` only creates the trainer's stop file: all ranks see it at the next step boundary,
agree, save their shards and exit; rank 0's `checkpoint()` waits for that and returns the same
task, which submitit requeues. The trainer may also stop by itself before the time limit (it
reads the job's end time): rank 0 then requeues the job the same way the sbatch script does.
The run folder is fixed at submission, so the requeued job resumes from its checkpoints; the
task counts its legs and tells the trainer (FSDP_UTILS_JOB_ID, FSDP_UTILS_RESTART_COUNT), so a
requeued leg resumes its own newest checkpoint instead of replaying `--resume never`/PATH. When
the trainer finishes the run instead of stopping (the stop came at the last step, or the rest
fits in the time left), the job ends there: no requeue.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from fsdp_utils.arguments import ArgumentParser
from fsdp_utils.config.job import JOB_ID_ENV, RESTART_COUNT_ENV
from fsdp_utils.hub.offline import OFFLINE_VARIABLES
from fsdp_utils.slurm.launch import decide_after_run, read_status, rendezvous_port, run_paths
from fsdp_utils.slurm.sweep import RunSummary, SweepSpec, format_sweep_table, summarise_run

DEFAULT_TRAIN_SCRIPT = "chess_finetune.py"


class TrainingFailed(RuntimeError):
    """The training process of one task exited with an error."""


class _RunFinished(Exception):
    """Raised by `checkpoint()` (inside submitit's signal handler) when the trainer finished
    the run instead of stopping: unwinds into `__call__`, which returns normally, so submitit
    does not requeue a finished job."""


class PreflightFailed(ValueError):
    """The trainer's preflight rejected the run; `reason` is its message."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"preflight failed, nothing was submitted:\n{reason}")
        self.reason = reason

    @property
    def headline(self) -> str:
        """The message's first clause, short enough for a table cell."""
        first = self.reason.split(". ")[0].split(":")[0].strip()
        return first if len(first) <= 60 else first[:59] + "…"


# --- options -------------------------------------------------------------------------------------


def parse_time_minutes(text: str) -> int:
    """Slurm's --time formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in whole
    minutes, rounded up like Slurm does."""
    try:
        days, _, clock = text.rpartition("-")
        parts = [int(p) for p in clock.split(":")]
        if days:
            hours, minutes, seconds = [*parts, 0, 0][:3]
        elif len(parts) == 3:
            hours, minutes, seconds = parts
        elif len(parts) == 2:
            hours, (minutes, seconds) = 0, parts
        elif len(parts) == 1:
            hours, minutes, seconds = 0, parts[0], 0
        else:
            raise ValueError
        total_seconds = ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds
    except ValueError:
        raise ValueError(
            f"--time {text!r} is not a Slurm time: use MM, HH:MM:SS or D-HH:MM:SS."
        ) from None
    if total_seconds <= 0:
        raise ValueError(f"--time {text!r} must be positive.")
    return -(-total_seconds // 60)


@dataclass(frozen=True)
class SubmitOptions:
    nodes: int = 1
    gpus_per_node: int = 4
    cpus_per_gpu: int = 8
    mem_gb: float = 256
    time: str = "04:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    job_name: str = "chess-finetune"
    setup: tuple[str, ...] = ()
    local: bool = False
    log_dir: Path = Path("logs/submitit")
    signal_delay_s: int = 300
    max_requeues: int = 20
    python: str = sys.executable
    train_script: str = DEFAULT_TRAIN_SCRIPT
    gpu_memory: str = "auto"  # for the memory plan of the preflight

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or self.cpus_per_gpu < 1:
            raise ValueError("--nodes, --gpus-per-node and --cpus-per-gpu must be at least 1.")
        if self.local and self.nodes != 1:
            raise ValueError("--local runs on this machine only: use --nodes 1.")
        parse_time_minutes(self.time)

    @property
    def tasks_per_node(self) -> int:
        """One task (training process) per GPU."""
        return self.gpus_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


def executor_parameters(options: SubmitOptions) -> dict[str, Any]:
    """Parameters for submitit's SlurmExecutor (sbatch options) or LocalExecutor."""
    minutes = parse_time_minutes(options.time)
    if options.local:
        return {
            "timeout_min": minutes,
            "tasks_per_node": options.tasks_per_node,
            "gpus_per_node": options.gpus_per_node,
            "signal_delay_s": options.signal_delay_s,
            "stderr_to_stdout": True,
        }
    exports = " ".join(f"{k}={v}" for k, v in OFFLINE_VARIABLES.items())
    params: dict[str, Any] = {
        "job_name": options.job_name,
        "time": minutes,
        "nodes": options.nodes,
        "ntasks_per_node": options.tasks_per_node,
        "gpus_per_node": options.gpus_per_node,
        "cpus_per_task": options.cpus_per_gpu,
        "mem": f"{options.mem_gb:g}GB",
        "partition": options.partition,
        "account": options.account,
        "qos": options.qos,
        "constraint": options.constraint,
        "signal_delay_s": options.signal_delay_s,
        # Offline before any Python starts, as in slurm/finetune.sh.
        "setup": [*options.setup, f"export {exports}"],
        # Sites with JobRequeue=0 refuse `scontrol requeue` unless the job asked for it.
        "additional_parameters": {"requeue": True},
        # srun in Slurm 22.05 does not inherit --cpus-per-task from the job.
        "srun_args": ["--cpus-per-task", str(options.cpus_per_gpu)],
        "stderr_to_stdout": True,
    }
    return {k: v for k, v in params.items() if v is not None}


def make_executor(options: SubmitOptions) -> Any:
    import submitit

    python = shlex.quote(options.python)
    executor: Any
    if options.local:
        executor = submitit.LocalExecutor(
            options.log_dir, max_num_timeout=options.max_requeues, python=python
        )
    else:  # one log folder per job
        executor = submitit.SlurmExecutor(
            options.log_dir / "%j", max_num_timeout=options.max_requeues, python=python
        )
    executor.update_parameters(**executor_parameters(options))
    return executor


def sbatch_preview(options: SubmitOptions) -> str:
    """The batch script submitit would submit for these options (`--dry-run`)."""
    if options.local:
        raise ValueError("--dry-run shows the Slurm batch script: leave out --local.")
    executor = make_executor(options)
    # submitit's own renderer (private but stable since 2020): exactly what sbatch receives.
    text: str = executor._make_submission_file_text(executor._submitit_command_str, "preview")
    return text


# --- the task that runs on every rank --------------------------------------------------------------


def _supervised_child_setup() -> None:  # pragma: no cover (runs in the child before exec)
    """In the training process, before exec: ignore submitit's preemption signal until the
    trainer installs its own handler (Slurm may deliver it to every process of the step, and
    the default action would kill a trainer that is still starting up), and die with the task
    instead of outliving it."""
    import submitit

    signal.signal(submitit.JobEnvironment._usr_sig(), signal.SIG_IGN)
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


@dataclass
class TrainingTask:
    """One rank of the run; submitit pickles it and calls it once per task."""

    train_script: str
    train_args: tuple[str, ...]
    run_dir: str
    python: str
    max_requeues: int
    save_timeout_s: float
    leg: int = 0  # requeues of this task so far (submitit's local executor does not count them)
    _process: subprocess.Popen[bytes] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def command(self) -> list[str]:
        # --output_dir last: the trainer uses exactly the folder fixed at submission.
        return [self.python, self.train_script, *self.train_args, "--output_dir", self.run_dir]

    @property
    def stop_file(self) -> Path:
        return run_paths(self.command[2:], Path(self.run_dir)).stop_file

    def restarts(self) -> int:
        return max(int(os.environ.get("SLURM_RESTART_COUNT") or 0), self.leg)

    def __call__(self) -> dict[str, Any]:
        import submitit
        from submitit.helpers import TorchDistributedEnvironment

        job = submitit.JobEnvironment()
        # Same port scheme as slurm/finetune.sh: stable across requeues, unlike a free port.
        os.environ.setdefault("MASTER_PORT", str(rendezvous_port(job.job_id)))
        # All GPUs of the node stay visible: the trainer picks cuda:LOCAL_RANK itself.
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        # Which job and which leg: a requeued leg resumes this job's own checkpoints.
        leg = {JOB_ID_ENV: str(job.job_id), RESTART_COUNT_ENV: str(self.restarts())}
        env = {**os.environ, **OFFLINE_VARIABLES, **leg}
        if job.global_rank == 0:  # a stop request of an earlier leg is not for this one
            self.stop_file.unlink(missing_ok=True)
        print(
            f"rank {job.global_rank}/{job.num_tasks} (leg {self.restarts()}): "
            f"{shlex.join(self.command)}",
            flush=True,
        )
        self._process = subprocess.Popen(self.command, env=env, preexec_fn=_supervised_child_setup)
        # Poll rather than Popen.wait(): submitit's signal handler runs in this thread and
        # calls checkpoint(), which must be able to poll the same process.
        try:
            while self._process.poll() is None:
                time.sleep(0.5)
        except _RunFinished as finished:
            print(finished, flush=True)
        exit_code = self._process.returncode
        status = read_status(Path(self.run_dir))
        if job.global_rank == 0:
            self._maybe_requeue(status, exit_code)
        if exit_code != 0:
            raise TrainingFailed(f"rank {job.global_rank}: training exited with code {exit_code}")
        return {"run_dir": self.run_dir, "rank": job.global_rank, "status": status}

    def _maybe_requeue(self, status: dict[str, object] | None, exit_code: int) -> None:
        """The trainer stopped early by itself (the job's end time is near): requeue like
        slurm/finetune.sh does."""
        from submitit.local.local import LOCAL_REQUEUE_RETURN_CODE

        decision = decide_after_run(
            status, exit_code, restarts=self.restarts(), max_requeues=self.max_requeues
        )
        if not decision.requeue:
            return
        print(decision.reason, flush=True)
        if os.environ.get("SUBMITIT_EXECUTOR") == "local":
            # submitit's local controller restarts the tasks from the pickled task: count the leg.
            self._store_next_leg()
            sys.exit(LOCAL_REQUEUE_RETURN_CODE)
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)
        sys.exit(0)  # like submitit's own requeue: no result file for a job that continues

    def checkpoint(self) -> Any:
        """Called by submitit on global rank 0 only, from its USR2 handler. Saving needs every
        rank, so ask the trainer (all ranks) through the stop file and wait for it to finish."""
        from submitit.helpers import DelayedSubmission

        stop_file = self.stop_file
        stop_file.parent.mkdir(parents=True, exist_ok=True)
        print(f"time limit or preemption: asking all ranks to save ({stop_file})", flush=True)
        stop_file.touch()  # the trainer consumes it once it has saved
        deadline = time.monotonic() + self.save_timeout_s
        while self._process is not None and self._process.poll() is None:
            if time.monotonic() > deadline:
                print("the trainer did not finish saving in time: requeueing anyway", flush=True)
                break
            time.sleep(0.5)
        status = read_status(Path(self.run_dir)) or {}
        finished = self._process is not None and self._process.returncode == 0
        if finished and status.get("status") == "completed":
            raise _RunFinished(
                f"the trainer finished the run (step {status.get('step')}) instead of "
                "stopping: not requeueing"
            )
        # A fresh task (without the finished process) resumes from the run folder.
        return DelayedSubmission(dataclasses.replace(self, leg=self.leg + 1))

    def _store_next_leg(self) -> None:
        """Rewrite the job's pickled task with the next leg number, as submitit does with the
        task `checkpoint()` returns."""
        import submitit
        from submitit.core.utils import DelayedSubmission

        path = submitit.JobEnvironment().paths.submitted_pickle
        delayed = DelayedSubmission.load(path)
        delayed.function = dataclasses.replace(self, leg=self.leg + 1)
        delayed.dump(path)


# --- submission ------------------------------------------------------------------------------


def choose_run_dir(options: SubmitOptions, train_args: Sequence[str], now: datetime) -> Path:
    """--output_dir (flag or config file) if given, else runs/<job name>-<date-time>: fixed at
    submission so that requeued jobs find their checkpoints."""
    return run_paths(train_args, Path("runs") / f"{options.job_name}-{now:%Y%m%d-%H%M%S}").run_dir


def make_task(options: SubmitOptions, train_args: Sequence[str], run_dir: Path) -> TrainingTask:
    return TrainingTask(
        train_script=str(Path(options.train_script).resolve()),
        train_args=tuple(train_args),
        run_dir=str(run_dir.resolve()),
        python=options.python,
        max_requeues=options.max_requeues,
        save_timeout_s=max(30.0, options.signal_delay_s - 30.0),
    )


def preflight(options: SubmitOptions, train_args: Sequence[str]) -> None:
    """The trainer's own checks (config, batch arithmetic for the world size, offline assets)
    before anything is queued; a failure raises with the trainer's message."""
    print(_preflight(options, train_args), flush=True)


def preflight_each(
    options: SubmitOptions, arg_lists: Sequence[Sequence[str]]
) -> list[str | PreflightFailed]:
    """`preflight` of each argument list (a sweep's values): what it printed, or its failure,
    in order. Side by side, one per core at most: each is a Python process that imports torch
    (~5 s of CPU), and a sweep of 6 values checked one after another kept its user waiting
    half a minute on the login node before anything was queued."""

    def check(train_args: Sequence[str]) -> str | PreflightFailed:
        try:
            return _preflight(options, train_args)
        except PreflightFailed as error:
            return error

    workers = max(1, min(len(arg_lists), len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(check, arg_lists))


def _preflight(options: SubmitOptions, train_args: Sequence[str]) -> str:
    command = [
        options.python,
        options.train_script,
        "--preflight",
        "--world_size",
        str(options.world_size),
        "--nodes",
        str(options.nodes),
        "--gpu_memory",
        options.gpu_memory,
        # the run goes to the GPU nodes (except --local): what needs their GPU waits for them
        *([] if options.local else ["--login_node"]),
        *train_args,
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **OFFLINE_VARIABLES}
    )
    if result.returncode != 0:
        raise PreflightFailed(result.stderr.strip().removeprefix("error:").strip())
    return result.stdout.strip()


def _job_text(job: Any) -> str:
    try:
        return f"{job.stdout() or ''}\n{job.stderr() or ''}"
    except OSError:
        return ""


def submit(options: SubmitOptions, train_args: Sequence[str], wait: bool) -> int:
    if not Path(options.train_script).is_file():
        raise ValueError(
            f"{options.train_script} not found in {Path.cwd()}: run from the repository root."
        )
    run_dir = choose_run_dir(options, train_args, datetime.now())
    preflight(options, train_args)
    executor = make_executor(options)
    task = make_task(options, train_args, run_dir)
    job = executor.submit(task)
    where = "locally" if options.local else "to Slurm"
    print(
        f"submitted job {job.job_id} {where}: {options.nodes} node(s) x "
        f"{options.tasks_per_node} task(s); run folder {task.run_dir}; "
        f"logs {job.paths.stdout}",
        flush=True,
    )
    if not wait:
        print(f"follow it with: squeue -j {job.job_id}", flush=True)
        return 0
    try:
        job.results()
    except Exception as error:  # submitit re-raises the task's failure with its traceback
        print(f"job {job.job_id} failed: {error}\n{_job_text(job)[-2000:]}", file=sys.stderr)
        return 1
    print(f"job {job.job_id} done: run folder {task.run_dir}", flush=True)
    return 0


def submit_sweep(options: SubmitOptions, spec: SweepSpec, train_args: Sequence[str]) -> int:
    """One job array task per value that passes preflight; waits and prints the table."""
    base = choose_run_dir(options, train_args, datetime.now())
    rejected: dict[str, str] = {}
    runs: list[tuple[str, Path]] = []
    checked = preflight_each(options, [[*train_args, *spec.run_args(v)] for v in spec.values])
    for value, outcome in zip(spec.values, checked, strict=True):
        if isinstance(outcome, PreflightFailed):  # e.g. a batch that does not divide: a row,
            rejected[value] = outcome.headline  # not an abort
        else:
            print(outcome, flush=True)
            runs.append((value, base / spec.run_name(value)))
    jobs = []
    if runs:
        executor = make_executor(options)
        tasks = [make_task(options, [*train_args, *spec.run_args(v)], d) for v, d in runs]
        with executor.batch():
            jobs = [executor.submit(task) for task in tasks]
        print(
            f"submitted sweep over {spec.option} = {', '.join(v for v, _ in runs)}: jobs "
            f"{', '.join(str(j.job_id) for j in jobs)}; run folders under {base}",
            flush=True,
        )
    finished: dict[str, RunSummary] = {}
    for (value, run_dir), job in zip(runs, jobs, strict=True):
        failure = None
        try:
            job.results()
        except Exception as error:  # the row says what went wrong
            failure = f"{error}\n{_job_text(job)}"
        finished[value] = summarise_run(value, run_dir, failure)
    rows = [
        finished.get(value) or RunSummary.not_run(value, f"preflight: {rejected[value]}")
        for value in spec.values
    ]
    print(format_sweep_table(spec.option, rows), flush=True)
    return 0 if any(r.outcome == "completed" for r in rows) else 1


# --- command line -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    defaults = SubmitOptions()
    parser = ArgumentParser(
        prog="python slurm/submit.py",
        description="Submit chess_finetune.py through submitit: one task per GPU, on Slurm or "
        "(--local) on this machine. Arguments after -- go to chess_finetune.py.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--nodes", type=int, default=defaults.nodes)
    add("--gpus-per-node", type=int, default=defaults.gpus_per_node,
        help="GPUs per node = training processes per node (CPU processes without GPUs)")  # fmt: skip
    add("--cpus-per-gpu", type=int, default=defaults.cpus_per_gpu)
    add("--mem-gb", type=float, default=defaults.mem_gb, help="host RAM per node")
    add("--time", default=defaults.time, help="time limit (Slurm format)")
    add("--partition")
    add("--account")
    add("--qos")
    add("--constraint")
    add("--job-name", default=defaults.job_name)
    add("--setup", action="append", default=[],
        help="shell line run before the tasks start, e.g. 'module load cuda' (repeatable)")  # fmt: skip
    add("--local", action="store_true", help="run on this machine with submitit's local executor")
    add("--log-dir", type=Path, default=defaults.log_dir)
    add("--signal-delay-s", type=int, default=defaults.signal_delay_s,
        help="seconds before the time limit at which the run saves and requeues")  # fmt: skip
    add("--max-requeues", type=int, default=defaults.max_requeues)
    add("--train-script", default=defaults.train_script)
    add("--gpu-memory", default=defaults.gpu_memory, metavar="SIZE|GPU",
        help="memory of one GPU of the partition (80GiB, a100-80gb, h100-64gb, ...): the "
        "preflight plans the run's memory before submitting; off: no plan")  # fmt: skip
    add("--sweep", metavar="OPTION=V1,V2,...",
        help="one job per value (a job array), then a table, e.g. batch_size_per_device=1,2,4,8")  # fmt: skip
    add("--wait", action="store_true", help="wait for the job (always with --local or --sweep)")
    add("--dry-run", action="store_true", help="print the batch script and submit nothing")
    add("train_args", nargs=argparse.REMAINDER, help="-- then chess_finetune.py arguments")
    return parser


def options_from_args(args: argparse.Namespace) -> SubmitOptions:
    return SubmitOptions(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        cpus_per_gpu=args.cpus_per_gpu,
        mem_gb=args.mem_gb,
        time=args.time,
        partition=args.partition,
        account=args.account,
        qos=args.qos,
        constraint=args.constraint,
        job_name=args.job_name,
        setup=tuple(args.setup),
        local=args.local,
        log_dir=args.log_dir,
        signal_delay_s=args.signal_delay_s,
        max_requeues=args.max_requeues,
        train_script=args.train_script,
        gpu_memory=args.gpu_memory,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    try:
        options = options_from_args(args)
        if args.dry_run:
            print(sbatch_preview(options), end="")
            return 0
        if args.sweep:
            return submit_sweep(options, SweepSpec.parse(args.sweep), train_args)
        return submit(options, train_args, wait=args.wait or args.local)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
