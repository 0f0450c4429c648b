"""Decode attention over the token-slot KV pool: one query token per request, split-KV.

Flash-decoding in two launches, both CUDA-graph capturable (no host reads of
tensor values, scratch sized from shapes only):

  stage 1, grid (B, num_kv_heads, num_kv_splits): a program owns one kv head
    and all G = num_heads // num_kv_heads query heads that share it, so each
    K/V row is read from HBM once per request, not G times. It walks its share
    of the keys (split length = cdiv(seq_len, num_kv_splits), computed in the
    kernel) with an online softmax in float32 and writes a normalised partial
    output and its log-sum-exp (base 2). A split with no keys writes lse = -inf.
  stage 2, grid (B, num_heads): merges the splits, skipping empty ones.
  With one split (large batches: the batch alone fills the GPU) stage 1 writes the
  output directly and stage 2 is not launched: the float32 partials would cost a
  write + read of [B, H, D] float32 and a launch per layer (~0.1 ms of a 6 ms step
  at batch 256 on a 28-layer model).

The G heads go through `tl.dot` as a [BLOCK_H, D] block padded to 16 rows
(tl.dot needs M >= 16); the padded rows read zeros and are never stored. The
kernel is bandwidth bound, so the wasted tensor-core work costs nothing.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .kv_fp8_ref import KV_FP8_DTYPE, check_pool_dtype, from_pool_ref

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _attend_key_tile(q, acc, m_i, l_i, n0, end, rt_base, k_base, v_base, stride_ks, stride_vs, offs_d,
                     sm_scale_log2, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over keys [n0, min(n0 + BLOCK_N, end)) of a table row (slots at rt_base):
    q [M, D] in the dot dtype, acc [M, D] / m_i, l_i [M] float32 -> the updated (acc, m_i, l_i)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    slots = tl.load(rt_base + offs_n, mask=mask_n, other=0).to(tl.int64)  # [BLOCK_N]
    k = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :],
                mask=mask_n[:, None], other=0.0).to(q.dtype)  # [BLOCK_N, D] (e4m3 -> q's: exact)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2  # [M, BLOCK_N]
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :],
                mask=mask_n[:, None], other=0.0).to(q.dtype)  # [BLOCK_N, D]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _decode_attention_stage1_kernel(
    Q, K, V, ReqToToken, Rows, SeqLens, KeyStarts, MidO, MidLse, Out,
    sm_scale_log2,  # softmax scale * k_scale * log2(e): the kernel works in base 2
    v_scale,  # an FP8 pool's v scale (1.0 otherwise): the output is sum(p * v_pool) * v_scale
    stride_qb, stride_qh,
    stride_ob, stride_oh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_rt,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    G: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, F16_DOTS: tl.constexpr = False,
    HAS_KEY_STARTS: tl.constexpr = False, SPLIT_BASE: tl.constexpr = 0,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + b)
    row = tl.load(Rows + b).to(tl.int64)
    key_start = 0
    if HAS_KEY_STARTS:  # keys [0, key_start) are another kernel's (kernels/shared_prefix_decode_attention.py)
        key_start = tl.load(KeyStarts + b)
    split_len = tl.cdiv(tl.maximum(seq_len - key_start, 0), NUM_SPLITS)
    start = key_start + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < G
    heads = (kvh * G + offs_h).to(tl.int64)  # [BLOCK_H] query heads of this kv head
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None], other=0.0)  # [BLOCK_H, D]
    if F16_DOTS:  # e4m3 pool: e4m3 -> f16 is one conversion per 2 values, e4m3 -> bf16 goes through f16 and f32
        q = q.to(tl.float16)

    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    rt_base = ReqToToken + row * stride_rt
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        acc, m_i, l_i = _attend_key_tile(q, acc, m_i, l_i, n0, end, rt_base, k_base, v_base, stride_ks, stride_vs,
                                         offs_d, sm_scale_log2, BLOCK_N, DOT_PRECISION)

    if NUM_SPLITS == 1 and not HAS_KEY_STARTS:  # the whole sequence: normalise, store the output (seq_len 0: zeros)
        out = tl.where(l_i[:, None] > 0.0, acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * v_scale, 0.0)
        tl.store(Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=mask_h[:, None])
        return
    mid_lse = MidLse + b.to(tl.int64) * stride_mlb + heads * stride_mlh + SPLIT_BASE + split
    if end > start:
        mid_o = (MidO + b.to(tl.int64) * stride_mob + heads[:, None] * stride_moh
                 + (SPLIT_BASE + split) * stride_mos + offs_d[None, :])
        tl.store(mid_o, acc / l_i[:, None] * v_scale, mask=mask_h[:, None])
        tl.store(mid_lse, m_i + tl.math.log2(l_i), mask=mask_h)
    else:  # empty split (seq_len < num_kv_splits): stage 2 skips it
        tl.store(mid_lse, tl.full([BLOCK_H], float("-inf"), dtype=tl.float32), mask=mask_h)


@triton.jit
def _decode_attention_stage2_kernel(
    MidO, MidLse, Out,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_ob, stride_oh,
    D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, D)
    lse = tl.load(MidLse + b * stride_mlb + h * stride_mlh + offs_s,
                  mask=offs_s < NUM_SPLITS, other=float("-inf"))  # [SPLITS_P2]
    valid = lse > float("-inf")
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)  # all splits empty: keep -inf - -inf (NaN) out
    w = tl.where(valid, tl.math.exp2(lse - m), 0.0)
    # empty splits never wrote their partial output: do not read it
    o = tl.load(MidO + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
                mask=valid[:, None], other=0.0)  # [SPLITS_P2, D]
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)  # seq_len 0 (padding) gives zeros, not NaN
    out = tl.sum(w[:, None] * o, 0) / denom
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty))


def _check_pool(q, k_pool, v_pool, req_to_token, *others) -> tuple[int, int, int]:
    """The checks every attention over the pool shares: q, the pools and req_to_token (and `others`:
    the kernel's own index tensors) on one device -> (num_heads, num_kv_heads, head_dim)."""
    assert q.dtype in _DTYPES, f"q dtype {q.dtype} not in {_DTYPES}"
    assert k_pool.dtype == v_pool.dtype, f"k/v pool dtypes differ: {k_pool.dtype}, {v_pool.dtype}"
    check_pool_dtype(k_pool, q.dtype, "k_pool")
    assert k_pool.dim() == 3 and v_pool.shape == k_pool.shape, (
        f"k_pool {tuple(k_pool.shape)} / v_pool {tuple(v_pool.shape)}: want [num_slots, num_kv_heads, head_dim]")
    head_dim = q.shape[-1]
    assert k_pool.shape[2] == head_dim, f"head_dim of q {head_dim} != pool {k_pool.shape[2]}"
    assert 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0, (
        f"head_dim {head_dim} must be a power of 2 in [16, 256]")
    num_heads, num_kv_heads = q.shape[-2], k_pool.shape[1]
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}"
    assert q.stride(-1) == 1 and k_pool.stride(2) == 1 and v_pool.stride(2) == 1, "head_dim must be contiguous"
    assert req_to_token.dim() == 2 and req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1, (
        "req_to_token must be [max_rows, max_len] int32, contiguous rows")
    devices = {t.device for t in (q, k_pool, v_pool, req_to_token, *others)}
    assert len(devices) == 1, f"tensors on several devices: {devices}"
    return num_heads, num_kv_heads, head_dim


