"""Where a run keeps its files. One folder per run, stable across Slurm requeues.

<output_dir>/
    config.json        resolved TrainConfig (+ world size, batch plan, versions)
    metrics.jsonl      one JSON object per logged step / eval / event
    samples.jsonl      the model's answers to --sample_prompts at every evaluation
    completions.jsonl  --method grpo: completions with their rewards, every few steps
    checkpoints/       sharded DCP checkpoints (step_00000100/ ...)
    final/             Hugging Face model + tokenizer (safetensors) at the end; with --lora
                       a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)
    final_merged/      with --lora --merge: the base model with the adapters merged in
    gpu_samples/       per-node GPU samples written by the sbatch sampler (CSV)
    logs/              Slurm and launcher logs
    tensorboard/       TensorBoard event files (--tensorboard)
    wandb/             W&B offline runs, one per leg, and the run id they share (--wandb)
    status.json        how the last run ended: completed | interrupted | failed
    STOP               created to ask a running job to save and stop
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SITE_ENV = "FSDP_UTILS_SITE_DIR"


def site_dir() -> Path:
    """Where the step-time model keeps what it learns of this site (fsdp_utils/plan/site.py):
    $FSDP_UTILS_SITE_DIR, else $XDG_CACHE_HOME/fsdp_utils/site, else ~/.cache/fsdp_utils/site."""
    if os.environ.get(SITE_ENV):
        return Path(os.environ[SITE_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "fsdp_utils" / "site"


def site_calibration_file() -> Path:
    """The site's calibrations (`python -m fsdp_utils.plan --calibrate` writes them)."""
    return site_dir() / "calibration.json"


@dataclass(frozen=True)
class RunLayout:
    root: Path

    @classmethod
    def of(cls, output_dir: str | Path) -> RunLayout:
        return cls(Path(output_dir))

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def samples(self) -> Path:
        """The answers to --sample_prompts, one JSON object per prompt and evaluation."""
        return self.root / "samples.jsonl"

    @property
    def completions(self) -> Path:
        """--method grpo: a few completions and their rewards every --log_completions_every."""
        return self.root / "completions.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def final_model(self) -> Path:
        return self.root / "final"

    @property
    def merged_model(self) -> Path:
        return self.root / "final_merged"

    @property
    def gpu_samples(self) -> Path:
        return self.root / "gpu_samples"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def chess_eval(self) -> Path:
        """The chess evaluation's per-move and per-game records, a folder per evaluation."""
        return self.root / "chess_eval"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def wandb(self) -> Path:
        """W&B writes its offline runs into `<root>/wandb/` (wandb.init(dir=root))."""
        return self.root / "wandb"

    @property
    def status(self) -> Path:
        """Written at exit by rank 0: completed | interrupted | failed (read by finetune.sh)."""
        return self.root / "status.json"

    @property
    def default_stop_file(self) -> Path:
        return self.root / "STOP"

    def stop_file(self, configured: str | None) -> Path:
        """The file that asks the run to stop: `--stop_file`, else `<output_dir>/STOP`. The
        trainer and both launchers call this, so they always watch and touch the same file."""
        return Path(configured) if configured else self.default_stop_file
