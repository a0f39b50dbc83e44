#!/bin/bash
# Engine games (and positions labelled by the engine) as training data, made by many CPUs: a
# Slurm array job, each task its own shards
# (python -m fsdp_utils.chess_eval.selfplay, docs/chess-eval.md#engine-games-as-data).
#
#   mkdir -p logs && sbatch --array=0-15 slurm/selfplay.sh --games 200000 --output data/engine_games
#   sbatch --array=0-63%16 --cpus-per-task=8 slurm/selfplay.sh --games 2000000 \
#       --output data/engine_games --mix selfplay:8,vs_random:1,random:1
#   sbatch --array=0-15 --partition=cpu slurm/selfplay.sh ...      # your site's CPU partition
#   sbatch --array=0-15 slurm/selfplay.sh --games 20000 --positions 10 --output data/labelled
#       # and 10 positions of each game labelled by the engine at depth 8 (--label_depth):
#       # every legal move's centipawns, the best move; chess_position_NNNN.parquet beside
#
# Submit from the repository root; arguments after the script name go to the selfplay command.
# Task k of N plays the shards s with s % N == k (--shard_games games each, default 500), on as
# many processes as it has CPUs (one Stockfish each): one task or sixty-four write the same
# files. Each shard is written whole (a temporary file renamed), so a task that is killed,
# preempted or requeued goes on from its last shard, and a second submission of the same command
# only plays what is missing. The last task to finish writes the manifest (selfplay.json); or
# run `python -m fsdp_utils.chess_eval.selfplay --output DIR --merge` (it checks every shard).
# Train on the folder: `--dataset data/engine_games`.
#
# Stockfish must be on the compute nodes (--chess_engine PATH, $FSDP_UTILS_STOCKFISH, `stockfish`
# on PATH or /usr/games/stockfish; conda install -c conda-forge stockfish): a missing one stops
# the task in seconds (exit 2). Every node must run the same Stockfish: shards of another engine
# version are refused.
#
#SBATCH --job-name=chess-selfplay
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=4             # processes per task, one engine each
#SBATCH --mem=8G
#SBATCH --time=01:00:00
#SBATCH --output=logs/%x-%A_%a.out    # logs/ must exist (mkdir -p logs): Slurm does not create it
#SBATCH --open-mode=append            # a requeued task appends to the same log
#SBATCH --signal=B:USR1@60            # a minute before the time limit, signal this script (B:) ...
#SBATCH --requeue                     # ... which requeues the task: it goes on from its last shard
#
# Environment overrides:
#   SETUP              shell code that activates your environment (as for slurm/finetune.sh)
#   PROCESSES          processes per task (default: the CPUs Slurm gave the task)
#   REQUEUE            0: do not requeue a task at its time limit (default 1)
#   PYTHON             interpreter (python)

# SETUP, strict mode, PYTHON, offline mode: slurm/job_env.sh, found from the submit directory
# (sbatch runs a spooled copy of this script) or FSDP_UTILS_SLURM_DIR.
job_env=${FSDP_UTILS_SLURM_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/slurm}/job_env.sh
[ -f "$job_env" ] || { echo "error: $job_env not found: submit from the repository root." >&2; exit 2; }
source "$job_env"  # shellcheck source=slurm/job_env.sh

# --- time limit: requeue; the shards written so far stay ------------------------------------
child=""
time_limit=0
# shellcheck disable=SC2317  # called by the trap
on_time_limit() {
    time_limit=1
    local then="REQUEUE=0: not requeued"
    [ "${REQUEUE:-1}" = 0 ] || then="requeueing this task to play the rest"
    echo "$(date '+%F %T') Slurm signalled the coming time limit: the shards written so far" \
        "stay; $then"
    [ -z "$child" ] || kill -TERM "$child" 2>/dev/null
}
trap on_time_limit USR1

args=(--processes "${PROCESSES:-${SLURM_CPUS_PER_TASK:-1}}" "$@")  # the command line wins
echo "task ${SLURM_ARRAY_TASK_ID:-?} of array job ${SLURM_ARRAY_JOB_ID:-?}" \
    "(restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST:-$(hostname)}:" \
    "$PYTHON -m fsdp_utils.chess_eval.selfplay$(printf ' %q' "${args[@]}")"
"$PYTHON" -m fsdp_utils.chess_eval.selfplay "${args[@]}" &
child=$!
wait "$child"
exit_code=$?
if [ "$time_limit" = 1 ]; then
    wait "$child" 2>/dev/null  # the trap interrupted the first wait: the command's own end
    if [ "${REQUEUE:-1}" = 1 ]; then
        scontrol requeue "$SLURM_JOB_ID" && exit 0
    fi
fi
exit "$exit_code"
