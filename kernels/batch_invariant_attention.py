"""Attention whose every query row has the same bits whatever batch, chunk or step computes it: the
on-policy mode's attention (issue 19). One kernel serves prefill, chunked prefill, extend and decode.

The default kernels take their arithmetic from the batch: decode splits a request's keys into
num_kv_splits = f(batch) pieces, and the extend kernel walks keys in tiles relative to its query
block. So a token computed in a decode step, in a prefill chunk, or beside another batch may round
differently. Here a query row's arithmetic depends on its own position p, its q and keys [0, p]:
  - keys are visited in tiles of BLOCK_N at absolute positions (tile j covers [j BLOCK_N, (j+1) BLOCK_N)),
    grouped into splits of SPLIT positions (a multiple of BLOCK_N), also at absolute positions;
  - within a split, an online softmax (base 2, float32) from a fresh state over its tiles in order;
    a key past p is masked to -inf, so a tile a row cannot see leaves its state unchanged exactly
    (alpha = exp2(0) = 1, its p = 0);
  - the splits' states (max m, sum l, acc) are merged in split order from the empty state (m = -inf,
    l = 0, acc = 0: the first merge copies), then out = acc / l;
  - tile shapes, warps and the MMA instruction are fixed per (dtype, head_dim, G), never per batch.

How the work is laid out does not enter the arithmetic. A program takes a query block: BLOCK_M =
max(16, next_pow2(G)) rows, the G query heads of one kv head for BLOCK_M // G consecutive tokens of
one request (`query_blocks` cuts a batch into them). With P = 1 it walks all the splits of its rows
and merges them in registers (when the blocks alone fill the GPU). With P > 1 (few blocks, long
contexts: the decode tail), P programs per block take every P-th split and write the raw split
states, and a second launch merges them in the same order. Both give the same bits: the same
float32 operations in the same order, compiled without FMA contraction (enable_fp_fusion=False)
so the compiler cannot fuse them one way in one kernel and another way in the other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import _LOG2E, _check_pool

SPLIT = 1024  # key positions per split; a multiple of every BLOCK_N below
TARGET_PROGRAMS = 512  # programs wanted in flight (about four per SM of the H200's 132)
PARTIALS_BUDGET = 64 << 20  # bytes of split states a P > 1 launch may allocate


@triton.jit
def _merge(m_all, l_all, acc_all, m, l, acc, take):
    """Merge a split's state (m, l [R], acc [R, D]) into the running one, in rows where take [R]."""
    m_new = tl.maximum(m_all, m)
    a = tl.math.exp2(m_all - m_new)
    b = tl.math.exp2(m - m_new)
    l_new = l_all * a + l * b
    acc_new = acc_all * a[:, None] + acc * b[:, None]
    return (tl.where(take, m_new, m_all), tl.where(take, l_new, l_all),
            tl.where(take[:, None], acc_new, acc_all))


