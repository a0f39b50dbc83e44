"""Data preparation: rows -> tokens (and loss masks) -> blocks, cached on disk.

Preparation (`prepare_dataset`) runs once per dataset/tokenizer/settings and is cached under a
key of everything that determines its result, so a rerun, another rank or a requeued job loads
it in milliseconds. It can also run on the login node (`download_models.py --prepare`).

It streams: rows are read, tokenised and written a batch at a time, so its memory does not grow
with the data (a few batches of rows, and a few bytes per row: lengths, drop reasons, the split's
order), and nothing beside the prepared arrays is left on disk.

1. source: the dataset's files, read in batches in file order (`fsdp_utils.data.streaming`;
   their types: `fsdp_utils.data.files`), or a `--dataset_module`'s rows
   (`fsdp_utils.data.custom`); the format follows from the columns (`fsdp_utils.data.formats`)
   and the log says which and why;
2. tokens: chess and text are rendered (`fsdp_utils.data.render`) and tokenised with an EOS
   closing every document; chat, prompt/completion, alpaca and templates become tokens and a
   loss mask (`fsdp_utils.data.rows`: the answers only, unless --train_on_prompt), too-long
   rows and rows with nothing to train dropped and counted. With `--num_proc` N, N forked
   processes take a batch each (two each in flight at most: `fsdp_utils.data.workers`, which
   also asks a training job's time limit after every batch). Each batch's tokens are appended
   to spill files as it comes (`fsdp_utils.data.token_files`), with progress in the log;
3. split: rows are shuffled by seed; the first `eval_examples` are held out (`split_rows`);
4. blocks, per split in split order, written a chunk of blocks at a time: chess and text as one
   stream cut into full blocks (`--no_packing`: each document padded); the masked formats'
   whole rows packed by best-fit decreasing over the split's lengths
   (`fsdp_utils.data.packing`). The spill files are deleted.

Prepared layout, memory-mapped at training time (`fsdp_utils.data.blocks`), per split:
`input_ids` (blocks x max_seq_length int32) and `lengths` (valid tokens per block; the rest is
padding and carries no loss); the masked formats add `loss_mask` and `row_starts` (both
blocks x max_seq_length bool). `meta.json` holds the key's inputs (`spec`) and the counts the
start of the log prints (`stats`). The raw rows of the eval split are also what the chess
evaluation plays from (`held_out_games`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fsdp_utils.config.options.evaluation import DEFAULT_EVAL_EXAMPLES
from fsdp_utils.config.seq_length import fit_seq_length
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import TokenBlocks
from fsdp_utils.data.chat import ChatEncoder, ChatTemplate, chat_template, check_end_of_turn
from fsdp_utils.data.custom import ModuleRows, load_dataset_module
from fsdp_utils.data.files import peek_columns
from fsdp_utils.data.formats import PROMPT_FORMAT, FormatChoice, choose_format
from fsdp_utils.data.instruct import check_templates
from fsdp_utils.data.preference import PAIR_ROWS, PreferenceEncoder, PreferencePairs, pair_sequences
from fsdp_utils.data.prompts import (
    PROMPT_COLUMN,
    PromptEncoder,
    PromptSet,
    PromptSplit,
    check_prompt_lengths,
    end_of_turn_id,
    is_messages,
    jsonable,
)
from fsdp_utils.data.render import CHESS_COLUMNS, is_chess_schema, render_game
from fsdp_utils.data.rows import ROW_INDEX, RowEncoder, uses_messages
from fsdp_utils.data.streaming import Batch, count_rows, dataset_batches, row_batches
from fsdp_utils.data.token_files import TokenSpill, write_packed, write_padded, write_stream
from fsdp_utils.data.workers import StopCheck, available_cpus, tokenised
from fsdp_utils.hub.resolve import (
    ResolvedAssets,
    describe_dataset_files,
    resolve_assets,
    resolve_dataset_files,
)
from fsdp_utils.hub.selection import SAFETENSORS_INDEX, SUPPORT_SUFFIXES

FORMAT_VERSION = 1  # bump when the prepared layout or the preparation logic changes
# The same for the masked formats (chat, prompt/completion, alpaca, templates): only their
# keys carry it, so chess and text keep the keys (and caches) they had.
MASKED_VERSION = 2  # 2: chat masks by character offsets, nothing after the end-of-turn token
PROMPTS_VERSION = 1  # the same for prompt sets (--method grpo: fsdp_utils/data/prompts.py)
TOKENIZER_SUBDIR = "tokenizer"  # with --chat_template: the tokenizer the final model carries


# --- preparation ---------------------------------------------------------------------------


def default_data_cache_dir(config: TrainConfig) -> Path:
    if config.data_cache_dir:
        return Path(config.data_cache_dir)
    if config.cache_dir:
        return Path(config.cache_dir) / "fsdp_utils" / "prepared"
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "fsdp_utils" / "prepared"


def _file_fingerprint(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime": int(stat.st_mtime)}


def _tokenizer_fingerprint(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for name in sorted(os.listdir(model_dir)):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            digest.update(name.encode())
            digest.update((model_dir / name).read_bytes())
    return digest.hexdigest()


def preparation_spec(
    config: TrainConfig, files: list[Path], model_dir: Path, *, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Everything that determines the prepared data, and nothing else. `extra`: what only
    some preparations depend on (`source_spec`); chess and text from files have none."""
    return {
        "format_version": FORMAT_VERSION,
        "files": [_file_fingerprint(f) for f in files],
        "tokenizer": _tokenizer_fingerprint(model_dir),
        "template": config.template,
        "text_field": config.text_field,
        "max_seq_length": config.seq_length,
        "packing": not config.no_packing,
        "eval_examples": config.eval_examples,
        "max_examples": config.max_examples,
        "seed": config.seed,
        **(extra or {}),
    }


