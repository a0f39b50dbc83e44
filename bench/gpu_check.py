"""GPU validation kit (`make gpu-check`): run the CUDA paths for real and measure them.

On one lent H100 from a fresh copy of the tree (docs/gpu-check.md has the exact device call), or
on a cluster's GPU node:

    python3 bench/gpu_check.py --wheels .whl --output $OUT          # the prepared call, < 6 min
    python3 bench/gpu_check.py --wheels .whl --output $OUT --quick  # a second try: the 1B rows
    python3 bench/gpu_check.py --only 8b-lora-4k,8b-lora-32k --output DIR   # chosen rows
    python bench/gpu_check.py                                       # make gpu-check (cluster node)
    python bench/gpu_check.py --allow-cpu --shapes tiny --budget 0 --output DIR   # CPU dry run

1. `--wheels DIR`: installs the carried wheels this Python lacks into `--site` (bench/device_stack.py
   decides which), then runs again with them first on PYTHONPATH; then checks the versions with
   the toolkit's own check (`python -m fsdp_utils.versions`) and stops there if it fails.
2. Builds Llama-architecture models with random weights (safetensors, a chess tokenizer, a few
   thousand random legal games): the 1.1B shape (TinyLlama's) and the 8B one (Llama 3's).
3. Runs ROWS in order, each a real command of the toolkit (`chess_finetune.py` under torchrun,
   `python -m fsdp_utils.evaluate`) or a probe, few steps each: tokens/s per GPU, MFU, peak
   allocated and reserved CUDA memory and the peak nvidia-smi memory.used, each against the
   memory planner's prediction for the same configuration (planned on the CPU beside the runs),
   checkpoint save/load/export times, document masking's losses, evaluation requests/s.
   `--budget` seconds in all (330 by default): a row whose estimate would pass it is skipped and
   says so; each row has a time limit of its own.
4. Writes into `--output` after every row: gpu_check.json (everything), gpu_check.md (the
   table), gpu_check.log (this output), versions.txt (the versions found, the wheels installed)
   and logs.tar.gz (each run's log, metrics.jsonl and plan).

Without a CUDA device it prints one line and exits 2. `--allow-cpu --shapes tiny` runs the same
rows on CPU (gloo) with a tiny model and short sequences: that is how its logic is tested.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import io
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for _path in (str(REPO), str(BENCH)):  # the device runs the checkout, not an installed package
    if _path not in sys.path:
        sys.path.insert(0, _path)

EXIT_NO_GPU = 2
GIB = 1024**3
DEFAULT_BUDGET_S = 460.0  # of the 9 minutes a prepared device call may take
STARTED_ENV = "GPU_CHECK_STARTED"  # the first start's clock, kept across the re-run with wheels
EVAL_TASK = "arc_easy"
EVAL_DOCUMENTS = 400  # 1,600 requests (four answers each) on a GPU


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
    # 256 wide: the smallest whose every decoder linear NF4 can hold (nf4_holds), so that the CPU
    # dry run runs the QLoRA row too (1.4M parameters)
    "tiny": Shape("tiny", hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=512),
    "1b": Shape("1b", hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632),  # TinyLlama
    "3b": Shape("3b", hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192),
    "8b": Shape("8b", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
    "13b": Shape("13b", hidden=5120, layers=40, heads=40, kv_heads=40, intermediate=13824),
}
TINY_SEQ_DIVISOR = 32  # --shapes tiny: 2,048 tokens -> 64, 32k -> 1,024

BF16 = ("--precision", "bf16-mixed")
AC = ("--gradient_checkpointing",)
LORA = ("--lora",)
# The QLoRA row's flags (issue 40).
QLORA = ("--lora", "--quantize", "nf4")
# GRPO (issue 50): G = 8 completions of up to GRPO_COMPLETION tokens per prompt, the chess
# legality reward (no file, no engine), on prompts made from the kit's games.
GRPO_COMPLETION = 128
GRPO = ("--method", "grpo", "--reward_funcs", "chess_legal", "--num_generations", "8",
        "--log_completions_every", "0")  # fmt: skip
# torchao's NF4 quantizes in blocks of 64 weights with one 8-bit scale per 256 blocks: a weight it
# can hold has a multiple of this many elements (one process: FSDP2 splits nothing).
NF4_ELEMENTS = 16_384


def nf4_holds(shape: Shape) -> bool:
    """Whether every linear weight of the shape's decoder layers can be stored as NF4."""
    head_dim = shape.hidden // shape.heads
    sizes = (
        shape.hidden * shape.heads * head_dim,  # q_proj, o_proj
        shape.hidden * shape.kv_heads * head_dim,  # k_proj, v_proj
        shape.hidden * shape.intermediate,  # gate, up, down
    )
    return all(size % NF4_ELEMENTS == 0 for size in sizes)


@dataclasses.dataclass(frozen=True)
class Row:
    """One measurement. `kind`: train (one chess_finetune.py run), checkpoint (save at half
    way, resume, export), masking (the probe), evaluate (python -m fsdp_utils.evaluate on the
    checkpoint row's export). `role`: the small (1B) or large (8B) shape. `estimate_s`: its
    wall time on one H100, start-up included, for the budget."""

    name: str
    kind: str
    role: str
    seq: int
    batch: int
    steps: int
    flags: tuple[str, ...] = ()
    estimate_s: float = 30.0
    quick: bool = False
    needs_cuda: bool = False
    tiny_seq: int = 64  # the shortest sequence with --shapes tiny (masking: several games a row)


