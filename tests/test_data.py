"""Data: render, tokenise, pack (cached), and the deterministic step sampler."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from fsdp_utils.config.batch import plan_batch
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.blocks import IGNORE_INDEX, StepSampler, TokenBlocks, eval_batches
from fsdp_utils.data.prepare import prepare_dataset
from fsdp_utils.data.render import render_game


def _config(tiny_assets, cache: Path, **kw) -> TrainConfig:
    base = dict(
        model=str(tiny_assets["model"]), dataset=str(tiny_assets["data"]), dataset_include="",
        data_cache_dir=str(cache), max_seq_length=64, eval_examples=20,
    )  # fmt: skip
    return TrainConfig(**{**base, **kw})


def test_render_template():
    text = render_game(["e2e4", "e7e5"], "CHECKMATE", "1-0")
    assert text == "[Result 1-0] [Termination CHECKMATE] e2e4 e7e5"
    assert render_game(["e2e4"], "X", "0-1", "{moves} => {result}") == "e2e4 => 0-1"


def test_packing_leaves_no_padding_but_in_the_last_block(tiny_assets, tmp_path):
    folder = prepare_dataset(_config(tiny_assets, tmp_path), log=lambda _: None)
    train = TokenBlocks.load(folder, "train")
    lengths = np.asarray(train.lengths)
    assert (lengths[:-1] == 64).all() and 0 < lengths[-1] <= 64
    meta = json.loads((folder / "meta.json").read_text())["stats"]
    eos = meta["eos_token_id"]
    # Documents are separated by EOS: one per training document in the stream.
    assert (
        int((np.asarray(train.input_ids)[lengths == 64] == eos).sum()) <= meta["train"]["documents"]
    )
    stream = np.concatenate([row[:n] for row, n in zip(train.input_ids, lengths, strict=False)])
    assert int((stream == eos).sum()) == meta["train"]["documents"]
    assert meta["train"]["padding_fraction"] < 64 / lengths.sum()


def test_no_packing_pads_every_document(tiny_assets, tmp_path):
    folder = prepare_dataset(_config(tiny_assets, tmp_path, no_packing=True), log=lambda _: None)
    train = TokenBlocks.load(folder, "train")
    meta = json.loads((folder / "meta.json").read_text())["stats"]["train"]
    assert len(train) == meta["documents"]  # one row per document
    batch = train.batch(np.arange(4))
    for row, labels, n in zip(batch["input_ids"], batch["labels"], train.lengths[:4], strict=True):
        assert (labels[n:] == IGNORE_INDEX).all() and (labels[:n] == row[:n]).all()


def test_prepared_data_is_cached_and_keyed(tiny_assets, tmp_path):
    messages: list[str] = []
    first = prepare_dataset(_config(tiny_assets, tmp_path), log=messages.append)
    again = prepare_dataset(_config(tiny_assets, tmp_path), log=messages.append)
    assert first == again and "using prepared data" in messages[-1]
    other = prepare_dataset(_config(tiny_assets, tmp_path, max_seq_length=32), log=messages.append)
    assert other != first  # a different setting is a different cache entry


def test_jsonl_text_dataset(tiny_assets, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"e2e4 e7e5 game {i}"}) for i in range(50)))
    folder = prepare_dataset(
        _config(tiny_assets, tmp_path / "cache", dataset=str(path), eval_examples=5),
        log=lambda _: None,
    )
    stats = json.loads((folder / "meta.json").read_text())["stats"]
    assert stats["train"]["documents"] == 45 and stats["eval"]["documents"] == 5


def test_unknown_schema_is_explained(tiny_assets, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(ValueError, match="`text` text column"):
        prepare_dataset(_config(tiny_assets, tmp_path / "c", dataset=str(path)), log=lambda _: None)


@pytest.mark.parametrize(("per_device", "world"), [(8, 1), (4, 2), (2, 2), (1, 4), (2, 8)])
def test_a_step_sees_the_same_sequences_whatever_the_split(per_device, world):
    config = TrainConfig(total_batch_size=16, batch_size_per_device=per_device)
    reference = StepSampler(
        100, plan_batch(TrainConfig(total_batch_size=16, batch_size_per_device=16), 1), seed=3
    )
    sampler = StepSampler(100, plan_batch(config, world), seed=3)
    for step in (0, 5, 6, 13):  # 6 steps per epoch: crosses into epochs 1 and 2
        seen = np.concatenate([b for r in range(world) for b in sampler.micro_batches(step, r)])
        assert sorted(seen) == sorted(reference.global_batch(step))
        assert len(set(seen)) == 16


def test_epochs_reshuffle_and_cover_the_data():
    sampler = StepSampler(64, plan_batch(TrainConfig(total_batch_size=16), 1), seed=0)
    epoch0 = np.concatenate([sampler.global_batch(s) for s in range(4)])
    epoch1 = np.concatenate([sampler.global_batch(s) for s in range(4, 8)])
    assert sorted(epoch0) == list(range(64)) == sorted(epoch1)
    assert not np.array_equal(epoch0, epoch1)


def test_too_little_data_for_one_batch():
    with pytest.raises(ValueError, match="fewer than one total batch"):
        StepSampler(10, plan_batch(TrainConfig(total_batch_size=16), 1), seed=0)


def test_eval_batches_are_equal_in_number_on_every_rank():
    counts = {len(eval_batches(21, 2, r, 4, max_batches=100)) for r in range(4)}
    assert counts == {3}


def test_tokenizer_roundtrip_of_rendered_game(tiny_assets):
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    text = render_game(["e2e4", "e7e5", "g1f3"], "CHECKMATE", "1-0")
    assert (
        tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True).split()
        == text.split()
    )


def test_held_out_games_come_from_the_files_training_uses(tmp_path):
    """Without --dataset_include, training uses every shard download_models.py fetched; the
    chess evaluation's held-out games must come from the same files, or the seed's shuffle
    differs and "held-out" games can be training games."""
    from fsdp_utils.config.train_config import DEFAULT_DATASET
    from fsdp_utils.data.prepare import dataset_files, held_out_games
    from fsdp_utils.synthetic import random_games, write_chess_shards
    from tests.test_download_units import fake_download

    shards = write_chess_shards(random_games(10, seed=3), tmp_path / "games", num_shards=2)
    cache = tmp_path / "hub"
    fake_download(cache, {p.name: p.read_bytes() for p in shards}, repo_id=DEFAULT_DATASET)
    config = TrainConfig(
        dataset=DEFAULT_DATASET,
        cache_dir=str(cache),
        data_cache_dir=str(tmp_path / "prepared"),
        eval_examples=1000,  # everything but one game is held out
    )
    assert [f.name for f in dataset_files(config)] == [p.name for p in shards]
    assert len(held_out_games(config)) == 10 - 1
