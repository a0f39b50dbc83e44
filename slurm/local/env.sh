# shellcheck shell=bash
# Point Slurm's commands (sbatch, squeue, srun, scontrol, sinfo) at the local cluster:
#   source slurm/local/env.sh
SLURM_CONF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/state/etc/slurm.conf"
export SLURM_CONF
