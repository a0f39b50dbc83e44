"""LoRA (fsdp_utils/model/lora.py, lora_export.py): the transform on meta models, exports that PEFT and
transformers load, and real multi-process CPU (gloo) runs.

One 2-process run (`lora_run`, through `tests/lora_probe.py`) feeds most end-to-end checks:
the loss falls, the base is bit-identical, the checkpoint holds adapters only, the adapter
folder under PEFT and the merged model give the trained model's logits, and its step-8
checkpoint is resumed on 2 and on 1 process(es).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdp_utils.checkpoint.lora_adapters import ADAPTER_CONFIG, write_lora_outputs
from fsdp_utils.checkpoint.sharded import MARKER, read_checkpoint, run_identity
from fsdp_utils.config.parse import build_parser, parse_config
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.hub.resolve import load_model_config
from fsdp_utils.model.build import build_meta_model, find_decoder_layers
from fsdp_utils.model.lora import (
    adapted_modules,
    apply_lora,
    target_modules,
)
from fsdp_utils.plan.estimate import Cluster, estimate
from fsdp_utils.synthetic import save_tiny_model
from tests.lora_helpers import lora_model_on_cpu
from tests.test_plan_validation import _measure
from tests.train_helpers import (
    REPO_ROOT,
    check_ok,
    read_metrics,
    run_finetune,
    run_script,
    tiny_args,
)

LLAMA_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _meta_lora_model(model_dir: Path, **options):
    config = TrainConfig(model=str(model_dir), lora=True, **options)
    model = build_meta_model(load_model_config(model_dir), config.precision)
    layers = find_decoder_layers(model)
    apply_lora(model, layers, config)
    return model, layers


# --- the transform, on meta models (fast) ---------------------------------------------------


def test_default_targets_are_every_linear_layer_of_the_decoder_layers(tiny_assets):
    model, layers = _meta_lora_model(tiny_assets["model"])
    adapted = sorted(adapted_modules(model))
    expected = sorted(
        f"model.layers.{i}.{part}.{name}"
        for i in range(len(layers))
        for part, names in (("self_attn", LLAMA_LINEAR[:4]), ("mlp", LLAMA_LINEAR[4:]))
        for name in names
    )
    assert adapted == expected  # not lm_head, which is linear too but outside the blocks


def test_named_targets_and_an_unknown_name(tiny_assets):
    model, _ = _meta_lora_model(tiny_assets["model"], lora_target_modules="q_proj, mlp.up_proj")
    assert sorted(n.split(".", 3)[3] for n in adapted_modules(model)) == [
        "mlp.up_proj", "mlp.up_proj", "self_attn.q_proj", "self_attn.q_proj",
    ]  # fmt: skip
    plain = find_decoder_layers(build_meta_model(load_model_config(tiny_assets["model"]), "fp32"))
    with pytest.raises(ValueError) as err:
        target_modules(plain, ["model.layers.0", "model.layers.1"], "q_proj,qkv_proj")
    message = str(err.value)
    assert message.startswith("--lora_target_modules qkv_proj: no linear layer")
    assert ", ".join(LLAMA_LINEAR) in message and "\n" not in message


@pytest.mark.parametrize(
    ("precision", "frozen", "adapter"),
    [
        ("bf16-mixed", torch.bfloat16, torch.float32),
        ("fp16-mixed", torch.float16, torch.float32),
        ("bf16-true", torch.bfloat16, torch.bfloat16),
        ("fp32", torch.float32, torch.float32),
    ],
)
def test_frozen_base_in_the_compute_dtype_and_adapters_trainable(
    tiny_assets, precision, frozen, adapter
):
    model, _ = _meta_lora_model(tiny_assets["model"], precision=precision)
    adapters = 0
    for name, param in model.named_parameters():
        is_adapter = ".lora_A." in name or ".lora_B." in name
        adapters += is_adapter
        assert param.requires_grad == is_adapter, name
        assert param.dtype == (adapter if is_adapter else frozen), name
    assert adapters == 28  # A and B on the 7 linear layers of each of the 2 blocks


def test_config_options(tiny_assets):
    config, _ = parse_config(["--lora", "--lora_r", "4", "--lora_target_modules", "q_proj"])
    assert (config.lora, config.lora_r, config.lora_alpha, config.lora_dropout) == (
        True, 4, 16, 0.05,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"--merge .* needs --lora"):
        parse_config(["--merge"])
    with pytest.raises(ValueError, match="--lora_dropout must be in"):
        parse_config(["--lora", "--lora_dropout", "1"])


# --- export and merge in one process, on three architectures ------------------------------


@pytest.fixture(scope="module")
def tied_and_conv1d_models(tiny_assets, tmp_path_factory) -> dict[str, Path]:
    """A Qwen2 with tied embeddings and a GPT-2 (Conv1D projections, stored transposed)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    return {
        "llama": tiny_assets["model"],
        "qwen2": save_tiny_model(tmp_path_factory.mktemp("qwen2"), tokenizer, arch="qwen2"),
        "gpt2": save_tiny_model(tmp_path_factory.mktemp("gpt2"), tokenizer, arch="gpt2"),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_adapter_folder_and_merged_model_give_the_lora_models_logits(
    tied_and_conv1d_models, tmp_path, arch
):
    from peft import PeftModel
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model_dir = tied_and_conv1d_models[arch]
    config = TrainConfig(model=str(model_dir), lora=True, precision="fp32", lora_dropout=0.0)
    model, hf_config = lora_model_on_cpu(model_dir, config)
    with torch.no_grad():  # B starts at zero: give it values so the merge is not a no-op
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    input_ids = torch.randint(0, hf_config.vocab_size, (2, 16), generator=torch.Generator())
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=input_ids).logits
    state = get_model_state_dict(model)
    write_lora_outputs(
        state, model, config, hf_config, (tmp_path / "adapter", tmp_path / "merged"), model_dir
    )
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        untouched = base(input_ids=input_ids).logits
        peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        with_adapter = peft(input_ids=input_ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(input_ids).logits
    assert not torch.allclose(untouched, trained, atol=1e-3)  # the adapters do something
    torch.testing.assert_close(with_adapter, trained, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, with_adapter, rtol=1e-4, atol=1e-4)
    saved = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert saved["r"] == 8 and saved["lora_alpha"] == 16 and saved["peft_type"] == "LORA"
    assert saved["fan_in_fan_out"] == (arch == "gpt2")


# --- real multi-process runs (slow) ---------------------------------------------------------

STEPS, SAVE_AT = 16, 8
# fp32 and no dropout, so that runs split differently over processes give the same losses.
LORA = {
    "lora": True, "lora_dropout": 0.0, "precision": "fp32", "learning_rate": 2e-2,
    "max_training_steps": STEPS, "eval_batches": 2,
}  # fmt: skip


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="module")
def lora_run(tiny_assets, data_cache, tmp_path_factory) -> dict:
    """2 processes, FSDP2, 16 steps, checkpoints at 8 and 16, adapter folder + merged model;
    the probe adds the trained model's logits on two held-out blocks and its whole state."""
    out = tmp_path_factory.mktemp("lora") / "run"
    args = tiny_args(tiny_assets, out, data_cache, save_every_steps=SAVE_AT, merge=True, **LORA)
    probe = out.parent / "probe.pt"
    result = run_script(2, "tests/lora_probe.py", ["--probe_out", str(probe), *args], timeout=300)
    check_ok(result)
    return {"out": out, "args": args, "probe": torch.load(probe), "stdout": result.stdout}


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


