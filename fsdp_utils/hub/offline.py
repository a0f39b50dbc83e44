"""Hugging Face offline mode for compute nodes.

huggingface_hub, transformers and datasets read these variables when they are imported, so
`enable_offline_mode()` must run before any of them is imported: the sbatch script exports them
and `chess_finetune.py` calls this at its very top.
"""

from __future__ import annotations

import os
import sys

OFFLINE_VARIABLES = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}
_HF_MODULES = ("huggingface_hub", "transformers", "datasets")


def enable_offline_mode(*, force: bool = False) -> list[str]:
    """Set the offline variables (keeping values the user set, unless `force`).

    Returns the Hugging Face modules that were already imported (too late for them to notice).
    """
    for name, value in OFFLINE_VARIABLES.items():
        if force:
            os.environ[name] = value
        else:
            os.environ.setdefault(name, value)
    return [m for m in _HF_MODULES if m in sys.modules]
