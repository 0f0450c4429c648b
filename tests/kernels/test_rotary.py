"""apply_rotary against RotaryEmbedding's math: full and partial rotary_dim, strided q/k views of fused qkv."""

from __future__ import annotations

import pytest
import torch

from rollout_kernels.rotary import apply_rotary, apply_rotary_ref

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
# against the float32-math reference: rounding once; against the module's in-dtype math: a few ulp
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
TOL_MODULE = {torch.float32: 2e-5, torch.float16: 8e-3, torch.bfloat16: 6e-2}


def _tables(max_pos, rotary_dim, base=10000.0, scale=1.0, device=DEV):
    """As RotaryEmbedding builds them: float32 [max_pos, rotary_dim]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(device), (emb.sin() * scale).to(device)


def _qkv(t, h, kvh, d, dtype, device=DEV):
    """q [t, h, d] and k [t, kvh, d] as strided views of one fused qkv output."""
    qkv = torch.randn(t, (h + 2 * kvh) * d, device=device).to(dtype)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d: (h + kvh) * d].view(t, kvh, d)
    return qkv, q, k


def _close(a, b, tol):
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t,h,kvh,d,rotary_dim", [
    (1, 1, 1, 2, 2),
    (5, 4, 2, 64, 64),
    (63, 3, 1, 32, 16),      # partial rotary: half the head passes through
    (127, 2, 2, 128, 96),    # half = 48: not a power of two
    (7, 9, 3, 80, 80),       # head_dim 80, 9 q heads (odd head blocks)
])
def test_apply_rotary(t, h, kvh, d, rotary_dim, dtype):
    torch.manual_seed(t * 31 + d)
    max_pos = 4096
    cos, sin = _tables(max_pos, rotary_dim, scale=1.0 if d != 80 else 1.3)
    positions = torch.randint(0, max_pos, (t,), device=DEV)
    qkv, q, k = _qkv(t, h, kvh, d, dtype)
    v_before = qkv[:, (h + kvh) * d:].clone()
    q0, k0 = q.clone(), k.clone()
    want_q, want_k = apply_rotary_ref(q0, k0, positions, cos, sin)
    mod_q, mod_k = apply_rotary_ref(q0, k0, positions, cos, sin, compute_dtype=None)  # RotaryEmbedding math
    got_q, got_k = apply_rotary(q, k, positions, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    _close(got_q, want_q, TOL[dtype])
    _close(got_k, want_k, TOL[dtype])
    _close(got_q, mod_q, TOL_MODULE[dtype])
    _close(got_k, mod_k, TOL_MODULE[dtype])
    assert torch.equal(got_q[..., rotary_dim:], q0[..., rotary_dim:])  # pass-through is exact
    assert torch.equal(got_k[..., rotary_dim:], k0[..., rotary_dim:])
    assert torch.equal(qkv[:, (h + kvh) * d:], v_before)  # v untouched


def test_matches_rotary_embedding_module():
    """The module itself (float32): tables and rotation from a tiny config."""
    from types import SimpleNamespace

    from rollout_cli.models.layers import RotaryEmbedding

    config = SimpleNamespace(hidden_size=64, num_attention_heads=2, head_dim=32, rope_theta=10000.0,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5})
    rope = RotaryEmbedding(config, head_dim=32, max_positions=512)
    assert rope.rotary_dim == 16
    torch.manual_seed(0)
    positions = torch.randint(0, 512, (33,), device=DEV)
    q, k = torch.randn(33, 4, 32, device=DEV), torch.randn(33, 2, 32, device=DEV)
    want_q, want_k = rope(positions, q, k)  # moves its tables to the device
    got_q, got_k = apply_rotary(q.clone(), k.clone(), positions, rope.cos, rope.sin)
    _close(got_q, want_q, 1e-5)
    _close(got_k, want_k, 1e-5)


def test_contiguous_separate_q_k_and_bad_inputs():
    torch.manual_seed(1)
    cos, sin = _tables(64, 16)
    q, k = torch.randn(3, 2, 16, device=DEV), torch.randn(3, 1, 16, device=DEV)
    pos = torch.tensor([0, 5, 63], device=DEV)
    want_q, want_k = apply_rotary_ref(q, k, pos, cos, sin)
    got_q, got_k = apply_rotary(q.clone(), k.clone(), pos, cos, sin)
    _close(got_q, want_q, 1e-5)
    _close(got_k, want_k, 1e-5)
    _close(got_q[0], q[0], 0.0)  # position 0 is the identity
    with pytest.raises(AssertionError):
        apply_rotary(q, k, pos.int(), cos, sin)  # positions must be int64
    with pytest.raises(AssertionError):
        apply_rotary(q, k, pos, cos.half(), sin.half())  # tables must be float32
    with pytest.raises(AssertionError):
        apply_rotary(q, k.half(), pos, cos, sin)  # one dtype for q and k


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,kvh,d,rotary_dim", [(32, 8, 128, 128), (16, 2, 128, 64), (14, 2, 64, 64)])
def test_gpu_apply_rotary(h, kvh, d, rotary_dim, dtype):
    torch.manual_seed(h + d)
    t, max_pos = 1000, 32768
    cos, sin = _tables(max_pos, rotary_dim, base=1e6)
    positions = torch.randint(0, max_pos, (t,), device=DEV)
    qkv, q, k = _qkv(t, h, kvh, d, dtype)
    q0, k0 = q.clone(), k.clone()
    want_q, want_k = apply_rotary_ref(q0, k0, positions, cos, sin)
    mod_q, mod_k = apply_rotary_ref(q0, k0, positions, cos, sin, compute_dtype=None)
    apply_rotary(q, k, positions, cos, sin)
    _close(q, want_q, TOL[dtype])
    _close(k, want_k, TOL[dtype])
    _close(q, mod_q, TOL_MODULE[dtype])
    _close(k, mod_k, TOL_MODULE[dtype])


@pytest.mark.gpu
def test_gpu_apply_rotary_cuda_graph():
    t, h, kvh, d = 64, 8, 2, 128
    cos, sin = _tables(4096, d)
    positions = torch.randint(0, 4096, (t,), device=DEV)
    _, q, k = _qkv(t, h, kvh, d, torch.bfloat16)
    apply_rotary(q, k, positions, cos, sin)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_rotary(q, k, positions, cos, sin)
    q.copy_(torch.randn_like(q))
    k.copy_(torch.randn_like(k))
    positions.copy_(torch.randint(0, 4096, (t,), device=DEV))
    want_q, want_k = apply_rotary_ref(q.clone(), k.clone(), positions, cos, sin)
    graph.replay()
    _close(q, want_q, TOL[torch.bfloat16])
    _close(k, want_k, TOL[torch.bfloat16])
