"""Data preparation: rows -> tokens (and loss masks) -> blocks, cached on disk.

Preparation (`prepare_dataset`) runs once per dataset/tokenizer/settings and is cached under a
key of everything that determines its result, so a rerun, another rank or a requeued job loads
it in milliseconds. It can also run on the login node (`download_models.py --prepare`).

1. source: the dataset's files (`fsdp_utils.data.files`) or a `--dataset_module`'s rows
   (`fsdp_utils.data.custom`); the format follows from the columns (`fsdp_utils.data.formats`)
   and the log says which and why;
2. split: rows are shuffled by seed; the first `eval_examples` are held out;
3. chess and text: rendered (`fsdp_utils.data.render`), tokenised with an EOS closing every
   document (`datasets.map`, multi-process), the stream cut into full blocks; `--no_packing`
   pads each document instead. Every token is trained.
4. chat, prompt/completion, alpaca, templates: each row becomes its tokens and a loss mask
   (`fsdp_utils.data.rows`: the answers only, unless --train_on_prompt), too-long rows and
   rows with nothing to train are dropped and counted, and whole rows are packed into blocks
   (`fsdp_utils.data.packing`).

Prepared layout, memory-mapped at training time (`fsdp_utils.data.blocks`), per split:
`input_ids` (blocks x max_seq_length int32) and `lengths` (valid tokens per block; the rest is
padding and carries no loss); the masked formats add `loss_mask` and `row_starts` (both
blocks x max_seq_length bool). `meta.json` holds the key's inputs (`spec`) and the counts the
start of the log prints (`stats`). The raw rows of the eval split are also what the chess
evaluation plays from (`held_out_games`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import TokenBlocks
from fsdp_utils.data.chat import ChatEncoder, ChatTemplate, chat_template, check_end_of_turn
from fsdp_utils.data.custom import ModuleRows, load_dataset_module
from fsdp_utils.data.files import load_files, peek_columns
from fsdp_utils.data.formats import FormatChoice, choose_format
from fsdp_utils.data.instruct import check_templates
from fsdp_utils.data.packing import pack_rows, pack_stream, pad_documents
from fsdp_utils.data.render import CHESS_COLUMNS, is_chess_schema, render_game
from fsdp_utils.data.rows import ROW_INDEX, RowEncoder, uses_messages
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
MASKED_VERSION = 1
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
        "max_seq_length": config.max_seq_length,
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
    if choice.masked:
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

    def split(self, name: str, *, document_masking: bool = False) -> TokenBlocks:
        """A split's blocks; with document masking their batches carry position ids that
        restart at every document (fsdp_utils.data.document_masking): after each EOS for
        chess and text, at the stored row starts for the masked formats. A padded (unpacked)
        row holds one document anyway, so it gets none."""
        packed = bool(self.meta["spec"].get("packing", True))
        restart = document_masking and packed
        if "masked" in self.meta["spec"]:
            return TokenBlocks.load(self.folder, name, row_starts=restart)
        eos = self.meta["stats"]["eos_token_id"] if restart else None
        return TokenBlocks.load(self.folder, name, document_eos=eos)

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

    def rows(self, config: TrainConfig) -> Any:
        if self.module is not None:
            return self.module.dataset
        return _load_raw(config, self.files)


def open_source(config: TrainConfig, assets: ResolvedAssets, log: Any) -> DataSource:
    if config.dataset_module is not None:
        module = load_dataset_module(config.dataset_module)
        log(f"data: {config.dataset_module}: {len(module.dataset):,} rows")
        return DataSource([], module, list(module.dataset.column_names))
    files = list(assets.dataset_files)
    log(f"data: {config.dataset}: {describe_dataset_files(files, config.dataset_include)}")
    return DataSource(files, None, peek_columns(files))


def prepare_dataset(
    config: TrainConfig, *, assets: ResolvedAssets | None = None, log: Any = print
) -> Path:
    """Render, tokenise and pack the dataset (`--dataset`, or `--dataset_module`'s rows) for
    `config.model`'s tokenizer; return the cache folder (reused when it already exists).
    `assets`: the run's resolved files (else resolved here, as on the login node's
    `download_models.py --prepare`)."""
    assets = assets or resolve_assets(config)
    model_dir = assets.model_dir
    source = open_source(config, assets, log)
    choice = choose_format(source.columns, config)
    log(f"data: format {choice.name} ({choice.reason})")
    tokenizer = template = None
    if choice.masked:
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
        raw = source.rows(config)
        if choice.masked:
            stats = _build_rows(config, raw, choice, tokenizer, template, tmp, log)
            _write_export_files(config, model_dir, template, stats, tmp / TOKENIZER_SUBDIR)
        else:
            stats = _build(config, raw, choice, model_dir, tmp, log)
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
    if choice.name == "prompt_completion" and tokenizer.chat_template:
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
        if s:
            parts.append(
                f"{split} {s['documents']:,} docs, {s['tokens']:,} tokens, {s['blocks']:,} blocks "
                f"({100 * s['padding_fraction']:.2f}% padding)"
            )
    return "; ".join(parts)


def _load_raw(config: TrainConfig, files: list[Path]) -> Any:
    """The dataset files as one `datasets.Dataset`, columns as stored."""
    return load_files(files, default_data_cache_dir(config) / "raw")


def _load_documents(config: TrainConfig, raw: Any, *, chess: bool) -> Any:
    """A `datasets.Dataset` with one `text` column (chess games rendered)."""
    columns = raw.column_names
    if chess:
        template = config.template

        def render(batch: dict[str, list[Any]]) -> dict[str, list[str]]:
            return {
                "text": [
                    render_game(m, t, r, template)
                    for m, t, r in zip(
                        batch["Moves"], batch["Termination"], batch["Result"], strict=False
                    )
                ]
            }

        return raw.map(render, batched=True, remove_columns=columns, num_proc=1)
    texts = raw.select_columns([config.text_field])
    return texts if config.text_field == "text" else texts.rename_column(config.text_field, "text")


def _split(config: TrainConfig, docs: Any) -> dict[str, Any]:
    """Shuffle by seed, cap at max_examples, hold out the first eval_examples. The order
    depends only on the number of documents and the seed, so raw rows and their rendered
    texts split the same way (the chess evaluation reads the raw held-out games)."""
    docs = docs.shuffle(seed=config.seed)
    if config.max_examples is not None:
        docs = docs.select(range(min(config.max_examples, len(docs))))
    n_eval = min(config.eval_examples, max(len(docs) - 1, 0))
    return {"eval": docs.select(range(n_eval)), "train": docs.select(range(n_eval, len(docs)))}


def _training_split(config: TrainConfig, docs: Any) -> dict[str, Any]:
    """`_split` for a training run, which must keep at least as much to train on as it
    evaluates. The default (200) suits the chess games and most published sets; on a small set
    it would leave a handful of rows to train on, and the run would fail later with a message
    about blocks. (The chess evaluation's `held_out_games` may hold out nearly everything.)"""
    splits = _split(config, docs)
    n_eval, n_train = len(splits["eval"]), len(splits["train"])
    if n_eval > n_train:
        raise ValueError(
            f"--eval_examples {config.eval_examples} would hold out {n_eval:,} of the "
            f"{n_eval + n_train:,} documents for evaluation, leaving {n_train:,} to train on. "
            f"Hold out fewer, e.g. a tenth: --eval_examples {(n_eval + n_train) // 10} (0: no "
            "eval split)."
        )
    return splits


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
    raw = _load_raw(config, list(files) if files is not None else dataset_files(config))
    if not is_chess_schema(raw.column_names):
        raise ValueError(
            f"The chess evaluation needs chess games, but the dataset {config.dataset} has "
            f"columns {raw.column_names}, not the laion/strategic_game_chess schema (Moves, "
            "Termination, Result). Evaluate on a chess dataset (--dataset "
            "laion/strategic_game_chess, or a folder of parquet files in that schema), or "
            "leave --chess_eval_every at 0 for text data."
        )
    eval_split = _split(config, raw.select_columns(list(CHESS_COLUMNS)))["eval"]
    if limit is not None:
        eval_split = eval_split.select(range(min(limit, len(eval_split))))
    return list(eval_split)


def _num_proc(config: TrainConfig, num_docs: int) -> int:
    if config.num_proc is not None:
        return max(1, config.num_proc)
    # Worker start-up costs seconds: not worth it for small datasets.
    return 1 if num_docs < 20_000 else min(8, os.cpu_count() or 1)


def _quiet_progress() -> None:
    import datasets

    if not sys.stderr.isatty():  # progress bars are noise in a Slurm log; we log a summary
        datasets.disable_progress_bars()


def _build(
    config: TrainConfig, raw: Any, choice: FormatChoice, model_dir: Path, out: Path, log: Any
) -> dict[str, Any]:
    """Chess and text: documents -> one token stream -> full blocks."""
    from transformers import AutoTokenizer

    _quiet_progress()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"The tokenizer in {model_dir} has no EOS token to separate documents.")
    eos = int(tokenizer.eos_token_id)
    pad = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else eos

    docs = _load_documents(config, raw, chess=choice.name == "chess")
    num_proc = _num_proc(config, len(docs))
    splits = _training_split(config, docs)

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        ids = tokenizer(batch["text"], add_special_tokens=True)["input_ids"]
        return {"input_ids": [x if x and x[-1] == eos else [*x, eos] for x in ids]}

    stats: dict[str, Any] = {"eos_token_id": eos, "pad_token_id": pad}
    for name, split in splits.items():
        if len(split) == 0:
            continue
        tokenized = split.map(
            tokenize, batched=True, remove_columns=["text"], num_proc=num_proc,
            desc=f"tokenising {name}",
        )  # fmt: skip
        column = tokenized.data.column("input_ids").combine_chunks()
        flat = column.values.to_numpy().astype(np.int32)
        offsets = column.offsets.to_numpy()
        if config.no_packing:
            input_ids, lengths = pad_documents(flat, offsets, config.max_seq_length, pad)
        else:
            input_ids, lengths = pack_stream(flat, config.max_seq_length, pad)
        np.save(out / f"{name}_input_ids.npy", input_ids)
        np.save(out / f"{name}_lengths.npy", lengths)
        total_slots = input_ids.size
        stats[name] = {
            "documents": len(split),
            "tokens": int(lengths.sum()),
            "blocks": len(lengths),
            "padding_fraction": float(1 - lengths.sum() / total_slots) if total_slots else 0.0,
            "truncated_documents": int(np.sum(np.diff(offsets) > config.max_seq_length))
            if config.no_packing
            else 0,
        }
        log(f"data: {name}: {_describe({name: stats[name]})}")
    if "train" not in stats:
        raise ValueError("No training documents left after holding out the eval split.")
    return stats