def _token_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1)
    ).item()


_ASSET_HASHES = """
import hashlib, sys
from pathlib import Path
from fsdp_utils.synthetic import build_demo_assets
root = Path(sys.argv[1])
if sys.argv[2:] != ["--built"]:
    build_demo_assets(root, num_games=400, num_shards=2)
# What build_demo_assets writes (a session's folder may hold other tests' files beside them).
written = [p for p in root.rglob("*") if p.is_file() and p.relative_to(root).parts[0] in
           ("data", "model")]
for path in sorted(written):
    print(path.relative_to(root), hashlib.sha256(path.read_bytes()).hexdigest())
"""


def test_the_tiny_assets_are_the_same_in_every_process(tiny_assets, tmp_path):
    """The seeded model, games and tokenizer, byte for byte, from two processes (this one, whose
    session fixture `tiny_assets` is the same call, and a new interpreter, each with its own
    hash seed; a fork would share this one's). The tokenizer was not: tokenizers' BPE trainer
    numbered the word-final characters in a hash map's order, random per process, so the
    seeded model learned from another vocabulary's order each time and the held-out gain
    below varied from run to run (6.2498 against 6.2523 once, on a clean clone);
    `synthetic.canonical_ids` numbers them from the tokens alone. (This process's build is
    the session's: a second one here cost ~8 s of CPU.)"""
    here = io.StringIO()
    root = tiny_assets["model"].parent
    assert tiny_assets["data"].parent == root
    with (
        contextlib.redirect_stdout(here),
        mock.patch.object(sys, "argv", ["-c", str(root), "--built"]),
    ):
        exec(_ASSET_HASHES, {"__name__": "__main__"})
    command = [sys.executable, "-c", _ASSET_HASHES, str(tmp_path / "two")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    check_ok(result)
    outputs = [here.getvalue(), result.stdout]
    assert "model/tokenizer.json" in outputs[0] and "model/model.safetensors" in outputs[0]
    assert "data/" in outputs[0]
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_lora_learns_with_a_frozen_base_and_exports_what_it_trained(lora_run, tiny_assets):
    from peft import PeftModel

    out, probe = lora_run["out"], lora_run["probe"]
    losses = _losses(out)
    assert len(losses) == STEPS
    # A random tiny base learns slowly through rank-8 adapters: compare 4-step means.
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.02
    assert "lora: LoRA r=8, alpha=16, dropout=0 on every linear layer" in lora_run["stdout"]

    # The base is bit-identical to the pretrained weights; the adapters moved.
    state, pretrained = probe["state"], load_file(tiny_assets["model"] / "model.safetensors")
    base = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}
    assert set(base) == set(pretrained)
    for key, value in pretrained.items():
        assert torch.equal(base[key], value), key
    lora_b = [v for k, v in state.items() if ".lora_B." in k]
    assert len(lora_b) == 14 and all(v.abs().max() > 0 for v in lora_b)  # they start at 0

    # Checkpoints hold adapters + optimizer state only, and resume needs nothing else.
    checkpoint = read_checkpoint(out / "checkpoints" / f"step_{STEPS:08d}")
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(checkpoint.path)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert len(model_keys) == 28 and all(".lora_" in k for k in model_keys)
    assert checkpoint.meta["identity"]["lora"] == {
        "r": 8, "alpha": 16, "dropout": 0.0, "target_modules": None,
    }  # fmt: skip

    # The adapter folder on the base under PEFT gives the trained (sharded) model's logits, and
    # the merged model gives those of the adapter on its base. The trained model's held-out loss
    # is below the base's: by 0.0246 (6.2276 against 6.2523) in every run since the tiny assets
    # are the same in every process (the test above), bit for bit in two runs; the margin asked
    # is 0.01.
    input_ids = probe["input_ids"]
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(tiny_assets["model"])
        base_logits = model(input_ids=input_ids).logits
        peft = PeftModel.from_pretrained(model, out / "final").eval()
        with_adapter = peft(input_ids=input_ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "final_merged")(input_ids).logits
    torch.testing.assert_close(with_adapter, probe["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, with_adapter, rtol=1e-4, atol=1e-4)
    assert _token_loss(probe["logits"], input_ids) < _token_loss(base_logits, input_ids) - 0.01


@pytest.mark.slow
def test_export_of_a_lora_checkpoint_matches_the_final_folders(lora_run, tmp_path):
    """`python -m fsdp_utils.export [--merge]` (its main, in this process) on the last
    checkpoint."""
    from fsdp_utils.checkpoint.export import main as export_main

    out = lora_run["out"]
    checkpoint = out / "checkpoints" / f"step_{STEPS:08d}"
    for flags, produced, final, weights in (
        ([], "adapter", "final", "adapter_model.safetensors"),
        (["--merge"], "merged", "final_merged", "model.safetensors"),
    ):
        assert export_main([*flags, str(checkpoint), str(tmp_path / produced)]) == 0
        exported, trained = (
            load_file(tmp_path / produced / weights),
            load_file(out / final / weights),
        )
        assert exported.keys() == trained.keys()
        for key in trained:
            assert torch.equal(exported[key], trained[key]), key


def _assert_same_losses(losses: list[float], reference: list[float], what: str) -> None:
    """fp32 runs that sum in another order differ by ~1e-7 at first; over 16 steps at this
    learning rate training amplifies that (Adam divides the LoRA weights' small early gradients
    by their own size, so rounding noise becomes a step of full size), by how much depending on
    the session's tiny model and data (built afresh each time): up to 2e-4 (3.4e-5 relative) in
    2 of 5 sessions, once 6.6e-4 (1.1e-4 relative) at step 16 of the DDP run on a clean CI
    clone, and once 3.5e-3 (5.7e-4 relative) at step 13 of the one-process run on a loaded clean
    clone. So: 2e-5 over the first 8 steps, where the layouts still agree to rounding (another
    batch composition or loss normalisation shows from step 1), and 1e-3 relative over all 16."""
    assert losses[:8] == pytest.approx(reference[:8], rel=2e-5, abs=2e-5), what
    assert losses == pytest.approx(reference, rel=1e-3, abs=1e-4), what


@pytest.mark.slow
def test_same_losses_on_one_process_and_with_ddp(lora_run, tiny_assets, data_cache, tmp_path):
    """Total batch 8 as 2 x 2 x 2 (FSDP2, the lora_run), 1 x 4 x 2, and 2 x 2 x 2 with DDP."""
    reference = _losses(lora_run["out"])
    for name, nproc, overrides in (
        ("one", 1, {"batch_size_per_device": 4}),
        ("ddp", 2, {"no_fsdp": True}),
    ):
        options = {**LORA, **overrides}
        args = tiny_args(tiny_assets, tmp_path / name, data_cache, no_final_save=True, **options)
        check_ok(run_finetune(nproc, args))
        _assert_same_losses(_losses(tmp_path / name), reference, name)


@pytest.mark.slow
def test_resume_is_exact_on_2_then_2_and_2_then_1(lora_run, tiny_assets, data_cache, tmp_path):
    reference = _losses(lora_run["out"])
    saved = lora_run["out"] / "checkpoints" / f"step_{SAVE_AT:08d}"
    for nproc in (2, 1):
        out = tmp_path / f"resumed_on_{nproc}"
        (out / "checkpoints").mkdir(parents=True)
        shutil.copytree(saved, out / "checkpoints" / saved.name)
        args = tiny_args(tiny_assets, out, data_cache, no_final_save=True, **LORA)
        result = run_finetune(nproc, args)
        check_ok(result)
        assert f"resumed from step {SAVE_AT} " in result.stdout
        losses = reference[:SAVE_AT] + _losses(out)
        if nproc == 2:  # the same computation as the uninterrupted run's
            assert losses == reference
        else:
            _assert_same_losses(losses, reference, "resumed on 1 process")


def _one_paragraph_exit_2(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert expected in result.stderr and result.stderr.count(expected) == 1, result.stderr
    assert "Traceback" not in result.stderr
    (paragraph,) = [p for p in result.stderr.strip().split("\n\n") if "error:" in p]
    assert "\n" not in paragraph.strip()


@pytest.mark.slow
def test_bad_input_one_paragraph_exit_2(lora_run, tiny_assets, data_cache, tmp_path):
    # An unknown target module: before any data or weights are read.
    args = tiny_args(tiny_assets, tmp_path / "unknown", data_cache,
                     **{**LORA, "lora_target_modules": "q_proj,qkv"})  # fmt: skip
    result = run_finetune(1, args)
    _one_paragraph_exit_2(result, "--lora_target_modules qkv: no linear layer")
    assert "data:" not in result.stdout

    # A full fine-tune meeting the LoRA run's checkpoint.
    lora_out = tmp_path / "lora_ckpt"
    shutil.copytree(lora_run["out"] / "checkpoints", lora_out / "checkpoints")
    full = {k: v for k, v in LORA.items() if k != "lora"}
    result = run_finetune(1, tiny_args(tiny_assets, lora_out, data_cache, **full))
    _one_paragraph_exit_2(result, "is from a LoRA run (it holds the adapters only)")

    # A LoRA run meeting a full fine-tune's checkpoint. The check reads the checkpoint's marker:
    # it is given the identity a full fine-tune with these flags writes (run_identity).
    full_out = tmp_path / "full_ckpt"
    shutil.copytree(lora_run["out"] / "checkpoints", full_out / "checkpoints")
    config, _ = parse_config(tiny_args(tiny_assets, full_out, data_cache, **full), build_parser())
    for marker in (full_out / "checkpoints").glob(f"*/{MARKER}"):
        meta = json.loads(marker.read_text())
        meta["identity"] = run_identity(config, 8)
        marker.write_text(json.dumps(meta))
    result = run_finetune(1, tiny_args(tiny_assets, full_out, data_cache, **LORA))
    _one_paragraph_exit_2(result, "is from a full fine-tune, and this run has --lora")
    assert re.search(r"Drop --lora|--resume never", result.stderr)


@pytest.mark.slow
def test_plan_matches_the_tracker_and_both_show_the_frozen_base_saving(
    tiny_assets, data_cache, tmp_path
):
    """bf16-mixed with the default dropout (0.05), 2 micro-batches: the planner against the same
    tracker on a real 2-process run, as tests/test_plan_validation.py does for full fine-tuning."""
    overrides = {"precision": "bf16-mixed", "total_batch_size": 8, "batch_size_per_device": 2}
    args = tiny_args(
        tiny_assets, tmp_path / "run", data_cache, no_final_save=True, lora=True, **overrides
    )
    real = _measure(args, tmp_path / "step.json")
    config, _ = parse_config(args, build_parser())
    planned = estimate(config, Cluster(nodes=1, gpus_per_node=2)).memory
    assert planned.micro_batches == real.micro_batches == 2
    assert planned.state_bytes == real.state_bytes
    gc_slack = 256  # scalars the real run's garbage collector may not have freed yet
    assert 0 <= real.peak_bytes - planned.peak_bytes <= gc_slack
    for category, measured in real.peak.items():
        assert planned.peak.get(category, 0) == pytest.approx(measured, abs=gc_slack), category

    # The textbook state of a LoRA run: the frozen base in bf16 (2 bytes per parameter), the
    # adapters with fp32 weights, fp32 gradients and two AdamW moments (16 bytes), over 2 ranks;
    # full fine-tuning holds 16 bytes for every parameter.
    model, _ = _meta_lora_model(tiny_assets["model"], precision="bf16-mixed")
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert real.state_bytes == pytest.approx((2 * frozen + 16 * trainable) / 2, rel=1e-3)
    full = estimate(config.replace(lora=False), Cluster(nodes=1, gpus_per_node=2)).memory
    assert full.state_bytes == pytest.approx(16 * frozen / 2, rel=1e-3)
    adapters = len(adapted_modules(model)) * 2  # A and B: one AdamW step count (fp32) each
    assert real.optimizer_state_bytes == 8 * trainable // 2 + 4 * adapters
