"""The `download_models.py` command line: download (login node), --verify, --check-offline,
--prepare (tokenise and pack a dataset on the login node)."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from fsdp_utils.arguments import ArgumentParser
from fsdp_utils.config.train_config import (
    DEFAULT_DATASET,
    DEFAULT_DATASET_INCLUDE,
    DEFAULT_MODEL,
    TrainConfig,
    default_dataset_include,
)
from fsdp_utils.hub.cache import format_bytes, hub_cache_dir
from fsdp_utils.hub.manifest import manifest_path
from fsdp_utils.hub.specs import (
    AssetSpec,
    default_specs,
    load_assets_file,
    looks_like_path,
    looks_local,
    no_such_path,
    split_tasks,
)

EPILOG = """\
examples:
  python download_models.py                      # what chess_finetune.py uses by default
  python download_models.py --model codellama/CodeLlama-7b-hf \\
      --dataset laion/strategic_game_chess --dataset-include 'chess_game_000[1-2].parquet'
  python download_models.py --config assets.yaml --cache-dir /projects/me/hf-cache/hub
  python download_models.py --eval_tasks arc_easy,gsm8k,mmlu   # lm-eval benchmarks' data
  python download_models.py --model meta-llama/Llama-3.2-1B --config_only   # enough to --plan
  python download_models.py --verify             # offline: re-hash the cache
  python download_models.py --check-offline      # offline: load everything, no network

HF_TOKEN (gated models) and HF_ENDPOINT (site mirrors) are read from the environment.
exit status: 0 ok, 1 --verify/--check-offline found problems, 2 bad input, 130 interrupted.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="download_models.py",
        description="Cache models and datasets for compute nodes without internet: pinned to "
        "a commit, verified against the Hub's checksums, recorded in a manifest.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = parser.add_argument_group("what to fetch (default: the trainer's defaults)")
    what.add_argument("--model", metavar="ID", help="Hub model id, e.g. codellama/CodeLlama-7b-hf.")
    what.add_argument("--revision", metavar="REV", help="Model branch, tag or commit (main).")
    what.add_argument("--dataset", metavar="ID", help="Hub dataset id.")
    what.add_argument(
        "--dataset-include",
        metavar="GLOBS",
        help="Comma-separated globs of dataset files; '' for all data files (default: "
        f"{DEFAULT_DATASET_INCLUDE!r} for {DEFAULT_DATASET}, all data files otherwise).",
    )
    what.add_argument("--dataset-revision", metavar="REV", help="Dataset branch, tag or commit.")
    what.add_argument(
        "--eval_tasks",
        metavar="TASKS",
        help="Comma-separated lm-eval tasks or groups (arc_easy,hellaswag,gsm8k,mmlu,ifeval): "
        "cache the datasets (and NLTK data) they read, for python -m fsdp_utils.evaluate.",
    )
    what.add_argument(
        "--config",
        metavar="FILE",
        help="YAML/JSON assets file (`assets:` list) or a training config for chess_finetune.py.",
    )
    where = parser.add_argument_group("where and how")
    where.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="Hub cache folder (default: $HF_HUB_CACHE or $HF_HOME/hub). Use project storage.",
    )
    where.add_argument("--workers", type=int, default=8, help="Parallel file downloads (8).")
    where.add_argument(
        "--dry-run", action="store_true", help="Show files and sizes, check disk, fetch nothing."
    )
    where.add_argument(
        "--config_only",
        action="store_true",
        help="Fetch each model's config.json only (seconds): enough for the memory plan "
        "(chess_finetune.py --plan, python -m fsdp_utils.plan) before downloading the weights; "
        "not enough to train.",
    )
    modes = parser.add_argument_group("offline modes (no download)")
    modes.add_argument(
        "--verify",
        action="store_true",
        help="Re-hash cached files against the manifest; list what is missing or corrupt.",
    )
    modes.add_argument(
        "--check-offline",
        action="store_true",
        help="Load every model config/tokenizer and open every shard with no network.",
    )
    parser.add_argument(
        "--prepare",
        action="store_true",
        help="After downloading, tokenise and pack the dataset into the cache (saves GPU time).",
    )
    return parser


@dataclass(frozen=True)
class Request:
    """What the command line asks for. `specs` is None when no asset was named."""

    specs: list[AssetSpec] | None
    cache_dir: str | None  # as given (--cache-dir, else the assets file), None: environment
    train_config: TrainConfig | None  # when --config is a training config
    eval_tasks: tuple[str, ...] = ()  # lm-eval tasks (--eval_tasks, the file's eval_tasks:)


