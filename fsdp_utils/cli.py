"""`chess_finetune.py`'s main: parse, check, train, save. User mistakes end with one clear
paragraph (printed once, by rank 0) and exit code 2, never a bare traceback; under torchrun the
other ranks end quietly with the same code (`fsdp_utils.parallel.distributed.on_main_rank`)."""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from fsdp_utils.config.parse import build_parser, parse_config
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.error_report import EXIT_USAGE, PEER_EXIT_DELAY_S, report_error
from fsdp_utils.startup import resume_collector

if TYPE_CHECKING:
    from fsdp_utils.trainer.trainer import Trainer

    AfterSetup = Callable[[Trainer], None]


DESCRIPTION = """Fine-tune a causal LM on chess games (or any text) with FSDP2.
Run with torchrun (one process per GPU; gloo on CPU) or as a plain process."""


def make_parser() -> argparse.ArgumentParser:
    return build_parser(DESCRIPTION, command_options=_add_check_options)


def _add_check_options(checks: argparse._ArgumentGroup) -> None:
    checks.add_argument(
        "--preflight",
        action="store_true",
        help="Check config, batch arithmetic for --world_size processes, offline assets and "
        "sequence length in seconds, without loading weights; exit 0 if all is well.",
    )
    checks.add_argument(
        "--world_size",
        type=int,
        default=None,
        help="With --preflight: the number of processes the run will have.",
    )
    checks.add_argument(
        "--nodes", type=int, default=1, help="With --preflight: the number of nodes (1)."
    )
    checks.add_argument(
        "--gpu_memory",
        default="auto",
        metavar="SIZE",
        help="With --preflight: memory of one GPU for the memory plan (80GiB, a100-80gb, ...); "
        "auto: this node's GPUs (none: no plan); off: no plan.",
    )
    checks.add_argument(
        "--login_node",
        action="store_true",
        help="With --preflight: this machine submits the run and does not run it (slurm/submit.py "
        "passes it): without a GPU here, checks that need the run's GPU wait for its start.",
    )
    checks.add_argument(
        "--plan",
        action="store_true",
        help="Plan the GPU memory of this run and exit: the same as `python -m fsdp_utils.plan` "
        "(add --nodes, --gpus_per_node, --gpu_memory, --find_max_batch).",
    )


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _fail(message: str, *, code: int = EXIT_USAGE) -> int:
    """A user mistake that every rank found (the arguments, the batch arithmetic), or an
    outside failure every rank stopped for (`code` 1): rank 0 prints it; every rank puts it in
    its torchrun error file, since torchrun's closing report names the first rank to exit,
    whichever that is."""
    report_error(message, show=_rank() == 0)
    if _rank() != 0:  # not needed for the message (see above): rank 0's print reaches the log
        time.sleep(PEER_EXIT_DELAY_S)  # before torchrun stops it, on a quiet machine at least
    return code


