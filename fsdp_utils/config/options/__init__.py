"""The options of a run, one module per stage that owns them; `TrainConfig`
(fsdp_utils/config/train_config.py) gathers their fields into one flat dataclass, the single
source of truth, so `config.learning_rate` reads as it always did and config.json is unchanged.

    assets.py       the model and dataset in the offline cache
    batch.py        the total batch (held fixed), the per-device batch, the sequence length
    optimizer.py    optimizer, learning-rate schedule, steps or epochs, seed, frozen layers
    parallelism.py  FSDP2/DDP, sharding, offload, activation checkpointing, precision, attention
    data.py         formats, templates, packing, masking, the prepared-data cache
    evaluation.py   held-out loss, benchmarks, chess evaluation, sample prompts
    checkpoints.py  run folder, checkpoints, time limits, the final model
    lora.py         LoRA adapters
    method.py       the training method (--method) and its options (DPO's)
    metrics.py      logging, profiling and trackers

An option is a field in its stage's class, with its help text (`SECTION.option`): `--help`
shows it in the stage's section, the command line and config files take it, config.json holds
it. Checks of one stage's values go in that module's `check`; checks that read two stages are
in train_config.py (`validate_config`).
"""
