"""`--compare BASE_RESULTS`: the base model's lm-eval results against these, task by task and
metric by metric, with lm-eval's standard errors.

    task      metric               base              this              change
    arc_easy  acc,none             0.7424 ± 0.0090   0.7551 ± 0.0088   +0.0127 (1.0 se)

`se` is the change over the combined standard error sqrt(se_base^2 + se_this^2) (the two runs
scored the same documents, so this overstates the noise of the difference: a paired test would be
tighter). Rows that either side lacks are left out.

Two results scored different ways (one with the chat template, one as plain text; few-shot
examples as turns in one only; another system instruction) are refused (`check_same_way`):
their difference measures the prompt format as much as the model (a chat model's scores move
by more than a fine-tune's usual gain when its template is dropped), so the table would
mislead. The message names the options that score both alike. The way is read from lm-eval's
own keys in the results files (`fsdp_utils.lm_harness.scoring.ScoredWay`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_utils.lm_harness.scoring import ScoredWay


def load_results(path: str | Path, *, flag: str = "--compare") -> dict[str, Any]:
    """A results JSON, or the newest `results_*.json` in a folder (lm-eval's own layout, where
    the files sit one folder deeper, too). ValueError when there is none."""
    path = Path(path).expanduser()
    if path.is_dir():
        found = sorted(path.glob("results_*.json")) or sorted(path.glob("*/results_*.json"))
        if not found:
            raise ValueError(f"{flag} {path}: no results_*.json in that folder.")
        path = max(found, key=lambda p: p.name.split("results_", 1)[1])
    try:
        results = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{flag} {path}: not a readable lm-eval results file ({err}).") from err
    if not isinstance(results, dict) or "results" not in results:
        raise ValueError(f"{flag} {path}: no `results` in it; is it lm-eval's results JSON?")
    return results


def check_same_way(
    base: dict[str, Any], this: ScoredWay, *, base_name: str, this_name: str = "this evaluation"
) -> None:
    """ValueError when the base results were scored another way than `this` (see above)."""
    theirs = ScoredWay.of(base)
    if theirs == this:
        return
    raise ValueError(
        f"--compare {base_name}: the two results were scored different ways, so their "
        "difference would measure the prompt format as much as the models: the base "
        f"{theirs.describe()}, {this_name} {this.describe()}. Score both the same way: rerun "
        f"the base {this.options()}, or score this model as the base was, {theirs.options()}."
    )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Compared:
    """One task's metric in both results (`metric` as lm-eval keys it: `acc,none`)."""

    task: str
    metric: str
    base: float
    base_se: float | None
    this: float
    this_se: float | None

    @property
    def change(self) -> float:
        return self.this - self.base

    @property
    def change_in_se(self) -> float | None:
        """The change over the combined standard error, when both sides have one."""
        if self.base_se is None or self.this_se is None or not (self.base_se or self.this_se):
            return None
        return self.change / math.hypot(self.base_se, self.this_se)


def compared_metrics(base: dict[str, Any], new: dict[str, Any]) -> list[Compared]:
    """Every task and metric both results hold, in task then metric order."""
    found: list[Compared] = []
    for task in sorted(set(base["results"]) & set(new["results"])):
        mine, theirs = new["results"][task], base["results"][task]
        for key in sorted(mine):
            metric, _, where = key.partition(",")
            if metric.endswith("_stderr") or key == "alias" or not where:
                continue
            value, before = _number(mine[key]), _number(theirs.get(key))
            if value is None or before is None:
                continue
            stderr_key = f"{metric}_stderr,{where}"
            se, se_before = _number(mine.get(stderr_key)), _number(theirs.get(stderr_key))
            found.append(Compared(task, key, before, se_before, value, se))
    return found


def higher_is_better(results: dict[str, Any], task: str, metric: str) -> bool | None:
    """lm-eval's own word on the metric (`higher_is_better` in its results), None if silent."""
    value = results.get("higher_is_better", {}).get(task, {}).get(metric.partition(",")[0])
    return value if isinstance(value, bool) else None


def comparison_rows(base: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, ...]]:
    """(task, metric, base, this, change) per metric both results hold, as text."""
    rows: list[tuple[str, ...]] = []
    for c in compared_metrics(base, new):
        change = f"{c.change:+.4f}"
        if c.change_in_se is not None:
            change += f" ({c.change_in_se:+.1f} se)"
        rows.append(
            (c.task, c.metric, _with_se(c.base, c.base_se), _with_se(c.this, c.this_se), change)
        )
    return rows


def _with_se(value: float, se: float | None) -> str:
    return f"{value:.4f}" + (f" ± {se:.4f}" if se is not None else "")


def comparison_table(base: dict[str, Any], new: dict[str, Any], *, base_name: str) -> str:
    rows = comparison_rows(base, new)
    if not rows:
        return f"compare: no task and metric in common with {base_name}"
    header = ("task", "metric", "base", "this", "change")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    return f"compared with {base_name}:\n" + "\n".join(line.rstrip() for line in lines)