def source_spec(
    config: TrainConfig,
    choice: FormatChoice,
    template: ChatTemplate | None,
    module: ModuleRows | None,
) -> dict[str, Any]:
    """The key's inputs beyond chess and text from files: the masked formats' settings (the
    format, its templates, the chat template's text, the masking options) and the rows a
    --dataset_module returned."""
    extra: dict[str, Any] = {}
    if choice.name == PROMPT_FORMAT:
        extra["prompts"] = {
            "version": PROMPTS_VERSION,
            "chat_template": template.text if template else None,
            "max_prompt_length": config.seq_length - config.max_completion_length,
        }
    elif choice.masked:
        extra["masked"] = {
            "version": MASKED_VERSION,
            "format": choice.name,
            "chat_template": template.text if template else None,
            "prompt_template": config.prompt_template,
            "response_template": config.response_template,
            "train_on_prompt": config.train_on_prompt,
            "long_examples": config.long_examples,
        }
    elif config.data_format != "auto":  # e.g. forced to text: another result than auto's
        extra["data_format"] = choice.name
    if module is not None:
        extra["dataset_module"] = {"function": module.spec, "rows_sha256": module.digest}
    return extra


@dataclass(frozen=True)
class PreparedData:
    folder: Path
    meta: dict[str, Any]

    @classmethod
    def load(cls, folder: Path) -> PreparedData:
        """A prepared folder (`prepare_dataset`'s result) and its meta.json."""
        return cls(folder, json.loads((folder / "meta.json").read_text()))

    def split(
        self, name: str, *, document_masking: bool = False
    ) -> TokenBlocks | PreferencePairs | PromptSet:
        """A split's blocks (pairs, prompts); with document masking their batches carry
        position ids that restart at every document (fsdp_utils.data.document_masking): after
        each EOS for chess and text, at the stored row starts for the masked formats. A padded
        (unpacked) row holds one document anyway, so it gets none."""
        if "prompts" in self.meta["spec"]:
            return PromptSet.load(self.folder, name)
        packed = bool(self.meta["spec"].get("packing", True))
        restart = document_masking and packed
        if self.meta["spec"].get("masked", {}).get("format") == "preference":
            return PreferencePairs.load(self.folder, name)  # padded pairs: nothing to restart
        if "masked" in self.meta["spec"]:
            return TokenBlocks.load(self.folder, name, row_starts=restart)
        eos = self.meta["stats"]["eos_token_id"] if restart else None
        return TokenBlocks.load(self.folder, name, document_eos=eos)

    @property
    def chat_template_source(self) -> str | None:
        """Where the chat template the rows were rendered with came from ("the chat template
        of MODEL", "--chat_template FILE"); None when the data is not chat (no row was a
        message list)."""
        source = self.meta["stats"].get("chat_template")
        return str(source) if source else None

    def tokenizer_dir(self, model_dir: Path) -> Path:
        """Where the final model's tokenizer files come from: the model's own, or with
        --chat_template the copy that carries the template the data was rendered with."""
        own = self.folder / TOKENIZER_SUBDIR
        return own if own.is_dir() else model_dir

    def stop_token_ids(self, model_dir: Path) -> list[int]:
        """The tokens a generation of the trained model ends at: generation_config.json's EOS
        ids (the end-of-turn token among them: `tokenizer_dir`) and the chat data's end of
        turn."""
        ids = _generation_eos_ids(self.tokenizer_dir(model_dir))
        eot = self.meta["stats"].get("end_of_turn_id")
        return ids + ([int(eot)] if eot is not None and eot not in ids else [])


