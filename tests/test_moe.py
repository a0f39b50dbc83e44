"""Mixture-of-experts models: Hub-layout checkpoints (one tensor per expert) loaded into
transformers' fused expert tensors shard by shard, exported back, resumed, LoRA, the router
loss, the planner and MFU.

The end-to-end checks share two launches: one 2-process `torchrun` that runs every 2-process
training of the module in one process group (tests/trainer_runs.py), and one 1-process run for
the legs that resume on one process.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdp_utils.config.parse import build_parser, parse_config
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.hub.resolve import load_model_config
from fsdp_utils.metrics.throughput import flops_per_token
from fsdp_utils.model.build import build_meta_model, find_decoder_layers, routed_expert_parameters
from fsdp_utils.model.fused_weights import (
    FusedTensor,
    UnsupportedConversionError,
    plan_fused_tensor,
)
from fsdp_utils.model.lora import _module_names, check_target_modules, lora_targets
from fsdp_utils.model.weights import checkpoint_key_map
from fsdp_utils.parallel.distributed import DistEnv
from fsdp_utils.parallel.parallelize import build_parallel_model
from fsdp_utils.plan import StepMemory
from fsdp_utils.plan.estimate import Cluster, estimate
from fsdp_utils.synthetic import TINY_MOE_ARCHITECTURES, save_tiny_model, tiny_model_config
from fsdp_utils.train.loss import count_targets, token_loss_sum
from fsdp_utils.train.optim import build_optimizer, build_scheduler
from fsdp_utils.train.router_loss import RouterLoss, resolve_coefficient
from fsdp_utils.train.step import TrainStep
from tests.train_helpers import check_ok, read_metrics, run_script, tiny_args

DEEP = ("mixtral", "qwen3_moe")  # every check; the other families: train and export
OTHERS = tuple(arch for arch in TINY_MOE_ARCHITECTURES if arch not in DEEP)
STEPS = 8


def _shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape in a model folder's safetensors files."""
    shapes = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names = f.keys()  # a safetensors file, not a dict
            shapes.update({key: tuple(f.get_slice(key).get_shape()) for key in names})
    return shapes


