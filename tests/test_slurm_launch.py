"""What slurm/finetune.sh computes inside a job: processes per node, rendezvous, run folder,
the requeue decision. Pure functions, plus the command line through real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_utils.hub.offline import OFFLINE_VARIABLES
from fsdp_utils.slurm.launch import (
    RDZV_PORT_BASE,
    RDZV_PORT_SPAN,
    GpuCount,
    check_rendezvous_host,
    count_gpus,
    decide_after_run,
    plan_launch,
    rendezvous_port,
)

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
FINETUNE_SH = REPO / "slurm" / "finetune.sh"


def never_called() -> str | None:
    raise AssertionError("nvidia-smi must not run when the environment tells")


def test_gpu_count_precedence() -> None:
    both = {"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert count_gpus(both, never_called) == GpuCount(4, "SLURM_GPUS_ON_NODE=4")
    assert count_gpus({"CUDA_VISIBLE_DEVICES": "2,3,5"}, never_called).count == 3
    # Slurm writes NoDevFiles when it cannot map the GPUs: fall through to nvidia-smi.
    listing = (FIXTURES / "nvidia_smi_list_a100_mig.txt").read_text()
    gpus = count_gpus({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, lambda: listing)
    assert gpus == GpuCount(1, "nvidia-smi -L")  # one physical GPU, its MIG lines not counted
    assert count_gpus({}, lambda: None) == GpuCount(0, "no GPU")


def test_rendezvous_port_is_stable_and_in_range() -> None:
    ports = {rendezvous_port(str(job)) for job in range(1_234_560, 1_234_600)}
    assert len(ports) == 40  # neighbouring jobs never share a port
    assert all(RDZV_PORT_BASE <= p < RDZV_PORT_BASE + RDZV_PORT_SPAN for p in ports)
    # Every node computes it in its own interpreter (another str hash seed): the same port.
    elsewhere = [
        subprocess.run(
            [sys.executable, "-c", "from fsdp_utils.slurm.launch import rendezvous_port as p; "
             "print(p('1234567'))"],
            capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    ]  # fmt: skip
    assert elsewhere == [str(rendezvous_port("1234567"))] * 2


def test_loopback_head_fails_fast_only_for_multi_node() -> None:
    loopback = {"gpu07": ["127.0.1.1"], "gpu07-ib": ["10.3.0.7"], "lonely": []}

    def resolve(host: str) -> list[str]:
        return loopback[host]

    check_rendezvous_host("gpu07", 1, resolve)  # one node: the rendezvous stays local
    with pytest.raises(ValueError, match=r"resolves to loopback \(127\.0\.1\.1\).*RDZV_HOST"):
        check_rendezvous_host("gpu07", 2, resolve)
    with pytest.raises(ValueError, match="does not resolve"):
        check_rendezvous_host("lonely", 2, resolve)
    check_rendezvous_host("gpu07-ib", 2, resolve)


def slurm_env(**extra: str) -> dict[str, str]:
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "chess-finetune",
        "SLURM_NNODES": "2",
        "SLURM_GPUS_ON_NODE": "4",
        "SLURM_CPUS_PER_TASK": "32",
    }
    env.update(extra)
    return env


def test_multi_node_plan() -> None:
    plan = plan_launch(
        slurm_env(), ["gpu07", "gpu08"], GpuCount(4, "SLURM_GPUS_ON_NODE=4"), [],
        resolve=lambda host: ["10.0.0.7"],
    )  # fmt: skip
    assert (plan.nnodes, plan.nproc_per_node, plan.world_size) == (2, 4, 8)
    assert plan.rdzv_endpoint == f"gpu07:{rendezvous_port('4242')}" and plan.rdzv_id == "4242"
    assert plan.run_dir == Path("runs/chess-finetune-4242")
    assert plan.stop_file == Path("runs/chess-finetune-4242/STOP")
    assert plan.omp_num_threads == 8  # 32 CPUs shared by 4 processes
    with pytest.raises(ValueError, match="SLURM_NNODES=2 but the node list has 1"):
        plan_launch(slurm_env(), ["gpu07"], GpuCount(4, ""), [])


def test_single_node_cpu_plan_and_overrides(tmp_path: Path) -> None:
    env = slurm_env(SLURM_NNODES="1", SLURM_CPUS_PER_TASK="2", NPROC_PER_NODE="2")
    plan = plan_launch(env, ["vm"], GpuCount(0, "no GPU"), [])
    assert plan.rdzv_host == "127.0.0.1"  # no DNS needed for a one-node job
    assert (plan.nproc_per_node, plan.omp_num_threads) == (2, 1)
    with pytest.raises(ValueError, match="NPROC_PER_NODE must be a positive integer"):
        plan_launch({**env, "NPROC_PER_NODE": "two"}, ["vm"], GpuCount(0, ""), [])
    array = {**env, "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "3"}
    assert plan_launch(array, ["vm"], GpuCount(1, ""), []).run_dir == Path(
        "runs/chess-finetune-4240_3"
    )


def test_run_paths_are_the_trainers_own(tmp_path: Path) -> None:
    """Run folder and stop file come from the TrainConfig chess_finetune.py builds from the same
    arguments (defaults < --config file < flags; finetune.sh passes OUTPUT_DIR as a flag before
    the user's own), so the USR1 trap touches the very file the trainer watches."""
    env = slurm_env(SLURM_NNODES="1")

    def paths(*args: str) -> tuple[Path, Path]:
        plan = plan_launch(env, ["vm"], GpuCount(1, ""), list(args))
        return plan.run_dir, plan.stop_file

    config = tmp_path / "run.yaml"
    config.write_text("output_dir: runs/from-config\nstop_file: /tmp/halt-from-config\n")
    assert paths("--config", str(config)) == (
        Path("runs/from-config"),
        Path("/tmp/halt-from-config"),
    )
    flags = ("--config", str(config), "--output_dir=flag", "--stop_file", "/tmp/halt")
    assert paths(*flags) == (Path("flag"), Path("/tmp/halt"))
    # OUTPUT_DIR is a flag put before the user's arguments: theirs win, as for every variable.
    assert paths("--output_dir", "/scratch/x", "--output_dir", "flag")[0] == Path("flag")
    assert paths() == (Path("runs/chess-finetune-4242"), Path("runs/chess-finetune-4242/STOP"))
    config.write_text("output_dir: runs/from-config\n")
    assert paths("--config", str(config))[1] == Path("runs/from-config/STOP")
    # A mistake in the arguments is the trainer's own error, before anything starts.
    config.write_text("stop_fle: /tmp/halt\n")
    with pytest.raises(ValueError, match="did you mean 'stop_file'"):
        paths("--config", str(config))


def test_shell_assignments_survive_bash_eval() -> None:
    """Values with spaces and quotes come through `eval` unchanged; only OMP_NUM_THREADS is
    exported to the trainer's environment."""
    env = slurm_env(SLURM_NNODES="1")
    plan = plan_launch(env, ["vm"], GpuCount(2, ""), ["--output_dir", "runs/it's a run"])
    script = plan.shell_assignments() + 'echo "$RUN_DIR|$WORLD_SIZE"; env | grep -c WORLD_SIZE'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True).stdout
    assert out.splitlines() == ["runs/it's a run|2", "0"]


