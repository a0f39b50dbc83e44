"""`python -m fsdp_utils.evaluate --model MODEL --tasks arc_easy,...`: standard benchmarks
(lm-evaluation-harness) on the model sharded with FSDP2 as in training, offline. The command
lives in `fsdp_utils.lm_harness.cli`; the memory plan that sizes `--batch_size auto` on GPUs in
`fsdp_utils.plan.inference` (a stage above the harness, so it is handed in here)."""

from fsdp_utils.lm_harness.cli import main
from fsdp_utils.plan.inference import eval_token_budget

if __name__ == "__main__":
    raise SystemExit(main(planner=eval_token_budget))
