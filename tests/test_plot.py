"""The one reader of metrics.jsonl, and `python -m fsdp_utils.plot`: the drawn lines (read back
from the figure and from the CSV written beside the PNG) are the run's metrics, resumed legs
form one curve, sweeps overlay, and bad input is one paragraph with exit 2."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from fsdp_utils.metrics import plot
from fsdp_utils.metrics.logger import RunLogger, latest_history, read_metrics
from tests.train_helpers import run_module


def _write(run_dir: Path, records: list[dict[str, Any]], *, cut_last: bool = False) -> None:
    """Records as RunLogger writes them; `cut_last`: a job killed in the middle of a write."""
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"time": 1.0, **r}) + "\n" for r in records)
    if cut_last:
        text = text[: len(text) - 15]
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(text)


def _train(step: int, leg: int, *, cuda: bool = False) -> dict[str, Any]:
    """Values that tell step and leg apart: leg 2 logs other numbers for the same steps."""
    record = {
        "kind": "train",
        "step": step,
        "loss": 6.0 - 0.1 * step + 0.01 * leg,
        "lr": 1e-3 * (1 + leg) / step,
        "grad_norm": 0.5 + 0.01 * step + leg,
        "tokens_per_s": 1000.0 * step + 7 * leg,
        "tokens_per_s_per_device": 500.0 * step,
        "step_time_s": 0.1,
        "mfu_pct": None,  # not a number on a CPU: left out, not drawn as 0
        "host_rss_gib": 0.4 + 0.001 * step,
    }
    if cuda:
        record |= {"cuda_peak_allocated_gib": 10.0 + step, "cuda_peak_reserved_gib": 12.0 + leg}
    return record


def _resumed_run(run_dir: Path, *, cuda: bool = False) -> None:
    """Leg 1: steps 1-8 with evals at 4 and 8, then killed mid-write. Leg 2 resumes from the
    checkpoint of step 6 and logs 7-10: its steps 7 and 8 replace leg 1's, and leg 1's eval at 8
    belongs to the abandoned history."""
    leg1: list[dict[str, Any]] = [{"kind": "start", "step": 0, "message": "training"}]
    for step in range(1, 9):
        leg1.append(_train(step, 1, cuda=cuda))
        if step % 4 == 0:
            leg1.append({"kind": "eval", "step": step, "eval_loss": 7.0 - 0.1 * step})
            leg1.append({"kind": "chess_eval", "step": step, "legal_move_rate": 0.1 * step,
                         "next_move_accuracy": 0.01 * step, "games": 3, "opening": "e2e4",
                         "strict": True})  # fmt: skip
    leg1.append({"kind": "checkpoint", "step": 8, "seconds": 0.5})
    _write(run_dir, leg1, cut_last=True)
    # The next leg opens the file as the trainer does (RunLogger), which ends the cut line.
    logger = RunLogger(run_dir / "metrics.jsonl", True, 10, stream=open("/dev/null", "w"))  # noqa: SIM115
    logger.event("resumed", "checkpoint: resumed from step 6", step=6)
    logger.event("start", "training: steps 6 -> 10", step=6)
    for step in range(7, 11):
        logger.step({k: v for k, v in _train(step, 2, cuda=cuda).items() if k != "kind"})
    logger.eval({"step": 10, "eval_loss": 5.5, "eval_perplexity": 245.0, "eval_tokens": 100})
    logger.close()


def _drawn(drawn: list[plot.DrawnLine], run: str, series: str) -> list[tuple[int, float]]:
    (line,) = [d for d in drawn if d.run == run and d.series == series]
    return line.points()


def test_reader_skips_a_cut_line_and_the_later_leg_wins(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _resumed_run(run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert sum(1 for line in lines if not line.endswith("}")) == 1  # the cut line, on its own
    records = read_metrics(run)
    assert records[-1]["kind"] == "eval" and records[-1]["step"] == 10
    assert [r["kind"] for r in records].count("resumed") == 1  # not glued to the cut line
    history = latest_history(records)
    train = [(r["step"], r["loss"]) for r in history if r["kind"] == "train"]
    assert train == [(s, 6.0 - 0.1 * s + 0.01 * (1 if s <= 6 else 2)) for s in range(1, 11)]
    assert [r["step"] for r in history if r["kind"] == "eval"] == [4, 10]
    assert [r["step"] for r in read_metrics(run, "train")] == [*range(1, 9), 7, 8, 9, 10]
    with pytest.raises(ValueError, match="is not a run folder"):
        read_metrics(tmp_path / "nothing-here")


def test_plot_draws_the_metrics_of_a_resumed_run(tmp_path: Path) -> None:
    run = tmp_path / "my-run"
    _resumed_run(run, cuda=True)
    # What the plot must show, from the file itself: per step, the last leg that logged it.
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
               if line.endswith("}")]  # fmt: skip
    legs: list[list[dict[str, Any]]] = []
    for r in records:
        if r["kind"] == "start":
            legs.append([])
        legs[-1].append(r)
    resumed_at = legs[1][0]["step"]
    current = [r for r in legs[0] if r["step"] <= resumed_at] + legs[1]

    def expected(kind: str, key: str) -> list[tuple[int, float]]:
        return [(r["step"], r[key]) for r in current if r["kind"] == kind and key in r]

    fig, drawn = plot.plot_runs([plot.RunCurves.load(run, "my-run")], smoothing=0.5)
    assert _drawn(drawn, "my-run", "train loss") == expected("train", "loss")
    assert _drawn(drawn, "my-run", "eval loss") == expected("eval", "eval_loss") == [
        (4, pytest.approx(6.6)), (10, 5.5)]  # fmt: skip
    assert _drawn(drawn, "my-run", "lr") == expected("train", "lr")
    assert _drawn(drawn, "my-run", "tokens/s") == expected("train", "tokens_per_s")
    assert _drawn(drawn, "my-run", "grad norm") == expected("train", "grad_norm")
    assert _drawn(drawn, "my-run", "CUDA peak allocated") == expected(
        "train", "cuda_peak_allocated_gib"
    )
    assert _drawn(drawn, "my-run", "CUDA peak reserved") == expected(
        "train", "cuda_peak_reserved_gib"
    )
    # The chess evaluation's skill measures get panels; its counts, text and booleans do not.
    for name in ("legal_move_rate", "next_move_accuracy"):
        assert _drawn(drawn, "my-run", name) == expected("chess_eval", name)
    assert not [d for d in drawn if d.series == "games"]
    titles = {ax.get_title() for ax in fig.axes if ax.get_visible()}
    assert {"chess eval: legal-move rate", "chess eval: next-move accuracy"} <= titles
    assert not [t for t in titles if "games" in t or "opening" in t or "strict" in t]
    assert not [t for t in titles if "DPO" in t]  # an SFT run's plot: no DPO panels
    assert loss_label(fig) == "cross-entropy (nats/token)"
    # Smoothed: TensorBoard's debiased EMA of the raw values.
    raw = [v for _, v in expected("train", "loss")]
    ema, smoothed = 0.0, []
    for i, v in enumerate(raw, start=1):
        ema = 0.5 * ema + 0.5 * v
        smoothed.append(ema / (1 - 0.5**i))
    got = [v for _, v in _drawn(drawn, "my-run", "train loss (smoothed)")]
    assert got == pytest.approx(smoothed)
    # The resume is marked on each panel: a vertical line at the step it resumed from.
    loss_ax = next(ax for ax in fig.axes if ax.get_title() == "loss")
    assert [list(line.get_xdata()) for line in loss_ax.lines if line not in
            [d.line for d in drawn]] == [[6, 6]]  # fmt: skip

    # The command writes the PNG, and the CSV beside it holds the same drawn numbers.
    out = tmp_path / "plots" / "runs.png"
    assert plot.main([str(run), "-o", str(out), "--smoothing", "0.5"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out.with_suffix(".csv")) as f:
        rows = list(csv.DictReader(f))
    from_csv: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        assert row["run"] == "my-run"
        from_csv.setdefault(row["series"], []).append((int(row["step"]), float(row["value"])))
    assert from_csv == {d.series: d.points() for d in drawn}


def loss_label(fig: Any) -> str:
    return next(ax.get_ylabel() for ax in fig.axes if ax.get_title() == "loss")


DPO_FIELDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
              "logps/chosen", "logps/rejected")  # fmt: skip


def _dpo_metrics(step: int, prefix: str = "") -> dict[str, float]:
    """TRL's metrics as fsdp_utils.methods.dpo.step logs them, a different number per field."""
    chosen, rejected = 0.02 * step, -0.03 * step - (0.01 if prefix else 0.0)
    return {
        f"{prefix}rewards/chosen": chosen,
        f"{prefix}rewards/rejected": rejected,
        f"{prefix}rewards/accuracies": min(1.0, 0.1 * step + (0.05 if prefix else 0.0)),
        f"{prefix}logps/chosen": -40.0 + 0.2 * step,
        f"{prefix}logps/rejected": -42.0 - 0.3 * step,
        f"{prefix}rewards/margins": chosen - rejected,
    }


