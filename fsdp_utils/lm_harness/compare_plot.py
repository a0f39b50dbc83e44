"""`python -m fsdp_utils.plot --compare BASE_RESULTS RESULTS -o compare.png`: the `--compare`
table drawn. One panel per metric (`acc,none`, `exact_match,strict-match`, ...), the tasks that
report it down the side, the base model's bar and this one's beside each other with lm-eval's
standard error as an error bar (none where lm-eval gives none); the panel's title says whether
higher is better (lm-eval's own `higher_is_better`). The drawn numbers go to a CSV beside the PNG
(task, metric, base, base_se, this, this_se). Headless (matplotlib's Agg): no display needed.
Two results scored different ways (chat template or not, ...) are refused, as `--compare`
refuses them (`fsdp_utils.lm_harness.compare.check_same_way`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fsdp_utils.arguments import ArgumentParser
from fsdp_utils.lm_harness.compare import (
    Compared,
    check_same_way,
    compared_metrics,
    higher_is_better,
    load_results,
)
from fsdp_utils.lm_harness.scoring import ScoredWay
from fsdp_utils.metrics.figure import save_png_and_csv

EXIT_USAGE = 2
BASE_COLOR, THIS_COLOR = "0.6", "C0"
MAX_LABEL = 36


def model_label(results: dict[str, Any], fallback: str) -> str:
    """What `--model` said when these results were made (this toolkit's section, else
    lm-eval's config), else `fallback`."""
    ours = results.get("fsdp_utils", {}).get("model", {}).get("model")
    theirs = results.get("config", {}).get("model")
    label = str(ours or (theirs if isinstance(theirs, str) else None) or fallback)
    # A long folder path keeps its end (the run's name), so that the title fits the figure.
    return label if len(label) <= MAX_LABEL else "..." + label[-(MAX_LABEL - 3) :]


def by_metric(rows: Sequence[Compared]) -> dict[str, list[Compared]]:
    panels: dict[str, list[Compared]] = {}
    for row in rows:
        panels.setdefault(row.metric, []).append(row)
    return panels


def plot_comparison(
    base: dict[str, Any],
    new: dict[str, Any],
    *,
    labels: tuple[str, str] = ("base", "this"),
    title: str | None = None,
) -> tuple[Any, dict[str, list[Compared]]]:
    """The figure (not shown; save it) and, per panel (metric), the rows drawn in it, top to
    bottom. ValueError when the two results share no task and metric."""
    from matplotlib.container import BarContainer
    from matplotlib.figure import Figure

    panels = by_metric(compared_metrics(base, new))
    if not panels:
        raise ValueError(
            "The two results have no task and metric in common: nothing to compare. Check that "
            "both were made with the same --tasks."
        )
    heights = [0.45 * len(rows) + 1.0 for rows in panels.values()]
    fig = Figure(figsize=(8.0, sum(heights) + 0.9), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=heights)[:, 0]
    bar = 0.38
    for ax, (metric, rows) in zip(axes, panels.items(), strict=True):
        places = list(range(len(rows)))[::-1]  # the first task on top
        for offset, side, label, color in (
            (bar / 2, "base", labels[0], BASE_COLOR),
            (-bar / 2, "this", labels[1], THIS_COLOR),
        ):
            values = [getattr(r, side) for r in rows]
            # No standard error (lm-eval's "N/A"): no error bar, rather than one of width 0.
            errors = [_or_nan(getattr(r, f"{side}_se")) for r in rows]
            ax.barh(
                [p + offset for p in places], values, height=bar, xerr=errors, capsize=3,
                color=color, label=label, error_kw={"elinewidth": 1.0},
            )  # fmt: skip
        ax.set_yticks(places, [r.task for r in rows])
        better = higher_is_better(new, rows[0].task, metric)
        hint = {True: " (higher is better)", False: " (lower is better)", None: ""}[better]
        ax.set_title(f"{metric}{hint}", loc="left", fontsize="medium")
        ax.grid(True, axis="x", alpha=0.3)
        ends = [_end(r) for r in rows]
        for place, row, end in zip(places, rows, ends, strict=True):
            se = f" ({row.change_in_se:+.1f} se)" if row.change_in_se is not None else ""
            ax.annotate(
                f"{row.change:+.4f}{se}", (end, place), xytext=(6, 0),
                textcoords="offset points", va="center", fontsize="x-small",
            )  # fmt: skip
        # From 0 (or below, for negative scores), with room on the right for the changes.
        low = min(0.0, *(min(r.base, r.this) for r in rows))
        high = max(0.0, *ends)
        ax.set_xlim(low, high + 0.25 * ((high - low) or 1.0))
    bars = [c for c in axes[0].containers if isinstance(c, BarContainer)]
    fig.legend(handles=bars, loc="outside lower center", ncols=2, fontsize="small")
    fig.suptitle(
        title or f"{labels[1]} against {labels[0]}\n(error bars: lm-eval's standard errors)"
    )
    return fig, panels


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def _end(row: Compared) -> float:
    """Where the pair's bars and error bars end: the change is written after it."""
    return max(row.base + (row.base_se or 0.0), row.this + (row.this_se or 0.0))


CSV_HEADER = ("task", "metric", "base", "base_se", "this", "this_se")


def csv_rows(panels: dict[str, list[Compared]]) -> Iterator[list[Any]]:
    for rows in panels.values():
        for r in rows:
            yield [r.task, r.metric, r.base, r.base_se, r.this, r.this_se]


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m fsdp_utils.plot",
        description="Draw base against fine-tuned per task and metric, with lm-eval's standard "
        "errors, into a PNG (and the drawn numbers into a CSV beside it).",
    )
    parser.add_argument("--compare", type=Path, required=True, metavar="BASE_RESULTS",
                        help="the base model's results JSON (or its folder)")  # fmt: skip
    parser.add_argument("results", type=Path, metavar="RESULTS",
                        help="the results to compare with it (JSON or folder, e.g. runs/x/lm_eval)")  # fmt: skip
    parser.add_argument("-o", "--output", type=Path, default=Path("compare.png"),
                        help="the PNG to write (default: compare.png; the CSV goes beside it)")  # fmt: skip
    parser.add_argument("--title", help="figure title")
    args = parser.parse_args(argv)
    try:
        base, new = load_results(args.compare), load_results(args.results, flag="RESULTS")
        check_same_way(
            base, ScoredWay.of(new), base_name=str(args.compare), this_name=str(args.results)
        )
        labels = (model_label(base, "base"), model_label(new, "this"))
        fig, panels = plot_comparison(base, new, labels=labels, title=args.title)
        rows = sum(len(r) for r in panels.values())
        detail = f"{rows} task/metric pair(s) in {len(panels)} panel(s)"
        save_png_and_csv(fig, args.output, CSV_HEADER, csv_rows(panels), detail=detail)
    except (ValueError, OSError) as err:
        print(f"\nerror: {err}\n", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
