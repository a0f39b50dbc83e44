# shellcheck shell=bash
# Point Slurm's commands (sbatch, squeue, srun, scontrol, sinfo) at the local cluster:
#   source slurm/local/env.sh              the one-node cluster
#   source slurm/local/env.sh --nodes 2    the multi-node cluster (any number above 1)
_fsdp_local="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/state"
if [ "${1:-}" = --nodes ] && [ "${2:-1}" -gt 1 ]; then _fsdp_local="$_fsdp_local-multi"; fi
SLURM_CONF="$_fsdp_local/etc/slurm.conf"
export SLURM_CONF
unset _fsdp_local
