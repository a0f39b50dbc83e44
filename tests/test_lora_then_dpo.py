"""A newcomer's route (issue 48): a LoRA fine-tune on 150 chat rows with the default settings,
then DPO on preference pairs from what it wrote, given as the adapter folder (`final/`) and as
the run folder. `--model` reads both (`fsdp_utils/config/model_path.py`); the DPO reference is
a frozen copy of the starting adapter (TRL's `ref_adapter_name`), so the first loss is ln 2.

One torchrun of 2 processes runs the three (`run_finetunes`); the checks read its folders and
its log. What `--model` names is also checked on folders alone (no model, no torch)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from fsdp_utils.config.model_path import model_path
from fsdp_utils.config.parse import parse_config
from fsdp_utils.synthetic import preference_pairs, random_conversations, save_chat_model
from tests.chat_helpers import write_jsonl
from tests.train_helpers import read_metrics, run_finetunes, tiny_args

ROWS, PAIRS = 150, 60


@pytest.fixture(scope="module")
def route(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora-then-dpo")
    assets = {
        "model": save_chat_model(root / "model", "chatml"),
        "data": write_jsonl(
            root / "chat.jsonl", [{"messages": m} for m in random_conversations(ROWS)]
        ),
    }
    prefs = write_jsonl(root / "prefs.jsonl", preference_pairs(PAIRS))
    sft = root / "sft"

    def args(out: Path, **options: Any) -> list[str]:
        # tiny_args' short fp32 settings; --eval_examples (and the rest) at their defaults.
        flags = {"dataset_include": None, "eval_batches": 2, **options}
        return tiny_args(assets, out, root / "data_cache", **flags)

    # --lora_dropout at its default (0.05): DPO turns dropout off, as TRL does.
    dpo = {"method": "dpo", "dataset": prefs, "lora": True, "max_training_steps": 1}
    runs = {
        # Enough steps at a high rate that the adapter moves the model away from its base.
        "sft": args(sft, lora=True, max_training_steps=4, learning_rate=3e-2),
        "dpo_from_adapter": args(root / "dpo_a", model=sft / "final", **dpo),
        "dpo_from_run": args(root / "dpo_r", model=sft, **dpo),
    }
    results = run_finetunes(2, runs, root / "runs")
    for name, outcome in results.items():
        assert outcome["exit_code"] == 0, (name, outcome.get("output_tail"))
    return {
        "root": root,
        "sft": sft,
        "model": assets["model"],
        "output": (root / "runs" / "output.txt").read_text(),
    }


@pytest.mark.slow
def test_a_150_row_set_trains_with_the_default_settings(route):
    # The default 200 held-out rows would leave fewer to train on: a tenth, said in the log.
    assert f"holding out {ROWS // 10} of {ROWS} documents for evaluation" in route["output"]
    config = json.loads((route["sft"] / "config.json").read_text())
    assert config["config"]["eval_examples"] == 200  # the default, as given
    meta = json.loads((Path(config["resolved"]["prepared_data"]) / "meta.json").read_text())
    assert meta["stats"]["eval"]["documents"] == ROWS // 10
    assert meta["stats"]["train"]["documents"] == ROWS - ROWS // 10


@pytest.mark.slow
@pytest.mark.parametrize("run", ["dpo_a", "dpo_r"])
def test_dpo_after_a_lora_fine_tune_starts_at_ln2_from_the_adapter_or_the_run(route, run):
    out = route["root"] / run
    first = read_metrics(out)[0]
    assert first["step"] == 1
    # The reference is the fine-tuned model (the starting adapter, frozen): at the first step
    # the policy is the reference, every pair's logits are 0.
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    config = json.loads((out / "config.json").read_text())["config"]
    adapter = route["sft"] / "final"
    assert (config["model"], config["lora_from"]) == (str(route["model"]), str(adapter))
    assert f"reference: the starting adapter {adapter}, a frozen copy" in route["output"]
    # The final adapter is the trained one alone, over the base, as peft loads it.
    from safetensors import safe_open

    with safe_open(str(out / "final" / "adapter_model.safetensors"), "pt") as saved:
        keys = list(saved.keys())
    trained = json.loads((out / "final" / "adapter_config.json").read_text())
    assert keys and not [k for k in keys if "reference" in k]
    assert trained["base_model_name_or_path"] == str(route["model"])


@pytest.mark.slow
def test_the_starting_adapter_moved_the_model(route):
    """Without it the first loss would be ln 2 however the reference was chosen: the adapter
    over the base gives other answers than the base (what the reference was before: 0.6993)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(route["model"], dtype=torch.float32).eval()
    ids = torch.arange(1, 33)[None]
    with torch.no_grad():
        before = base(ids).logits
        tuned = PeftModel.from_pretrained(base, route["sft"] / "final").eval()
        after = tuned(ids).logits
    assert (after - before).abs().max().item() > 1e-2


# --- what --model names, on folders alone ------------------------------------------------------


def _adapter(folder: Path, base: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "base_model_name_or_path": base})
    )
    return folder


def _run(folder: Path, *, quantize: str = "none") -> Path:
    (folder / "checkpoints" / "step_00000004").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"config": {"quantize": quantize}}))
    return folder


def test_model_names_a_hub_id_a_folder_a_run_or_an_adapter(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert model_path("org/name") == model_path("org/name").__class__("org/name", "org/name")
    assert model_path("plain").model == "plain" and model_path("plain").adapter is None

    lora = _run(tmp_path / "lora")
    _adapter(lora / "final", "org/base")
    found = model_path(str(lora))
    assert (found.model, found.adapter, found.run_dir) == ("org/base", lora / "final", lora)
    (lora / "final_merged").mkdir()  # --merge wrote a full model: the run's model is that
    found = model_path(str(lora))
    assert (found.model, found.adapter) == (str(lora / "final_merged"), None)

    qlora = _run(tmp_path / "qlora", quantize="nf4")  # merged = dequantized: not what trained
    _adapter(qlora / "final", "org/base")
    (qlora / "final_merged").mkdir()
    assert model_path(str(qlora)).adapter == qlora / "final"

    unfinished = _run(tmp_path / "unfinished")
    with pytest.raises(ValueError, match="a run folder without a final model"):
        model_path(str(unfinished))


def test_an_adapter_as_model_continues_it_with_lora_and_says_what_to_do_without(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    run = _run(tmp_path / "sft")
    _adapter(run / "final", "org/base")
    config, _ = parse_config(["--model", "sft/final", "--lora", "--method", "dpo"])
    assert (config.model, config.lora_from, config.reference_adapter) == (
        "org/base",
        "sft/final",
        True,
    )
    config, _ = parse_config(["--model", "sft", "--lora"])  # the run folder: its final/
    assert (config.model, config.lora_from, config.reference_adapter) == (
        "org/base",
        "sft/final",
        False,  # SFT continues the adapter; only a reference method keeps a copy
    )
    with pytest.raises(ValueError) as without:
        parse_config(["--model", "sft/final", "--method", "dpo"])
    assert "Add --lora to continue training it" in str(without.value)
    merge = "python -m fsdp_utils.export --merge sft/checkpoints/step_00000004 sft/final_merged"
    assert merge in str(without.value) and "then --model" in str(without.value)
    with pytest.raises(ValueError, match="names another"):
        parse_config(["--model", "sft/final", "--lora", "--lora_from", "other"])
