"""The training method (`--method`, fsdp_utils/methods/) and the options of one method
(`only_for` in their metadata: DPO's, GRPO's, distillation's). GRPO's carry the names and
defaults of TRL's GRPOConfig (trl 1.16.0, trl/trainer/grpo_config.py), so that settings carry
over."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from .section import Section, check_at_least

SECTION = Section(
    "method",
    "training method (fsdp_utils/methods/; DPO: docs/preference.md; GRPO: docs/grpo.md; "
    "distillation: docs/distillation.md)",
)
_opt = SECTION.option


def _dpo(help: str) -> dict[str, Any]:
    return SECTION.option(help, only_for="dpo")


def _distill(help: str) -> dict[str, Any]:
    return SECTION.option(help, only_for="distill")


def _grpo(help: str, **extra: Any) -> dict[str, Any]:
    return SECTION.option(help, only_for="grpo", **extra)


DpoLoss = Literal["sigmoid", "ipo"]
ReferenceMode = Literal["cached", "live"]
# TRL's GKDTrainer: beta 0 is the forward KL, 1 the reverse KL, between them the generalized JSD
DistillLoss = Literal["forward_kl", "reverse_kl", "jsd"]
TeacherQuantize = Literal["none", "nf4"]
GrpoLoss = Literal["dapo", "grpo", "dr_grpo", "bnpo"]
ScaleRewards = Literal["group", "batch", "none"]
ImportanceSampling = Literal["token", "sequence"]
# The methods whose examples are preference pairs (a chosen and a rejected answer, 2 sequences
# each): the data stage prepares pairs for them (fsdp_utils/data/formats.py) and the batch sizes
# count pairs (fsdp_utils/config/batch.py). It is said here, not by the methods package, because
# those stages sit below it (`python -m fsdp_utils.data` prepares a run's data without it).
PAIRED_METHODS = frozenset({"dpo"})
# The methods that score the policy against a reference model: continuing a LoRA adapter
# (--lora --lora_from), their reference is a frozen copy of it (`TrainConfig.reference_adapter`,
# which the model stage builds), as TRL's DPOTrainer takes `ref_adapter_name`.
REFERENCE_METHODS = frozenset({"dpo"})
# The methods that train on prompts and sample their own answers (G completions per prompt):
# the data stage prepares prompts for them (fsdp_utils/data/prompts.py) and the batch sizes
# count prompts (fsdp_utils/config/batch.py).
PROMPT_METHODS = frozenset({"grpo"})


@dataclass
class MethodOptions:
    # A name, not a Literal: the methods are listed in fsdp_utils/methods/registry.py, which
    # a program may extend; a name not there fails the run's checks (`method_class`).
    method: str = field(
        default="sft",
        metadata=_opt(
            "sft: supervised fine-tuning (the loss on the answers); dpo: Direct Preference "
            "Optimization on pairs of a chosen and a rejected answer (columns chosen, rejected "
            "and optionally prompt; docs/preference.md). With dpo the batch sizes count pairs; "
            "grpo: reinforcement learning from rewards on the model's own completions of "
            "prompts (column prompt; --reward_funcs; docs/grpo.md). With grpo the batch sizes "
            "count prompts (--num_generations completions each); "
            "distill: distillation from a bigger model of the same vocabulary (--teacher, "
            "docs/distillation.md)."
        ),
    )
    # The options of one method (`only_for` in their metadata): setting one with another
    # --method is an error (`check`).
    dpo_beta: float = field(
        default=0.1,
        metadata=_dpo("DPO's beta: how far the policy may move from the reference (higher: less)."),
    )
    dpo_loss: DpoLoss = field(
        default="sigmoid",
        metadata=_dpo(
            "sigmoid: DPO's loss; ipo: IPO's squared loss on length-averaged log-probabilities "
            "(TRL's loss_type names)."
        ),
    )
    dpo_label_smoothing: float = field(
        default=0.0,
        metadata=_dpo(
            "With --dpo_loss sigmoid: the assumed fraction of pairs whose labels are flipped "
            "(conservative DPO); 0: plain DPO."
        ),
    )
    reference: ReferenceMode = field(
        default="cached",
        metadata=_dpo(
            "The DPO reference model without --lora: cached (its log-probabilities computed "
            "once before training, sharded, and kept beside the prepared data) or live (a "
            "frozen sharded copy of the model, run at every step: one more forward per step, "
            "one more model in memory). With --lora the reference is the model with its "
            "adapters off."
        ),
    )

    teacher: str | None = field(
        default=None,
        metadata=_distill(
            "The teacher: a hub id (from the offline cache: download_models.py fetches it with "
            "the run's --config) or a local model folder, of the student's tokenizer. Loaded "
            "and sharded beside the student, frozen; with --teacher_cache only when the cache "
            "is not yet written."
        ),
    )
    teacher_revision: str | None = field(
        default=None, metadata=_distill("The teacher's revision (branch, tag or commit).")
    )
    teacher_quantize: TeacherQuantize = field(
        default="none",
        metadata=_distill(
            "none: the teacher in its 16-bit precision (bf16; fp32 with --precision fp32); "
            "nf4: its decoder layers' linear weights in 4 bits (QLoRA's NF4, 0.52 bytes per "
            "parameter)."
        ),
    )
    distill_loss: DistillLoss = field(
        default="forward_kl",
        metadata=_distill(
            "forward_kl: KL(teacher || student), the mass-covering one (TRL's beta 0); "
            "reverse_kl: KL(student || teacher), mode-seeking (TRL's beta 1; MiniLLM, on-policy "
            "distillation); jsd: the generalized Jensen-Shannon divergence of --distill_beta."
        ),
    )
    distill_beta: float = field(
        default=0.5,
        metadata=_distill(
            "With --distill_loss jsd: the teacher's weight in the mixture (TRL GKDTrainer's "
            "beta, strictly between 0 and 1; 0.5: the symmetric JSD)."
        ),
    )
    distill_temperature: float = field(
        default=1.0,
        metadata=_distill(
            "Both models' logits are divided by this before the divergence (above 1: softer "
            "distributions); the cross-entropy on the labels stays at 1."
        ),
    )
    distill_alpha: float = field(
        default=0.5,
        metadata=_distill(
            "loss = alpha * divergence + (1 - alpha) * cross-entropy on the labels, per target "
            "token (torchtune's kd_ratio); 1: the divergence alone (TRL's GKD). Batches the "
            "student sampled (--lmbda) carry the divergence alone."
        ),
    )
    teacher_cache: str | None = field(
        default=None,
        metadata=_distill(
            "A folder for the teacher's top --teacher_top_k log-probabilities of every target "
            "token of the prepared data (train and eval). Written when empty (with --teacher: "
            "sharded, resumed by a requeued job after the time limit), then read: a run with a "
            "complete cache loads no teacher. Refused when it holds another teacher's or data "
            "set's."
        ),
    )
    teacher_top_k: int = field(
        default=64,
        metadata=_distill(
            "Log-probabilities kept per token in --teacher_cache (with the rest's mass): "
            "8 x K + 4 bytes per token (docs/distillation.md has the disk per million tokens)."
        ),
    )
    teacher_cache_only: bool = field(
        default=False,
        metadata=_distill(
            "Write --teacher_cache and end: the teacher's job of its own (on a partition with "
            "the memory for it); the student's job then reads the cache without --teacher."
        ),
    )
    lmbda: float = field(
        default=0.0,
        metadata=_distill(
            "The share of optimizer steps whose completions the student samples from the "
            "prompts of the data (on-policy, GKD's lambda; TRL's lmbda), scored by the live "
            "teacher token by token; 0: the data's answers only."
        ),
    )
    distill_max_new_tokens: int = field(
        default=128,
        metadata=_distill(
            "With --lmbda: at most this many tokens per sampled completion (TRL's max_new_tokens)."
        ),
    )
    # GRPO (docs/grpo.md): TRL's GRPOConfig names and defaults (trl 1.16.0).
    reward_funcs: str | None = field(
        default=None,
        metadata=_grpo(
            "Comma-separated reward functions: FILE.py:FUNCTION (TRL's signature: prompts, "
            "completions, completion_ids, the dataset's other columns and **kwargs; returns "
            "a float, or None to skip, per completion) or a built-in name (docs/grpo.md: "
            "chess_legal, chess_engine, chess_format, exact_answer, length).",
            joined=True,
        ),
    )
    reward_weights: str | None = field(
        default=None,
        metadata=_grpo(
            "Comma-separated weight of each reward function (default: all 1.0).", joined=True
        ),
    )
    num_generations: int = field(
        default=8,
        metadata=_grpo("Completions sampled per prompt (G), at least 2: a group's rewards are "
                       "compared with each other."),
    )  # fmt: skip
    max_completion_length: int = field(
        default=512,
        metadata=_grpo(
            "Tokens sampled per completion at most; a prompt and its completion must fit "
            "--max_seq_length."
        ),
    )
    temperature: float = field(
        default=1.0, metadata=_grpo("Sampling temperature of the completions (above 0).")
    )
    top_k: int = field(default=0, metadata=_grpo("Sample from the k most likely tokens (0: all)."))
    top_p: float = field(
        default=1.0, metadata=_grpo("Sample from the smallest set of tokens of this probability.")
    )
    loss_type: GrpoLoss = field(
        default="dapo",
        metadata=_grpo(
            "How the per-token losses are averaged (docs/grpo.md): dapo: over the step's "
            "completion tokens (TRL's default); grpo: over each completion's tokens, then over "
            "completions; dr_grpo: over completions x --max_completion_length; bnpo: over each "
            "micro-batch's completion tokens."
        ),
    )
    scale_rewards: ScaleRewards = field(
        default="group",
        metadata=_grpo(
            "Advantages: reward minus its group's mean, divided by the standard deviation of "
            "the group (group), of the whole step (batch), or not divided (none: Dr. GRPO)."
        ),
    )
    epsilon: float = field(
        default=0.2, metadata=_grpo("Lower clipping bound of the ratio: 1 - epsilon.")
    )
    epsilon_high: float | None = field(
        default=None,
        metadata=_grpo("Upper clipping bound: 1 + epsilon_high (default: --epsilon; DAPO: 0.28)."),
    )
    importance_sampling_level: ImportanceSampling = field(
        default="token",
        metadata=_grpo(
            "token: a probability ratio per token; sequence: one per completion, the mean of "
            "its tokens' log-ratios (GSPO)."
        ),
    )
    beta: float = field(
        default=0.0,
        metadata=_grpo(
            "Weight of the KL penalty (k3 estimator) against the reference: the starting model "
            "(a frozen sharded copy; with --lora the adapters off). 0: no reference at all."
        ),
    )
    # TRL's use_bias_correction_kl (default True) turned around: a flag can only turn on.
    no_bias_correction_kl: bool = field(
        default=False,
        metadata=_grpo(
            "The KL term without the probability ratio it is multiplied by by default (TRL's "
            "use_bias_correction_kl=False; the ratio makes the KL gradient unbiased: "
            "DeepSeek-V3.2)."
        ),
    )
    num_iterations: int = field(
        default=1,
        metadata=_grpo(
            "Optimizer steps per rollout (mu): the same completions trained on again, with "
            "their log-probabilities from when they were sampled."
        ),
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata=_grpo("Leave completions that ran out of tokens out of the loss (DAPO)."),
    )
    log_completions_every: int = field(
        default=10,
        metadata=_grpo(
            "Every N steps, log a few completions with their rewards (completions.jsonl in the "
            "run folder; 0: never)."
        ),
    )

    @property
    def trains_on_pairs(self) -> bool:
        return self.method in PAIRED_METHODS

    @property
    def trains_on_prompts(self) -> bool:
        return self.method in PROMPT_METHODS

    @property
    def sequences_per_example(self) -> int:
        """Sequences one example of the batch becomes: 2 for a pair, G for a prompt, else 1."""
        if self.trains_on_pairs:
            return 2
        return self.num_generations if self.trains_on_prompts else 1


def check(options: MethodOptions) -> None:
    """A method's own options need that method; DPO's values."""
    fields = dataclasses.fields(MethodOptions)
    owners = {f.metadata["only_for"] for f in fields if "only_for" in f.metadata}
    for owner in sorted(owners - {options.method}):
        changed = [
            f"--{g.name}"
            for g in fields
            if g.metadata.get("only_for") == owner and getattr(options, g.name) != g.default
        ]
        if changed:
            raise ValueError(
                f"{', '.join(changed)}: option(s) of --method {owner}, which --method "
                f"{options.method} does not read. Add --method {owner}"
                + " (and a dataset of chosen/rejected pairs)" * (owner in PAIRED_METHODS)
                + ", or drop them."
            )
    if options.method == "distill":
        _check_distill(options)
    if options.method == "grpo":
        _check_grpo(options)
    if options.method != "dpo":
        return
    if options.dpo_beta <= 0:
        raise ValueError(f"--dpo_beta must be positive, got {options.dpo_beta}.")
    if not 0.0 <= options.dpo_label_smoothing < 0.5:
        raise ValueError(
            f"--dpo_label_smoothing must be in [0, 0.5), got {options.dpo_label_smoothing}."
        )
    if options.dpo_label_smoothing and options.dpo_loss != "sigmoid":
        raise ValueError("--dpo_label_smoothing applies to --dpo_loss sigmoid only.")


def _check_distill(options: MethodOptions) -> None:
    """Distillation's values and the combinations that cannot work, each with its fix."""
    if options.teacher is None and options.teacher_cache is None:
        raise ValueError(
            "--method distill needs a teacher: --teacher MODEL (loaded beside the student), "
            "or --teacher_cache DIR written by a job of the teacher's own (docs/distillation.md)."
        )
    if options.teacher_cache_only and (options.teacher is None or options.teacher_cache is None):
        raise ValueError(
            "--teacher_cache_only writes the teacher's cache and ends: give both --teacher MODEL "
            "and --teacher_cache DIR."
        )
    if not 0.0 < options.distill_beta < 1.0:
        raise ValueError(
            f"--distill_beta must be strictly between 0 and 1, got {options.distill_beta} (its "
            "ends are --distill_loss forward_kl, beta 0, and reverse_kl, beta 1)."
        )
    if options.distill_beta != 0.5 and options.distill_loss != "jsd":
        raise ValueError("--distill_beta weighs --distill_loss jsd's mixture: add it or drop beta.")
    if not options.distill_temperature > 0:
        raise ValueError(
            f"--distill_temperature must be above 0, got {options.distill_temperature}."
        )
    for name in ("distill_alpha", "lmbda"):
        if not 0.0 <= getattr(options, name) <= 1.0:
            raise ValueError(f"--{name} must be in [0, 1], got {getattr(options, name)}.")
    check_at_least(options, ("teacher_top_k", "distill_max_new_tokens"))
    if options.lmbda > 0 and options.teacher is None:
        raise ValueError(
            f"--lmbda {options.lmbda}: the student's own samples are scored by the live "
            "teacher, which a cache written before training cannot hold. Give --teacher MODEL "
            "(with or without --teacher_cache for the data's batches), or --lmbda 0."
        )


