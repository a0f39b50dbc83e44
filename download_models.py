"""Cache models and datasets on the login node for compute nodes without internet.

    python download_models.py                  # the trainer's default model and dataset subset
    python download_models.py --help           # --model/--dataset/--config, --verify, --check-offline

Everything lives in `fsdp_utils.hub`; see docs/download.md.
"""

import sys

from fsdp_utils.versions import exit_if_untested

if __name__ == "__main__":
    exit_if_untested()  # before anything imports huggingface_hub or transformers
    from fsdp_utils.download import main

    sys.exit(main())
