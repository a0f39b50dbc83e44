#!/usr/bin/env python
"""Submit chess_finetune.py through submitit: one task per GPU, on Slurm or on this machine.

    python slurm/submit.py --nodes 2 --gpus-per-node 4 --time 04:00:00 -- --total_batch_size 64
    python slurm/submit.py --local --gpus-per-node 2 -- --model demo_assets/model ...
    python slurm/submit.py --sweep batch_size_per_device=1,2,4,8 -- --max_training_steps 20
    python slurm/submit.py --dry-run ...      # print the batch script, submit nothing

Run it from the repository root; see `python slurm/submit.py --help`.
"""

import sys
from pathlib import Path

# Importable from a plain checkout too (python puts slurm/, not the root, on sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_utils.versions import exit_if_untested

if __name__ == "__main__":
    exit_if_untested()  # here, not after the job waited in the queue
    from fsdp_utils.slurm.submitit_launcher import main

    sys.exit(main())
