"""fsdp_utils: fine-tune LLMs with PyTorch FSDP2 on air-gapped Slurm clusters.

The packages follow a run's data, and each imports only the stages below it (`make lint`
checks it: see `.importlinter`):

    config/      what a run is: TrainConfig, the command line, batch arithmetic, run folder, job
    hub/         the offline asset cache: download (login node), resolve (compute nodes)
    data/        dataset files -> rows -> tokens (+ loss masks) -> packed blocks -> batches
    model/       meta build, decoder layers, sliced weight loading, LoRA, QLoRA's 4-bit base,
                 a distillation teacher
    parallel/    process groups, sequence parallelism, activation checkpointing, torch.compile,
                 FSDP2/DDP
    metrics/     rank 0's log and its reader, FLOPs/MFU/memory, trackers, plots
    checkpoint/  sharded checkpoints, Hugging Face and PEFT folders, export, storage check
    chess_eval/  did the model learn chess? (python-chess as the referee, Stockfish as the judge)
    lm_harness/  standard benchmarks (lm-evaluation-harness) on the FSDP2-sharded model, offline
    train/       the step machinery every method shares: TrainStep (micro-batches, the loss
                 normalised by the step's count, clipping, non-finite checks), the chunked loss,
                 optimizer, time limit
    methods/     training methods over it: SFT, DPO and distillation behind one interface,
                 `--method` registry
    trainer/     the Trainer: composes the stages and the run's method (train -> train_step)
    plan/        will it fit in GPU memory? (one step traced on fake tensors)
    run/         before a run: preflight, run-folder start, shared paths; opening the Trainer
    slurm/       sbatch/submitit launchers, a local Slurm for tests

Commands: `cli` (chess_finetune.py), `download` (download_models.py), `demo` (make demo),
`export`, `plot` and `evaluate` (`python -m fsdp_utils.export|plot|evaluate`); `synthetic` builds the tiny models,
tokenizers and datasets of the demo and the tests. Under every stage: `versions` (each command
starts by checking the installed dependencies against pyproject.toml's ranges), `arguments`
(every command's parser: the closest flag for a misspelt one, dashes or underscores),
`error_report` (a user mistake's one paragraph) and `atomic` (files written whole or not at all).
"""

import logging
import os
import sys

__version__ = "0.1.0"


def _quiet_torchao() -> None:
    """transformers imports torchao (our dependency for --quantize nf4) whenever it is installed,
    in every command. NF4 is plain PyTorch: skip torchao's compiled extensions (built for one
    torch version: on others each one logs "Failed to load"), and drop the notes torch logs
    about the enums torchao registers for torch.compile. Filters, not levels: any other
    warning of theirs still shows."""
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    notes = {
        "torchao": ("Skipping import of cpp extensions", "Failed to load"),
        "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
    }
    for name, texts in notes.items():
        logging.getLogger(name).addFilter(_DropNotes(texts))


class _DropNotes(logging.Filter):
    def __init__(self, texts: tuple[str, ...]) -> None:
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.texts)


_quiet_torchao()

# `python -m fsdp_utils.plan` (and .chess_eval, .evaluate, .export, .plot, .demo) imports this package, then
# the command's package (which imports torch), then runs it. While Python looks the command up,
# sys.argv[0] is "-m" (documented for -m), so this is the one place that checks the versions of
# every `python -m fsdp_utils.*` command before anything imports torch or transformers. A program
# that imports fsdp_utils as a library is not checked. The scripts (chess_finetune.py, ...) check
# first thing.
if sys.argv[:1] == ["-m"]:
    from fsdp_utils.versions import exit_if_untested

    exit_if_untested()
