"""Where the test suite's CPU goes: a py-spy profile of a whole `make test` run, each sample put
in one row by what it was doing (importing, the planner's trace, a training step, ...) and in one
column by the process it came from (a run forked by tests/prefork.py, a pytest worker, a fresh
process: torchrun and its workers, Slurm job steps, command lines), in seconds of CPU.

    .venv/bin/pip install py-spy        # a profiler for this measurement, not a dependency
    .venv/bin/py-spy record --subprocesses --nonblocking --rate 20 --format raw \\
        --output suite.raw -- .venv/bin/python -m pytest -n 2 --dist loadgroup
    python bench/suite_profile.py suite.raw               # the tables
    python bench/suite_profile.py suite.raw --json bench/results/suite_profile.json

py-spy samples the threads that are running, not those waiting, so the sums are CPU, not wall
time, in every process pytest starts and all they start (the Slurm jobs' steps included: the
test clusters' daemons are the tests' children). The profiler costs CPU too: a run took 23 min
15 s with it, 18-21 min without (docs/development.md, "The fifth round").
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

# First match wins: what a sample was doing, by the frames on its stack.
ACTIVITIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("imports", ("_find_and_load (<frozen importlib._bootstrap>",)),
    ("planner traces", ("(fsdp_utils/plan/",)),
    (
        "evaluations",
        (
            "(fsdp_utils/lm_harness/",
            "(fsdp_utils/chess_eval/",
            "(fsdp_utils/evaluate",
            "(fsdp_utils/train/evaluate.py",
        ),
    ),
    ("training steps", ("(fsdp_utils/train/", "(fsdp_utils/methods/")),
    (
        "model set-up",
        ("(fsdp_utils/model/", "(fsdp_utils/parallel/parallelize.py", "Trainer.setup"),
    ),
    ("checkpoints", ("(fsdp_utils/checkpoint/",)),
    ("data", ("(fsdp_utils/data/", "(fsdp_utils/synthetic.py")),
)
# Not exclusive: parts of the rows above worth their own figure.
WITHIN = {
    "DTensor sharding rules (first use of each op)": "propagate_op_sharding_non_cached",
    "fake-tensor dispatch": "FakeTensorMode.__torch_dispatch__",
    "FSDP2 collectives": "(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py",
    "backward (autograd engine)": "_engine_run_backward",
}
ACTIVITY_ROWS = (*(name for name, _ in ACTIVITIES), "other")
PROCESSES = ("forked runs", "pytest workers", "fresh processes", "prefork servers")


def split_frames(stack: str) -> list[str]:
    """py-spy joins frames with ';', which a process's command line may hold too (xdist's
    workers: `python -c import sys;exec(...)`): a fragment inside an open quote belongs to
    the frame before it."""
    frames: list[str] = []
    for part in stack.split(";"):
        if frames and frames[-1].startswith("process ") and frames[-1].count('"') % 2 == 1:
            frames[-1] += ";" + part
        else:
            frames.append(part)
    return frames


def process_kind(command: str, code: list[str]) -> str:
    if "tests/prefork.py --serve" in command:
        return (
            "forked runs"
            if any("_child (tests/prefork.py" in f for f in code)
            else "prefork servers"
        )
    # xdist's workers, or pytest itself (a test's folder, /tmp/pytest-of-..., is not pytest)
    if "exec(eval(sys.stdin.readline()))" in command or re.search(r"-m pytest\b", command):
        return "pytest workers"
    return "fresh processes"


def activity(code: list[str]) -> str:
    for name, marks in ACTIVITIES:
        if any(mark in frame for frame in code for mark in marks):
            return name
    return "other"


def imported_package(code: list[str]) -> str:
    """The package whose module the sample was executing, the innermost one being imported
    (scipy's when transformers imports it): what costs the time, whoever asked for it."""
    found = "(this project)"
    importing = False
    for frame in code:
        if frame.startswith("_find_and_load ("):
            importing = True
        elif importing and (match := re.match(r"<module> \(([^/:]+)", frame)):
            if match.group(1) not in ("fsdp_utils", "tests"):
                found = match.group(1).removesuffix(".py")
            importing = False
    return found


def summarise(lines: Iterable[str], rate: float) -> dict[str, dict[str, float]]:
    table: Counter[tuple[str, str]] = Counter()
    within: Counter[str] = Counter()
    imports: Counter[str] = Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit():
            continue
        frames = split_frames(stack)
        commands = [f for f in frames if f.startswith("process ")]
        code = [f for f in frames if not f.startswith("process ")]
        kind = process_kind(commands[-1] if commands else "", code)
        doing = activity(code)
        table[(doing, kind)] += int(count)
        for name, mark in WITHIN.items():
            if any(mark in frame for frame in code):
                within[name] += int(count)
        if doing == "imports":
            imports[imported_package(code)] += int(count)
    result = {row: {kind: table[(row, kind)] / rate for kind in PROCESSES} for row in ACTIVITY_ROWS}
    result["within those"] = {name: n / rate for name, n in within.most_common()}
    result["imports by package"] = {name: n / rate for name, n in imports.most_common(12)}
    return result


def print_tables(result: dict[str, dict[str, float]]) -> None:
    total = sum(sum(result[row].values()) for row in ACTIVITY_ROWS)
    print(f"{'seconds of CPU':<18}" + "".join(f"{k:>17}" for k in PROCESSES) + f"{'all':>9}")
    for row in ACTIVITY_ROWS:
        cells = result[row]
        share = sum(cells.values())
        print(f"{row:<18}" + "".join(f"{cells[k]:>17.0f}" for k in PROCESSES)
              + f"{share:>9.0f}  {share / max(total, 1e-9):>4.0%}")  # fmt: skip
    print(
        f"{'all':<18}"
        + "".join(f"{sum(result[r][k] for r in ACTIVITY_ROWS):>17.0f}" for k in PROCESSES)
        + f"{total:>9.0f}"
    )
    for title in ("within those", "imports by package"):
        print(f"\n{title}: " + ", ".join(f"{k} {v:.0f}" for k, v in result[title].items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", type=Path, help="py-spy's --format raw output")
    parser.add_argument("--rate", type=float, default=20.0, help="py-spy's --rate (samples/s)")
    parser.add_argument("--json", type=Path, help="also write the tables to this file")
    args = parser.parse_args(argv)
    if not args.profile.is_file():
        parser.error(f"{args.profile} is not a file: make it with the py-spy command above")
    with args.profile.open(errors="replace") as lines:  # a command line may hold any bytes
        result = summarise(lines, args.rate)  # line by line: a run's profile is ~100 MB
    print_tables(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
