"""GPU monitoring for Slurm jobs: `python monitoring/gpu_report.py <jobid>`.

collect (Slurm and nvidia-smi, subprocesses) -> parse (pure) -> summary (pure) -> report (rich,
JSON, plain text). `monitoring.sampler` is the per-node sampler that `slurm/finetune.sh` runs.
"""
