"""The Triton chunked (prefill) gated delta rule against its torch references: the chunk-local cumsum and
WY stages alone, then the whole varlen call vs the chunked reference and the token-by-token recurrence,
over odd lengths around chunk boundaries, several sequences per call, an empty sequence, grouped key
heads, strided q/k/v/beta views of fused projections, nonzero initial states in a pooled layer slice
whose other slots are NaN and must stay so (interpreter on the CPU, compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

from rollout_kernels.chunk_gated_delta_rule import (
    chunk_gated_delta_rule_varlen,
    chunk_local_cumsum,
    chunk_local_cumsum_ref,
    chunk_wy_repr,
    chunk_wy_repr_ref,
)
from rollout_kernels.chunk_gated_delta_rule_lowp_ref import chunk_gated_delta_rule_lowp_varlen_ref
from rollout_kernels.gated_delta_rule import chunk_gated_delta_rule_varlen_ref, recurrent_gated_delta_rule_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
LENGTHS = [1, 3, 63, 64, 65, 130]


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _inputs(T, hk, hv, dk, dv, dtype, seed, gates=(-0.3, 0.0)):
    """q/k/v as row-strided views of one fused projection [T, 2 hk dk + hv dv + 3], beta a view of [T, 2 hv];
    g uniform in `gates` (default: slow decay, earlier chunks still matter)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    fused = torch.randn(T, 2 * hk * dk + hv * dv + 3, generator=gen, device=DEV).to(dtype)
    q = fused[:, : hk * dk].view(T, hk, dk)
    k = fused[:, hk * dk: 2 * hk * dk].view(T, hk, dk)
    v = fused[:, 2 * hk * dk: 2 * hk * dk + hv * dv].view(T, hv, dv)
    low, high = gates
    g = low + (high - low) * torch.rand(T, hv, generator=gen, device=DEV)
    beta = torch.rand(T, 2 * hv, generator=gen, device=DEV).to(dtype)[:, :hv]
    return q, k, v, g, beta


def test_chunk_local_cumsum_matches_reference():
    cu = _cu([1, 17, 16, 40])
    g = -torch.rand(cu[-1], 5, device=DEV)
    for chunk_size in (16, 32):
        torch.testing.assert_close(chunk_local_cumsum(g, cu, chunk_size), chunk_local_cumsum_ref(g, cu, chunk_size),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("batched_diag", [True, False])
def test_wy_repr_matches_reference(chunk_size, batched_diag):
    cu = _cu([5, 70])
    q, k, v, g, beta = _inputs(cu[-1], 2, 4, 16, 24, torch.float32, seed=chunk_size)
    gcum = chunk_local_cumsum_ref(g, cu, chunk_size)
    w, u = chunk_wy_repr(k, v, beta, gcum, cu, chunk_size, batched_diag=batched_diag)
    want_w, want_u = chunk_wy_repr_ref(k, v, beta, gcum, cu, chunk_size)
    torch.testing.assert_close(w, want_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(u, want_u, atol=1e-5, rtol=1e-5)


def _run_both(lengths, hk, hv, dk, dv, dtype, chunk_size, seed, use_qk_l2norm=True, gates=(-0.3, 0.0)):
    cu = _cu(lengths)
    B, num_slots = len(lengths), len(lengths) + 3
    step = _inputs(cu[-1], hk, hv, dk, dv, dtype, seed, gates)
    if not use_qk_l2norm:  # raw keys: keep |k| small so the delta rule stays contractive
        step = (step[0], step[1] * 0.2) + step[2:]
    pools = torch.full((2, num_slots, hv, dk, dv), float("nan"), device=DEV)  # [layers, S, ...]: a layer slice
    pool = pools[1]
    index = torch.randperm(num_slots, device=DEV)[:B]
    pool[index] = torch.randn(B, hv, dk, dv, device=DEV)
    want_pool = pool.clone()
    want = chunk_gated_delta_rule_varlen_ref(*step, want_pool, index, cu, chunk_size, use_qk_l2norm)
    initial = pool[index].clone()
    got = chunk_gated_delta_rule_varlen(*step, pool, index, cu, chunk_size, use_qk_l2norm)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEV)
    untouched[index] = False
    assert pool[untouched].isnan().all() and pools[0].isnan().all()
    return cu, step, index, initial, got, want, pool, want_pool


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_varlen_matches_token_by_token_float32(chunk_size):
    """Odd lengths around the chunk boundaries, six sequences in one call, nonzero initial states:
    equal to the chunked reference and to the token-by-token recurrence within 1e-4."""
    cu, step, index, initial, got, want, pool, want_pool = _run_both(LENGTHS, 2, 4, 16, 24, torch.float32,
                                                                      chunk_size, seed=chunk_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool[index], want_pool[index], atol=1e-4, rtol=1e-4)
    q, k, v, g, beta = step
    for b in range(len(LENGTHS)):
        s, e = cu[b], cu[b + 1]
        out, final = recurrent_gated_delta_rule_ref(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e],
                                                    beta[None, s:e], initial[b:b + 1])
        torch.testing.assert_close(got[s:e], out[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pool[index[b]], final[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else []))
def test_varlen_half_precision(dtype):
    _, _, index, _, got, want, pool, want_pool = _run_both([65, 3], 2, 4, 32, 16, dtype, 32, seed=7)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(pool[index], want_pool[index], atol=TOL[dtype], rtol=TOL[dtype])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else []))