def dataset_files(config: TrainConfig) -> list[Path]:
    """The data files of the run: training data and the held-out games come from the same
    ones (without --dataset_include, those download_models.py fetched: assets.py)."""
    return resolve_dataset_files(
        config.dataset, config.dataset_include, config.dataset_revision, config.cache_dir
    )


@dataclass(frozen=True)
class DataSource:
    """Where the rows come from: dataset files, or the rows of a --dataset_module."""

    files: list[Path]
    module: ModuleRows | None
    columns: list[str]


def open_source(config: TrainConfig, assets: ResolvedAssets, log: Any) -> DataSource:
    if config.dataset_module is not None:
        module = load_dataset_module(config.dataset_module)
        log(f"data: {config.dataset_module}: {len(module.dataset):,} rows")
        return DataSource([], module, list(module.dataset.column_names))
    files = list(assets.dataset_files)
    log(
        f"data: {config.dataset}: {describe_dataset_files(files, config.dataset_include, config.dataset)}"
    )
    return DataSource(files, None, peek_columns(files))


def prepare_dataset(
    config: TrainConfig,
    *,
    assets: ResolvedAssets | None = None,
    log: Any = print,
    stop: StopCheck | None = None,
) -> Path:
    """Render, tokenise and pack the dataset (`--dataset`, or `--dataset_module`'s rows) for
    `config.model`'s tokenizer; return the cache folder (reused when it already exists).
    `assets`: the run's resolved files (else resolved here, as on the login node's
    `download_models.py --prepare`). `stop`: asked between batches of rows, the reason to stop
    or None (a training job's time limit): PreparationStopped, with nothing kept."""
    assets = assets or resolve_assets(config)
    # The trainer's own length (a run's config is fitted already): the cache key holds it.
    config = fit_seq_length(config, assets.model_config)[0]
    model_dir = assets.model_dir
    source = open_source(config, assets, log)
    choice = choose_format(source.columns, config)
    log(f"data: format {choice.name} ({choice.reason})")
    tokenizer = template = None
    if choice.masked or choice.name == PROMPT_FORMAT:
        tokenizer = _load_tokenizer(model_dir)
        template = _chat_template_for(choice, tokenizer, config)
    extra = source_spec(config, choice, template, source.module)
    spec = preparation_spec(config, source.files, model_dir, extra=extra)
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]
    folder = default_data_cache_dir(config) / key
    if (folder / "meta.json").is_file():
        stats = json.loads((folder / "meta.json").read_text()).get("stats", {})
        log(f"data: using prepared data in {folder}: {_describe(stats)}")
        for line in _summary(stats):
            log(line)
        return folder

    started = time.perf_counter()
    where = f"{len(source.files)} file(s)" if source.module is None else config.dataset_module
    log(f"data: preparing {where} -> {folder}")
    tmp = folder.with_name(f"{key}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if choice.name == PROMPT_FORMAT:
            stats = _build_prompts(config, source, tokenizer, template, tmp, log)
            _write_export_files(config, model_dir, template, stats, tmp / TOKENIZER_SUBDIR)
        elif choice.masked:
            stats = _build_rows(config, source, choice, tokenizer, template, tmp, log, stop)
            _write_export_files(config, model_dir, template, stats, tmp / TOKENIZER_SUBDIR)
        else:
            stats = _build(config, source, choice, model_dir, tmp, log, stop)
        meta = {"spec": spec, "stats": stats, "seconds": round(time.perf_counter() - started, 2)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, folder)  # atomic: readers see all of it or nothing
        except OSError:
            if not (folder / "meta.json").is_file():  # not a concurrent winner: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"data: prepared in {time.perf_counter() - started:.1f}s: {_describe(stats)}")
    for line in _summary(stats):
        log(line)
    return folder


# Preparing inside a training job longer than this: the log says how to do it once, before.
SLOW_IN_JOB_S = 180.0


def slow_preparation_advice(seconds: float, world_size: int) -> str | None:
    """The log's advice after a training job prepared its data for `seconds` while its other
    `world_size - 1` processes waited; None when it was quick."""
    if seconds < SLOW_IN_JOB_S:
        return None
    waited = f" while {world_size - 1} other process(es) waited" if world_size > 1 else ""
    return (
        f"data: preparing took {seconds / 60:.1f} min inside the job{waited}. It is cached now "
        "(the next run with these data options starts at once); for the next dataset, prepare "
        "it before the GPU job, on the login node: python download_models.py --config "
        "<your run's config> --prepare, or on a CPU node with as many processes as it has "
        "cores: sbatch slurm/prepare.sh <the same training options>"
    )


def _load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"The tokenizer in {model_dir} has no EOS token to end an answer with.")
    return tokenizer


