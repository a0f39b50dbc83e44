"""`python -m fsdp_utils.plot RUN_DIR [RUN_DIR ...] -o runs.png`: a run's curves against the
optimizer step in one PNG, headless (matplotlib's Agg backend: no display), and the drawn numbers
in a CSV beside it (`runs.csv`: panel, run, series, step, value).

Panels: train loss, raw and smoothed, with the eval loss; learning rate; tokens/s; memory;
gradient norm; a DPO run's rewards of the chosen and rejected answers with their margin, its
reward accuracy and its log-probabilities, train and eval split (fields `rewards/...`,
`logps/...`, `eval_rewards/...`); a distillation run's terms and top-1 agreement (`distill/...`);
and the chess evaluation's skill measures (records of kind
`chess_eval`: legal-move rate overall and per game phase, next-move accuracy, plies to the first illegal
move, full-length continuations; with the engine judge, centipawn loss, Lichess accuracy, best-move
and blunder rates) when the run has them. Several runs overlay, one colour each, with their names in
the legend: run folders given one by one, or `--sweep DIR` for every run folder in DIR (what
`slurm/submit.py --sweep` writes). A run resumed after a requeue is one folder and one curve
(`fsdp_utils.metrics.logger.latest_history`); dotted vertical lines mark where it resumed.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_utils.arguments import ArgumentParser
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.metrics.figure import save_png_and_csv
from fsdp_utils.metrics.logger import latest_history, read_metrics, scalar_fields

EXIT_USAGE = 2
DEFAULT_SMOOTHING = 0.9

# (record field, series name in the CSV and legends): GPU memory when the run had CUDA, else the
# host's resident memory (a CPU run, or one that moves everything to the host). Peaks over the
# steps since the previous log step (fsdp_utils.metrics.throughput.memory_snapshot).
CUDA_MEMORY = (
    ("cuda_peak_allocated_gib", "CUDA peak allocated"),
    ("cuda_peak_reserved_gib", "CUDA peak reserved"),
)
HOST_MEMORY = (("host_peak_rss_gib", "host peak RSS"), ("host_rss_gib", "host RSS after the step"))
CHESS_KIND = "chess_eval"


@dataclass
class RunCurves:
    """What one run folder has to draw, after its resumes (later legs win)."""

    name: str
    folder: Path
    train: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    chess: list[dict[str, Any]]
    resumed_at: list[int]
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, folder: Path, name: str) -> RunCurves:
        if not folder.is_dir():
            raise ValueError(
                f"{folder} is not a run folder: it does not exist or is not a folder. Give the "
                "run's --output_dir, e.g. `python -m fsdp_utils.plot runs/chess -o runs.png`."
            )
        history = latest_history(read_metrics(folder))
        config: dict[str, Any] = {}
        config_path = RunLayout.of(folder).config
        if config_path.is_file():
            config = json.loads(config_path.read_text())

        def of_kind(kind: str) -> list[dict[str, Any]]:
            return [r for r in history if r.get("kind") == kind and isinstance(r.get("step"), int)]

        return cls(
            name=name,
            folder=folder,
            train=of_kind("train"),
            evals=of_kind("eval"),
            chess=of_kind(CHESS_KIND),
            # Each leg logs a "start" at its first step; one after 0 resumed a checkpoint.
            resumed_at=[int(r["step"]) for r in of_kind("start") if r["step"] > 0],
            config=config,
        )

    def describe(self) -> str:
        """e.g. `demo: model demo_assets/model, 2 processes, total batch 8`."""
        resolved = self.config.get("resolved", {})
        options = self.config.get("config", {})
        parts = []
        if options.get("model"):
            parts.append(f"model {options['model']}")
        if resolved.get("world_size"):
            parts.append(f"{resolved['world_size']} process(es)")
        if resolved.get("total_batch_size"):
            parts.append(f"total batch {resolved['total_batch_size']}")
        return self.name + (": " + ", ".join(parts) if parts else "")


@dataclass(frozen=True)
class DrawnLine:
    """One line in the figure and what it shows: the CSV is written from these."""

    panel: str
    run: str
    series: str
    line: Any  # matplotlib.lines.Line2D

    def points(self) -> list[tuple[int, float]]:
        return [
            (int(x), float(y))
            for x, y in zip(self.line.get_xdata(), self.line.get_ydata(), strict=True)
        ]


def smooth(steps: Sequence[int], values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing, per optimizer step: an exponential moving average, debiased so
    that the first points are not pulled towards zero. With a value logged every step it is
    exactly TensorBoard's; with --log_every N a point N steps on decays the past by weight**N,
    so the curve averages over the same ~1/(1-weight) steps whatever the logging interval
    (per point, a run logged every 20 steps would average over 200). weight 0: the values."""
    if weight <= 0:
        return list(values)
    out, last, norm, previous = [], 0.0, 0.0, None
    for step, value in zip(steps, values, strict=True):
        decay = weight ** (1 if previous is None else max(step - previous, 1))
        last = last * decay + (1.0 - decay) * value
        norm = norm * decay + (1.0 - decay)
        out.append(last / norm)
        previous = step
    return out


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of one field, leaving out records without a number there (None)."""
    pairs = [
        (int(r["step"]), float(r[key]))
        for r in records
        if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)
    ]
    return [s for s, _ in pairs], [v for _, v in pairs]


# The chess evaluation's skill measures, one panel each (fsdp_utils.chess_eval.evaluator): the
# counts beside them (games, moves judged, failures by kind, seconds) are for the log's table,
# and a panel per count would bury the curves that say whether the model learnt chess. The
# engine judge's panels appear only for runs that logged them.
CHESS_PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("chess eval: legal-move rate", "share of generated moves",
     ("legal_move_rate", "legal_move_rate_opening", "legal_move_rate_middlegame",
      "legal_move_rate_ending")),
    ("chess eval: next-move accuracy", "teacher-forced top-1", ("next_move_accuracy",)),
    ("chess eval: plies to the first illegal move", "mean plies", ("mean_legal_plies",)),
    ("chess eval: full-length continuations", "share of continuations", ("full_length_share",)),
    # The engine judge's (docs/chess-eval.md): over every judged move, an illegal one as the
    # worst (engine_all_*: the headline), and over the legal moves alone.
    ("chess eval: centipawn loss (engine)", "mean centipawns lost per move",
     ("engine_all_centipawn_loss", "engine_centipawn_loss", "engine_centipawn_loss_balanced")),
    ("chess eval: accuracy (engine, Lichess)", "mean move accuracy, %",
     ("engine_all_accuracy", "engine_accuracy", "engine_accuracy_balanced")),
    ("chess eval: best move, blunders (engine)", "share of judged moves",
     ("engine_best_move_rate", "engine_blunder_rate")),
)  # fmt: skip
CHESS_STYLES = ("-", "--", ":", "-.")
# What each line of a panel with several is, in its legend (a field's last word would call the
# best-move and the blunder rates both "rate"). The engine's headline figures count every move
# (an illegal one as the worst); its others the legal moves alone.
SERIES_LABELS = {
    "legal_move_rate": "all", "legal_move_rate_opening": "opening",
    "legal_move_rate_middlegame": "middlegame", "legal_move_rate_ending": "ending",
    "engine_all_centipawn_loss": "every move (illegal = 1000)",
    "engine_centipawn_loss": "legal moves", "engine_centipawn_loss_balanced": "balanced positions",
    "engine_all_accuracy": "every move (illegal = 0)",
    "engine_accuracy": "legal moves", "engine_accuracy_balanced": "balanced positions",
    "engine_best_move_rate": "best move", "engine_blunder_rate": "blunders",
    # GRPO: the train reward is the mean of the sampled completions'; its evaluation samples
    # the held-out prompts (eval_reward) and decodes them greedily (eval_greedy_reward).
    "reward": "sampled", "greedy_reward": "greedy",
}  # fmt: skip
# The evaluation points of a method's panel, one marker per series (filled, then hollow), so
# that two series of the same panel (GRPO's sampled and greedy rewards) never look alike.
EVAL_MARKERS = (("o", True), ("s", False), ("^", True))

# DPO's metrics, TRL's names (fsdp_utils.methods.dpo.step): three panels when a run logged them,
# the train split's as lines and the eval split's (`eval_` prefix) as the same line style with
# dots. An SFT run has none of these fields and keeps its plot.
DPO_REWARDS, DPO_ACCURACY = "DPO rewards: chosen vs rejected", "DPO reward accuracy"
DPO_PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (DPO_REWARDS, "beta (log pi - log ref), mean over pairs",
     ("rewards/chosen", "rewards/rejected", "rewards/margins")),
    (DPO_ACCURACY, "share of pairs, chosen reward higher", ("rewards/accuracies",)),
    ("DPO log-probabilities", "policy log p of the answer, mean over pairs",
     ("logps/chosen", "logps/rejected")),
)  # fmt: skip
DPO_STYLES = ("-", "--", ":")
# Distillation's terms (fsdp_utils.methods.distill.step), drawn as DPO's are.
DISTILL_PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("distillation: the loss's terms", "mean over target tokens",
     ("distill/teacher_kl", "distill/divergence", "distill/ce")),
    ("distillation: top-1 agreement", "share of target tokens", ("distill/top1_agreement",)),
)  # fmt: skip
# GRPO's (fsdp_utils.methods.grpo, TRL's names), drawn the same way: the held-out prompts'
# rewards (`eval_reward`: sampled, `eval_greedy_reward`) as dots on the train reward's panel.
GRPO_PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("GRPO reward", "mean reward of the completions", ("reward", "greedy_reward")),
    ("GRPO completions", "tokens", ("completions/mean_length", "completions/max_length")),
    ("GRPO rollout and update", "seconds per step", ("rollout/seconds", "update/seconds")),
    ("GRPO entropy and KL", "nats per token", ("entropy", "kl")),
)  # fmt: skip


def series_label(name: str) -> str:
    """A series' name in a panel's legend: SERIES_LABELS', else its field's last part."""
    return SERIES_LABELS.get(name, name.split("/")[-1])


def _logged_panels(
    table: Sequence[tuple[str, str, tuple[str, ...]]], records: Iterable[dict[str, Any]]
) -> list[tuple[str, str, list[str]]]:
    """The panels of `table` whose fields some record has as a number (or as an evaluation's,
    `eval_` before it): (title, y label, fields)."""
    logged = {key for record in records for key in scalar_fields(record)}
    panels = []
    for title, ylabel, fields in table:
        present = [f for f in fields if f in logged or f"eval_{f}" in logged]
        if present:
            panels.append((title, ylabel, present))
    return panels


def _natural_key(text: str) -> list[Any]:
    """`batch_size_per_device=10` after `=2`: numbers compare as numbers."""
    return [(0, float(p), "") if re.fullmatch(r"\d+(\.\d+)?", p) else (1, 0.0, p)
            for p in re.split(r"(\d+(?:\.\d+)?)", text) if p]  # fmt: skip


def sweep_run_folders(sweep_dir: Path) -> list[Path]:
    """The run folders in a sweep's folder (sub-folders that hold a metrics.jsonl)."""
    runs = []
    if sweep_dir.is_dir():
        runs = [d for d in sweep_dir.iterdir() if RunLayout.of(d).metrics.is_file()]
    if not runs:
        raise ValueError(
            f"--sweep {sweep_dir} holds no run folders (sub-folders with a metrics.jsonl). Give "
            "the folder that `slurm/submit.py --sweep` printed (`run folders under ...`), or give "
            "run folders one by one: `python -m fsdp_utils.plot RUN_DIR RUN_DIR -o runs.png`."
        )
    return sorted(runs, key=lambda d: _natural_key(d.name))


