"""`--method distill`: the Method the trainer composes. Its examples are the prepared blocks
(the student's data and tokenizer); its teacher is live (`--teacher`, sharded beside the
student) or cached (`--teacher_cache`, written before the first step when it is not yet, by
this job or by a job of the teacher's own: `--teacher_cache_only`); its step is a TrainStep
whose loss of a micro-batch is distillation's (step.py)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import TokenBlocks
from fsdp_utils.data.prepare import PreparedData
from fsdp_utils.hub.resolve import (
    config_folder,
    load_model_config,
    resolve_model_dir,
)
from fsdp_utils.model.teacher import check_same_vocabulary, output_width
from fsdp_utils.parallel import distributed as dist_utils
from fsdp_utils.train.loss import LossChunking, logit_transform, run_chunking
from fsdp_utils.train.step import TrainStep, build_train_step

from ..base import Examples, Method, MethodContext, StepParts, StopCheck
from .cache import (
    CachedBlocks,
    CacheKey,
    check_key,
    compute_teacher_cache,
    missing_cache_message,
    read_meta,
    start_cache,
    teacher_files,
)
from .loss import DistillSettings
from .on_policy import OnPolicy, describe_data_problem
from .step import (
    DistillLoss,
    DistillStep,
    TeacherPassStep,
    build_distill_step,
    evaluate_distill,
)
from .teacher import CachedStandIn, CachedTeacher, LiveTeacher, TeacherSource

# --loss_chunk_size 0 (unchunked): the whole micro-batch's targets in one chunk
ONE_CHUNK = 2**62


def distill_chunking(config: TrainConfig, hf_config: Any, device: torch.device) -> LossChunking:
    """The student's chunks (`train.loss.LossChunking`): the losses always read the output
    layer through them; --loss_chunk_size 0 makes one chunk of every target."""
    chunking = run_chunking(config, hf_config, device)
    if chunking.chunk_size:
        return chunking
    return LossChunking(ONE_CHUNK, logit_transform(hf_config)[0], "loss: in one chunk")


def _known_logits(hf_config: Any, who: str) -> None:
    _, reason = logit_transform(hf_config)
    if reason is not None:
        raise ValueError(
            f"--method distill reads the {who}'s output layer chunk by chunk, and {reason}: "
            "distill from a family this toolkit knows (docs/models.md)."
        )


def _pad_token_id(hf_config: Any, stop_token_ids: list[int]) -> int:
    """The token the samples are padded with (never read: the labels ignore padding)."""
    pad = getattr(hf_config, "pad_token_id", None)
    return int(pad) if pad is not None else int(stop_token_ids[0]) if stop_token_ids else 0


def _not_split(config: TrainConfig) -> None:
    """Refused at the preflight, and in the planner (which then does not offer it)."""
    if config.sequence_parallel > 1:
        raise ValueError(
            "--method distill with --sequence_parallel: the teacher's forward is not split over "
            "a sequence-parallel group. Drop --sequence_parallel (a shorter --max_seq_length, "
            "--gradient_checkpointing or the teacher as a job of its own, --teacher_cache, for "
            "the memory)."
        )


class Distill(Method):
    name: ClassVar[str] = "distill"
    step: DistillStep  # set by build_step

    def __init__(self, config: TrainConfig, context: MethodContext) -> None:
        super().__init__(config, context)
        self.chunking = distill_chunking(config, context.hf_config, context.env.device)
        self.cache = Path(config.teacher_cache) if config.teacher_cache else None
        self.cached = False  # the cache is complete (read: no teacher needed for the data)
        self.meta: dict[str, Any] | None = None
        self.splits: dict[str, CachedBlocks] = {}
        self.live: LiveTeacher | None = None
        self.vocab: int | None = None
        self.prepared: PreparedData | None = None
        self.stop_token_ids: list[int] = []  # the data's (--lmbda's samples end at one)

    # --- checks and the teacher's files -------------------------------------------------------

    @classmethod
    def preflight(cls, config: TrainConfig) -> None:
        """Before any work: the student's and the teacher's logits read in chunks, the teacher
        in the offline cache with the student's vocabulary, a cache to read when there is no
        teacher."""
        _not_split(config)
        student_dir = resolve_model_dir(config.model, config.revision, config.cache_dir)
        student_config = load_model_config(student_dir)
        _known_logits(student_config, "student")
        if config.teacher is not None:
            teacher_dir = cls.teacher_dir(config)
            teacher_config = load_model_config(teacher_dir)
            _known_logits(teacher_config, "teacher")
            check_same_vocabulary(
                (config.model, student_dir, student_config),
                (config.teacher, teacher_dir, teacher_config),
            )
        elif config.teacher_cache is not None:  # read only: it must be there, whole
            meta = read_meta(Path(config.teacher_cache))
            if meta is None or not meta["complete"]:
                raise ValueError(missing_cache_message(Path(config.teacher_cache), meta))

    @staticmethod
    def teacher_dir(config: TrainConfig, *, config_only: bool = False) -> Path:
        """The teacher's folder from the offline cache (`config_only`: its config.json alone,
        all the memory planner reads); MissingAssetError with the download command otherwise."""
        assert config.teacher is not None
        find = config_folder if config_only else resolve_model_dir
        return find(config.teacher, config.teacher_revision, config.cache_dir)

    def _vocab(self) -> int:
        """The output columns both models read (the student's, teacher's tokenizer shared)."""
        if self.vocab is None:
            c = self.config
            if c.teacher is not None:
                teacher = self.teacher_dir(c)
                self.vocab = check_same_vocabulary(
                    (c.model, self.context.model_dir, self.context.hf_config),
                    (c.teacher, teacher, load_model_config(teacher)),
                )
            else:
                assert self.meta is not None
                self.vocab = int(self.meta["key"]["vocab"])
        return self.vocab

    # --- data and the cache ---------------------------------------------------------------

    def use_data(self, prepared: PreparedData) -> tuple[Examples, Examples]:
        masking = self.config.document_masking
        for name in ("train", "eval"):
            blocks = prepared.split(name, document_masking=masking)
            assert isinstance(blocks, TokenBlocks), "distillation reads blocks, not pairs"
            self.splits[name] = CachedBlocks(blocks, name)
        if self.cache is not None:
            # Rank 0's view of the shared file system decides, for every rank.
            self.meta = dist_utils.broadcast_object(
                read_meta(self.cache) if self.env.is_main else None
            )
            if self.meta is not None:
                check_key(
                    self.cache,
                    self.meta,
                    self._key(prepared),
                    teacher_known=bool(self.config.teacher),
                )
            elif self.config.teacher is None:
                raise ValueError(missing_cache_message(self.cache, None))
            self.cached = self.meta is not None and bool(self.meta["complete"])
            self.prepared = prepared
            if self.cached:
                self._attach()
        if self.config.lmbda > 0:
            problem = describe_data_problem(prepared.meta["spec"])
            if problem is not None:
                raise ValueError(
                    f"--lmbda {self.config.lmbda}: the student samples the answers of the data's "
                    f"prompts, but {problem} (docs/distillation.md#on-policy)."
                )
            self.stop_token_ids = prepared.stop_token_ids(self.context.model_dir)
        return self.splits["train"], self.splits["eval"]

    def _key(self, prepared: PreparedData) -> CacheKey:
        c = self.config
        if c.teacher is None:  # read only: the cache's own teacher
            assert self.meta is not None
            saved = self.meta["key"]
            name, files = saved["teacher"], saved["teacher_files"]
        else:
            name, files = c.teacher, teacher_files(self.teacher_dir(c))
        return CacheKey(prepared.folder.name, name, files, c.distill_temperature, self._vocab())

    def _attach(self) -> None:
        assert self.cache is not None
        for split in self.splits.values():
            split.attach(self.cache)

    def describe(self) -> str:
        c = self.config
        settings = DistillSettings.of(c, None).describe()
        if self.cached:
            assert self.meta is not None
            teacher = (
                f"cached in {self.cache} ({self.meta['key']['teacher']}, top {self.meta['top_k']} "
                "log-probabilities per token): no teacher loaded"
            )
        elif self.cache is not None:
            teacher = (
                f"{c.teacher}, loaded to write its top {c.teacher_top_k} log-probabilities "
                f"per token to {self.cache} first"
                + (" (and then end: --teacher_cache_only)" if c.teacher_cache_only else "")
            )
        else:
            teacher = f"{c.teacher}, sharded beside the student, run at every micro-batch"
        on_policy = (
            f"; on-policy (--lmbda {c.lmbda:g}): on that share of the steps the student samples "
            f"the answers (at most {c.distill_max_new_tokens} tokens) and the live teacher "
            f"{c.teacher} scores them"
            if c.lmbda > 0
            else ""
        )
        return f"distill: {settings}; teacher: {teacher}{on_policy}"

    def before_first_step(self, model: nn.Module, parts: StepParts, stop: StopCheck) -> str | None:
        """Collective: the teacher's cache of every block (train and eval) when it is to be
        cached and is not yet. A stop request between its batches keeps the blocks done, and
        the next leg computes the rest."""
        if self.cache is None or self.cached:
            if self.cached:
                self.context.log(f"distill: the teacher's log-probabilities from {self.cache}")
            return None
        teacher = self._live(parts)
        c = self.config
        blocks = {name: split.blocks for name, split in self.splits.items()}
        if self.meta is None:
            assert self.prepared is not None
            key = self._key(self.prepared)
            k = min(c.teacher_top_k, self._vocab())
            self.meta = dist_utils.broadcast_object(
                start_cache(self.cache, key, blocks, k, self.env.world_size)
                if self.env.is_main
                else None
            )
        meta = self.meta
        assert meta is not None
        total = sum(len(b) for b in blocks.values())
        self.context.log(
            f"distill: writing the teacher's top {meta['top_k']} log-probabilities of "
            f"{total:,} blocks to {self.cache}"
        )

        def entries(batch: dict[str, Any]) -> dict[str, np.ndarray]:
            return teacher.cache_entries(
                batch, k=int(meta["top_k"]),
                temperature=c.distill_temperature, vocab=self._vocab(),
                chunk_size=self.chunking.chunk_size,
            )  # fmt: skip

        stopped = compute_teacher_cache(
            entries, blocks, self.cache, meta, env=self.env,
            batch_size=self.context.plan.batch_size_per_device, log=self.context.log, stop=stop,
        )  # fmt: skip
        if stopped is not None:
            return stopped
        self.cached = True
        self._attach()
        if c.teacher_cache_only:
            self.context.log(
                f"distill: the teacher's job is done (--teacher_cache_only); train the student "
                f"with --teacher_cache {self.cache} and without --teacher (no teacher loaded)"
            )
        if c.lmbda == 0:  # the data's batches read the cache from now on
            teacher.close()
            self.live = None
        return None

    def trains(self) -> bool:
        return not self.config.teacher_cache_only

    # --- the step -------------------------------------------------------------------------

    def _live(self, parts: StepParts) -> LiveTeacher:
        """Collective: the teacher, built and loaded once."""
        if self.live is None:
            c = self.config
            teacher_dir = self.teacher_dir(c)
            self.live = LiveTeacher.build(
                c, self.env, model_dir=teacher_dir, hf_config=load_model_config(teacher_dir),
                autocast=parts.autocast, log=self.context.log,
            )  # fmt: skip
        return self.live

    def build_step(self, model: nn.Module, parts: StepParts) -> TrainStep:
        c = self.config
        teacher: TeacherSource = (
            CachedTeacher(self.env.device) if self.cached else self._live(parts)
        )
        on_policy = None
        if c.lmbda > 0:
            settings = OnPolicy.settings(
                max_new_tokens=c.distill_max_new_tokens, stop_token_ids=self.stop_token_ids,
                pad_token_id=_pad_token_id(self.context.hf_config, self.stop_token_ids),
                temperature=c.distill_temperature,
            )  # fmt: skip
            on_policy = OnPolicy(
                model, seed=c.seed, lmbda=c.lmbda, settings=settings, device=self.env.device,
                autocast=parts.autocast,
            )  # fmt: skip
        live = self._live(parts) if on_policy is not None else None
        return self._step(model, parts, teacher, self._vocab(), on_policy=on_policy, live=live)

    def planned_step(self, model: nn.Module, parts: StepParts) -> TrainStep:
        """The planner's: the teacher built on fake tensors (its config.json is all it reads)
        when the run holds it, a stand-in for the cache's rows when the data's batches read
        them. (The sampling phase of --lmbda is not traced.)"""
        c = self.config
        _not_split(c)
        cached = c.teacher is None or (c.teacher_cache is not None and not c.teacher_cache_only)
        k = c.teacher_top_k
        if c.teacher is None or (cached and c.lmbda == 0):
            return self._step(model, parts, CachedStandIn(self.env.device, k), None)
        teacher_config = load_model_config(self.teacher_dir(c, config_only=True))
        teacher = self.live = LiveTeacher.build(
            c, self.env, model_dir=None, hf_config=teacher_config, autocast=parts.autocast,
            log=self.context.log,
        )  # fmt: skip
        vocab = min(output_width(teacher_config), output_width(self.context.hf_config))
        if c.teacher_cache_only:  # the teacher's job of its own: its pass, nothing trained
            top_k = functools.partial(
                teacher.top_k_entries, k=min(k, vocab), temperature=c.distill_temperature,
                vocab=vocab, chunk_size=self.chunking.chunk_size,
            )  # fmt: skip
            return build_train_step(
                model, c, world_size=self.env.world_size, device=self.env.device,
                hf_config=self.context.hf_config, autocast=parts.autocast, grad_scaler=False,
                step_class=TeacherPassStep, router_loss=None, chunking=self.chunking,
                teacher=teacher, top_k=top_k,
            )  # fmt: skip
        data: TeacherSource = CachedStandIn(self.env.device, k) if cached else teacher
        return self._step(model, parts, data, vocab, live=teacher)

    def _step(
        self,
        model: nn.Module,
        parts: StepParts,
        teacher: TeacherSource,
        vocab: int | None,
        *,
        on_policy: OnPolicy | None = None,
        live: TeacherSource | None = None,
    ) -> TrainStep:
        distill_loss = DistillLoss(
            teacher, DistillSettings.of(self.config, vocab), chunking=self.chunking,
            device=self.env.device, autocast=parts.autocast, live=live,
            cached_top_k=int(self.meta["top_k"]) if self.cached and self.meta else None,
        )  # fmt: skip
        self.step = build_distill_step(
            model, self.config, world_size=self.env.world_size, device=self.env.device,
            hf_config=self.context.hf_config, chunking=self.chunking, distill_loss=distill_loss,
            on_policy=on_policy, autocast=parts.autocast, grad_scaler=parts.grad_scaler,
        )  # fmt: skip
        return self.step

    def frozen_models(self) -> list[nn.Module]:
        return [self.live.loaded] if self.live is not None and self.live.model is not None else []

    @classmethod
    def memory_fixes(cls, config: TrainConfig) -> list[tuple[str, str, TrainConfig]]:
        """With a live teacher: the teacher in 4 bits, and the teacher as a job of its own
        (the student's job then holds no teacher at all)."""
        if config.teacher is None or config.teacher_cache is not None or config.lmbda > 0:
            return []
        fixes = []
        if config.teacher_quantize == "none":
            fixes.append((
                "--teacher_quantize nf4",
                "the teacher's decoder layers in 4 bits: its log-probabilities move a little",
                config.replace(teacher_quantize="nf4"),
            ))  # fmt: skip
        cost = (
            f"the teacher as a job of its own first (sbatch ... --teacher_cache DIR "
            f"--teacher_cache_only, on nodes with the memory for it), then this job without "
            f"--teacher: top {config.teacher_top_k} log-probabilities per token, "
            f"{8 * config.teacher_top_k + 4} bytes per token on disk"
        )
        fixes.append(
            ("--teacher_cache DIR", cost, config.replace(teacher=None, teacher_cache="DIR"))
        )
        return fixes

    def evaluate(
        self, model: nn.Module, examples: Examples, *, batch_size: int, max_batches: int
    ) -> dict[str, Any] | None:
        return evaluate_distill(
            model, examples, self.step.distill_loss, env=self.env, batch_size=batch_size,
            max_batches=max_batches,
        )  # fmt: skip

    def before_export(self) -> None:
        if self.live is not None:  # the teacher's shards are not needed any more
            self.live.close()
