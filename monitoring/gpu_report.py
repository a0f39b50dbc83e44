"""`python monitoring/gpu_report.py <jobid>`: how well does (or did) a Slurm job use its GPUs?

A thin entry point; the logic is in monitoring.cli. Run as a file, Python puts `monitoring/` (not
the repository root) first on sys.path, so the root is put there instead: `monitoring` then
imports as a package and its module names cannot shadow anything.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    _here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != _here]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from monitoring.cli import main

if __name__ == "__main__":
    sys.exit(main())
