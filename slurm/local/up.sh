#!/usr/bin/env bash
# Bring up a one-node Slurm on this machine (slurmctld + slurmd + munge, as root) with
# emulated GPUs; state, logs and config stay in slurm/local/state/. Idempotent.
#   sudo slurm/local/up.sh [--gpus 4]
#   export SLURM_CONF=$PWD/slurm/local/state/etc/slurm.conf   # or: source slurm/local/env.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python=python3  # the cluster code needs only the standard library
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m fsdp_utils.slurm.local_cluster up --state-dir "$here/state" "$@"