def _check_common(q, k_pool, v_pool, req_to_token, rows, seq_lens):
    assert rows.dim() == 1 and rows.dtype in (torch.int32, torch.int64) and rows.is_contiguous(), (
        "rows must be a contiguous 1-d int32/int64 tensor")
    assert seq_lens.dim() == 1 and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(), (
        "seq_lens must be a contiguous 1-d int32 tensor")
    return _check_pool(q, k_pool, v_pool, req_to_token, rows, seq_lens)


def _decode_config(dtype, head_dim: int, kv_dtype=None) -> tuple[int, int, int]:
    """Stage 1 BLOCK_N, num_warps, num_stages for q's dtype and the pool's (None: q's)."""
    # H200, batch 64 x 4096 keys, 16/8 heads, D 128, bf16: 64/4/3 reads at ~93% of copy bandwidth
    # (64/4/2: 83%, 64/4/1: 73%; 128/4/2 and 32/2/3 are as good). Decode is memory bound.
    if dtype == torch.float32:
        return 32, 4, 3
    # An e4m3 pool (H100, the 8B's heads, `device_check.sh kvsweep`, session 35): 128/4/3 reads at 70-76%
    # of bandwidth against 61-68% for 64/4/3 (bf16 pools: 91-92% for both); 8 warps or 4 stages are slower.
    if kv_dtype == KV_FP8_DTYPE:
        return 128, 4, 3
    return 64, 4, 3


