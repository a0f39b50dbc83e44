"""Check tests/trl_grpo_reference.py (TRL's GRPO arithmetic, copied) against the installed trl
itself: run where trl 1.16.0 is importable, e.g. without touching the project's environment

    pip install --target /tmp/trl_target --no-deps trl==1.16.0
    PYTHONPATH=/tmp/trl_target:. python tests/trl_crosscheck.py

(trl's own dependencies, accelerate, datasets >= 4.7, pandas, are those of `make setup`'s newest
versions). It calls trl's `GRPOTrainer._compute_loss` unbound, on a stand-in trainer whose
forward returns the given log-probabilities, and trl's `nanstd`, on every case of
tests/test_grpo_loss.py, and prints the largest differences from the copy (0 expected: the
copy is TRL's statements). Not part of the suite: the suite has no trl."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class _Accelerator:
    num_processes = 1

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1)

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return x


def _stand_in(args: SimpleNamespace, logps: torch.Tensor) -> SimpleNamespace:
    from collections import defaultdict

    trainer = SimpleNamespace(
        loss_type=args.loss_type, epsilon_low=args.epsilon_low, epsilon_high=args.epsilon_high,
        importance_sampling_level=args.importance_sampling_level, beta=args.beta,
        max_completion_length=args.max_completion_length,
        current_gradient_accumulation_steps=args.gradient_accumulation_steps,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
        vllm_importance_sampling_correction=False, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, accelerator=_Accelerator(), model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(
            use_bias_correction_kl=args.use_bias_correction_kl, delta=None,
            steps_per_generation=args.steps_per_generation,
        ),
    )  # fmt: skip
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (
        logps,
        torch.zeros_like(logps),
        None,
    )
    return trainer


def main() -> int:
    import trl
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import nanstd

    from tests import test_grpo_loss as cases
    from tests import trl_grpo_reference as copy

    print(f"trl {trl.__version__} from {trl.__file__}")
    worst_loss = worst_grad = worst_metric = 0.0
    for loss_type, level, beta, bias_kl, off_policy in cases.CASES:
        inputs = cases._inputs(1, off_policy=off_policy, beta=beta)
        for parts in (1, 2):
            args = copy.trl_args(
                loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, beta=beta,
                importance_sampling_level=level, max_completion_length=cases.MAX_COMPLETION,
                use_bias_correction_kl=bias_kl, gradient_accumulation_steps=parts,
            )  # fmt: skip
            for rows in torch.arange(cases.ROWS).chunk(parts):
                micro = {k: v[rows] for k, v in inputs.items() if k != "logps"}
                micro["num_items_in_batch"] = inputs["completion_mask"].sum()
                ids = torch.zeros_like(micro["completion_mask"], dtype=torch.long)
                micro.update(prompt_ids=ids[:, :1], prompt_mask=ids[:, :1] + 1, completion_ids=ids)
                theirs_logps = inputs["logps"][rows].clone().requires_grad_(True)
                copy_logps = inputs["logps"][rows].clone().requires_grad_(True)
                trainer = _stand_in(args, theirs_logps)
                theirs = GRPOTrainer._compute_loss(trainer, None, micro)
                ours, metrics = copy.compute_loss(args, copy_logps, micro)
                theirs.backward()
                ours.backward()
                worst_loss = max(worst_loss, abs(theirs.item() - ours.item()))
                grad = (theirs_logps.grad - copy_logps.grad).abs().max().item()
                worst_grad = max(worst_grad, grad)
                for name, value in metrics.items():
                    logged = trainer._metrics["train"][name][-1]
                    worst_metric = max(worst_metric, abs(logged - value))
    values = torch.randn(5, 4).masked_fill(torch.rand(5, 4) < 0.2, torch.nan)
    std = max(
        (nanstd(values, dim=1) - copy.nanstd(values, dim=1)).nan_to_num().abs().max().item(),
        (nanstd(values) - copy.nanstd(values)).nan_to_num().abs().item(),
    )
    print(f"{len(cases.CASES)} cases x 1 and 2 micro-batches: largest difference of the loss "
          f"{worst_loss:.3g}, of a gradient {worst_grad:.3g}, of a logged metric "
          f"{worst_metric:.3g}; nanstd {std:.3g}")  # fmt: skip
    return 0 if max(worst_loss, worst_grad, worst_metric, std) == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
