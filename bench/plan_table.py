"""The figures of docs/plan.md: the memory table (CodeLlama-7B on 4 x A100-80GB, batch per device
1 to 16, with and without activation checkpointing: the tutorial's questions), how long
planning takes for 7B, 13B and 70B, how long the whole `python -m fsdp_utils.plan` command
takes, and how the fast planner agrees with the full trace.

    python bench/plan_table.py                   # make bench: the table, the times, the command
    python bench/plan_table.py --full            # make bench-full: + the full trace of every row
                                                 #   and model, + the agreement on tiny models
    python bench/plan_table.py --model codellama/CodeLlama-7b-hf   # the table from the cache
    python bench/plan_table.py --timings         # only the planning times and the command
    python bench/plan_table.py --baseline ../old # another checkout's command joins every round
    python bench/plan_table.py --agreement       # only fast vs full trace, tiny 20-layer models
    python bench/plan_table.py --long_context    # only Llama-3-8B/Gemma-2-9B shapes at 8k and
                                                 #   32k on 8 GPUs, chunked loss or not (--full too)
    python bench/plan_table.py --qlora           # only QLoRA beside LoRA and full fine-tuning:
                                                 #   Llama-3-70B on 4 x 80 GB and 8 x 40 GB, 8B on
                                                 #   one 24 GB GPU, 4k and 8k tokens (--full too)
    python bench/plan_table.py --sequence_parallel  # only --sequence_parallel 1-8: Llama-3-8B
                                                 #   at 32k-128k on 8 GPUs, 70B at 32k on 32 (--full too)

Each row is one `plan_memory` (fake-tensor traces of the trainer's step, extrapolated from
shallow copies of the model); with --full it is checked against the full trace of every layer
(`--full_trace`). Total batch 64, so that 16 per device x 4 GPUs divides it; everything else is
chess_finetune.py's defaults (1024 tokens per sequence, bf16-mixed, AdamW, FSDP2 per decoder
layer). Times are wall and CPU seconds: on a shared machine the CPU time is the steadier one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.plan import GPU_PRESETS, MemoryPlan, plan_memory
from fsdp_utils.train.loss import LOGITS_PER_CHUNK

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "tests" / "fixtures" / "configs"
RESULTS = REPO / "bench" / "results"
GPU = GPU_PRESETS["a100-80gb"]
GIB = 1024**3

# meta-llama/Llama-2-7b-hf's shapes (its config.json's values; the weights are not needed).
LLAMA_2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float16",
}
# Long sequences on large vocabularies (issue 31): the shapes of meta-llama/Meta-Llama-3-8B and
# google/gemma-2-9b (their config.json's values; Gemma 2's positions raised to 32,768 so that the
# 32k rows can be asked at all: its released models were trained to 8,192).
LLAMA_3_8B = {
    **LLAMA_2_7B,
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
GEMMA_2_9B = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "vocab_size": 256000,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_theta": 10000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}
# meta-llama/Meta-Llama-3-70B's shapes, for sequence parallelism across nodes and QLoRA's rows.
LLAMA_3_70B = {
    **LLAMA_3_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}
LONG_CONTEXT_MODELS: dict[str, dict[str, Any]] = {
    "Llama-3-8B-shaped": LLAMA_3_8B,
    "Gemma-2-9B-shaped": GEMMA_2_9B,
}

# The command of issue 23 ("the planner's speed"): what every preflight of such a job runs.
COMMAND_FLAGS = [
    "--nodes", "1", "--gpus_per_node", "4", "--gpu_memory", "80GiB",
    "--batch_size_per_device", "1", "--max_seq_length", "1024", "--gradient_checkpointing",
]  # fmt: skip


def config_folder(name: str, config: dict[str, Any]) -> Path:
    """A model folder holding only `config.json`: all the planner reads of a shape."""
    model = RESULTS / "configs" / name.lower()
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def timed_plan(
    config: TrainConfig, gpus: int = 4, *, full_trace: bool = False
) -> tuple[MemoryPlan, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    plan = plan_memory(
        config, nodes=1, gpus_per_node=gpus, gpu_memory_bytes=GPU.memory_bytes,
        gpu_name=GPU.name, suggest_fixes=False, full_trace=full_trace,
    )  # fmt: skip
    return plan, time.perf_counter() - wall, time.process_time() - cpu


def _difference(fast: MemoryPlan, full: MemoryPlan) -> str:
    """How far the fast plan's peak is from the full trace's: 'same bytes' or a percentage."""
    if fast.peak_bytes == full.peak_bytes and fast.breakdown == full.breakdown:
        return "same bytes"
    return f"{100 * (fast.peak_bytes / full.peak_bytes - 1):+.3f}%"


def table(model: str, full_trace: bool) -> str:
    """The tutorial's questions; with `full_trace` each row is checked against the full trace."""
    rows = [
        "| batch/GPU | accum. | act. ckpt | params | grads | optimizer | activations "
        "| temporaries | peak | peak in | + margin | fits 80 GB? | plan (wall / CPU) "
        "| full trace (wall / CPU) | fast vs full |",
        "|---:|---:|:---:|---:|---:|---:|---:|---:|---:|:---:|---:|:---:|---:|---:|:---:|",
    ]
    largest: dict[bool, int] = {}
    for checkpointing in (False, True):
        for batch in (1, 2, 4, 8, 16):
            config = TrainConfig(
                model=model,
                total_batch_size=64,
                batch_size_per_device=batch,
                gradient_checkpointing=checkpointing,
            )
            plan, wall, cpu = timed_plan(config)
            checked = "not run (--full) | "
            if full_trace:
                full, full_wall, full_cpu = timed_plan(config, full_trace=True)
                checked = f"{full_wall:.0f} s / {full_cpu:.0f} s | {_difference(plan, full)}"
            if plan.fits:
                largest[checkpointing] = batch
            g = plan.parts_gib()
            phase = "optimizer" if plan.peak_in_optimizer_step else "fwd/bwd"
            rows.append(
                f"| {batch} | {plan.batch.gradient_accumulation_steps} | "
                f"{'yes' if checkpointing else 'no'} | {' | '.join(g)} | {phase} | "
                f"{plan.required_bytes / GIB:.1f} | "
                f"{'yes' if plan.fits else '**no**'} | {wall:.0f} s / {cpu:.0f} s | {checked} |"
            )
            print(rows[-1], flush=True)
    rows.append("")
    rows.append(
        f"GiB per GPU, at the peak (its parts sum to it). Largest batch per GPU that fits: "
        f"{largest.get(False, 'none')} without, {largest.get(True, 'none')} with activation "
        f"checkpointing. Margin: {plan.margin.describe()}."
    )
    return "\n".join(rows)


