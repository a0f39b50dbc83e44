"""DoRA (`--lora_dora`) and continuing an adapter (`--lora_from`): PEFT's names and merge on
one process, adapter folders read back (local and from the offline cache), and real 2-process
FSDP2 runs: a DoRA adapter A trained, exported and reloaded by PEFT, then continued with
--lora_from from exactly where it ended, resumed and exported again."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdp_utils.checkpoint.lora_adapters import adapter_state, write_lora_outputs
from fsdp_utils.checkpoint.sharded import read_checkpoint
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.hub.cache import snapshot_dir
from fsdp_utils.hub.manifest import FileRecord, ManifestEntry, record_entry
from fsdp_utils.hub.resolve import load_model_config, resolve_adapter_dir
from fsdp_utils.hub.specs import specs_from_train_config
from fsdp_utils.model.build import build_meta_model, find_decoder_layers
from fsdp_utils.model.lora import (
    adapted_modules,
    apply_lora,
    lora_settings,
)
from fsdp_utils.model.peft_adapter import read_adapter_folder
from fsdp_utils.synthetic import save_tiny_model
from tests.lora_helpers import lora_model_on_cpu
from tests.train_helpers import (
    check_ok,
    read_metrics,
    run_finetune,
    run_script,
    tiny_args,
)

LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_adapter(model_dir: Path, folder: Path, **lora_options) -> Path:
    """An adapter folder as PEFT itself writes it, for the tiny model in `model_dir`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    safe = lora_options.pop("safe", True)  # False: the older .bin format
    options = {"r": 4, "lora_alpha": 8, "target_modules": LINEAR, **lora_options}
    peft = get_peft_model(model, LoraConfig(**options))
    with torch.no_grad():  # B starts at zero: give the adapter something to say
        for name, param in peft.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.1)
    peft.save_pretrained(folder, safe_serialization=safe)
    return folder


# --- PEFT's names, DoRA's merge (one process) -------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_dir(tiny_assets, tmp_path_factory) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    return save_tiny_model(tmp_path_factory.mktemp("gpt2"), tokenizer, arch="gpt2")


