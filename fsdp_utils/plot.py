"""`python -m fsdp_utils.plot RUN... [-o runs.png]`: training curves of one run, several, or a
sweep (`fsdp_utils.metrics.plot`). `python -m fsdp_utils.plot --compare BASE_RESULTS RESULTS
[-o compare.png]`: lm-eval's scores of two models side by side, with their standard errors
(`fsdp_utils.lm_harness.compare_plot`)."""

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a == "--compare" or a.startswith("--compare=") for a in args):
        from fsdp_utils.lm_harness.compare_plot import main as compare_main

        return compare_main(args)
    from fsdp_utils.metrics.plot import main as curves_main

    return curves_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
