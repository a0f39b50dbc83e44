"""Slurm launchers: the sbatch helper, the submitit launcher and a one-node local Slurm.

- `launch`: what `slurm/finetune.sh` computes inside a job (processes per node, rendezvous,
  run folder, requeue decision), as pure functions plus a tiny command line.
- `submitit_launcher`: `slurm/submit.py`, the same run through submitit (one task per GPU).
- `local_cluster`: a one-node Slurm on localhost, brought up and down by `slurm/local/up.sh` and
  `slurm/local/down.sh` (their command line; with `--nodes N`, `local_multinode`'s N nodes in
  network namespaces); `local_conf` renders their slurm.conf/gres.conf as pure functions, and
  `local_daemons` holds what both do with their daemons.
"""
