"""What `slurm/finetune.sh` works out inside a job, as pure functions with a small command line.

    eval "$(python -m fsdp_utils.slurm.launch plan -- <chess_finetune.py arguments>)"
        sets NNODES, NPROC_PER_NODE, WORLD_SIZE, RDZV_ENDPOINT, RDZV_ID, RUN_DIR, STOP_FILE,
        exports OMP_NUM_THREADS, and prints a one-line summary (or the error, exit 2) on stderr.
    eval "$(python -m fsdp_utils.slurm.launch nodes)"
        the same without a run folder (slurm/evaluate.sh): NNODES, NPROC_PER_NODE,
        WORLD_SIZE, RDZV_ENDPOINT, RDZV_ID and OMP_NUM_THREADS.
    python -m fsdp_utils.slurm.launch after-run <run_dir> <exit code> [--not-started]
        prints `requeue` if the trainer stopped early to save (status.json "interrupted") and the
        job may be requeued, `user-error` if it failed on a user mistake (status.json's
        `user_error`: its paragraph goes last to stderr, and the script ends the job with exit
        code 2, where torchrun's own is 1), else `done`; the reason goes to stderr. --not-started: Slurm's
        signal came before the script started the trainer, which it then never started (the
        leg is one that stopped before its first step, at the step status.json last gave).

Processes per node: one per GPU, found in SLURM_GPUS_ON_NODE, CUDA_VISIBLE_DEVICES or
`nvidia-smi -L` (in that order); `NPROC_PER_NODE` overrides; no GPU at all means one CPU process
(gloo). Multi-node jobs rendezvous (torchrun's c10d) on the first node of SLURM_JOB_NODELIST, on a
port derived from the job id so jobs sharing a node do not collide; the rendezvous id is the
job id. The run folder is stable across requeues (it is named by the job id), so a requeued job
resumes from its own checkpoints. Run folder and stop file are read from the TrainConfig the
trainer builds from the same arguments (`parse_config`, --config file included), never re-parsed
here, so the USR1 trap touches the file the trainer watches.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fsdp_utils.arguments import ArgumentParser
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig

# Below Linux's ephemeral range (32768-60999) so an outgoing connection never holds our port,
# and away from Slurm's own (6817-6819) and the local cluster's (16817-16818).
RDZV_PORT_BASE = 20000
RDZV_PORT_SPAN = 10000
DEFAULT_MAX_REQUEUES = 20

Resolver = Callable[[str], list[str]]


@dataclass(frozen=True)
class GpuCount:
    count: int
    source: str  # where the number came from, for the log


@dataclass(frozen=True)
class LaunchPlan:
    nnodes: int
    nproc_per_node: int
    nproc_source: str
    rdzv_host: str
    rdzv_port: int
    rdzv_id: str
    run_dir: Path | None  # None: a job that writes no run folder (slurm/evaluate.sh)
    stop_file: Path | None
    omp_num_threads: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def rdzv_endpoint(self) -> str:
        return f"{self.rdzv_host}:{self.rdzv_port}"

    def shell_assignments(self) -> str:
        """Lines for `eval` in bash, every value quoted. Only OMP_NUM_THREADS is exported: the
        others are the script's own and must not leak into the trainer's environment (torchrun
        sets WORLD_SIZE for its workers)."""
        values = {
            "NNODES": self.nnodes,
            "NPROC_PER_NODE": self.nproc_per_node,
            "WORLD_SIZE": self.world_size,
            "RDZV_ENDPOINT": self.rdzv_endpoint,
            "RDZV_ID": self.rdzv_id,
            "RUN_DIR": self.run_dir,
            "STOP_FILE": self.stop_file,
        }
        lines = [f"{k}={shlex.quote(str(v))}\n" for k, v in values.items() if v is not None]
        lines.append(f"export OMP_NUM_THREADS={self.omp_num_threads}\n")
        return "".join(lines)

    def describe(self) -> str:
        return (
            f"launch: {self.nnodes} node(s) x {self.nproc_per_node} process(es) "
            f"({self.nproc_source}) = world size {self.world_size}; rendezvous "
            f"{self.rdzv_endpoint} (id {self.rdzv_id}); {self.omp_num_threads} CPU thread(s) "
            f"per process" + (f"; run folder {self.run_dir}" if self.run_dir else "")
        )


# --- pieces -----------------------------------------------------------------------------------


def count_gpus(
    env: Mapping[str, str], nvidia_smi_list: Callable[[], str | None] = lambda: None
) -> GpuCount:
    """GPUs this node gives the job. `nvidia_smi_list` returns the output of `nvidia-smi -L`
    (None if nvidia-smi is missing); it is only called when the environment does not tell."""
    on_node = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if on_node.isdigit():
        return GpuCount(int(on_node), f"SLURM_GPUS_ON_NODE={on_node}")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    # Slurm sets "NoDevFiles" when the job asked for GPUs the node's gres.conf cannot map.
    if visible is not None and visible.strip() not in ("", "NoDevFiles", "-1"):
        devices = [d for d in visible.split(",") if d.strip()]
        return GpuCount(len(devices), f"CUDA_VISIBLE_DEVICES={visible}")
    listing = nvidia_smi_list()
    if listing:
        gpus = [line for line in listing.splitlines() if line.startswith("GPU ")]
        if gpus:
            return GpuCount(len(gpus), "nvidia-smi -L")
    return GpuCount(0, "no GPU")


def processes_per_node(env: Mapping[str, str], gpus: GpuCount) -> tuple[int, str]:
    override = env.get("NPROC_PER_NODE", "").strip()
    if override:
        if not override.isdigit() or int(override) < 1:
            raise ValueError(f"NPROC_PER_NODE must be a positive integer, got {override!r}.")
        return int(override), f"NPROC_PER_NODE={override}"
    if gpus.count:
        return gpus.count, f"one per GPU, {gpus.source}"
    return 1, "no GPU: one CPU process with gloo; set NPROC_PER_NODE for more"


def rendezvous_port(job_id: str) -> int:
    """A port from the job id: stable across requeues, different for neighbouring jobs."""
    digits = "".join(c for c in job_id if c.isdigit()) or "0"
    return RDZV_PORT_BASE + int(digits) % RDZV_PORT_SPAN


def resolve_addresses(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return []
    return sorted({str(info[4][0]) for info in infos})


def check_rendezvous_host(host: str, nnodes: int, resolve: Resolver = resolve_addresses) -> None:
    """Other nodes must reach the head: a loopback address (Debian's /etc/hosts maps the host
    name to 127.0.1.1) would make each node wait for a rendezvous of its own until the timeout."""
    if nnodes == 1:
        return
    addresses = resolve(host)
    if not addresses:
        raise ValueError(
            f"The rendezvous host {host!r} (first node of the job) does not resolve. Set "
            "RDZV_HOST to the head node's address on the cluster network and resubmit."
        )
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise ValueError(
            f"The rendezvous host {host!r} resolves to loopback ({', '.join(addresses)}) on the "
            f"head node, so the other {nnodes - 1} node(s) could not join this multi-node job. "
            "Set RDZV_HOST to the head node's name or address on the cluster network (many "
            "sites have an InfiniBand name such as <node>-ib), or ask your admins to map the "
            "node name to its real address in /etc/hosts."
        )


@dataclass(frozen=True)
class RunPaths:
    """The run folder and stop file the trainer will use, derived from its own TrainConfig."""

    run_dir: Path
    stop_file: Path


def parse_train_args(train_args: Sequence[str]) -> tuple[TrainConfig, set[str]]:
    """The TrainConfig chess_finetune.py will build from these arguments (its own parser:
    defaults < --config file < flags), and the names of the options set explicitly."""
    from fsdp_utils.cli import make_parser
    from fsdp_utils.config.parse import load_config_file, parse_config

    parser = make_parser()
    parser.prog = "chess_finetune.py"  # argparse errors name the script the arguments are for
    config, args = parse_config(list(train_args), parser)
    explicit = set(vars(args))
    if args.config:
        explicit |= set(load_config_file(args.config))
    return config, explicit


def job_run_name(env: Mapping[str, str]) -> str:
    """`<job name>-<job id>`, with `<array job id>_<task id>` for array tasks."""
    name = env.get("SLURM_JOB_NAME", "run").replace("/", "_")
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{name}-{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return f"{name}-{env.get('SLURM_JOB_ID', 'local')}"


def run_paths(train_args: Sequence[str], default_run_dir: Path) -> RunPaths:
    """`output_dir` if given (flag or --config file; finetune.sh turns OUTPUT_DIR into a
    flag), else `default_run_dir`; the stop file as the trainer derives it (`--stop_file`,
    flag or config file, else `<run folder>/STOP`)."""
    config, explicit = parse_train_args(train_args)
    run_dir = Path(config.output_dir) if "output_dir" in explicit else default_run_dir
    return RunPaths(run_dir, RunLayout.of(run_dir).stop_file(config.stop_file))


def plan_launch(
    env: Mapping[str, str],
    hostnames: Sequence[str],
    gpus: GpuCount,
    train_args: Sequence[str] | None,
    resolve: Resolver = resolve_addresses,
) -> LaunchPlan:
    """Everything the sbatch script needs to start one torchrun per node; the run folder and
    stop file too unless `train_args` is None (a job that is no training run)."""
    if not hostnames:
        raise ValueError("The job has no nodes (empty SLURM_JOB_NODELIST?).")
    nnodes = len(hostnames)
    declared = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    if declared and int(declared) != nnodes:
        raise ValueError(f"SLURM_NNODES={declared} but the node list has {nnodes} node(s).")
    nproc, source = processes_per_node(env, gpus)
    if nnodes == 1:
        # The rendezvous is on this very node: loopback is right and needs no DNS.
        host = env.get("RDZV_HOST") or "127.0.0.1"
    else:
        host = env.get("RDZV_HOST") or hostnames[0]
        check_rendezvous_host(host, nnodes, resolve)
    job_id = env.get("SLURM_JOB_ID", "0")
    port = int(env["RDZV_PORT"]) if env.get("RDZV_PORT") else rendezvous_port(job_id)
    # One folder per job, the same after a requeue, unless the arguments name one.
    paths = None if train_args is None else run_paths(train_args, Path("runs") / job_run_name(env))
    cpus = int(env.get("SLURM_CPUS_PER_TASK") or env.get("SLURM_CPUS_ON_NODE") or nproc)
    return LaunchPlan(
        nnodes=nnodes,
        nproc_per_node=nproc,
        nproc_source=source,
        rdzv_host=host,
        rdzv_port=port,
        rdzv_id=job_id,
        run_dir=paths.run_dir if paths else None,
        stop_file=paths.stop_file if paths else None,
        omp_num_threads=int(env.get("OMP_NUM_THREADS") or max(1, cpus // nproc)),
    )


@dataclass(frozen=True)
class AfterRun:
    requeue: bool
    reason: str


def decide_after_run(
    status: Mapping[str, object] | None,
    exit_code: int,
    restarts: int,
    max_requeues: int,
    requeue_allowed: bool = True,
) -> AfterRun:
    """Requeue only a run that saved and stopped early (status "interrupted") and exited
    cleanly; a crash is never requeued (it would crash again), nor a finished run."""
    if status is None:
        return AfterRun(False, f"no status.json: the trainer ended with exit code {exit_code}")
    state, step = status.get("status"), status.get("step")
    if state != "interrupted":
        return AfterRun(False, f"training {state} at step {step} (exit code {exit_code})")
    if exit_code != 0:
        return AfterRun(False, f"training interrupted at step {step} but exited {exit_code}")
    if not requeue_allowed:
        return AfterRun(False, f"interrupted at step {step}; REQUEUE=0, so not requeued")
    if restarts >= max_requeues:
        return AfterRun(
            False,
            f"interrupted at step {step}; already requeued {restarts} times (MAX_REQUEUES="
            f"{max_requeues}). Resubmit with the same OUTPUT_DIR to continue.",
        )
    reason = status.get("reason", "stop requested")
    return AfterRun(True, f"interrupted at step {step} ({reason}): requeueing to resume")


def not_started_status(previous: Mapping[str, object] | None) -> dict[str, object]:
    """The status of a leg whose trainer the script never started (Slurm's signal came while
    the job was starting): interrupted before its first step, at the previous leg's step."""
    step = previous.get("step", 0) if previous is not None else 0
    return {"status": "interrupted", "reason": "signal before the trainer started", "step": step}


