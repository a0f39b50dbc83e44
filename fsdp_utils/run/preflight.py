"""`chess_finetune.py --preflight`: everything that can be checked before the expensive part.

The sbatch script runs it on the job's first node before torchrun starts: config, batch
arithmetic for the job's world size, model and data in the offline cache, sequence length, and,
where the GPU's memory is known, the memory planner's verdict. A failure ends the job within
seconds (the plan takes ~10 s for a 7B model) with the fix in the log. Only the planner's "does
not fit" is a failure: a planner that cannot plan the run or crashes is a warning, and the job
goes on.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from fsdp_utils.chess_eval.evaluator import EngineSettings
from fsdp_utils.config.batch import BatchPlan, plan_batch
from fsdp_utils.config.seq_length import fit_seq_length
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.hub.resolve import ResolvedAssets, describe_dataset_files, resolve_assets
from fsdp_utils.lm_harness.training import check_eval_tasks
from fsdp_utils.methods.registry import method_class
from fsdp_utils.metrics.trackers import check_trackers
from fsdp_utils.model.attention import check_attn_implementation
from fsdp_utils.model.float8 import check_float8_device
from fsdp_utils.model.freeze import check_freeze_layers
from fsdp_utils.model.liger import check_liger_kernels
from fsdp_utils.model.lora import check_target_modules
from fsdp_utils.model.qlora import shard_group_size
from fsdp_utils.model.weights import check_not_quantized
from fsdp_utils.parallel.distributed import device_type
from fsdp_utils.parallel.sequence import check_splittable
from fsdp_utils.run.start import storage_preflight
from fsdp_utils.train.router_loss import resolve_coefficient
from fsdp_utils.train.samples import read_sample_prompts

GPU_MEMORY_AUTO, GPU_MEMORY_OFF = "auto", "off"
# A 70B plan takes about a minute on a 2-core node; a planner that hangs must not hold the job.
PLAN_TIMEOUT_S = 600


def detect_gpu_memory() -> list[str] | None:
    """The planner's flags for the smallest GPU of this node, from nvidia-smi: its own
    memory.total (`--gpu_memory 95830MiB`) and its name (`--gpu_kind 'NVIDIA H100 NVL'`, the kind
    --auto times); None without GPUs. (nvidia-smi rather than torch.cuda: no CUDA context.)"""
    from fsdp_utils.plan.hardware import MIB, Gpu, planner_flags

    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    gpus = []
    for line in result.stdout.splitlines():
        name, _, mib = line.rpartition(",")
        if mib.strip().isdigit():
            gpus.append((int(mib), name.strip()))
    if result.returncode != 0 or not gpus:
        return None
    smallest, name = min(gpus)
    return planner_flags(Gpu(name, smallest * MIB))


class CheckedRun(NamedTuple):
    """What `check_run` found: the config as the run uses it (the model's context decides a
    default --max_seq_length), its batch plan, its assets, and lines for the log."""

    config: TrainConfig
    plan: BatchPlan
    assets: ResolvedAssets
    notes: list[str]


def run_device_type(config: TrainConfig, *, run_host: bool = True) -> str | None:
    """The device kind the run's device checks (--float8, --liger_kernels, an --sdpa_backend
    kernel, flash or flex attention) are made for: "cuda" where this machine has a GPU, "cpu"
    for --device cpu, or --device auto on the run's own host (the trainer; the sbatch
    preflight on the job's first node). None where the run's GPUs are elsewhere: --device
    cuda with none visible here, or --device auto on the login node (`run_host` False:
    slurm/submit.py's preflight). Then the checks that need the GPU wait for the trainer's
    start, which makes them on the GPU node (`check_run` again, `run_host` True)."""
    if config.device == "cpu" or torch.cuda.is_available():
        return device_type(config.device)
    if config.device == "cuda" or not run_host:
        return None
    return "cpu"


def check_run(config: TrainConfig, world_size: int, *, run_host: bool = True) -> CheckedRun:
    """Trackers, the training method, batch arithmetic, the model and data in the offline
    cache, the sequence length against the model's context (a default one fitted to it), the
    attention implementation, what sequence parallelism splits, LoRA's targets and adapter,
    the frozen layers. The trainer's process calls it once and passes what it found down;
    `--preflight` runs the same checks (`run_host`: see `run_device_type`)."""
    check_trackers(config)
    # registered in this process (fsdp_utils.methods.registry), and its own needs met
    method_class(config.method).preflight(config)
    plan_batch(config, world_size)  # the arithmetic's mistakes first, as before the model's
    assets = resolve_assets(config)
    hf_config = assets.model_config
    config, note = fit_seq_length(config, hf_config)
    plan = plan_batch(config, world_size)
    check_not_quantized(hf_config, assets.model_dir)
    kind = run_device_type(config, run_host=run_host)
    check_attn_implementation(hf_config, config, device_type=kind)
    check_liger_kernels(hf_config, config, device_type=kind)
    check_float8_device(config, kind)
    check_splittable(
        hf_config, config.sequence_parallel, attn_implementation=config.attn_implementation,
        max_seq_length=config.seq_length, world_size=world_size,
    )  # fmt: skip
    resolve_coefficient(config, hf_config)  # --router_aux_loss_coef on a model with routers
    if config.lora:  # a wrong target or adapter (or a 4-bit base FSDP2 cannot split) fails
        # here, before any data work; --sharding hybrid's split is known once on the nodes
        shards = None if config.sharding == "hybrid" else shard_group_size(config, world_size, 1)
        check_target_modules(hf_config, config, shards=shards)
    if config.freeze_layers:
        check_freeze_layers(config.freeze_layers, hf_config.get_text_config().num_hidden_layers)
    if config.sample_prompts:  # a missing file or a bad line fails before the queue
        read_sample_prompts(config.sample_prompts)
    if config.eval_tasks:  # the benchmarks' data, before hours of training
        check_eval_tasks(config, assets.model_dir)
    if config.chess_eval_every:  # no engine for --chess_engine on, or a PATH that is none: exit 2
        EngineSettings.from_config(config)
    notes = [note] if note else []
    device_options = (
        config.float8 != "none" or config.liger_kernels or config.sdpa_backend != "auto"
        or config.attn_implementation in ("flash_attention_2", "flex_attention")
    )  # fmt: skip
    if kind is None and device_options:
        notes.append(
            "device checks: this machine has no GPU, so what needs the run's GPU (float8's "
            "compute capability, liger's and SDPA's kernels) is checked again by the trainer "
            "at its start on the GPU node"
        )
    return CheckedRun(config, plan, assets, notes)


def check_chess_engine(config: TrainConfig) -> str | None:
    """The preflight's line on the chess evaluation's engine judge (None: no chess eval). The
    engine and the ladder's opponents are started once: the version is printed, and a binary
    that is not a UCI engine, or a rung it refuses, fails here."""
    if not config.chess_eval_every:
        return None
    settings, note = EngineSettings.from_config(config)
    if settings is None:
        return f"chess eval: {note}"
    version = settings.check()
    return f"chess eval: {note} ({version})"


def check_basics(config: TrainConfig, world_size: int) -> str:
    """Batch arithmetic, offline assets, sequence length: no weights, no process group."""
    return _basics_line(check_run(config, world_size))


def _basics_line(checked: CheckedRun) -> str:
    config, plan, assets = checked.config, checked.plan, checked.assets
    if config.dataset_module is not None:  # its rows come when the data is prepared
        data = f"rows from --dataset_module {config.dataset_module}"
    else:
        data = describe_dataset_files(
            list(assets.dataset_files), config.dataset_include, config.dataset
        )
    line = f"preflight OK: {plan.describe()}; model {assets.model_dir}; data {data}"
    return "\n".join([line, *checked.notes])


def check_memory(config: TrainConfig, nodes: int, world_size: int, gpu_flags: list[str]) -> str:
    """Run the memory planner (in a child process: run/speed.py's `run_planner`). Raises ValueError with the
    plan when the run does not fit; any other planner failure is a warning (`read_plan`)."""
    if world_size % nodes:
        raise ValueError(f"--world_size {world_size} is not a multiple of --nodes {nodes}.")
    from fsdp_utils.run.speed import auto_file, planner_command, run_planner

    with tempfile.TemporaryDirectory() as tmp:
        config_file = Path(tmp) / "config.json"
        config_file.write_text(config.to_json())
        flags = [*gpu_flags, "--no_fixes"]
        if config.auto:  # the choice, made here once for every leg (fsdp_utils/run/speed.py)
            choice = auto_file(config)
            choice.parent.mkdir(parents=True, exist_ok=True)
            flags += ["--auto", "--save_json", str(choice)]
        command = planner_command(config_file, nodes, world_size // nodes, flags)
        try:
            result = run_planner(command, timeout=PLAN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return _skipped(f"the planner did not finish in {PLAN_TIMEOUT_S} s")
    rerun = (
        f"python chess_finetune.py --plan --nodes {nodes} --gpus_per_node "
        f"{world_size // nodes} {shlex.join(gpu_flags)} <your training flags>"
    )
    return read_plan(result.returncode, result.stdout, result.stderr, rerun=rerun)


def read_plan(returncode: int, stdout: str, stderr: str, *, rerun: str) -> str:
    """The preflight's line from the planner's exit status and output.

    Only a real "does not fit" (exit 1 with its verdict: an interpreter that dies on an
    uncaught exception exits 1 too) stops the job. A run the planner cannot plan (2), a crash
    (3, with its traceback), a killed planner or anything else only skips the plan: a failing
    planner must not cost a job that may well fit.
    """
    # Imported here: a training process that never reads a plan need not import the planner.
    from fsdp_utils.plan.cli import EXIT_CANNOT_PLAN, EXIT_CRASHED, EXIT_DOES_NOT_FIT, EXIT_FITS

    verdict = next((line for line in stdout.splitlines() if line.startswith("verdict:")), "")
    verdict = verdict.removeprefix("verdict: ")
    chosen = next((line for line in stdout.splitlines() if line.startswith("chosen:")), "")
    if returncode == EXIT_FITS and chosen:  # --auto: the choice the run reads back
        return f"auto: {chosen} (the run folder's auto.json; the run applies it)\n{stdout.strip()}"
    if returncode == EXIT_FITS:
        return f"memory plan: {verdict or 'fits'}"
    if returncode == EXIT_DOES_NOT_FIT and verdict.startswith("DOES NOT FIT"):
        raise ValueError(
            f"The run does not fit in GPU memory:\n{stdout.strip()}\n"
            f"For the cheapest changes that make it fit, run on the login node:\n  {rerun}"
        )
    error = _error_paragraph(stderr)
    if returncode == EXIT_CANNOT_PLAN:
        return _skipped(f"the planner cannot plan this run: {error}")
    if returncode == EXIT_CRASHED:
        tb = stderr[: stderr.rfind("error:")].strip() if "error:" in stderr else stderr.strip()
        exception = tb.splitlines()[-1].strip() if tb else error
        title = "the planner's traceback (a bug in fsdp_utils.plan: please report it)"
        return _skipped(f"the planner crashed ({exception})", details=tb, title=title)
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (often: out of host memory)" if name == "SIGKILL" else ""
        return _skipped(f"the planner was killed by {name}{hint}", details=stderr)
    return _skipped(f"the planner exited with status {returncode}", details=stderr or stdout)


def _error_paragraph(stderr: str) -> str:
    """The planner's last `error: ...` paragraph (else its last line), on one line."""
    text = stderr.strip()
    if "error:" in text:
        text = text[text.rfind("error:") + len("error:") :]
    else:
        text = text.splitlines()[-1] if text else "no message"
    return " ".join(text.split())


def _skipped(reason: str, *, details: str = "", title: str = "the planner's output") -> str:
    """A warning, not a failure: training goes on without a plan. `details` (a traceback)
    follows it in the job's log, indented, so that it can be reported."""
    line = f"memory plan skipped: {reason}; GPU_MEMORY=off skips it"
    if details.strip():
        line += f"\n  {title}:\n" + "\n".join(
            f"    {text}" for text in details.strip().splitlines()
        )
    return line


def preflight(
    config: TrainConfig,
    world_size: int,
    nodes: int = 1,
    gpu_memory: str = GPU_MEMORY_AUTO,
    *,
    run_host: bool = True,
) -> str:
    """All checks; returns what was checked, raises ValueError with the fix otherwise. The
    storage check comes last: a run that does not fit in memory fails first. `run_host`
    False: this is the login node, not the run's first node (`run_device_type`)."""
    checked = check_run(config, world_size, run_host=run_host)
    config, assets = checked.config, checked.assets
    lines = [_basics_line(checked)]
    engine = check_chess_engine(config)
    if engine:
        lines.append(engine)
    if not config.no_fsdp and gpu_memory != GPU_MEMORY_OFF:
        given = ["--gpu_memory", gpu_memory]
        memory = detect_gpu_memory() if gpu_memory == GPU_MEMORY_AUTO else given
        if memory is None:
            lines.append(
                "memory plan: skipped (no GPU on this node; --gpu_memory 80GiB plans anyway)"
            )
        else:
            lines.append(check_memory(config, nodes, world_size, memory))
    lines.append(storage_preflight(config, assets, world_size))
    return "\n".join(lines)