def run_names(folders: Sequence[Path]) -> list[str]:
    """Folder names; where two are the same, their paths from the folder they share."""
    names = [f.resolve().name for f in folders]
    if len(set(names)) == len(names):
        return names
    resolved = [str(f.resolve()) for f in folders]
    common = os.path.commonpath(resolved)
    return [os.path.relpath(r, common) if r != common else Path(r).name for r in resolved]


def plot_runs(
    runs: Sequence[RunCurves], *, smoothing: float = DEFAULT_SMOOTHING, title: str | None = None
) -> tuple[Any, list[DrawnLine]]:
    """The figure (not shown; save it) and its drawn lines."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    cuda = any(r.get("cuda_peak_allocated_gib") is not None for run in runs for r in run.train)
    memory = CUDA_MEMORY if cuda else HOST_MEMORY
    chess_panels = _logged_panels(CHESS_PANELS, (r for run in runs for r in run.chess))
    method_panels = _logged_panels(
        DPO_PANELS + DISTILL_PANELS, (r for run in runs for r in run.train)
    )
    grpo_records = (r for run in runs for r in [*run.train, *run.evals])
    method_panels += _logged_panels(GRPO_PANELS, grpo_records)

    def only(field: str) -> bool:
        return bool(method_panels) and all(any(field in r for r in run.train) for run in runs)

    loss_label = "cross-entropy (nats/token)"
    if only("rewards/accuracies"):
        loss_label = "DPO loss, mean over pairs"
    elif only("reward"):
        loss_label = "GRPO loss (--loss_type's mean)"
    elif only("distill/teacher_kl"):
        loss_label = "alpha x divergence + (1 - alpha) x CE, per token"
    panels: list[tuple[str, str]] = [  # (title, y label)
        ("loss", loss_label),
        ("learning rate", "learning rate"),
        ("throughput", "tokens/s (all processes)"),
        ("memory", "GiB"),
        ("gradient norm", "global L2 norm (before clipping)"),
        *[(title_, ylabel) for title_, ylabel, _ in method_panels],
        *[(title_, ylabel) for title_, ylabel, _ in chess_panels],
    ]
    columns = 2
    rows = -(-len(panels) // columns)
    fig = Figure(figsize=(6.2 * columns, 3.3 * rows + 0.8), layout="constrained")
    first = fig.add_subplot(rows, columns, 1)
    # One step axis for all panels, so that a chess evaluation lines up with the loss.
    axes = {panels[0][0]: first} | {
        title_: fig.add_subplot(rows, columns, i + 1, sharex=first)
        for i, (title_, _) in enumerate(panels) if i > 0
    }  # fmt: skip
    for title_, ylabel in panels:
        ax = axes[title_]
        ax.set_title(title_)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes["learning rate"].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))

    drawn: list[DrawnLine] = []

    def draw(panel: str, run: str, series: str, steps: list[int], values: list[float],
             **style: Any) -> None:  # fmt: skip
        if steps:
            (line,) = axes[panel].plot(steps, values, **style)
            drawn.append(DrawnLine(panel, run, series, line))

    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        steps, losses = _series(run.train, "loss")
        draw("loss", run.name, "train loss", steps, losses, color=color, lw=0.8, alpha=0.35)
        draw("loss", run.name, "train loss (smoothed)", steps, smooth(steps, losses, smoothing),
             color=color, lw=1.8)  # fmt: skip
        draw("loss", run.name, "eval loss", *_series(run.evals, "eval_loss"), color=color,
             lw=1.2, ls="--", marker="o", ms=4)  # fmt: skip
        draw("learning rate", run.name, "lr", *_series(run.train, "lr"), color=color, lw=1.5)
        draw("throughput", run.name, "tokens/s", *_series(run.train, "tokens_per_s"),
             color=color, lw=1.2, marker=".", ms=3)  # fmt: skip
        for (key, series), ls in zip(memory, ("-", "--"), strict=False):
            draw("memory", run.name, series, *_series(run.train, key), color=color, lw=1.5, ls=ls)
        draw("gradient norm", run.name, "grad norm", *_series(run.train, "grad_norm"),
             color=color, lw=1.2)  # fmt: skip
        for title_, _, fields in method_panels:
            for name, ls, (marker, filled) in zip(fields, DPO_STYLES, EVAL_MARKERS, strict=False):
                draw(title_, run.name, name, *_series(run.train, name), color=color, lw=1.5,
                     ls=ls)  # fmt: skip
                draw(title_, run.name, f"eval_{name}", *_series(run.evals, f"eval_{name}"),
                     color=color, lw=1.0, ls=ls, marker=marker, ms=5,
                     mfc=color if filled else "white")  # fmt: skip
        for title_, _, fields in chess_panels:
            for name, ls in zip(fields, CHESS_STYLES, strict=False):
                draw(title_, run.name, name, *_series(run.chess, name), color=color,
                     lw=1.5 if ls == "-" else 1.0, ls=ls, marker="o", ms=4)  # fmt: skip
        for step in run.resumed_at:
            for ax in axes.values():
                ax.axvline(step, color=color, ls=":", lw=1.0, alpha=0.8)

    # Line styles say what a line is; colours say which run.
    styles = [
        Line2D([], [], color="0.3", lw=0.8, alpha=0.5, label="train loss"),
        Line2D([], [], color="0.3", lw=1.8, label=f"smoothed (EMA {smoothing:g})"),
        Line2D([], [], color="0.3", lw=1.2, ls="--", marker="o", ms=4, label="eval loss"),
    ]
    if any(run.resumed_at for run in runs):
        styles.append(Line2D([], [], color="0.3", ls=":", label="resumed here"))
    axes["loss"].legend(handles=styles, fontsize="small")
    if cuda:
        axes["memory"].legend(
            handles=[Line2D([], [], color="0.3", ls=ls, label=name)
                     for (_, name), ls in zip(memory, ("-", "--"), strict=False)],
            fontsize="small",
        )  # fmt: skip
    else:
        axes["memory"].set_title("memory: host RSS of rank 0 (no CUDA)")
    for title_, _, fields in chess_panels:
        axes[title_].set_ylim(bottom=0)
        if len(fields) > 1:  # which line style is which game phase
            axes[title_].legend(
                handles=[Line2D([], [], color="0.3", ls=ls, label=series_label(name))
                         for name, ls in zip(fields, CHESS_STYLES, strict=False)],
                fontsize="small",
            )  # fmt: skip
    for title_, _, fields in method_panels:
        # Line styles say which series, markers the eval split's; colours say which run. Only
        # what the panel draws is in its legend.
        shown = {d.series for d in drawn if d.panel == title_}
        labels = [series_label(name) for name in fields]
        if len(set(labels)) < len(labels):  # rollout/seconds, update/seconds: say which
            labels = [name.split("/")[0] for name in fields]
        handles = []
        for name, label, ls, (marker, filled) in zip(
            fields, labels, DPO_STYLES, EVAL_MARKERS, strict=False
        ):
            train, held_out = name in shown, f"eval_{name}" in shown
            alone = len(fields) == 1  # the panel's title names it: train and eval say enough
            if train:
                text = "train" if alone else f"{label} (train)" if held_out else label
                handles.append(Line2D([], [], color="0.3", ls=ls, label=text))
            if held_out:
                handles.append(Line2D([], [], color="0.3", lw=1.0, ls=ls, marker=marker, ms=5,
                                      mfc="0.3" if filled else "white",
                                      label="eval" if alone else f"{label} (eval)"))  # fmt: skip
        # An accuracy rises to 1 at the right: its legend below, where it hides no point.
        axes[title_].legend(
            handles=handles,
            fontsize="small",
            loc="lower right" if title_ == DPO_ACCURACY else "best",
        )
    if DPO_REWARDS in axes:  # at 0 the policy is the reference
        axes[DPO_REWARDS].axhline(0.0, color="0.5", lw=0.8)
    if DPO_ACCURACY in axes:  # ties count as wrong, so the first step's accuracy is 0
        axes[DPO_ACCURACY].set_ylim(-0.02, 1.02)
        axes[DPO_ACCURACY].axhline(0.5, color="0.5", lw=0.8, ls=":")  # a coin's accuracy
    axes["memory"].set_ylim(bottom=0)  # from 0: how much of the memory is in use, at a glance
    for extra in range(len(panels), rows * columns):  # an empty cell in the last row
        fig.add_subplot(rows, columns, extra + 1).set_visible(False)

    if title is None:
        title = runs[0].describe() if len(runs) == 1 else f"{len(runs)} runs"
    fig.suptitle(title)
    if len(runs) > 1:
        fig.legend(
            handles=[Line2D([], [], color=f"C{i % 10}", lw=2, label=run.name)
                     for i, run in enumerate(runs)],
            loc="outside lower center", ncols=min(len(runs), 4), fontsize="small",
        )  # fmt: skip
    return fig, drawn


CSV_HEADER = ("panel", "run", "series", "step", "value")


def csv_rows(drawn: Sequence[DrawnLine]) -> Iterator[list[Any]]:
    for item in drawn:
        for step, value in item.points():
            yield [item.panel, item.run, item.series, step, repr(value)]


def load_runs(run_dirs: Sequence[Path], sweep: Path | None) -> list[RunCurves]:
    folders = list(run_dirs) + (sweep_run_folders(sweep) if sweep else [])
    if not folders:
        raise ValueError(
            "No run to plot: give run folders (`python -m fsdp_utils.plot runs/chess -o runs.png`) "
            "or a sweep's folder (`--sweep runs/<sweep>`)."
        )
    runs = [RunCurves.load(f, n) for f, n in zip(folders, run_names(folders), strict=True)]
    drawable = [run for run in runs if run.train]
    for run in runs:
        if not run.train:
            print(f"note: {run.folder} has no training step logged yet: left out", file=sys.stderr)
    if not drawable:
        raise ValueError(
            f"No training step logged yet in {', '.join(str(r.folder) for r in runs)}: "
            "metrics.jsonl gets a `train` record every --log_every steps. Plot again once the run "
            "has taken a step (its log says `step 1/...`)."
        )
    return drawable


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m fsdp_utils.plot",
        description="Plot runs' metrics against the optimizer step into a PNG (and the drawn "
        "numbers into a CSV beside it). No display needed.",
    )
    parser.add_argument("run_dirs", nargs="*", type=Path, metavar="RUN_DIR",
                        help="run folders (the trainer's --output_dir)")  # fmt: skip
    parser.add_argument("--sweep", type=Path, metavar="DIR",
                        help="also every run folder in DIR (a slurm/submit.py --sweep)")  # fmt: skip
    parser.add_argument("-o", "--output", type=Path, default=Path("runs.png"),
                        help="the PNG to write (default: runs.png; the CSV goes beside it)")  # fmt: skip
    parser.add_argument("--smoothing", type=float, default=DEFAULT_SMOOTHING,
                        help="EMA weight for the smoothed train loss, 0 to <1 (default: 0.9)")  # fmt: skip
    parser.add_argument("--title", help="figure title (default: the run and its setup)")
    args = parser.parse_args(argv)
    try:
        if not 0.0 <= args.smoothing < 1.0:
            raise ValueError(f"--smoothing must be in [0, 1), got {args.smoothing}.")
        runs = load_runs(args.run_dirs, args.sweep)
        title = args.title
        if title is None and args.sweep is not None:
            title = f"sweep {args.sweep.resolve().name}: {len(runs)} runs"
        fig, drawn = plot_runs(runs, smoothing=args.smoothing, title=title)
        steps = max(int(r["step"]) for run in runs for r in run.train)
        detail = f"{len(runs)} run(s), up to step {steps}"
        save_png_and_csv(fig, args.output, CSV_HEADER, csv_rows(drawn), detail=detail)
    except (ValueError, OSError) as err:
        print(f"\nerror: {err}\n", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
