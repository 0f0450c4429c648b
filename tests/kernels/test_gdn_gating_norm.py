"""gdn_gating and gated_rms_norm against their torch references (the model's own code): odd sizes,
strided slices of one projection output, [T, H, D] views, softplus past its threshold, empty input."""

from __future__ import annotations

import pytest
import torch

from rollout_cli.models.norms import GatedRMSNorm
from rollout_kernels.gdn_gating_norm import gated_rms_norm, gated_rms_norm_ref, gdn_gating, gdn_gating_ref

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # atol = rtol


def _close(got, want, dtype):
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def _projections(t, h, dtype, scale=4.0, seed=0):
    """b, a as the model gets them: the two halves of in_proj_ba's [T, 2 Hv] output (row stride 2 Hv)."""
    g = torch.Generator().manual_seed(seed)
    ba = (torch.randn(t, 2 * h, generator=g) * scale).to(DEV, dtype)
    b, a = ba.chunk(2, dim=-1)
    a_log = torch.randn(h, generator=g).to(DEV, dtype)
    dt_bias = torch.randn(h, generator=g).to(DEV, dtype)
    return a, b, a_log, dt_bias


def _check_gating(t, h, dtype, scale=4.0):
    a, b, a_log, dt_bias = _projections(t, h, dtype, scale, seed=t + h)
    g, beta = gdn_gating(a, b, a_log, dt_bias)
    g_ref, beta_ref = gdn_gating_ref(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype and g.shape == beta.shape == (t, h)
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)  # g is float32 whatever the input dtype
    _close(beta, beta_ref, dtype)
    assert (g <= 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,h", [(1, 1), (7, 3), (33, 32), (65, 5)])
def test_gating_matches_reference(t, h, dtype):
    _check_gating(t, h, dtype)


def test_gating_past_the_softplus_threshold_and_empty():
    _check_gating(9, 4, torch.float32, scale=40.0)  # a + dt_bias far beyond 20: softplus(x) = x there
    a, b, a_log, dt_bias = _projections(0, 4, torch.float32)
    g, beta = gdn_gating(a, b, a_log, dt_bias)
    assert g.shape == beta.shape == (0, 4)


def test_gating_bad_inputs():
    a, b, a_log, dt_bias = _projections(3, 4, torch.float32)
    with pytest.raises(AssertionError, match="b must be"):
        gdn_gating(a, b[:, :3], a_log, dt_bias)
    with pytest.raises(AssertionError, match="dt_bias must be"):
        gdn_gating(a, b, a_log, dt_bias[:3])


def _norm_case(t, h, d, dtype, seed=0):
    """x: the delta rule's [T, H, D] output; z: the gate, a strided slice of the qkvz projection."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h, d, generator=g) * 3).to(DEV, dtype)
    qkvz = torch.randn(t, 11 + h * d, generator=g).to(DEV, dtype)
    z = qkvz[:, 11:].unflatten(1, (h, d))
    w = (torch.rand(d, generator=g) + 0.5).to(DEV, dtype)
    return x, z, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,h,d", [(1, 1, 8), (5, 3, 16), (17, 4, 128), (3, 2, 100)])
def test_gated_rms_norm_matches_reference(t, h, d, dtype):
    x, z, w = _norm_case(t, h, d, dtype, seed=t * d)
    got = gated_rms_norm(x, z, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    _close(got, gated_rms_norm_ref(x, z, w, 1e-6), dtype)
    # the 2-D form the model module takes, and the module itself
    flat = gated_rms_norm(x.reshape(-1, d), z.reshape(-1, d), w, 1e-6)
    assert torch.equal(flat, got.reshape(-1, d))
    module = GatedRMSNorm(d, 1e-6).to(DEV, dtype)
    module.weight.data.copy_(w)
    _close(flat, module(x.reshape(-1, d), z.reshape(-1, d)), dtype)


def test_gated_rms_norm_into_out_and_bad_inputs():
    x, z, w = _norm_case(4, 2, 32, torch.float32)
    out = torch.full_like(x, float("nan"))
    assert gated_rms_norm(x, z, w, 1e-6, out=out) is out
    _close(out, gated_rms_norm_ref(x, z, w, 1e-6), torch.float32)
    assert gated_rms_norm(x[:0], z[:0], w, 1e-6).shape == (0, 2, 32)
    with pytest.raises(AssertionError, match="z has shape"):
        gated_rms_norm(x, z[:, :1], w, 1e-6)
    with pytest.raises(AssertionError, match="weight dtype"):
        gated_rms_norm(x, z, w.half(), 1e-6)
    with pytest.raises(AssertionError, match="contiguous in its last dim"):
        gated_rms_norm(x, z.transpose(1, 2).contiguous().transpose(1, 2), w, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("t,h,d", [(1, 32, 128), (77, 32, 128), (256, 16, 256)])
def test_gpu_bf16(t, h, d):
    _check_gating(t, h, torch.bfloat16)
    x, z, w = _norm_case(t, h, d, torch.bfloat16, seed=t)
    _close(gated_rms_norm(x, z, w, 1e-6), gated_rms_norm_ref(x, z, w, 1e-6), torch.bfloat16)
