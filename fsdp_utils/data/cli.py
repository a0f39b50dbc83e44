"""`python -m fsdp_utils.data [chess_finetune.py options]`: prepare the training data and
nothing else, offline, on any node: what `slurm/prepare.sh` runs on a CPU node, so that the
GPU job finds the data prepared ("using prepared data") instead of preparing it while its GPUs
wait. The same preparation, cache folder and key as the training run with the same options
(`fsdp_utils.data.prepare.prepare_dataset`); `--num_proc` defaults to this node's CPUs."""

from __future__ import annotations

import sys
import time

from fsdp_utils.config.parse import build_parser, parse_config

EXIT_USAGE = 2
DESCRIPTION = """Tokenise and pack the training data into the prepared-data cache, offline.
Takes chess_finetune.py's options (only the model's tokenizer and the data options matter);
a training run with the same options then finds the data prepared."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(DESCRIPTION, prog="python -m fsdp_utils.data")
    try:
        config, _ = parse_config(sys.argv[1:] if argv is None else argv, parser)
        from fsdp_utils.data.prepare import prepare_dataset
        from fsdp_utils.data.workers import available_cpus

        if config.num_proc is None:
            config = config.replace(num_proc=available_cpus())

        started = time.monotonic()
        folder = prepare_dataset(config)
    except ValueError as err:
        print(f"\nerror: {err}\n", file=sys.stderr, flush=True)
        return EXIT_USAGE
    print(f"prepared in {time.monotonic() - started:.1f} s: {folder}")
    print("next: sbatch slurm/finetune.sh with the same options (it finds the prepared data)")
    return 0
