"""Model: build the architecture on the meta device, find its decoder layers, load weights.

`build` instantiates a transformers model from its config with no memory, finds the decoder
layers and materialises (sharded) parameters; `weights` maps checkpoint keys to model keys and
loads safetensors slice by slice, each rank reading only what it owns; `lora` is the peft
transform applied before parallelisation.
"""