@pytest.fixture(scope="module")
def moe_models(tiny_assets, tmp_path_factory) -> dict[str, Path]:
    """Each tiny MoE family saved by transformers' `save_pretrained`, with the chess tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    root = tmp_path_factory.mktemp("moe_models")
    return {
        arch: save_tiny_model(root / arch, tokenizer, arch=arch) for arch in TINY_MOE_ARCHITECTURES
    }


# --- the checkpoint layout and the plan (no training) --------------------------------------------


def test_save_pretrained_writes_one_tensor_per_expert(moe_models):
    """The tiny models have the Hub's layout: what the loader must assemble, not what the model
    holds (gpt-oss: its bf16 checkpoints are fused already)."""
    mixtral, qwen = _shapes(moe_models["mixtral"]), _shapes(moe_models["qwen3_moe"])
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in mixtral
    assert not any("gate_up_proj" in key for key in mixtral)
    assert {f"model.layers.1.mlp.experts.{e}.up_proj.weight" for e in range(4)} <= set(qwen)
    assert "model.layers.0.mlp.experts.gate_up_proj" in _shapes(moe_models["gpt_oss"])


def test_the_plan_stacks_experts_and_puts_gate_before_up(moe_models):
    """Mixtral's rule: w1 (gate) and w3 (up) of expert e fill rows e of the merge dim, gate the
    first half of the concat dim, up the second; down (w2) stacks alone."""
    folder = moe_models["mixtral"]
    plans = {
        key: source
        for key, source in checkpoint_key_map(
            build_meta_model(load_model_config(folder), "fp32"), folder
        ).items()
        if isinstance(source, FusedTensor)
    }
    assert sorted(plans) == [
        f"model.layers.{i}.mlp.experts.{name}"
        for i in (0, 1)
        for name in ("down_proj", "gate_up_proj")
    ]
    gate_up = plans["model.layers.1.mlp.experts.gate_up_proj"]
    hidden = intermediate = 64
    assert gate_up.shape == (4, 2 * intermediate, hidden)
    boxes = {
        piece.key.split("experts.")[1]: (piece.start, piece.size, piece.merged_dim)
        for piece in gate_up.pieces
    }
    assert boxes["2.w1.weight"] == ((2, 0, 0), (1, intermediate, hidden), 0)
    assert boxes["2.w3.weight"] == ((2, intermediate, 0), (1, intermediate, hidden), 0)
    assert len(boxes) == 8
    down = plans["model.layers.0.mlp.experts.down_proj"]
    assert [p.key for p in down.pieces] == [
        f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight" for e in range(4)
    ]


def test_a_rule_that_cannot_be_read_slice_by_slice_is_named():
    from transformers.core_model_loading import Interleave, MergeModulelist, WeightConverter

    converter = WeightConverter(
        source_patterns="mlp.experts.*.w13.weight",
        target_patterns="mlp.experts.gate_up_proj",
        operations=[MergeModulelist(dim=0), Interleave(dim=1)],
    )

    def sources(*experts: int) -> list[tuple[str, str, str, tuple[int, ...]]]:
        keys = [f"model.layers.0.mlp.experts.{e}.w13.weight" for e in experts]
        return [(key, key, "mlp.experts.*.w13.weight", (8, 4)) for key in keys]

    with pytest.raises(UnsupportedConversionError, match="Interleave"):
        plan_fused_tensor(converter, sources(0, 1), (2, 8, 4))
    with pytest.raises(UnsupportedConversionError, match=r"numbered \[0, 2\]"):
        plan_fused_tensor(converter, sources(0, 2), (2, 8, 4))


def test_a_quantized_checkpoint_is_refused_with_the_way_out(moe_models, tmp_path):
    """gpt-oss's Hub checkpoints hold MXFP4 blocks and scales, not trainable weights."""
    config = json.loads((moe_models["gpt_oss"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    folder = tmp_path / "gpt-oss-mxfp4"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    for path in moe_models["gpt_oss"].glob("*.safetensors"):
        (folder / path.name).symlink_to(path)
    with pytest.raises(ValueError, match=r"Mxfp4Config\(dequantize=True\)"):
        checkpoint_key_map(build_meta_model(load_model_config(folder), "fp32"), folder)


# --- LoRA targets, the router loss, MFU (no training) ----------------------------------------


def _targets(arch: str, requested: str | None):
    model = build_meta_model(tiny_model_config(arch, vocab_size=64), "fp32")
    layers = find_decoder_layers(model)
    targets = lora_targets(layers, _module_names(model, layers), requested)
    strip = lambda names: sorted({n.split(".", 3)[3] for n in names})  # noqa: E731
    return strip(targets.modules), strip(targets.parameters)


def test_lora_defaults_to_the_attention_and_can_add_the_experts():
    attention = ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
    # Qwen2-MoE's shared expert and its gate are linear layers, inside the MoE block: not default.
    for arch in TINY_MOE_ARCHITECTURES:
        assert _targets(arch, None) == (attention, []), arch
    assert _targets("mixtral", "q_proj,experts") == (
        ["self_attn.q_proj"],
        ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"],
    )
    # A name adapts every linear layer and every expert tensor it names.
    assert _targets("qwen2_moe", "down_proj") == (
        ["mlp.shared_expert.down_proj"],
        ["mlp.experts.down_proj"],
    )
    with pytest.raises(ValueError, match=r"fused expert tensors are .*experts\.gate_up_proj"):
        _targets("mixtral", "w1")
    # peft adds B @ A to the fused weight: no dropout on the experts' input.
    folder_config = tiny_model_config("mixtral", vocab_size=64)
    with pytest.raises(ValueError, match="--lora_dropout 0"):
        check_target_modules(folder_config, TrainConfig(lora=True, lora_target_modules="experts"))
    check_target_modules(
        folder_config, TrainConfig(lora=True, lora_target_modules="experts", lora_dropout=0)
    )


def test_router_loss_weight_is_the_model_configs_unless_given():
    mixtral = tiny_model_config("mixtral", vocab_size=64)
    assert resolve_coefficient(TrainConfig(), mixtral) == 0.0  # the released configs: off
    mixtral.output_router_logits = True
    assert resolve_coefficient(TrainConfig(), mixtral) == mixtral.router_aux_loss_coef
    assert resolve_coefficient(TrainConfig(router_aux_loss_coef=0.0), mixtral) == 0.0
    assert resolve_coefficient(TrainConfig(router_aux_loss_coef=0.05), mixtral) == 0.05
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        resolve_coefficient(TrainConfig(router_aux_loss_coef=0.01), tiny_model_config("llama", 64))


def test_the_router_loss_enters_the_step_with_its_coefficient(moe_models):
    """The trainer's own step (TrainStep.forward_backward) on one micro-batch (the whole step):
    the gradient of mean token loss + coef x router loss, and the router loss logged as the model
    gives it."""
    model = AutoModelForCausalLM.from_pretrained(moe_models["mixtral"])
    config = TrainConfig()
    optimizer = build_optimizer(model, config)
    router = RouterLoss(0.5)
    step = TrainStep(
        model, optimizer, build_scheduler(optimizer, config),
        config=config, world_size=1, device=torch.device("cpu"), router_loss=router,
    )  # fmt: skip
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    targets = count_targets(ids)
    step.forward_backward({"input_ids": ids, "labels": ids}, float(targets))
    stepped = {name: p.grad.clone() for name, p in model.named_parameters()}
    logged = router.step_value(float(targets))

    model.zero_grad()
    outputs = model(input_ids=ids, output_router_logits=True)
    (token_loss_sum(outputs.logits, ids) / targets + 0.5 * outputs.aux_loss).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(stepped[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert logged == pytest.approx(outputs.aux_loss.item(), rel=1e-6)


@pytest.mark.parametrize("arch", TINY_MOE_ARCHITECTURES)
def test_every_family_returns_its_router_loss(arch):
    model = AutoModelForCausalLM.from_config(tiny_model_config(arch, vocab_size=64))
    outputs = model(input_ids=torch.randint(0, 64, (2, 8)), **RouterLoss.forward_kwargs)
    # 2 of 4 experts per token: 2 when balanced, up to 4 (everything on the same 2 experts).
    assert 1.5 < outputs.aux_loss.item() <= 4.0


@pytest.mark.parametrize("arch", TINY_MOE_ARCHITECTURES)
def test_flops_count_the_routed_experts_a_token_uses(arch):
    """6N with N = everything but the embeddings and the routed experts, plus top-k / experts of
    the routed experts (2 of 4 here); a shared expert counts whole."""
    config = tiny_model_config(arch, vocab_size=64)
    model, info = build_parallel_model(
        config, TrainConfig(no_fsdp=True), DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
    )
    routed = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    assert routed == routed_expert_parameters(model) > 0
    assert info.active_parameters == info.non_embedding_parameters - routed // 2
    dense_part = flops_per_token(config, info.non_embedding_parameters - routed, 64)
    assert flops_per_token(config, info.active_parameters, 64) == pytest.approx(
        dense_part + 6 * routed / 2
    )


def test_routing_with_data_dependent_sizes_cannot_be_planned_exit_2(tmp_path, capsys):
    """transformers' default experts implementation (grouped_mm) plans (the runs below check it
    against the real step); the eager per-expert loop sizes its buffers from the routing."""
    from fsdp_utils.plan import main as plan_main

    config = tiny_model_config("mixtral", vocab_size=512).to_dict()
    config["experts_implementation"] = "eager"
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["--model", str(tmp_path), "--gpus-per-node", "2", "--max_seq_length", "64"]
    assert plan_main([*argv, "--gpu-memory", "80GiB"]) == 2
    err = capsys.readouterr().err
    assert "experts implementation 'eager'" in err and "remove experts_implementation" in err


# --- real runs --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


def _assets(tiny_assets, moe_models, arch):
    return {"model": moe_models[arch], "data": tiny_assets["data"]}


def _deep_args(assets, out, cache, **overrides):
    options = {
        "max_training_steps": STEPS,
        "save_every_steps": 3,
        "keep_last": 3,
        "router_aux_loss_coef": 0.02,
        **overrides,
    }
    return tiny_args(assets, out, cache, **options)


LORA = {
    "lora": True,
    "lora_dropout": 0,
    "lora_target_modules": "q_proj,v_proj,experts",
    "merge": True,
    "learning_rate": 1e-2,
    "max_training_steps": 6,
    "save_every_steps": 6,
}


def _launch(nproc: int, runs: list[dict], path: Path) -> subprocess.CompletedProcess[str]:
    path.write_text(json.dumps(runs))
    result = run_script(nproc, "tests/trainer_runs.py", [str(path)], timeout=900)
    check_ok(result)
    return result


@pytest.fixture(scope="module")
def runs(tiny_assets, moe_models, data_cache, tmp_path_factory) -> dict:
    """Every run of this module. On 2 processes, per deep family: the straight run (checkpoints
    at 3 and 6, probed), the first two legs of the same run stopped at 3 and 6, a LoRA run on
    attention and experts (probed), and one measured step for the planner; per other family: 4
    steps. Then, on 1 process, the last leg of each split run."""
    root = tmp_path_factory.mktemp("moe_runs")
    two: list[dict] = []
    one: list[dict] = []
    folders: dict[str, Path] = {}
    measured: dict[str, tuple[Path, list[str]]] = {}  # case -> (StepMemory JSON, its flags)

    def measure(case: str, assets: dict, **overrides) -> None:
        args = tiny_args(
            assets, root / case / "measured", data_cache, no_final_save=True,
            precision="bf16-mixed", **overrides,
        )  # fmt: skip
        measured[case] = (root / f"{case}.json", args)
        two.append({"args": args, "measure": str(root / f"{case}.json")})

    for arch in DEEP:
        assets, base = _assets(tiny_assets, moe_models, arch), root / arch
        folders[arch] = base
        two.append(
            {
                "args": _deep_args(assets, base / "straight", data_cache),
                "probe": str(base / "straight.pt"),
            }
        )
        for _ in range(2):
            two.append({"args": _deep_args(assets, base / "split", data_cache, stop_after_steps=3)})
        one.append({"args": _deep_args(assets, base / "split", data_cache)})
        lora = tiny_args(assets, base / "lora", data_cache, **LORA)
        two.append({"args": lora, "probe": str(base / "lora.pt")})
        measure(arch, assets, router_aux_loss_coef=0.02)
    # LoRA on the experts: peft's parametrization adds W + B @ A per layer to the step.
    mixtral = _assets(tiny_assets, moe_models, "mixtral")
    measure("mixtral-lora-experts", mixtral, **{**LORA, "merge": False})
    for arch in OTHERS:
        folders[arch] = root / arch
        two.append(
            {"args": tiny_args(_assets(tiny_assets, moe_models, arch), root / arch, data_cache)}
        )
    result = _launch(2, two, root / "two.json")
    last_legs = _launch(1, one, root / "one.json")
    return {
        "folders": folders,
        "measured": measured,
        "stdout": result.stdout,
        "last_legs": last_legs.stdout,
    }


@pytest.mark.slow
@pytest.mark.parametrize("arch", DEEP)
def test_two_process_run_learns_and_logs_the_router_loss(runs, arch):
    records = read_metrics(runs["folders"][arch] / "straight")
    losses = [r["loss"] for r in records]
    assert len(losses) == STEPS
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05
    # Balanced routing gives top-k (2); the loss is logged on its own, beside the LM loss.
    assert all(1.9 < r["aux_loss"] < 4.0 for r in records)
    assert "router loss: load balancing x 0.02, logged as aux_loss" in runs["stdout"]
    assert " | aux " in runs["stdout"]
    config = json.loads((runs["folders"][arch] / "straight" / "config.json").read_text())
    resolved = config["resolved"]
    assert resolved["active_non_embedding_parameters"] < resolved["non_embedding_parameters"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", DEEP)
def test_the_final_model_has_the_sources_layout_and_the_trained_logits(runs, moe_models, arch):
    """What vLLM and from_pretrained read: the source checkpoint's names and shapes (one tensor
    per expert), holding the trained weights."""
    final = runs["folders"][arch] / "straight" / "final"
    assert _shapes(final) == _shapes(moe_models[arch])
    probe = torch.load(runs["folders"][arch] / "straight.pt")
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("arch", DEEP)
def test_resume_is_exact_two_to_two_then_two_to_one(runs, tmp_path, arch):
    """Straight on 2 processes == stopped at 3 and 6 and resumed on 2, then on 1 process, the
    router loss included (the same --batch_size_per_device forms the same micro-batches), and
    the offline export of the last checkpoint is the final model."""
    from fsdp_utils.checkpoint.export import export_checkpoint

    base = runs["folders"][arch]
    straight, split = read_metrics(base / "straight"), read_metrics(base / "split")
    assert [r["step"] for r in split] == list(range(1, STEPS + 1))
    assert [r["batch_id"] for r in split] == [r["batch_id"] for r in straight]
    for key in ("loss", "aux_loss"):
        assert [r[key] for r in split] == pytest.approx(
            [r[key] for r in straight], rel=1e-5, abs=1e-6
        )
    assert "resumed from step 6" in runs["last_legs"]

    exported = export_checkpoint(
        base / "split" / "checkpoints" / f"step_{STEPS:08d}", tmp_path / "exported"
    )
    assert _shapes(exported) == _shapes(base / "split" / "final")
    final = AutoModelForCausalLM.from_pretrained(base / "split" / "final").state_dict()
    reloaded = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert all(torch.equal(final[k], reloaded[k]) for k in final)


@pytest.mark.slow
@pytest.mark.parametrize("arch", DEEP)
def test_lora_on_attention_and_experts_exports_what_it_trained(runs, moe_models, tmp_path, arch):
    """peft's target_parameters under FSDP2: the adapter folder on its base under PEFT, and the
    merged model (in the source's layout), give the trained model's logits."""
    from peft import PeftModel

    base = runs["folders"][arch]
    probe = torch.load(base / "lora.pt")
    expert_b = [v for k, v in probe["state"].items() if ".experts." in k and ".lora_B." in k]
    assert len(expert_b) == 4 and all(v.abs().max() > 0 for v in expert_b)  # they start at 0
    adapter_config = json.loads((base / "lora" / "final" / "adapter_config.json").read_text())
    assert adapter_config["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    assert sorted(adapter_config["target_modules"]) == ["q_proj", "v_proj"]
    input_ids = probe["input_ids"]
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(moe_models[arch])
        peft = PeftModel.from_pretrained(model, base / "lora" / "final").eval()
        with_adapter = peft(input_ids=input_ids).logits
        merged_dir = base / "lora" / "final_merged"
        merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()(input_ids=input_ids).logits
    torch.testing.assert_close(with_adapter, probe["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, with_adapter, rtol=1e-4, atol=1e-4)
    assert _shapes(merged_dir) == _shapes(moe_models[arch])

    # The offline export of the checkpoint (one CPU process, base read by the sliced loader).
    from fsdp_utils.checkpoint.export import export_checkpoint

    checkpoint = base / "lora" / "checkpoints" / "step_00000006"
    exported = export_checkpoint(checkpoint, tmp_path / "merged", merge=True, base=moe_models[arch])
    assert _shapes(exported) == _shapes(moe_models[arch])
    reference = AutoModelForCausalLM.from_pretrained(merged_dir).state_dict()
    reloaded = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert all(torch.equal(reference[k], reloaded[k]) for k in reference)


@pytest.mark.slow
@pytest.mark.parametrize("case", [*DEEP, "mixtral-lora-experts"])
def test_the_plan_is_the_measured_step(runs, case):
    """Every expert's weights, gradients and AdamW state, and the routed experts' activations
    (and with LoRA on the experts, the W + B @ A that peft builds per layer): the planner's
    fake-tensor trace equals the tracker on the real 2-process step."""
    path, args = runs["measured"][case]
    real = StepMemory.from_dict(json.loads(path.read_text()))
    config, _ = parse_config(args, build_parser())
    planned = estimate(config, Cluster(nodes=1, gpus_per_node=2)).memory
    assert planned.state_bytes == real.state_bytes
    gc_slack = 256  # scalars the real run's garbage collector may not have freed yet
    assert 0 <= real.peak_bytes - planned.peak_bytes <= gc_slack
    for category, measured in real.peak.items():
        assert planned.peak.get(category, 0) == pytest.approx(measured, abs=gc_slack), category


@pytest.mark.slow
@pytest.mark.parametrize("arch", OTHERS)
def test_other_families_train_and_export_the_sources_layout(runs, moe_models, arch):
    losses = [r["loss"] for r in read_metrics(runs["folders"][arch])]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert _shapes(runs["folders"][arch] / "final") == _shapes(moe_models[arch])


@pytest.mark.slow
def test_each_rank_reads_only_the_rows_of_its_shard(moe_models, tmp_path):
    """2 real processes: 4 experts over 2 ranks; 3 experts (FSDP2 pads, ranks hold 2 and 1); and
    fused tensors sharded on dim 1, which splits inside every expert. Each rank reads exactly
    what its shards hold, and the gathered model is from_pretrained's."""
    uneven = tiny_model_config("qwen3_moe", vocab_size=64, hidden_size=32)
    uneven.num_experts = 3
    folders = [moe_models["mixtral"], tmp_path / "qwen3-3-experts", tmp_path / "mixtral-dim1"]
    AutoModelForCausalLM.from_config(uneven).save_pretrained(folders[1])
    folders[2].symlink_to(moe_models["mixtral"], target_is_directory=True)
    out = tmp_path / "loaded.json"
    check_ok(run_script(2, "tests/fused_load_probe.py", [str(out), *map(str, folders)]))
    results = json.loads(out.read_text())
    for name, result in results.items():
        assert result["different"] == [], name
        assert len(result["fused"]) == 4, name  # gate_up and down of 2 layers
        for read, held in result["counts"]:
            assert read == held, name
        assert sum(read for read, _ in result["counts"]) == result["full"], name
    held = [held for _, held in results["qwen3-3-experts"]["counts"]]
    assert held[0] == 2 * held[1]  # experts 0-1 and 2