@pytest.mark.parametrize(
    ("status", "exit_code", "restarts", "requeue", "reason"),
    [
        ({"status": "interrupted", "step": 7}, 0, 0, True, "interrupted at step 7"),
        ({"status": "completed", "step": 20}, 0, 1, False, "completed at step 20"),
        ({"status": "interrupted", "step": 7}, 1, 0, False, "exited 1"),
        ({"status": "interrupted", "step": 7}, 0, 20, False, "already requeued 20 times"),
        (None, 137, 0, False, "no status.json"),
    ],
)
def test_requeue_decision(
    status: dict[str, object] | None, exit_code: int, restarts: int, requeue: bool, reason: str
) -> None:
    decision = decide_after_run(status, exit_code, restarts, max_requeues=20)
    assert decision.requeue is requeue
    assert reason in decision.reason


def run_launch(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_utils.slurm.launch", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": os.environ["PATH"], **env},
    )


def test_command_line(tmp_path: Path) -> None:
    (tmp_path / "status.json").write_text(json.dumps({"status": "interrupted", "step": 3}))
    after = run_launch("after-run", str(tmp_path), "0", env={"SLURM_RESTART_COUNT": "1"})
    assert after.stdout == "requeue\n" and "interrupted at step 3" in after.stderr
    after = run_launch("after-run", str(tmp_path), "0", env={"REQUEUE": "0"})
    assert after.stdout == "done\n" and "REQUEUE=0" in after.stderr
    # Slurm's signal before the trainer started: a leg ended before its first step, at the
    # step the last leg saved (no status.json at all: step 0), requeued within MAX_REQUEUES.
    after = run_launch("after-run", str(tmp_path), "0", "--not-started", env={})
    assert after.stdout == "requeue\n"
    assert "interrupted at step 3 (signal before the trainer started)" in after.stderr
    (tmp_path / "status.json").unlink()
    after = run_launch("after-run", str(tmp_path), "0", "--not-started", env={})
    assert after.stdout == "requeue\n" and "interrupted at step 0" in after.stderr
    after = run_launch(
        "after-run", str(tmp_path), "0", "--not-started", env={"SLURM_RESTART_COUNT": "20"}
    )
    assert after.stdout == "done\n" and "already requeued 20 times" in after.stderr
    multi = slurm_env(SLURM_JOB_NODELIST="localhost,gpu08", RDZV_HOST="localhost")
    plan = run_launch("plan", "--", "--model", "m", env=multi)
    assert plan.returncode == 2 and "error: The rendezvous host 'localhost'" in plan.stderr
    assert plan.stdout == ""


