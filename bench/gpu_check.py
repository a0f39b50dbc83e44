"""GPU validation kit (`make gpu-check`): run the CUDA paths for real and measure them.

On whatever CUDA GPUs are visible, with no download:

1. builds Llama-architecture models with random weights from configs (safetensors in a
   temporary folder, with a chess tokenizer and a few thousand random legal games): a ~1.1B
   shape, and the largest of 3B, 8B, 13B that the memory planner says fits these GPUs;
2. runs `chess_finetune.py` under torchrun on all visible GPUs, a few dozen steps per
   configuration: bf16-mixed with and without activation checkpointing, fp16-mixed (gradient
   scaler), `--cpu_offload`, and a save, a resume and an export;
3. measures tokens/s per GPU, MFU, peak allocated and reserved CUDA memory and the peak
   `nvidia-smi` memory.used, each against the planner's prediction for the same configuration,
   and checkpoint save and load times;
4. writes `gpu_check.json` and `gpu_check.md` (a markdown table) to `--output`.

    python bench/gpu_check.py                      # or: make gpu-check
    python bench/gpu_check.py --only 1b --steps 20 # a quicker subset

Without a CUDA device it prints one line and exits 2. `--allow-cpu --shapes tiny` runs the same
flow on CPU (gloo) with a tiny model: that is how its logic is tested.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXIT_NO_GPU = 2
GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama-architecture shape (vocabulary 32,000 as Llama 2 / TinyLlama)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 32000

    def parameters(self) -> int:
        head_dim = self.hidden // self.heads
        attention = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attention + mlp + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden


SHAPES = {
    "tiny": Shape("tiny", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512),
    "1b": Shape("1b", hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632),  # TinyLlama
    "3b": Shape("3b", hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192),
    "8b": Shape("8b", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
    "13b": Shape("13b", hidden=5120, layers=40, heads=40, kv_heads=40, intermediate=13824),
}
LARGE_CANDIDATES = ("13b", "8b", "3b")  # largest first


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training configuration of the kit."""

    name: str
    shape: str
    flags: tuple[str, ...]
    steps: int
    batch_size_per_device: int
    seq_length: int

    def label(self) -> str:
        return f"{self.shape} {self.name}"