def reward_names(options: MethodOptions) -> list[str]:
    """--reward_funcs as a list (FILE.py:FUNCTION or built-in names)."""
    return [n.strip() for n in (options.reward_funcs or "").split(",") if n.strip()]


def reward_weights(options: MethodOptions) -> list[float]:
    """--reward_weights as floats, one per reward function (default: 1.0 each)."""
    if options.reward_weights is None:
        return [1.0] * len(reward_names(options))
    try:
        return [float(w) for w in options.reward_weights.split(",")]
    except ValueError:
        raise ValueError(
            f"--reward_weights {options.reward_weights!r}: expected comma-separated numbers, "
            "one per reward function, e.g. --reward_weights 1.0,0.5."
        ) from None


def _check_grpo(options: MethodOptions) -> None:
    names = reward_names(options)
    if not names:
        raise ValueError(
            "--method grpo needs rewards: --reward_funcs my_rewards.py:correct (TRL's "
            "reward-function signature) or a built-in one, e.g. --reward_funcs exact_answer "
            "(docs/grpo.md lists them)."
        )
    weights = reward_weights(options)
    if len(weights) != len(names):
        raise ValueError(
            f"--reward_weights gives {len(weights)} weight(s) for {len(names)} reward "
            f"function(s) ({', '.join(names)}): give one per function, in the same order."
        )
    if options.num_generations < 2:
        raise ValueError(
            f"--num_generations {options.num_generations}: GRPO compares the rewards of a "
            "prompt's completions with each other, so it needs at least 2 per prompt (TRL's "
            "default is 8): --num_generations 8."
        )
    if options.max_completion_length < 1:
        raise ValueError(
            f"--max_completion_length must be at least 1, got {options.max_completion_length}."
        )
    if not options.temperature > 0 or options.top_k < 0 or not 0 < options.top_p <= 1:
        raise ValueError(
            "GRPO samples its completions: --temperature must be above 0, --top_k at least 0 "
            f"(0: off) and 0 < --top_p <= 1; got {options.temperature}, {options.top_k}, "
            f"{options.top_p}."
        )
    if options.epsilon <= 0 or (options.epsilon_high is not None and options.epsilon_high <= 0):
        raise ValueError(
            f"--epsilon and --epsilon_high must be positive, got {options.epsilon} and "
            f"{options.epsilon_high}."
        )
    if options.beta < 0:
        raise ValueError(f"--beta must be 0 (no KL term) or positive, got {options.beta}.")
    if options.num_iterations < 1:
        raise ValueError(f"--num_iterations must be at least 1, got {options.num_iterations}.")
    if options.log_completions_every < 0:
        raise ValueError(
            f"--log_completions_every must be 0 (never) or more, got {options.log_completions_every}."
        )
