"""Training methods (objectives), between the trainer above and the step machinery below.

    base.py       the Method interface: what a method trains on, its step (the loss and metrics
                  of a micro-batch), its evaluation, what it adds to the checkpoint identity
                  and the planner, what it needs before the first step and at export
    registry.py   `--method NAME` -> its Method (`METHODS`, `register_method`)
    sft.py        supervised fine-tuning: the token loss (the default)
    dpo/          Direct Preference Optimization: pairs, a reference, DPO's loss
    distill/      distillation from a bigger model: a sharded teacher, live or cached, and
                  TRL's GKD losses in chunks
    grpo/         Group Relative Policy Optimization: prompts, rollouts, rewards, GRPO's loss

The trainer (`fsdp_utils.trainer`) composes a method and never asks which one it is; the
methods build on `fsdp_utils.train` (TrainStep, the chunked loss, the optimizer), which knows
none of them. docs/development.md ("Adding a training method") walks through a new one.
"""