@triton.jit
def _block_rows(Blocks, blk, kvh, G: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Query block blk's rows for kv head kvh: row r is token r // G of the block, query head
    kvh * G + r % G -> (first position, the block's last position (it sees keys [0, last]), valid [BLOCK_M],
    each row's position, head and q row)."""
    q0 = tl.load(Blocks + blk * 4 + 1)
    pos0 = tl.load(Blocks + blk * 4 + 2)
    num_tokens = tl.load(Blocks + blk * 4 + 3)
    offs_m = tl.arange(0, BLOCK_M)
    tok = offs_m // G
    valid = (tok < num_tokens) & (tok < TOKENS)
    pos = tl.where(valid, pos0 + tok, pos0)  # padding rows see what the block's first row sees: no NaN
    heads = (kvh * G + offs_m % G).to(tl.int64)
    return pos0, pos0 + num_tokens - 1, valid, pos, heads, (q0 + tok).to(tl.int64)


@triton.jit(do_not_specialize=["P"])
def _split_states_kernel(
    Q, K, V, ReqToToken, Blocks, Out, PartAcc, PartML,
    sm_scale_log2, P,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_ks, stride_kh, stride_vs, stride_vh, stride_rt,
    stride_pat, stride_pah, stride_pas, stride_pmt, stride_pmh, stride_pms,
    G: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (num_blocks, num_kv_heads, P). Blocks [num_blocks, 4] int32: table row, first q row,
    first position, token count. P == 1: merge here and write Out. P > 1: write each split's raw
    state to PartAcc [T, H, S, D] / PartML [T, H, S, 2] for _merge_splits_kernel."""
    blk = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    first_split = tl.program_id(2)
    table_row = tl.load(Blocks + blk * 4).to(tl.int64)
    pos0, last_pos, valid, pos, heads, q_rows = _block_rows(Blocks, blk, kvh, G, TOKENS, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=valid[:, None], other=0.0)  # [BLOCK_M, D]

    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    rt_base = ReqToToken + table_row * stride_rt
    m_all = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_all = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_all = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for s in range(first_split, last_pos // SPLIT + 1, P):
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        lo = s * SPLIT
        for n0 in range(lo, tl.minimum(lo + SPLIT, last_pos + 1), BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            in_context = offs_n <= last_pos
            slots = tl.load(rt_base + offs_n, mask=in_context, other=0).to(tl.int64)  # [BLOCK_N]
            k = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :], mask=in_context[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2  # [BLOCK_M, BLOCK_N]
            qk = tl.where(offs_n[None, :] <= pos[:, None], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :], mask=in_context[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        seen = valid & (lo <= pos)  # rows with keys in this split (others hold NaN from -inf - -inf)
        if P == 1:
            m_all, l_all, acc_all = _merge(m_all, l_all, acc_all, m_i, l_i, acc, seen)
        else:
            pa = PartAcc + q_rows[:, None] * stride_pat + heads[:, None] * stride_pah + s * stride_pas + offs_d[None, :]
            tl.store(pa, acc, mask=seen[:, None])
            pm = PartML + q_rows * stride_pmt + heads * stride_pmh + s * stride_pms
            tl.store(pm, m_i, mask=seen)
            tl.store(pm + 1, l_i, mask=seen)
    if P == 1:
        out = acc_all / l_all[:, None]
        tl.store(Out + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _merge_splits_kernel(
    Blocks, Out, PartAcc, PartML,
    stride_ot, stride_oh, stride_pat, stride_pah, stride_pas, stride_pmt, stride_pmh, stride_pms,
    G: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
):
    """Grid (num_blocks, num_kv_heads): merge each row's split states in split order (as P == 1 does
    in registers) and write Out."""
    blk = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    pos0, last_pos, valid, pos, heads, q_rows = _block_rows(Blocks, blk, kvh, G, TOKENS, BLOCK_M)
    offs_d = tl.arange(0, D)
    m_all = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_all = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_all = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for s in range(0, last_pos // SPLIT + 1):
        seen = valid & (s * SPLIT <= pos)
        pm = PartML + q_rows * stride_pmt + heads * stride_pmh + s * stride_pms
        m_i = tl.load(pm, mask=seen, other=float("-inf"))
        l_i = tl.load(pm + 1, mask=seen, other=0.0)
        acc = tl.load(PartAcc + q_rows[:, None] * stride_pat + heads[:, None] * stride_pah + s * stride_pas
                      + offs_d[None, :], mask=seen[:, None], other=0.0)
        m_all, l_all, acc_all = _merge(m_all, l_all, acc_all, m_i, l_i, acc, seen)
    out = acc_all / l_all[:, None]
    tl.store(Out + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=valid[:, None])


def block_rows(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(BLOCK_M, tokens per block) for a head layout: G = num_heads // num_kv_heads query heads share
    a kv head; a block is BLOCK_M = max(16, next_pow2(G)) rows of BLOCK_M // G tokens x G heads."""
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group))
    return block_m, block_m // group


def query_blocks(spans, tokens_per_block: int) -> list[tuple[int, int, int, int]]:
    """spans: (table_row, first q row, first position, token count) per request, in any order ->
    (table_row, first q row, first position, token count) per block of at most tokens_per_block
    consecutive tokens, for `batch_invariant_attention`'s `blocks` (as an int32 [NB, 4] tensor)."""
    blocks = []
    for table_row, q_row, position, count in spans:
        for i in range(0, count, tokens_per_block):
            blocks.append((table_row, q_row + i, position + i, min(tokens_per_block, count - i)))
    return blocks


