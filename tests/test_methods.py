"""Training methods as one interface (fsdp_utils/methods/): the registry, what each method adds
to the checkpoint identity, a run folder written before the methods existed, and a toy method
registered here, in the test, and trained through chess_finetune.py's main: the interface is
enough on its own (nothing in the trainer or the registry's source names it)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from fsdp_utils import cli
from fsdp_utils.checkpoint.sharded import run_identity
from fsdp_utils.config.batch import plan_batch
from fsdp_utils.config.parse import config_from_dict
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.methods import registry
from fsdp_utils.methods.base import MethodContext, StepParts
from fsdp_utils.methods.sft import SFT
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.synthetic import preference_pairs, save_chat_model
from fsdp_utils.train.step import Batch, TrainStep, build_train_step, forward_loss_sum
from tests.chat_helpers import write_jsonl
from tests.prefork import launch
from tests.train_helpers import REPO_ROOT, check_ok, read_metrics, tiny_args

FIXTURE_RUN = REPO_ROOT / "tests" / "fixtures" / "run_452c872"


def _method(config: TrainConfig) -> Any:
    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
    context = MethodContext(env, plan_batch(config, 1), None, Path(), log=lambda line: None)
    return registry.build_method(config, context)


def test_each_method_adds_its_name_to_the_identity_but_sft():
    """A fine-tune's identity is as it was before methods existed; any other method's names it,
    so that no method continues another's checkpoint."""
    assert _method(TrainConfig()).identity() == {}
    assert _method(TrainConfig(method="dpo")).identity() == {"method": "dpo"}


def test_an_unknown_method_is_one_paragraph_naming_the_known(capsys):
    with pytest.raises(
        ValueError, match=r"--method dop: no such training method\. Known: distill, dpo, grpo, sft"
    ):
        registry.method_class("dop")
    # chess_finetune.py's checks say it before anything starts: exit 2, no traceback
    assert cli.main(["--method", "dop", "--preflight", "--world_size", "1"]) == 2
    err = capsys.readouterr().err
    assert "--method dop: no such training method" in err and "Traceback" not in err


def test_a_name_is_registered_once(monkeypatch):
    monkeypatch.setattr(registry, "METHODS", dict(registry.METHODS))

    class Other(SFT):
        name: ClassVar[str] = "sft"

    with pytest.raises(ValueError, match="--method sft is taken by SFT"):
        registry.register_method(Other)

    class Nameless(SFT):
        name: ClassVar[str] = ""

    with pytest.raises(ValueError, match="Nameless has no `name`"):
        registry.register_method(Nameless)


def test_a_method_s_options_need_the_method():
    with pytest.raises(ValueError, match=r"--dpo_beta, --reference: option\(s\) of --method dpo"):
        config_from_dict({"dpo_beta": 0.2, "reference": "live"})
    config_from_dict({"method": "dpo", "dpo_beta": 0.2, "reference": "live"})


# --- a run folder written before the methods and the split config ---------------------------


def test_a_config_json_written_before_the_split_reads_the_same():
    """tests/fixtures/run_452c872 was written by chess_finetune.py at 452c872 (the commit before
    the config's stages and the methods): its config reads into the same options, and the
    identity this code gives it is the one its checkpoint holds, so it resumes."""
    record = json.loads((FIXTURE_RUN / "config.json").read_text())
    config = config_from_dict(record["config"])
    read, defaults = config.to_dict(), TrainConfig().to_dict()
    assert {name: read[name] for name in record["config"]} == record["config"]
    added = set(read) - set(
        record["config"]
    )  # options added since (--sequence_parallel, eval_apply_chat_template, ...): their defaults
    assert {name: read[name] for name in added} == {name: defaults[name] for name in added}
    checkpoint = json.loads(
        (FIXTURE_RUN / "checkpoints" / "step_00000002" / "checkpoint.json").read_text()
    )
    total = record["resolved"]["total_batch_size"]
    assert run_identity(config, total, _method(config).identity()) == checkpoint["identity"]


