"""Data preparation: render -> tokenise -> pack, cached on disk.

Preparation (`prepare_dataset`) runs once per dataset/tokenizer/settings and is cached under a
key of everything that determines its result, so a rerun, another rank or a requeued job loads
it in milliseconds. It can also run on the login node (`download_models.py --prepare`).

1. render: chess rows (`Moves`, `Termination`, `Result`) become text through the template
   (`fsdp_utils.data.render`); jsonl rows use their `text` field;
2. split: documents are shuffled by seed; the first `eval_examples` are held out;
3. tokenise: `datasets.map` (batched, multi-process), an EOS closing every document;
4. pack: the token stream is cut into full blocks of `max_seq_length` (documents separated by
   EOS, no padding but in the very last block); `--no_packing` pads each document instead.

The result is two int32 arrays per split, memory-mapped at training time
(`fsdp_utils.data.blocks`): `input_ids` (blocks x max_seq_length) and `lengths` (valid tokens
per block; positions past it are padding and carry no loss). The raw rows of the eval split are
also what the chess evaluation plays from (`held_out_games`).
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
from fsdp_utils.data.render import CHESS_COLUMNS, is_chess_schema, render_game
from fsdp_utils.hub.resolve import (
    ResolvedAssets,
    describe_dataset_files,
    resolve_assets,
    resolve_dataset_files,
)

FORMAT_VERSION = 1  # bump when the prepared layout or the preparation logic changes


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


def preparation_spec(config: TrainConfig, files: list[Path], model_dir: Path) -> dict[str, Any]:
    """Everything that determines the prepared data, and nothing else."""
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
    }


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
        restart at every document (fsdp_utils.data.document_masking). A padded (unpacked) row
        holds one document anyway, so it gets none."""
        packed = bool(self.meta["spec"].get("packing", True))
        eos = self.meta["stats"]["eos_token_id"] if document_masking and packed else None
        return TokenBlocks.load(self.folder, name, document_eos=eos)


def dataset_files(config: TrainConfig) -> list[Path]:
    """The data files of the run: training data and the held-out games come from the same
    ones (without --dataset_include, those download_models.py fetched: assets.py)."""
    return resolve_dataset_files(
        config.dataset, config.dataset_include, config.dataset_revision, config.cache_dir
    )


def prepare_dataset(
    config: TrainConfig, *, assets: ResolvedAssets | None = None, log: Any = print
) -> Path:
    """Render, tokenise and pack `config.dataset` for `config.model`'s tokenizer; return the
    cache folder (reused when it already exists). `assets`: the run's resolved files (else
    resolved here, as on the login node's `download_models.py --prepare`)."""
    assets = assets or resolve_assets(config)
    files, model_dir = list(assets.dataset_files), assets.model_dir
    log(f"data: {config.dataset}: {describe_dataset_files(files, config.dataset_include)}")
    spec = preparation_spec(config, files, model_dir)
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]
    folder = default_data_cache_dir(config) / key
    if (folder / "meta.json").is_file():
        stats = json.loads((folder / "meta.json").read_text()).get("stats", {})
        log(f"data: using prepared data in {folder}: {_describe(stats)}")
        return folder

    started = time.perf_counter()
    log(f"data: preparing {len(files)} file(s) -> {folder}")
    tmp = folder.with_name(f"{key}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        stats = _build(config, files, model_dir, tmp, log)
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
    return folder


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
    import datasets

    suffixes = {f.suffix for f in files}
    if len(suffixes) > 1:
        raise ValueError(
            f"Mixed data file types {sorted(suffixes)}: use parquet or jsonl, not both."
        )
    builder = "parquet" if ".parquet" in suffixes else "json"
    cache = str(default_data_cache_dir(config) / "raw")
    return datasets.load_dataset(
        builder, data_files=[str(f) for f in files], split="train", cache_dir=cache
    )


def _load_documents(config: TrainConfig, files: list[Path], num_proc: int) -> Any:
    """A `datasets.Dataset` with one `text` column."""
    raw = _load_raw(config, files)
    columns = raw.column_names
    if is_chess_schema(columns):
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

        return raw.map(render, batched=True, remove_columns=columns, num_proc=num_proc)
    if config.text_field in columns:
        texts = raw.select_columns([config.text_field])
        return (
            texts if config.text_field == "text" else texts.rename_column(config.text_field, "text")
        )
    raise ValueError(
        f"The dataset has columns {columns}: expected the laion/strategic_game_chess schema "
        f"(Moves, Termination, Result) or a `{config.text_field}` text column "
        "(set --text_field for another name)."
    )


def _split(config: TrainConfig, docs: Any) -> dict[str, Any]:
    """Shuffle by seed, cap at max_examples, hold out the first eval_examples. The order
    depends only on the number of documents and the seed, so raw rows and their rendered
    texts split the same way (the chess evaluation reads the raw held-out games)."""
    docs = docs.shuffle(seed=config.seed)
    if config.max_examples is not None:
        docs = docs.select(range(min(config.max_examples, len(docs))))
    n_eval = min(config.eval_examples, max(len(docs) - 1, 0))
    return {"eval": docs.select(range(n_eval)), "train": docs.select(range(n_eval, len(docs)))}


def held_out_games(
    config: TrainConfig, limit: int | None = None, *, files: Sequence[Path] | None = None
) -> list[dict[str, Any]]:
    """The raw rows (`Moves`, `Termination`, `Result`) of the eval split, in split order:
    the games whose rendered text is the held-out data. `files`: the run's data files, as
    resolved once (`ResolvedAssets.dataset_files`; else resolved here). A dataset that is not
    chess is a ValueError saying so."""
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


def _build(
    config: TrainConfig, files: list[Path], model_dir: Path, out: Path, log: Any
) -> dict[str, Any]:
    import datasets
    from transformers import AutoTokenizer

    if not sys.stderr.isatty():  # progress bars are noise in a Slurm log; we log a summary
        datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"The tokenizer in {model_dir} has no EOS token to separate documents.")
    eos = int(tokenizer.eos_token_id)
    pad = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else eos

    docs = _load_documents(config, files, num_proc=1)
    num_proc = _num_proc(config, len(docs))
    splits = _split(config, docs)

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
            input_ids, lengths = _pad_documents(flat, offsets, config.max_seq_length, pad)
        else:
            input_ids, lengths = _pack(flat, config.max_seq_length, pad)
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


def _pack(flat: np.ndarray, block: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut the token stream into full blocks; only the final block may be partial (padded)."""
    n_blocks = -(-len(flat) // block)
    padded = np.full(n_blocks * block, pad, dtype=np.int32)
    padded[: len(flat)] = flat
    lengths = np.full(n_blocks, block, dtype=np.int32)
    if n_blocks:
        lengths[-1] = len(flat) - (n_blocks - 1) * block
    return padded.reshape(n_blocks, block), lengths


def _pad_documents(
    flat: np.ndarray, offsets: np.ndarray, block: int, pad: int
) -> tuple[np.ndarray, np.ndarray]:
    """One document per row, truncated to `block` tokens and right-padded (the seed's way)."""
    n_docs = len(offsets) - 1
    out = np.full((n_docs, block), pad, dtype=np.int32)
    lengths = np.minimum(np.diff(offsets), block).astype(np.int32)
    for i in range(n_docs):
        out[i, : lengths[i]] = flat[offsets[i] : offsets[i] + lengths[i]]
    return out, lengths