def test_our_adapter_names_are_pefts(tiny_assets, tmp_path):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    peft_dir = _peft_adapter(tiny_assets["model"], tmp_path / "peft", use_dora=True)
    config = TrainConfig(lora=True, lora_dora=True, precision="fp32")
    model, _ = lora_model_on_cpu(tiny_assets["model"], config)
    ours = adapter_state(get_model_state_dict(model))
    theirs = load_file(peft_dir / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    assert {k for k in ours if k.endswith(".lora_magnitude_vector")}  # DoRA's, without .weight


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_dora_adapter_and_its_merge_give_the_models_logits(tiny_assets, gpt2_dir, tmp_path, arch):
    """peft initialises DoRA's magnitude as the norm of each output row of the base weight; the
    adapter folder under PEFT and our merge (W' = m / ||W + s B A|| (W + s B A)) must give the
    model's logits, for nn.Linear and for GPT-2's Conv1D (weights stored transposed)."""
    from peft import PeftModel
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model_dir = tiny_assets["model"] if arch == "llama" else gpt2_dir
    config = TrainConfig(model=str(model_dir), lora=True, lora_dora=True, precision="fp32")
    model, hf_config = lora_model_on_cpu(model_dir, config)
    for name, module in adapted_modules(model).items():  # peft's init, row norms of W
        weight = module.get_base_layer().weight
        rows = weight.T if module.fan_in_fan_out else weight
        magnitude = module.lora_magnitude_vector["default"].weight
        torch.testing.assert_close(magnitude, torch.linalg.norm(rows, dim=1), msg=name)
    with torch.no_grad():  # trained-looking adapters and magnitudes
        generator = torch.Generator().manual_seed(1)
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.3, generator=generator)
            elif ".lora_magnitude_vector." in name:
                param.mul_(1 + 0.2 * torch.rand(param.shape, generator=generator))
    input_ids = torch.randint(0, hf_config.vocab_size, (2, 16), generator=torch.Generator())
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=input_ids).logits
    state = get_model_state_dict(model)
    write_lora_outputs(
        state, model, config, hf_config, (tmp_path / "adapter", tmp_path / "merged"), model_dir
    )
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["use_dora"] is True
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(model_dir)
        with_adapter = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        adapter_logits = with_adapter(input_ids=input_ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(input_ids).logits
    torch.testing.assert_close(adapter_logits, trained, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, adapter_logits, rtol=1e-4, atol=1e-4)


# --- adapter folders read back ---------------------------------------------------------------


def test_an_adapter_folder_sets_rank_alpha_targets_and_dora(tiny_assets, tmp_path):
    folder = _peft_adapter(
        tiny_assets["model"], tmp_path / "a", r=4, lora_alpha=32,
        target_modules=["q_proj", "v_proj"], use_dora=True,
    )  # fmt: skip
    read = read_adapter_folder(folder)
    assert (read.r, read.alpha, read.dora, read.short_names) == (4, 32, True, ["q_proj", "v_proj"])
    config = TrainConfig(model=str(tiny_assets["model"]), lora=True, lora_from=str(folder))
    settings = lora_settings(config)
    assert (settings.r, settings.alpha, settings.target_modules, settings.dora) == (
        4, 32, "q_proj,v_proj", True,
    )  # fmt: skip
    assert settings.dropout == config.lora_dropout  # a training choice: the flag's
    assert settings.note == (
        f"continuing the adapter {folder}; its adapter_config.json wins over the flags: "
        "--lora_r 8 -> 4, --lora_alpha 16 -> 32, --lora_target_modules (every linear layer) -> "
        "q_proj,v_proj, --lora_dora off -> on"
    )
    model = build_meta_model(load_model_config(tiny_assets["model"]), "fp32")
    apply_lora(model, find_decoder_layers(model), config)
    assert sorted(adapted_modules(model)) == list(read.modules)


def test_adapters_that_cannot_be_continued_say_why(tiny_assets, tmp_path):
    model_dir = tiny_assets["model"]
    cases = [
        ({"use_rslora": True}, "rsLoRA scaling"),
        ({"modules_to_save": ["lm_head"]}, "fully trained modules (modules_to_save)"),
        ({"safe": False}, "no adapter_model.safetensors there (found adapter_model.bin)"),
    ]
    for index, (options, expected) in enumerate(cases):
        folder = _peft_adapter(model_dir, tmp_path / str(index), **options)
        with pytest.raises(ValueError, match=r"^--lora_from .*") as err:
            read_adapter_folder(folder)
        assert expected in str(err.value)
    with pytest.raises(
        ValueError, match=r"It holds a config\.json: a full model, which --model takes"
    ):
        read_adapter_folder(model_dir)
    # An adapter of layer 0 only: continuing it would adapt every layer's projections.
    partial = _peft_adapter(model_dir, tmp_path / "partial", layers_to_transform=[0])
    config = TrainConfig(model=str(model_dir), lora=True, lora_from=str(partial))
    model = build_meta_model(load_model_config(model_dir), "fp32")
    with pytest.raises(ValueError, match="in some decoder layers only"):
        apply_lora(model, find_decoder_layers(model), config)


def test_an_adapter_from_the_offline_cache(tiny_assets, tmp_path):
    """A hub id resolves like a model's, through download_models.py's manifest; an assets file
    made from a training config lists the adapter for download."""
    folder = _peft_adapter(tiny_assets["model"], tmp_path / "adapter")
    cache, commit = tmp_path / "hub", "e" * 40
    snapshot = snapshot_dir(cache, "org/chess-lora", "model", commit)
    shutil.copytree(folder, snapshot)
    files = sorted(p.name for p in snapshot.iterdir())
    record_entry(
        cache,
        ManifestEntry(
            repo_id="org/chess-lora", repo_type="model", revision="main", commit=commit,
            files=tuple(
                FileRecord(n, (snapshot / n).stat().st_size,
                           hashlib.sha256((snapshot / n).read_bytes()).hexdigest())
                for n in files
            ),
            repo_files=tuple(files), endpoint="https://huggingface.co",
            downloaded_at="2026-01-01T00:00:00+00:00",
        ),
    )  # fmt: skip
    assert resolve_adapter_dir("org/chess-lora", str(cache)) == snapshot
    config = TrainConfig(lora=True, lora_from="org/chess-lora", cache_dir=str(cache))
    assert lora_settings(config).adapter == snapshot
    repos = [(s.repo_id, s.repo_type) for s in specs_from_train_config(config)]
    assert ("org/chess-lora", "model") in repos
    with pytest.raises(ValueError, match=r"python download_models\.py --model org/other"):
        resolve_adapter_dir("org/other", str(cache))


def test_lora_options_need_lora():
    from fsdp_utils.config.parse import parse_config

    for flags in (["--lora_dora"], ["--lora_from", "x"]):
        with pytest.raises(ValueError, match=f"{flags[0]} is a LoRA option: add --lora"):
            parse_config(flags)


# --- real 2-process runs (slow) ---------------------------------------------------------------

STEPS, SAVE_AT = 8, 4
# fp32 and no dropout: runs split differently over processes give the same losses.
DORA = {
    "lora": True, "lora_dora": True, "lora_dropout": 0.0, "precision": "fp32",
    "learning_rate": 2e-2, "max_training_steps": STEPS, "eval_batches": 2,
}  # fmt: skip


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


def _probe_run(args: list[str], probe: Path) -> dict:
    """tests/lora_probe.py on 2 processes: the real trainer, plus the logits of two held-out
    blocks before and after training and the whole trained state."""
    result = run_script(2, "tests/lora_probe.py", ["--probe_out", str(probe), *args], timeout=300)
    check_ok(result)
    return {"probe": torch.load(probe), "stdout": result.stdout}


@pytest.fixture(scope="module")
def dora_run(tiny_assets, data_cache, tmp_path_factory) -> dict:
    """Adapter A: DoRA on every linear layer, 8 steps, checkpoints at 4 and 8."""
    out = tmp_path_factory.mktemp("dora") / "run"
    args = tiny_args(tiny_assets, out, data_cache, save_every_steps=SAVE_AT, merge=True, **DORA)
    return {"out": out, **_probe_run(args, out.parent / "probe.pt")}


@pytest.fixture(scope="module")
def continued_run(dora_run, tiny_assets, data_cache, tmp_path_factory) -> dict:
    """Adapter A continued with --lora_from (flags that disagree with it, which it overrides)."""
    out = tmp_path_factory.mktemp("continued") / "run"
    options = {**DORA, "lora_dora": False, "lora_r": 2, "lora_from": dora_run["out"] / "final"}
    args = tiny_args(tiny_assets, out, data_cache, save_every_steps=SAVE_AT, **options)
    return {"out": out, "args": args, **_probe_run(args, out.parent / "probe.pt")}


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


def _peft_logits(base: Path, adapter: Path, input_ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel

    with torch.no_grad():
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
        return model.eval()(input_ids=input_ids).logits


@pytest.mark.slow
def test_dora_trains_under_fsdp2_and_peft_loads_what_it_trained(dora_run, tiny_assets):
    out, probe = dora_run["out"], dora_run["probe"]
    losses = _losses(out)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.01
    assert "lora: DoRA r=8, alpha=16, dropout=0 on every linear layer" in dora_run["stdout"]
    # The base is untouched; every magnitude moved from its start (the base's row norms).
    state, pretrained = probe["state"], load_file(tiny_assets["model"] / "model.safetensors")
    for key, value in pretrained.items():
        assert torch.equal(state[key.replace("proj.weight", "proj.base_layer.weight")], value)
    magnitudes = {k: v for k, v in state.items() if ".lora_magnitude_vector." in k}
    assert len(magnitudes) == 14
    for key, value in magnitudes.items():
        base = state[key.replace("lora_magnitude_vector.default.weight", "base_layer.weight")]
        assert not torch.allclose(value, torch.linalg.norm(base, dim=1)), key
    # Checkpoints hold them; PEFT loads the adapter folder; the merged model agrees.
    checkpoint = read_checkpoint(out / "checkpoints" / f"step_{STEPS:08d}")
    assert checkpoint.meta["identity"]["lora"]["dora"] is True
    logits = _peft_logits(tiny_assets["model"], out / "final", probe["input_ids"])
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out / "final_merged")(probe["input_ids"])
    torch.testing.assert_close(merged.logits, logits, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_continued_adapter_starts_where_it_ended(dora_run, continued_run):
    """Before its first step, the run continuing A gives A's final logits (and so A's final
    loss) on the same held-out tokens: A's rank, alpha, targets and DoRA won over the flags."""
    start = continued_run["probe"]["start_logits"]
    torch.testing.assert_close(start, dora_run["probe"]["logits"], rtol=1e-6, atol=1e-6)
    (note,) = [line for line in continued_run["stdout"].splitlines() if "wins over" in line]
    assert note.startswith("lora: continuing the adapter ")
    assert "--lora_r 2 -> 8" in note and "--lora_dora off -> on" in note
    # Training goes on from A's level, not from the base's.
    assert _losses(continued_run["out"])[0] < _losses(dora_run["out"])[0] - 0.01


@pytest.mark.slow
def test_a_continued_adapter_exports_and_resumes_as_a_fresh_one(
    continued_run, tiny_assets, data_cache, tmp_path
):
    from fsdp_utils.checkpoint.export import main as export_main

    out, probe = continued_run["out"], continued_run["probe"]
    logits = _peft_logits(tiny_assets["model"], out / "final", probe["input_ids"])
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-5, atol=1e-5)
    checkpoint = out / "checkpoints" / f"step_{STEPS:08d}"
    assert export_main([str(checkpoint), str(tmp_path / "exported")]) == 0
    exported = load_file(tmp_path / "exported" / "adapter_model.safetensors")
    final = load_file(out / "final" / "adapter_model.safetensors")
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)

    # Resume from step 4 with the same command: the uninterrupted run's losses.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    saved = out / "checkpoints" / f"step_{SAVE_AT:08d}"
    shutil.copytree(saved, resumed / "checkpoints" / saved.name)
    args = [a if a != str(out) else str(resumed) for a in continued_run["args"]]
    result = run_finetune(2, [*args, "--no_final_save"])
    check_ok(result)
    assert f"resumed from step {SAVE_AT} " in result.stdout
    assert _losses(out)[:SAVE_AT] + _losses(resumed) == _losses(out)