def user_error(status: Mapping[str, object] | None) -> str | None:
    """The message of a run that failed on a user mistake (status.json's `user_error`), which
    the job's log should end with: torchrun's and srun's reports come after the trainer's."""
    if status is None or status.get("status") != "failed":
        return None
    error = status.get("user_error")
    return error if isinstance(error, str) and error.strip() else None


# --- the impure edges -------------------------------------------------------------------------


def job_hostnames(env: Mapping[str, str]) -> list[str]:
    """The job's nodes in order. Never guesses: a multi-node job without `scontrol` would
    have every node rendezvous with itself."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return [socket.gethostname().split(".")[0]]  # outside Slurm: this machine
    if "[" not in nodelist:
        return nodelist.split(",")
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise ValueError(
            f"Cannot expand SLURM_JOB_NODELIST={nodelist}: `scontrol` is not on PATH. Add "
            "Slurm's bin folder to PATH in SETUP."
        )
    result = subprocess.run(
        [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True
    )
    if result.returncode != 0 or not result.stdout.split():
        raise ValueError(f"`scontrol show hostnames {nodelist}` failed: {result.stderr.strip()}")
    return result.stdout.split()


def nvidia_smi_list() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    return result.stdout if result.returncode == 0 else None


def read_status(run_dir: Path) -> dict[str, object] | None:
    path = RunLayout.of(run_dir).status
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m fsdp_utils.slurm.launch")
    sub = parser.add_subparsers(dest="command", required=True)
    plan_cmd = sub.add_parser("plan", help="print shell exports for slurm/finetune.sh")
    plan_cmd.add_argument("train_args", nargs=argparse.REMAINDER)
    sub.add_parser("nodes", help="print shell exports for slurm/evaluate.sh (no run folder)")
    after = sub.add_parser("after-run", help="print `requeue`, `user-error` or `done`")
    after.add_argument("run_dir", type=Path)
    after.add_argument("exit_code", type=int)
    after.add_argument("--not-started", action="store_true")
    args = parser.parse_args(argv)
    env = os.environ
    if args.command in ("plan", "nodes"):
        train_args = None
        if args.command == "plan":
            train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
        try:
            gpus = count_gpus(env, nvidia_smi_list)
            plan = plan_launch(env, job_hostnames(env), gpus, train_args)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        print(plan.describe(), file=sys.stderr)
        print(plan.shell_assignments(), end="")
        return 0
    status = read_status(args.run_dir)
    if args.not_started:
        status = not_started_status(status)
    decision = decide_after_run(
        status,
        args.exit_code,
        restarts=int(env.get("SLURM_RESTART_COUNT") or 0),
        max_requeues=int(env.get("MAX_REQUEUES") or DEFAULT_MAX_REQUEUES),
        requeue_allowed=env.get("REQUEUE", "1") not in ("0", "no", "false"),
    )
    print(decision.reason, file=sys.stderr)
    mistake = user_error(status)
    if mistake:  # the trainer's one paragraph, again, as the last thing in the job's log
        print(f"\nerror: {mistake}\n", file=sys.stderr)
    print("requeue" if decision.requeue else "user-error" if mistake else "done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
