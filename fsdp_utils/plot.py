"""`python -m fsdp_utils.plot RUN... [-o runs.png]`: training curves of one run, several, or a
sweep. The command lives in `fsdp_utils.metrics.plot`."""

from fsdp_utils.metrics.plot import main

if __name__ == "__main__":
    raise SystemExit(main())
