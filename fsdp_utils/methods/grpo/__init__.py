"""Group Relative Policy Optimization (`--method grpo`): reinforcement learning from rewards on
the model's own completions, as TRL's GRPOTrainer defines it (trl 1.16.0), under FSDP2 in the
training processes themselves (no Ray, no inference server).

    loss.py             the objective in small functions of plain tensors: advantages, the
                        clipped surrogate, the KL term, the loss types' normalisations
    rewards.py          reward functions: loaded by name (FILE.py:FUNCTION, or built in), called
                        with TRL's signature, checked
    builtin_rewards.py  exact_answer, length, chess_format, chess_legal, chess_engine
    rollouts.py         the rollout phase (the policy samples, the rewards score) and its buffer
    step.py             the step: rollout, then the update with GRPO's loss
    method.py           the Method the trainer composes

docs/grpo.md is the user's guide.
"""
