"""Checkpoints: atomic saves, exact resume (also on another world size), faults that must never
cost the previous checkpoint. (Stopping for the time limit, a signal or a stop file:
test_timelimit.py; the storage check against real saves: test_storage.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdp_utils.checkpoint.sharded import (
    MARKER,
    Checkpointer,
    CheckpointError,
    list_checkpoints,
    read_checkpoint,
)
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.synthetic import save_tiny_model
from tests.train_helpers import (
    BackgroundFinetune,
    check_ok,
    read_metrics,
    run_finetune,
    run_module,
    tiny_args,
    worker_pids,
)

# --- units (no training) -------------------------------------------------------------------


def _fake_checkpoint(root: Path, step: int, complete: bool = True, identity=None) -> Path:
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x" * 100)
    if complete:
        meta = {"step": step, "identity": identity or {}, "files": {"__0_0.distcp": 100}}
        (path / MARKER).write_text(json.dumps(meta))
    return path


def test_partial_and_tmp_folders_are_never_picked(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 4, complete=False)  # the job died while writing it
    (tmp_path / "step_00000006.tmp").mkdir()
    assert [c.step for c in list_checkpoints(tmp_path)] == [2]
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        read_checkpoint(tmp_path / "step_00000004")


def test_truncated_file_is_reported(tmp_path):
    path = _fake_checkpoint(tmp_path, 2)
    (path / "__0_0.distcp").write_bytes(b"x" * 10)
    with pytest.raises(CheckpointError, match="has 10 bytes instead of 100"):
        read_checkpoint(path)


def test_resume_auto_skips_a_damaged_newest_and_keeps_it(tmp_path):
    config = TrainConfig(resume="auto")
    _fake_checkpoint(tmp_path, 2)
    damaged = _fake_checkpoint(tmp_path, 4)
    (damaged / "__0_0.distcp").unlink()
    warnings: list[str] = []
    info = Checkpointer(tmp_path, config, {}, True, torch.device("cpu")).to_resume(warnings.append)
    assert info is not None and info.step == 2
    assert "skipping" in warnings[0] and "missing" in warnings[0]
    assert damaged.exists()  # reported, never deleted


def test_checkpoint_of_another_run_is_refused(tmp_path):
    _fake_checkpoint(tmp_path, 2, identity={"model": "a", "max_seq_length": 64})
    checkpointer = Checkpointer(
        tmp_path, TrainConfig(), {"model": "a", "max_seq_length": 128}, True, torch.device("cpu")
    )
    with pytest.raises(CheckpointError, match="max_seq_length: checkpoint 64, now 128"):
        checkpointer.to_resume()


def test_stale_tmp_of_a_crashed_save_is_cleaned(tmp_path):
    (tmp_path / "step_00000008.tmp").mkdir()
    Checkpointer(tmp_path, TrainConfig(), {}, True, torch.device("cpu"))
    assert not (tmp_path / "step_00000008.tmp").exists()


# --- real runs -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


def _ckpt_args(assets, out, cache, **overrides):
    base = {"max_training_steps": 8, "save_every_steps": 3, "keep_last": 2}
    return tiny_args(assets, out, cache, **{**base, **overrides})


def _status(out: Path) -> dict:
    return json.loads((out / "status.json").read_text())


@pytest.mark.slow
def test_exact_resume_also_on_another_world_size(tmp_path, tiny_assets, data_cache):
    """Uninterrupted (2 processes) == stopped at 3 and 6 and resumed on 2, then on 1 process."""
    straight = tmp_path / "straight"
    check_ok(run_finetune(2, _ckpt_args(tiny_assets, straight, data_cache)))

    split = tmp_path / "split"
    check_ok(run_finetune(2, _ckpt_args(tiny_assets, split, data_cache, stop_after_steps=3)))
    assert _status(split) == {**_status(split), "status": "interrupted", "step": 3}
    check_ok(run_finetune(2, _ckpt_args(tiny_assets, split, data_cache, stop_after_steps=3)))
    assert _status(split)["step"] == 6
    # The last leg's step budget ends at the last step: it finishes (final eval and model)
    # instead of stopping for a leg that would do only that.
    last_leg = _ckpt_args(
        tiny_assets, split, data_cache, batch_size_per_device=4, stop_after_steps=2
    )
    result = run_finetune(1, last_leg)
    check_ok(result)
    assert "resumed from step 6" in result.stdout and _status(split)["status"] == "completed"
    assert "finishing in this job instead of requeueing (stop at step 8" in result.stdout

    a, b = read_metrics(straight), read_metrics(split)
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [r["batch_id"] for r in a] == [r["batch_id"] for r in b]  # same data, same order
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5, abs=1e-6)
    events = [
        r["kind"] for r in map(json.loads, (split / "metrics.jsonl").read_text().splitlines())
    ]
    assert events.count("resumed") == 2 and events.count("stopping") == 2

    # The export of the last checkpoint is the model written at the end of training.
    exported = tmp_path / "exported"
    check_ok(
        run_module("fsdp_utils.export", str(split / "checkpoints" / "step_00000008"), str(exported))
    )
    final = AutoModelForCausalLM.from_pretrained(split / "final").state_dict()
    reloaded = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert final.keys() == reloaded.keys()
    assert all(torch.equal(final[k], reloaded[k]) for k in final)
    assert AutoTokenizer.from_pretrained(exported).eos_token == "</s>"
    # keep_last=2: the legs saved steps 3, 6 and 8; step 3 was pruned once step 8 was sealed.
    assert [c.step for c in list_checkpoints(split / "checkpoints")] == [6, 8]


def _kill_tree(*pids: int) -> None:
    """SIGKILL processes and all their descendants at once, as a node failure would. (Each
    rank is in a process group of its own, so killing one group is not enough.)"""
    tree, frontier = list(pids), list(pids)
    while frontier:
        frontier = [child for parent in frontier for child in worker_pids(parent)]
        tree += frontier
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


@pytest.mark.slow
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_usable(
    tmp_path, tiny_assets, data_cache
):
    # A larger model (about 10M parameters) so that a save takes long enough to be caught.
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    model = save_tiny_model(tmp_path / "model", tokenizer, hidden_size=512, num_layers=4)
    assets = {"model": model, "data": tiny_assets["data"]}
    out = tmp_path / "run"
    args = _ckpt_args(
        assets, out, data_cache, max_training_steps=30, save_every_steps=1, keep_last=2
    )
    checkpoints = out / "checkpoints"
    caught = None
    for _attempt in range(6):
        # The 2 processes forked (tests/prefork.py), not under torchrun: what is killed is the
        # ranks, all at once, as when the node dies; torchrun's part in that is nothing.
        run = BackgroundFinetune(2, args, timeout=300)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and run.running():
                partial = list(checkpoints.glob("step_*.tmp")) if checkpoints.exists() else []
                if partial and list_checkpoints(checkpoints):
                    _kill_tree(*run.ranks())  # the node dies mid-save
                    run.result()
                    caught = [p for p in partial if p.exists()]
                    break
                time.sleep(0.002)
        finally:
            run.kill()
        if caught:
            break
    assert caught, "never caught a save in progress"
    interrupted_step = int(caught[0].name[5:13])
    complete = list_checkpoints(checkpoints)
    assert complete and complete[-1].step < interrupted_step
    read_checkpoint(complete[-1].path)  # intact

    result = run_finetune(2, [*args, "--stop_after_steps", "1"])
    check_ok(result)
    assert f"resumed from step {complete[-1].step} " in result.stdout, result.stdout
    assert not list(checkpoints.glob("*.tmp"))


@pytest.mark.slow
def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, tiny_assets, data_cache):
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.fail("this test mounts a small tmpfs and must run as root (as CI does)")
    out = tmp_path / "small_disk"
    out.mkdir()
    # One checkpoint of the tiny model is ~1.7 MB (weights + two AdamW states + tokenizer).
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2600k", "tmpfs", str(out)], check=True)
    try:
        args = _ckpt_args(
            tiny_assets,
            out,
            data_cache,
            max_training_steps=4,
            save_every_steps=2,
            keep_last=1,
            no_final_save=True,
        )
        result = run_finetune(1, args)
        assert "Saving the checkpoint of step 4 failed" in result.stdout + result.stderr
        assert "step_00000002 is kept" in result.stdout + result.stderr
        kept = read_checkpoint(out / "checkpoints" / "step_00000002")
        assert kept.step == 2
        assert not list((out / "checkpoints").glob("*.tmp"))
        assert "Traceback" not in result.stderr
        assert "warning: storage: a checkpoint is" in result.stdout  # one fits, not two

        # The kept checkpoint leaves less than one on this disk: a new run there fails at once.
        args = _ckpt_args(tiny_assets, out / "another", data_cache, max_training_steps=4)
        result = run_finetune(1, args)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert "Not even one checkpoint of this run fits" in result.stderr
        assert not (out / "another" / "metrics.jsonl").exists()
    finally:
        subprocess.run(["umount", str(out)], check=False)


@pytest.mark.slow
def test_unwritable_output_folder_and_foreign_checkpoint(tmp_path, tiny_assets, data_cache):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    result = run_finetune(1, _ckpt_args(tiny_assets, blocker / "run", data_cache))
    assert result.returncode == 2 and "is not writable" in result.stderr

    out = tmp_path / "run"
    check_ok(
        run_finetune(
            1, _ckpt_args(tiny_assets, out, data_cache, max_training_steps=3, no_final_save=True)
        )
    )
    result = run_finetune(1, _ckpt_args(tiny_assets, out, data_cache, max_seq_length=32))
    assert result.returncode == 2
    assert "belongs to a different run: max_seq_length: checkpoint 64, now 32" in result.stderr
