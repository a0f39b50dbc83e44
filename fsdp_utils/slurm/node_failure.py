"""After a failed training step: which node failed, how, and where to resume from.

    python -m fsdp_utils.slurm.node_failure LOG OFFSET RUN_DIR     # slurm/finetune.sh, on failure

When one node of a multi-node job fails, srun stops the others (--kill-on-bad-exit=1), and the
log fills with their tracebacks and "death signal" warnings, which point at the wrong node. The
first `srun: error: <node>: task <n>: <what>` line after the step started is the cause; this
prints it in one paragraph, with the newest complete checkpoint and the command to resume:

    first failure: node2 (task 1) was killed (SIGKILL: the out-of-memory killer, an
    administrator, or the node going down); srun then stopped node1. Newest complete
    checkpoint: step 3 (runs/x/checkpoints/step_00000003). Resubmit the same command (same
    run folder) to resume from it.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from fsdp_utils.arguments import ArgumentParser

# srun's own report of a task that ended badly, e.g. "srun: error: node2: task 1: Killed" or
# "srun: error: node1: tasks 0-1: Exited with exit code 1".
_TASK_ERROR = re.compile(
    r"^srun: error: (?P<node>[^:\s]+): tasks? (?P<tasks>[\d,\-]+): (?P<what>.+)$"
)
# Slurm noticed that a node stopped answering.
_NODE_FAIL = re.compile(r"^srun: error: Node failure on (?P<node>\S+)")
# A collective ran into the process-group timeout (--collective_timeout_minutes): gloo's and
# NCCL's (ProcessGroupNCCL's watchdog) wording.
_COLLECTIVE_TIMEOUT = re.compile(
    r"gloo/transport/tcp/\S+\] Timed out waiting \d+ms for (?:send|recv) operation"
    r"|Watchdog caught collective operation timeout"
)
COLLECTIVE_TIMEOUT_NOTE = (
    "A collective timed out (--collective_timeout_minutes): a rank stopped answering without "
    "exiting, most likely on another node (frozen, or its network went); the node named first "
    "only noticed it."
)


@dataclass(frozen=True)
class TaskFailure:
    node: str
    tasks: str
    what: str  # as srun printed it

    def explain(self) -> str:
        tasks = f"task{'s' if ',' in self.tasks or '-' in self.tasks else ''} {self.tasks}"
        what = self.what.strip()
        if what == "Killed":
            how = (
                "was killed (SIGKILL: the out-of-memory killer, an administrator, or the node "
                "going down)"
            )
        elif what == "Node failure":
            how = "was lost: Slurm stopped hearing from the node (hardware, network, or a crash)"
        elif what.startswith("Exited with exit code"):
            code = what.rsplit(" ", 1)[-1]
            how = f"exited with code {code} (its training processes failed: see their error above)"
        else:
            how = f"ended: {what}"
        return f"{self.node} ({tasks}) {how}"


def parse_failures(log_text: str) -> list[TaskFailure]:
    """srun's reports of failed tasks, in the order they happened."""
    failures = []
    for line in log_text.splitlines():
        line = line.strip()
        node_fail = _NODE_FAIL.match(line)
        if node_fail:
            failures.append(TaskFailure(node_fail.group("node"), "?", "Node failure"))
            continue
        match = _TASK_ERROR.match(line)
        if match:
            failures.append(
                TaskFailure(match.group("node"), match.group("tasks"), match.group("what"))
            )
    return failures


def collective_timed_out(log_text: str) -> bool:
    return _COLLECTIVE_TIMEOUT.search(log_text) is not None


def describe(
    failures: list[TaskFailure], checkpoint: str | None, *, timed_out: bool = False
) -> str | None:
    """One paragraph for the log, or None if srun reported no failed task."""
    if not failures:
        return None
    first = failures[0]
    others = []
    for failure in failures[1:]:
        if failure.node != first.node and failure.node not in others:
            others.append(failure.node)
    text = f"first failure: {first.explain()}"
    if others:
        text += f"; srun then stopped {', '.join(others)}"
    text += ". "
    if timed_out:
        text += COLLECTIVE_TIMEOUT_NOTE + " "
    if checkpoint:
        text += (
            f"Newest complete checkpoint: {checkpoint}. Resubmit the same command (same run "
            "folder) to resume from it."
        )
    else:
        text += "No complete checkpoint yet: a resubmitted job starts from the beginning."
    return text


def newest_complete_checkpoint(run_dir: Path) -> str | None:
    """`step N (path)` of the newest checkpoint whose files are all there."""
    from fsdp_utils.checkpoint.sharded import newest_intact_checkpoint
    from fsdp_utils.config.layout import RunLayout

    # Damaged ones are skipped silently: the summary names only the one to resume from.
    info = newest_intact_checkpoint(RunLayout.of(run_dir).checkpoints, warn=lambda _: None)
    return None if info is None else f"step {info.step} ({info.path})"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m fsdp_utils.slurm.node_failure")
    parser.add_argument("log", type=Path, help="the job's Slurm log")
    parser.add_argument("offset", type=int, help="size of the log when the training step started")
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        with args.log.open("rb") as handle:
            handle.seek(args.offset)
            text = handle.read().decode(errors="replace")
    except OSError:
        return 0  # no log to read: nothing to add
    message = describe(
        parse_failures(text),
        newest_complete_checkpoint(args.run_dir),
        timed_out=collective_timed_out(text),
    )
    if message:
        print(message, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
