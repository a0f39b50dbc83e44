#!/bin/bash
# FSDP2 fine-tune under Slurm: one torchrun per node, one training process per GPU.
#
#   mkdir -p logs && sbatch slurm/finetune.sh [chess_finetune.py arguments ...]
#   TOTAL_BATCH_SIZE=64 BATCH_SIZE_PER_DEVICE=2 sbatch --nodes=2 slurm/finetune.sh
#   SETUP="module load anaconda3/2024.6; conda activate fsdp-utils" sbatch slurm/finetune.sh
#
# Submit from the repository root. Every #SBATCH line below can be overridden on the sbatch
# command line; arguments after the script name go to chess_finetune.py (they win over the
# environment overrides). The total batch stays fixed whatever the number of nodes and GPUs:
# gradient accumulation is derived from it, and a total that does not divide fails in seconds.
#
#SBATCH --job-name=chess-finetune
#SBATCH --nodes=1                     # more nodes: same total batch, less accumulation
#SBATCH --ntasks-per-node=1           # one torchrun per node; it starts one process per GPU
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32            # per node: data loading and tokenisation workers
#SBATCH --mem=256G                    # host RAM per node (sharded checkpoints pass through it)
#SBATCH --time=04:00:00
#SBATCH --output=logs/%x-%j.out       # logs/ must exist (mkdir -p logs): Slurm does not create it
#SBATCH --open-mode=append            # a requeued job appends to the same log
#SBATCH --signal=B:USR1@300           # 5 min before the time limit, signal this script (B:) ...
#SBATCH --requeue                     # ... which saves a checkpoint and requeues the job
#
# Environment overrides (unset: chess_finetune.py's defaults or its --config file):
#   SETUP                  shell code that activates your environment, run first, e.g.
#                          "source .venv/bin/activate" or "module load cuda; conda activate env"
#                          (default: the environment sbatch was called from, which it exports)
#   MODEL, DATASET         hub id cached by download_models.py, or a local folder
#   OUTPUT_DIR             run folder (default: output_dir of the --config file, else
#                          runs/<job name>-<job id>; the same after a requeue)
#   TOTAL_BATCH_SIZE       sequences per optimizer step, fixed whatever the GPU count
#   BATCH_SIZE_PER_DEVICE  sequences per forward/backward pass on each GPU
#   CONFIG                 a YAML/JSON file of chess_finetune.py options
#   NPROC_PER_NODE         processes per node (default: one per GPU; 1 on a node without GPUs)
#   GPU_SAMPLE_INTERVAL    seconds between GPU samples in RUN_DIR/gpu_samples (0: off; 30)
#   GPU_MEMORY             memory of one GPU for the preflight's memory plan (default: read
#                          from nvidia-smi on the node; e.g. 80GiB to force it; off: no plan)
#   REQUEUE, MAX_REQUEUES  0 disables requeueing after a time-limit save; at most 20 requeues
#   RDZV_HOST, RDZV_PORT   rendezvous address for multi-node jobs (default: the first node,
#                          port 20000 + job id % 10000)
#   PYTHON, TRAIN_SCRIPT   interpreter (python) and entry point (chess_finetune.py)
#   FSDP_UTILS_SLURM_DIR   where slurm/job_env.sh is (default: the submit directory's slurm/;
#                          every job script here sources it: SETUP, PYTHON, offline mode)
#
# Cluster network settings are site specific: set what your admins recommend in SETUP, e.g.
#   NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0  interface for bootstrap and socket traffic
#                                                  (a wrong one hangs the first collective)
#   NCCL_IB_HCA=mlx5                               InfiniBand adapters NCCL may use
#   NCCL_DEBUG=INFO                                log the transport NCCL picked (IB or sockets)
#   TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=1800          how long a hung collective may block before
#                                                  the watchdog aborts the job (default 480 s)
# Timeouts, so that a job with a dead or frozen node ends instead of hanging until its limit:
#   torchrun waits up to 600 s for all nodes to join the rendezvous (--rdzv-conf join_timeout);
#   srun --kill-on-bad-exit=1 stops every node as soon as one node's torchrun fails;
#   a collective waits at most 30 min for a rank (chess_finetune.py --collective_timeout_minutes).

# --- time limit: save, then requeue -------------------------------------------------------------
# Trapped first: an untrapped USR1 would kill this script. torchrun does not pass SIGUSR1 on to
# its workers, so the trainer watches STOP_FILE at every step boundary instead (and reads the
# job's end time itself); all ranks then save a checkpoint and exit 0.
STOP_FILE=""
stop_requested=0
# shellcheck disable=SC2317  # called by the trap
on_time_limit() {
    stop_requested=1
    echo "$(date '+%F %T') Slurm signalled the coming time limit: asking the trainer to save" \
        "and stop (${STOP_FILE:-not started yet})"
    [ -z "$STOP_FILE" ] || touch "$STOP_FILE"
}
trap on_time_limit USR1

