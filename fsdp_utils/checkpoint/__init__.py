"""Checkpoints and exports: what a run writes to disk and how it reads it back.

`sharded` saves and resumes DCP checkpoints on any world size; `hf_folder` writes Hugging Face
model folders (safetensors + config + tokenizer); `lora_adapters` writes PEFT adapter folders
and merged models; `export` turns a sharded checkpoint into either, offline
(`python -m fsdp_utils.export`); `storage` checks before training that the checkpoints fit
on the disk; `saved_model` loads a saved model (a hub id, a folder, a run's final model, a LoRA
adapter) sharded with FSDP2 as the trainer builds it, for the evaluations (lm-eval's and the
chess evaluation's).
"""
