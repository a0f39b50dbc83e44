"""`python -m fsdp_utils.evaluate --model MODEL --tasks arc_easy,...`: standard benchmarks
(lm-evaluation-harness) on the model sharded with FSDP2 as in training, offline. The command
lives in `fsdp_utils.lm_harness.cli`; the memory plan that sizes `--batch_size auto` on GPUs in
`fsdp_utils.plan.inference` (a stage above the harness, so it is handed in here)."""

from typing import Any

from fsdp_utils.lm_harness.cli import main


def plan_token_budget(config: Any, seq_len: int) -> tuple[int, str]:
    # Imported when called: the planner imports transformers, which must come after main()
    # has set the offline variables.
    from fsdp_utils.plan.inference import eval_token_budget

    return eval_token_budget(config, seq_len)


if __name__ == "__main__":
    raise SystemExit(main(planner=plan_token_budget))
