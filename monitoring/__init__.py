"""GPU monitoring for Slurm jobs: `python monitoring/gpu_report.py <jobid>`.

collect (Slurm and nvidia-smi, subprocesses) -> parse (pure) -> allocation (the job's GPUs, and
by which rule) -> legs (restarts of a requeued job) -> summary (pure) -> report (rich, JSON,
plain text); plot draws the sampler files over time (`--plot`). `monitoring.sampler` is the
per-node sampler that `slurm/finetune.sh` runs; `arguments` the commands' parser.
"""