# --- environment -----------------------------------------------------------------------------
# SETUP, strict mode, PYTHON, offline mode: slurm/job_env.sh, found from the submit directory
# (sbatch runs a spooled copy of this script) or FSDP_UTILS_SLURM_DIR.
job_env=${FSDP_UTILS_SLURM_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/slurm}/job_env.sh
[ -f "$job_env" ] || { echo "error: $job_env not found: submit from the repository root." >&2; exit 2; }
source "$job_env"  # shellcheck source=slurm/job_env.sh
TRAIN_SCRIPT=${TRAIN_SCRIPT:-chess_finetune.py}
if [ ! -f "$TRAIN_SCRIPT" ]; then
    echo "error: $TRAIN_SCRIPT not found in $PWD: submit from the repository root" \
        "(cd <checkout> && sbatch slurm/finetune.sh)." >&2
    exit 2
fi

train_args=()
[ -n "${CONFIG:-}" ] && train_args+=(--config "$CONFIG")
[ -n "${MODEL:-}" ] && train_args+=(--model "$MODEL")
[ -n "${DATASET:-}" ] && train_args+=(--dataset "$DATASET")
[ -n "${OUTPUT_DIR:-}" ] && train_args+=(--output_dir "$OUTPUT_DIR")
[ -n "${TOTAL_BATCH_SIZE:-}" ] && train_args+=(--total_batch_size "$TOTAL_BATCH_SIZE")
[ -n "${BATCH_SIZE_PER_DEVICE:-}" ] && train_args+=(--batch_size_per_device "$BATCH_SIZE_PER_DEVICE")
train_args+=("$@")

# --- plan: processes per node, rendezvous, run folder -------------------------------------------
# Sets NNODES NPROC_PER_NODE WORLD_SIZE RDZV_ENDPOINT RDZV_ID RUN_DIR STOP_FILE, exports
# OMP_NUM_THREADS (the node's CPUs shared among its processes). RUN_DIR and STOP_FILE come from
# the trainer's own config (flags and --config file), so the trap touches the file it watches.
launch_plan=$("$PYTHON" -m fsdp_utils.slurm.launch plan -- "${train_args[@]}") || exit 2
eval "$launch_plan"
train_args+=(--output_dir "$RUN_DIR")  # last, so the trainer uses exactly this folder
mkdir -p "$RUN_DIR/logs" "$RUN_DIR/gpu_samples"
slurm_log=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *StdOut=//p')
[ -f "$slurm_log" ] && ln -sf "$(realpath "$slurm_log")" "$RUN_DIR/logs/"
echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST:" \
    "$PYTHON $TRAIN_SCRIPT$(printf ' %q' "${train_args[@]}")"

# --- preflight: seconds, before anything expensive ----------------------------------------------
# Config, batch arithmetic for WORLD_SIZE processes, offline assets, sequence length, and the
# memory planner's verdict for this node's GPUs (GPU_MEMORY=80GiB to force a size, off to skip).
# Once per job: a requeued leg runs the same command, and when its processes, nodes and GPUs are
# those an earlier leg's preflight passed with (recorded in RUN_DIR/logs), it is not repeated
# (the trainer checks the config and data again in every process anyway; the preflight costs
# every leg a Python process importing torch, and a big model's plan up to a minute).
gpu_memory=${GPU_MEMORY:-auto}
if [ "$gpu_memory" = auto ]; then  # this node's GPU sizes (none without nvidia-smi)
    gpu_sizes=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader 2>/dev/null | sort -u)
    [ -z "$gpu_sizes" ] || gpu_memory+=" $(printf '%s' "$gpu_sizes" | paste -sd ' ')"
fi
preflight_passed="$RUN_DIR/logs/preflight-$SLURM_JOB_ID.passed"
preflight_key="$WORLD_SIZE process(es) on $NNODES node(s), GPU memory $gpu_memory"
if [ -f "$preflight_passed" ] && [ "$(cat "$preflight_passed")" = "$preflight_key" ]; then
    echo "preflight: passed in an earlier leg of job $SLURM_JOB_ID ($preflight_key): not repeated"
elif "$PYTHON" "$TRAIN_SCRIPT" --preflight --world_size "$WORLD_SIZE" --nodes "$NNODES" \
    --gpu_memory "${GPU_MEMORY:-auto}" "${train_args[@]}"; then
    printf '%s\n' "$preflight_key" > "$preflight_passed"
else
    echo "preflight failed: nothing was started. Fix the error above and resubmit." >&2
    exit 2
fi