@pytest.mark.slow
def test_a_run_folder_written_before_the_split_resumes(tmp_path):
    """The fixture's run (DPO with LoRA, stopped at step 2 of 4) resumes here: its model and
    pairs made again as they were made then (relative paths, as the run was started)."""
    shutil.copytree(FIXTURE_RUN, tmp_path / "run")
    save_chat_model(tmp_path / "model", "chatml")
    write_jsonl(tmp_path / "prefs.jsonl", preference_pairs(40))
    # The command that wrote it, but for --stop_after_steps (README.md in tests/fixtures)
    args = tiny_args(
        {"model": Path("model"), "data": Path("prefs.jsonl")}, Path("run"), Path("cache"),
        max_seq_length=32, total_batch_size=4, max_training_steps=4, save_every_steps=2,
        method="dpo", dpo_beta=0.2, lora=True, lora_r=2, lora_target_modules="q_proj,v_proj",
        eval_examples=8, no_final_save=True,
    )  # fmt: skip
    result = launch(
        1, str(REPO_ROOT / "chess_finetune.py"), args, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    check_ok(result)
    out = tmp_path / "run"
    assert [r["step"] for r in read_metrics(out, "resumed")] == [2]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert json.loads((out / "status.json").read_text())["status"] == "completed"


# --- a method of the test's own ----------------------------------------------------------------

WEIGHT = 2.0


class WeightedStep(TrainStep):
    """The token loss times a fixed weight."""

    def forward_backward(self, batch: Batch, global_targets: float) -> torch.Tensor:
        _, loss_sum = forward_loss_sum(self.model, batch, self.device, self.autocast, self.chunking)
        weighted = WEIGHT * loss_sum
        (weighted * (self.world_size / max(global_targets, 1.0))).backward()
        return weighted.detach().to(torch.float64)


class WeightedSFT(SFT):
    """SFT whose every token weighs `WEIGHT`: a method in a few lines of the test."""

    name: ClassVar[str] = "weighted_sft"

    def identity(self) -> dict[str, Any]:
        return {"method": self.name, "weight": WEIGHT}

    def describe(self) -> str:
        return f"{self.name}: the token loss times {WEIGHT:g}"

    def build_step(self, model: torch.nn.Module, parts: StepParts) -> TrainStep:
        self.step = build_train_step(
            model, self.config, world_size=self.env.world_size, device=self.env.device,
            hf_config=self.context.hf_config, autocast=parts.autocast,
            grad_scaler=parts.grad_scaler, step_class=WeightedStep,
        )  # fmt: skip
        return self.step


@pytest.mark.slow
def test_a_method_registered_by_the_test_trains_through_the_command_line(
    tiny_assets, tmp_path, monkeypatch, capsys
):
    """Registered here, named by --method, trained by chess_finetune.py's main in this process:
    its first step's loss is twice the fine-tune's on the same batch, its checkpoint carries
    its identity, its line is in the log, and the run ends with a final model."""
    monkeypatch.setattr(registry, "METHODS", dict(registry.METHODS))
    registry.register_method(WeightedSFT)
    options = {"max_training_steps": 2, "eval_every": 2, "save_every_steps": 2}
    runs = {}
    for method in ("sft", "weighted_sft"):
        out = tmp_path / method
        args = tiny_args(tiny_assets, out, tmp_path / "cache", method=method, **options)
        assert cli.main([str(a) for a in args]) == 0
        runs[method] = out
    log = capsys.readouterr().out
    sft, weighted = (read_metrics(runs[m]) for m in ("sft", "weighted_sft"))
    assert weighted[0]["batch_id"] == sft[0]["batch_id"]
    assert weighted[0]["loss"] == pytest.approx(WEIGHT * sft[0]["loss"], rel=1e-6)
    assert [r["step"] for r in read_metrics(runs["weighted_sft"], "eval")] == [2]
    meta = json.loads(
        (runs["weighted_sft"] / "checkpoints" / "step_00000002" / "checkpoint.json").read_text()
    )
    assert meta["identity"]["method"] == "weighted_sft" and meta["identity"]["weight"] == WEIGHT
    assert log.count("weighted_sft: the token loss times 2\n") == 1
    assert (runs["weighted_sft"] / "final" / "config.json").is_file()
