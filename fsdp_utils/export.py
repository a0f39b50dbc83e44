"""`python -m fsdp_utils.export CHECKPOINT FOLDER`: a sharded training checkpoint as a Hugging Face
model folder (or a PEFT adapter folder). The command lives in `fsdp_utils.checkpoint.export`."""

from fsdp_utils.checkpoint.export import main

if __name__ == "__main__":
    raise SystemExit(main())
