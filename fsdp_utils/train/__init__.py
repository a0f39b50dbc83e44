"""Training: the loop and its parts.

`trainer` composes the stages for one run (`train` -> `train_step`); `optim` builds the
optimizer and the learning-rate schedule; `loss` is the token-summed causal-LM loss;
`timelimit` decides when to save and stop (Slurm time limit, signals, stop file).
"""
