#!/bin/bash
# Prepare (tokenise and pack) the training data on a CPU node, once, before the GPU job, with
# as many processes as the allocation has cores. The GPU job with the same options then finds
# it in the cache ("data: using prepared data") instead of preparing it while its GPUs wait.
#
#   mkdir -p logs && sbatch slurm/prepare.sh --config runs/chat.yaml
#   sbatch --partition=cpu --cpus-per-task=32 slurm/prepare.sh --config runs/chat.yaml
#   sbatch --dependency=afterok:<its job id> slurm/finetune.sh --config runs/chat.yaml
#
# Submit from the repository root; arguments are chess_finetune.py's (only the model's
# tokenizer and the data options matter). Pick your site's CPU partition with --partition on
# the sbatch command line. The model and data come from download_models.py's cache: the node
# needs no internet.
#
#SBATCH --job-name=prepare-data
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=16            # tokenisation processes (NUM_PROC follows the allocation)
#SBATCH --mem=32G                     # host RAM: preparation's memory grows with the processes
#SBATCH --time=04:00:00
#SBATCH --output=logs/%x-%j.out       # logs/ must exist (mkdir -p logs): Slurm does not create it
#
# Environment overrides:
#   SETUP              shell code that activates your environment (as for slurm/finetune.sh)
#   CONFIG, MODEL, DATASET  as for slurm/finetune.sh
#   NUM_PROC           processes (default: the CPUs Slurm gave the job)
#   PYTHON             interpreter (python)

# SETUP, strict mode, PYTHON, offline mode: slurm/job_env.sh, found from the submit directory
# (sbatch runs a spooled copy of this script) or FSDP_UTILS_SLURM_DIR.
job_env=${FSDP_UTILS_SLURM_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/slurm}/job_env.sh
[ -f "$job_env" ] || { echo "error: $job_env not found: submit from the repository root." >&2; exit 2; }
source "$job_env"  # shellcheck source=slurm/job_env.sh

args=()
[ -n "${CONFIG:-}" ] && args+=(--config "$CONFIG")
[ -n "${MODEL:-}" ] && args+=(--model "$MODEL")
[ -n "${DATASET:-}" ] && args+=(--dataset "$DATASET")
args+=(--num_proc "${NUM_PROC:-${SLURM_CPUS_PER_TASK:-$(nproc)}}")
args+=("$@")  # last: the command line wins

echo "job ${SLURM_JOB_ID:-?} on ${SLURM_JOB_NODELIST:-$(hostname)}:" \
    "$PYTHON -m fsdp_utils.data$(printf ' %q' "${args[@]}")"
exec "$PYTHON" -m fsdp_utils.data "${args[@]}"
