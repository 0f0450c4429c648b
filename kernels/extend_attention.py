"""Prefill / chunked prefill / extend attention over the token-slot KV pool.

The new tokens of B requests sit back to back in q [T, H, D]; request b owns
q[q_starts[b]:q_starts[b+1]], at positions prefix_lens[b] .. seq_lens[b]-1, and
its keys (cached prefix and the new tokens, already stored) are read from the
pool through req_to_token. Query i of request b attends causally to keys
[0, prefix_lens[b] + i].

Grid (cdiv(max_q_len, BLOCK_M), H, B): a program takes BLOCK_M queries of one
head and runs a flash-attention online softmax (tl.dot, float32 accumulation)
over key blocks up to the causal limit of its last query; blocks past it are
never loaded. Key blocks before the block's first query position take no mask;
only the diagonal ones do. Query blocks are visited last-first so the longest programs
start first. Programs past a request's q_len exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import _LOG2E, _check_common
from .kv_fp8_ref import from_pool_ref


@triton.jit
def _extend_attention_block(acc, l_i, m_i, q, q_pos, k_base, v_base, rt_base, stride_ks, stride_vs,
                            lo, hi, kv_end, sm_scale_log2, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                            DOT_PRECISION: tl.constexpr):
    """Online-softmax steps over key blocks [lo, hi). MASKED=False: every key is visible to every query.
    K/V rows are read as q's dtype (an e4m3 pool's exactly; its scales are applied by the caller)."""
    offs_d = tl.arange(0, D)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            mask_n = offs_n < kv_end
            slots = tl.load(rt_base + offs_n, mask=mask_n, other=0).to(tl.int64)  # [BLOCK_N]
            k = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        else:
            slots = tl.load(rt_base + offs_n).to(tl.int64)
            k = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :])  # [BLOCK_N, D]
        k = k.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2  # [BLOCK_M, BLOCK_N]
        if MASKED:
            visible = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        else:
            v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :])  # [BLOCK_N, D]
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _extend_attention_kernel(
    Q, K, V, Out, ReqToToken, Rows, QStarts, PrefixLens, SeqLens,
    sm_scale_log2,  # softmax scale * k_scale * log2(e): the kernel works in base 2
    v_scale,  # an FP8 pool's v scale (1.0 otherwise)
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_rt,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    mblk = tl.num_programs(0) - 1 - tl.program_id(0)  # last query blocks (most keys) first
    h = tl.program_id(1)
    b = tl.program_id(2)

    q_start = tl.load(QStarts + b)
    q_len = tl.load(QStarts + b + 1) - q_start
    if mblk * BLOCK_M >= q_len:
        return
    prefix = tl.load(PrefixLens + b)
    seq_len = tl.load(SeqLens + b)
    row = tl.load(Rows + b).to(tl.int64)
    kvh = (h // G).to(tl.int64)

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    offs_d = tl.arange(0, D)
    tok = (q_start + offs_m).to(tl.int64)  # [BLOCK_M] rows of q / out
    q = tl.load(Q + tok[:, None] * stride_qt + h.to(tl.int64) * stride_qh + offs_d[None, :],
                mask=mask_m[:, None], other=0.0)  # [BLOCK_M, D]
    q_pos = prefix + offs_m  # [BLOCK_M] positions of the queries

    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    rt_base = ReqToToken + row * stride_rt
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    # keys before the block's first query position are visible to all its queries: no masks there;
    # the rest, up to the last query's position, takes the causal mask
    kv_end = tl.minimum(prefix + tl.minimum(q_len, (mblk + 1) * BLOCK_M), seq_len)
    full_end = (prefix + mblk * BLOCK_M) // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _extend_attention_block(acc, l_i, m_i, q, q_pos, k_base, v_base, rt_base, stride_ks, stride_vs,
                                            0, full_end, kv_end, sm_scale_log2, D, BLOCK_N, False, DOT_PRECISION)
    # every query row sees key 0, so no row is all -inf once a block has run
    acc, l_i, m_i = _extend_attention_block(acc, l_i, m_i, q, q_pos, k_base, v_base, rt_base, stride_ks, stride_vs,
                                            full_end, kv_end, kv_end, sm_scale_log2, D, BLOCK_N, True, DOT_PRECISION)

    out = acc / l_i[:, None] * v_scale
    tl.store(Out + tok[:, None] * stride_ot + h.to(tl.int64) * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_m[:, None])


def _config(dtype, head_dim: int) -> tuple[int, int, int, int]:
    """BLOCK_M, BLOCK_N, num_warps, num_stages."""
    # H200, bf16, 8 x 2048-token causal prefill, 16/8 heads, D 128: 128/64/4/3 runs ~300 TFLOP/s
    # (SDPA flash on dense tensors ~505; 64/64/4/3 ~250; 128/64/8/3 ~233).
    if dtype == torch.float32:
        return 32, 32, 4, 2
    if head_dim > 128:  # keep Q + 3 stages of K/V inside shared memory
        return 64, 32, 4, 2
    return 128, 64, 4, 3


def extend_attention(q, k_pool, v_pool, req_to_token, rows, q_starts, prefix_lens, seq_lens, scale: float,
                     max_q_len: int, out: torch.Tensor | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of the new tokens of B requests over their prefix and themselves.

    q [T, H, D] (any strides with a contiguous last dim); k_pool, v_pool
    [num_slots, KVH, D] with the new tokens' k/v already stored (q's dtype, or e4m3 with per-tensor
    k_scale / v_scale: kernels/kv_store.py);
    req_to_token [max_rows, max_len] int32; rows [B] int32/int64;
    q_starts [B+1] int32 (q_starts[0] = 0, q_starts[B] = T); prefix_lens and
    seq_lens [B] int32 with seq_lens = prefix_lens + q_len; max_q_len: a host
    int >= every q_len (it sizes the grid; a smaller one leaves tokens unwritten).
    Returns out [T, H, D] in q.dtype (written into `out` if given).
    """
    assert q.dim() == 3, f"q {tuple(q.shape)}: want [num_tokens, num_heads, head_dim]"
    num_heads, num_kv_heads, head_dim = _check_common(q, k_pool, v_pool, req_to_token, rows, seq_lens)
    batch = rows.shape[0]
    assert q_starts.shape == (batch + 1,) and q_starts.dtype == torch.int32 and q_starts.is_contiguous(), (
        "q_starts must be a contiguous [B+1] int32 tensor")
    assert prefix_lens.shape == (batch,) and prefix_lens.dtype == torch.int32 and prefix_lens.is_contiguous(), (
        "prefix_lens must be a contiguous [B] int32 tensor")
    assert seq_lens.shape == (batch,), "seq_lens must have one entry per request"
    assert q_starts.device == q.device and prefix_lens.device == q.device
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1 and out.device == q.device
    if batch == 0 or max_q_len <= 0 or q.shape[0] == 0:
        return out

    block_m, block_n, num_warps, num_stages = _config(q.dtype, head_dim)
    grid = (triton.cdiv(max_q_len, block_m), num_heads, batch)
    assert batch <= 65535, f"batch {batch} exceeds the grid limit 65535"
    _extend_attention_kernel[grid](
        q, k_pool, v_pool, out, req_to_token, rows, q_starts, prefix_lens, seq_lens,
        scale * k_scale * _LOG2E, v_scale,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1),
        req_to_token.stride(0),
        G=num_heads // num_kv_heads, D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def extend_attention_ref(q, k_pool, v_pool, req_to_token, rows, q_starts, prefix_lens, seq_lens, scale: float,
                         max_q_len: int, out=None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Plain torch, one request at a time, float32 math; same arguments and result as extend_attention."""
    num_heads, num_kv_heads = q.shape[1], k_pool.shape[1]
    group = num_heads // num_kv_heads
    result = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for b in range(rows.shape[0]):
        start, end = int(q_starts[b]), int(q_starts[b + 1])
        prefix, seq_len = int(prefix_lens[b]), int(seq_lens[b])
        assert seq_len == prefix + end - start, f"request {b}: seq_len {seq_len} != prefix {prefix} + q_len"
        assert end - start <= max_q_len, f"request {b}: q_len {end - start} > max_q_len {max_q_len}"
        slots = req_to_token[int(rows[b]), :seq_len].long()
        k = from_pool_ref(k_pool[slots], k_scale, torch.float32).repeat_interleave(group, dim=1)  # [L, H, D]
        v = from_pool_ref(v_pool[slots], v_scale, torch.float32).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,lhd->hql", q[start:end].float(), k) * scale  # [H, Q, L]
        q_pos = prefix + torch.arange(end - start, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [Q, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        result[start:end] = torch.einsum("hql,lhd->qhd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result
