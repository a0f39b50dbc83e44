"""Direct Preference Optimization (`--method dpo`) on the FSDP2 trainer.

    loss.py       the DPO and IPO losses (TRL's formulas) from sequence log-probabilities,
                  which come from the training loss's chunked path (train/loss.py)
    reference.py  the reference model's log-probabilities: the same model with the LoRA
                  adapters off, a cache computed once (sharded) before training and indexed by
                  each pair's dataset row, or a frozen sharded copy (`--reference live`)
    step.py       the optimizer step over pairs (a TrainStep whose loss is DPO's) and the
                  evaluation of the held-out pairs
    method.py     the Method the trainer composes (`fsdp_utils.methods.base`)

The data side (TRL's preference formats, pairs kept whole) is fsdp_utils/data/preference.py.
"""
