"""Preparation at any size: bad rows explained, and the waiting ranks never time out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fsdp_utils.cli import main as finetune_main
from fsdp_utils.config.parse import parse_config
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data import prepare, token_files
from fsdp_utils.data.chat import chat_template
from fsdp_utils.data.cli import main as data_main
from fsdp_utils.data.packing import pack_rows, pack_stream, pad_documents
from fsdp_utils.data.prepare import (
    SLOW_IN_JOB_S,
    prepare_dataset,
    slow_preparation_advice,
    split_rows,
)
from fsdp_utils.data.rows import ROW_INDEX, RowEncoder
from fsdp_utils.data.workers import PreparationStopped, tokenised
from fsdp_utils.synthetic import random_conversations, save_chat_model, train_chat_tokenizer
from tests.chat_helpers import write_jsonl
from tests.train_helpers import check_ok, read_metrics, run_finetune, tiny_args


def _write_rows(path: Path, count: int, *, bad_line: int | None = None) -> Path:
    lines = [json.dumps({"text": f"1.e4 e5 2.Nf3 Nc6 game {i}"}) for i in range(count)]
    if bad_line is not None:
        lines[bad_line - 1] = lines[bad_line - 1][:-7]  # a truncated write
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_malformed_json_line_names_the_file_and_line(tiny_assets, tmp_path, capsys):
    data = _write_rows(tmp_path / "rows.jsonl", 300, bad_line=123)
    config = TrainConfig(
        model=str(tiny_assets["model"]), dataset=str(data), data_cache_dir=str(tmp_path / "c"),
        max_seq_length=64, eval_examples=10,
    )  # fmt: skip
    with pytest.raises(ValueError, match=rf"{data}:123: not a valid JSON line"):
        prepare_dataset(config, log=lambda _: None)
    # The training command: one paragraph, exit 2, no traceback.
    args = tiny_args(tiny_assets, tmp_path / "run", tmp_path / "c", dataset=data, eval_examples=10)
    assert finetune_main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert f"error: {data}:123: not a valid JSON line" in err
    assert "Traceback" not in err and "DatasetGenerationError" not in err


@pytest.mark.slow
def test_preparing_longer_than_the_collective_timeout_still_trains(tiny_assets, tmp_path):
    """Rank 0 prepares while rank 1 waits: on the process group's store, not in a collective
    that --collective_timeout_minutes would end (gloo's timeout traceback, then torchrun's).
    The rows' function takes longer than the timeout whatever the machine's speed."""
    module = tmp_path / "slow_rows.py"
    module.write_text(
        "import time\n\n\ndef rows():\n"
        "    time.sleep(8)  # longer than the 6 s collective timeout below\n"
        "    return [{'text': f'1.e4 e5 2.Nf3 Nc6 3.Bb5 a6 game {i}'} for i in range(200)]\n"
    )
    args = tiny_args(
        tiny_assets, tmp_path / "run", tmp_path / "cache", dataset=None,
        dataset_module=f"{module}:rows", collective_timeout_minutes=0.1, max_training_steps=2,
        eval_examples=10,
    )  # fmt: skip
    result = run_finetune(2, [str(a) for a in args])
    check_ok(result)
    assert "data: preparing" in result.stdout + result.stderr
    assert "done in" in result.stdout
    assert "Timed out" not in result.stderr and "Traceback" not in result.stderr


def test_the_tokenising_stops_between_batches_never_after_the_last():
    """A stopped preparation keeps nothing, so a stop that comes with the last batch (what is
    left is quick) lets it finish."""
    batches = [{"text": ["a"] * 4}, {"text": ["b"] * 4}, {"text": ["c"] * 2}]
    asked = []

    def stop() -> str:
        asked.append(len(asked))
        return "time limit"

    def run(parts: list[dict[str, list[str]]]) -> list[int]:
        total = sum(len(p["text"]) for p in parts)
        work = tokenised(lambda b: len(b["text"]), iter(parts), num_proc=1, total=total,
                         log=print, stop=stop)  # fmt: skip
        return list(work)

    with pytest.raises(PreparationStopped, match=r"time limit \(tokenised 4 of 10 rows\)"):
        run(batches)
    assert asked == [0]
    assert run(batches[2:]) == [2] and asked == [0]  # one batch: the last, never asked


@pytest.mark.slow
def test_a_stop_during_the_preparation_ends_the_leg_and_the_next_prepares(tiny_assets, tmp_path):
    """The time limit's stop file appears while rank 0 prepares (the rows' function writes it,
    in the first leg only, whatever the machine's speed): both ranks end the leg before the
    first step, "interrupted" (the sbatch script requeues such a leg), with the stop file
    consumed and nothing half-prepared in the cache; the same command then prepares and trains."""
    module = tmp_path / "rows_then_time_limit.py"
    module.write_text(
        "import os\nfrom pathlib import Path\n\n\ndef rows():\n"
        "    first_leg = Path(os.environ['FIRST_LEG_DONE'])\n"
        "    if not first_leg.exists():\n"
        "        first_leg.touch()\n"
        "        Path(os.environ['STOP_FILE_TO_WRITE']).touch()\n"
        "    return [{'text': f'1.e4 e5 2.Nf3 Nc6 3.Bb5 a6 game {i}'} for i in range(COUNT)]\n"
        f"\n\nCOUNT = {2 * prepare.ROWS_PER_BATCH + 1}  # three batches\n"
    )
    run, cache = tmp_path / "run", tmp_path / "cache"
    args = tiny_args(
        tiny_assets, run, cache, dataset=None, dataset_module=f"{module}:rows",
        max_training_steps=2, eval_examples=10,
    )  # fmt: skip
    env = {"FIRST_LEG_DONE": str(tmp_path / "first"), "STOP_FILE_TO_WRITE": str(run / "STOP")}
    first = run_finetune(2, [str(a) for a in args], env=env)
    check_ok(first)
    batch = prepare.ROWS_PER_BATCH
    assert (
        f"data: preparation stopped (stop file) when it had tokenised {batch:,} of "
        f"{2 * batch + 1:,} rows" in first.stdout
    )
    assert "stopping before the first step: stop file during the data preparation" in first.stdout
    status = json.loads((run / "status.json").read_text())
    assert (status["status"], status["reason"], status["step"]) == ("interrupted", "stop file", 0)
    assert not (run / "STOP").exists() and not list(cache.glob("*/meta.json"))
    assert not read_metrics(run)
    second = run_finetune(2, [str(a) for a in args], env=env)
    check_ok(second)
    assert "data: preparing" in second.stdout and "done in" in second.stdout
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert json.loads((run / "status.json").read_text())["status"] == "completed"


def test_a_slow_preparation_in_the_job_says_how_to_prepare_before_it():
    assert slow_preparation_advice(SLOW_IN_JOB_S - 1, 8) is None
    advice = slow_preparation_advice(600, 8)
    assert advice is not None and "10.0 min inside the job while 7 other process(es)" in advice
    assert "download_models.py --config" in advice and "--prepare" in advice
    assert "sbatch slurm/prepare.sh" in advice


def test_the_data_command_prepares_what_the_training_run_finds(tiny_assets, tmp_path, capsys):
    """`python -m fsdp_utils.data` (slurm/prepare.sh's command): the same key as training."""
    cache = tmp_path / "cache"
    options = ["--model", str(tiny_assets["model"]), "--dataset", str(tiny_assets["data"])]
    options += ["--dataset_include", "", "--data_cache_dir", str(cache), "--max_seq_length", "64"]
    assert data_main([*options, "--num_proc", "1"]) == 0
    assert "prepared in" in capsys.readouterr().out
    config, _ = parse_config(options)
    lines: list[str] = []
    prepare_dataset(config, log=lines.append)
    assert any(line.startswith("data: using prepared data") for line in lines), lines
    assert data_main([*options, "--max_seq_length", "0"]) == 2
    assert "error: " in capsys.readouterr().err


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return save_chat_model(
        tmp_path_factory.mktemp("chat_model"), "chatml", base=train_chat_tokenizer()
    )


def _arrays(folder: Path) -> dict[str, np.ndarray]:
    return {p.stem: np.load(p) for p in sorted(folder.glob("*.npy"))}


def test_streamed_batches_and_processes_give_the_blocks_the_in_memory_packers_give(
    tmp_path, chat_model, monkeypatch
):
    """Preparation read in small batches, by one process or two, spilled and written a few
    blocks at a time, gives the arrays `pack_rows` gives over the whole split at once (rows in
    split order, best-fit decreasing), and leaves nothing but them: no spill files, no copy of
    the raw rows."""
    monkeypatch.setattr(prepare, "ROWS_PER_BATCH", 37)
    monkeypatch.setattr(token_files, "BLOCKS_PER_WRITE", 5)
    chats = [{"messages": c} for c in random_conversations(300, seed=1, turns=(1, 3))]
    chats[7] = {"messages": [{"role": "user", "content": "no answer"}]}  # dropped, counted
    data = write_jsonl(tmp_path / "chat.jsonl", chats)
    config = TrainConfig(
        model=str(chat_model), dataset=str(data), max_seq_length=256, eval_examples=20,
    )  # fmt: skip
    one = prepare_dataset(config.replace(data_cache_dir=str(tmp_path / "a"), num_proc=1), log=print)
    two = prepare_dataset(config.replace(data_cache_dir=str(tmp_path / "b"), num_proc=2), log=print)
    arrays = _arrays(one)
    assert arrays.keys() == _arrays(two).keys()
    for name, values in _arrays(two).items():
        np.testing.assert_array_equal(values, arrays[name], err_msg=name)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [one.name]  # no raw copy
    assert not list(one.glob("spill*"))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    encoder = RowEncoder(
        "chat",
        tokenizer,
        256,
        "drop",
        template=chat_template(tokenizer, template_file=None, model=str(chat_model)),
    )
    split = split_rows(config, len(chats))["train"]
    batch = {"messages": [chats[i]["messages"] for i in split], ROW_INDEX: [int(i) for i in split]}
    encoded = encoder(batch)
    kept = [i for i, d in enumerate(encoded["dropped"]) if not d]
    assert len(kept) == len(split) - (7 in split)
    ids = [encoded["input_ids"][i] for i in kept]
    masks = [encoded["loss_mask"][i] for i in kept]
    offsets = np.cumsum([0, *map(len, ids)])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    expected = pack_rows(
        np.concatenate(ids), np.concatenate(masks), offsets, 256, pad, packing=True
    )
    np.testing.assert_array_equal(arrays["train_input_ids"], expected.input_ids)
    np.testing.assert_array_equal(arrays["train_loss_mask"], expected.loss_mask)
    np.testing.assert_array_equal(arrays["train_row_starts"], expected.row_starts)
    np.testing.assert_array_equal(arrays["train_lengths"], expected.lengths)


def test_streamed_text_is_the_split_order_stream_cut_into_blocks(
    tmp_path, tiny_assets, monkeypatch
):
    monkeypatch.setattr(prepare, "ROWS_PER_BATCH", 29)
    monkeypatch.setattr(token_files, "BLOCKS_PER_WRITE", 3)
    data = _write_rows(tmp_path / "rows.jsonl", 250)
    config = TrainConfig(
        model=str(tiny_assets["model"]), dataset=str(data), data_cache_dir=str(tmp_path / "c"),
        max_seq_length=64, eval_examples=10, num_proc=2,
    )  # fmt: skip
    arrays = _arrays(prepare_dataset(config, log=lambda _: None))
    padded = _arrays(prepare_dataset(config.replace(no_packing=True), log=lambda _: None))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    for name, order in split_rows(config, len(texts)).items():
        docs = [tokenizer(texts[i])["input_ids"] for i in order]
        docs = [d if d and d[-1] == eos else [*d, eos] for d in docs]
        ids, lengths = pack_stream(np.concatenate(docs).astype(np.int32), 64, pad)
        np.testing.assert_array_equal(arrays[f"{name}_input_ids"], ids)
        np.testing.assert_array_equal(arrays[f"{name}_lengths"], lengths)
        offsets = np.cumsum([0, *map(len, docs)])
        ids, lengths = pad_documents(np.concatenate(docs).astype(np.int32), offsets, 64, pad)
        np.testing.assert_array_equal(padded[f"{name}_input_ids"], ids)
        np.testing.assert_array_equal(padded[f"{name}_lengths"], lengths)
