"""QLoRA beside LoRA on a model whose weights dominate (CPU, gloo): host memory per process while
loading and while training, measured from outside the processes, and the speed.

The model: a Llama of hidden size 1024, 24 layers, MLP 2816, 16 heads (8 key/value heads) and
the chess tokenizer (512 words): 283.6M parameters, 99.6% of them in the decoder layers' linear
weights, saved in bf16 (567 MB of safetensors). The runs: `chess_finetune.py --lora` with and
without `--quantize nf4`, dropout 0, in the settings of `SETTINGS` (first: issue 40's, fp32 on 2
processes); 128 tokens per sequence, 1 per device, 4 per step, 4 steps (the last 2 timed), no
checkpoints, no final model.

Memory: every 5 ms a sampler reads /proc/<pid>/status of each worker (VmRSS, and its parts
RssAnon: the process's own memory; RssFile: mapped files, the libraries and any mapped
checkpoint; RssShmem), independently of the toolkit's own `peak rss` (which resets the kernel's
peak at every log step, so `/usr/bin/time` would report only the last interval's peak). The run's
log lines split the time: *loading* from the first `data:` line done to "model: built, sharded
and loaded" (meta build, sharding, weights), *training* from "training:" to the end. Per phase:
the highest VmRSS of any worker, with its RssAnon/RssFile at that sample. *Before loading*: the
RSS when loading starts (imports, data, the meta model). Speed: rank 0's CPU seconds per step
(steadier than wall clock on a shared machine) and tokens/s, steps 3-4.

    python bench/qlora.py                # every setting of SETTINGS (~50 min on a loaded 2-core machine)
    python bench/qlora.py --quick        # issue 40's setting only: 2 processes, fp32
    python bench/qlora.py --baseline DIR # also LoRA from another checkout (before a change)
    python bench/qlora.py --malloc 2     # the fixed mmap threshold's cost, LoRA, 2 pairs

Writes bench/results/qlora.json and prints a markdown table, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
MIB = 2**20
SEQ, TOTAL, STEPS = 128, 4, 4
SHAPE: dict[str, Any] = {
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
}
STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
# Log lines (rank 0's) that mark the phases, in order.
LOADED = "model: built, sharded and loaded"
TRAINING = "training: steps"


def assets() -> dict[str, Path]:
    """The chess data and tokenizer of the demo, and the 284M Llama in bf16 (built once)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from fsdp_utils.synthetic import build_demo_assets

    folder = RESULTS / "qlora_assets"
    demo = folder / "demo"
    if not (demo / "data").is_dir():
        build_demo_assets(demo, num_games=2000, num_shards=1)
    model_dir = folder / "llama-284m-bf16"
    if not (model_dir / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(demo / "model")
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            max_position_embeddings=1024,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **SHAPE,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    return {"model": model_dir, "data": demo / "data"}


@dataclass
class Sample:
    t: float
    pid: int
    kib: dict[str, int]


@dataclass
class Sampler:
    """Polls /proc/<pid>/status of the workers of a process tree every `interval` seconds."""

    root: int
    interval: float = 0.005
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def workers(self) -> list[int]:
        """torchrun's children (the ranks), or the process itself when it runs alone."""
        try:
            children = Path(f"/proc/{self.root}/task/{self.root}/children").read_text().split()
        except OSError:
            return []
        return [int(c) for c in children] or [self.root]

    def run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for pid in self.workers():
                kib = read_status(pid)
                if kib:
                    self.samples.append(Sample(now, pid, kib))
            time.sleep(self.interval)

    def stop(self) -> None:
        self._stop.set()


def read_status(pid: int) -> dict[str, int]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in STATUS_FIELDS:
            found[name] = int(value.split()[0])
    return found


def phase_figures(samples: list[Sample], start: float, end: float) -> dict[str, float]:
    """The sample of the highest VmRSS of any worker in [start, end): its parts, in MiB."""
    inside = [s for s in samples if start <= s.t < end and "VmRSS" in s.kib]
    if not inside:
        return {}
    top = max(inside, key=lambda s: s.kib["VmRSS"])
    return {name: top.kib.get(name, 0) / 1024 for name in STATUS_FIELDS}


def run(
    paths: dict[str, Path],
    method: str,
    setting: tuple[int, str, tuple[str, ...]],
    checkout: Path = REPO,
    env_extra: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One training run under the sampler: its phases' peaks and its speed."""
    nproc, precision, extra = setting
    name = f"{method}-{precision}-{nproc}p{''.join(extra)}" + ("" if checkout == REPO else "-base")
    out = RESULTS / "qlora_runs" / name
    shutil.rmtree(out, ignore_errors=True)
    flags = ["--lora", "--lora_dropout", "0"] + (["--quantize", "nf4"] if method == "QLoRA" else [])
    script = str(checkout / "chess_finetune.py")
    launcher = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    command = [
        *(launcher or [sys.executable]), script,
        "--model", str(paths["model"]), "--dataset", str(paths["data"]),
        "--data_cache_dir", str(RESULTS / "qlora_prepared"), "--output_dir", str(out),
        "--max_seq_length", str(SEQ), "--batch_size_per_device", "1",
        "--total_batch_size", str(TOTAL), "--max_training_steps", str(STEPS),
        "--precision", precision, "--eval_every", "0", "--eval_batches", "1",
        "--save_every_minutes", "0", "--no_final_save", "--resume", "never", "--log_every", "1",
        *flags, *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = str(checkout)
    env.update(env_extra or {})
    started = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    sampler = Sampler(proc.pid)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    marks: dict[str, float] = {}
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        now = time.monotonic()
        if line.startswith("data:"):
            marks["loading"] = now  # the last data line: loading comes next
        for key, text in (("loaded", LOADED), ("training", TRAINING)):
            if text in line and key not in marks:
                marks[key] = now
    proc.wait()
    ended = time.monotonic()
    sampler.stop()
    thread.join()
    if proc.returncode != 0 or set(marks) != {"loading", "loaded", "training"}:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{''.join(lines[-40:])}")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    first, last = train[1], train[-1]  # steps 3-4 timed (log_every 1)
    steps = last["step"] - first["step"]
    before = phase_figures(sampler.samples, marks["loading"] - 0.05, marks["loading"])
    return {
        "name": name,
        "method": method if checkout == REPO else f"{method} ({checkout.name})",
        "precision": precision,
        "nproc": nproc,
        "flags": " ".join(extra),
        "seconds": ended - started,
        "before_loading": before,
        "loading": phase_figures(sampler.samples, marks["loading"], marks["loaded"]),
        "training": phase_figures(sampler.samples, marks["training"], ended),
        "toolkit_peak_rss_gib": max(r.get("host_peak_rss_gib", 0) for r in train),
        "cpu_seconds_per_step": (last["process_cpu_s"] - first["process_cpu_s"]) / steps,
        "tokens_per_s": (last["tokens_seen"] - first["tokens_seen"])
        / (last["time"] - first["time"]),
        "start_lines": [x.rstrip() for x in lines if x.startswith(("lora:", "qlora:"))],
        "samples": len(sampler.samples),
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| method | precision | processes | flags | before loading | loading peak | training peak "
        "(anon + file) | QLoRA / LoRA training | toolkit's peak rss | CPU s/step | tokens/s |\n"
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    lora = {(r["precision"], r["nproc"], r["flags"]): r for r in rows if r["method"] == "LoRA"}
    out = [head]
    for r in rows:
        train = r["training"]
        ratio = ""
        base = lora.get((r["precision"], r["nproc"], r["flags"]))
        if r["method"] == "QLoRA" and base:
            ratio = f"{train['VmRSS'] / base['training']['VmRSS']:.2f}"
        out.append(
            f"| {r['method']} | {r['precision']} | {r['nproc']} | {r['flags']} | "
            f"{r['before_loading'].get('VmRSS', 0):,.0f} | {r['loading']['VmRSS']:,.0f} | "
            f"{train['VmRSS']:,.0f} ({train['RssAnon']:,.0f} + {train['RssFile']:,.0f}) | "
            f"{ratio} | {r['toolkit_peak_rss_gib'] * 1024:,.0f} | "
            f"{r['cpu_seconds_per_step']:.1f} | {r['tokens_per_s']:.1f} |"
        )
    return "\n".join(out) + "\n\nMiB per process (the highest of the ranks)."


def malloc_pairs(paths: dict[str, Path], pairs: int) -> str:
    """LoRA in issue 40's setting with the trainer's fixed mmap threshold (128 KiB,
    fsdp_utils/run/host_memory.py) against a fixed 32 MiB (glibc's moving threshold at its
    ceiling, where it ends up after the first steps: blocks below it come from the heaps),
    interleaved A B B A ...: the training peak and rank 0's CPU seconds per step, pair by pair."""
    settings = {"128 KiB (the trainer's)": None, "32 MiB": {"MALLOC_MMAP_THRESHOLD_": str(2**25)}}
    lines = ["| threshold | training peak MiB | CPU s/step | tokens/s |", "|---|---:|---:|---:|"]
    ratios = []
    for index in range(pairs):
        order = list(settings) if index % 2 == 0 else list(reversed(settings))
        got = {name: run(paths, "LoRA", SETTINGS[0], env_extra=settings[name]) for name in order}
        for name in order:
            r = got[name]
            lines.append(
                f"| {name} | {r['training']['VmRSS']:,.0f} | {r['cpu_seconds_per_step']:.1f} "
                f"| {r['tokens_per_s']:.1f} |"
            )
        fixed, moving = (got[name]["cpu_seconds_per_step"] for name in settings)
        ratios.append(fixed / moving)
    shown = ", ".join(f"{r:.2f}" for r in ratios)
    return "\n".join(lines) + f"\n\nCPU s/step, 128 KiB over 32 MiB, pair by pair: {shown}"


# (processes, precision, extra flags): issue 40's setting first
SETTINGS = [
    (2, "fp32", ()),
    (2, "fp32", ("--gradient_checkpointing",)),
    (2, "bf16-mixed", ()),
    (1, "fp32", ()),
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="issue 40's setting only")
    parser.add_argument(
        "--baseline", type=Path, help="also LoRA from this checkout, in issue 40's setting"
    )
    parser.add_argument(
        "--malloc", type=int, metavar="PAIRS", help="only the mmap threshold's cost: PAIRS pairs"
    )
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    paths = assets()
    if args.malloc:
        before = os.getloadavg()
        print(malloc_pairs(paths, args.malloc))
        print(f"load average before and after: {before}, {os.getloadavg()}")
        return
    load = [os.getloadavg()]
    rows = []
    for setting in SETTINGS[:1] if args.quick else SETTINGS:
        for method in ("LoRA", "QLoRA"):  # one after the other: load drifts hit both
            rows.append(run(paths, method, setting))
            print(json.dumps({k: rows[-1][k] for k in ("name", "loading", "training")}))
        if args.baseline and setting == SETTINGS[0]:
            rows.append(run(paths, "LoRA", setting, args.baseline))
        load.append(os.getloadavg())
    result = {
        "rows": rows,
        "load_average": load,
        "model": {**SHAPE, "vocab_size": 512, "dtype": "bfloat16"},
    }
    (RESULTS / "qlora.json").write_text(json.dumps(result, indent=2))
    print(table(rows))
    print(f"load average (1, 5, 15 min) before and after each setting: {load}")


if __name__ == "__main__":
    main()
