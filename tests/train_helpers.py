"""Run chess_finetune.py for real, CPU/gloo: forked from the pre-imported server of
tests/prefork.py (1 process, or several as torchrun's workers), or, with `torchrun=True`,
as a plain process (1) or under torchrun (>1) where the launcher itself is the point."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from fsdp_utils.metrics import logger as metrics
from tests.prefork import launch

REPO_ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")


def finetune_command(nproc: int, args: list[str]) -> list[str]:
    script = str(REPO_ROOT / "chess_finetune.py")
    if nproc == 1:
        return [sys.executable, script, *args]
    return [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", script, *args]


def run_finetune(
    nproc: int,
    args: list[str],
    timeout: float = 300,
    env: dict[str, str] | None = None,
    *,
    torchrun: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`chess_finetune.py ARGS` on `nproc` processes, as `subprocess.run(capture_output=True)`
    would give it. Forked by tests/prefork.py (the imports are paid once per pytest process),
    unless `torchrun`: the real `python` or `torchrun` command."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if not torchrun:
        return launch(nproc, "chess_finetune.py", args, env=full_env, timeout=timeout)
    return subprocess.run(
        finetune_command(nproc, args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO_ROOT,
    )


class BackgroundFinetune:
    """`run_finetune(nproc, args)` in a thread, for a test that acts on the run while it goes
    (writes its stop file, kills its processes): forked as run_finetune's are, so the test
    does not pay a torchrun. `ranks()` are the run's processes (the prefork server's
    children)."""

    def __init__(self, nproc: int, args: list[str], timeout: float = 300) -> None:
        self.outcome: subprocess.CompletedProcess[str] | BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(nproc, args, timeout), daemon=True)
        self.thread.start()

    def _run(self, nproc: int, args: list[str], timeout: float) -> None:
        try:
            self.outcome = run_finetune(nproc, args, timeout=timeout)
        except BaseException as error:  # re-raised by result()
            self.outcome = error

    def running(self) -> bool:
        return self.thread.is_alive()

    def ranks(self) -> list[int]:
        from tests import prefork

        server = prefork._servers.get(True)
        return [] if server is None or not self.running() else worker_pids(server.proc.pid)

    def result(self, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise AssertionError(f"the run did not end within {timeout} s")
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        assert self.outcome is not None
        return self.outcome

    def kill(self) -> None:
        """SIGKILL the run's processes (a test's cleanup), and wait for the launch to return."""
        import signal

        for pid in self.ranks():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.thread.join(60)


def run_script(
    nproc: int, script: str, args: list[str], timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """A test's own launcher script (tests/trainer_runs.py, tests/finetune_runs.py, ...), or
    "-m" and a module, on `nproc` processes, forked as torchrun's workers (tests/prefork.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return launch(nproc, script, args, env=env, timeout=timeout, distributed=True)


def run_module(
    module: str, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m MODULE ARGS` as one plain process, forked (tests/prefork.py)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return launch(1, "-m", [module, *args], env=full_env, timeout=timeout)


def prepare_in_this_process(model: Path, dataset: Path, args: tuple[str, ...]) -> None:
    """The run's data, into the cache its job will read (the session's HF_HOME, or the
    `--data_cache_dir` in `args`; keyed by the data options), before a Slurm job that must
    not spend its seconds on it, as slurm/prepare.sh has a user do."""
    from fsdp_utils.config.parse import parse_config
    from fsdp_utils.data.prepare import prepare_dataset

    config, _ = parse_config(["--model", str(model), "--dataset", str(dataset), *args])
    lines: list[str] = []
    prepare_dataset(config, log=lines.append)
    assert any(line.startswith("data: prepared in") for line in lines), lines


def tiny_args(
    assets: dict[str, Path], output_dir: Path, data_cache: Path, **overrides: Any
) -> list[str]:
    """Flags for a few quick fp32 steps on the tiny model; overrides use flag names."""
    options: dict[str, Any] = {
        "model": assets["model"],
        "dataset": assets["data"],
        "dataset_include": "",
        "output_dir": output_dir,
        "data_cache_dir": data_cache,
        "max_seq_length": 64,
        "total_batch_size": 8,
        "batch_size_per_device": 2,
        "max_training_steps": 4,
        "precision": "fp32",
        "learning_rate": 3e-3,
        "eval_every": 0,
        "eval_batches": 2,
        "save_every_minutes": 0,
    }
    options.update(overrides)
    return as_flags(options)


def as_flags(options: dict[str, Any]) -> list[str]:
    """{name: value} as command-line flags: True a bare flag, False and None left out."""
    args: list[str] = []
    for key, value in options.items():
        if value is True:
            args.append(f"--{key}")
        elif value is not False and value is not None:
            args += [f"--{key}", str(value)]
    return args


def run_finetunes(nproc: int, runs: dict[str, list[str]], root: Path) -> dict[str, Any]:
    """Several chess_finetune.py runs in one torchrun (tests/finetune_runs.py), sparing each
    the start of the interpreter, torch and the process group: {name: {"exit_code", "seconds"}}.
    A run that fails shows its exit code (its message is in the output) and the others still
    run; the caller checks the codes it cares about. The whole output (rank 0's logs of every
    run, in order) is kept in ROOT/output.txt for checks of what the runs said."""
    root.mkdir(parents=True, exist_ok=True)
    listed = [{"name": name, "argv": [str(a) for a in argv]} for name, argv in runs.items()]
    (root / "runs.json").write_text(json.dumps(listed))
    result = run_script(
        nproc, "tests/finetune_runs.py", [str(root / "runs.json"), str(root / "results.json")],
        timeout=900,
    )  # fmt: skip
    (root / "output.txt").write_text(result.stdout)
    done = root / "results.json"
    results: dict[str, Any] = json.loads(done.read_text()) if done.exists() else {}
    if len(results) < len(runs):  # a crash, not a run's exit code: show torchrun's output
        check_ok(result)
        raise AssertionError(f"torchrun ended after {len(results)} of {len(runs)} runs")
    for outcome in results.values():
        if outcome["exit_code"] != 0:  # its message is in the output, among the other runs'
            outcome["output_tail"] = f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return results


def bench_module(name: str) -> Any:
    """bench/NAME.py loaded as a module (bench/ holds scripts, not a package), registered in
    sys.modules under NAME: a dataclass looks its module up there."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def worker_pids(parent: int) -> list[int]:
    """The child processes of `parent` (torchrun's workers)."""
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def read_metrics(output_dir: Path, kind: str | None = "train") -> list[dict[str, Any]]:
    """The run's records of one kind (None: every kind), in the order written (the reader of
    fsdp_utils.metrics)."""
    return metrics.read_metrics(output_dir, kind)


def check_ok(result: subprocess.CompletedProcess[str]) -> None:
    if result.returncode != 0:
        # torchrun's own report comes last; the worker's error is usually earlier.
        raise AssertionError(
            f"exit {result.returncode}\n--- stdout ---\n{result.stdout[-3000:]}\n"
            f"--- stderr (head) ---\n{result.stderr[:6000]}\n--- stderr (tail) ---\n"
            f"{result.stderr[-2000:]}"
        )