def model_config(shape: Shape, tokenizer: Any, seq_length: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=max(shape.vocab, len(tokenizer)),
        max_position_embeddings=max(4096, seq_length),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def write_model(folder: Path, shape: Shape, tokenizer: Any, seq_length: int, device: str) -> Path:
    """Random bf16 weights (initialised on the GPU: a 13B init on the host takes minutes)."""
    import torch
    from transformers import AutoModelForCausalLM

    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    config = model_config(shape, tokenizer, seq_length)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def build_data(folder: Path, games: int) -> tuple[Path, Any]:
    from fsdp_utils.synthetic import (
        iter_rendered,
        random_games,
        train_chess_tokenizer,
        write_chess_shards,
    )

    played = random_games(games, seed=0)
    write_chess_shards(played, folder / "data", num_shards=1)
    tokenizer = train_chess_tokenizer(list(iter_rendered(played)), vocab_size=512)
    return folder / "data", tokenizer


def run_specs(shapes: list[str], *, steps: int, seq_length: int, batch: int) -> list[RunSpec]:
    """The kit's configurations: everything on the first (small) shape, the headline
    configuration on the larger one."""
    specs: list[RunSpec] = []
    for index, shape in enumerate(shapes):
        bf16 = ("--precision", "bf16-mixed")
        specs.append(RunSpec("bf16-mixed", shape, bf16, steps, batch, seq_length))
        specs.append(
            RunSpec(
                "bf16-mixed + AC",
                shape,
                (*bf16, "--gradient_checkpointing"),
                steps,
                batch,
                seq_length,
            )
        )
        if index > 0:  # QLoRA on the large shape (8B on one 80 GB GPU: issue 40's row)
            specs.append(
                RunSpec(
                    "QLoRA bf16-mixed + AC",
                    shape,
                    (*bf16, "--qlora", "--gradient_checkpointing"),
                    steps,
                    batch,
                    seq_length,
                )
            )
        if index > 0:
            continue
        specs.append(
            RunSpec("fp16-mixed", shape, ("--precision", "fp16-mixed"), steps, batch, seq_length)
        )
        specs.append(
            RunSpec(
                "bf16-mixed + CPU offload",
                shape,
                (*bf16, "--cpu_offload"),
                max(3, steps // 3),
                batch,
                seq_length,
            )
        )
    return specs


class MemoryWatch:
    """Peak nvidia-smi memory.used (MiB) per GPU while a run goes: what the job really takes,
    CUDA context and NCCL buffers included, which torch's allocator statistics cannot see."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.peak_mib: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.available = shutil.which("nvidia-smi") is not None

    def __enter__(self) -> MemoryWatch:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.available:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    [
                        "nvidia-smi",
                        "--query-gpu=index,memory.used",
                        "--format=csv,noheader,nounits",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout
            except (OSError, subprocess.TimeoutExpired):
                out = ""
            for line in out.splitlines():
                cells = [c.strip() for c in line.split(",")]
                try:
                    index, used = int(cells[0]), float(cells[1])
                except (IndexError, ValueError):
                    continue
                self.peak_mib[index] = max(self.peak_mib.get(index, 0.0), used)
            self._stop.wait(self.interval)


def run_records(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl through the project's one reader; [] for a run that never started."""
    from fsdp_utils.metrics.logger import read_metrics

    try:
        return read_metrics(run_dir)
    except ValueError:
        return []


def summarize(records: list[dict[str, Any]], *, warmup: int = 3) -> dict[str, Any]:
    """Throughput and memory of a run from its metrics.jsonl: medians over the steps after
    `warmup` (compilation, allocator growth and the first all-gathers are not the steady
    state), peaks over all steps (memory_snapshot resets the CUDA peak at every log)."""
    train = [r for r in records if r.get("kind") == "train"]
    steady = train[warmup:] or train
    out: dict[str, Any] = {"steps_logged": len(train)}

    def median(key: str) -> float | None:
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    def peak(key: str) -> float | None:
        values = [r[key] for r in train if r.get(key) is not None]
        return max(values) if values else None

    out["tokens_per_s_per_gpu"] = median("tokens_per_s_per_device")
    out["mfu_pct"] = median("mfu_pct")
    out["step_time_s"] = median("step_time_s")
    out["peak_allocated_gib"] = peak("cuda_peak_allocated_gib")
    out["peak_reserved_gib"] = peak("cuda_peak_reserved_gib")
    out["final_loss"] = train[-1]["loss"] if train else None
    saves = [r["seconds"] for r in records if r.get("kind") == "checkpoint"]
    loads = [r for r in records if r.get("kind") == "resumed"]
    out["checkpoint_save_s"] = max(saves) if saves else None
    out["resumed"] = bool(loads)
    finals = [r for r in records if r.get("kind") == "final_model"]
    out["final_model"] = finals[-1].get("path") if finals else None
    out["export_s"] = finals[-1].get("seconds") if finals else None
    return out


def resume_seconds(log_text: str) -> float | None:
    """`checkpoint: resumed from step N (...) in 1.2s`: the load time the trainer logs. From the
    log line, not the `resumed` record: that record's step precedes the trackers' current step,
    so a number there could not become a W&B scalar."""
    import re

    match = re.search(r"checkpoint: resumed from step \d+ .* in ([0-9.]+)s", log_text)
    return float(match.group(1)) if match else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def render_table(result: dict[str, Any]) -> str:
    """The markdown table to paste into docs/gpu-check.md."""

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        f"GPU: {result['gpu']} x {result['gpus']} (torch {result['torch']}, "
        f"seq {result['seq_length']}, batch {result['batch_size_per_device']} per GPU)",
        "",
        "| model | configuration | tokens/s/GPU | MFU % | peak alloc GiB | peak reserved GiB "
        "| nvidia-smi GiB | planner peak GiB | alloc/plan | reserved/plan | used/required |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in result["runs"]:
        if run.get("error"):
            lines.append(f"| {run['shape']} | {run['name']} | failed: {run['error']} |")
            continue
        lines.append(
            f"| {run['shape']} ({run['parameters'] / 1e9:.2f}B) | {run['name']} "
            f"| {fmt(run['tokens_per_s_per_gpu'], ',.0f')} | {fmt(run['mfu_pct'], '.1f')} "
            f"| {fmt(run['peak_allocated_gib'], '.2f')} | {fmt(run['peak_reserved_gib'], '.2f')} "
            f"| {fmt(run['smi_peak_gib'], '.2f')} | {fmt(run['planned_peak_gib'], '.2f')} "
            f"| {fmt(run['allocated_over_plan'], '.3f')} | {fmt(run['reserved_over_plan'], '.3f')} "
            f"| {fmt(run['used_over_required'], '.3f')} |"
        )
    margin = result.get("margin_suggestion")
    if margin:
        lines += [
            "",
            f"planner margin from these runs: allocator +{margin['allocator_fraction']:.1%} "
            f"(reserved over allocated), runtime {margin['runtime_gib']:.2f} GiB "
            "(nvidia-smi over reserved)",
        ]
    ckpt = result.get("checkpoint") or {}
    if ckpt:
        lines += [
            "",
            f"checkpoint ({ckpt.get('shape')}): save {fmt(ckpt.get('save_s'), '.1f')} s, "
            f"load (resume) {fmt(ckpt.get('load_s'), '.1f')} s, final HF export "
            f"{fmt(ckpt.get('export_s'), '.1f')} s; resumed: {ckpt.get('resumed')}",
        ]
    return "\n".join(lines) + "\n"


class Kit:
    def __init__(self, args: argparse.Namespace, work: Path, device: str, gpus: int) -> None:
        self.args = args
        self.work = work
        self.device = device
        self.gpus = gpus
        self.env = {**os.environ, "OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"}

    def common_flags(self, model: Path, data: Path, out: Path, spec: RunSpec) -> list[str]:
        return [
            "--model", str(model), "--dataset", str(data), "--dataset_include", "",
            "--data_cache_dir", str(self.work / "prepared"), "--output_dir", str(out),
            "--max_seq_length", str(spec.seq_length),
            "--batch_size_per_device", str(spec.batch_size_per_device),
            "--total_batch_size", str(spec.batch_size_per_device * self.gpus),
            "--max_training_steps", str(spec.steps), "--learning_rate", "1e-4",
            "--warmup_steps", "0", "--eval_every", "0", "--eval_examples", "0",
            "--save_every_minutes", "0", "--log_every", "1", "--device", self.device,
            *spec.flags,
        ]  # fmt: skip

    def plan(self, model: Path, data: Path, spec: RunSpec) -> dict[str, Any] | None:
        """The planner's prediction for exactly this configuration (None if it cannot plan)."""
        flags = self.common_flags(model, data, self.work / "plan-unused", spec)
        command = [sys.executable, "-m", "fsdp_utils.plan", *flags, "--json"]
        command += ["--gpus_per_node", str(self.gpus), "--no_fixes"]
        if self.args.gpu_memory:
            command += ["--gpu_memory", self.args.gpu_memory]
        result = subprocess.run(command, capture_output=True, text=True, env=self.env, cwd=REPO)
        try:
            return json.loads(result.stdout)
        except json.JSONDecodeError:
            print(f"  planner failed (exit {result.returncode}): {result.stderr[-800:]}")
            return None

    def train(
        self, model: Path, data: Path, out: Path, spec: RunSpec, *extra: str
    ) -> tuple[int, str, dict[int, float]]:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        command = [torchrun, "--standalone", f"--nproc_per_node={self.gpus}"]
        command += [str(REPO / "chess_finetune.py"), *self.common_flags(model, data, out, spec)]
        command += list(extra)
        with MemoryWatch() as watch:
            result = subprocess.run(command, capture_output=True, text=True, env=self.env, cwd=REPO)
        log = result.stdout + result.stderr
        (out / "gpu_check.log").parent.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.log").write_text(log)
        return result.returncode, log, watch.peak_mib

    def measure(self, model: Path, data: Path, spec: RunSpec) -> dict[str, Any]:
        shape = SHAPES[spec.shape]
        out = self.work / "runs" / f"{spec.shape}-{spec.name.replace(' ', '').replace('+', '_')}"
        print(f"gpu-check: {spec.label()}: {spec.steps} steps ...", flush=True)
        started = time.perf_counter()
        code, log, smi = self.train(model, data, out, spec, "--no_final_save", "--resume", "never")
        row: dict[str, Any] = {"shape": spec.shape, "name": spec.name, "flags": list(spec.flags)}
        row["parameters"] = shape.parameters()
        row["wall_s"] = time.perf_counter() - started
        if code != 0:
            row["error"] = f"exit {code}"
            row["log_tail"] = log[-3000:]
            print(f"  FAILED (exit {code}):\n{log[-3000:]}", flush=True)
            return row
        row.update(summarize(run_records(out)))
        plan = self.plan(model, data, spec)
        planned = plan["peak_bytes"] / GIB if plan else None
        required = plan["required_bytes"] / GIB if plan else None
        row["planned_peak_gib"] = planned
        row["planned_required_gib"] = required
        row["smi_peak_gib"] = max(smi.values()) / 1024 if smi else None
        row["allocated_over_plan"] = ratio(row["peak_allocated_gib"], planned)
        row["reserved_over_plan"] = ratio(row["peak_reserved_gib"], planned)
        row["used_over_required"] = ratio(row["smi_peak_gib"], required)
        print(
            f"  {row['tokens_per_s_per_gpu'] or 0:,.0f} tokens/s/GPU, MFU {row['mfu_pct']}, "
            f"peak alloc {row['peak_allocated_gib']} GiB, planned {planned}",
            flush=True,
        )
        return row

    def checkpoint_cycle(self, model: Path, data: Path, spec: RunSpec) -> dict[str, Any]:
        """Save at half way (stop as if the time limit came), resume, finish, export."""
        out = self.work / "runs" / f"{spec.shape}-checkpoint"
        half = max(1, spec.steps // 2)
        print(f"gpu-check: {spec.shape} save/resume/export ({spec.steps} steps) ...", flush=True)
        stop = ("--save_every_steps", str(half), "--stop_after_steps", str(half))
        code1, log1, _ = self.train(model, data, out, spec, *stop, "--resume", "never")
        code2, log2, _ = self.train(model, data, out, spec, "--resume", "auto")
        records = run_records(out)
        summary = summarize(records)
        result = {
            "shape": spec.shape,
            "exit_codes": [code1, code2],
            "save_s": summary["checkpoint_save_s"],
            "load_s": resume_seconds(log2),
            "export_s": summary["export_s"],
            "resumed": summary["resumed"],
            "final_model": summary["final_model"],
        }
        if code1 or code2:
            result["log_tail"] = (log1 + log2)[-3000:]
            print(f"  FAILED:\n{result['log_tail']}", flush=True)
        return result


def margin_suggestion(runs: list[dict[str, Any]]) -> dict[str, float] | None:
    """What the planner's margin (fsdp_utils.plan.report.Margin) should be, from the measured
    runs: the allocator's share is reserved over allocated peak, the runtime part is what
    nvidia-smi saw beyond torch's reserved memory (CUDA context, cuBLAS workspaces, NCCL)."""
    fractions = [
        r["peak_reserved_gib"] / r["peak_allocated_gib"] - 1.0
        for r in runs
        if r.get("peak_reserved_gib") and r.get("peak_allocated_gib")
    ]
    runtime = [
        r["smi_peak_gib"] - r["peak_reserved_gib"]
        for r in runs
        if r.get("smi_peak_gib") and r.get("peak_reserved_gib")
    ]
    if not fractions or not runtime:
        return None
    return {
        "allocator_fraction": max(fractions),
        "runtime_gib": max(runtime),
        "runs": float(len(fractions)),
    }


def choose_large_shape(plans: dict[str, dict[str, Any] | None]) -> str | None:
    """The largest candidate shape the planner says fits (None: none fits)."""
    for name in LARGE_CANDIDATES:
        plan = plans.get(name)
        if plan is not None and plan.get("fits"):
            return name
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "gpu_check")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: temp)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
    parser.add_argument("--games", type=int, default=4000, help="random games for the data")
    parser.add_argument(
        "--shapes",
        default="1b,auto",
        help="comma-separated shapes (tiny, 1b, 3b, 8b, 13b); auto: the largest of "
        "13b/8b/3b that the planner says fits",
    )
    parser.add_argument("--large-batch", type=int, default=2, help="batch per GPU, large shape")
    parser.add_argument("--no-checkpoint", action="store_true", help="skip save/resume/export")
    parser.add_argument(
        "--configs",
        default="",
        help="comma-separated configuration names to run (default: all), e.g. 'bf16-mixed'",
    )
    parser.add_argument("--extra", default="", help="extra chess_finetune.py flags for every run")
    parser.add_argument("--gpu-memory", default=None, help="for the planner (default: detected)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU (tests only)")
    args = parser.parse_args(argv)

    import torch

    if torch.cuda.is_available():
        device, gpus = "cuda", torch.cuda.device_count()
        gpu_name = torch.cuda.get_device_name(0)
    elif args.allow_cpu:
        device, gpus, gpu_name = "cpu", 1, "cpu"
    else:
        print(
            "gpu-check: no CUDA device is visible (torch.cuda.is_available() is False): run it "
            "on a GPU node, e.g. `srun -p <gpu-partition> --gpus-per-node 4 -t 30 make gpu-check`.",
            file=sys.stderr,
        )
        return EXIT_NO_GPU

    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data, tokenizer = build_data(work, args.games)
    kit = Kit(args, work, device, gpus)
    print(f"gpu-check: {gpus} x {gpu_name}; data {data} ({time.perf_counter() - started:.0f}s)")

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s != "auto" and s not in SHAPES]
    if unknown:
        print(
            f"gpu-check: unknown shape(s) {unknown}; choose from {sorted(SHAPES)}", file=sys.stderr
        )
        return 2
    models: dict[str, Path] = {}
    if "auto" in shapes:
        plans: dict[str, dict[str, Any] | None] = {}
        for name in LARGE_CANDIDATES:
            models[name] = write_config_only(work / f"model-{name}", SHAPES[name], tokenizer, args)
            spec = RunSpec("plan", name, ("--gradient_checkpointing",), 1, args.large_batch,
                           args.seq_length)  # fmt: skip
            plan = plans[name] = kit.plan(models[name], data, spec)
            print(f"gpu-check: planner for {name}: fits={plan and plan['fits']}")
        chosen = choose_large_shape(plans)
        shapes = [s for s in shapes if s != "auto"] + ([chosen] if chosen else [])
    for name in shapes:
        shutil.rmtree(work / f"model-{name}", ignore_errors=True)
        models[name] = write_model(work / f"model-{name}", SHAPES[name], tokenizer,
                                   args.seq_length, device)  # fmt: skip
    specs = run_specs(shapes, steps=args.steps, seq_length=args.seq_length, batch=args.batch)
    if len(shapes) > 1:  # the large shape runs with its own (smaller) batch
        specs = [
            dataclasses.replace(s, batch_size_per_device=args.large_batch)
            if s.shape != shapes[0]
            else s
            for s in specs
        ]
    if args.configs:
        wanted = {c.strip() for c in args.configs.split(",")}
        specs = [s for s in specs if s.name in wanted]
    if args.extra:
        specs = [dataclasses.replace(s, flags=(*s.flags, *args.extra.split())) for s in specs]

    if not specs:
        print(f"gpu-check: no configuration matches --configs {args.configs!r}", file=sys.stderr)
        return 2
    runs = [kit.measure(models[s.shape], data, s) for s in specs]
    checkpoint = None
    if not args.no_checkpoint:
        first = specs[0]
        checkpoint = kit.checkpoint_cycle(models[first.shape], data, first)
    result = {
        "gpu": gpu_name,
        "gpus": gpus,
        "torch": torch.__version__,
        "seq_length": args.seq_length,
        "batch_size_per_device": args.batch,
        "runs": runs,
        "checkpoint": checkpoint,
        "margin_suggestion": margin_suggestion(runs),
        "seconds": time.perf_counter() - started,
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "gpu_check.json").write_text(json.dumps(result, indent=2))
    table = render_table(result)
    (args.output / "gpu_check.md").write_text(table)
    print("\n" + table)
    failed = [r for r in runs if r.get("error")] + (
        [checkpoint] if checkpoint and any(checkpoint["exit_codes"]) else []
    )
    return 1 if failed else 0


def write_config_only(folder: Path, shape: Shape, tokenizer: Any, args: argparse.Namespace) -> Path:
    """config.json + tokenizer without weights: all the planner reads."""
    folder.mkdir(parents=True, exist_ok=True)
    model_config(shape, tokenizer, args.seq_length).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    raise SystemExit(main())