def timings(full_trace: tuple[str, ...]) -> str:
    """In-process planning times of CodeLlama-7B, -13B and -70B; the full trace of those named
    in `full_trace` too (the first plan of a process pays the lazy imports: 7B's here)."""
    lines = [
        "",
        "Planning time in one process, chess_finetune.py defaults (total batch 32, 1 per GPU, "
        "4 GPUs), fast planner vs --full_trace:",
    ]
    for name in ("codellama-7b", "codellama-13b", "codellama-70b"):
        config = TrainConfig(model=str(CONFIGS / name))
        plan, wall, cpu = timed_plan(config)
        line = f"  {name}: {wall:.1f} s wall, {cpu:.1f} s CPU ({plan.trace_method}); "
        if name in full_trace:
            full, full_wall, full_cpu = timed_plan(config, full_trace=True)
            line += (
                f"full trace {full_wall:.1f} s wall, {full_cpu:.1f} s CPU; peak "
                f"{plan.peak_bytes / GIB:.2f} GiB, {_difference(plan, full)} ({plan.verdict})"
            )
        else:
            line += f"peak {plan.peak_bytes / GIB:.2f} GiB ({plan.verdict}); full trace: --full"
        lines.append(line)
        print(line, flush=True)
    return "\n".join(lines)


def _run_command(checkout: Path, model: Path) -> tuple[float, float]:
    """One `python -m fsdp_utils.plan` as a user runs it, with `checkout`'s fsdp_utils (first on
    PYTHONPATH; this interpreter's packages): wall and CPU seconds (user + system)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "fsdp_utils.plan", "--model", str(model), *COMMAND_FLAGS],
        env={**os.environ, "PYTHONPATH": str(checkout)},
        cwd=checkout,
        capture_output=True,
        check=True,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} s ({min(values):.1f} - {max(values):.1f})"


def command_timings(repeats: int, baseline: Path | None) -> str:
    """The whole command of issue 23 on Llama-2-7B's config, imports included, `repeats` times;
    with `baseline`, that checkout's command alternates with this one's (the order reversed
    every other round, as bench/throughput.py interleaves its runs)."""
    model = config_folder("llama-2-7b", LLAMA_2_7B)
    checkouts = {"this checkout": REPO}
    if baseline is not None:
        checkouts["baseline"] = baseline.resolve()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in checkouts}
    for index in range(repeats):
        order = list(checkouts) if index % 2 == 0 else list(reversed(checkouts))
        for name in order:
            times[name].append(_run_command(checkouts[name], model))
    flags = " ".join(COMMAND_FLAGS)
    lines = [
        "",
        f"The whole command, {repeats} runs (median, min - max): python -m fsdp_utils.plan "
        f"--model <Llama-2-7B config.json> {flags}",
    ]
    for name, runs in times.items():
        walls, cpus = [w for w, _ in runs], [c for _, c in runs]
        lines.append(f"  {name}: {_spread(walls)} wall, {_spread(cpus)} CPU")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines.append(f"  (load average at the end: {load} on {os.cpu_count()} cores)")
    return "\n".join(lines)


def long_context(lengths: tuple[int, ...] = (8192, 32768)) -> str:
    """Llama-3-8B- and Gemma-2-9B-shaped models at 8k and 32k tokens on 8 x 80 GB (1 per GPU,
    activation checkpointing, bf16-mixed), the full logits (--loss_chunk_size 0) against the
    loss in chunks (the default: 64 Mi logits per chunk)."""
    rows = [
        "| model | tokens | loss | params | grads | optimizer | activations | temporaries "
        "| peak | peak in | + margin | fits 80 GB? | plan (wall / CPU) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|:---:|---:|:---:|---:|",
    ]
    for name, shape in LONG_CONTEXT_MODELS.items():
        model = config_folder(name, shape)
        for seq in lengths:
            for chunk in (0, None):
                config = TrainConfig(
                    model=str(model), max_seq_length=seq, total_batch_size=8,
                    batch_size_per_device=1, gradient_checkpointing=True, loss_chunk_size=chunk,
                )  # fmt: skip
                plan, wall, cpu = timed_plan(config, gpus=8)
                tokens = max(1, LOGITS_PER_CHUNK // shape["vocab_size"])
                loss = "full logits" if chunk == 0 else f"chunks of {tokens}"
                phase = "optimizer" if plan.peak_in_optimizer_step else "fwd/bwd"
                rows.append(
                    f"| {name} | {seq:,} | {loss} | {' | '.join(plan.parts_gib())} | {phase} "
                    f"| {plan.required_bytes / GIB:.1f} | {'yes' if plan.fits else '**no**'} "
                    f"| {wall:.0f} s / {cpu:.0f} s |"
                )
                print(rows[-1], flush=True)
    rows += ["", "GiB per GPU at the peak (its parts sum to it); total batch 8."]
    return "\n".join(rows)


# (model, shape, GPUs, GPU name, GiB): issue 40's hardware for QLoRA
QLORA_SETUPS = [
    ("Llama-3-70B", LLAMA_3_70B, 4, "A100/H100-80GB", 80),
    ("Llama-3-70B", LLAMA_3_70B, 8, "A100-40GB", 40),
    ("Llama-3-8B", LLAMA_3_8B, 1, "24GB (RTX 4090, A10, L4)", 24),
]
QLORA_METHODS: dict[str, dict[str, Any]] = {
    "QLoRA (NF4 base)": {"lora": True, "quantize": "nf4"},
    "LoRA (bf16 base)": {"lora": True},
    "full fine-tuning": {},
}


def qlora_table(lengths: tuple[int, ...] = (4096, 8192)) -> str:
    """docs/lora.md's QLoRA table: Llama-3-70B on one node of 4 x 80 GB and of 8 x 40 GB,
    Llama-3-8B on one 24 GB GPU, at 4k and 8k tokens: QLoRA beside LoRA on a bf16 base and
    full fine-tuning. bf16-mixed, 1 sequence per GPU, total batch 8, activation checkpointing,
    LoRA r 8 on every linear layer of the blocks (dropout 0.05)."""
    rows = [
        "| model | GPUs | tokens | method | params | grads | optimizer | activations "
        "| temporaries | peak | peak in | + margin | fits? | plan (wall / CPU) |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|:---:|---:|:---:|---:|",
    ]
    for name, shape, gpus, gpu_name, gib in QLORA_SETUPS:
        model = config_folder(name, shape)
        for seq in lengths:
            for method, options in QLORA_METHODS.items():
                config = TrainConfig(
                    model=str(model), max_seq_length=seq, total_batch_size=8,
                    batch_size_per_device=1, gradient_checkpointing=True, **options,
                )  # fmt: skip
                wall, cpu = time.perf_counter(), time.process_time()
                plan = plan_memory(
                    config, nodes=1, gpus_per_node=gpus, gpu_memory_bytes=gib * GIB,
                    gpu_name=gpu_name, suggest_fixes=False,
                )  # fmt: skip
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                phase = "optimizer" if plan.peak_in_optimizer_step else "fwd/bwd"
                rows.append(
                    f"| {name} | {gpus} x {gpu_name} | {seq:,} | {method} | "
                    f"{' | '.join(plan.parts_gib())} | {phase} | {plan.required_bytes / GIB:.1f} "
                    f"| {'yes' if plan.fits else '**no**'} | {wall:.0f} s / {cpu:.0f} s |"
                )
                print(rows[-1], flush=True)
    margin = plan.margin.describe()
    rows += ["", f"GiB per GPU at the peak (its parts sum to it). Margin: {margin}."]
    return "\n".join(rows)


# (name, shape, lengths, nodes, total batch) of the sequence-parallel rows: 8 GPUs per node.
SEQUENCE_PARALLEL_ROWS = [
    ("Llama-3-8B-shaped", LLAMA_3_8B, (32768, 65536, 131072), 1, 8),
    ("Llama-3-70B-shaped", LLAMA_3_70B, (32768,), 4, 32),
]


def sequence_parallel() -> str:
    """--sequence_parallel N = 1, 2, 4, 8 (within a node) for the Llama-3-8B shape at 32k, 64k
    and 128k tokens on 8 x 80 GB, and the Llama-3-70B shape at 32k on 4 nodes of 8: batch 1 per
    GPU, activation checkpointing, bf16-mixed, the loss in chunks (docs/long-context.md)."""
    rows = [
        "| model | GPUs | tokens | N | tokens per GPU | params | grads | optimizer "
        "| activations | temporaries | peak | peak in | + margin | fits 80 GB? | plan (wall / CPU) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|:---:|---:|",
    ]
    for name, shape, lengths, nodes, total in SEQUENCE_PARALLEL_ROWS:
        model = config_folder(name, shape)
        for seq in lengths:
            for size in (1, 2, 4, 8):
                config = TrainConfig(
                    model=str(model), max_seq_length=seq, total_batch_size=total,
                    batch_size_per_device=1, gradient_checkpointing=True, sequence_parallel=size,
                )  # fmt: skip
                wall, cpu = time.perf_counter(), time.process_time()
                plan = plan_memory(
                    config, nodes=nodes, gpus_per_node=8, gpu_memory_bytes=GPU.memory_bytes,
                    gpu_name=GPU.name, suggest_fixes=False,
                )  # fmt: skip
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                phase = "optimizer" if plan.peak_in_optimizer_step else "fwd/bwd"
                rows.append(
                    f"| {name} | {nodes * 8} | {seq:,} | {size} | {seq // size:,} "
                    f"| {' | '.join(plan.parts_gib())} | {phase} "
                    f"| {plan.required_bytes / GIB:.1f} | {'yes' if plan.fits else '**no**'} "
                    f"| {wall:.0f} s / {cpu:.0f} s |"
                )
                print(rows[-1], flush=True)
    rows += [
        "",
        "GiB per GPU at the peak (its parts sum to it); 1 sequence per GPU per micro-batch "
        "(8B: total batch 8; 70B: 32), sequence-parallel groups within a node.",
    ]
    return "\n".join(rows)


AGREEMENT_SETTINGS: list[dict[str, Any]] = [
    {},
    {"gradient_checkpointing": True},
    {"gradient_checkpointing": True, "checkpoint_every_n_layers": 2},
    {"batch_size_per_device": 1, "defer_grad_sync": True},
    {"cpu_offload": True},
    {"precision": "bf16-true", "optimizer": "sgd"},
    {"precision": "fp32"},
    {"no_layer_wrap_policy": True},
    {"sharding": "hybrid"},
    {"sharding": "shard_grad_op"},
]


def agreement(layers: int = 20) -> str:
    """Fast vs full trace on every tiny architecture with `layers` layers, 2 nodes x 2 GPUs."""
    from fsdp_utils.synthetic import TINY_ARCHITECTURES, tiny_model_config

    lines = [f"Fast planner vs full trace, tiny {layers}-layer models on 2 x 2 GPUs:"]
    same = total = 0
    for arch in TINY_ARCHITECTURES:
        with tempfile.TemporaryDirectory() as folder:
            tiny_model_config(arch, vocab_size=512, num_layers=layers).save_pretrained(folder)
            for settings in AGREEMENT_SETTINGS:
                base = {"total_batch_size": 8, "batch_size_per_device": 2, "max_seq_length": 64}
                config = TrainConfig(model=folder, **{**base, **settings})
                args: dict[str, Any] = {"nodes": 2, "gpus_per_node": 2, "gpu_memory_bytes": None}
                started = time.process_time()
                fast = plan_memory(config, **args)
                fast_cpu, started = time.process_time() - started, time.process_time()
                full = plan_memory(config, **args, full_trace=True)
                full_cpu = time.process_time() - started
                difference = _difference(fast, full)
                same += difference == "same bytes"
                total += 1
                lines.append(
                    f"  {arch:9} {settings or 'defaults'!s:72} {difference:>10}  "
                    f"CPU {fast_cpu:4.1f} s vs {full_cpu:4.1f} s  ({fast.trace_method})"
                )
                print(lines[-1], flush=True)
    lines.append(f"{same} of {total} plans byte for byte equal to the full trace.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(CONFIGS / "codellama-7b"))
    parser.add_argument(
        "--full",
        action="store_true",
        help="make bench-full: every row and model against its full trace, and the agreement",
    )
    parser.add_argument("--timings", action="store_true", help="only the planning times")
    parser.add_argument("--agreement", action="store_true", help="only fast vs full, tiny")
    parser.add_argument(
        "--long_context", action="store_true", help="only the 8k/32k rows, chunked loss or not"
    )
    parser.add_argument(
        "--qlora", action="store_true", help="only the QLoRA rows (70B and 8B, 4k and 8k)"
    )
    parser.add_argument(
        "--sequence_parallel",
        action="store_true",
        help="only the --sequence_parallel rows: Llama-3-8B at 32k-128k, 70B at 32k on 4 nodes",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of the whole command")
    parser.add_argument(
        "--baseline", type=Path, help="another checkout, whose command alternates with this one's"
    )
    args = parser.parse_args()
    # The default set traces CodeLlama-7B in full once: it is the figure docs/plan.md quotes.
    full_trace = (
        ("codellama-7b", "codellama-13b", "codellama-70b") if args.full else ("codellama-7b",)
    )
    if args.agreement:
        print(f"\n{agreement()}")
        return
    if args.long_context:
        print(f"\n{long_context()}")
        return
    if args.qlora:
        print(f"\n{qlora_table()}")
        return
    if args.sequence_parallel:
        print(f"\n{sequence_parallel()}")
        return
    if not args.timings:
        print(f"\n{table(args.model, full_trace=args.full)}")
    print(timings(full_trace))
    print(command_timings(args.repeats, args.baseline))
    if args.full:
        print(f"\n{long_context()}")
        print(f"\n{qlora_table()}")
        print(f"\n{sequence_parallel()}")
        print(f"\n{agreement()}")


if __name__ == "__main__":
    main()
