#!/usr/bin/env bash
# Bring up a local Slurm on this machine (as root) with emulated GPUs. Idempotent.
#   sudo slurm/local/up.sh [--gpus 4]             one node on localhost; state in slurm/local/state/
#   sudo slurm/local/up.sh --nodes 2 [--gpus 4]   node1, node2 in their own network namespaces, each
#                                                 with its own address, host name and private /tmp;
#                                                 state in slurm/local/state-multi/. Both can run
#                                                 at once (own ports, munged and state).
#   source slurm/local/env.sh [--nodes 2]         # SLURM_CONF for sbatch/squeue/srun in this shell
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python=python3  # the cluster code needs only the standard library
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m fsdp_utils.slurm.local_cluster up "$@"