def test_a_dpo_run_gets_panels_of_its_rewards_accuracy_and_log_probabilities(
    tmp_path: Path,
) -> None:
    """The records of a DPO run as the trainer logs them (RunLogger: a train record with the
    step's metrics and the method's `logged` ones, an eval record with the `eval_` split's):
    every DPO field is drawn, train as lines and eval as dotted lines, in three panels, and
    overlaid with an SFT run the SFT run draws none of them."""
    run, sft = tmp_path / "dpo", tmp_path / "sft"
    run.mkdir()
    logger = RunLogger(run / "metrics.jsonl", True, 12, stream=open("/dev/null", "w"))  # noqa: SIM115
    logger.event("start", "training: steps 0 -> 12", step=0)
    for step in range(1, 13):
        train = {k: v for k, v in _train(step, 1).items() if k != "kind"}
        logger.step(train | {"loss": 0.6931 - 0.04 * step} | _dpo_metrics(step))
        if step % 4 == 0:
            logger.eval({"step": step, "eval_loss": 0.7 - 0.03 * step,
                         **_dpo_metrics(step, "eval_"), "eval_pairs": 40})  # fmt: skip
    logger.close()
    _write(sft, [{"kind": "start", "step": 0}] + [_train(s, 1) for s in (1, 2, 3)])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    def expected(kind: str, key: str) -> list[tuple[int, float]]:
        return [(r["step"], r[key]) for r in records if r["kind"] == kind and key in r]

    fig, drawn = plot.plot_runs([plot.RunCurves.load(run, "dpo")], smoothing=0.5)
    panels = {
        "DPO rewards: chosen vs rejected": ["rewards/chosen", "rewards/rejected", "rewards/margins"],
        "DPO reward accuracy": ["rewards/accuracies"],
        "DPO log-probabilities": ["logps/chosen", "logps/rejected"],
    }  # fmt: skip
    for panel, fields in panels.items():
        assert [d.series for d in drawn if d.panel == panel] == [
            name for field in fields for name in (field, f"eval_{field}")
        ]
    for field in DPO_FIELDS:
        assert len(expected("train", field)) == 12 and len(expected("eval", f"eval_{field}")) == 3
        assert _drawn(drawn, "dpo", field) == expected("train", field)
        assert _drawn(drawn, "dpo", f"eval_{field}") == expected("eval", f"eval_{field}")
    # In the figure itself: the eval split's line has dots, the accuracy's axis spans 0 to 1.
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert set(panels) <= set(axes)
    (eval_line,) = [d.line for d in drawn if d.series == "eval_rewards/accuracies"]
    assert eval_line.get_marker() == "o" and eval_line in axes["DPO reward accuracy"].lines
    assert axes["DPO reward accuracy"].get_ylim() == pytest.approx((-0.02, 1.02))
    assert _drawn(drawn, "dpo", "train loss") == expected("train", "loss")
    assert loss_label(fig) == "DPO loss, mean over pairs"

    # The command: the CSV beside the PNG holds the DPO series too.
    out = tmp_path / "dpo.png"
    assert plot.main([str(run), "-o", str(out)]) == 0
    with open(out.with_suffix(".csv")) as f:
        rows = [r for r in csv.DictReader(f) if r["series"] == "eval_rewards/margins"]
    assert [(int(r["step"]), float(r["value"])) for r in rows] == expected(
        "eval", "eval_rewards/margins"
    )

    # Overlaid with an SFT run: the DPO panels stay, with the DPO run's lines only.
    fig, drawn = plot.plot_runs(plot.load_runs([run, sft], None))
    assert {d.run for d in drawn if d.panel in panels} == {"dpo"}
    assert {d.run for d in drawn if d.series == "train loss"} == {"dpo", "sft"}
    assert loss_label(fig) == "cross-entropy (nats/token)"  # not only DPO losses there


