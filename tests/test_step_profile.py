"""Where a step's time goes (fsdp_utils/metrics/step_profile.py), on a recorded CPU trace of a
real 2-process step (tests/fixtures/step_profile/), on a small GPU trace written by hand, and on
public CUDA kernel names, so that a lent GPU only has to run it."""

from __future__ import annotations

import pytest

from fsdp_utils.metrics.step_profile import BUCKETS, breakdown, classify, describe, read_trace
from tests.train_helpers import REPO_ROOT

FIXTURE = REPO_ROOT / "tests" / "fixtures" / "step_profile" / "cpu_step.pt.trace.json.gz"

# Kernel names as public PyTorch profiles and Nsight reports print them (the excerpts in
# pytorch/pytorch issues on SDPA backends, torchtitan and Megatron-FSDP comparisons, cuBLAS's
# Hopper `nvjet` family, NCCL's device kernels, inductor's `triton_{poi,red,per}_fused_*`),
# liger-kernel 0.8.5's Triton functions, and torch's own CUDA kernels; each checked by hand.
KERNELS = [
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn", "matrix products"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas", "matrix products"),
    ("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NNT", "matrix products"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)", "matrix products"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> >, true, false, false, false, false, false, false>(pytorch_flash::Flash_bwd_params)", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)", "attention"),
    ("fmha_cutlassB_bf16_aligned_128x128_k128_sm80", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    ("cudnn::fusion::compute_dot_do_o", "attention"),
    ("triton_poi_fused__to_copy_add_mul_rsqrt_0", "fused kernels"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", "fused kernels"),
    ("triton_per_fused_add_mul_silu_2", "fused kernels"),
    ("_rms_norm_forward_kernel", "fused kernels"),
    ("_swiglu_backward_kernel", "fused kernels"),
    ("_triton_rope", "fused kernels"),
    ("liger_cross_entropy_kernel", "loss"),
    ("nll_loss_forward_reduce_cuda_kernel_2d<float, long>", "loss"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>>", "optimizer"),
    ("void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<2>, at::native::BinaryOpListAlphaFunctor<float, 2, 2, 0>, std::plus<float>, float>", "optimizer"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collectives"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collectives"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)", "elementwise and reductions"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, unsigned int, float, 4, 4> >", "elementwise and reductions"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy_aligned16_contig<at::native::(anonymous namespace)::OpaqueType<2u>, unsigned int, 1, 128, 1>", "elementwise and reductions"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "bucket"), KERNELS, ids=[n[:40] for n, _ in KERNELS])
def test_public_kernel_names_land_in_their_buckets(name, bucket):
    assert classify(name) == bucket


def test_where_a_kernel_was_launched_decides_before_its_name():
    copy = "void at::native::(anonymous namespace)::CatArrayBatchedCopy_aligned16_contig<>"
    assert (
        classify(copy, ("FSDP::all_gather_copy_out (model.layers.0)", "aten::cat")) == "FSDP copies"
    )
    softmax = "void (anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>"
    assert classify(softmax, ("_LinearNLLSum", "aten::_log_softmax")) == "loss"
    gemm = "nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NNT"
    assert classify(gemm, ("_LinearNLLSum", "aten::mm")) == "loss"  # the fused loss's products
    assert classify(gemm, ("aten::_scaled_dot_product_attention_math", "aten::bmm")) == "attention"
    assert classify("Memcpy DtoH (Device -> Pageable)", category="gpu_memcpy") == "memory copies"
    add = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>"
    assert classify(add, ("Optimizer.step#AdamW.step", "aten::add_")) == "optimizer"


def test_the_recorded_cpu_step_by_bucket():
    """Rank 0's step: 2 micro-batches of 2 x 64 tokens through 2 layers (linears 64 -> 64, 32,
    32, 64, 128, 128, 128 -> 64: 36,864 weights each), FSDP2 over gloo, the fused loss."""
    step = breakdown(read_trace(FIXTURE))
    assert step.device == "cpu" and step.step == "ProfilerStep#1"
    assert set(step.buckets) == set(BUCKETS)
    for bucket in ("matrix products", "attention", "elementwise and reductions", "optimizer",
                   "FSDP copies", "collectives", "loss"):  # fmt: skip
        assert step.buckets[bucket] > 0, bucket
    assert step.buckets["fused kernels"] == step.buckets["memory copies"] == 0  # eager, CPU
    # The layers' products, forward and the two of backward: 6 x tokens x weights, exactly
    # (the output layer's are in the fused loss's bucket)
    assert step.matmul_flops == 6 * 256 * (2 * 36_864)
    # Busy time is the union, counted once however the activities nest or overlap
    assert 0 < step.busy_us <= step.wall_us
    assert step.idle_us == pytest.approx(step.wall_us - step.busy_us)
    # A CPU step has no CUDA runtime; what reads tensor values on the host is counted
    assert step.host_syncs == step.device_to_host == 0 and step.host_reads > 0
    table = describe(step, bare_tflops=1.0)
    assert "| matrix products |" in table and "of a bare matmul's 1.0" in table


def _kernel(name: str, ts: float, dur: float, external: int, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7,
            "args": {"External id": external}}  # fmt: skip


def _op(name: str, ts: float, dur: float, external: int | None = None, **args: object) -> dict:
    cat = "cpu_op" if external is not None else "user_annotation"
    ids = {"External id": external} if external is not None else {}
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1,
            "args": {**ids, **args}}  # fmt: skip


def test_a_gpu_step_by_hand():
    """A 100 us step on the host that launches a product (20 us on the GPU), an attention kernel
    overlapping it by 5 us (10 us), an all-gather on another stream (30 us), a DtoH copy (2 us)
    and syncs: busy 20 + 10 - 5 + 30 + 2 = 57 us, the step's wall time to the copy's end (110)."""
    events = [
        _op("ProfilerStep#3", 0, 100),
        _op("aten::mm", 10, 5, 1, **{"Input Dims": [[1024, 512], [512, 256]]}),
        _op("aten::_scaled_dot_product_flash_attention", 20, 5, 2),
        _op("FSDP::all_gather", 30, 10),
        _op("c10d::_allgather_base_", 31, 5, 3),
        _op("aten::item", 60, 40, 4),
        _op("aten::_local_scalar_dense", 61, 39, 5),
        _kernel("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NNT", 20, 20, 1),
        _kernel("void pytorch_flash::flash_fwd_kernel<>", 35, 10, 2),
        _kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 50, 30, 3),
        _kernel("Memcpy DtoH (Device -> Pageable)", 108, 2, 5, cat="gpu_memcpy"),
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaStreamSynchronize",
            "ts": 62,
            "dur": 37,
            "pid": 1,
            "tid": 1,
            "args": {},
        },
        _kernel("void at::native::vectorized_elementwise_kernel<>", 500, 1, 99),  # another step
    ]
    step = breakdown({"traceEvents": events})
    assert step.device == "cuda" and step.activities == 4
    assert step.buckets["matrix products"] == 20 and step.buckets["attention"] == 10
    assert step.buckets["collectives"] == 30 and step.buckets["memory copies"] == 2
    assert step.wall_us == 110 and step.busy_us == 57 and step.idle_us == 53
    assert step.host_syncs == 1 and step.device_to_host == 1 and step.host_reads == 1
    assert step.matmul_flops == 2 * 1024 * 512 * 256
    assert step.matmul_tflops == pytest.approx(2 * 1024 * 512 * 256 / 20e-6 / 1e12)
