#!/usr/bin/env python
"""Fine-tune a causal LM on chess games with FSDP2. See `python chess_finetune.py --help`.

    torchrun --nproc_per_node 4 chess_finetune.py --model codellama/CodeLlama-7b-hf \\
        --total_batch_size 32 --batch_size_per_device 2 --gradient_checkpointing
"""

from fsdp_utils.hub.offline import enable_offline_mode
from fsdp_utils.startup import pause_collector
from fsdp_utils.versions import exit_if_untested

# Compute nodes have no internet: the Hugging Face libraries read these at import time.
enable_offline_mode()

if __name__ == "__main__":
    exit_if_untested()  # before anything imports torch or transformers
    pause_collector()  # until the model is built on meta: fsdp_utils/startup.py
    from fsdp_utils.cli import exit_process, main

    exit_process(main())
