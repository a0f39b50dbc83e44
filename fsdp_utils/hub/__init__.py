"""The offline asset cache: what `download_models.py` writes on the login node and the trainer
reads on compute nodes.

Modules, from pure to networked:
- `specs`: what to fetch (`AssetSpec`), from the command line, an assets file or a training config;
- `selection`: which files of a repo to fetch (safetensors, config, tokenizer; dataset globs);
- `manifest`: the pinned record of every asset (commit, files, sizes, sha256), written atomically;
- `cache`: Hugging Face cache layout, free-space check, leftovers of interrupted downloads;
- `hashing`: sha256 and git blob ids of cached files;
- `remote`: repo metadata from the Hub (or a mirror), with errors turned into clear messages;
- `download`: plan, check disk, download in parallel, verify, record;
- `verify`: offline re-hash of the cache against the manifest;
- `offline_check`: load every asset with the offline variables set and, if possible, no network;
- `offline`: the Hugging Face offline variables, set before any Hugging Face import;
- `resolve`: the compute side: `--model`/`--dataset` to local files through the manifest, never
  touching the network, and the model's config read once.

The `download_models.py` command line is `fsdp_utils.download`.

Importing this package does not import `huggingface_hub`: the offline variables must be set
before that happens (see `fsdp_utils.hub.offline`).
"""