# --- masked formats: rows with loss masks ---------------------------------------------------


def _build_rows(
    config: TrainConfig,
    raw: Any,
    choice: FormatChoice,
    tokenizer: Any,
    template: ChatTemplate | None,
    out: Path,
    log: Any,
) -> dict[str, Any]:
    """Chat, prompt/completion, alpaca, templates: rows -> (tokens, loss mask) -> whole rows
    packed into blocks. Writes input_ids, lengths, loss_mask, row_starts per split."""
    import datasets
    import pyarrow.compute as pc

    _quiet_progress()
    if len(raw) == 0:
        raise ValueError("The dataset has no rows.")
    raw = raw.add_column(ROW_INDEX, np.arange(len(raw), dtype=np.int64))
    if choice.name == "templates":
        assert config.prompt_template is not None and config.response_template is not None
        check_templates(config.prompt_template, config.response_template, raw.column_names)
    first = raw[:64]
    if choice.name == "prompt_completion" and uses_messages(first) and template is None:
        # Message lists, and the model has no chat template: the error names --chat_template.
        template = chat_template(tokenizer, template_file=None, model=config.model)
    encoder = RowEncoder(
        choice.name,
        tokenizer,
        config.max_seq_length,
        config.long_examples,
        train_on_prompt=config.train_on_prompt,
        template=template,
        prompt_template=config.prompt_template,
        response_template=config.response_template,
    )
    conversations = encoder.conversations(first)
    stats: dict[str, Any] = {"format": choice.name, "format_reason": choice.reason}
    if conversations is not None:
        assert template is not None
        stats["chat_template"] = template.source
        stats["generation_markers"] = template.has_generation_markers
        chat = ChatEncoder(tokenizer, template, train_on_prompt=config.train_on_prompt)
        end_of_turn = check_end_of_turn(chat, conversations)
        if end_of_turn is not None:
            stats["end_of_turn"] = end_of_turn.token
            stats["end_of_turn_id"] = end_of_turn.id if end_of_turn.special else None
    eos = int(tokenizer.eos_token_id)
    pad = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else eos
    stats.update({"eos_token_id": eos, "pad_token_id": pad})
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("bool")),
            "dropped": datasets.Value("string"),
            "truncated": datasets.Value("bool"),
            "merged": datasets.Value("bool"),
        }
    )
    num_proc = _num_proc(config, len(raw))
    for name, split in _training_split(config, raw).items():
        if len(split) == 0:
            continue
        encoded = split.map(
            encoder, batched=True, batch_size=256, remove_columns=split.column_names,
            features=features, num_proc=num_proc, desc=f"encoding {name}",
        )  # fmt: skip
        table = encoded.data.table
        dropped = table.column("dropped")
        kept = table.filter(pc.equal(dropped, ""))
        ids_column = kept.column("input_ids").combine_chunks()
        mask_column = kept.column("loss_mask").combine_chunks()
        offsets = ids_column.offsets.to_numpy().astype(np.int64)
        offsets -= offsets[0]
        packed = pack_rows(
            ids_column.values.to_numpy(),
            mask_column.values.to_numpy(zero_copy_only=False),
            offsets,
            config.max_seq_length,
            pad,
            packing=not config.no_packing,
        )
        np.save(out / f"{name}_input_ids.npy", packed.input_ids)
        np.save(out / f"{name}_lengths.npy", packed.lengths)
        np.save(out / f"{name}_loss_mask.npy", packed.loss_mask)
        np.save(out / f"{name}_row_starts.npy", packed.row_starts)
        causes = pc.value_counts(dropped).to_pylist()
        slots = packed.input_ids.size
        stats[name] = {
            "rows_read": len(split),
            "documents": kept.num_rows,
            "dropped": {c["values"]: c["counts"] for c in causes if c["values"]},
            "truncated": int(pc.sum(kept.column("truncated")).as_py() or 0),
            "prompt_merged": int(pc.sum(table.column("merged")).as_py() or 0),
            "tokens": int(packed.lengths.sum()),
            "trained_tokens": int(packed.loss_mask.sum()),
            "blocks": len(packed.lengths),
            "padding_fraction": float(1 - packed.lengths.sum() / slots) if slots else 0.0,
        }
        log(f"data: {name}: {_describe({name: stats[name]})}")
    if not stats.get("train", {}).get("blocks"):
        read = sum(stats[s]["rows_read"] for s in ("train", "eval") if s in stats)
        raise ValueError(
            f"No training rows left: {read:,} rows read, {_dropped_text(stats)}. "
            + _drop_advice(stats)
        )
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
    if "format" not in stats:
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
        how = (
            "{% generation %} markers"
            if stats["generation_markers"]
            else "rendering each conversation's prefixes"
        )
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