def test_lowp_intermediates_round_where_their_reference_does(dtype):
    """Intermediates in the inputs' dtype (the `lowp_intermediates` knob): the kernels equal their
    reference, which rounds where they store, far closer than either is to the float32 path; so
    the knob took effect and rounds at the stated points, across chunk boundaries and several sequences."""
    lengths, chunk = [65, 3, 130], 16
    cu, step, index, initial, _, exact_out, _, exact_pool = _run_both(lengths, 2, 4, 32, 16, dtype, chunk, seed=5)
    start = torch.zeros(len(lengths) + 3, 4, 32, 16, device=DEV)
    start[index] = initial
    got_pool, ref_pool = start.clone(), start.clone()
    exact_inverse = {"lowp_intermediates": True, "inv_precision": "tf32x3"}  # the reference inverts in float32
    got = chunk_gated_delta_rule_varlen(*step, got_pool, index, cu, chunk, tuning=exact_inverse)
    default = chunk_gated_delta_rule_varlen(*step, start.clone(), index, cu, chunk)  # tf32 inverse on a GPU
    ref = chunk_gated_delta_rule_lowp_varlen_ref(*step, ref_pool, index, cu, chunk)
    assert got.dtype == dtype
    out_gap, state_gap = _rel(ref, exact_out), _rel(ref_pool[index], exact_pool[index])
    assert out_gap > 1e-4 and state_gap > 1e-5  # the rounding is visible at all
    assert _rel(got, ref) < 0.25 * out_gap
    # compiled, the state measured 0.098 of the gap on the H100 (session 35; the outputs passed): tl.exp
    # there is ex2.approx, an ulp or two from torch's exp, which likely flips half-precision roundings of
    # the decayed keys. The interpreter (numpy's exp) stays within 0.05
    assert _rel(got_pool[index], ref_pool[index]) < (0.15 if DEV == "cuda" else 0.05) * state_gap
    assert _rel(default, ref) < out_gap  # half-precision inputs take this path by default


def test_per_kernel_launch_knobs_change_no_result():
    """The sweep's knobs (scripts/bench_gdn_vs_fla.py --sweep): the state walk and the output kernel on
    different value-block widths, other warps, the walk pipelined: the same outputs and final states."""
    lengths, chunk = [40, 7], 16
    cu, step, index, initial, got, _, pool, _ = _run_both(lengths, 1, 2, 16, 32, torch.float32, chunk, seed=3)
    other_pool = torch.zeros_like(pool)
    other_pool[index] = initial
    knobs = {"state_block_v": 16, "output_block_v": 32, "state_warps": 2, "wy_warps": 2, "output_warps": 1,
             "state_stages": 2}
    other = chunk_gated_delta_rule_varlen(*step, other_pool, index, cu, chunk, tuning=knobs)
    torch.testing.assert_close(other, got, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(other_pool[index], pool[index], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths,hk,hv,dk,dv,l2", [
    ([17, 0, 5], 1, 1, 16, 16, True),  # an empty sequence keeps its state
    ([40], 1, 3, 24, 72, True),  # dk not a power of two, dv over two column blocks
    ([33, 2], 2, 2, 16, 8, False),  # raw q/k: the caller normalised them
])
def test_varlen_shapes(lengths, hk, hv, dk, dv, l2):
    _, _, index, _, got, want, pool, want_pool = _run_both(lengths, hk, hv, dk, dv, torch.float32, 16, seed=dv,
                                                           use_qk_l2norm=l2)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool[index], want_pool[index], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_strong_decay_in_a_partial_chunk_stays_finite(dtype):
    """A trained model's gates (here -12 to -4 a token) sum below -88 inside a chunk. Rows past a partial
    chunk's end must not turn exp(gc_i - gc_j) into inf: times their zero keys it was NaN, which the
    inverse's dots spread into every row (a trained Qwen3-Next prefilled NaN; the first test failed so)."""
    _, _, index, _, got, want, pool, want_pool = _run_both([40, 64, 3], 2, 4, 16, 16, dtype, 64, seed=5,
                                                           gates=(-12.0, -4.0))
    assert got.isfinite().all() and pool[index].isfinite().all()
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(pool[index], want_pool[index], atol=tol, rtol=tol)


def test_split_prefill_carries_the_state():
    """A prompt prefilled over two engine steps (cut mid-chunk) == one call."""
    q, k, v, g, beta = _inputs(50, 2, 4, 16, 16, torch.float32, seed=3)
    pool = torch.randn(3, 4, 16, 16, device=DEV)
    split_pool = pool.clone()
    index = torch.tensor([1], device=DEV)
    whole = chunk_gated_delta_rule_varlen(q, k, v, g, beta, pool, index, [0, 50], 16)
    first = chunk_gated_delta_rule_varlen(q[:21], k[:21], v[:21], g[:21], beta[:21], split_pool, index, [0, 21], 16)
    second = chunk_gated_delta_rule_varlen(q[21:], k[21:], v[21:], g[21:], beta[21:], split_pool, index, [0, 29], 16)
    torch.testing.assert_close(torch.cat((first, second)), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(split_pool, pool, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_qwen3_next_shape_bf16():
    """Qwen3-Next's linear-layer heads (16 key, 32 value, 128 x 128), chunk 64, bf16 inputs (tf32 dots)."""
    _, _, index, _, got, want, pool, want_pool = _run_both([1, 100, 1000, 64], 16, 32, 128, 128, torch.bfloat16,
                                                           64, seed=11)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(pool[index], want_pool[index], atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_gpu_benchmark_runs():
    from rollout_kernels.chunk_gated_delta_rule_bench import benchmark_chunk_gated_delta_rule

    result = benchmark_chunk_gated_delta_rule(num_seqs=2, seq_len=512)
    assert result["time_us"] > 0 and result["tflop_per_s"] > 0