def parse_request(args: argparse.Namespace) -> Request:
    specs: list[AssetSpec] = []
    train_config, cache_dir = None, args.cache_dir
    tasks = split_tasks(args.eval_tasks)
    if args.config:
        loaded = load_assets_file(args.config)
        specs += loaded.specs
        train_config = loaded.train_config
        cache_dir = cache_dir or loaded.cache_dir
        tasks = tuple(dict.fromkeys(loaded.eval_tasks + tasks))
    if args.model:
        specs.append(AssetSpec(args.model, "model", args.revision))
    elif args.revision:
        raise ValueError("--revision is the model's revision: give --model too.")
    if args.dataset:
        include = args.dataset_include
        include = default_dataset_include(args.dataset) if include is None else (include or None)
        specs.append(AssetSpec(args.dataset, "dataset", args.dataset_revision, include))
    elif args.dataset_include is not None or args.dataset_revision:
        raise ValueError("--dataset-include and --dataset-revision need --dataset.")
    for spec in specs:
        if looks_like_path(spec.repo_id) and not looks_local(spec.repo_id):
            raise ValueError(no_such_path(f"--{spec.repo_type}", spec.repo_id))
        if looks_local(spec.repo_id):
            raise ValueError(
                f"{spec.repo_id} is a local path: there is nothing to download, the trainer "
                "reads it directly."
            )
    named = bool(args.config or args.model or args.dataset or tasks)
    return Request(specs if named else None, cache_dir, train_config, tasks)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["python", "download_models.py", *argv])
    try:
        return _run(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 130


INTERRUPTED = (
    "\ninterrupted: files downloaded completely are kept, nothing half-done was recorded in the "
    "manifest. Re-run the same command to resume."
)


@contextmanager
def _stop_at_once_on_ctrl_c() -> Iterator[None]:
    """Ctrl-C exits now, not after the files in flight (minutes for a 10 GB shard).

    A KeyboardInterrupt would reach us only once huggingface_hub's thread pool has let its
    running downloads finish. Exiting from the signal handler skips that; the temporary files
    it leaves are removed by the next run, and the manifest is only ever replaced atomically.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        sys.stdout.flush()
        print(INTERRUPTED, file=sys.stderr, flush=True)
        os._exit(130)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}.")
    request = parse_request(args)
    cache_dir = hub_cache_dir(request.cache_dir)
    if request.train_config is not None:
        trainer_cache = hub_cache_dir(request.train_config.cache_dir)
        if trainer_cache != cache_dir:
            print(
                f"warning: {args.config} makes the trainer look in {trainer_cache}, not in "
                f"{cache_dir}: set cache_dir there (or HF_HOME) so that it finds these assets."
            )
    if args.verify or args.check_offline:
        if args.prepare or args.dry_run:
            raise ValueError("--verify/--check-offline do not download: drop --prepare/--dry-run.")
        return _offline_modes(args, request.specs, cache_dir)

    specs = request.specs if request.specs is not None else default_specs()
    if args.config_only:
        return _config_only(args, specs, cache_dir)
    if not specs and not request.eval_tasks and not (args.prepare and request.train_config):
        raise ValueError(f"{args.config} names no hub assets (only local paths): nothing to do.")
    # Checked before downloading, so that a bad --prepare does not cost a download first.
    prepare_config = _prepare_config(specs, request) if args.prepare else None
    if specs:
        _download(args, specs, cache_dir)
    if args.dry_run:
        return 0
    if request.eval_tasks:
        _download_eval_tasks(args, list(request.eval_tasks), cache_dir)
    if prepare_config is not None:
        from fsdp_utils.data.prepare import prepare_dataset

        started = time.monotonic()
        path = prepare_dataset(prepare_config)
        print(f"prepared in {time.monotonic() - started:.1f} s: {path}")
    print("next: python download_models.py --check-offline   (then sbatch slurm/finetune.sh)")
    return 0


def _download(args: argparse.Namespace, specs: list[AssetSpec], cache_dir: Path) -> None:
    from huggingface_hub import constants

    from fsdp_utils.hub.download import download_assets

    if constants.HF_HUB_OFFLINE:
        raise ValueError(
            "HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set in this shell, so nothing can be "
            "downloaded. They belong on compute nodes; on the login node run:\n  "
            f"HF_HUB_OFFLINE=0 TRANSFORMERS_OFFLINE=0 {args.command_line}"
        )
    started = time.monotonic()
    with _stop_at_once_on_ctrl_c():
        entries = download_assets(
            specs, cache_dir, workers=args.workers, dry_run=args.dry_run, log=print
        )
    if args.dry_run:
        return
    total = sum(f.size for e in entries for f in e.files)
    print(
        f"cached {len(entries)} asset(s), {format_bytes(total)}, in "
        f"{time.monotonic() - started:.1f} s; manifest: {manifest_path(cache_dir)}"
    )


def _config_only(args: argparse.Namespace, specs: list[AssetSpec], cache_dir: Path) -> int:
    from huggingface_hub import constants

    from fsdp_utils.hub.download import download_model_configs

    if args.prepare or args.dry_run:
        raise ValueError("--config_only fetches one file per model: drop --prepare/--dry-run.")
    models = [spec for spec in specs if spec.repo_type == "model"]
    if not models:
        raise ValueError("--config_only fetches models' config.json: give --model ID.")
    if constants.HF_HUB_OFFLINE:
        raise ValueError(
            "HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set in this shell, so nothing can be "
            "downloaded. On the login node run:\n  "
            f"HF_HUB_OFFLINE=0 TRANSFORMERS_OFFLINE=0 {args.command_line}"
        )
    download_model_configs(models, cache_dir, log=print)
    plan = " ".join(f"--model {spec.repo_id}" for spec in models[:1])
    print(
        f"next: python -m fsdp_utils.plan {plan} --gpus_per_node 4 --gpu_memory 80GiB (the "
        "plan reads config.json only); to train, download the whole model: python "
        f"download_models.py {plan}"
    )
    return 0


def _download_eval_tasks(args: argparse.Namespace, names: list[str], cache_dir: Path) -> None:
    from huggingface_hub import constants

    from fsdp_utils.lm_harness.task_cache import download_task_data
    from fsdp_utils.lm_harness.tasks import require_known_tasks

    require_known_tasks(names)  # a typo first: no download, offline or not, would help
    if constants.HF_HUB_OFFLINE:
        raise ValueError(
            "HF_HUB_OFFLINE is set in this shell, so no task data can be downloaded. On the "
            f"login node run:\n  HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0 {args.command_line}"
        )
    started = time.monotonic()
    download_task_data(names, cache_dir, workers=args.workers, log=print)
    print(f"lm-eval task data cached in {time.monotonic() - started:.1f} s")


def _offline_modes(args: argparse.Namespace, specs: list[AssetSpec] | None, cache_dir: Path) -> int:
    status = 0
    if args.verify:
        from fsdp_utils.hub.verify import verify_cache

        reports = verify_cache(cache_dir, specs, workers=args.workers)
        for report in reports:
            print("\n".join(report.lines()))
        bad = [r for r in reports if not r.ok]
        print(f"verify: {len(reports) - len(bad)} of {len(reports)} asset(s) OK in {cache_dir}")
        status = 1 if bad else 0
    if args.check_offline:
        from fsdp_utils.hub.offline_check import run_offline_check
        from fsdp_utils.lm_harness.task_cache import run_offline_task_check

        status = max(status, run_offline_check(cache_dir, specs))
        status = max(status, run_offline_task_check(cache_dir))
    return status


def _prepare_config(specs: list[AssetSpec], request: Request) -> TrainConfig:
    """The config `--prepare` tokenises with: the training config given with --config, else
    the trainer's defaults for the named model and dataset. The cache folder stays as the user
    gave it (None: from the environment): the prepared data's folder derives from it exactly
    as it will on the compute node."""
    if request.train_config is not None:
        return request.train_config
    models = [s for s in specs if s.repo_type == "model"]
    datasets = [s for s in specs if s.repo_type == "dataset"]
    if len(models) > 1 or len(datasets) != 1:
        raise ValueError(
            "--prepare needs exactly one dataset and at most one model; otherwise pass the "
            "training config: python download_models.py --config train.yaml --prepare"
        )
    model = models[0] if models else AssetSpec(DEFAULT_MODEL, "model")
    return TrainConfig(
        model=model.repo_id,
        revision=model.revision,
        dataset=datasets[0].repo_id,
        dataset_include=datasets[0].include or "",
        dataset_revision=datasets[0].revision,
        cache_dir=request.cache_dir,
    )
