"""fsdp_utils: fine-tune LLMs with PyTorch FSDP2 on air-gapped Slurm clusters."""

__version__ = "0.1.0"