def _chat_template_for(
    choice: FormatChoice, tokenizer: Any, config: TrainConfig
) -> ChatTemplate | None:
    """The chat template the rows are rendered with: chat rows need one (the error names
    --chat_template); prompt/completion rows need one only if they hold message lists."""
    if choice.name == "chat" or config.chat_template is not None:
        return chat_template(tokenizer, template_file=config.chat_template, model=config.model)
    if (
        choice.name in ("prompt_completion", "preference", PROMPT_FORMAT)
        and tokenizer.chat_template
    ):
        return chat_template(tokenizer, template_file=None, model=config.model)
    return None


def _write_export_files(
    config: TrainConfig,
    model_dir: Path,
    template: ChatTemplate | None,
    stats: dict[str, Any],
    folder: Path,
) -> None:
    """The tokenizer files the final model (and every checkpoint) is saved with, when the
    model's own would not do: with the --chat_template the rows were rendered with, and with
    the end-of-turn token among the EOS ids of generation_config.json when the template's
    token is not the model's EOS (ChatML on a base model whose EOS is <|endoftext|>), so that
    transformers and vLLM prompt the model as it was trained and stop where it learned to.
    The model's files are copied, not re-saved: they stay as they were."""
    eot = stats.get("end_of_turn_id")
    stop_ids = _generation_eos_ids(model_dir)
    new_template = config.chat_template is not None and template is not None
    if not new_template and (eot is None or eot in stop_ids):
        return
    folder.mkdir()
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix in SUPPORT_SUFFIXES and path.name != SAFETENSORS_INDEX:
            shutil.copy2(path, folder / path.name)
    if new_template:
        assert template is not None
        (folder / "chat_template.jinja").write_text(template.text, encoding="utf-8")
        config_file = folder / "tokenizer_config.json"
        if config_file.is_file():  # one template only: the file's
            tokenizer_config = json.loads(config_file.read_text(encoding="utf-8"))
            if tokenizer_config.pop("chat_template", None) is not None:
                config_file.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
    if eot is not None and eot not in stop_ids:
        generation = _generation_config(model_dir)
        generation["eos_token_id"] = [*stop_ids, eot]
        (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _generation_config(model_dir: Path) -> dict[str, Any]:
    """generation_config.json as a dict; without one, what transformers derives from config.json."""
    path = model_dir / "generation_config.json"
    if path.is_file():
        return dict(json.loads(path.read_text()))
    model_config = json.loads((model_dir / "config.json").read_text())
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: model_config[k] for k in keys if model_config.get(k) is not None}


def _generation_eos_ids(model_dir: Path) -> list[int]:
    eos = _generation_config(model_dir).get("eos_token_id")
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def _describe(stats: dict[str, Any]) -> str:
    parts = []
    for split in ("train", "eval"):
        s = stats.get(split)
        if s and stats.get("format") == PROMPT_FORMAT:
            parts.append(f"{split} {s['documents']:,} prompts, {s['tokens']:,} tokens")
        elif s:
            parts.append(
                f"{split} {s['documents']:,} docs, {s['tokens']:,} tokens, {s['blocks']:,} blocks "
                f"({100 * s['padding_fraction']:.2f}% padding)"
            )
    return "; ".join(parts)


# Rows read, tokenised and handed to the workers at a time: memory holds a few such batches.
ROWS_PER_BATCH = 1024


def _row_batches(source: DataSource, columns: list[str] | None) -> Iterator[Batch]:
    if source.module is not None:
        return dataset_batches(source.module.dataset, ROWS_PER_BATCH)
    return row_batches(source.files, columns, ROWS_PER_BATCH)


def _count_rows(source: DataSource) -> int:
    if source.module is not None:
        return len(source.module.dataset)
    return count_rows(source.files)


def split_rows(config: TrainConfig, num_rows: int) -> dict[str, np.ndarray]:
    """Each split's row indices, in split order: shuffled by seed, capped at max_examples, the
    first eval_examples held out. The permutation is numpy's PCG64 one that `datasets`'
    `shuffle(seed=...)` gave earlier versions, so the splits, their order and the prepared
    blocks are unchanged. It depends only on the number of rows and the seed, so the chess
    evaluation finds the raw rows of the held-out games (`held_out_games`)."""
    order = np.random.default_rng(config.seed).permutation(num_rows)
    if num_rows < 2**31:  # half the bytes per row: the one array that grows with the data
        order = order.astype(np.int32)
    if config.max_examples is not None:
        order = order[: min(config.max_examples, num_rows)]
    n_eval = eval_count(config, len(order))
    return {"eval": order[:n_eval], "train": order[n_eval:]}


