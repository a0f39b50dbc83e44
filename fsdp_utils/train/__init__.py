"""Training's shared machinery, below the methods (fsdp_utils/methods/) and the trainer
(fsdp_utils/trainer/), knowing neither.

`step` runs one optimizer step (`TrainStep`: micro-batches, the loss normalised by the step's
count, gradient accumulation and sync, clipping, the non-finite checks); `loss` is the
token-summed causal-LM loss, in chunks; `optim` builds the optimizer and the learning-rate
schedule; `router_loss` is the load-balancing term of mixture-of-experts models; `evaluate` the
held-out token loss; `samples` the answers to --sample_prompts; `timelimit` decides when to save
and stop (Slurm time limit, signals, stop file).
"""
