# shellcheck shell=bash
# Point Slurm's commands (sbatch, squeue, srun, scontrol, sinfo) at the local cluster:
#   source slurm/local/env.sh              the one-node cluster
#   source slurm/local/env.sh --nodes 2    the multi-node cluster (any number above 1)
# On a machine without nvidia-smi it also puts slurm/local/bin/ first on PATH: a clearly labelled
# replay of recorded nvidia-smi output, so that the GPU report of a job submitted from this
# shell has numbers to show (and says they are a replay). A real nvidia-smi is never shadowed.
_fsdp_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
_fsdp_local="$_fsdp_here/state"
if [ "${1:-}" = --nodes ] && [ "${2:-1}" -gt 1 ]; then _fsdp_local="$_fsdp_local-multi"; fi
SLURM_CONF="$_fsdp_local/etc/slurm.conf"
export SLURM_CONF
if ! command -v nvidia-smi >/dev/null 2>&1; then
    PATH="$_fsdp_here/bin:$PATH"
    export PATH
    echo "slurm/local/env.sh: no nvidia-smi here: $_fsdp_here/bin/nvidia-smi (a replay of recorded output) is on PATH for the GPU report"
fi
unset _fsdp_here _fsdp_local