def eval_count(config: TrainConfig, rows: int) -> int:
    """The rows held out of `rows`: --eval_examples (all but one at most), or, for the default
    on a set too small for it (more held out than left to train on), a tenth of the set."""
    wanted = min(config.eval_examples, max(rows - 1, 0))
    if config.eval_examples == DEFAULT_EVAL_EXAMPLES and wanted > rows - wanted:
        return rows // 10
    return wanted


def _training_split(config: TrainConfig, num_rows: int, log: Any) -> dict[str, np.ndarray]:
    """`split_rows` for a training run, which must keep at least as much to train on as it
    evaluates. The default (200) suits the chess games and most published sets; on a small set
    it is scaled to a tenth (said in the log); a value given that holds out more than it
    leaves would have the run fail later with a message about blocks, so it is refused here.
    (The chess evaluation's `held_out_games` may hold out nearly everything.)"""
    splits = split_rows(config, num_rows)
    n_eval, n_train = len(splits["eval"]), len(splits["train"])
    if config.eval_examples == DEFAULT_EVAL_EXAMPLES and n_eval < DEFAULT_EVAL_EXAMPLES:
        log(
            f"data: holding out {n_eval:,} of {n_eval + n_train:,} documents for evaluation: "
            f"a tenth, as the default {DEFAULT_EVAL_EXAMPLES} would leave fewer to train on "
            "(--eval_examples N to choose)"
        )
    if n_eval > n_train:
        raise ValueError(
            f"--eval_examples {config.eval_examples} would hold out {n_eval:,} of the "
            f"{n_eval + n_train:,} documents for evaluation, leaving {n_train:,} to train on. "
            f"Hold out fewer, e.g. a tenth: --eval_examples {(n_eval + n_train) // 10} (0: no "
            "eval split)."
        )
    return splits


class NotChessData(ValueError):
    """The dataset is not games (its `columns` say what it is: GRPO's chess prompts, say)."""

    def __init__(self, columns: Sequence[str], message: str) -> None:
        super().__init__(message)
        self.columns = list(columns)


def held_out_games(
    config: TrainConfig, limit: int | None = None, *, files: Sequence[Path] | None = None
) -> list[dict[str, Any]]:
    """The raw rows (`Moves`, `Termination`, `Result`) of the eval split, in split order:
    the games whose rendered text is the held-out data. `files`: the run's data files, as
    resolved once (`ResolvedAssets.dataset_files`; else resolved here). A dataset that is not
    chess is a ValueError saying so."""
    if config.dataset_module is not None:
        raise ValueError(
            "The chess evaluation plays held-out games from the --dataset files, and this run "
            f"reads its rows from --dataset_module {config.dataset_module}. Leave "
            "--chess_eval_every at 0, or give the games as --dataset."
        )
    paths = list(files) if files is not None else dataset_files(config)
    columns = peek_columns(paths)
    if not is_chess_schema(columns):
        raise NotChessData(
            columns,
            f"The chess evaluation needs chess games, but the dataset {config.dataset} has "
            f"columns {columns}, not the laion/strategic_game_chess schema (Moves, "
            "Termination, Result). Evaluate on a chess dataset (--dataset "
            "laion/strategic_game_chess, or a folder of parquet files in that schema), or "
            "leave --chess_eval_every at 0 for text data.",
        )
    wanted = split_rows(config, count_rows(paths))["eval"]
    if limit is not None:
        wanted = wanted[:limit]
    place = {int(row): k for k, row in enumerate(wanted)}
    games: list[dict[str, Any]] = [{} for _ in wanted]
    start = 0
    for batch in row_batches(paths, list(CHESS_COLUMNS), ROWS_PER_BATCH):
        size = len(batch[CHESS_COLUMNS[0]])
        for j in range(size):
            k = place.get(start + j)
            if k is not None:
                games[k] = {c: batch[c][j] for c in CHESS_COLUMNS}
        start += size
    return games


def _num_proc(config: TrainConfig, num_docs: int) -> int:
    if config.num_proc is not None:
        return max(1, config.num_proc)
    # Worker start-up costs seconds: not worth it for small datasets.
    return 1 if num_docs < 20_000 else min(8, available_cpus())


@dataclass
class _EncodeDocuments:
    """Chess and text rows -> their tokens, an EOS closing every document."""

    tokenizer: Any
    eos: int
    chess_template: str | None  # chess: render the games with it; else the text column
    text_field: str

    def __call__(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        if self.chess_template is not None:
            texts = [
                render_game(m, t, r, self.chess_template)
                for m, t, r in zip(
                    batch["Moves"], batch["Termination"], batch["Result"], strict=True
                )
            ]
        else:
            texts = batch[self.text_field]
        ids = self.tokenizer(texts, add_special_tokens=True)["input_ids"]
        ids = [x if x and x[-1] == self.eos else [*x, self.eos] for x in ids]
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int32, count=len(ids))
        flat = np.fromiter(
            itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum())
        )
        return flat, lengths


