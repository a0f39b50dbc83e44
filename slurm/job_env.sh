# The environment every job script here starts with (finetune.sh, evaluate.sh, prepare.sh
# source it; it is not a job script itself): SETUP's activation, strict mode, the interpreter,
# and the offline mode of the Hugging Face libraries.
#
# sbatch runs a copy of the job script from its spool folder, so the scripts find this file
# from where the job was submitted (the repository root: $SLURM_SUBMIT_DIR/slurm), or in
# FSDP_UTILS_SLURM_DIR when that is set.

# Before `set -u`: activation scripts (conda's in particular) read unset variables.
eval "${SETUP:-}" || { echo "error: SETUP failed: ${SETUP}" >&2; exit 2; }
set -uo pipefail
PYTHON=${PYTHON:-python}
# Compute nodes have no internet: the Hugging Face libraries must know before Python imports
# them, or they wait for network timeouts. Models and data come from download_models.py's cache.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
