"""What every plot command writes (`python -m fsdp_utils.plot`: a run's curves, and --compare's
scores): the figure as a PNG, the numbers it draws as a CSV beside it, and one line saying so."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

DPI = 110


def save_png_and_csv(
    figure: Any,
    output: Path,
    header: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    detail: str,
) -> None:
    """`figure` (matplotlib's) as `output`, its folder made; `header` and `rows` as
    `output` with the suffix .csv. OSError when either cannot be written: the commands turn it
    into their one-paragraph error."""
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=DPI)
    csv_path = output.with_suffix(".csv")
    with open(csv_path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(header)
        out.writerows(rows)
    print(f"wrote {output} ({detail}) and {csv_path} (the drawn numbers)")
