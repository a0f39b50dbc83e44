#!/usr/bin/env bash
# Cancel all jobs and stop the local Slurm started by up.sh (munged too, if up.sh started it).
# A pytest session still using it keeps it running until the session ends (--force: stop anyway).
#   sudo slurm/local/down.sh [--force]              the one-node cluster
#   sudo slurm/local/down.sh --nodes 2 [--force]    the multi-node cluster: also removes its network
#                                                   namespaces, links and mounts
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python=python3
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m fsdp_utils.slurm.local_cluster down "$@"
