"""The kernel levers of issue 60 (part B), each against the default path: op-level selective
checkpointing (`--checkpoint_mode op`), grouped-query SDPA without key/value copies and
`--sdpa_backend` (fsdp_utils/model/sdpa.py), `--liger_kernels`' refusals and family table.

One 2-process FSDP2 launch (gloo, packed documents, so that SDPA gets a mask and grouped key-value
heads) trains the tiny Llama three ways: whole-layer checkpointing, op-level checkpointing, and
whole-layer checkpointing with the math kernel; the checks read its folders."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fsdp_utils.config.parse import parse_config
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.document_masking import document_position_ids
from fsdp_utils.model import liger
from fsdp_utils.model.attention import check_attn_implementation
from fsdp_utils.model.build import find_decoder_layers
from fsdp_utils.model.sdpa import sdpa_attention, use_sdpa_backend
from fsdp_utils.parallel.parallelize import apply_activation_checkpointing
from fsdp_utils.parallel.selective_checkpoint import op_policy
from fsdp_utils.synthetic import TINY_ARCHITECTURES, tiny_model_config
from tests.train_helpers import read_metrics, run_finetunes, tiny_args

RUNS = {
    "layer": {"gradient_checkpointing": True},
    "op": {"gradient_checkpointing": True, "checkpoint_mode": "op"},
    "math": {"gradient_checkpointing": True, "sdpa_backend": "math"},
}


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kernels")
    data_cache = root / "data_cache"
    argv = {
        name: tiny_args(tiny_assets, root / name, data_cache, document_masking=True, **overrides)
        for name, overrides in RUNS.items()
    }
    results = run_finetunes(2, argv, root / "launch")
    failed = {name: r for name, r in results.items() if r["exit_code"] != 0}
    assert not failed, failed
    return {**{name: root / name for name in RUNS}, "output": root / "launch" / "output.txt"}


def _losses(folder: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(folder)]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "final" / "model.safetensors")


# --- op-level selective checkpointing ------------------------------------------------------


def _tiny_llama(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_model_config("llama", 100, num_layers=layers))


def test_the_op_policy_saves_attention_and_every_second_matmul():
    """In a Llama layer the products run q, k, v, o, gate, up, down: q, v, gate and down are
    saved (widths 64, 32, 128, 64 in the tiny model: 4 heads and 2 key-value heads of 16, an
    MLP of 128), k, o and up recomputed, with the attention's output."""
    layer = find_decoder_layers(_tiny_llama())[0]
    decisions: list[tuple[bool, str, object]] = []

    def contexts():
        policy = op_policy()

        def logged(ctx, func, *args, **kwargs):
            decision = policy(ctx, func, *args, **kwargs)
            decisions.append((ctx.is_recompute, str(func), decision))
            return decision

        return create_selective_checkpoint_contexts(logged)

    hidden = torch.randn(2, 16, 64, requires_grad=True)
    positions = torch.arange(16).expand(2, 16)
    rotary = _tiny_llama().model.rotary_emb(hidden, positions)

    def forward(h: torch.Tensor) -> torch.Tensor:
        out = layer(h, position_embeddings=rotary, position_ids=positions)
        return out[0] if isinstance(out, tuple) else out

    out = checkpoint(forward, hidden, use_reentrant=False, context_fn=contexts)
    out.sum().backward()
    forward = [(func, decision.name) for recompute, func, decision in decisions if not recompute]
    saved = [func for func, decision in forward if decision == "MUST_SAVE"]
    assert saved.count("aten._scaled_dot_product_flash_attention_for_cpu.default") >= 1
    matmuls = [func for func, _ in forward if func == "aten.mm.default"]
    assert len(matmuls) % 7 == 0 and saved.count("aten.mm.default") == 4 * len(matmuls) // 7
    # what is recomputed in backward: everything else, the cheap ops among it
    assert {"aten.silu.default", "aten.rsqrt.default"} <= {
        func for func, decision in forward if decision == "PREFER_RECOMPUTE"
    }


