"""chess_finetune.py's main, run several times in one torchrun: short runs that differ in flags
(one per model family, one per sharding strategy, ...).

    torchrun --standalone --nproc_per_node 2 tests/finetune_runs.py RUNS.json RESULTS.json

RUNS.json is a list of {"name": ..., "argv": [chess_finetune.py flags]}. Each run goes through
`fsdp_utils.cli.main`, as `chess_finetune.py` does (parse, check, set up, train, final save),
in the one process group this script sets up: the interpreter, torch, transformers and the
group start once for all the runs, not once per run (seconds each, per process). Rank 0 writes
RESULTS.json after every run ({name: {"exit_code", "seconds"}}), so a crash in one run leaves
the results of the runs before it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# Run as a script (tests/ is then sys.path[0]): import this checkout's package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    from fsdp_utils.hub.offline import enable_offline_mode

    enable_offline_mode()  # as chess_finetune.py does before any Hugging Face import
    from fsdp_utils.cli import main as finetune_main
    from fsdp_utils.parallel import distributed as dist_utils

    runs, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    results: dict[str, dict[str, float]] = {}
    # Set up here, the group outlives every run (`fsdp_utils.cli.run` leaves it up).
    env = dist_utils.init_distributed("cpu", timeout_minutes=5)
    clean = False
    try:
        for run in runs:
            started = time.perf_counter()
            code = finetune_main(run["argv"])
            results[run["name"]] = {"exit_code": code, "seconds": time.perf_counter() - started}
            if env.is_main:
                out.write_text(json.dumps(results, indent=2))
        clean = True
    finally:
        dist_utils.destroy(synchronize=clean)
    return max((r["exit_code"] for r in results.values()), default=0)


if __name__ == "__main__":
    raise SystemExit(main())
