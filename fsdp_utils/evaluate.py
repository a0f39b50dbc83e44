"""`python -m fsdp_utils.evaluate --model MODEL --tasks arc_easy,...`: standard benchmarks
(lm-evaluation-harness) on the model sharded with FSDP2 as in training, offline. The command
lives in `fsdp_utils.lm_harness.cli`."""

from fsdp_utils.lm_harness.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
