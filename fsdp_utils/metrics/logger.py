"""The run's log: JSONL file + console (rich live on a terminal, plain lines in a Slurm log),
plus optional sinks (TensorBoard, W&B: `fsdp_utils.metrics.trackers`). Only rank 0 writes.
`read_metrics` is the one reader of what `RunLogger` writes.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

if TYPE_CHECKING:  # torch only where CUDA is asked about: plots need not import it (1 s)
    pass


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def format_step(m: dict[str, Any], max_steps: int) -> str:
    """The step's line. Memory: the peaks since the previous log step (GPUs: allocated/reserved;
    the host: resident)."""
    mem = (
        f"peak cuda {_fmt(m.get('cuda_peak_allocated_gib'), '.2f')}/"
        f"{_fmt(m.get('cuda_peak_reserved_gib'), '.2f')} GiB | "
        if "cuda_peak_allocated_gib" in m
        else ""
    )
    # Mixture-of-experts runs with a router loss: logged beside the language-model loss.
    aux = f" | aux {m['aux_loss']:.4f}" if m.get("aux_loss") is not None else ""
    return (
        f"step {m['step']:>5}/{max_steps} | loss {m['loss']:.4f}{aux}{_preference(m)}"
        f"{_distillation(m)} | "
        f"lr {m['lr']:.2e} | "
        f"grad norm {_fmt(m.get('grad_norm'), '.3f')} | "
        f"{m['tokens_per_s']:,.0f} tok/s ({m['tokens_per_s_per_device']:,.0f}/device) | "
        f"MFU {_fmt(m.get('mfu_pct'), '.1f', '%')} | {mem}"
        f"peak rss {_fmt(m.get('host_peak_rss_gib'), '.2f')} GiB | {m['step_time_s']:.3f} s/step"
    )


def _preference(m: dict[str, Any], prefix: str = "") -> str:
    """DPO's reward accuracy and margin (--method dpo), or GRPO's mean reward of the step's
    completions (--method grpo), beside the loss."""
    if not prefix and m.get("reward") is not None:
        return f" | reward {m['reward']:.4f}"
    accuracy = m.get(f"{prefix}rewards/accuracies")
    if accuracy is None:
        return ""
    return f" | reward acc {100 * accuracy:.1f}% margin {m[f'{prefix}rewards/margins']:.4f}"


def _distillation(m: dict[str, Any], prefix: str = "") -> str:
    """Distillation's terms (--method distill), beside the loss: KL(teacher || student), the
    labels' cross-entropy and how often the two models' most likely tokens agree. From a
    cached teacher's top K the KL is a lower bound of the whole vocabulary's, and says so."""
    kl = m.get(f"{prefix}distill/teacher_kl")
    if kl is None:
        return ""
    sampled = " (student's samples)" if m.get(f"{prefix}distill/on_policy") else ""
    top_k = m.get(f"{prefix}distill/teacher_top_k")
    bound = f" (top-{top_k} lower bound)" if top_k else ""
    return (
        f" | kl {kl:.4f}{bound} ce {m[f'{prefix}distill/ce']:.4f} "
        f"top-1 agree {100 * m[f'{prefix}distill/top1_agreement']:.1f}%{sampled}"
    )


def format_eval(m: dict[str, Any]) -> str:
    """An evaluation's line: the token loss's perplexity, DPO's reward accuracy, GRPO's
    rewards of the held-out prompts' completions (GRPO has no held-out loss), or
    distillation's terms."""
    if "eval_reward" in m:
        return (
            f"reward {m['eval_reward']:.4f} (sampled) | {m['eval_greedy_reward']:.4f} (greedy) | "
            f"{m['eval_prompts']:,} prompts"
        )
    if "eval_distill/teacher_kl" in m:
        detail = _distillation(m, "eval_").removeprefix(" | ") + f" | {m['eval_tokens']:,} tokens"
    elif "eval_perplexity" in m:
        detail = f"perplexity {m['eval_perplexity']:.2f} | {m['eval_tokens']:,} tokens"
    else:
        detail = _preference(m, "eval_").removeprefix(" | ") + f" | {m['eval_pairs']:,} pairs"
    return f"loss {m['eval_loss']:.4f} | {detail}"


def _ends_mid_line(path: Path) -> bool:
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            return False
        f.seek(-1, 2)
        return f.read(1) != b"\n"


class MetricSink(Protocol):
    """Somewhere else the log's records go (torchtitan's LoggerContainer holds such loggers):
    every record that metrics.jsonl gets, the run's resolved config once per run (leg), and a
    closing note for the end of the log."""

    def write(self, record: dict[str, Any]) -> None: ...

    def write_config(self, record: dict[str, Any]) -> None: ...

    def close(self) -> str | None: ...


