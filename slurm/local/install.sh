#!/usr/bin/env bash
# Install Debian's Slurm (slurmctld, slurmd, client commands), munge, iproute2 and Stockfish
# (the chess evaluation's engine judge, /usr/games/stockfish), only if missing, and make sure
# munge has a key. Idempotent: `make setup-system` runs it; rerunning
# changes nothing.
set -euo pipefail

# iproute2: `ip` for the multi-node cluster; stockfish: the engine judge (docs/chess-eval.md)
packages=(slurm-wlm munge iproute2 stockfish)
missing=()
for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" \
        || missing+=("$package")
done

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

if [ ${#missing[@]} -gt 0 ]; then
    echo "Installing ${missing[*]} (Debian packages) ..."
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}"
fi

# Debian's munge package creates the key on install; an image built without it may lack one.
if ! as_root test -s /etc/munge/munge.key; then
    as_root mungekey --create --keyfile=/etc/munge/munge.key
    as_root chown munge:munge /etc/munge/munge.key
    as_root chmod 0600 /etc/munge/munge.key
fi
echo "Slurm $(/usr/sbin/slurmctld -V | awk '{print $2}') and munge are installed."
# Stockfish prints its name and version as its first line, then waits for UCI commands.
echo "$(/usr/games/stockfish </dev/null | head -n 1 | cut -d" " -f1-2) is installed (/usr/games/stockfish)."