# In order of value: what the first GPU measurement needs most comes first (issue 43); the last
# three (QLoRA, fp16, compiled: measured on the first H100 call) run when the rows before them
# beat their estimates, else a second call runs them: --only 8b-qlora-4k,1b-fp16,1b-bf16-compile
# (docs/gpu-check.md). GRPO's row (issue 50) runs before them: it has never run on a GPU. The
# estimates are the first H100 call's wall times (2026-11-27, one H100 80GB HBM3), rounded up;
# GRPO's is its own guess.
ROWS: tuple[Row, ...] = (
    Row("1b-bf16", "train", "small", 2048, 4, 12, BF16, 32, quick=True),
    Row("1b-bf16-ac", "train", "small", 2048, 4, 12, (*BF16, *AC), 28, quick=True),
    Row("1b-checkpoint", "checkpoint", "small", 2048, 4, 4, BF16, 92, quick=True),
    Row("1b-masking", "masking", "small", 2048, 2, 1, (), 24, quick=True, tiny_seq=1024),
    Row("8b-lora-4k", "train", "large", 4096, 1, 6, (*BF16, *AC, *LORA), 36),
    Row("8b-lora-32k", "train", "large", 32768, 1, 2, (*BF16, *AC, *LORA), 42),
    Row("1b-evaluate", "evaluate", "small", 2048, 0, 0, (), 36, quick=True),
    Row("1b-bf16-offload", "train", "small", 2048, 4, 4, (*BF16, "--cpu_offload"), 45,
        needs_cuda=True),
    Row("1b-grpo", "grpo", "small", 1024, 2, 5, (*BF16, *GRPO), 45),
    Row("8b-qlora-4k", "train", "large", 4096, 1, 6, (*BF16, *AC, *QLORA), 40),
    Row("1b-fp16", "train", "small", 2048, 4, 12, ("--precision", "fp16-mixed"), 32),
    # torch.compile per decoder layer: what MFU the eager 1b-bf16 row leaves on the table.
    Row("1b-bf16-compile", "train", "small", 2048, 4, 12, (*BF16, "--compile"), 75),
)  # fmt: skip
# Before the rows: the wheels installed, the random games and tokenizer, the 1B shape's weights
# (2.2 GB; 19 s on the first H100 call); before the first 8B row, its weights (15 GB written
# through the page cache: 31-36 s).
SETUP_S = 40.0
LARGE_WEIGHTS_S = 36.0


def estimate_s(rows: list[Row]) -> float:
    """The rows' planned seconds on one H100, the setup and the 8B weights included."""
    large = any(r.role == "large" for r in rows)
    return SETUP_S + sum(r.estimate_s for r in rows) + (LARGE_WEIGHTS_S if large else 0.0)


def select_rows(rows: tuple[Row, ...], *, quick: bool = False, only: str = "") -> list[Row]:
    """The rows to run: all, the --quick ones, or those --only names (in ROWS' order)."""
    chosen = [r for r in rows if r.quick] if quick else list(rows)
    if only:
        wanted = [n.strip() for n in only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {r.name for r in rows})
        if unknown:
            raise ValueError(f"unknown row(s) {unknown}; the rows: {[r.name for r in rows]}")
        chosen = [r for r in rows if r.name in wanted]
    return chosen