def _config(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages): fixed per dtype, never per batch (part of the arithmetic)."""
    if dtype == torch.float32:
        return 32, 4, 2
    return 64, 4, 2


def split_programs(num_blocks: int, num_kv_heads: int, max_splits: int, partial_bytes: int) -> int:
    """P, the programs per (block, kv head): 1 when the blocks fill the GPU, else enough to; a power
    of two, at most max_splits, and 1 when the split states would take over PARTIALS_BUDGET bytes.
    Only speed depends on it: every P gives the same bits."""
    want = TARGET_PROGRAMS // max(1, num_blocks * num_kv_heads)
    if want <= 1 or max_splits <= 1 or partial_bytes > PARTIALS_BUDGET:
        return 1
    return min(1 << (want.bit_length() - 1), 1 << (max_splits.bit_length() - 1))


def batch_invariant_attention(q, k_pool, v_pool, req_to_token, blocks, scale: float, out=None,
                              split: int = SPLIT, programs: int | None = None) -> torch.Tensor:
    """Causal attention of the query rows q [T, H, D] over the pool, each row batch-invariant.

    blocks [NB, 4] int32 (`query_blocks`): table row, first q row, first position, token count; the
    block's tokens are q rows first .. first + count - 1 at consecutive positions, and each attends
    to keys [0, its position] read through req_to_token (its own k/v already stored). Every q row
    must belong to one block. k_pool, v_pool [num_slots, KVH, D]; req_to_token [rows, max_len]
    int32. Returns out [T, H, D] in q.dtype (written into `out` if given). `split` (positions per
    split, a multiple of 64) is part of the arithmetic; `programs` (P) overrides the choice of
    `split_programs`, which changes speed only (tests use it).
    """
    assert q.dim() == 3, f"q {tuple(q.shape)}: want [tokens, num_heads, head_dim]"
    num_heads, num_kv_heads, head_dim = _check_pool(q, k_pool, v_pool, req_to_token, blocks)
    assert blocks.dim() == 2 and blocks.shape[1] == 4 and blocks.dtype == torch.int32 and blocks.is_contiguous(), \
        "blocks must be a contiguous [num_blocks, 4] int32 tensor (query_blocks)"
    block_n, num_warps, num_stages = _config(q.dtype)
    assert split >= block_n and split % 64 == 0, f"split {split} must be a positive multiple of 64"
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1 and out.device == q.device
    num_blocks = blocks.shape[0]
    if num_blocks == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, tokens = block_rows(num_heads, num_kv_heads)
    # split states sized from shapes only (CUDA-graph capturable): every split a row of req_to_token can have
    max_splits = triton.cdiv(req_to_token.shape[1], split)
    partial_bytes = q.shape[0] * num_heads * max_splits * (head_dim + 2) * 4
    if programs is None:
        programs = split_programs(num_blocks, num_kv_heads, max_splits, partial_bytes)
    assert programs >= 1
    shape = (q.shape[0], num_heads, max_splits) if programs > 1 else (1, 1, 1)
    part_acc = torch.empty((*shape, head_dim), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((*shape, 2), dtype=torch.float32, device=q.device)
    common = dict(G=group, TOKENS=tokens, BLOCK_M=block_m, D=head_dim, SPLIT=split)
    part_strides = (*part_acc.stride()[:3], *part_ml.stride()[:3])
    _split_states_kernel[(num_blocks, num_kv_heads, programs)](
        q, k_pool, v_pool, req_to_token, blocks, out, part_acc, part_ml,
        scale * _LOG2E, programs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), req_to_token.stride(0),
        *part_strides,
        BLOCK_N=block_n, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **common,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,
    )
    if programs > 1:
        _merge_splits_kernel[(num_blocks, num_kv_heads)](
            blocks, out, part_acc, part_ml, out.stride(0), out.stride(1), *part_strides, **common,
            num_warps=num_warps, enable_fp_fusion=False,
        )
    return out


def batch_invariant_attention_ref(q, k_pool, v_pool, req_to_token, blocks, scale: float) -> torch.Tensor:
    """Plain torch, one query token at a time, float32 softmax; the same arguments and result as
    batch_invariant_attention up to rounding."""
    num_heads, num_kv_heads = q.shape[1], k_pool.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    for table_row, q_row, position, count in blocks.tolist():
        for i in range(count):
            slots = req_to_token[table_row, : position + i + 1].long()
            k = k_pool[slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
            v = v_pool[slots].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[q_row + i].float(), k) * scale  # [H, L]
            out[q_row + i] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out