def test_every_legend_tells_its_series_apart(tmp_path: Path) -> None:
    """A GRPO run with the chess evaluation's engine judge: the best-move and blunder rates are
    named as such, and the held-out prompts' sampled and greedy rewards are drawn with their
    own markers and named in the legend, apart from the train reward."""
    run = tmp_path / "grpo"
    records: list[dict[str, Any]] = [{"kind": "start", "step": 0}]
    for step in range(1, 5):
        records.append(_train(step, 1) | {"reward": 0.1 * step})
        if step % 2 == 0:
            records.append({"kind": "eval", "step": step, "eval_reward": 0.2 * step,
                            "eval_greedy_reward": 0.25 * step, "eval_prompts": 16})  # fmt: skip
            records.append({"kind": "chess_eval", "step": step, "legal_move_rate": 0.5,
                            "engine_best_move_rate": 0.1 * step, "engine_blunder_rate": 0.05,
                            "engine_all_accuracy": 50.0, "engine_accuracy": 70.0,
                            "engine_accuracy_balanced": 60.0})  # fmt: skip
    _write(run, records)
    fig, drawn = plot.plot_runs([plot.RunCurves.load(run, "grpo")])
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}

    def legend(title: str) -> list[str]:
        return [t.get_text() for t in axes[title].get_legend().get_texts()]

    assert legend("chess eval: best move, blunders (engine)") == ["best move", "blunders"]
    assert legend("chess eval: accuracy (engine, Lichess)") == [
        "every move (illegal = 0)", "legal moves", "balanced positions"]  # fmt: skip
    assert legend("GRPO reward") == ["sampled (train)", "sampled (eval)", "greedy (eval)"]
    lines = {d.series: d.line for d in drawn if d.panel == "GRPO reward"}
    sampled, greedy = lines["eval_reward"], lines["eval_greedy_reward"]
    assert (sampled.get_marker(), greedy.get_marker()) == ("o", "s")
    assert greedy.get_markerfacecolor() == "white" != sampled.get_markerfacecolor()
    assert lines["reward"].get_marker() in ("None", "", None)  # the train line has none
    assert _drawn(drawn, "grpo", "eval_greedy_reward") == [(2, 0.5), (4, 1.0)]
    for title, ax in axes.items():
        if ax.get_legend() is not None:
            texts = [t.get_text() for t in ax.get_legend().get_texts()]
            assert len(set(texts)) == len(texts), (title, texts)