# fp16 dots for a bf16 model over an e4m3 pool (H100, kvsweep, session 35): 637 against 689 us at
# batch 256 x 3,072 keys, 446 against 476 us at 64 x 8,192, at the 128/4/3 tile
F16_DOTS_OVER_E4M3 = True


def _f16_dots(dtype, kv_dtype) -> bool:
    """Whether stage 1 takes its dots in fp16 (q, k, v and p cast to fp16, float32 sums): for a bf16 model
    reading an e4m3 pool, where e4m3 -> f16 is a single conversion and e4m3 -> bf16 is not. Exact for the
    pool (every e4m3 value is an f16); q and p get f16's 10 mantissa bits, more than bf16's 7."""
    return F16_DOTS_OVER_E4M3 and dtype == torch.bfloat16 and kv_dtype == KV_FP8_DTYPE


def decode_attention(q, k_pool, v_pool, req_to_token, rows, seq_lens, scale: float,
                     num_kv_splits: int = 16, out: torch.Tensor | None = None,
                     stage1_config: tuple[int, int, int] | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0, f16_dots: bool | None = None) -> torch.Tensor:
    """Attention of one new token per request over its keys [0, seq_len) in the pool.

    q [B, H, D] (any strides with a contiguous last dim, e.g. a slice of qkv);
    k_pool, v_pool [num_slots, KVH, D] in q's dtype, or e4m3 with per-tensor k_scale / v_scale
    (kernels/kv_store.py); req_to_token [max_rows, max_len] int32;
    rows [B] int32/int64: table row of each request; seq_lens [B] int32 (>= 1;
    0 gives zeros). Returns out [B, H, D] in q.dtype (written into `out` if given).
    `stage1_config` (BLOCK_N, num_warps, num_stages) overrides `_decode_config` and `f16_dots`
    `_f16_dots` (benchmark sweeps).
    """
    assert q.dim() == 3, f"q {tuple(q.shape)}: want [batch, num_heads, head_dim]"
    num_heads, num_kv_heads, head_dim = _check_common(q, k_pool, v_pool, req_to_token, rows, seq_lens)
    batch = q.shape[0]
    assert rows.shape[0] == batch and seq_lens.shape[0] == batch, "rows / seq_lens must have one entry per request"
    assert num_kv_splits >= 1
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1 and out.device == q.device
    if batch == 0:
        return out

    block_n, num_warps, num_stages = stage1_config or _decode_config(q.dtype, head_dim, k_pool.dtype)
    f16_dots = _f16_dots(q.dtype, k_pool.dtype) if f16_dots is None else f16_dots
    # scratch sized from shapes only: fine under CUDA graph capture (one split: unused, one element)
    parts = (batch, num_heads, num_kv_splits) if num_kv_splits > 1 else (1, 1, 1)
    mid_o = torch.empty((*parts, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(parts, dtype=torch.float32, device=q.device)

    _launch_stage1(q, k_pool, v_pool, req_to_token, rows, seq_lens, mid_o, mid_lse, out, scale * k_scale * _LOG2E,
                   v_scale, num_kv_splits, (block_n, num_warps, num_stages), f16_dots)
    if num_kv_splits > 1:
        _launch_stage2(mid_o, mid_lse, out, num_kv_splits)
    return out


def _launch_stage1(q, k_pool, v_pool, req_to_token, rows, seq_lens, mid_o, mid_lse, out, sm_scale_log2: float,
                   v_scale: float, num_kv_splits: int, config: tuple[int, int, int], f16_dots: bool,
                   key_starts: torch.Tensor | None = None, split_base: int = 0) -> None:
    """Stage 1 over each request's keys [key_starts or 0, seq_len), its splits in mid slots from split_base
    (one split and no key_starts: the output itself). Shared with kernels/shared_prefix_decode_attention.py."""
    (batch, num_heads, head_dim), num_kv_heads = q.shape, k_pool.shape[1]
    block_n, num_warps, num_stages = config
    _decode_attention_stage1_kernel[(batch, num_kv_heads, num_kv_splits)](
        q, k_pool, v_pool, req_to_token, rows, seq_lens, seq_lens if key_starts is None else key_starts,
        mid_o, mid_lse, out,
        sm_scale_log2, v_scale,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        G=num_heads // num_kv_heads, BLOCK_H=max(16, triton.next_power_of_2(num_heads // num_kv_heads)), D=head_dim,
        BLOCK_N=block_n, NUM_SPLITS=num_kv_splits, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        F16_DOTS=f16_dots, HAS_KEY_STARTS=key_starts is not None, SPLIT_BASE=split_base,
        num_warps=num_warps, num_stages=num_stages,
    )


def _launch_stage2(mid_o, mid_lse, out, num_splits: int) -> None:
    """Stage 2: out [B, H, D] merged from the first num_splits mid slots of each (request, head)."""
    batch, num_heads, head_dim = out.shape
    _decode_attention_stage2_kernel[(batch, num_heads)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        D=head_dim, NUM_SPLITS=num_splits, SPLITS_P2=triton.next_power_of_2(num_splits),
        num_warps=4 if head_dim >= 128 else 2,
    )


def decode_attention_ref(q, k_pool, v_pool, req_to_token, rows, seq_lens, scale: float,
                         k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Plain torch, one request at a time, float32 math; same arguments and result as decode_attention."""
    num_heads, num_kv_heads = q.shape[1], k_pool.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for b in range(q.shape[0]):
        seq_len = int(seq_lens[b])
        slots = req_to_token[int(rows[b]), :seq_len].long()
        k = from_pool_ref(k_pool[slots], k_scale, torch.float32).repeat_interleave(group, dim=1)  # [L, H, D]
        v = from_pool_ref(v_pool[slots], v_scale, torch.float32).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale  # [H, L]
        out[b] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


def benchmark_decode_attention(batch: int = 64, context: int = 4096, num_heads: int = 16, num_kv_heads: int = 8,
                               head_dim: int = 128, dtype=torch.bfloat16, num_kv_splits: int = 16,
                               hbm_bytes_per_s: float | None = None,
                               stage1_config: tuple[int, int, int] | None = None, kv_dtype=None,
                               f16_dots: bool | None = None) -> dict:
    """Time decode_attention on CUDA (triton.testing.do_bench, median) for one decode step.

    Every request has `context` keys in scattered slots (a random permutation of
    the pool); `kv_dtype` torch.float8_e4m3fn times an FP8 pool. GB/s counts the bytes
    that must move: K and V of every request once (in the pool's dtype), q and out;
    `hbm_fraction` divides by `hbm_bytes_per_s` when given.
    """
    assert torch.cuda.is_available(), "benchmark_decode_attention needs a CUDA device"
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    num_slots = batch * context
    kv_dtype = kv_dtype or dtype
    k_pool = torch.randn((num_slots, num_kv_heads, head_dim), device=device, generator=gen).to(kv_dtype)
    v_pool = torch.randn((num_slots, num_kv_heads, head_dim), device=device, generator=gen).to(kv_dtype)
    q = torch.randn((batch, num_heads, head_dim), dtype=dtype, device=device, generator=gen)
    req_to_token = torch.randperm(num_slots, device=device, generator=gen).to(torch.int32).view(batch, context)
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(head_dim)

    def step():
        decode_attention(q, k_pool, v_pool, req_to_token, rows, seq_lens, scale, num_kv_splits, out=out,
                         stage1_config=stage1_config, f16_dots=f16_dots)

    step()
    seconds = triton.testing.do_bench(step, return_mode="median") * 1e-3
    elt = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * k_pool.element_size()
    total = kv_bytes + 2 * batch * num_heads * head_dim * elt
    result = {
        "batch": batch, "context": context, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
        "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch."), "num_kv_splits": num_kv_splits,
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "stage1_config": list(stage1_config or _decode_config(dtype, head_dim, k_pool.dtype)),
        "f16_dots": _f16_dots(dtype, kv_dtype) if f16_dots is None else f16_dots,
        "time_us": seconds * 1e6, "bytes": total, "gb_per_s": total / seconds / 1e9,
    }
    if hbm_bytes_per_s is not None:
        result["hbm_fraction"] = total / seconds / hbm_bytes_per_s
    return result
