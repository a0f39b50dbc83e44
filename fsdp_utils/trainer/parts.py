"""What the Trainer's setup builds before the training method takes over: the run's header
line, the prepared data, and the model (on meta, then sharded and loaded, and a frozen copy of
the starting model for a method that keeps one)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from torch import nn

from fsdp_utils.checkpoint.sharded import list_checkpoints
from fsdp_utils.checkpoint.storage import plan_storage
from fsdp_utils.config.batch import BatchPlan
from fsdp_utils.config.layout import RunLayout
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.document_masking import attention_implementation
from fsdp_utils.data.prepare import PreparedData, prepare_dataset, slow_preparation_advice
from fsdp_utils.data.sequence_slices import describe_padding
from fsdp_utils.data.workers import PreparationStopped
from fsdp_utils.hub.resolve import ResolvedAssets
from fsdp_utils.model import freeze, liger, lora
from fsdp_utils.model.build import build_meta_model
from fsdp_utils.model.float8 import describe_float8
from fsdp_utils.model.transforms import MetaModel, transform_model
from fsdp_utils.model.weights import WeightSource, checkpoint_key_map
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.parallel.materialize import build_model
from fsdp_utils.parallel.parallelize import describe_parallelism, fsdp_group_names
from fsdp_utils.train.timelimit import StoppedBeforeFirstStep

Log = Callable[[str], None]


def describe_run(config: TrainConfig, plan: BatchPlan, env: DistEnv, root: Path) -> str:
    """The log's first lines: what trains on what, where, with which batch and settings."""
    c = config
    warmup = "warmup: see epochs" if c.num_epochs else f"{c.resolved_warmup_steps} warmup steps"
    padding = describe_padding(c.seq_length, c.sequence_parallel)
    return (
        f"run: {c.model} on {c.dataset} -> {root}\n"
        f"world: {env.world_size} process(es) on {env.num_nodes} node(s), "
        f"device {env.device.type}, backend {env.backend}\n"
        f"batch: {plan.describe()}\n"
        f"parallel: {describe_parallelism(c, env.world_size)}; precision {c.precision}; "
        f"optimizer {c.optimizer}, lr {c.learning_rate:g} ({c.lr_schedule}, {warmup}), "
        f"grad clip {c.grad_clip or 'off'}" + (f"\n{padding}" if padding else "")
    )


def prepare_data(
    config: TrainConfig,
    assets: ResolvedAssets,
    env: DistEnv,
    log: Log,
    *,
    stop: Callable[[], str | None],
) -> PreparedData:
    """Collective: rank 0 prepares (or finds) the cached data and tells the others where: a
    --dataset_module runs once, and every rank reads what rank 0 prepared. The others wait on
    the store, not in a collective: preparing may take hours, longer than
    --collective_timeout_minutes (`on_main_rank`). Rank 0 asks `stop` as it goes (the time
    limit: StoppedBeforeFirstStep on every rank)."""

    def prepare() -> Path | str:
        try:
            return prepare_dataset(config, assets=assets, log=log, stop=stop)
        except PreparationStopped as stopped:
            log(
                f"data: preparation stopped ({stopped.reason}) when it had {stopped.done}; a "
                "preparation is kept whole or not at all, so the next leg starts it again. "
                "Prepare the data before the training job instead: sbatch slurm/prepare.sh "
                "with the same options (docs/slurm.md)."
            )
            return stopped.reason

    started = time.monotonic()
    main_outcome = dist_utils.on_main_rank(prepare)
    advice = slow_preparation_advice(time.monotonic() - started, env.world_size)
    if advice:
        log(advice)
    outcome = dist_utils.broadcast_object(main_outcome)
    if isinstance(outcome, str):
        raise StoppedBeforeFirstStep(outcome, "the data preparation")
    assert outcome is not None  # rank 0 prepared it, or every rank raised
    return PreparedData.load(outcome)


class RunModel:
    """The model of a run as the Trainer builds it: on meta first (no memory), then sharded,
    materialised and loaded (`fsdp_utils.parallel.materialize.build_model`). It reads the
    model's options only (precision, attention, LoRA, frozen layers)."""

    fsdp_groups: list[str]  # set by `build`

    def __init__(
        self, config: TrainConfig, env: DistEnv, assets: ResolvedAssets, layout: RunLayout, log: Log
    ) -> None:
        self.config = config
        self.env = env
        self.hf_config = assets.model_config
        self.model_dir = assets.model_dir
        self.layout = layout
        self.log = log
        self.key_map: dict[str, WeightSource] = {}

    def meta(self) -> MetaModel:
        """The model as it will train, on meta; its checkpoint key map (taken before the
        transforms rename anything); and, on rank 0, the storage check of its checkpoints."""
        model = build_meta_model(
            self.hf_config,
            self.config.precision,
            attn_implementation=self.config.attn_implementation,
        )
        self.key_map = checkpoint_key_map(model, self.model_dir)
        meta = transform_model(model, self.config)

        def check_storage() -> str:
            return plan_storage(
                meta.model, self.config, self.hf_config, self.model_dir,
                existing=len(list_checkpoints(self.layout.checkpoints)),
                world_size=self.env.world_size,
            ).check()  # fmt: skip

        line = dist_utils.on_main_rank(check_storage)
        if line:
            self.log(line)
        return meta

    def build(self, meta: MetaModel, *, load_weights: bool) -> nn.Module:
        """Collective: `meta` sharded, materialised and (with `load_weights`) loaded; logged."""
        model = build_model(
            meta, self.config, self.env, self.model_dir, self.key_map, load_weights=load_weights
        )
        self.fsdp_groups = fsdp_group_names(model)
        c = self.config
        self.log(
            f"model: {meta.info.describe()}; "
            f"{len(self.fsdp_groups)} FSDP shard group(s); attention "
            f"{attention_implementation(getattr(model, 'module', model))}"
            + (f"\nlora: {lora.describe(c, model)}" if c.lora else "")
            + (f"\nfreeze: {freeze.describe(c, model)}" if c.freeze_layers else "")
            + (f"\n{liger.describe(meta.info.model_type)}" if c.liger_kernels else "")
            + (f"\n{describe_float8(model, c)}" if c.float8 != "none" else "")
        )
        return model

    def frozen_copy(self) -> nn.Module:
        """Collective: the starting model again, built and sharded like the trained one
        (`methods.base.StepParts`: the DPO reference of --reference live)."""
        model = build_meta_model(
            self.hf_config,
            self.config.precision,
            attn_implementation=self.config.attn_implementation,
        )
        meta = transform_model(model, self.config)
        return build_model(
            meta, self.config, self.env, self.model_dir, self.key_map, load_weights=True
        )
