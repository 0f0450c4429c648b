"""Decode attention that reads a shared prefix once per group of requests (cascade decode).

The n samples of a GRPO prompt share the prompt's KV slots (the prefix cache hands every sample the
same slots), yet plain decode attention (kernels/decode_attention.py) has each sample read them
again: at 64 prompts x n 16 with 512-token prompts that is up to half of a step's KV traffic
(issue 25). Here the batch is cut into groups of requests (listed through `order`, anywhere in the
batch) that share their first prefix_len keys, and attention runs in three launches:

  prefix, grid (num_groups, num_kv_heads, PREFIX_SPLITS): a program owns one kv head of one group
    and stacks its members' G query heads into one [BLOCK_M, D] block, BLOCK_M // G members at a
    time, so each prefix K/V row is read once per chunk of members (once for a group that fits) and
    the dots are real matrix work. It writes each member's partial output and log-sum-exp into mid
    slots [0, PREFIX_SPLITS).
  suffix: decode_attention's stage 1 over keys [prefix_len, seq_len) of each request (KeyStarts),
    its splits in mid slots [PREFIX_SPLITS, PREFIX_SPLITS + num_kv_splits).
  merge: decode_attention's stage 2 over all the slots (empty ones carry lse = -inf and are skipped).

The result is the same attention as decode_attention's up to float32 summation order. A group's
prefix slots are read from its FIRST member's req_to_token row: callers guarantee the members'
rows agree there. A request alone (a group of one, prefix 0) gets plain decode through the suffix
launch. Everything is sized from shapes and host ints: CUDA-graph capturable.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .decode_attention import (_LOG2E, _attend_key_tile, _check_common, _decode_config, _f16_dots, _launch_stage1,
                               _launch_stage2, decode_attention, decode_attention_ref)
from .kv_fp8_ref import from_pool_ref

MAX_BLOCK_M = 128  # query rows of one prefix program: members * G (acc [128, D] float32 is 8 warps' registers)


@triton.jit
def _shared_prefix_kernel(
    Q, K, V, ReqToToken, Rows, Order, GroupStarts, PrefixLens, MidO, MidLse,
    sm_scale_log2, v_scale,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_rt,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    G: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PREFIX_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, F16_DOTS: tl.constexpr,
):
    g = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    first = tl.load(GroupStarts + g)
    members = tl.load(GroupStarts + g + 1) - first  # 0: an empty group slot (padding for a fixed-size graph)
    prefix_len = tl.load(PrefixLens + g)
    split_len = tl.cdiv(prefix_len, PREFIX_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, prefix_len)

    MEMBERS_PER_BLOCK: tl.constexpr = BLOCK_M // G
    offs_m = tl.arange(0, BLOCK_M)  # row r: member r // G of the chunk, query head kvh * G + r % G
    heads = (kvh * G + offs_m % G).to(tl.int64)
    offs_d = tl.arange(0, D)
    row = tl.load(Rows + tl.load(Order + first, mask=members > 0, other=0)).to(tl.int64)
    rt_base = ReqToToken + row * stride_rt  # the first member's row holds the group's prefix slots
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    # members in chunks of BLOCK_M // G (one chunk for groups up to that size; a larger group, or the
    # group of prefix 0 that collects the requests alone, reads the prefix once per chunk)
    for chunk in range(0, members, MEMBERS_PER_BLOCK):
        member = chunk + offs_m // G
        mask_m = (offs_m // G < MEMBERS_PER_BLOCK) & (member < members)
        reqs = tl.load(Order + first + member, mask=mask_m, other=0).to(tl.int64)  # [BLOCK_M] batch index
        q = tl.load(Q + reqs[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None], other=0.0)  # [BLOCK_M, D]
        if F16_DOTS:  # as decode_attention's stage 1 (bf16 model over an e4m3 pool)
            q = q.to(tl.float16)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):  # the prefix's keys, once for the chunk's BLOCK_M query rows
            acc, m_i, l_i = _attend_key_tile(q, acc, m_i, l_i, n0, end, rt_base, k_base, v_base, stride_ks,
                                             stride_vs, offs_d, sm_scale_log2, BLOCK_N, DOT_PRECISION)

        mid_lse = MidLse + reqs * stride_mlb + heads * stride_mlh + split
        if end > start:
            mid_o = (MidO + reqs[:, None] * stride_mob + heads[:, None] * stride_moh + split * stride_mos
                     + offs_d[None, :])
            tl.store(mid_o, acc / l_i[:, None] * v_scale, mask=mask_m[:, None])
            tl.store(mid_lse, m_i + tl.math.log2(l_i), mask=mask_m)
        else:  # no prefix keys in this split (prefix 0, or shorter than the split count): stage 2 skips it
            tl.store(mid_lse, tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), mask=mask_m)


def prefix_block_m(max_group_size: int, group: int) -> int:
    """Query rows of a prefix program: one chunk holds `max_group_size` members, within MAX_BLOCK_M."""
    return min(MAX_BLOCK_M, max(16, triton.next_power_of_2(max_group_size * group)))


def shared_prefix_decode_attention(q, k_pool, v_pool, req_to_token, rows, seq_lens, group_starts, prefix_lens,
                                   scale: float, max_group_size: int, order: torch.Tensor | None = None,
                                   prefix_splits: int = 4,
                                   num_kv_splits: int = 1, out: torch.Tensor | None = None,
                                   k_scale: float = 1.0, v_scale: float = 1.0,
                                   stage1_config: tuple[int, int, int] | None = None,
                                   f16_dots: bool | None = None) -> torch.Tensor:
    """decode_attention's result for q [B, H, D], reading each group's shared prefix once.

    order [B] int32: the batch indices listed group by group (default: the batch order);
    group_starts [NG + 1] int32, non-decreasing from 0 to B: group i is requests
    order[group_starts[i]:group_starts[i + 1]] (repeated entries: empty groups, so NG can be fixed);
    prefix_lens [NG] int32: keys [0, prefix_lens[i]) of every member sit in the same slots (read from
    the first member's row), prefix_lens[i] <= each member's seq_len. max_group_size: members a prefix
    program takes at once (its rows: members * G, at most MAX_BLOCK_M; a larger group is walked in
    chunks). Other arguments as decode_attention's.
    """
    num_heads, num_kv_heads, head_dim = _check_common(q, k_pool, v_pool, req_to_token, rows, seq_lens)
    assert group_starts.device == q.device and prefix_lens.device == q.device, "group tensors on another device"
    batch, group = q.shape[0], num_heads // num_kv_heads
    num_groups = prefix_lens.shape[0]
    assert group_starts.dtype == torch.int32 and prefix_lens.dtype == torch.int32
    assert group_starts.shape == (num_groups + 1,), "group_starts must have one entry more than prefix_lens"
    block_m = prefix_block_m(max_group_size, group)
    assert block_m >= group, f"{group} query heads a kv head > {MAX_BLOCK_M} rows"
    assert prefix_splits >= 1 and num_kv_splits >= 1
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if batch == 0:
        return out
    # the plain kernel's bf16 tile for every pool: over e4m3 pools, 128/4/3 (the plain kernel's e4m3 tile) made
    # this one slower at the GRPO shapes (H100, `device_check.sh cascade`, session 35: n 16, suffix 64 / 512 /
    # 1,024: 199 / 275 / 279 us against 99 / 200 / 322 us at 64/4/3)
    block_n, num_warps, num_stages = stage1_config or _decode_config(q.dtype, head_dim)
    f16_dots = _f16_dots(q.dtype, k_pool.dtype) if f16_dots is None else f16_dots
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    splits = prefix_splits + num_kv_splits
    mid_o = torch.empty((batch, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    positions = torch.arange(batch, dtype=torch.int32, device=q.device)
    order = positions if order is None else order
    assert order.dtype == torch.int32 and order.shape == (batch,) and order.device == q.device
    # each request's first own key: its group's prefix length (searchsorted, scatter: no host read)
    group_of = torch.searchsorted(group_starts[1:], positions, right=True).clamp_(max=num_groups - 1)
    key_starts = torch.empty_like(positions).index_put_((order.long(),), prefix_lens[group_of])  # [B] int32
    sm_scale_log2 = scale * k_scale * _LOG2E

    _shared_prefix_kernel[(num_groups, num_kv_heads, prefix_splits)](
        q, k_pool, v_pool, req_to_token, rows, order, group_starts, prefix_lens, mid_o, mid_lse,
        sm_scale_log2, v_scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        G=group, BLOCK_M=block_m, D=head_dim, BLOCK_N=block_n, PREFIX_SPLITS=prefix_splits,
        DOT_PRECISION=dot_precision, F16_DOTS=f16_dots, num_warps=8 if block_m > 64 else 4, num_stages=num_stages,
    )
    _launch_stage1(q, k_pool, v_pool, req_to_token, rows, seq_lens, mid_o, mid_lse, out, sm_scale_log2, v_scale,
                   num_kv_splits, (block_n, num_warps, num_stages), f16_dots, key_starts, split_base=prefix_splits)
    _launch_stage2(mid_o, mid_lse, out, splits)
    return out


def shared_prefix_decode_attention_ref(q, k_pool, v_pool, req_to_token, rows, seq_lens, group_starts,
                                       prefix_lens, scale: float, order: torch.Tensor | None = None,
                                       k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Plain torch, float32 math: each request attends to its group's first member's prefix slots, then
    its own slots from prefix_len on; same arguments (less the tuning ones) and result."""
    num_heads, num_kv_heads = q.shape[1], k_pool.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    starts = [int(s) for s in group_starts]
    order = list(range(q.shape[0])) if order is None else [int(i) for i in order]
    for g, prefix_len in enumerate(int(p) for p in prefix_lens):
        members = order[starts[g]:starts[g + 1]]
        first_row = int(rows[members[0]]) if members else 0
        for b in members:
            own = req_to_token[int(rows[b]), prefix_len:int(seq_lens[b])]
            slots = torch.cat([req_to_token[first_row, :prefix_len], own]).long()
            k = from_pool_ref(k_pool[slots], k_scale, torch.float32).repeat_interleave(group, dim=1)  # [L, H, D]
            v = from_pool_ref(v_pool[slots], v_scale, torch.float32).repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale  # [H, L]
            out[b] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


def grouped_case(num_groups: int, group_size: int, prefix_len: int, suffix_len: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, dtype, kv_dtype, device) -> dict:
    """One decode step of num_groups x group_size requests of prefix_len shared + suffix_len own keys
    (slots scattered), as keyword arguments of shared_prefix_decode_attention (less the tuning ones)."""
    gen = torch.Generator(device=device).manual_seed(0)
    batch, seq_len = num_groups * group_size, prefix_len + suffix_len
    num_slots = num_groups * prefix_len + batch * suffix_len
    k_pool = torch.randn((num_slots, num_kv_heads, head_dim), device=device, generator=gen).to(kv_dtype)
    v_pool = torch.randn((num_slots, num_kv_heads, head_dim), device=device, generator=gen).to(kv_dtype)
    perm = torch.randperm(num_slots, device=device, generator=gen).to(torch.int32)
    prefixes = perm[: num_groups * prefix_len].view(num_groups, 1, prefix_len).expand(-1, group_size, -1)
    suffixes = perm[num_groups * prefix_len:].view(num_groups, group_size, suffix_len)
    return dict(
        q=torch.randn((batch, num_heads, head_dim), device=device, generator=gen).to(dtype),
        k_pool=k_pool, v_pool=v_pool,
        req_to_token=torch.cat([prefixes, suffixes], dim=2).reshape(batch, seq_len).contiguous(),
        rows=torch.arange(batch, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        group_starts=torch.arange(0, batch + 1, group_size, dtype=torch.int32, device=device),
        prefix_lens=torch.full((num_groups,), prefix_len, dtype=torch.int32, device=device),
        scale=1.0 / math.sqrt(head_dim))


def benchmark_shared_prefix(num_groups: int = 16, group_size: int = 16, prefix_len: int = 512,
                            suffix_len: int = 512, num_heads: int = 16, num_kv_heads: int = 8, head_dim: int = 128,
                            dtype=torch.bfloat16, kv_dtype=None, prefix_splits: int = 4,
                            hbm_bytes_per_s: float | None = None) -> dict:
    """Time plain decode_attention against the shared-prefix path on CUDA over grouped_case's step.
    Bytes that must move: each group's prefix once, every request's suffix, q and out."""
    assert torch.cuda.is_available(), "benchmark_shared_prefix needs a CUDA device"
    case = grouped_case(num_groups, group_size, prefix_len, suffix_len, num_heads, num_kv_heads, head_dim, dtype,
                        kv_dtype or dtype, torch.device("cuda"))
    plain = {k: v for k, v in case.items() if k not in ("group_starts", "prefix_lens")}
    out = torch.empty_like(case["q"])
    batch = num_groups * group_size
    runs = {
        "plain": lambda: decode_attention(**plain, num_kv_splits=1 if batch * num_kv_heads >= 512 else 4, out=out),
        "shared": lambda: shared_prefix_decode_attention(**case, max_group_size=group_size,
                                                         prefix_splits=prefix_splits, out=out),
    }
    ref = decode_attention_ref(**{**plain, "q": case["q"][:2], "rows": case["rows"][:2],
                                  "seq_lens": case["seq_lens"][:2]})
    row_bytes = 2 * num_kv_heads * head_dim * case["k_pool"].element_size()  # K and V of one token
    q_bytes = 2 * case["q"].numel() * case["q"].element_size()  # q in, out
    must_move = (num_groups * prefix_len + batch * suffix_len) * row_bytes + q_bytes
    result = {"batch": batch, "group_size": group_size, "prefix_len": prefix_len, "suffix_len": suffix_len,
              "kv_dtype": str(case["k_pool"].dtype).removeprefix("torch."), "bytes_must_move": must_move}
    for name, fn in runs.items():
        fn()
        torch.testing.assert_close(out[:2].float(), ref.float(), atol=3e-2, rtol=3e-2)  # both paths right
        seconds = triton.testing.do_bench(fn, return_mode="median") * 1e-3
        result[f"{name}_us"] = seconds * 1e6
        if hbm_bytes_per_s is not None:
            result[f"{name}_fraction"] = must_move / seconds / hbm_bytes_per_s
    return result