def scaled(row: Row, shapes: dict[str, str]) -> Row:
    """The row for the shapes in use: --shapes tiny divides the sequence lengths too."""
    if shapes["small"] != "tiny":
        return row
    return dataclasses.replace(row, seq=max(row.tiny_seq, row.seq // TINY_SEQ_DIVISOR))


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


def write_config_only(folder: Path, shape: Shape, tokenizer: Any, seq_length: int) -> Path:
    """config.json + tokenizer without weights: all the planner reads."""
    folder.mkdir(parents=True, exist_ok=True)
    model_config(shape, tokenizer, seq_length).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_model(folder: Path, shape: Shape, tokenizer: Any, seq_length: int, device: str) -> Path:
    """Random bf16 weights (initialised on the GPU: an 8B init on the host takes minutes)."""
    import torch
    from transformers import AutoModelForCausalLM

    if (folder / "model.safetensors.index.json").is_file() or (
        folder / "model.safetensors"
    ).is_file():
        return folder
    torch.manual_seed(0)
    config = model_config(shape, tokenizer, seq_length)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
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


def build_prompts(games: Path, out: Path) -> Path:
    """The GRPO row's prompts: positions of the games after at most 8 plies (short enough for
    the dry run's 64 tokens), in the default template (fsdp_utils.chess_eval.prompt_set)."""
    from fsdp_utils.chess_eval.prompt_set import positions, read_games
    from fsdp_utils.config.train_config import DEFAULT_TEMPLATE

    rows = positions(read_games(games), template=DEFAULT_TEMPLATE, per_game=2, seed=0, max_plies=8)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


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
            out = _smi("--query-gpu=index,memory.used")
            for line in out.splitlines():
                cells = [c.strip() for c in line.split(",")]
                try:
                    index, used = int(cells[0]), float(cells[1])
                except (IndexError, ValueError):
                    continue
                self.peak_mib[index] = max(self.peak_mib.get(index, 0.0), used)
            self._stop.wait(self.interval)


def _smi(query: str) -> str:
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        return subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


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


def margin_suggestion(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """What the planner's margin (fsdp_utils.plan.report.Margin) should be, from the measured
    runs: the allocator's share is reserved over allocated peak, the runtime part is what
    nvidia-smi saw beyond torch's reserved memory (CUDA context, cuBLAS workspaces, NCCL).
    `fitted_fraction`: the allocator share that brings the planner's reserved peak (its
    predicted peak x (1 + share)) nearest to every measured one, the largest relative miss
    being `fitted_error`: the margin the planner uses is this one, not the largest share,
    since a caching allocator with room to spare keeps blocks it would free under pressure."""
    fractions = [
        r["peak_reserved_gib"] / r["peak_allocated_gib"] - 1.0
        for r in rows
        if r.get("peak_reserved_gib") and r.get("peak_allocated_gib")
    ]
    runtime = [
        r["smi_peak_gib"] - r["peak_reserved_gib"]
        for r in rows
        if r.get("smi_peak_gib") and r.get("peak_reserved_gib")
    ]
    if not fractions or not runtime:
        return None
    suggestion = {
        "allocator_fraction": max(fractions),
        "runtime_gib": max(runtime),
        "runs": float(len(fractions)),
    }
    planned = [
        (r["planned_peak_gib"], r["peak_reserved_gib"])
        for r in rows
        if r.get("planned_peak_gib") and r.get("peak_reserved_gib")
    ]
    if planned:

        def worst(share: float) -> float:
            return max(abs(plan * (1 + share) - got) / got for plan, got in planned)

        fitted = min((i / 200 for i in range(101)), key=worst)  # 0 to 50% by 0.5%
        suggestion.update(fitted_fraction=fitted, fitted_error=worst(fitted))
    return suggestion


def parameters(count: float) -> str:
    """1.10B, 0.14M: the table's model sizes."""
    return f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"


def render_table(result: dict[str, Any]) -> str:
    """The markdown to paste into docs/gpu-check.md: the training rows against the planner, then
    one line for each other row."""

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    env = result.get("environment", {})
    lines = [
        f"GPU: {result['gpu']} x {result['gpus']}, driver {env.get('driver', '-')}; torch "
        f"{result['torch']}, transformers {env.get('transformers', '-')}; "
        f"{result.get('seconds', 0):.0f} s in all",
        "",
        "| row | model | seq x batch | tokens/s/GPU | MFU % | peak alloc GiB | peak reserved GiB "
        "| nvidia-smi GiB | planner peak GiB | alloc/plan | reserved/plan | used/required |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    others = []
    for row in result["rows"]:
        status = row.get("status", "ok")
        if status != "ok":
            others.append(
                f"- {row['name']}: {status}{': ' + row['reason'] if row.get('reason') else ''}"
            )
            continue
        if row["kind"] != "train":
            others.append(f"- {row['name']}: {row.get('summary', 'ok')}")
            continue
        lines.append(
            f"| {row['name']} | {row['shape']} ({parameters(row['parameters'])}) "
            f"| {row['seq']} x {row['batch']} "
            f"| {fmt(row.get('tokens_per_s_per_gpu'), ',.0f')} | {fmt(row.get('mfu_pct'), '.1f')} "
            f"| {fmt(row.get('peak_allocated_gib'), '.2f')} "
            f"| {fmt(row.get('peak_reserved_gib'), '.2f')} "
            f"| {fmt(row.get('smi_peak_gib'), '.2f')} | {fmt(row.get('planned_peak_gib'), '.2f')} "
            f"| {fmt(row.get('allocated_over_plan'), '.3f')} "
            f"| {fmt(row.get('reserved_over_plan'), '.3f')} "
            f"| {fmt(row.get('used_over_required'), '.3f')} |"
        )
    lines += ["", *others]
    margin = result.get("margin_suggestion")
    if margin:
        lines += [
            "",
            f"planner margin from these runs: allocator +{margin['allocator_fraction']:.1%} "
            f"(reserved over allocated), runtime {margin['runtime_gib']:.2f} GiB "
            "(nvidia-smi over reserved)",
        ]
        if "fitted_fraction" in margin:
            lines.append(
                f"the allocator share nearest every reserved peak: "
                f"+{margin['fitted_fraction']:.1%} (planned x (1 + share) within "
                f"{margin['fitted_error']:.1%} of each)"
            )
    return "\n".join(lines) + "\n"


class Tee(io.TextIOBase):
    """This process's output to the terminal and to gpu_check.log as it goes."""

    def __init__(self, stream: TextIO, path: Path) -> None:
        self.stream = stream
        self.file = path.open("a", encoding="utf-8")

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.file.write(text)
        self.stream.flush()
        self.file.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()


def run_process(
    command: list[str],
    *,
    env: dict[str, str],
    timeout: float,
    log: Path,
    errors: Path | None = None,
) -> int:
    """`command` in its own process group, killed whole at `timeout`: its exit code, 124 for a
    timeout (as `timeout(1)` says it). Its output goes to `log` as it runs (a command cut off
    leaves what it printed), its errors to `errors` or there too. Every process the kit starts
    starts here: the CPU test (tests/test_gpu_check.py) swaps it for its forking launcher."""
    with contextlib.ExitStack() as files:
        out = files.enter_context(log.open("w"))
        err = files.enter_context(errors.open("w")) if errors else subprocess.STDOUT
        process = subprocess.Popen(
            command, stdout=out, stderr=err, env=env, cwd=REPO, start_new_session=True
        )
        try:
            return process.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return 124


class Kit:
    """The rows' commands, run one after another on the GPU(s), the planner beside them."""

    def __init__(self, args: argparse.Namespace, work: Path, device: str, gpus: int) -> None:
        self.args = args
        self.work = work
        self.device = device
        self.gpus = gpus
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "4",
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "HF_HOME": str(work / "hf"),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(
                p for p in (os.environ.get("PYTHONPATH", ""), str(REPO)) if p
            ),
        }
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.planner = concurrent.futures.ThreadPoolExecutor(max_workers=3)
        self.plans: dict[str, concurrent.futures.Future[dict[str, Any] | None]] = {}
        self.final_model: Path | None = None
        self.data = work / "data"  # build_data writes it
        self.prompts = work / "prompts.jsonl"  # build_prompts writes it (the GRPO row)

    # --- commands -----------------------------------------------------------------------------

    def common_flags(self, model: Path, data: Path, out: Path, row: Row) -> list[str]:
        if row.kind == "grpo":  # its prompts, a completion's share of the sequence
            completion = min(GRPO_COMPLETION, row.seq // 4)
            data = self.prompts
            row = dataclasses.replace(
                row, flags=(*row.flags, "--max_completion_length", str(completion))
            )
        return [
            "--model", str(model), "--dataset", str(data), "--dataset_include", "",
            "--data_cache_dir", str(self.work / "prepared"), "--output_dir", str(out),
            "--max_seq_length", str(row.seq),
            "--batch_size_per_device", str(row.batch),
            "--total_batch_size", str(row.batch * self.gpus),
            "--max_training_steps", str(row.steps), "--learning_rate", "1e-4",
            "--warmup_steps", "0", "--eval_every", "0", "--eval_examples", "0",
            "--save_every_minutes", "0", "--log_every", "1", "--device", self.device,
            *row.flags,
        ]  # fmt: skip

    def run(self, command: list[str], log: Path, timeout: float) -> tuple[int, str, float]:
        """A command (`run_process`), its output into `log`; (exit code, output, seconds)."""
        started = time.perf_counter()
        code = run_process(command, env=self.env, timeout=timeout, log=log)
        return code, log.read_text(errors="replace"), time.perf_counter() - started

    def write_weights(
        self, folder: Path, shape: str, tokenizer_dir: Path, seq: int, timeout: float
    ) -> tuple[int, str]:
        """A model's random weights, written by a process of its own (see parse_args)."""
        command = [sys.executable, str(Path(__file__).resolve()), "--probe-write", str(folder)]
        command += ["--probe-shape", shape, "--probe-data", str(tokenizer_dir)]
        command += ["--probe-seq", str(seq), "--probe-device", self.device]
        code, log, _ = self.run(command, self.logs / f"{folder.name}-weights.log", timeout)
        return code, log

    def plan(self, model: Path, data: Path, row: Row) -> dict[str, Any] | None:
        """The planner's prediction for exactly this configuration, on the CPU (the GPU stays the
        run's alone: CUDA_VISIBLE_DEVICES is empty). None if it cannot plan."""
        flags = self.common_flags(model, data, self.work / "plan-unused", row)
        command = [sys.executable, "-m", "fsdp_utils.plan", *flags, "--json"]
        command += ["--gpus_per_node", str(self.gpus), "--no_fixes"]
        command += ["--gpu_memory", self.args.gpu_memory]
        env = {**self.env, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "2"}
        out, err = self.logs / f"{row.name}.plan.json", self.logs / f"{row.name}.plan.log"
        run_process(command, env=env, timeout=600, log=out, errors=err)
        try:
            return json.loads(out.read_text())
        except json.JSONDecodeError:
            return None

    def plan_later(self, model: Path, data: Path, row: Row) -> None:
        self.plans[row.name] = self.planner.submit(self.plan, model, data, row)

    def planned(self, row: Row, timeout: float) -> dict[str, Any] | None:
        future = self.plans.get(row.name)
        if future is None:
            return None
        try:
            return future.result(timeout=max(timeout, 1.0))
        except (concurrent.futures.TimeoutError, subprocess.TimeoutExpired):
            return None

    def train(
        self, model: Path, data: Path, out: Path, row: Row, *extra: str, timeout: float
    ) -> tuple[int, str, dict[int, float], float]:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        if not Path(torchrun).exists():
            torchrun = shutil.which("torchrun") or torchrun
        command = [torchrun, "--standalone", f"--nproc_per_node={self.gpus}"]
        command += [str(REPO / "chess_finetune.py"), *self.common_flags(model, data, out, row)]
        command += list(extra)
        log = self.logs / f"{out.name}.log"
        with MemoryWatch() as watch:
            code, text, seconds = self.run(command, log, timeout)
        return code, text, watch.peak_mib, seconds

    # --- rows ---------------------------------------------------------------------------------

    def train_row(self, model: Path, data: Path, row: Row, timeout: float) -> dict[str, Any]:
        out = self.work / "runs" / row.name
        code, log, smi, seconds = self.train(
            model, data, out, row, "--no_final_save", "--resume", "never", timeout=timeout
        )
        result: dict[str, Any] = {"wall_s": seconds}
        if code != 0:
            return {**result, **failure(code, log)}
        result.update(summarize(run_records(out)))
        (self.logs / f"{row.name}.metrics.jsonl").write_bytes(
            (out / "metrics.jsonl").read_bytes() if (out / "metrics.jsonl").is_file() else b""
        )
        plan = self.planned(row, timeout=60)
        planned = plan["peak_bytes"] / GIB if plan else None
        required = plan["required_bytes"] / GIB if plan else None
        result["planned_peak_gib"] = planned
        result["planned_required_gib"] = required
        result["planner_fits"] = plan.get("fits") if plan else None
        result["smi_peak_gib"] = max(smi.values()) / 1024 if smi else None
        result["allocated_over_plan"] = ratio(result["peak_allocated_gib"], planned)
        result["reserved_over_plan"] = ratio(result["peak_reserved_gib"], planned)
        result["used_over_required"] = ratio(result["smi_peak_gib"], required)
        return result

    def grpo_row(self, model: Path, row: Row, timeout: float) -> dict[str, Any]:
        """GRPO: rollout and update tokens/s (medians after the first step, metrics.jsonl's
        rollout/* and update/*) and the peak memory against the plan of both phases."""
        result = self.train_row(model, self.data, row, timeout)
        if result.get("status") == "failed" or "reason" in result:
            return result
        train = [r for r in run_records(self.work / "runs" / row.name) if r.get("kind") == "train"]
        steady = [r for r in train[1:] if "rollout/tokens_per_s" in r] or train

        def median(key: str) -> float | None:
            values = [r[key] for r in steady if r.get(key) is not None]
            return statistics.median(values) if values else None

        plan = self.planned(row, timeout=60) or {}
        rollout = plan.get("rollout") or {}
        result.update(
            rollout_tokens_per_s=median("rollout/tokens_per_s"),
            update_tokens_per_s=median("update/tokens_per_s"),
            rollout_s=median("rollout/seconds"),
            update_s=median("update/seconds"),
            planned_rollout_gib=rollout["total"] / GIB if rollout else None,
            planned_update_gib=plan["update_peak_bytes"] / GIB if plan else None,
            dominating_phase=plan.get("dominating_phase"),
        )
        result["summary"] = (
            f"rollout {_fmt(result['rollout_tokens_per_s'], ',.0f')} new tokens/s "
            f"({_fmt(result['rollout_s'], '.2f')} s), update "
            f"{_fmt(result['update_tokens_per_s'], ',.0f')} tokens/s ({_fmt(result['update_s'], '.2f')} s); "
            f"peak alloc {_fmt(result.get('peak_allocated_gib'), '.2f')} GiB against the plan's "
            f"{_fmt(result.get('planned_peak_gib'), '.2f')} (rollout "
            f"{_fmt(result['planned_rollout_gib'], '.2f')}, update "
            f"{_fmt(result['planned_update_gib'], '.2f')}: the {result['dominating_phase']} dominates)"
        )
        return result

    def checkpoint_row(self, model: Path, data: Path, row: Row, timeout: float) -> dict[str, Any]:
        """Save at half way (stop as if the time limit came), resume, finish, export."""
        out = self.work / "runs" / row.name
        half = max(1, row.steps // 2)
        stop = ("--save_every_steps", str(half), "--stop_after_steps", str(half))
        started = time.perf_counter()
        code1, log1, _, _ = self.train(
            model, data, out, row, *stop, "--resume", "never", timeout=timeout
        )
        if code1 != 0:
            return failure(code1, log1, "first leg")
        left = timeout - (time.perf_counter() - started)
        code2, log2, _, _ = self.train(model, data, out, row, "--resume", "auto", timeout=left)
        if code2 != 0:
            return failure(code2, log2, "resumed leg")
        summary = summarize(run_records(out))
        final = summary["final_model"]
        if final and Path(final, "config.json").is_file():
            self.final_model = Path(final)
        result = {
            "wall_s": time.perf_counter() - started,
            "save_s": summary["checkpoint_save_s"],
            "load_s": resume_seconds(log2),
            "export_s": summary["export_s"],
            "resumed": summary["resumed"],
            "final_model": final,
        }
        ok = result["resumed"] and self.final_model is not None
        result["summary"] = (
            f"save {_s(result['save_s'])}, load (resume) {_s(result['load_s'])}, "
            f"HF export {_s(result['export_s'])}; resumed: {result['resumed']}"
        )
        return result if ok else {**result, "status": "failed", "reason": "no resume or export"}

    def masking_row(self, model: Path, row: Row, timeout: float) -> dict[str, Any]:
        """The document-masking probe in a process of its own (its CUDA memory goes with it)."""
        out = self.work / "masking.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--probe-masking", str(out)]
        command += ["--probe-model", str(model), "--probe-data", str(self.data)]
        command += ["--probe-seq", str(row.seq), "--probe-device", self.device]
        command += ["--work", str(self.work)]
        code, log, seconds = self.run(command, self.logs / f"{row.name}.log", timeout)
        if code != 0 or not out.is_file():
            return failure(code, log)
        probe = json.loads(out.read_text())
        result: dict[str, Any] = {"wall_s": seconds, **probe}
        result["summary"] = f"{probe['documents']} documents in {probe['rows']} rows; " + "; ".join(
            f"{c['dtype']} ({c['attention']}): loss {c['loss_packed_vs_alone']:.1e} off, logits "
            f"{c['logits_packed_vs_alone']:.1e} off (unmasked {c['logits_unmasked_vs_alone']:.1e})"
            f" -> {c['verdict']}"
            for c in probe["cases"]
        )
        if any(c["verdict"] == "FAIL" for c in probe["cases"]):
            result.update(status="failed", reason="packed documents see each other")
        return result

    def evaluate_row(self, row: Row, timeout: float) -> dict[str, Any]:
        """`python -m fsdp_utils.evaluate` on the checkpoint row's export, one small task whose
        data is a copy in its Hub layout (tests/lm_eval_data.py) in an offline cache: requests
        per second of the model calls (the sharded model's own log line), and the whole
        command's time (start-up, loading, the batch plan)."""
        if self.final_model is None:
            return {"status": "skipped", "reason": "no export: the checkpoint row did not finish"}
        from tests.lm_eval_data import cache_arc_easy

        cache = self.work / "hf" / "hub"
        documents = EVAL_DOCUMENTS if self.device == "cuda" else 8
        cache_arc_easy(cache, documents)
        out = self.work / "lm_eval"
        command = [sys.executable, "-m", "fsdp_utils.evaluate", "--model", str(self.final_model)]
        command += ["--tasks", EVAL_TASK, "--limit", str(documents), "--cache_dir", str(cache)]
        command += ["--output_dir", str(out), "--bootstrap_iters", "0", "--device", self.device]
        code, log, seconds = self.run(command, self.logs / f"{row.name}.log", timeout)
        if code != 0:
            return failure(code, log)
        requests, model_s = request_times(log)
        results = sorted(out.glob("results_*.json"))
        if not results or not requests:
            return {
                "status": "failed",
                "reason": "no results or no timed requests",
                "log_tail": log[-3000:],
            }
        report = json.loads(results[-1].read_text())
        result = {
            "wall_s": seconds,
            "requests": requests,
            "model_s": model_s,
            "requests_per_s": requests / model_s if model_s else None,
            "accuracy": report["results"].get(EVAL_TASK, {}).get("acc,none"),
        }
        result["summary"] = (
            f"{EVAL_TASK}: {requests} requests in {model_s:.3f} s of model calls "
            f"({_fmt(result['requests_per_s'], ',.0f')} requests/s); the command {seconds:.0f} s"
        )
        return result


def request_times(log: str) -> tuple[int, float]:
    """Requests and seconds of the sharded model's calls, from its log lines
    (`loglikelihood: 400 requests as 400 distinct inputs on 1 rank(s), 1.2s`)."""
    import re

    pattern = (
        r"^(?:loglikelihood|loglikelihood_rolling|generate_until): (\d+) requests .*, ([0-9.]+)s$"
    )
    found = re.findall(pattern, log, flags=re.M)
    return sum(int(n) for n, _ in found), sum(float(s) for _, s in found)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def failure(code: int, log: str, where: str = "") -> dict[str, Any]:
    what = "timed out" if code == 124 else f"exit {code}"
    return {
        "status": "failed",
        "reason": f"{where + ': ' if where else ''}{what}",
        "log_tail": log[-3000:],
    }


# --- the document-masking probe ------------------------------------------------------------------


def masking_probe(model_dir: Path, data: Path, work: Path, seq: int, device: str) -> dict[str, Any]:
    """A packed batch through the trainer's forward (`model_forward`: per-document position ids,
    no mask) against each document run alone, in fp32 and bf16, with the attention the model
    trains with. The logits must agree far better (10x) than those of the same block without
    the position ids (plain causal attention: documents see the ones before them) do, and the
    loss sums within `tolerance`; packed logits as far from the lone ones as the unmasked ones
    are means documents see each other (FAIL)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_utils.config.train_config import TrainConfig
    from fsdp_utils.data.prepare import PreparedData, prepare_dataset
    from fsdp_utils.train.loss import token_loss_sum
    from fsdp_utils.train.step import model_forward

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
    config = TrainConfig(
        model=str(model_dir), dataset=str(data), dataset_include="",
        data_cache_dir=str(work / "prepared"), max_seq_length=seq, eval_examples=0,
    )  # fmt: skip
    prepared = PreparedData.load(prepare_dataset(config, log=lambda _: None))
    rows = 2
    batch = prepared.split("train", document_masking=True).batch(np.arange(rows))
    eos = int(prepared.meta["stats"]["eos_token_id"])
    target = torch.device(device)
    ids, labels = batch["input_ids"].to(target), batch["labels"].to(target)
    cases = []
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        model = model.to(target).eval()
        with torch.no_grad():
            packed = model_forward(model, batch, target, contextlib.nullcontext).logits.float()
            pieces, documents = [], 0
            for row in ids:
                starts = [0, *[int(i) + 1 for i in torch.nonzero(row[:-1] == eos).flatten()]]
                bounds = [*starts, len(row)]
                logits = [
                    model(input_ids=row[None, a:b], use_cache=False).logits[0]
                    for a, b in itertools.pairwise(bounds)
                ]
                pieces.append(torch.cat(logits).float())
                documents += len(logits)
            alone = torch.stack(pieces)
            unmasked = model(input_ids=ids, use_cache=False).logits.float()
            loss_alone = float(token_loss_sum(alone, labels))
            loss_packed = float(token_loss_sum(packed, labels))
        packed_off = float((packed - alone).abs().max())
        unmasked_off = float((unmasked - alone).abs().max())
        like_unmasked = float((packed - unmasked).abs().max())
        loss_off = abs(loss_packed - loss_alone) / abs(loss_alone)
        if documents <= rows:
            verdict = "inconclusive (one document a row: a longer sequence)"
        elif loss_off <= tolerance and 10 * packed_off <= unmasked_off:
            verdict = "pass"
        elif loss_off > tolerance or 10 * like_unmasked <= unmasked_off:
            verdict = "FAIL"
        else:
            verdict = "inconclusive (masking's effect within the rounding)"
        cases.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "attention": model.config._attn_implementation,
                "documents": documents,
                "loss_alone": loss_alone,
                "loss_packed_vs_alone": loss_off,
                "logits_packed_vs_alone": packed_off,
                "logits_unmasked_vs_alone": unmasked_off,
                "tolerance": tolerance,
                "verdict": verdict,
            }
        )
        del model, packed, alone, unmasked, pieces
        if target.type == "cuda":
            torch.cuda.empty_cache()
    return {"seq": seq, "rows": rows, "documents": cases[0]["documents"], "cases": cases}


# --- the whole run -------------------------------------------------------------------------------


class Report:
    """gpu_check.json, gpu_check.md and logs.tar.gz, rewritten after every row, so that a call
    cut off at its time limit still brings back what it measured."""

    def __init__(self, output: Path, logs: Path, result: dict[str, Any]) -> None:
        self.output, self.logs, self.result = output, logs, result

    def write(self, started: float) -> None:
        self.result["seconds"] = time.time() - started
        (self.output / "gpu_check.json").write_text(json.dumps(self.result, indent=2))
        (self.output / "gpu_check.md").write_text(render_table(self.result))
        with tarfile.open(self.output / "logs.tar.gz", "w:gz") as archive:
            for path in sorted(self.logs.glob("*")):
                archive.add(path, arcname=f"logs/{path.name}")


def install_wheels(args: argparse.Namespace) -> None:
    """Install the carried wheels this Python lacks, then run this script again with them first
    on PYTHONPATH (so that this process and every command it starts import the same versions)."""
    import device_stack

    lines = device_stack.install(args.wheels, args.site)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "versions.txt").write_text("\n".join(["# carried wheels", *lines, ""]))
    print("\n".join(lines), flush=True)
    env = {**os.environ, STARTED_ENV: os.environ.get(STARTED_ENV, str(time.time()))}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(args.site), str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    argv = [a for a in sys.argv[1:]]
    index = argv.index("--wheels")
    del argv[index : index + 2]
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)


def check_versions(output: Path, env: dict[str, str]) -> tuple[int, str]:
    """The toolkit's own start-up check, as every command runs it; its table into versions.txt."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        log = Path(folder, "versions.log")
        code = run_process(
            [sys.executable, "-m", "fsdp_utils.versions"], env=env, timeout=600, log=log
        )
        text = log.read_text(errors="replace")
    with (output / "versions.txt").open("a") as file:
        file.write(f"# python -m fsdp_utils.versions (exit {code})\n{text}")
    return code, text


def cuda_devices() -> tuple[int, str, str]:
    """(count, name, memory of the first) of the visible GPUs, from nvidia-smi where it answers:
    asking torch would start a CUDA context in this process, which nvidia-smi would then count
    in every run's memory."""
    lines = _smi("--query-gpu=name,memory.total").strip().splitlines()
    if lines:
        name, mib = (c.strip() for c in lines[0].split(","))
        return len(lines), name, f"{mib}MiB"
    import torch

    properties = torch.cuda.get_device_properties(0)
    return torch.cuda.device_count(), properties.name, f"{properties.total_memory}B"


def environment(device: str) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "transformers_path": str(Path(transformers.__file__).parent),
    }
    smi = _smi("--query-gpu=name,driver_version,memory.total").strip().splitlines()
    if smi:
        name, driver, memory = (c.strip() for c in smi[0].split(","))
        info.update(driver=driver, smi_gpu=name, smi_memory_mib=memory)
    return info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "gpu_check")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: temp)")
    parser.add_argument("--wheels", type=Path, help="carried wheels to install first (.whl)")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"), help="where they go")
    parser.add_argument("--quick", action="store_true", help="the short subset (the 1B rows)")
    parser.add_argument("--only", default="", help="comma-separated row names (see ROWS)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds in all, from the first start (0: no limit)")  # fmt: skip
    parser.add_argument("--games", type=int, default=800, help="random games for the data")
    parser.add_argument(
        "--shapes",
        default="1b,8b",
        help="the small and large shapes (tiny, 1b, 3b, 8b, 13b); 'tiny' alone for the dry run",
    )
    parser.add_argument("--gpu-memory", default=None, help="for the planner (default: detected)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU (tests only)")
    # The probes' own processes (the masking check; writing a model's random weights): whatever
    # they hold on the GPU goes with them, so nvidia-smi sees each run's memory alone.
    for name in ("masking", "write", "shape", "model", "data", "seq", "device"):
        parser.add_argument(f"--probe-{name}", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe_masking:
        probe = masking_probe(
            Path(args.probe_model), Path(args.probe_data), args.work, int(args.probe_seq),
            args.probe_device,
        )  # fmt: skip
        Path(args.probe_masking).write_text(json.dumps(probe, indent=2))
        return 0
    if args.probe_write:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.probe_data)
        shape = SHAPES[args.probe_shape]
        write_model(
            Path(args.probe_write), shape, tokenizer, int(args.probe_seq), args.probe_device
        )
        return 0
    if args.wheels:
        install_wheels(args)  # does not return: runs this script again
    started = float(os.environ.get(STARTED_ENV, time.time()))
    try:
        rows = select_rows(ROWS, quick=args.quick, only=args.only)
    except ValueError as error:
        print(f"gpu-check: {error}", file=sys.stderr)
        return 2
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if not names or any(n not in SHAPES for n in names) or len(names) > 2:
        print(f"gpu-check: --shapes takes one or two of {sorted(SHAPES)}", file=sys.stderr)
        return 2
    shapes = {"small": names[0], "large": names[-1]}

    import torch

    if torch.cuda.is_available():
        device, gpus, gpu_name, memory = "cuda", *cuda_devices()
        args.gpu_memory = args.gpu_memory or memory
    elif args.allow_cpu:
        device, gpus, gpu_name = "cpu", 1, "cpu"
        args.gpu_memory = args.gpu_memory or "80GiB"
    else:
        print(
            "gpu-check: no CUDA device is visible (torch.cuda.is_available() is False): run it "
            "on a GPU node, e.g. `srun -p <gpu-partition> --gpus-per-node 4 -t 30 make gpu-check`.",
            file=sys.stderr,
        )
        return EXIT_NO_GPU
    args.output.mkdir(parents=True, exist_ok=True)
    sys.stdout = Tee(sys.stdout, args.output / "gpu_check.log")  # type: ignore[assignment]
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    kit = Kit(args, work, device, gpus)
    code, versions = check_versions(args.output, kit.env)
    print(versions, end="", flush=True)
    result: dict[str, Any] = {
        "gpu": gpu_name,
        "gpus": gpus,
        "torch": torch.__version__,
        "environment": environment(device),
        "budget_s": args.budget,
        "rows": [],
    }
    report = Report(args.output, kit.logs, result)
    if code != 0:
        result["error"] = "the versions check failed: " + versions.strip().splitlines()[-1]
        report.write(started)
        print(f"gpu-check: {result['error']}", file=sys.stderr)
        return 2
    try:
        return run_rows(kit, rows, shapes, report, started)
    finally:
        kit.planner.shutdown(wait=False, cancel_futures=True)


def run_rows(
    kit: Kit, rows: list[Row], shapes: dict[str, str], report: Report, started: float
) -> int:
    args, device = kit.args, kit.device
    budget = args.budget or float("inf")

    def elapsed() -> float:
        return time.time() - started

    runnable = [
        r for r in rows if not skip_reason(r, device=device, left=float("inf"), shapes=shapes)
    ]
    print(
        f"gpu-check: {len(rows)} rows ({len(runnable)} runnable here), about "
        f"{estimate_s(runnable):.0f} s on one H100; budget {args.budget or 'none'}",
        flush=True,
    )
    t = time.perf_counter()
    kit.data, tokenizer = build_data(kit.work, args.games)
    build_prompts(kit.data, kit.prompts)
    print(f"gpu-check: {kit.gpus} x {report.result['gpu']}; data ({time.perf_counter() - t:.0f}s)")
    rows = [scaled(r, shapes) for r in rows]
    longest = {role: max((r.seq for r in rows if r.role == role), default=2048) for role in shapes}
    configs = {
        role: write_config_only(kit.work / f"config-{role}", SHAPES[name], tokenizer, longest[role])
        for role, name in shapes.items()
    }
    for row in rows:
        if row.kind in ("train", "grpo") and row.name in {r.name for r in runnable}:
            kit.plan_later(configs[row.role], kit.data, row)
    models: dict[str, Path] = {}
    unwritten: set[str] = set()
    for row in rows:
        entry: dict[str, Any] = {
            "name": row.name,
            "kind": row.kind,
            "shape": shapes[row.role],
            "parameters": SHAPES[shapes[row.role]].parameters(),
            "seq": row.seq,
            "batch": row.batch,
            "steps": row.steps,
            "flags": list(row.flags),
        }
        report.result["rows"].append(entry)
        weights_s = LARGE_WEIGHTS_S if row.role not in models and row.role == "large" else 0.0
        skip = skip_reason(
            row, device=device, left=budget - elapsed(), extra_s=weights_s, shapes=shapes
        )
        if row.role in unwritten:
            skip = f"the {shapes[row.role]} shape's weights could not be written (above)"
        if skip:
            entry.update(status="skipped", reason=skip)
            print(f"gpu-check: {row.name}: skipped ({skip})", flush=True)
            report.write(started)
            continue
        print(
            f"gpu-check: {row.name} ({row.kind}, {entry['shape']}, seq {row.seq}) ...", flush=True
        )
        if row.role not in models:
            t = time.perf_counter()
            folder = kit.work / f"model-{row.role}"
            code, log = kit.write_weights(
                folder, shapes[row.role], configs[row.role], longest[row.role],
                timeout=min(600.0, budget - elapsed()),
            )  # fmt: skip
            entry["weights_written_s"] = time.perf_counter() - t
            if code != 0:
                entry.update(failure(code, log, "writing the weights"))
                unwritten.add(row.role)
                print(f"  {describe_row(entry)}", flush=True)
                report.write(started)
                continue
            models[row.role] = folder
        # Three times its estimate on a GPU, within the budget; without a budget (--budget 0, the
        # CPU dry run on a loaded machine) only a stop for a hung command.
        timeout = min(max(3 * row.estimate_s, 60.0), budget - elapsed()) if args.budget else 1800.0
        model = models[row.role]
        if row.kind == "train":
            outcome = kit.train_row(model, kit.data, row, timeout)
        elif row.kind == "checkpoint":
            outcome = kit.checkpoint_row(model, kit.data, row, timeout)
        elif row.kind == "grpo":
            outcome = kit.grpo_row(model, row, timeout)
        elif row.kind == "masking":
            outcome = kit.masking_row(model, row, timeout)
        else:
            outcome = kit.evaluate_row(row, timeout)
        entry.update(outcome)
        entry.setdefault("status", "ok")
        print(f"  {describe_row(entry)}", flush=True)
        report.write(started)
    train_rows = [r for r in report.result["rows"] if r["kind"] == "train" and r["status"] == "ok"]
    report.result["margin_suggestion"] = margin_suggestion(train_rows)
    report.write(started)
    print("\n" + render_table(report.result), flush=True)
    failed = [r["name"] for r in report.result["rows"] if r["status"] == "failed"]
    if failed:
        print(f"gpu-check: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def skip_reason(
    row: Row,
    *,
    device: str,
    left: float,
    extra_s: float = 0.0,
    shapes: dict[str, str] | None = None,
) -> str | None:
    """Why a row does not run here ('' or None: it runs). `shapes`: the shape of each role."""
    if row.needs_cuda and device != "cuda":
        return "needs a CUDA device (pinned host memory for the offloaded state)"
    shape = SHAPES.get((shapes or {}).get(row.role, ""))
    if "--quantize" in row.flags and shape is not None and not nf4_holds(shape):
        return (
            f"the {shape.name} shape has a decoder weight NF4 cannot hold (not a multiple of "
            f"{NF4_ELEMENTS:,} elements)"
        )
    if row.estimate_s + extra_s > left:
        return (
            f"the budget: {left:.0f} s left, the row takes about {row.estimate_s + extra_s:.0f} s"
        )
    return None


def describe_row(entry: dict[str, Any]) -> str:
    if entry["status"] != "ok":
        tail = entry.get("log_tail", "")
        return f"{entry['status'].upper()}: {entry.get('reason', '')}\n{tail}"
    if entry["kind"] == "train":
        return (
            f"{_fmt(entry.get('tokens_per_s_per_gpu'), ',.0f')} tokens/s/GPU, MFU "
            f"{_fmt(entry.get('mfu_pct'), '.1f')}%, peak alloc "
            f"{_fmt(entry.get('peak_allocated_gib'), '.2f')} GiB, reserved "
            f"{_fmt(entry.get('peak_reserved_gib'), '.2f')} GiB, planned "
            f"{_fmt(entry.get('planned_peak_gib'), '.2f')} GiB ({entry['wall_s']:.0f} s)"
        )
    return f"{entry.get('summary', 'ok')} ({entry.get('wall_s', 0):.0f} s)"


if __name__ == "__main__":
    raise SystemExit(main())