def test_the_op_policy_counts_float8_products_among_the_matmuls():
    """--float8's layers multiply with `aten._scaled_mm` (torchao's Float8Linear): counted with
    the other products, every second one saved, in the forward and the recompute alike."""
    from types import SimpleNamespace

    policy = op_policy()
    scaled_mm, mm = torch.ops.aten._scaled_mm.default, torch.ops.aten.mm.default
    for recompute in (False, True):
        ctx = SimpleNamespace(is_recompute=recompute)
        decisions = [policy(ctx, func).name for func in (scaled_mm, scaled_mm, mm, scaled_mm)]
        assert decisions == ["MUST_SAVE", "PREFER_RECOMPUTE", "MUST_SAVE", "PREFER_RECOMPUTE"]


def test_op_level_checkpointing_gives_the_same_gradients_bit_for_bit():
    reference = _tiny_llama(layers=4)
    ids = torch.randint(0, 100, (2, 32))
    grads = {}
    for mode in (None, "layer", "op"):
        model = _tiny_llama(layers=4)
        model.load_state_dict(reference.state_dict())
        if mode is not None:
            apply_activation_checkpointing(
                model, find_decoder_layers(model), every_n=2 if mode == "layer" else 1, mode=mode
            )
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grads[mode] = {
            name.replace("_checkpoint_wrapped_module.", ""): p.grad
            for name, p in model.named_parameters()
        }
    for mode in ("layer", "op"):
        for name, grad in grads[None].items():
            assert torch.equal(grad, grads[mode][name]), (mode, name)


def test_checkpoint_mode_needs_checkpointing():
    assert (
        parse_config(["--gradient_checkpointing", "--checkpoint_mode", "op"])[0].checkpoint_mode
        == "op"
    )
    with pytest.raises(ValueError, match="add --gradient_checkpointing"):
        parse_config(["--checkpoint_mode", "op"])


@pytest.mark.slow
def test_op_level_runs_train_as_whole_layers_do_on_two_processes(runs):
    layer, op = _losses(runs["layer"]), _losses(runs["op"])
    assert len(layer) == 4 and layer[-1] < layer[0]
    assert op == layer  # bit for bit
    expected = _weights(runs["layer"])
    got = _weights(runs["op"])
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name
    output = runs["output"].read_text()
    assert "activation checkpointing (op-level: attention and every second matmul saved)" in output


# --- SDPA: grouped key-value heads without copies, the backend ---------------------------


def test_grouped_heads_with_a_mask_are_not_copied_and_compute_the_same():
    """Packed documents (a mask) and 4 query heads over 2 key-value heads: the SDPA function
    passes the grouped heads (enable_gqa) where transformers repeats them, with the same logits
    and gradients bit for bit."""
    model = _tiny_llama()
    ids = torch.randint(3, 100, (2, 32))
    ids[0, 10] = ids[1, 5] = ids[1, 20] = 2  # document ends
    positions = document_position_ids(ids, 2)
    results = {}
    try:
        for name, function in (("transformers", sdpa_attention_forward), ("ours", sdpa_attention)):
            AttentionInterface.register("sdpa", function)
            model.zero_grad()
            with torch.profiler.profile(record_shapes=True) as profile:
                out = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
                out.loss.backward()
            # the key heads each SDPA call got: the query's 4 (copies) or the model's 2
            key_heads = [
                e.input_shapes[1][1] for e in profile.events()
                if e.name == "aten::_scaled_dot_product_flash_attention_for_cpu"
            ]  # fmt: skip
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            results[name] = (out.logits.detach(), grads, key_heads)
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)
    (logits, grads, heads), (our_logits, our_grads, our_heads) = results.values()
    assert torch.equal(logits, our_logits)
    assert all(torch.equal(grads[n], our_grads[n]) for n in grads)
    assert heads == [4, 4] and our_heads == [2, 2]  # one call per layer