def run(config: TrainConfig, *, after_setup: AfterSetup | None = None) -> dict[str, Any]:
    """Check (once per process), start the run folder, train, save: the whole run on this
    process's rank. User mistakes raise ValueError (one paragraph, printed by `main`).
    `after_setup`: called with the set-up Trainer before its first step (tools and tests use
    it to instrument the model). A process group that exists already is the caller's (a tool
    that runs several runs in one process, as tests/finetune_runs.py): it is used and left up."""
    import torch.distributed as dist

    from fsdp_utils.parallel import distributed as dist_utils
    from fsdp_utils.run.session import open_trainer
    from fsdp_utils.train.step import TrainingDivergedError
    from fsdp_utils.train.timelimit import INTERRUPT

    # Tearing a group down and setting one up again in the same torchrun workers can deadlock
    # (a fast rank meets the previous group's keys in the store): only the owner tears down.
    owns_group = not dist.is_initialized()
    env = dist_utils.init_distributed(config.device, config.collective_timeout_minutes)
    trainer = None
    clean = False
    speed = None
    try:
        notes: list[str] = []
        if config.auto:  # the choice, made once before the model: fsdp_utils/run/speed.py
            from fsdp_utils.run.speed import resolve_auto

            config, notes = resolve_auto(config, env)
        trainer = open_trainer(config, env)
        for note in notes:
            trainer.log.info(note)
        trainer.setup()
        if env.is_main and trainer.stopped_early is None:
            speed = _predicted_speed(trainer)
        if after_setup is not None and trainer.stopped_early is None:
            after_setup(trainer)
        summary = trainer.train()
        trainer.stop.flag.training_over = True
        if speed is not None:
            from fsdp_utils.run.speed import record_run

            if (line := record_run(trainer.config, speed, env)) is not None:
                trainer.log.info(line)
        final = trainer.save_final_model() if summary["status"] == "completed" else None
        summary["final_model"] = str(final) if final else None
        if final is not None and config.eval_tasks and trainer.stop.interrupted():
            summary.update(status="interrupted", reason=INTERRUPT)
            trainer.log.info(
                f"{INTERRUPT} after the last step: the final model is saved, the benchmarks "
                f"are skipped (torchrun -m fsdp_utils.evaluate --model {final} --tasks "
                f"{config.eval_tasks} scores it later)"
            )
        elif final is not None and config.eval_tasks:
            from fsdp_utils.lm_harness.training import score_final_model

            summary["benchmarks"] = score_final_model(
                trainer.model,
                config,
                env,
                tokenizer_dir=trainer.data.tokenizer_dir(trainer.model_dir),
                chat_data=trainer.data.chat_template_source,
                log=trainer.log.info,
            )
        summary["lora"] = config.lora
        if final is not None and config.merge:
            summary["merged"] = str(trainer.layout.merged_model)
            summary["quantize"] = config.quantize
        summary["output_dir"] = str(trainer.layout.root)
        trainer.write_status(summary["status"], summary["reason"])
        if env.is_main:
            _print_summary(summary)
        clean = True
        return summary
    except KeyboardInterrupt:  # Ctrl-C before the run's stop controller took it over
        if trainer is not None:
            trainer.write_status("interrupted", f"{INTERRUPT} before the first step")
        raise
    except BaseException as err:
        user = isinstance(err, ValueError | TrainingDivergedError)
        if trainer is not None:  # tell the sbatch script not to requeue a failing run
            trainer.write_status(
                "failed",
                f"{type(err).__name__}: {err}"[:2000],
                user_error=str(err) if user else None,
            )
        elif user and env.is_main:  # a mistake found at the start (a teacher refused, ...)
            _started_and_failed(config, err)
        raise
    finally:
        if trainer is not None:
            trainer.close()
        # DDP's reducer talks to the process group when it is destroyed: free it first, or
        # gloo can hang or abort at exit.
        del trainer
        gc.collect()
        if owns_group:
            dist_utils.destroy(synchronize=clean)


def _started_and_failed(config: TrainConfig, err: BaseException) -> None:
    """status.json of a run that failed on a user mistake before its trainer existed (the
    checks of every process: the sbatch script, or a script of the user's under torchrun, reads
    it back: torchrun's own exit code is 1 whatever its workers'). Only into a run folder that
    exists: a mistake in --output_dir itself, or a first run, makes none."""
    from fsdp_utils.config.layout import RunLayout
    from fsdp_utils.metrics.records import write_status

    layout = RunLayout.of(config.output_dir)
    if layout.root.is_dir():
        write_status(
            layout, "failed", f"{type(err).__name__}: {err}"[:2000], step=0,
            max_training_steps=config.max_training_steps, user_error=str(err),
        )  # fmt: skip


def _predicted_speed(trainer: Trainer) -> Any:
    """Rank 0: the step-time model's prediction for this run, handed to the trainer as data
    (`Trainer.speed_check`); None where nothing predicts it (a CPU --calibrate has not
    measured). The planner is imported only then (a tenth of a second): most CPU runs have no
    calibration file at all."""
    from fsdp_utils.config.layout import site_calibration_file

    config = trainer.config
    if trainer.env.device.type == "cpu":
        if not site_calibration_file().is_file():
            return None
        from fsdp_utils.plan.site import calibrated_device, cpu_key

        if calibrated_device(cpu_key(), config) is None:
            return None
    from fsdp_utils.run.speed import predict_run

    speed, line = predict_run(config, trainer.env)
    if line is not None:
        trainer.log.info(line)
    if speed is not None:
        trainer.log.info(speed.line)
        trainer.speed_check = speed.check
    return speed


