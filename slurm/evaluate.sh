#!/bin/bash
# Standard benchmarks (lm-evaluation-harness) or the chess evaluation under Slurm, the model
# sharded with FSDP2 as in training: one torchrun per node, one process per GPU, no network.
#
#   mkdir -p logs && sbatch slurm/evaluate.sh --model runs/chess --tasks arc_easy,hellaswag,gsm8k
#   sbatch slurm/evaluate.sh --model codellama/CodeLlama-7b-hf --tasks mmlu --output_dir runs/base-eval
#   sbatch --nodes=2 slurm/evaluate.sh --model runs/big --tasks mmlu --compare runs/base-eval
#   MODEL=runs/chess TASKS=arc_easy,gsm8k LIMIT=100 sbatch slurm/evaluate.sh
#
# The chess evaluation (python -m fsdp_utils.chess_eval, docs/chess-eval.md): `--chess` first,
# then its arguments (MODEL may come from the environment instead):
#
#   sbatch slurm/evaluate.sh --chess runs/chess --engine on --ladder random,depth:1,skill:0
#   MODEL=runs/chess sbatch slurm/evaluate.sh --chess --games 200
#
# Its preflight (`--preflight`: the options, the model, the held-out games, the engine) runs on
# the job's first node before anything loads; run it on the login node too, before sbatch:
#   python -m fsdp_utils.chess_eval runs/chess --engine on --preflight
# Each process starts one Stockfish (Threads=1) for its share of the positions and games: give
# the job at least one CPU per process beyond the data loading.
#
# Submit from the repository root. Arguments after the script name go to
# `python -m fsdp_utils.evaluate` (see docs/evaluate.md; they win over the environment
# overrides). The tasks' data must be in the offline cache first: on the login node,
# `python download_models.py --eval_tasks arc_easy,...`. A task that is not cached stops the job
# in seconds, before the model loads, naming that command. An evaluation keeps nothing to resume
# from: give it the time it needs (--limit for a quick look).
#
#SBATCH --job-name=evaluate
#SBATCH --nodes=1                     # more nodes: a model too large for one node's GPUs
#SBATCH --ntasks-per-node=1           # one torchrun per node; it starts one process per GPU
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16            # per node: tokenisation of the requests
#SBATCH --mem=128G                    # host RAM per node (the weights pass through it, slice by slice)
#SBATCH --time=02:00:00
#SBATCH --output=logs/%x-%j.out       # logs/ must exist (mkdir -p logs): Slurm does not create it
#
# Environment overrides (unset: fsdp_utils.evaluate's defaults):
#   SETUP                  shell code that activates your environment (as for slurm/finetune.sh)
#   MODEL                  hub id in the offline cache, model folder, run folder or LoRA adapter
#                          (with --chess: the model argument)
#   TASKS                  comma-separated lm-eval tasks or groups
#   LIMIT, BATCH_SIZE      --limit (documents per task) and --batch_size (rows per rank)
#   OUTPUT_DIR             where the results go (default: <run>/lm_eval for a run folder)
#   NPROC_PER_NODE         processes per node (default: one per GPU; 1 on a node without GPUs)
#   RDZV_HOST, RDZV_PORT   rendezvous address for multi-node jobs (as for slurm/finetune.sh)
#   PYTHON                 interpreter (python)
# Cluster network settings (NCCL_SOCKET_IFNAME, ...) go in SETUP, as for slurm/finetune.sh.

# SETUP, strict mode, PYTHON, offline mode: slurm/job_env.sh, found from the submit directory
# (sbatch runs a spooled copy of this script) or FSDP_UTILS_SLURM_DIR.
job_env=${FSDP_UTILS_SLURM_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/slurm}/job_env.sh
[ -f "$job_env" ] || { echo "error: $job_env not found: submit from the repository root." >&2; exit 2; }
source "$job_env"  # shellcheck source=slurm/job_env.sh

args=()
if [ "${1:-}" = "--chess" ]; then
    shift
    module=fsdp_utils.chess_eval
    [ -n "${MODEL:-}" ] && args+=("$MODEL")
    args+=("$@")
    # Seconds, before the model loads or a GPU waits: a missing engine or a wrong path exits 2.
    "$PYTHON" -m fsdp_utils.chess_eval "${args[@]}" --preflight || {
        echo "preflight failed: nothing was started. Fix the error above and resubmit." >&2
        exit 2
    }
else
    module=fsdp_utils.evaluate
    [ -n "${MODEL:-}" ] && args+=(--model "$MODEL")
    [ -n "${TASKS:-}" ] && args+=(--tasks "$TASKS")
    [ -n "${LIMIT:-}" ] && args+=(--limit "$LIMIT")
    [ -n "${BATCH_SIZE:-}" ] && args+=(--batch_size "$BATCH_SIZE")
    [ -n "${OUTPUT_DIR:-}" ] && args+=(--output_dir "$OUTPUT_DIR")
    args+=("$@")  # last: the command line wins
fi

# Sets NNODES NPROC_PER_NODE WORLD_SIZE RDZV_ENDPOINT RDZV_ID and exports OMP_NUM_THREADS, as
# slurm/finetune.sh's plan does (one process per GPU, rendezvous on the first node).
launch_plan=$("$PYTHON" -m fsdp_utils.slurm.launch nodes) || exit 2
eval "$launch_plan"
echo "job ${SLURM_JOB_ID:-?} on ${SLURM_JOB_NODELIST:-$(hostname)}:" \
    "$PYTHON -m $module$(printf ' %q' "${args[@]}")"

# Several nodes: this script hosts the rendezvous store (as slurm/finetune.sh does), so every
# node can close the rendezvous when the others have exited.
rdzv_conf=join_timeout=600
store_pid=""
if [ "$NNODES" -gt 1 ]; then
    "$PYTHON" -m fsdp_utils.slurm.rdzv_store "${RDZV_ENDPOINT##*:}" &
    store_pid=$!
    rdzv_conf+=,is_host=false
fi
# --cpus-per-task is repeated because srun in Slurm 22.05 does not inherit it from sbatch.
srun --nodes="$NNODES" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    --kill-on-bad-exit=1 \
    "$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID" \
    --rdzv-conf="$rdzv_conf" \
    -m "$module" "${args[@]}"
exit_code=$?
[ -z "$store_pid" ] || { kill "$store_pid" && wait "$store_pid"; } 2>/dev/null
exit "$exit_code"
