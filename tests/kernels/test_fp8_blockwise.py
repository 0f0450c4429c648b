"""Blockwise FP8 kernels against their torch references (interpreter on the CPU, compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

from rollout_kernels.fp8_blockwise import (cublas_blockwise_matmul, fp8_blockwise_matmul, fp8_linear,
                                           quantize_activation)
from rollout_kernels.fp8_blockwise_ref import (FP8_DTYPE, FP8_MAX, dequantize_weight_blockwise, fp8_blockwise_matmul_ref,
                                               quantize_activation_ref, quantize_weight_blockwise)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
E4M3_REL = 2.0**-4  # 3 mantissa bits: rounding to nearest moves a normal value by at most 1/16 of it
E4M3_MIN_SUBNORMAL = 2.0**-9
# Hopper's e4m3 tensor-core dot does not add its products in full float32 (measured on the H100: up to
# 1.3e-3 off the exact float32 sum at outputs of size ~1, K <= 384); the interpreter's dot is exact
DOT_TOL = 3e-3 if CUDA else 1e-5


def _randn(*shape, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEV)


@pytest.mark.parametrize("n,k,block", [(256, 384, (128, 128)), (130, 200, (128, 128)), (96, 80, (32, 16))])
def test_weight_blocks_take_their_amax_to_448_and_round_within_e4m3(n, k, block):
    w = _randn(n, k, seed=n + k, scale=0.02)
    w[0, 0] = 3.0  # an outlier owns its block's scale, not the others'
    q, scale = quantize_weight_blockwise(w, block)
    nb, kb = -(-n // block[0]), -(-k // block[1])
    assert q.dtype == FP8_DTYPE and q.shape == (n, k) and scale.shape == (nb, kb)
    for i in range(nb):
        for j in range(kb):
            tile = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            assert scale[i, j].item() == pytest.approx(tile.abs().max().item() / FP8_MAX, rel=1e-6)
            qtile = q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            assert qtile.abs().max().item() == FP8_MAX  # the block's largest entry lands on 448
    back = dequantize_weight_blockwise(q, scale, block)
    scale_rows = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    bound = w.abs() * E4M3_REL + scale_rows * E4M3_MIN_SUBNORMAL
    assert ((back - w).abs() <= bound * 1.0001).all()
    assert scale[0, 0] > 10 * scale[-1, -1]  # 3.0 against a 0.02-sigma block's ~0.09


@pytest.mark.parametrize("m,k,group", [(1, 128, 128), (5, 300, 128), (33, 64, 32)])
def test_activation_quantization_matches_the_reference(m, k, group):
    x = _randn(m, k, seed=m * k, scale=3.0)
    x[0, :7] = 0.0
    if m > 1:
        x[1] = 0.0  # an all-zero row: a tiny scale, zeros out, no NaN
    q, scale = quantize_activation(x, group)
    q_ref, scale_ref = quantize_activation_ref(x, group)
    assert q.dtype == FP8_DTYPE and scale.shape == (m, -(-k // group))
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())
    assert not q.float().isnan().any()


def test_activation_scales_outer_major_for_cublas():
    """scale_outer_major: the same scales, laid out [M, KB] with strides (1, M) as cuBLASLt reads them."""
    x = _randn(5, 300, seed=9, scale=2.0)
    q, scale = quantize_activation(x, 128, scale_outer_major=True)
    q_ref, scale_ref = quantize_activation_ref(x, 128)
    assert scale.shape == (5, 3) and scale.stride() == (1, 5)
    assert torch.equal(scale, scale_ref) and torch.equal(q.float(), q_ref.float())


@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (7, 130, 200), (65, 256, 384), (3, 64, 96)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32] + ([torch.bfloat16] if CUDA else []))
def test_blockwise_matmul_matches_the_reference(m, n, k, bias, out_dtype):
    block = (64, 32) if n == 64 else (128, 128)
    x_q, x_scale = quantize_activation_ref(_randn(m, k, seed=1), block[1])
    w_q, w_scale = quantize_weight_blockwise(_randn(n, k, seed=2, scale=0.05), block)
    b = _randn(n, seed=3) if bias else None
    config = {"BLOCK_M": 64, "BLOCK_N": min(64, block[0]), "num_warps": 4, "num_stages": 3}
    got = fp8_blockwise_matmul(x_q, x_scale, w_q, w_scale, out_dtype, b, block, config)
    want = fp8_blockwise_matmul_ref(x_q, x_scale, w_q, w_scale, out_dtype, b, block)
    assert got.dtype == out_dtype and got.shape == (m, n) and not got.isnan().any()
    tol = DOT_TOL if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_fp8_linear_stays_near_the_unquantized_layer():
    """The price of W8A8 with 128-blocks on a Gaussian layer: the relative error of the output."""
    x, w = _randn(16, 512, seed=4), _randn(384, 512, seed=5, scale=0.04)
    w_q, w_scale = quantize_weight_blockwise(w)
    exact = x @ w.t()
    for use_triton in (False, True):
        y = fp8_linear(x.view(2, 8, 512), w_q, w_scale, use_triton=use_triton)
        assert y.shape == (2, 8, 384)
        assert ((y.view(16, 384) - exact).norm() / exact.norm()).item() < 0.05
    torch.testing.assert_close(fp8_linear(x, w_q, w_scale, use_triton=True),
                               fp8_linear(x, w_q, w_scale, use_triton=False), atol=DOT_TOL, rtol=DOT_TOL)


def test_cublas_rows_not_a_multiple_of_four_run_padded(monkeypatch):
    """cuBLAS refuses row counts that are not a multiple of 4: cublas_blockwise_matmul pads them with zero
    rows and drops the padding's products. A stand-in for _scaled_mm that refuses as cuBLAS does and
    multiplies as the reference does checks the padding on the CPU: same rows, same values (up to the CPU
    BLAS summing a taller matrix in another order)."""
    from rollout_kernels import fp8_blockwise

    def scaled_mm(x_q, w_t, x_scale, w_scale_t, out_dtype):
        assert x_q.shape[0] % fp8_blockwise.CUBLAS_ROW_MULTIPLE == 0, "cuBLAS would refuse this row count"
        assert x_scale.stride(0) == 1 and x_scale.shape[0] == x_q.shape[0], "scales must be outer-dim-major"
        return fp8_blockwise_matmul_ref(x_q, x_scale, w_t.t(), w_scale_t.t(), out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    w_q, w_scale = quantize_weight_blockwise(_randn(256, 512, seed=1, scale=0.05).cpu())
    for m in (1, 77, 129, 132):
        x_q, x_scale = quantize_activation_ref(_randn(m, 512, seed=m).cpu())
        got = cublas_blockwise_matmul(x_q, x_scale, w_q, w_scale, torch.float32)
        assert got.shape == (m, 256) and got.is_contiguous()
        torch.testing.assert_close(got, fp8_blockwise_matmul_ref(x_q, x_scale, w_q, w_scale, torch.float32),
                                   atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(4, 256, 512), (76, 384, 1536), (77, 384, 1536), (256, 6144, 4096),
                                   (1001, 6144, 4096)])
def test_gpu_cublas_blockwise_matches_the_reference(m, n, k):
    """cuBLASLt's blockwise-scaled GEMM reads our scales as we mean them (skipped where this torch /
    CUDA build has no blockwise _scaled_mm)."""
    from rollout_kernels import fp8_blockwise
    if not fp8_blockwise._cublas_blockwise_works(torch.cuda.current_device()):
        pytest.skip("this torch / cuBLAS build or GPU has no blockwise-scaled _scaled_mm (the engine's probe says so)")
    x_q, x_scale = quantize_activation(_randn(m, k, seed=m).bfloat16())
    w_q, w_scale = quantize_weight_blockwise(_randn(n, k, seed=n, scale=0.05))
    got = cublas_blockwise_matmul(x_q, x_scale, w_q, w_scale, torch.bfloat16)
    want = fp8_blockwise_matmul_ref(x_q, x_scale, w_q, w_scale, torch.float32)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_fp8_linear_runs_cublas_from_its_row_count():
    """Where the blockwise _scaled_mm works, a layer of >= CUBLAS_MIN_ROWS rows (129 runs padded) and K in
    whole groups of 4 scale blocks runs it (fewer rows or K = 3 blocks run ours); all near the reference."""
    from rollout_kernels import fp8_blockwise
    for k in (4 * 128, 3 * 128):
        w_q, w_scale = quantize_weight_blockwise(_randn(512, k, seed=3, scale=0.05))
        for m in (fp8_blockwise.CUBLAS_MIN_ROWS - 4, fp8_blockwise.CUBLAS_MIN_ROWS, fp8_blockwise.CUBLAS_MIN_ROWS + 1):
            x = _randn(m, k, seed=m).bfloat16()
            chosen = fp8_blockwise.takes_cublas(m, k, x.dtype, x.device, w_q, (128, 128))
            assert chosen == (m >= fp8_blockwise.CUBLAS_MIN_ROWS and k == 512 and fp8_blockwise._cublas_blockwise_works(0))
            x_q, x_scale = quantize_activation(x)
            want = fp8_blockwise_matmul_ref(x_q, x_scale, w_q, w_scale, torch.float32)
            torch.testing.assert_close(fp8_linear(x, w_q, w_scale).float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_cublas_probe_passes_on_hopper_with_cuda_12_9():
    """On an H100 / H200 with CUDA >= 12.9 (where cuBLASLt has blockwise scaling) the probe must say yes:
    a probe that fails there (as one with K = 2 scale blocks did) silently sends every layer to our slower GEMM."""
    from rollout_kernels import fp8_blockwise
    cuda = tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
    if torch.cuda.get_device_capability() != (9, 0) or cuda < (12, 9):
        pytest.skip("cuBLASLt's blockwise FP8 scaling needs sm90 and CUDA >= 12.9")
    assert fp8_blockwise.probe_cublas_blockwise(torch.device("cuda", torch.cuda.current_device()))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 256, 2048])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288)])
def test_gpu_bf16_at_8b_shapes(m, n, k):
    x = _randn(m, k, seed=m).bfloat16()
    w_q, w_scale = quantize_weight_blockwise(_randn(n, k, seed=n, scale=0.02))
    got = fp8_linear(x, w_q, w_scale)
    x_q, x_scale = quantize_activation_ref(x)
    want = fp8_blockwise_matmul_ref(x_q, x_scale, w_q, w_scale, torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("n,k,block,dtype", [
    (256, 384, (128, 128), torch.bfloat16), (130, 200, (128, 128), torch.float32),
    (96, 80, (32, 16), torch.float16), (200, 256, (64, 128), torch.bfloat16)])
def test_weight_quantization_kernel_gives_the_references_bits(n, k, block, dtype):
    """quantize_weight (one launch, what FP8 loads and updates run on the GPU) against the torch reference:
    the same e4m3 bits and scales, edge blocks, an outlier, an all-zero block; a row-strided slice and a
    transposed view (the hub's transposed expert stacks) read as they are."""
    from rollout_kernels.fp8_blockwise import quantize_weight

    w = _randn(n, k, seed=n + k, scale=0.02).to(dtype)
    w[0, 0] = 3.0
    w[-block[0]:, :block[1]] = 0.0
    for view in (w, torch.cat([w, w], dim=1)[:, k:], w.t().contiguous().t()):
        q, scale = quantize_weight(view, block)
        q_ref, scale_ref = quantize_weight_blockwise(view, block)
        assert q.dtype == FP8_DTYPE and scale.shape == scale_ref.shape
        assert torch.equal(scale, scale_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    transposed = w.t()  # [k, n] with strides (1, k)
    q, scale = quantize_weight(transposed, block)
    q_ref, scale_ref = quantize_weight_blockwise(transposed, block)
    assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
