"""FP8 (e4m3) KV pools (`--kv-cache-dtype fp8`): the writers quantize as their torch references do,
bit for bit, and the attention kernels over an e4m3 pool match their references and stay within
e4m3's rounding of the attention over the unquantized pool.

On the CPU the kernels run under the Triton interpreter, whose own float32 -> e4m3 conversion is
wrong: the writers round to the e4m3 grid first (kernels/kv_store.py), which these tests check
against torch's conversion over every e4m3 value, every midpoint between two and random values.
"""

from __future__ import annotations

import math

import pytest
import torch

from slot_pool import make_slot_pool
from rollout_kernels.decode_attention import decode_attention, decode_attention_ref
from rollout_kernels.extend_attention import extend_attention, extend_attention_ref
from rollout_kernels.kv_fp8_ref import KV_FP8_DTYPE, from_pool_ref
from rollout_kernels.kv_store import store_kv, store_kv_ref
from rollout_kernels.qk_norm_rope_store import qk_norm_rope_store, qk_norm_rope_store_chain, qk_norm_rope_store_ref

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
Q_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])  # interpreter: no bf16 tl.dot
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _bits(pool: torch.Tensor) -> torch.Tensor:
    return pool.view(torch.uint8)


def _e4m3_probe_values() -> torch.Tensor:
    """Every finite e4m3 value, every midpoint of two neighbours (ties: to even), values past
    +-448 (saturate) and random values over nine decades (subnormals included)."""
    grid = torch.arange(256, dtype=torch.uint8).view(KV_FP8_DTYPE).float()
    grid = grid[~grid.isnan()].unique().sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    spread = torch.cat([torch.randn(512, generator=gen) * 10.0 ** e for e in range(-5, 4)])
    return torch.cat([grid, mids, torch.tensor([500.0, -1e4, 449.0, -460.0]), spread])


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_store_kv_rounds_to_e4m3_as_torch_does(scale):
    values = _e4m3_probe_values()
    t = values.numel() // 8
    k = values[: t * 8].view(t, 2, 4).to(DEV)
    v = -k.flip(0)
    slots = torch.randperm(t + 3, generator=torch.Generator().manual_seed(1))[:t].to(DEV)
    slots[::5] = -1  # padding rows write nothing
    pools = [torch.zeros((t + 3, 2, 4), dtype=KV_FP8_DTYPE, device=DEV) for _ in range(4)]
    store_kv(pools[0], pools[1], slots, k, v, scale, 2 * scale)
    store_kv_ref(pools[2], pools[3], slots, k, v, scale, 2 * scale)
    assert torch.equal(_bits(pools[0]), _bits(pools[2])) and torch.equal(_bits(pools[1]), _bits(pools[3]))
    assert not pools[0].float().isnan().any()  # saturated at +-448, never NaN
    assert pools[0].float().abs().max().item() == 448.0


