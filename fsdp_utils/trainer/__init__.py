"""The trainer: one run's loop, composing the stages below it (`trainer.Trainer`: setup, then
`train` -> `train_step`), with the training method (fsdp_utils/methods/) it is given by
`--method`. It knows no method by name."""