class RunLogger:
    """Rank 0's log. Every record goes to metrics.jsonl with a `kind` and a wall-clock time,
    and to each sink."""

    def __init__(
        self,
        metrics_path: Path | None,
        enabled: bool,
        max_steps: int,
        stream: TextIO | None = None,
        *,
        sinks: Sequence[MetricSink] = (),
    ) -> None:
        self.enabled = enabled
        self.max_steps = max_steps
        self.stream = stream or sys.stdout
        self.sinks = list(sinks) if enabled else []
        # Opened at the first record: a run that stops before it (a mistake found in the
        # setup, such as a disk too small for one checkpoint) leaves no metrics.jsonl behind.
        self._path = metrics_path if enabled else None
        self._file: TextIO | None = None
        self._live: Any = None
        self._live_rows: list[str] = []
        if enabled and self.stream.isatty():
            from rich.console import Console
            from rich.live import Live

            self._console = Console(file=self.stream)
            self._live = Live(console=self._console, refresh_per_second=4, transient=False)
            self._live.start()

    def _open(self) -> TextIO | None:
        if self._file is None and self._path is not None:
            self._file = open(self._path, "a")  # noqa: SIM115
            if _ends_mid_line(self._path):
                # The last leg was killed in the middle of a line: end it, or this leg's first
                # record would be glued to it and lost to readers.
                self._file.write("\n")
        return self._file

    def _write(self, record: dict[str, Any]) -> None:
        stamped = {"time": round(time.time(), 3), **record}
        file = self._open()
        if file is not None:
            file.write(json.dumps(stamped) + "\n")
            file.flush()
        for sink in self.sinks:
            sink.write(stamped)

    def config(self, record: dict[str, Any]) -> None:
        """The run's resolved config (what config.json holds), for the sinks."""
        for sink in self.sinks:
            sink.write_config(record)

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self._live is not None:
            self._live.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self.stream, flush=True)

    def event(self, kind: str, message: str, **fields: Any) -> None:
        """Something that happened (checkpoint saved, resumed, stopping): log + JSONL."""
        self._write({"kind": kind, "message": message, **fields})
        self.info(message)

    def step(self, metrics: dict[str, Any]) -> None:
        self._write({"kind": "train", **metrics})
        if not self.enabled:
            return
        if self._live is not None:
            self._live.update(self._render(metrics))
        else:
            print(format_step(metrics, self.max_steps), file=self.stream, flush=True)

    def _render(self, m: dict[str, Any]) -> Any:
        """A progress bar over a one-row table that is refreshed in place."""
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        table = Table(box=None, pad_edge=False, header_style="bold")
        columns = {
            "step": f"{m['step']}/{self.max_steps}",
            "loss": f"{m['loss']:.4f}",
            **({"aux loss": f"{m['aux_loss']:.4f}"} if m.get("aux_loss") is not None else {}),
            "lr": f"{m['lr']:.2e}",
            "grad norm": _fmt(m.get("grad_norm"), ".3f"),
            "tokens/s": f"{m['tokens_per_s']:,.0f}",
            "per device": f"{m['tokens_per_s_per_device']:,.0f}",
            "MFU": _fmt(m.get("mfu_pct"), ".1f", "%"),
        }
        if "cuda_peak_allocated_gib" in m:
            columns["CUDA peak GiB"] = _fmt(m.get("cuda_peak_allocated_gib"), ".2f")
        columns["peak RSS GiB"] = _fmt(m.get("host_peak_rss_gib"), ".2f")
        columns["s/step"] = f"{m['step_time_s']:.3f}"
        for name in columns:
            table.add_column(name, justify="right")
        table.add_row(*columns.values())
        bar = ProgressBar(total=self.max_steps, completed=m["step"], width=60)
        return Group(bar, table)

    def eval(self, metrics: dict[str, Any]) -> None:
        self._write({"kind": "eval", **metrics})
        self.info(f"eval  step {metrics['step']:>5} | {format_eval(metrics)}")

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:  # their notes (e.g. the `wandb sync` command) end the log
            note = sink.close()
            if note:
                self.info(note)
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._file is not None:
            self._file.close()
            self._file = None


# --- reading metrics.jsonl -------------------------------------------------------------------


def read_metrics(run_dir: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The records of `<run_dir>/metrics.jsonl` in the order written (all kinds, or one).

    A resumed run appends to the same file, so its legs follow one another. A line that does
    not parse is skipped: a job killed in the middle of a write leaves half a line, which the
    next leg then continues. Raises ValueError if the folder holds no metrics.jsonl."""
    from fsdp_utils.config.layout import RunLayout

    path = RunLayout.of(run_dir).metrics
    if not path.is_file():
        raise ValueError(
            f"{run_dir} is not a run folder: it has no metrics.jsonl (chess_finetune.py writes "
            "one into its --output_dir when training starts). Give the run's --output_dir, e.g. "
            "`python -m fsdp_utils.plot runs/chess -o runs.png`."
        )
    records = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and (kind is None or record.get("kind") == kind):
                records.append(record)
    return records


def latest_history(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's history as it stands after its resumes, in order.

    Each leg of a run logs a "start" record at the step it starts from (0, or the checkpoint it
    resumed). A leg resumed from a checkpoint older than the last step logged (a job killed
    between two saves) logs those steps again: what earlier legs logged after its start step is
    dropped, since the run continued from the checkpoint, not from them. (TensorBoard's purge of
    a restarted run does the same: `fsdp_utils.metrics.trackers`.)"""
    kept: list[dict[str, Any]] = []
    for record in records:
        start = record.get("step")
        if record.get("kind") == "start" and isinstance(start, int):
            kept = [r for r in kept if not (isinstance(r.get("step"), int) and r["step"] > start)]
        kept.append(record)
    return kept


def scalar_fields(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a record, without its step and time stamp: what plots and trackers draw.
    Booleans and missing values (None: e.g. MFU on a CPU) are not numbers here."""
    return {
        key: float(value)
        for key, value in record.items()
        if key not in ("step", "time")
        and isinstance(value, int | float)
        and not isinstance(value, bool)
    }