def test_backends_the_cpu_cannot_run_are_refused():
    llama = tiny_model_config("llama", 512)

    def error(device_type="cpu", **options):
        with pytest.raises(ValueError) as err:
            check_attn_implementation(llama, TrainConfig(**options), device_type=device_type)
        assert "\n" not in str(err.value)
        return str(err.value)

    for backend in ("cudnn", "efficient"):
        assert "flash (its CPU flash kernel) and math" in error(sdpa_backend=backend)
    for backend in ("flash", "math", "auto"):
        check_attn_implementation(llama, TrainConfig(sdpa_backend=backend), device_type="cpu")
    assert "runs eager" in error(sdpa_backend="math", attn_implementation="eager")
    assert "--precision bf16-mixed" in error("cuda", sdpa_backend="flash", precision="fp32")
    assert "takes no attention mask" in error("cuda", sdpa_backend="flash", document_masking=True)


def test_the_math_backend_runs_the_math_kernel():
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    try:
        for backend, op in (("math", "aten::_scaled_dot_product_attention_math"),
                            ("flash", "aten::_scaled_dot_product_flash_attention_for_cpu")):  # fmt: skip
            use_sdpa_backend(backend)
            with torch.profiler.profile() as profile:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            assert op in {e.name for e in profile.events()}, backend
    finally:
        use_sdpa_backend("auto")


def test_a_kernel_without_grouped_heads_takes_the_copies_instead_of_failing(monkeypatch):
    """`gqa_keeps_kernel` answers False, not torch's "no viable backend", where no allowed
    kernel takes the grouped call (on the CPU, `efficient` leaves none); and a masked GQA run
    whose kernel takes only repeated heads (transformers' repeat_kv path) is not refused."""
    from torch.backends import cuda

    from fsdp_utils.model.sdpa import backend_refusal, gqa_keeps_kernel

    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    assert gqa_keeps_kernel(q, kv, kv, mask)  # the CPU's flash kernel takes both
    try:
        use_sdpa_backend("efficient")
        assert not gqa_keeps_kernel(q, kv, kv, mask)
    finally:
        use_sdpa_backend("auto")

    asked = []

    def efficient(params, debug):  # as torch 2.11's CUDA check: grouped heads, no mask only
        asked.append((params.key.shape[1], params.enable_gqa, params.attn_mask is not None))
        if params.enable_gqa and params.attn_mask is not None:
            warnings.warn("efficient takes no enable_gqa with a mask.", stacklevel=2)
            return False
        return True

    monkeypatch.setattr(cuda, "can_use_efficient_attention", efficient)
    llama = tiny_model_config("llama", 512)  # 4 query heads over 2 key-value heads
    config = TrainConfig(sdpa_backend="efficient", document_masking=True, max_seq_length=64)
    meta = torch.device("meta")
    assert backend_refusal(config, llama, meta) is None
    assert asked == [(2, True, True), (4, False, True)]  # grouped, then repeated
    monkeypatch.setattr(cuda, "can_use_efficient_attention", lambda *a: False)
    refusal = backend_refusal(config, llama, meta)
    assert refusal is not None and "4 heads over 2 key-value heads" in refusal


