#!/bin/bash

# Parameters
#SBATCH --account=proj42
#SBATCH --cpus-per-task=8
#SBATCH --gpus-per-node=4
#SBATCH --job-name=chess-finetune
#SBATCH --mem=256GB
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --open-mode=append
#SBATCH --output=/scratch/alice/logs/submitit/%j/%j_0_log.out
#SBATCH --partition=gpu
#SBATCH --requeue
#SBATCH --signal=USR2@300
#SBATCH --time=240
#SBATCH --wckey=submitit

# setup
module load anaconda3/2024.6
conda activate fsdp-utils
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /scratch/alice/logs/submitit/%j/%j_%t_log.out --cpus-per-task 8 /home/alice/.conda/envs/fsdp-utils/bin/python -u -m submitit.core._submit /scratch/alice/logs/submitit/%j