# An earlier leg's STOP file is stale. Removed before the check below: a signal from now on
# either comes before the check (trap: stop_requested) or touches the file the trainer watches.
rm -f "$STOP_FILE"
# Slurm's signal came while the job was starting (bash runs the trap once the preflight ends):
# the trainer is not started, since importing and setting up would spend what is left of the
# job, and Slurm's TIMEOUT would then end a leg that is never requeued. The leg ends here as one
# that stopped before its first step: requeued, the next resumes where the last one saved.
if [ "$stop_requested" = 1 ]; then
    echo "$(date '+%F %T') the time limit is near and the trainer has not started: not starting it"
    rm -f "$STOP_FILE"
    decision=$("$PYTHON" -m fsdp_utils.slurm.launch after-run "$RUN_DIR" 0 --not-started)
    [ "$decision" != requeue ] || scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
rm -f "$RUN_DIR/status.json"

# --- GPU sampler: one per node, in the background -----------------------------------------------
sampler_pid=""
if [ "${GPU_SAMPLE_INTERVAL:-30}" != 0 ]; then
    # --overlap: shares the CPUs and GPUs of the training step instead of waiting for them.
    srun --overlap --job-name=gpu-sampler --nodes="$NNODES" --ntasks-per-node=1 \
        --kill-on-bad-exit=0 \
        "$PYTHON" -m monitoring.sampler --output "$RUN_DIR/gpu_samples" \
        --interval "${GPU_SAMPLE_INTERVAL:-30}" &
    sampler_pid=$!
fi
stop_sampler() {
    [ -n "$sampler_pid" ] || return 0
    # SIGINT through scancel ends the samplers cleanly; SIGTERM to srun would cancel the step
    # and print errors into this log.
    local step
    step=$(squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j" | awk '$2 == "gpu-sampler" {print $1}')
    # A sampler that already ended (no nvidia-smi on the node) is not an error to report.
    if [ -n "$step" ]; then
        scancel --signal=INT "$step"
    elif kill -0 "$sampler_pid" 2>/dev/null; then
        kill -TERM "$sampler_pid" 2>/dev/null
    fi
    wait "$sampler_pid" 2>/dev/null
    return 0
}

# --- train: one torchrun per node ---------------------------------------------------------------
# `python -m torch.distributed.run` is torchrun with the interpreter SETUP chose. srun runs in
# the background so that `wait` returns when USR1 arrives and the trap runs at once.
# --cpus-per-task is repeated because srun in Slurm 22.05 does not inherit it from sbatch.
# Several nodes: this script hosts the rendezvous store (on the first node) instead of node 1's
# torchrun, so every node can still close the rendezvous when the others have exited (else:
# "failed to shutdown the rendezvous ... RendezvousConnectionError", harmless but alarming).
rdzv_conf=join_timeout=600
store_pid=""
if [ "$NNODES" -gt 1 ]; then
    "$PYTHON" -m fsdp_utils.slurm.rdzv_store "${RDZV_ENDPOINT##*:}" &
    store_pid=$!
    rdzv_conf+=,is_host=false
fi
log_offset=$(stat -c %s "$slurm_log" 2>/dev/null || echo 0)
srun --nodes="$NNODES" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    --kill-on-bad-exit=1 \
    "$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID" \
    --rdzv-conf="$rdzv_conf" \
    "$TRAIN_SCRIPT" "${train_args[@]}" &
train_pid=$!
while kill -0 "$train_pid" 2>/dev/null; do
    wait "$train_pid"  # returns when training ends, or at once when a trapped signal arrives
done
wait "$train_pid"
exit_code=$?
[ -z "$store_pid" ] || { kill "$store_pid" && wait "$store_pid"; } 2>/dev/null
if [ "$exit_code" != 0 ] && [ "$NNODES" -gt 1 ] && [ -f "$slurm_log" ]; then
    # Which node failed first and how (srun's line), and the checkpoint to resume from.
    "$PYTHON" -m fsdp_utils.slurm.node_failure "$slurm_log" "$log_offset" "$RUN_DIR"
fi

stop_sampler

# --- after: requeue a run that saved before the time limit ------------------------------------
decision=$("$PYTHON" -m fsdp_utils.slurm.launch after-run "$RUN_DIR" "$exit_code")
if [ "$decision" = requeue ]; then
    # The requeued job keeps its id, so it resumes from RUN_DIR/checkpoints: the trainer picks
    # this job's own newest checkpoint (SLURM_RESTART_COUNT > 0), whatever --resume said.
    scontrol requeue "$SLURM_JOB_ID"
fi
# A user mistake the training processes found (status.json's user_error; after-run has just
# printed its paragraph last): they exit 2, torchrun 1 whatever its workers' code; the job
# ends with 2, as when the preflight finds one, so that sacct tells it from a crash.
[ "$decision" != user-error ] || exit_code=2
exit "$exit_code"
