"""Slurm launchers: the sbatch helper, the submitit launcher and a one-node local Slurm.

- `launch`: what `slurm/finetune.sh` computes inside a job (processes per node, rendezvous,
  run folder, requeue decision), as pure functions plus a tiny command line.
- `submitit_launcher`: `slurm/submit.py`, the same run through submitit (one task per GPU).
- `local_cluster`: slurm.conf/gres.conf for a one-node Slurm on localhost and the code that
  brings it up and down (`slurm/local/up.sh`, `slurm/local/down.sh`).
"""