def test_generation_falls_back_to_math_and_keeps_the_chosen_kernel_first():
    """Decoding and scoring under a restricted --sdpa_backend: math is allowed beside the
    chosen kernel (on the CPU, `efficient` leaves no kernel at all, as flash does on a GPU for
    a padding mask), the chosen kernel still runs where it can, and the process's setting and
    torch's order are as before afterwards."""
    from fsdp_utils.parallel.generate import continuation_logprobs, continue_prompts

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_model_config("llama", 512)).eval()
    cpu = torch.device("cpu")
    priority = torch._C._get_sdp_priority_order()

    def generate() -> tuple[list[list[int]], set[str]]:
        with torch.no_grad(), torch.profiler.profile() as profile:
            done = continue_prompts(
                model, [[5, 6, 7, 8], [9, 10]], pad_token_id=0, eos_token_id=2,
                max_new_tokens=3, device=cpu,
            )  # fmt: skip
            continuation_logprobs(
                model, [[5, 6], [7]], [[[8], [9, 10]], [[11]]], pad_token_id=0, device=cpu,
                batch_size=2,
            )  # fmt: skip
        return [g.tokens for g in done], {e.name for e in profile.events()}

    try:
        expected, _ = generate()
        for backend, op in (("efficient", "aten::_scaled_dot_product_attention_math"),
                            ("flash", "aten::_scaled_dot_product_flash_attention_for_cpu")):  # fmt: skip
            use_sdpa_backend(backend)
            tokens, ops = generate()
            assert tokens == expected, backend
            assert op in ops, backend
            assert not torch.backends.cuda.math_sdp_enabled()  # training: the chosen alone
        assert "aten::_scaled_dot_product_attention_math" not in ops  # flash first, not math
        assert torch._C._get_sdp_priority_order() == priority
    finally:
        use_sdpa_backend("auto")


@pytest.mark.slow
def test_the_log_names_the_kernel_and_math_trains_as_flash_does(runs):
    records = {name: read_metrics(runs[name], "attention_kernels") for name in ("layer", "math")}
    # 2 layers x 2 micro-batches, each forward again in backward (checkpointing's recompute)
    assert [r["kernels"] for r in records["layer"]] == [{"flash (CPU)": 2 * 2 * 2}]
    assert [r["kernels"] for r in records["math"]] == [{"math": 2 * 2 * 2}]
    output = runs["output"].read_text()
    assert (
        "attention: SDPA ran flash (CPU) in step 1 (--sdpa_backend auto, torch's choice)" in output
    )
    assert "attention: SDPA ran math in step 1 (--sdpa_backend math, the only kernel" in output
    # Another kernel sums in another order: fp32 rounding apart (docs/attention.md's tolerance:
    # losses within 1e-6; weights within 1e-4, AdamW moving each by about lr = 3e-3 a step
    # whatever its gradient's size, so a gradient at rounding level can move either way)
    assert _losses(runs["math"]) == pytest.approx(_losses(runs["layer"]), rel=1e-6)
    expected, got = _weights(runs["layer"]), _weights(runs["math"])
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-4)


# --- liger-kernel ---------------------------------------------------------------------------


def test_liger_is_refused_on_the_cpu_and_for_families_it_lacks():
    llama = tiny_model_config("llama", 512)
    config = TrainConfig(liger_kernels=True)
    with pytest.raises(
        ValueError, match=r"^--liger_kernels needs a CUDA GPU .* drop --liger_kernels\.$"
    ):
        liger.check_liger_kernels(llama, config, device_type="cpu")
    liger.check_liger_kernels(llama, TrainConfig(), device_type="cpu")  # off: nothing to check
    with pytest.raises(ValueError, match="liger-kernel has no kernels for gpt2 models"):
        liger.check_liger_kernels(tiny_model_config("gpt2", 512), config, device_type="cuda")
    # On a GPU node without the package: where to install it (the check reached the import)
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"pip install 'liger-kernel>=0\.8\.5'"):
            liger.check_liger_kernels(llama, config, device_type="cuda")