def _print_summary(summary: dict[str, Any]) -> None:
    from fsdp_utils.metrics.logger import format_eval

    last, ev = summary.get("last") or {}, summary.get("eval")
    if summary["status"] == "completed":
        lines = [f"done in {summary['seconds']:.1f}s"]
    else:
        lines = [
            f"stopped ({summary['reason']}) after {summary['seconds']:.1f}s; the checkpoint is "
            "saved: rerun the same command to continue"
        ]
    if last:
        lines.append(
            f"  final train loss {last['loss']:.4f} | {last['tokens_per_s']:,.0f} tokens/s "
            f"({last['tokens_per_s_per_device']:,.0f} per device)"
        )
    if ev:
        lines.append(f"  eval {format_eval(ev)}")
    for task, scores in (summary.get("benchmarks") or {}).items():
        shown = ", ".join(f"{k.split(',')[0]} {v:.4f}" for k, v in list(scores.items())[:3])
        lines.append(f"  {task}: {shown}")
    lines.append(f"  run folder: {summary['output_dir']}")
    if summary.get("final_model") and summary.get("lora"):
        lines.append(f"  LoRA adapters (PeftModel.from_pretrained): {summary['final_model']}")
        if summary.get("merged"):
            lines.append(f"  merged model (from_pretrained): {summary['merged']}")
        if summary.get("merged") and summary.get("quantize") != "none":
            from fsdp_utils.model.qlora import NF4_MERGE_NOTE

            lines.append(f"    {NF4_MERGE_NOTE}")
    elif summary.get("final_model"):
        lines.append(f"  model (from_pretrained): {summary['final_model']}")
    print("\n".join(lines), flush=True)


def exit_process(code: int) -> NoReturn:
    """End `chess_finetune.py` with `code`: the exit handlers run (atexit: W&B, logging) and
    the output is flushed, but the interpreter's teardown is skipped. That teardown frees every
    object of torch, transformers and the run one by one (~400,000 of them): measured on the
    2-core test machine at load 5-7, 4 s for one process and 8 s for a 2-process run, time in
    which torchrun waits and Slurm's time limit runs. A crash does not come here: it ends as
    Python ends it, traceback first."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None, *, after_setup: AfterSetup | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else argv, after_setup)
    finally:  # chess_finetune.py paused it; the Trainer resumes it after the model on meta
        resume_collector()


def _main(argv: list[str], after_setup: AfterSetup | None) -> int:
    if "--plan" in argv:  # the planner's parser has every training flag and its own
        from fsdp_utils.plan import main as plan_main

        resume_collector()  # the trace makes garbage
        return plan_main([a for a in argv if a != "--plan"])
    parser = make_parser()
    try:
        config, args = parse_config(argv, parser)
    except ValueError as err:
        return _fail(str(err))
    if args.print_config:
        print(config.to_json())
        return 0
    # torch (through these) only now: `--help`, `--print_config` and a mistake in the flags
    # answer in a second, not after the ~9 s of importing torch.distributed's tensor machinery.
    from fsdp_utils.parallel.distributed import PeerFailure, ReportedError
    from fsdp_utils.run.host_memory import fix_mmap_threshold
    from fsdp_utils.train.step import StepFailed, TrainingDivergedError
    from fsdp_utils.train.timelimit import EXIT_INTERRUPTED, INTERRUPT

    fix_mmap_threshold()  # freed activations go back to the system (run/host_memory.py)
    try:
        if args.preflight:
            from fsdp_utils.parallel.distributed import world_size_from_env
            from fsdp_utils.run.preflight import preflight

            resume_collector()  # the memory plan's trace makes garbage
            world_size = args.world_size or world_size_from_env()
            checked = preflight(
                config, world_size, args.nodes, args.gpu_memory, run_host=not args.login_node
            )
            print(checked, flush=True)
            return 0
        summary = run(config, after_setup=after_setup)
    except KeyboardInterrupt:  # before the run could save anything: nothing is lost either
        print(
            f"\n{INTERRUPT}: stopped before the first step, nothing to save (rerun the same "
            "command to start)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_INTERRUPTED
    except ReportedError:  # rank 0 found a mistake in work the others waited for: said
        return EXIT_USAGE
    except PeerFailure as err:  # ... and this rank is one of the others: end quietly, after
        # rank 0, so that torchrun sees rank 0's exit first and does not stop it on the way out
        time.sleep(PEER_EXIT_DELAY_S)
        return EXIT_USAGE if err.user_error else 1
    except (ValueError, TrainingDivergedError) as err:  # CheckpointError is a ValueError
        return _fail(str(err))
    except StepFailed as err:  # an outside failure, after the save: said, exit 1 (not 2)
        return _fail(str(err), code=1)
    # Ctrl-C's stop saved the run: 130 tells a script it was interrupted (no requeue under Slurm)
    return EXIT_INTERRUPTED if summary["reason"] == INTERRUPT else 0
