"""A training process's start-up without the cyclic garbage collector (fsdp_utils/startup.py):
off from chess_finetune.py's first line to the model on meta, on again before the data."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from fsdp_utils import startup


@pytest.fixture(autouse=True)
def _collector_as_it_was() -> Iterator[None]:
    """Whatever a test does, the pytest process's collector ends as it began."""
    enabled = gc.isenabled()
    yield
    startup._paused = False
    if enabled:
        gc.enable()
    else:
        gc.disable()


def test_pause_then_resume_freezes_what_the_start_built():
    assert gc.isenabled()
    startup.pause_collector()
    assert not gc.isenabled()
    frozen = gc.get_freeze_count()
    built = [[object()] for _ in range(1000)]  # what a start makes: tracked, long-lived
    startup.resume_collector()
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(built)
    gc.disable()  # a second resume is nothing: it does not turn the collector on again
    startup.resume_collector()
    assert not gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off():
    gc.disable()
    startup.pause_collector()
    startup.resume_collector()
    assert not gc.isenabled()


def test_every_way_out_of_the_command_turns_it_back_on(capsys):
    from fsdp_utils.cli import main

    startup.pause_collector()
    assert main(["--total_batch_size", "7", "--batch_size_per_device", "2"]) == 2
    assert "total_batch_size" in capsys.readouterr().err
    assert gc.isenabled()


def test_the_trainer_turns_it_on_after_the_model_on_meta_before_the_data(
    tiny_assets, tmp_path, monkeypatch
):
    from fsdp_utils.cli import main
    from fsdp_utils.trainer import trainer as trainer_module

    seen: dict[str, bool] = {}
    build_meta = trainer_module.RunModel.meta
    prepare = trainer_module.prepare_data

    def meta(self):  # type: ignore[no-untyped-def]
        seen["model on meta"] = gc.isenabled()
        return build_meta(self)

    def prepare_data(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen["data"] = gc.isenabled()
        return prepare(*args, **kwargs)

    monkeypatch.setattr(trainer_module.RunModel, "meta", meta)
    monkeypatch.setattr(trainer_module, "prepare_data", prepare_data)
    startup.pause_collector()  # as chess_finetune.py does
    code = main(
        ["--model", str(tiny_assets["model"]), "--dataset", str(tiny_assets["data"]),
         "--dataset_include", "", "--output_dir", str(tmp_path / "run"), "--device", "cpu",
         "--max_seq_length", "64", "--total_batch_size", "2", "--batch_size_per_device", "2",
         "--max_training_steps", "1", "--eval_batches", "1"]
    )  # fmt: skip
    assert code == 0
    assert seen == {"model on meta": False, "data": True}
    assert gc.isenabled()
