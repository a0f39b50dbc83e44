"""Distillation from a bigger model (`--method distill --teacher MODEL`) on the FSDP2 trainer.

loss.py       forward KL, reverse KL and the generalized JSD (TRL GKDTrainer's
              definitions) at a temperature, mixed with the labels' cross-entropy, per
              target token from a chunk of logits: the student's against the teacher's
              logits, or against its cached top K
teacher.py    the teacher as the step reads it: live (built by the model stage,
              fsdp_utils/model/teacher.py, sharded beside the student, frozen) or cached
cache.py      --teacher_cache: the teacher's top-K log-probabilities of every target token,
              written before training (resumed after a stop), read without the teacher
step.py       the optimizer step (a TrainStep whose loss is distillation's) and the
              evaluation of the held-out blocks
method.py     the Method the trainer composes (`fsdp_utils.methods.base`)
"""
