"""rms_norm / fused_add_rms_norm against RMSNorm in plain torch: odd sizes, strided rows, [T, H, D] views."""

from __future__ import annotations

import pytest
import torch

from rollout_cli.models.layers import RMSNorm
from rollout_cli.models.norms import ZeroCentredRMSNorm
from rollout_kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}  # atol = rtol; 16-bit: ~1 ulp at |y|~4


def _weight(n, dtype, device=DEV):
    return (1.0 + 0.2 * torch.randn(n, device=device)).to(dtype)


def _strided_rows(t, n, dtype, pad=7, device=DEV):
    """[t, n] slice of a wider tensor: row stride n + pad."""
    return torch.randn(t, n + pad, device=device).to(dtype)[:, :n]


def _close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n", [1, 63, 127, 769])
@pytest.mark.parametrize("t", [1, 5])
def test_rms_norm(t, n, dtype):
    torch.manual_seed(n + t)
    x = _strided_rows(t, n, dtype)
    w = _weight(n, dtype)
    out = torch.full((t, n), float("nan"), dtype=dtype, device=DEV)
    got = rms_norm(x, w, 1e-6, out=out)
    assert got is out
    _close(got, rms_norm_ref(x, w, 1e-6), dtype)
    # the torch module itself
    mod = RMSNorm(n, 1e-6).to(DEV)
    mod.weight.data = w
    _close(got, mod(x), dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n", [1, 63, 769])
def test_fused_add_rms_norm_in_place(n, dtype):
    torch.manual_seed(n)
    t = 6
    x = _strided_rows(t, n, dtype, pad=3)
    residual = _strided_rows(t, n, dtype, pad=5)
    w = _weight(n, dtype)
    want_normed, want_sum = fused_add_rms_norm_ref(x, residual, w, 1e-5)
    normed, new_res = fused_add_rms_norm(x, residual, w, 1e-5)
    assert normed.data_ptr() == x.data_ptr() and new_res.data_ptr() == residual.data_ptr()
    assert torch.equal(new_res, want_sum)  # the add rounds to the activation dtype exactly as torch
    _close(normed, want_normed, dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_fused_add_rms_norm_out_of_place_and_module(dtype):
    torch.manual_seed(1)
    t, n = 9, 127
    x, residual = torch.randn(t, n, device=DEV).to(dtype), torch.randn(t, n, device=DEV).to(dtype)
    x0, r0 = x.clone(), residual.clone()
    w = _weight(n, dtype)
    out = torch.full_like(x, float("nan"))
    res_out = torch.full_like(x, float("nan"))
    normed, new_res = fused_add_rms_norm(x, residual, w, 1e-6, out=out, residual_out=res_out)
    assert normed is out and new_res is res_out
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # inputs untouched
    mod = RMSNorm(n, 1e-6).to(DEV)
    mod.weight.data = w
    want_normed, want_sum = mod(x, residual)
    assert torch.equal(new_res, want_sum)
    _close(normed, want_normed, dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_per_head_norm_on_strided_qkv_view(dtype):
    """q/k norm: x [T, H, D] view of a fused qkv output (token stride != H * D), in place."""
    torch.manual_seed(2)
    t, h, kvh, d = 7, 4, 2, 63
    qkv = torch.randn(t, (h + 2 * kvh) * d, device=DEV).to(dtype)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d: (h + kvh) * d].view(t, kvh, d)
    v_before = qkv[:, (h + kvh) * d:].clone()
    wq, wk = _weight(d, dtype), _weight(d, dtype)
    want_q, want_k = rms_norm_ref(q, wq, 1e-6), rms_norm_ref(k, wk, 1e-6)
    rms_norm(q, wq, 1e-6, out=q)
    rms_norm(k, wk, 1e-6, out=k)
    _close(q, want_q, dtype)
    _close(k, want_k, dtype)
    assert torch.equal(qkv[:, (h + kvh) * d:], v_before)  # v untouched


def test_float32_weight_promotes_output():
    torch.manual_seed(3)
    x = torch.randn(5, 63, device=DEV).half()
    w = _weight(63, torch.float32)
    got = rms_norm(x, w, 1e-6)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, rms_norm_ref(x, w, 1e-6), atol=1e-5, rtol=1e-5)
    with pytest.raises(AssertionError):
        fused_add_rms_norm(x, x.clone(), w, 1e-6)  # cannot write float32 into the fp16 x


def test_empty_and_bad_inputs():
    w = _weight(8, torch.float32)
    assert rms_norm(torch.empty(0, 8, device=DEV), w, 1e-6).shape == (0, 8)
    with pytest.raises(AssertionError):
        rms_norm(torch.randn(4, 9, device=DEV), w, 1e-6)  # weight size
    with pytest.raises(AssertionError):
        rms_norm(torch.randn(8, 4, device=DEV).t(), w, 1e-6)  # last dim not contiguous


def _zero_centred_module(n, w, dtype):
    mod = ZeroCentredRMSNorm(n, 1e-6).to(DEV)
    mod.weight.data = w.to(DEV, dtype)
    return mod


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n", [1, 63, 769])
def test_zero_centred_against_the_hybrid_models_norm(n, dtype):
    """The (1 + w) variant of Qwen3-Next / Qwen3.5, rounded once: plain, fused with the residual (in
    place), and per head on a strided [T, H, D] view, against models/norms.ZeroCentredRMSNorm."""
    torch.manual_seed(n + 11)
    t = 6
    w = 0.2 * torch.randn(n, device=DEV).to(dtype)  # zero-centred: the scale is 1 + w
    mod = _zero_centred_module(n, w, dtype)
    x = _strided_rows(t, n, dtype)
    got = rms_norm(x, w, 1e-6, zero_centred=True)
    assert got.dtype == dtype
    _close(got, mod(x), dtype)
    _close(got, rms_norm_ref(x, w, 1e-6, zero_centred=True), dtype)
    residual = _strided_rows(t, n, dtype, pad=5)
    want_normed, want_sum = mod(x, residual)
    normed, new_res = fused_add_rms_norm(x, residual, w, 1e-6, zero_centred=True)
    assert normed.data_ptr() == x.data_ptr() and torch.equal(new_res, want_sum)
    _close(normed, want_normed, dtype)
    qkv = torch.randn(t, 3 * 2 * n + 4, device=DEV).to(dtype)
    heads = qkv[:, 4: 4 + 3 * n].view(t, 3, n)  # 3 heads, token stride 6n + 4
    _close(rms_norm(heads, w, 1e-6, zero_centred=True), mod(heads), dtype)


def test_zero_centred_keeps_the_activation_dtype_with_a_float32_weight():
    torch.manual_seed(4)
    x = torch.randn(5, 63, device=DEV).half()
    w = 0.2 * torch.randn(63, device=DEV)
    got = rms_norm(x, w, 1e-6, zero_centred=True)
    assert got.dtype == torch.float16
    _close(got, rms_norm_ref(x, w, 1e-6, zero_centred=True), torch.float16)
    normed, _ = fused_add_rms_norm(x, x.clone(), w, 1e-6, zero_centred=True)  # in place is fine here
    assert normed.dtype == torch.float16


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [64, 769, 4096, 8192])
def test_gpu_rms_norm(n, dtype):
    torch.manual_seed(n)
    t = 300
    x = _strided_rows(t, n, dtype, pad=64)
    residual = torch.randn(t, n, device=DEV).to(dtype)
    w = _weight(n, dtype)
    out = torch.full((t, n), float("nan"), dtype=dtype, device=DEV)
    _close(rms_norm(x, w, 1e-6, out=out), rms_norm_ref(x, w, 1e-6), dtype)
    want_normed, want_sum = fused_add_rms_norm_ref(x, residual, w, 1e-6)
    normed, new_res = fused_add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(new_res, want_sum)
    _close(normed, want_normed, dtype)
    wz = 0.2 * torch.randn(n, device=DEV).to(dtype)
    _close(rms_norm(x, wz, 1e-6, zero_centred=True), rms_norm_ref(x, wz, 1e-6, zero_centred=True), dtype)


@pytest.mark.gpu
def test_gpu_rms_norm_cuda_graph():
    t, n, dtype = 64, 1024, torch.bfloat16
    x = torch.randn(t, n, device=DEV).to(dtype)
    residual = torch.randn(t, n, device=DEV).to(dtype)
    w = _weight(n, dtype)
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    fused_add_rms_norm(x, residual, w, 1e-6, out=out, residual_out=res_out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_add_rms_norm(x, residual, w, 1e-6, out=out, residual_out=res_out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    want_normed, want_sum = fused_add_rms_norm_ref(x, residual, w, 1e-6)
    assert torch.equal(res_out, want_sum)
    _close(out, want_normed, dtype)