def _build(
    config: TrainConfig,
    source: DataSource,
    choice: FormatChoice,
    model_dir: Path,
    out: Path,
    log: Any,
    stop: StopCheck | None = None,
) -> dict[str, Any]:
    """Chess and text: documents -> their tokens, spilled to disk as they come -> one token
    stream per split, in split order -> full blocks."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"The tokenizer in {model_dir} has no EOS token to separate documents.")
    eos = int(tokenizer.eos_token_id)
    pad = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else eos
    num_rows = _count_rows(source)
    splits = _training_split(config, num_rows, log)
    chess = choice.name == "chess"
    work = _EncodeDocuments(tokenizer, eos, config.template if chess else None, config.text_field)
    columns = list(CHESS_COLUMNS) if chess else [config.text_field]
    spill = TokenSpill(out, masked=False)
    num_proc = _num_proc(config, num_rows)
    for flat, lengths in tokenised(
        work, _row_batches(source, columns), num_proc=num_proc, total=num_rows, log=log,
        stop=stop,
    ):  # fmt: skip
        spill.append(flat, lengths)
    rows = spill.close()
    stats: dict[str, Any] = {"eos_token_id": eos, "pad_token_id": pad}
    try:
        for name, order in splits.items():
            if len(order) == 0:
                continue
            block = config.seq_length
            write = write_padded if config.no_packing else write_stream
            written = write(rows, order, block, pad, out / name)
            stats[name] = {
                "documents": len(order),
                "tokens": written.tokens,
                "blocks": written.blocks,
                "padding_fraction": 1 - written.tokens / written.slots if written.slots else 0.0,
                "truncated_documents": int((rows.lengths[order] > block).sum())
                if config.no_packing
                else 0,
            }
            log(f"data: {name}: {_describe({name: stats[name]})}")
    finally:
        rows.close()
    if "train" not in stats:
        raise ValueError("No training documents left after holding out the eval split.")
    return stats


# --- masked formats: rows with loss masks ---------------------------------------------------


@dataclass
class _EncodeRows:
    """Masked rows -> (tokens, loss masks, lengths, drop reasons, truncated, merged); a
    dropped row keeps no tokens (length 0)."""

    encoder: RowEncoder | PreferenceEncoder

    def __call__(
        self, batch: Batch
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], np.ndarray, np.ndarray]:
        out = self.encoder(batch)
        kept = [not d for d in out["dropped"]]
        ids = [x if k else [] for x, k in zip(out["input_ids"], kept, strict=True)]
        masks = [m if k else [] for m, k in zip(out["loss_mask"], kept, strict=True)]
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int32, count=len(ids))
        total = int(lengths.sum())
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=total)
        mask = np.fromiter(itertools.chain.from_iterable(masks), dtype=np.uint8, count=total)
        truncated = np.asarray(out["truncated"], dtype=bool)
        merged = np.asarray(out["merged"], dtype=bool)
        return flat, mask, lengths, list(out["dropped"]), truncated, merged


def _build_rows(
    config: TrainConfig,
    source: DataSource,
    choice: FormatChoice,
    tokenizer: Any,
    template: ChatTemplate | None,
    out: Path,
    log: Any,
    stop: StopCheck | None = None,
) -> dict[str, Any]:
    """Chat, prompt/completion, alpaca, templates: rows -> (tokens, loss mask), spilled to disk
    as they come -> whole rows packed into blocks, per split. Writes input_ids, lengths,
    loss_mask, row_starts per split."""
    num_rows = _count_rows(source)
    if num_rows == 0:
        raise ValueError("The dataset has no rows.")
    if choice.name == "templates":
        assert config.prompt_template is not None and config.response_template is not None
        check_templates(config.prompt_template, config.response_template, source.columns)
    columns = None if source.module is not None else source.columns
    head = next(_row_batches(source, columns))
    first = {k: v[:64] for k, v in head.items()}
    first[ROW_INDEX] = list(range(len(next(iter(first.values())))))
    pairs = choice.name == "preference"
    sides = PreferenceEncoder.sides(first) if pairs else first
    if (
        choice.name in ("prompt_completion", "preference")
        and uses_messages(sides)
        and template is None
    ):
        # Message lists, and the model has no chat template: the error names --chat_template.
        template = chat_template(tokenizer, template_file=None, model=config.model)
    rows_encoder = RowEncoder(
        "prompt_completion" if pairs else choice.name,
        tokenizer,
        config.seq_length,
        config.long_examples,
        train_on_prompt=config.train_on_prompt,
        template=template,
        prompt_template=config.prompt_template,
        response_template=config.response_template,
    )
    encoder: RowEncoder | PreferenceEncoder = (
        PreferenceEncoder(rows_encoder) if pairs else rows_encoder
    )
    conversations = encoder.conversations(first)
    stats: dict[str, Any] = {"format": choice.name, "format_reason": choice.reason}
    if conversations is not None:
        assert template is not None
        stats["chat_template"] = template.source
        stats["generation_markers"] = template.has_generation_markers
        chat = ChatEncoder(tokenizer, template, train_on_prompt=config.train_on_prompt)
        stats["answers_found_by"] = chat.rule
        end_of_turn = check_end_of_turn(chat, conversations)
        if end_of_turn is not None:
            stats["end_of_turn"] = end_of_turn.token
            stats["end_of_turn_id"] = end_of_turn.id if end_of_turn.special else None
    eos = int(tokenizer.eos_token_id)
    pad = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else eos
    stats.update({"eos_token_id": eos, "pad_token_id": pad})
    splits = _training_split(config, num_rows, log)

    def numbered(batches: Iterator[Batch]) -> Iterator[Batch]:
        start = 0
        for batch in batches:
            size = len(next(iter(batch.values())))
            yield {**batch, ROW_INDEX: list(range(start, start + size))}
            start += size

    spill = TokenSpill(out, masked=True)
    causes: dict[str, int] = {"": 0}
    dropped_parts, truncated_parts, merged_parts = [], [], []
    for flat, mask, lengths, dropped, truncated, merged in tokenised(
        _EncodeRows(encoder), numbered(_row_batches(source, columns)),
        num_proc=_num_proc(config, num_rows), total=num_rows, log=log, stop=stop,
    ):  # fmt: skip
        spill.append(flat, lengths, mask)
        if pairs:  # one entry per pair: a pair is kept or dropped whole
            dropped, truncated = dropped[::2], truncated[::2] | truncated[1::2]
            merged = merged[::2] | merged[1::2]
        dropped_parts.append(
            np.fromiter(
                (causes.setdefault(d, len(causes)) for d in dropped), np.uint8, len(dropped)
            )
        )
        truncated_parts.append(truncated)
        merged_parts.append(merged)
    rows = spill.close()
    drop_code = np.concatenate(dropped_parts)
    truncated_all = np.concatenate(truncated_parts)
    merged_all = np.concatenate(merged_parts)
    names = {code: cause for cause, code in causes.items()}
    try:
        # The peak is the per-row arrays alive while a split is packed: each split's counts are
        # taken first, and before the last (train, nearly every row) is packed, what only the
        # counts needed is freed.
        for name in list(splits):
            order = splits.pop(name)
            if len(order) == 0:
                continue
            codes = drop_code[order]
            kept = order[codes == 0]
            counts = np.bincount(codes, minlength=len(causes))
            stats[name] = {
                "rows_read": len(order),
                "documents": len(kept),
                "dropped": {names[c]: int(n) for c, n in enumerate(counts) if c and n},
                "truncated": int(truncated_all[kept].sum()),
                "prompt_merged": int(merged_all[order].sum()),
            }
            del codes, order
            if not splits:
                del drop_code, truncated_all, merged_all
            if pairs:  # padded, chosen and rejected side by side; each pair's row for the cache
                np.save(out / f"{name}_{PAIR_ROWS}.npy", kept.astype(np.int64))
                written = write_packed(
                    rows, pair_sequences(kept), config.seq_length, pad, out / name,
                    packing=False,
                )  # fmt: skip
            else:
                written = write_packed(
                    rows, kept, config.seq_length, pad, out / name,
                    packing=not config.no_packing,
                )  # fmt: skip
            del kept
            stats[name].update(
                tokens=written.tokens,
                trained_tokens=written.trained,
                blocks=written.blocks,
                padding_fraction=1 - written.tokens / written.slots if written.slots else 0.0,
            )
            log(f"data: {name}: {_describe({name: stats[name]})}")
    finally:
        rows.close()
    if not stats.get("train", {}).get("blocks"):
        read = sum(stats[s]["rows_read"] for s in ("train", "eval") if s in stats)
        raise ValueError(
            f"No training rows left: {read:,} rows read, {_dropped_text(stats)}. "
            + _drop_advice(stats)
        )
    return stats


def _build_prompts(
    config: TrainConfig,
    source: DataSource,
    tokenizer: Any,
    template: ChatTemplate | None,
    out: Path,
    log: Any,
) -> dict[str, Any]:
    """Prompts (--method grpo): each row's `prompt` encoded as TRL's GRPOTrainer encodes it
    (fsdp_utils/data/prompts.py), its other columns kept for the rewards, per split. Prompt
    sets are small (thousands of rows): read, encoded and written in one pass, in memory."""
    num_rows = _count_rows(source)
    if num_rows == 0:
        raise ValueError("The dataset has no rows.")
    encoder = PromptEncoder(tokenizer, template)
    encoded: list[list[int]] = []
    columns: list[dict[str, Any]] = []
    for batch in _row_batches(source, None):
        names = list(batch)
        for j in range(len(batch[PROMPT_COLUMN])):
            row = {name: jsonable(batch[name][j]) for name in names}
            encoded.append(encoder(row[PROMPT_COLUMN], len(columns)))
            columns.append(row)
    limit = config.seq_length - config.max_completion_length
    check_prompt_lengths(
        [len(ids) for ids in encoded], range(len(encoded)), limit=limit,
        max_seq_length=config.seq_length,
    )  # fmt: skip
    chat = any(is_messages(row[PROMPT_COLUMN]) for row in columns)
    eos = int(tokenizer.eos_token_id)
    pad = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else eos
    stats: dict[str, Any] = {
        "format": PROMPT_FORMAT,
        "format_reason": f"column `prompt` (--method {config.method})",
        "eos_token_id": eos,
        "pad_token_id": pad,
        "chat_template": template.source if chat and template is not None else None,
        "end_of_turn_id": end_of_turn_id(tokenizer, template) if chat and template else None,
    }
    for name, order in _training_split(config, num_rows, log).items():
        split = PromptSplit(
            [encoded[i] for i in order], [int(i) for i in order], [columns[i] for i in order]
        )
        stats[name] = split.write(out, name)
        log(
            f"data: {name}: {stats[name]['documents']:,} prompts, {stats[name]['tokens']:,} "
            f"tokens (longest {stats[name]['longest']}, limit {limit})"
        )
    if not stats["train"]["documents"]:
        raise ValueError("No training prompts left: hold out fewer with --eval_examples.")
    return stats


def _dropped_text(stats: dict[str, Any]) -> str:
    causes: dict[str, int] = {}
    for split in ("train", "eval"):
        for cause, n in stats.get(split, {}).get("dropped", {}).items():
            causes[cause] = causes.get(cause, 0) + n
    if not causes:
        return "none dropped"
    total = sum(causes.values())
    shown = ", ".join(f"{n:,} {cause}" for cause, n in sorted(causes.items(), key=lambda x: -x[1]))
    return f"{total:,} dropped ({shown})"


def _drop_advice(stats: dict[str, Any]) -> str:
    text = _dropped_text(stats)
    if "longer than" in text or "after truncation" in text:
        return (
            "Raise --max_seq_length, or keep the start of long rows with --long_examples truncate."
        )
    return "Check the data's format (--data_format) and columns."


def _summary(stats: dict[str, Any]) -> list[str]:
    """The masked formats' account of the rows and tokens, for the start of the log."""
    if "format" not in stats or stats["format"] == PROMPT_FORMAT:
        return []
    splits = [stats[s] for s in ("train", "eval") if s in stats]
    read = sum(s["rows_read"] for s in splits)
    used = sum(s["documents"] for s in splits)
    trained = sum(s["trained_tokens"] for s in splits)
    tokens = sum(s["tokens"] for s in splits)
    truncated = sum(s["truncated"] for s in splits)
    lines = [
        f"data: rows: {read:,} read, {used:,} used, {_dropped_text(stats)}"
        + (
            f"; {truncated:,} truncated to --max_seq_length (their start kept)" if truncated else ""
        ),
        f"data: tokens: {trained:,} trained of {tokens:,} ({100 * trained / max(tokens, 1):.1f}%)"
        " - the answers and the token ending each, unless --train_on_prompt",
    ]
    if "chat_template" in stats:
        how = stats["answers_found_by"]
        eot = stats.get("end_of_turn")
        lines.append(
            f"data: chat: {stats['chat_template']}; answers found by {how}; "
            + (f"end-of-turn token {eot} trained" if eot else "end-of-turn token not checked")
        )
    merged = sum(s.get("prompt_merged", 0) for s in splits)
    if merged:
        lines.append(
            f"data: note: in {merged:,} rows the prompt's last token merges with the answer's "
            "first (a prompt ending in a space, say): the model will see another token when "
            "asked the prompt alone. End prompts with a newline, or without a trailing space."
        )
    return lines