def test_a_user_mistake_is_the_last_thing_after_run_prints(tmp_path: Path) -> None:
    """finetune.sh runs `after-run` last: a run that failed on a user mistake (status.json's
    `user_error`, written by chess_finetune.py) ends the job's log with its paragraph again,
    after srun's and torchrun's reports; a crash or a finished run adds nothing."""
    message = "The dataset has columns ['foo']: expected a `text` text column."
    status = {"status": "failed", "step": 0, "reason": f"ValueError: {message}"}
    (tmp_path / "status.json").write_text(json.dumps({**status, "user_error": message}))
    after = run_launch("after-run", str(tmp_path), "1", env={})
    assert after.stdout == "user-error\n"  # finetune.sh then ends the job with exit code 2
    assert after.stderr.strip().splitlines()[-1] == f"error: {message}"
    (tmp_path / "status.json").write_text(json.dumps(status))  # a crash: no user_error
    crash = run_launch("after-run", str(tmp_path), "1", env={})
    assert "error:" not in crash.stderr and crash.stdout == "done\n"
    text = FINETUNE_SH.read_text()  # the script's end: the decision's exit code
    assert '[ "$decision" != user-error ] || exit_code=2\nexit "$exit_code"' in text


JOB_ENV = REPO / "slurm" / "job_env.sh"


def assert_offline_before_python(script: Path) -> None:
    """`script` sources slurm/job_env.sh, which exports every offline variable, before it first
    runs Python; both parse."""
    shared = JOB_ENV.read_text()
    offline_line = next(line for line in shared.splitlines() if "HF_HUB_OFFLINE=1" in line)
    for name, value in OFFLINE_VARIABLES.items():
        assert f"{name}={value}" in offline_line
    assert '"$PYTHON"' not in shared
    text = script.read_text()
    assert "HF_HUB_OFFLINE" not in text  # one home: the shared file
    assert text.index('source "$job_env"') < text.index('"$PYTHON"')
    for path in (script, JOB_ENV):
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0


def test_finetune_sh_exports_offline_mode_before_python() -> None:
    assert_offline_before_python(FINETUNE_SH)


def test_prepare_sh_exports_offline_mode_before_python() -> None:
    assert_offline_before_python(REPO / "slurm" / "prepare.sh")


def _spooled_copy(tmp_path: Path, name: str) -> Path:
    """The job script as sbatch runs it: a copy in another folder (Slurm's spool)."""
    spool = tmp_path / "spool"
    spool.mkdir()
    copy = spool / "slurm_script"
    copy.write_text((REPO / "slurm" / name).read_text())
    return copy


def test_a_spooled_copy_finds_the_shared_environment_from_the_submit_dir(tmp_path) -> None:
    """sbatch runs a copy of prepare.sh from its spool folder: slurm/job_env.sh is found from
    SLURM_SUBMIT_DIR (not beside the copy), SETUP runs first, and Python starts offline."""
    script = _spooled_copy(tmp_path, "prepare.sh")
    python = tmp_path / "python"  # a stand-in that shows what Python would have been given
    python.write_text(
        '#!/bin/bash\necho "HF_HUB_OFFLINE=$HF_HUB_OFFLINE SETUP_RAN=$SETUP_RAN $*"\n'
    )
    python.chmod(0o755)
    env = {
        "PATH": os.environ["PATH"], "SLURM_SUBMIT_DIR": str(REPO), "PYTHON": str(python),
        "SETUP": "export SETUP_RAN=yes", "NUM_PROC": "3",
    }  # fmt: skip
    result = subprocess.run(
        ["bash", str(script), "--model", "m"], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        "HF_HUB_OFFLINE=1 SETUP_RAN=yes -m fsdp_utils.data --num_proc 3 --model m"
    )
    # Submitted from elsewhere, and no FSDP_UTILS_SLURM_DIR: one paragraph, exit 2
    elsewhere = {**env, "SLURM_SUBMIT_DIR": str(tmp_path)}
    result = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, cwd=tmp_path, env=elsewhere
    )
    assert result.returncode == 2 and result.stdout == ""
    assert (
        result.stderr
        == f"error: {tmp_path}/slurm/job_env.sh not found: submit from the repository root.\n"
    )
    # ... unless FSDP_UTILS_SLURM_DIR says where it is
    pointed = {**elsewhere, "FSDP_UTILS_SLURM_DIR": str(REPO / "slurm")}
    result = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, cwd=tmp_path, env=pointed
    )
    assert result.returncode == 0 and "HF_HUB_OFFLINE=1" in result.stdout
