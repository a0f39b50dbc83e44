"""Where a training step's time goes: chess_finetune.py's loop against the bare FSDP2 loop.

Runs under torchrun (2 CPU processes, gloo) on the benchmark's model and data, profiles rank 0
with cProfile on *process CPU time* (so that other processes on a shared machine do not count)
over the timed steps, and prints, per optimizer step: CPU seconds, split into forward,
backward, optimizer, gradient clipping and the rest (loop, loss, checks, logging, scalar
collectives), and how many scalar all-reduces, FSDP parameter all-gathers and host reads of
tensor values (`.item()`, `.tolist()`, `float()`: host-device syncs on a GPU) the step makes.

    python bench/profile_step.py                # both loops, after bench/throughput.py's assets
    python bench/profile_step.py --steps 6 --only ours

It imports `fsdp_utils` from PYTHONPATH, so the same script profiles another checkout's trainer
(e.g. the commit before a change) for a before/after comparison.

`--buckets`: where one configuration's step time goes on its device, from the torch profiler
(`fsdp_utils/metrics/step_profile.py`, docs/profiling.md): `chess_finetune.py` with
`--profile_steps` on step `--warmup + 1`, then rank 0's trace read back: the device time by
bucket (matrix products, attention, the compiler's fused kernels, elementwise and reductions,
optimizer, FSDP copies, collectives, loss, memory copies), the idle time between kernels, host
syncs, device-to-host copies and host reads, the matrix products' TFLOP/s against a bare matmul
on the same device, and the Chrome trace's path. Flags after `--` go to chess_finetune.py:

    python bench/profile_step.py --buckets                        # CPU: the benchmark's assets
    python bench/profile_step.py --buckets --nproc 1 --model M --dataset D -- --precision \
        bf16-mixed --max_seq_length 2048 --batch_size_per_device 4 --total_batch_size 4
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

# (category, predicate on a pstats key (file, function)): cumulative CPU time.
CATEGORIES = {
    "forward": lambda f, fn: f.endswith("modeling_llama.py") and fn == "forward",
    # ours: fsdp_utils.train.loss (unchunked, or the chunks' forward); the bare loop: transformers' loss, inside the model's forward
    "loss": lambda f, fn: (
        (
            f.endswith("fsdp_utils/train/loss.py")
            and fn in ("next_token_loss_sum", "chunked_target_nll")
        )
        or (f.endswith("loss_utils.py") and fn == "ForCausalLMLoss")
    ),
    "backward": lambda f, fn: fn == "<method 'run_backward' of 'torch._C._EngineBase' objects>",
    "optimizer": lambda f, fn: (
        (f.endswith("torch/optim/adamw.py") and fn == "adamw")
        or (f.endswith("torch/optim/adam.py") and fn == "adam")
    ),
    "gradient clipping": lambda f, fn: f.endswith("clip_grad.py") and fn == "clip_grad_norm_",
}
HOST_READS = ("item", "tolist", "__float__", "__bool__", "__int__")


def _summarise(stats: pstats.Stats, steps: int, cpu_seconds: float) -> dict[str, Any]:
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    out: dict[str, Any] = {"cpu_s_per_step": cpu_seconds / steps}
    for name, match in CATEGORIES.items():
        # The outermost call of each category: the largest cumulative time among the matches.
        times = [v[3] for (f, _, fn), v in raw.items() if match(f, fn)]
        out[f"{name}_s"] = max(times, default=0.0) / steps
    if any(f.endswith("loss_utils.py") and fn == "ForCausalLMLoss" for f, _, fn in raw):
        out["forward_s"] -= out["loss_s"]  # counted inside the model's forward
    known = sum(out[f"{n}_s"] for n in CATEGORIES)
    out["rest_s"] = out["cpu_s_per_step"] - known
    # Host reads made by the loop itself (the model's own, e.g. in transformers' mask code,
    # are the same in both loops and are left out).
    reads = 0
    for (f, _, fn), v in raw.items():
        if f == "~" and any(f"method '{m}' of 'torch._C.TensorBase'" in fn for m in HOST_READS):
            if not v[4]:  # called from the loop's own frame, entered before profiling began
                reads += v[0]
            for (caller, _, _), counts in v[4].items():
                if "fsdp_utils" in caller or caller.endswith("bare_fsdp2.py"):
                    reads += counts[0]
    out["loop_host_reads_per_step"] = reads / steps
    all_reduces = sum(
        v[0]
        for (f, _, fn), v in raw.items()
        if f.endswith("distributed_c10d.py") and fn == "all_reduce"
    )
    out["eager_all_reduces_per_step"] = all_reduces / steps
    # FSDP's parameter all-gathers (every shard group, forward and backward)
    gathers = sum(
        v[0] for (f, _, fn), v in raw.items() if f == "~" and "_distributed_c10d.all_gather" in fn
    )
    out["fsdp_all_gathers_per_step"] = gathers / steps
    return out


def _profile_ours(args: argparse.Namespace) -> dict[str, Any] | None:
    from fsdp_utils.hub.offline import enable_offline_mode

    enable_offline_mode()
    from fsdp_utils.config.parse import parse_config
    from fsdp_utils.parallel import distributed as dist_utils
    from fsdp_utils.run.session import open_trainer

    assets = RESULTS / "assets"
    config, _ = parse_config(
        ["--model", str(assets / "model"), "--dataset", str(assets / "data"),
         "--data_cache_dir", str(RESULTS / "prepared"), "--output_dir", str(RESULTS / "profile_run"),
         "--max_seq_length", "1024", "--batch_size_per_device", "2", "--total_batch_size", "8",
         "--max_training_steps", str(args.warmup + args.steps), "--precision", "fp32",
         "--eval_every", "0", "--eval_batches", "1", "--save_every_minutes", "0",
         "--no_final_save", "--resume", "never", "--log_every", str(args.log_every)]
    )  # fmt: skip
    env = dist_utils.init_distributed(config.device)
    trainer = open_trainer(config, env)
    trainer.setup()
    profiler = cProfile.Profile(time.process_time)
    started = {"steps": 0, "cpu": 0.0}
    original = trainer.train_step

    def train_step(*a: Any, **k: Any) -> Any:  # start profiling after the warm-up steps
        if started["steps"] == args.warmup and env.is_main:
            started["cpu"] = time.process_time()
            profiler.enable()
        started["steps"] += 1
        return original(*a, **k)

    original_evaluate = trainer.evaluate

    def evaluate() -> Any:  # the final evaluation is not a training step
        profiler.disable()
        started["cpu"] = time.process_time() - started["cpu"]
        trainer.train_step = original  # evaluate reads the step's settings (its loss chunks)
        return original_evaluate()

    trainer.train_step = train_step  # type: ignore[assignment]
    trainer.evaluate = evaluate  # type: ignore[method-assign]
    trainer.train()
    cpu = started["cpu"]
    trainer.close()
    dist_utils.destroy(synchronize=True)
    return _summarise(pstats.Stats(profiler), args.steps, cpu) if env.is_main else None


def _profile_bare(args: argparse.Namespace) -> dict[str, Any] | None:
    sys.path.insert(0, str(REPO / "bench"))
    import bare_fsdp2

    prepared = next((RESULTS / "prepared").glob("*/meta.json")).parent
    argv = ["--model", str(RESULTS / "assets" / "model"), "--prepared", str(prepared),
            "--batch_size_per_device", "2", "--accumulation", "2", "--seq_len", "1024",
            "--steps", str(args.steps), "--warmup", str(args.warmup)]  # fmt: skip
    profiler = cProfile.Profile(time.process_time)
    rank = int(os.environ.get("RANK", "0"))
    cpu = {"start": 0.0, "seconds": 0.0}

    def on_timed(started: bool) -> None:
        if rank != 0:
            return
        if started:
            cpu["start"] = time.process_time()
            profiler.enable()
        else:
            profiler.disable()
            cpu["seconds"] = time.process_time() - cpu["start"]

    bare_fsdp2.main(argv, on_timed)
    return _summarise(pstats.Stats(profiler), args.steps, cpu["seconds"]) if rank == 0 else None


def bare_matmul_tflops(
    device: str, dtype_name: str, size: int, repeats: int = 10, *, warmups: int = 1
) -> float:
    """TFLOP/s of `size`^3 products of random matrices on `device` (after `warmups` untimed
    ones, which also bring a GPU's clocks up): what the device's matrix products reach with
    nothing around them."""
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(warmups):
        torch.mm(a, b)
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - started) / 1e12


def _buckets(args: argparse.Namespace, trainer_flags: list[str]) -> None:
    """Run one configuration with the profiler on one step and print where its time went."""
    from fsdp_utils.metrics.step_profile import breakdown, describe, read_trace

    assets = RESULTS / "assets"
    model, dataset = args.model or assets / "model", args.dataset or assets / "data"
    if not Path(model).is_dir():
        sys.exit("error: run bench/throughput.py once first (it builds the benchmark's assets)")
    out = RESULTS / "profile_buckets"
    shutil.rmtree(out, ignore_errors=True)
    step = args.warmup + 1
    defaults = ["--max_seq_length", "1024", "--batch_size_per_device", "2",
                "--total_batch_size", "8", "--precision", "fp32"]  # fmt: skip
    flags = ["--model", str(model), "--dataset", str(dataset), "--dataset_include", "",
             "--data_cache_dir", str(RESULTS / "prepared"), "--output_dir", str(out),
             "--max_training_steps", str(step + 1), "--eval_every", "0", "--eval_batches", "1",
             "--save_every_minutes", "0", "--no_final_save", "--resume", "never",
             "--profile_steps", f"{step}:{step}", *defaults, *trainer_flags]  # fmt: skip
    command = [TORCHRUN, "--standalone", f"--nproc_per_node={args.nproc}",
               str(REPO / "chess_finetune.py"), *flags]  # fmt: skip
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(command)} exited {done.returncode}")
    trace_path = next((out / "profile").glob("rank0.*.pt.trace.json"))
    result = breakdown(read_trace(trace_path))
    device = result.device
    dtype = "float32" if device == "cpu" or "fp32" in trainer_flags else "bfloat16"
    size = 8192 if device == "cuda" else 1024
    bare = bare_matmul_tflops(device, dtype, size)
    print(describe(result, bare_tflops=bare))
    print(f"bare matmul: {size}^3 {dtype} on {device}: {bare:.2f} TFLOP/s")
    print(f"Chrome trace (ui.perfetto.dev): {trace_path}")
    record = {**result.to_dict(), "bare_matmul_tflops": bare, "trace": str(trace_path),
              "command": command}  # fmt: skip
    (out / "buckets.json").write_text(json.dumps(record, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--buckets", action="store_true", help="one configuration's step by bucket")
    parser.add_argument("--nproc", type=int, default=2, help="--buckets: processes (GPUs)")
    parser.add_argument("--model", help="--buckets: the model folder (default: the bench's)")
    parser.add_argument("--dataset", help="--buckets: the dataset (default: the bench's)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--log_every", type=int, default=1, help="chess_finetune.py's")
    parser.add_argument("--only", choices=["ours", "bare"])
    parser.add_argument("--worker", choices=["ours", "bare"], help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    trainer_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.buckets:
        _buckets(args, trainer_flags)
        return
    if args.worker:
        summary = (_profile_ours if args.worker == "ours" else _profile_bare)(args)
        if summary is not None:
            print("PROFILE " + json.dumps(summary), flush=True)
        return
    if not (RESULTS / "assets" / "model").is_dir():
        sys.exit("error: run bench/throughput.py once first (it builds the benchmark's assets)")
    results = {}
    for which in [args.only] if args.only else ["ours", "bare"]:
        command = [
            TORCHRUN, "--standalone", "--nproc_per_node=2", __file__, "--worker", which,
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--log_every", str(args.log_every),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"error: {' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
        line = next(x for x in done.stdout.splitlines() if x.startswith("PROFILE "))
        results[which] = json.loads(line.removeprefix("PROFILE "))
    names = list(next(iter(results.values())))
    print("| per optimizer step (rank 0) | " + " | ".join(results) + " |")
    print("|---|" + "---:|" * len(results))
    for name in names:
        cells = [f"{r[name]:.3f}" for r in results.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