def test_liger_families_are_those_it_patches():
    """Every tiny family of the test suite either has liger-kernel 0.8.5's function (its
    MODEL_TYPE_TO_APPLY_LIGER_FN, by name) or is refused with the list."""
    liger_table = {  # liger_kernel/transformers/monkey_patch.py, 0.8.5, for our families
        "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
        "granite", "mixtral", "qwen3_moe", "gpt_oss",
    }  # fmt: skip
    assert set(liger.FUNCTIONS) == liger_table
    for model_type, name in liger.FUNCTIONS.items():
        assert name == f"apply_liger_kernel_to_{model_type}"
    for arch in TINY_ARCHITECTURES:
        model_type = tiny_model_config(arch, 512).model_type
        if model_type in liger_table:
            assert liger.function_name(model_type) == liger.FUNCTIONS[model_type]
        else:
            with pytest.raises(ValueError, match="Drop --liger_kernels"):
                liger.function_name(model_type)


def test_liger_reaches_the_model_build_and_the_preflight(tiny_assets, tmp_path, capsys):
    from fsdp_utils.cli import main

    args = ["--model", str(tiny_assets["model"]), "--dataset", str(tiny_assets["data"]),
            "--dataset_include", "", "--output_dir", str(tmp_path / "run"),
            "--max_seq_length", "64", "--total_batch_size", "8", "--preflight",
            "--world_size", "2", "--gpu_memory", "off", "--device", "cpu"]  # fmt: skip
    assert main([*args, "--liger_kernels"]) == 2
    err = capsys.readouterr().err
    assert "error: --liger_kernels needs a CUDA GPU" in err and "Traceback" not in err
    assert main([*args, "--sdpa_backend", "cudnn"]) == 2
    assert "--sdpa_backend cudnn is a CUDA kernel" in capsys.readouterr().err
    assert json.loads(TrainConfig(liger_kernels=True).to_json())["liger_kernels"] is True


def test_the_login_node_leaves_the_gpu_checks_to_the_gpu_node(
    tiny_assets, tmp_path, capsys, monkeypatch
):
    """slurm/submit.py's preflight on a login node without GPUs (--login_node; --device auto)
    and --device cuda where no GPU is visible: what needs the run's GPU is left to the trainer,
    with one line, no refusal and no traceback; a CPU run is still refused."""
    from fsdp_utils.cli import main
    from fsdp_utils.model.float8 import EMULATE_VARIABLE

    monkeypatch.delenv(EMULATE_VARIABLE, raising=False)
    args = ["--model", str(tiny_assets["model"]), "--dataset", str(tiny_assets["data"]),
            "--dataset_include", "", "--output_dir", str(tmp_path / "run"),
            "--max_seq_length", "64", "--total_batch_size", "8", "--preflight",
            "--world_size", "2", "--gpu_memory", "off", "--float8", "rowwise",
            "--sdpa_backend", "cudnn"]  # fmt: skip
    for where in (["--device", "auto", "--login_node"], ["--device", "cuda"]):
        assert main([*args, *where]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "checked again by the trainer at its start on the GPU node" in out
    assert main([*args, "--device", "auto"]) == 2  # the sbatch preflight: this is the run's host
    assert "this run is on the CPU" in capsys.readouterr().err
    # the options' own mistakes are still found on the login node
    assert main([*args, "--login_node", "--precision", "fp32"]) == 2
    assert "--sdpa_backend cudnn computes in fp16 or bf16 only" in capsys.readouterr().err


def test_the_planner_stands_in_for_the_kernels_it_cannot_run():
    """The CPU planner traces cudnn, flash and efficient as its flash kernel and liger's layers
    as the eager ones, and says so (math it traces as math: tests/test_attention.py)."""
    from fsdp_utils.plan.estimate import _kernels_to_trace

    traced, note = _kernels_to_trace(TrainConfig(sdpa_backend="cudnn", liger_kernels=True))
    assert (traced.sdpa_backend, traced.liger_kernels) == ("auto", False)
    assert note == (
        "; --sdpa_backend cudnn traced as the CPU's flash kernel"
        "; --liger_kernels planned as the eager layers (the safe side)"
    )
    assert _kernels_to_trace(TrainConfig(sdpa_backend="math")) == (
        TrainConfig(sdpa_backend="math"),
        "",
    )