@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_prologue_quantizes_its_pool_rows_like_the_chain(norm, dtype):
    """Bit for bit the unfused chain's rows under the interpreter (as the unquantized pools are), within
    one e4m3 step of the torch reference's."""
    t, h, kvh, d, rotary_dim, max_pos = 19, 4, 2, 64, 32, 64
    g = torch.Generator().manual_seed(3)
    qkv = (torch.randn(t, (h + 2 * kvh) * d, generator=g) * 3).to(DEV, dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    emb = torch.outer(torch.arange(max_pos).float(), inv_freq).repeat(1, 2)
    cos, sin = emb.cos().to(DEV), emb.sin().to(DEV)
    positions = torch.randint(0, max_pos, (t,), generator=g).to(DEV)
    slots = torch.randperm(t + 4, generator=g)[:t].to(DEV)
    slots[2::4] = -1
    weights = [(torch.rand(d, generator=g) + 0.5).to(DEV, dtype) for _ in range(2)] if norm else [None, None]
    runs = []
    for fn in (qk_norm_rope_store, qk_norm_rope_store_chain, qk_norm_rope_store_ref):
        run = qkv.clone()  # the chain norms and rotates k in place
        q, k, v = (run[:, : h * d].view(t, h, d), run[:, h * d: (h + kvh) * d].view(t, kvh, d),
                   run[:, (h + kvh) * d:].view(t, kvh, d))
        pools = [torch.zeros((t + 4, kvh, d), dtype=KV_FP8_DTYPE, device=DEV) for _ in range(2)]
        fn(q, k, v, positions, cos, sin, *pools, slots, *weights, 1e-6, k_scale=0.5, v_scale=0.25)
        runs.append(pools)
    (k1, v1), (k2, v2), (k3, v3) = runs
    if not CUDA:  # compiled, the fused kernel's float32 steps may round apart from the chain's
        assert torch.equal(_bits(k1), _bits(k2))
    torch.testing.assert_close(k1.float(), k3.float(), atol=2.0**-9, rtol=2.0**-3)
    assert torch.equal(_bits(v1), _bits(v2)) and torch.equal(_bits(v1), _bits(v3))  # v: the same values quantized
    written = slots[slots >= 0]
    untouched = [s for s in range(t + 4) if s not in set(written.tolist())]
    assert (k1.float()[written] != 0).any() and k1.float()[untouched].abs().sum() == 0


def _fp8_pools(k_pool, v_pool, k_scale, v_scale):
    """Quantize a case's pools (the NaN poison slot stays NaN)."""
    return [(pool.float() / s).clamp(-448, 448).to(KV_FP8_DTYPE) for pool, s in ((k_pool, k_scale), (v_pool, v_scale))]


def _assert_near_unquantized(out_fp8, out_exact):
    """e4m3 keeps 3 mantissa bits (relative rounding <= 1/16): the attention output moves by a few
    percent of its scale, not more."""
    err = (out_fp8.float() - out_exact.float()).abs().max().item()
    assert err < 0.1 * out_exact.float().abs().max().item(), err


@pytest.mark.parametrize("dtype", Q_DTYPES)
@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_decode_over_an_fp8_pool_matches_the_reference(dtype, num_kv_splits):
    seq_lens, h, kvh, d = [1, 63, 130, 7], 8, 2, 64
    gen = torch.Generator().manual_seed(5)
    k_pool, v_pool, req_to_token, rows = make_slot_pool(seq_lens, kvh, d, torch.float32, DEV, gen)
    q = torch.randn((len(seq_lens), h, d), generator=gen).to(DEV, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    scale, k_scale, v_scale = 1.0 / math.sqrt(d), 0.02, 0.5
    k8, v8 = _fp8_pools(k_pool, v_pool, k_scale, v_scale)
    args = (q, k8, v8, req_to_token, rows, lens, scale)
    out = decode_attention(*args, num_kv_splits=num_kv_splits, k_scale=k_scale, v_scale=v_scale)
    ref = decode_attention_ref(*args, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    _assert_near_unquantized(out, decode_attention_ref(q, k_pool.to(dtype), v_pool.to(dtype), req_to_token,
                                                       rows, lens, scale))


@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_decode_over_an_fp8_pool_with_f16_dots_matches_the_reference(num_kv_splits):
    """The dots a bf16 model takes over an e4m3 pool (decode_attention._f16_dots), forced here on a float32
    q (the interpreter has no bf16 dot): q and p in fp16, the pool exact, within fp16's rounding."""
    seq_lens, h, kvh, d = [2, 70, 129], 8, 2, 64
    gen = torch.Generator().manual_seed(9)
    k_pool, v_pool, req_to_token, rows = make_slot_pool(seq_lens, kvh, d, torch.float32, DEV, gen)
    q = torch.randn((len(seq_lens), h, d), generator=gen).to(DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    k8, v8 = _fp8_pools(k_pool, v_pool, 0.02, 0.5)
    args = (q, k8, v8, req_to_token, rows, lens, 1.0 / math.sqrt(d))
    ref = decode_attention_ref(*args, k_scale=0.02, v_scale=0.5)
    f16 = decode_attention(*args, num_kv_splits=num_kv_splits, k_scale=0.02, v_scale=0.5, f16_dots=True)
    exact = decode_attention(*args, num_kv_splits=num_kv_splits, k_scale=0.02, v_scale=0.5, f16_dots=False)
    torch.testing.assert_close(f16, ref, atol=TOL[torch.float16], rtol=TOL[torch.float16])
    assert not torch.equal(f16, exact)  # the flag reaches the kernel: fp16 dots round where float32 ones do not
    torch.testing.assert_close(exact, ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize("dtype", Q_DTYPES)
def test_extend_over_an_fp8_pool_matches_the_reference(dtype):
    prefix_lens, q_lens, h, kvh, d = [0, 40, 3], [33, 5, 70], 4, 1, 32
    gen = torch.Generator().manual_seed(6)
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    k_pool, v_pool, req_to_token, rows = make_slot_pool(seq_lens, kvh, d, torch.float32, DEV, gen)
    q = torch.randn((sum(q_lens), h, d), generator=gen).to(DEV, dtype)
    meta = dict(rows=rows, q_starts=torch.tensor([0] + q_lens).cumsum(0).to(DEV, torch.int32),
                prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=DEV),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
                scale=1.0 / math.sqrt(d), max_q_len=max(q_lens))
    k_scale, v_scale = 4.0, 0.125
    k8, v8 = _fp8_pools(k_pool, v_pool, k_scale, v_scale)
    out = extend_attention(q, k8, v8, req_to_token, k_scale=k_scale, v_scale=v_scale, **meta)
    ref = extend_attention_ref(q, k8, v8, req_to_token, k_scale=k_scale, v_scale=v_scale, **meta)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    _assert_near_unquantized(out, extend_attention_ref(q, k_pool.to(dtype), v_pool.to(dtype), req_to_token, **meta))


def test_pool_reads_take_their_scale_and_other_dtypes_are_refused():
    rows = torch.tensor([[1.5, -448.0]]).to(KV_FP8_DTYPE)
    assert from_pool_ref(rows, 0.5, torch.float32).tolist() == [[0.75, -224.0]]
    assert from_pool_ref(torch.ones(2, dtype=torch.float16), 3.0, torch.float32).tolist() == [1.0, 1.0]
    q = torch.zeros((1, 2, 16), device=DEV)
    pool = torch.zeros((4, 2, 16), dtype=torch.float16, device=DEV)  # neither q's dtype nor e4m3
    table = torch.zeros((1, 4), dtype=torch.int32, device=DEV)
    one = torch.ones(1, dtype=torch.int32, device=DEV)
    with pytest.raises(AssertionError, match="dtype"):
        decode_attention(q, pool, pool, table, one.long(), one, 1.0)
