"""Configuration: what a run is, before anything is loaded.

`train_config.TrainConfig` is the single source of truth for every training setting: it gathers
the options of each stage, declared in `options/` (one module per stage; their fields' metadata
are the `--help` texts); `parse` is the thin layer that fills it from the command line
and YAML/JSON files; `batch` derives gradient accumulation from the fixed total batch;
`layout` says where a run keeps its files; `job` says which Slurm job and leg a process runs in.
Nothing here imports torch, the Hugging Face libraries, or any other stage.
"""
