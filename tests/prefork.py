"""Real multi-process runs without paying the imports each time: a pre-imported parent forks them.

    from tests.prefork import launch
    result = launch(2, "chess_finetune.py", [flags...])      # as `torchrun --nproc_per_node 2`
    result = launch(1, "-m", ["fsdp_utils.chess_eval", ...])  # as `python -m ...`

Every training process of the suite started by importing torch, torch.distributed's FSDP and
tensor machinery, transformers and this package: ~9 s of CPU per process on the 2-core test
machine (load 5-12; 4-5 s quiet), ~20 s for a `torchrun --nproc_per_node 2` with its agent,
before the first line of the run. Here one server process per pytest process (started on first
use, ended with it) imports them once, without running any computation, and forks each run's
processes from itself: each is a real process with its own rank, process group (gloo, over
TCP on a free port, as torchrun's workers), output and exit code, running the same script or
module as the command line would (`runpy`), with the environment and working folder asked for.
What a fork does not have is torchrun itself: its agent, rendezvous, restarts, its error report
and its handling of signals. Tests whose point those are (the time limit's signals, a rank that
dies, the rendezvous, Slurm) run the real `torchrun`.

Like torchrun, the first process that exits with an error ends the others (SIGTERM, then
SIGKILL after 30 s), so a run whose rank 0 failed does not wait out a collective's timeout; the
result's return code is then 1, as torchrun's (a single process: its own code). The processes'
output goes to one stdout and one stderr file each, appended to in order as torchrun's workers
write to its own.

Fork safety: the server imports only; it runs no torch operation (so no OpenMP thread pool
exists to be forked) and starts no thread. Each child gets a fresh process group id, stdin from
/dev/null, and `torch.set_num_threads` from its OMP_NUM_THREADS (default 1, as torchrun sets for
several processes per node).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
# Imported by the server before it forks anything: what every training run imports.
PREIMPORTS = (
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.modeling_utils",
    "transformers.masking_utils",
    "transformers.models.llama.modeling_llama",
    "fsdp_utils.hub.offline",
    "fsdp_utils.cli",
    "fsdp_utils.run.session",
    "fsdp_utils.trainer.trainer",
    "fsdp_utils.checkpoint.final_model",
    # ... and what a run imported on first use (sys.modules after a full and a LoRA run, less
    # the above): 0.3-0.5 s per process. Not pyarrow: importing it starts jemalloc's background
    # thread, and the server forks only while it has no thread but its own (checked below).
    "peft",
    "fsspec",
    "huggingface_hub.hf_file_system",
    "transformers.models.auto.tokenization_auto",
    "transformers.tokenization_utils_tokenizers",
    "transformers.convert_slow_tokenizer",
    "fsdp_utils.run.host_memory",
)
GRACE_S = 30.0  # torchrun's: a SIGTERM'd process has this long before SIGKILL


# --- the server ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(request: dict[str, Any], rank: int, port: int, out: str, err: str) -> None:
    """In the forked process: become rank `rank` of the run, run it, and exit with its code."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the server's `_on_term`
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        os.setpgid(0, 0)  # its own group: ending it ends what it started (data workers)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        nproc = request["nproc"]
        if nproc > 1 or request.get("distributed"):
            os.environ.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK=str(rank),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                TORCHELASTIC_RESTART_COUNT="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
            )  # fmt: skip
        import runpy

        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
        target, args = request["target"], request["args"]
        try:
            if target == "-m":
                sys.argv = [args[0], *args[1:]]
                runpy.run_module(args[0], run_name="__main__", alter_sys=True)
            else:
                script = str(Path(request["cwd"], target))
                sys.argv = [script, *args]
                sys.path[0] = str(Path(script).parent)
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if isinstance(exit_.code, str):
                print(exit_.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


_running: list[int] = []  # the server's: the processes of the run it has going


def _on_term(signum: int, frame: Any) -> None:
    """The server is ended (its client gave up on a run): the run's processes end with it."""
    _end(_running, signal.SIGKILL)
    os._exit(1)


def _end(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)


def _run(request: dict[str, Any]) -> dict[str, Any]:
    nproc, port = request["nproc"], _free_port()
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_before = used.ru_utime + used.ru_stime
    pids: dict[int, int] = {}
    # Blocked across the fork: a child must not run the server's SIGTERM handler.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _child(request, rank, port, request["stdout"], request["stderr"])
        pids[pid] = rank
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    _running[:] = list(pids)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + request["timeout"]
    terminated_at: float | None = None
    timed_out = False
    while len(codes) < nproc:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            alive = [p for p in pids if pids[p] not in codes]
            if terminated_at is None and now > deadline:
                timed_out = True
                terminated_at = now
                _end(alive, signal.SIGTERM)
            elif terminated_at is not None and now > terminated_at + GRACE_S:
                _end(alive, signal.SIGKILL)
            time.sleep(0.02)
            continue
        if pid not in pids:
            continue
        code = os.waitstatus_to_exitcode(status)
        codes[pids[pid]] = code
        if code != 0 and terminated_at is None:  # as torchrun: one failure ends the others
            terminated_at = time.monotonic()
            _end([p for p in pids if pids[p] not in codes], signal.SIGTERM)
    _end(list(pids), signal.SIGKILL)  # anything a run left behind in its groups
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = used.ru_utime + used.ru_stime - cpu_before
    return {"codes": [codes[r] for r in range(nproc)], "timed_out": timed_out, "cpu": cpu}


def _warm_up() -> None:
    """What every run's first use builds, built once here: transformers' checkpoint conversion
    rules of every architecture (hundreds of regular expressions, built whole on the first
    lookup; the trainer reads them to map a checkpoint's names). A forked run paid it on each
    rank: 1.90 -> 1.15 s for a 2-step run at load 4 (a second run in one process: 0.42 s)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("llama")
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:  # another thread may hold a lock the children would inherit locked
        names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in threads]
        raise RuntimeError(f"the prefork server has threads before forking: {names}")


def serve() -> None:
    """Read one JSON request per line on stdin, answer one JSON line each on stdout."""
    import importlib

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what an import prints must not reach the replies
    sys.path.insert(0, str(REPO_ROOT))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fsdp_utils.hub.offline import enable_offline_mode

    enable_offline_mode()
    signal.signal(signal.SIGTERM, _on_term)
    for name in PREIMPORTS:
        importlib.import_module(name)
    _warm_up()
    # What the imports made stays out of the garbage collector's passes, in the server and in
    # every fork: a pass writes to each object it visits, and each write to a shared page
    # copies it into the child (~400,000 objects).
    gc.freeze()
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        sys.stdout.flush()
        sys.stderr.flush()
        reply = _run(json.loads(line))
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


# --- the client --------------------------------------------------------------------------------


class Server:
    """The server of this pytest process, started on first use. `network=False`: a second
    server in a network namespace of its own with only loopback up (`unshare --net`, as on a
    compute node without internet), for runs whose point is that there is no network."""

    def __init__(self, *, network: bool = True) -> None:
        command = [sys.executable, __file__, "--serve"]
        if not network:
            command = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
                       *command]  # fmt: skip
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert self.proc.stdin is not None and self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"tests/prefork.py did not start (exit {self.proc.wait()})")
        self.lock = threading.Lock()
        atexit.register(self.close)

    def request(self, request: dict[str, Any]) -> dict[str, Any]:
        """One run at a time: a test's threads that launch runs wait for each other."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            try:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
                reply = self.proc.stdout.readline()
            except BaseException:  # pytest-timeout, Ctrl-C: its reply would answer the next
                self.kill()  # request; the next launch starts a new server
                raise
        if not reply:
            raise RuntimeError(f"tests/prefork.py ended (exit {self.proc.wait()})")
        return dict(json.loads(reply))

    def kill(self) -> None:
        """End the server, which ends the run it has going (SIGTERM: `_on_term`)."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# This process's servers, by `network` (False: launch(..., network=False)'s), each started on
# first use and again if it ended.
_servers: dict[bool, Server] = {}
cpu_seconds = 0.0  # the CPU time of every run launched from this process so far


def launch(
    nproc: int,
    target: str,
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path = REPO_ROOT,
    timeout: float = 600,
    distributed: bool = False,
    network: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run `target` (a script path relative to `cwd`, or "-m" and a module as `args[0]`) with
    `args` on `nproc` forked processes; `env` is their whole environment (default: this
    process's). `distributed`: the torchrun variables even for one process. `network=False`:
    forked from a server with no network but loopback (`unshare --net`; needs root). The result
    is what `subprocess.run(..., capture_output=True, text=True)` of torchrun would give."""
    server = _servers.get(network)
    if server is None or server.proc.poll() is not None:
        server = _servers[network] = Server(network=network)
    with tempfile.TemporaryDirectory(prefix="prefork-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        request = {
            "nproc": nproc, "target": target, "args": [str(a) for a in args],
            "env": dict(os.environ if env is None else env), "cwd": str(cwd),
            "timeout": timeout, "distributed": distributed,
            "stdout": str(out), "stderr": str(err),
        }  # fmt: skip
        reply = server.request(request)
        stdout = out.read_text() if out.exists() else ""
        stderr = err.read_text() if err.exists() else ""
    global cpu_seconds
    cpu_seconds += reply["cpu"]
    codes = reply["codes"]
    command = ["prefork", f"--nproc_per_node={nproc}", target, *request["args"]]
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    code = codes[0] if nproc == 1 else (0 if not any(codes) else 1)
    return subprocess.CompletedProcess(command, code, stdout, stderr)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