def test_sweep_overlays_runs_in_value_order(tmp_path: Path, capsys) -> None:
    sweep = tmp_path / "sweep"
    for value in ("10", "2", "1"):
        _write(sweep / f"batch_size_per_device={value}",
               [{"kind": "start", "step": 0}] + [_train(s, int(value)) for s in (1, 2, 3)])  # fmt: skip
    _write(sweep / "batch_size_per_device=16", [{"kind": "start", "step": 0}])  # ran out of memory
    (sweep / "logs").mkdir()  # not a run folder
    runs = plot.load_runs([], sweep)
    assert "batch_size_per_device=16 has no training step logged yet" in capsys.readouterr().err
    fig, drawn = plot.plot_runs(runs)
    names = [f"batch_size_per_device={v}" for v in ("1", "2", "10")]
    assert [d.run for d in drawn if d.series == "train loss"] == names
    for name in names:
        leg = int(name.split("=")[1])
        assert _drawn(drawn, name, "tokens/s") == [(s, 1000.0 * s + 7 * leg) for s in (1, 2, 3)]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == names
    colors = {d.run: d.line.get_color() for d in drawn if d.series == "lr"}
    assert len(set(colors.values())) == 3


def test_not_a_run_folder_is_one_paragraph_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = run_module("fsdp_utils.plot", str(tmp_path / "empty"), "-o", str(tmp_path / "x.png"))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    message = result.stderr.strip()
    assert message.startswith("error: ") and "\n" not in message
    assert "is not a run folder: it has no metrics.jsonl" in message
    assert "python -m fsdp_utils.plot runs/chess -o runs.png" in message
    assert not (tmp_path / "x.png").exists()
    assert plot.main(["--sweep", str(tmp_path / "empty")]) == 2
    assert plot.main([]) == 2


def test_smoothing_is_per_step_whatever_the_logging_interval() -> None:
    """Logged every 10 steps, a point decays the past by weight**10: the smoothed curve of a
    loss that jumps stays the curve of the same loss logged every step, at the logged steps."""
    every_step = list(range(1, 101))
    values = [5.0 if s <= 50 else 1.0 for s in every_step]
    dense = plot.smooth(every_step, values, 0.9)
    sparse_steps = every_step[9::10]
    sparse = plot.smooth(sparse_steps, [values[s - 1] for s in sparse_steps], 0.9)
    # Not equal (the sparse curve never saw the steps in between), but it has caught up with the
    # jump as the dense one has: per point it would still be far above 1 after 5 points.
    assert abs(sparse[-1] - dense[-1]) < 0.02
    assert sparse[-1] < 1.05
    assert plot.smooth([1, 2, 3], [1.0, 2.0, 3.0], 0.0) == [1.0, 2.0, 3.0]
