"""Multi-node training for real: a 2-node Slurm on this machine (slurm/local/up.sh --nodes 2).

node1 and node2 each run their slurmd in their own network, UTS and mount namespace: own
address and host name, a private /tmp, the rest of the file system shared. The main jobs ask
for 2 emulated GPUs per node, so `slurm/finetune.sh` starts one torchrun per node and 2 CPU
processes (gloo) under each: world size 4 across two "machines" that talk over a bridge. The
node-local and submitit checks use 1 process per node, which shows the same at half the cost.

Runs and caches live in the cluster's shared scratch folder (on a real cluster: /scratch or
/projects), never in /tmp, which is node-local here as there. All runs use a constant learning
rate without warmup, so runs of any `--max_training_steps` follow the same trajectory, and
every loss is compared with one single-process reference run at the same total batch.

Cost: one shared cluster for the module; five short jobs (one of them in two legs) and the
reference run, which overlaps the first job.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fsdp_utils.checkpoint.sharded import list_checkpoints, read_checkpoint
from fsdp_utils.slurm.local_cluster import acquire, release
from fsdp_utils.slurm.local_daemons import DEFAULT_MULTI_STATE_DIR, LocalClusterError
from fsdp_utils.slurm.local_multinode import (
    default_multi_cluster,
    is_up,
    leftovers,
    node_pids,
)
from tests import local_slurm as slurm_fixture
from tests.local_slurm import LocalSlurm
from tests.train_helpers import finetune_command, prepare_in_this_process

multinode_slurm = slurm_fixture.multinode_slurm  # the module fixture, under its own name

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
FAKE_BIN = Path(__file__).parent / "fake_bin"
GPU_REPORT = REPO / "monitoring" / "gpu_report.py"
RESOURCES = ("--gpus-per-node=2", "--cpus-per-task=2", "--mem=4G")
TRAIN = (
    "--dataset_include", "",
    "--max_seq_length", "128",
    "--eval_examples", "16",
    "--eval_every", "0",
    "--precision", "fp32",
    "--lr_schedule", "constant",
    "--warmup_steps", "0",
    "--learning_rate", "3e-3",
    "--total_batch_size", "8",
    "--batch_size_per_device", "2",
    "--save_every_minutes", "0",
)  # fmt: skip
REFERENCE_STEPS = 30
# The same total batch split 4 ways instead of 1: sums in another order, fp32 rounding only.
LOSS_TOLERANCE = 1e-5


def test_two_node_cluster_comes_up_and_leaves_nothing() -> None:
    """Each node has its own host name and address, resolvable from the others (never
    loopback), its GPUs, and a private /tmp, while the scratch folder is shared; another size
    is refused while it runs; down leaves no namespace, link, mount or daemon behind. Runs
    first, before the module's cluster."""
    cluster = default_multi_cluster(DEFAULT_MULTI_STATE_DIR, nodes=2)
    lease = acquire(cluster)
    try:
        env = cluster.env()
        mark = f"fsdp-mark-{uuid.uuid4().hex[:8]}"
        shared = cluster.scratch_dir / mark
        shared.mkdir()
        script = (
            f'touch /tmp/{mark}-$(hostname) {shared}/$(hostname); sleep 1; echo "$(hostname) '
            f'$(getent hosts $(hostname) | cut -d" " -f1) $(getent hosts node1 node2 | wc -l) '
            f'gpus=$CUDA_VISIBLE_DEVICES tmp=$(ls /tmp | grep -c {mark}) shared=$(ls {shared} | wc -l)"'
        )
        out = subprocess.run(
            ["srun", "-N2", "--ntasks-per-node=1", "--gpus-per-node=2", "bash", "-c", script],
            env=env, capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        shutil.rmtree(shared)
        # One size at a time; asking for another is refused and leaves this one running.
        with pytest.raises(LocalClusterError, match="is up with 2 nodes; bring it down first"):
            acquire(default_multi_cluster(DEFAULT_MULTI_STATE_DIR, nodes=3))
        assert is_up(cluster)
    finally:
        stopped = release(cluster, lease)
    assert sorted(out.split("\n")[:2]) == [
        "node1 192.168.213.11 2 gpus=0,1 tmp=1 shared=2",
        "node2 192.168.213.12 2 gpus=0,1 tmp=1 shared=2",
    ], out
    assert not list(Path("/tmp").glob(f"{mark}*"))  # written in the nodes' own /tmp only
    if not stopped:
        pytest.skip("another session still uses the 2-node cluster: cannot check teardown")
    assert leftovers(cluster) == []


@dataclass(frozen=True)
class Shared:
    """This module's folder in the cluster's shared scratch: assets, HF_HOME, runs, logs."""

    root: Path

    @property
    def model(self) -> Path:
        return self.root / "assets" / "model"

    @property
    def data(self) -> Path:
        return self.root / "assets" / "data"

    @property
    def hf_home(self) -> Path:
        return self.root / "hf"


@pytest.fixture(scope="module")
def shared(multinode_slurm: LocalSlurm, tiny_assets: dict[str, Path]) -> Iterator[Shared]:
    cluster = multinode_slurm.cluster
    root = cluster.scratch_dir / f"pytest-{os.getpid()}-{uuid.uuid4().hex[:6]}"  # type: ignore[union-attr]
    shutil.copytree(tiny_assets["model"], root / "assets" / "model")
    shutil.copytree(tiny_assets["data"], root / "assets" / "data")
    yield Shared(root)
    shutil.rmtree(root, ignore_errors=True)


class Reference:
    """Losses of one process (no Slurm) at the same total batch: 2 per pass x 4 accumulation.
    It runs in the background from the first test that asks for it: the cluster jobs leave
    the CPUs idle at times (scheduling, requeue hold), and the reference fills them."""

    def __init__(self, shared: Shared) -> None:
        self.output_dir = shared.root / "reference"
        args = [
            "--model", str(shared.model), "--dataset", str(shared.data),
            "--output_dir", str(self.output_dir), *TRAIN,
            "--max_training_steps", str(REFERENCE_STEPS), "--no_final_save",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(shared.hf_home)}
        self.process = subprocess.Popen(
            finetune_command(1, args), cwd=REPO, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self._losses: list[float] | None = None

    @property
    def losses(self) -> list[float]:
        if self._losses is None:
            output, _ = self.process.communicate(timeout=600)
            assert self.process.returncode == 0, output[-3000:]
            self._losses = [loss for _, loss in sorted(losses_by_step(self.output_dir).items())]
        return self._losses


@pytest.fixture(scope="module")
def reference(shared: Shared) -> Iterator[Reference]:
    ref = Reference(shared)
    yield ref
    if ref.process.poll() is None:
        ref.process.kill()
        ref.process.wait()


def job_env(shared: Shared, **overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{FAKE_BIN}{os.pathsep}{env['PATH']}"
    env["SETUP"] = f"source {REPO / '.venv' / 'bin' / 'activate'}"
    env["HF_HOME"] = str(shared.hf_home)
    env["MODEL"], env["DATASET"] = str(shared.model), str(shared.data)
    env["GPU_MEMORY"] = "off"  # the preflight's memory plan is the one-node tests' business
    env["GPU_SAMPLE_INTERVAL"] = "0"
    env.update(overrides)
    return env


def submit(slurm: LocalSlurm, env: dict[str, str], log: Path, *args: str, nodes: int = 2) -> str:
    """sbatch slurm/finetune.sh; `args`: sbatch options, then "--", then trainer arguments."""
    split = args.index("--") if "--" in args else len(args)
    return slurm.sbatch(
        f"--nodes={nodes}", *RESOURCES, f"--output={log}", *args[:split],
        "slurm/finetune.sh", *TRAIN, *args[split + 1 :], cwd=REPO, env=env,
    )  # fmt: skip


def prepare_data(shared: Shared) -> None:
    """The jobs' data prepared before the job, as docs/slurm.md has a user do
    (`slurm/prepare.sh`), into the cache the jobs read (their HF_HOME's). A job whose time limit
    is seconds away then meets it after its first step however loaded the machine: preparing
    inside the job, beside two CPU-bound processes, took longer than the 3 s the time-limit test
    leaves, and the trainer rightly stopped during the preparation."""
    cache = shared.hf_home / "fsdp_utils" / "prepared"
    prepare_in_this_process(shared.model, shared.data, ("--data_cache_dir", str(cache), *TRAIN))


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """The last logged loss of every step (a step repeated after a crash has the same loss)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "train":
            out[int(record["step"])] = float(record["loss"])
    return out


def assert_same_losses(run_dir: Path, reference: Reference, steps: int) -> None:
    losses = losses_by_step(run_dir)
    assert sorted(losses) == list(range(1, steps + 1)), losses
    expected = reference.losses
    for step, loss in losses.items():
        assert loss == pytest.approx(expected[step - 1], rel=LOSS_TOLERANCE, abs=0), (
            step,
            losses,
            expected[:steps],
        )


def gpu_report(job: str, *args: str, env: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, str(GPU_REPORT), job, "--json", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def hosts_measured(report: dict[str, Any]) -> list[set[str]]:
    return [{gpu["host"] for gpu in m["gpus"]} for m in report["measurements"]]


def test_time_limit_across_two_nodes_requeues_and_matches_one_process(
    multinode_slurm: LocalSlurm, shared: Shared, reference: Reference
) -> None:
    """2 nodes x 2 processes, full sharding, a 3-minute job with a margin of all but 3 s of
    it, the data prepared before the job (`prepare_data`): the trainer sees the time limit
    coming after step 1 (Slurm's USR1 comes 2 minutes later, after a start however slow),
    every rank of both nodes saves, the job requeues and finishes from the checkpoint; the
    losses are the single process's. Afterwards gpu_report finds both nodes' sampler files. No
    rendezvous-shutdown warning at the end."""
    run_dir, log = shared.root / "timelimit", shared.root / "timelimit.out"
    prepare_data(shared)
    env = job_env(shared, OUTPUT_DIR=str(run_dir), GPU_SAMPLE_INTERVAL="5")
    job = submit(
        multinode_slurm, env, log, "--time=3", "--signal=B:USR1@20", "--",
        "--max_training_steps", "6", "--time_limit_margin_minutes", "2.95",
    )  # fmt: skip
    multinode_slurm.wait_for_requeue(job, log, timeout=240, then_minutes=10)
    info = multinode_slurm.wait(job, timeout=240)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), text
    assert "launch: 2 node(s) x 2 process(es)" in text and "world size 4" in text
    assert "data: using prepared data in" in text and "data: preparing" not in text
    # The trainer saw the end coming (or, on a slow machine, Slurm's USR1 came first and the
    # script made the stop file): both are the time-limit path.
    assert re.search(r"stopping at step 1: (time limit|stop file)", text), text
    assert "requeueing to resume" in text
    # Leg 2 skips the preflight that leg 1 passed with the same 4 processes on 2 nodes.
    assert text.count("preflight OK") == 1
    assert f"preflight: passed in an earlier leg of job {job} (4 process(es) on 2 node(s)" in text
    assert "checkpoint: resumed from step 1 (" in text and "saved on 4 process(es))" in text
    # Every rank of both nodes wrote its shard of the time-limit checkpoint.
    saved = read_checkpoint(run_dir / "checkpoints" / "step_00000001")
    assert saved.meta["world_size"] == 4
    assert sorted(p.name for p in saved.path.glob("*.distcp")) == [
        f"__{rank}_0.distcp" for rank in range(4)
    ]
    assert_same_losses(run_dir, reference, steps=6)
    assert "failed to shutdown the rendezvous" not in text
    # Finished job: both nodes' sampler files, found from the job's log.
    report = gpu_report(job, env=job_env(shared))
    assert report["job"]["state"] == "COMPLETED"
    assert hosts_measured(report) == [{"node1", "node2"}]
    assert sorted(p.name for p in (run_dir / "gpu_samples").glob("*.csv")) == [
        "node1.csv",
        "node2.csv",
    ]


def test_node_dies_job_ends_and_resumes_on_one_node(
    multinode_slurm: LocalSlurm, shared: Shared, reference: Reference
) -> None:
    """--sharding hybrid (shard within a node, replicate across): while it trains, one
    `srun --overlap` step of gpu_report measures both nodes; then node2's training processes
    are killed. The job ends within seconds, the log names node2 and what happened and the
    checkpoint to resume from; that checkpoint (written by 2 nodes) is intact and the same
    command resumes from it on 1 node. All losses are the single process's."""
    run_dir, log = shared.root / "nodedies", shared.root / "nodedies.out"
    env = job_env(shared, OUTPUT_DIR=str(run_dir))
    hybrid = ("--sharding", "hybrid", "--save_every_steps", "1", "--keep_last", "3")
    job = submit(
        multinode_slurm, env, log, "--time=10", "--", *hybrid, "--max_training_steps", "200"
    )
    deadline = time.monotonic() + 180
    while not (run_dir / "metrics.jsonl").exists() or max(losses_by_step(run_dir), default=0) < 2:
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        assert multinode_slurm.job_info(job).get("JobState") in ("PENDING", "RUNNING")
        time.sleep(0.5)

    calls = shared.root / "nvidia-smi-calls.jsonl"
    live = gpu_report(
        job,
        "--samples",
        "2",
        "--interval",
        "0.5",
        env=job_env(shared, FAKE_NVIDIA_SMI_LOG=str(calls)),
    )
    assert live["job"]["state"] == "RUNNING" and hosts_measured(live)[0] == {"node1", "node2"}
    records = [json.loads(line) for line in calls.read_text().splitlines()]
    assert {r["host"] for r in records} == {"node1", "node2"}
    steps = {(r["SLURM_JOB_ID"], r["SLURM_STEP_ID"]) for r in records}
    assert len(steps) == 1 and next(iter(steps))[1] not in (None, "batch"), steps  # one step

    cluster = multinode_slurm.cluster
    victims = [
        pid
        for pid in node_pids(cluster, "node2")  # type: ignore[arg-type]
        if Path(f"/proc/{pid}/comm").read_text().strip() not in ("slurmd", "slurmstepd")
    ]
    assert victims, "nothing of the job runs on node2"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    info = multinode_slurm.wait(job, timeout=120)
    ended_after = time.monotonic() - killed
    text = log.read_text()
    assert info["JobState"] == "FAILED", text
    assert ended_after < 60, f"the job took {ended_after:.0f} s to end after node2 died"
    assert "srun: error: node2: task 1: Killed" in text
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    read_checkpoint(newest.path)  # complete and intact (sizes checked)
    assert newest.meta["world_size"] == 4
    assert re.search(
        r"first failure: node2 \(task 1\) was killed \(SIGKILL.*\); srun then stopped node1\. "
        rf"Newest complete checkpoint: step {newest.step} \({re.escape(str(newest.path))}\)\. "
        r"Resubmit the same command",
        text,
    ), text[-3000:]

    # Resubmitted on one node (2 processes): resumes from the 2-node checkpoint.
    steps_total = newest.step + 2
    assert steps_total <= REFERENCE_STEPS, newest.step
    log2 = shared.root / "nodedies-resumed.out"
    job2 = submit(
        multinode_slurm, env, log2, "--time=10", "--", *hybrid,
        "--max_training_steps", str(steps_total), nodes=1,
    )  # fmt: skip
    info2 = multinode_slurm.wait(job2, timeout=240)
    text2 = log2.read_text()
    assert (info2["JobState"], info2["ExitCode"]) == ("COMPLETED", "0:0"), text2
    assert "launch: 1 node(s) x 2 process(es)" in text2
    assert (
        f"checkpoint: resumed from step {newest.step} ({newest.path}, saved on 4 process(es))"
        in text2
    )
    assert_same_losses(run_dir, reference, steps=steps_total)


def test_node_local_run_folder_and_cache_are_refused(
    multinode_slurm: LocalSlurm, shared: Shared
) -> None:
    """A run folder and HF_HOME (hence the data cache) in /tmp, which is node-local: refused
    before any data is prepared or step taken, naming both paths, the blind node and the fix,
    with no rank left waiting. One process per node is enough to show it (and costs half)."""
    local = Path("/tmp") / f"fsdp-nodelocal-{uuid.uuid4().hex[:8]}"
    log = shared.root / "nodelocal.out"
    env = job_env(shared, OUTPUT_DIR=str(local / "run"), HF_HOME=str(local / "hf"))
    job = submit(
        multinode_slurm, env, log, "--time=10", "--gpus-per-node=1", "--",
        "--max_training_steps", "4",
    )  # fmt: skip
    info = multinode_slurm.wait(job, timeout=180)
    text = " ".join(log.read_text().split())
    assert info["JobState"] == "FAILED", text
    assert (
        f"Node-local path: the run folder (--output_dir) {local}/run is not shared between the "
        "nodes: node2 (rank 1) cannot see a file rank 0 wrote there on node1; the data cache "
        f"(--data_cache_dir; default HF_HOME/fsdp_utils/prepared) {local}/hf/fsdp_utils/prepared "
        "is not shared between the nodes: node2 (rank 1)"
    ) in text
    assert "put them on shared project or scratch storage" in text
    assert "data: preparing" not in text and "step 1/" not in text
    assert not local.exists()  # it only ever existed in node1's own /tmp


def test_submitit_two_nodes(
    multinode_slurm: LocalSlurm, shared: Shared, reference: Reference
) -> None:
    """`slurm/submit.py --nodes 2`: one task (training process) per GPU, here 1 per node, with
    MASTER_ADDR the first node: the same losses."""
    run_dir = shared.root / "submitit"
    result = subprocess.run(
        [
            sys.executable, "slurm/submit.py", "--nodes", "2", "--gpus-per-node", "1",
            "--cpus-per-gpu", "1", "--mem-gb", "4", "--time", "10", "--gpu-memory", "off",
            "--log-dir", str(shared.root / "submitit-logs"), "--",
            "--model", str(shared.model), "--dataset", str(shared.data),
            "--output_dir", str(run_dir), *TRAIN, "--max_training_steps", "4",
        ],
        cwd=REPO, env=job_env(shared), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    match = re.search(r"submitted job (\d+) to Slurm: 2 node\(s\) x 1 task\(s\)", result.stdout)
    assert match, result.stdout
    info = multinode_slurm.wait(match.group(1), timeout=240)
    logs = "\n".join(
        p.read_text() for p in sorted((shared.root / "submitit-logs").rglob("*_log.out"))
    )
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), logs
    assert "world: 2 process(es) on 2 node(s)" in logs
    assert {m.group(1) for m in re.finditer(r"hostname=(node\d), local_rank", logs)} == {
        "node1",
        "node2",
    }
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    assert_same_losses(run_dir, reference, steps=4)
