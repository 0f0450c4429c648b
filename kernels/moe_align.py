"""Sort a MoE layer's (token, choice) slots by expert and pad each expert's run to BLOCK_M.

topk_ids [T, k] holds numel = T * k slots; slot s is token s // k, choice s % k. The grouped
GEMMs walk blocks of BLOCK_M slots that all go to one expert, so this builds

    sorted_ids      [max_blocks * BLOCK_M] int32  slots grouped by expert (ascending expert id,
                                                  ascending slot id within an expert), each
                                                  expert's run padded to a multiple of BLOCK_M
                                                  with `numel` (a slot id past the end)
    expert_ids      [max_blocks] int32            the expert of each block; -1 past the end
    num_post_padded [1] int32                     sum over experts of roundup(count, BLOCK_M)

Sizes come from shapes only (worst case numel + min(E, numel) * (BLOCK_M - 1) slots), and nothing
is read back to the host, so it is CUDA-graph capturable. Experts without tokens get no block.
The order within an expert is fixed (no atomics): the same ids give the same layout.

Small batches (decode: numel * E_P2 <= 16384, e.g. up to 16 tokens of top-8 over 128 experts)
take one launch, `_align_small_kernel`: one program holds the whole one-hot matrix, fills the
padding, and scatters. Larger ones take four launches, P = cdiv(numel, CHUNK) chunks of the flat ids:
  count   grid (P,):  counts[e, p] = slots of chunk p routed to e
  scan    grid (E,):  offsets[e, p] = slots of e in chunks before p; totals[e]
  layout  grid (1,):  starts[e] (padded exclusive cumsum), num_post_padded, expert_ids
  scatter grid (P,):  sorted_ids[starts[e] + offsets[e, p] + rank in chunk] = slot
A chunk's one-hot matrix [CHUNK, E_P2] gives both its counts and each slot's rank among the
chunk's slots of the same expert (a cumsum down the chunk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Batch-size dependent ints are not specialised (divisibility by 16): one compile per shape family.
@triton.jit(do_not_specialize=["numel", "P"])
def _align_count_kernel(Ids, Counts, numel, E, P, CHUNK: tl.constexpr, E_P2: tl.constexpr):
    p = tl.program_id(0)
    offs = p * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(Ids + offs, mask=offs < numel, other=-1)  # [CHUNK]; -1 matches no expert
    offs_e = tl.arange(0, E_P2)
    onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [CHUNK, E_P2]
    tl.store(Counts + offs_e.to(tl.int64) * P + p, tl.sum(onehot, 0), mask=offs_e < E)


@triton.jit(do_not_specialize=["P"])
def _align_scan_kernel(Counts, Offsets, Totals, P, BLOCK_P: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    carry = tl.zeros([], dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        mask = offs < P
        c = tl.load(Counts + e * P + offs, mask=mask, other=0)  # [BLOCK_P]
        tl.store(Offsets + e * P + offs, carry + tl.cumsum(c, 0) - c, mask=mask)
        carry += tl.sum(c, 0)
    tl.store(Totals + e, carry)


@triton.jit(do_not_specialize=["max_blocks"])
def _align_layout_kernel(Totals, Starts, ExpertIds, NumPostPadded, E, max_blocks,
                         BLOCK_M: tl.constexpr, E_P2: tl.constexpr, BLOCK_B: tl.constexpr):
    offs_e = tl.arange(0, E_P2)
    mask_e = offs_e < E
    total = tl.load(Totals + offs_e, mask=mask_e, other=0)
    padded = tl.cdiv(total, BLOCK_M) * BLOCK_M  # [E_P2]
    ends = tl.cumsum(padded, 0)  # expert e owns sorted positions [ends[e] - padded[e], ends[e])
    tl.store(Starts + offs_e, ends - padded, mask=mask_e)
    num_padded = tl.sum(padded, 0)
    tl.store(NumPostPadded, num_padded)
    for b0 in range(0, max_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        first = blocks * BLOCK_M  # [BLOCK_B] first sorted position of each block
        # experts that end at or before `first` (empty ones included) = index of the block's expert
        before = tl.sum(((ends[None, :] <= first[:, None]) & mask_e[None, :]).to(tl.int32), 1)
        expert = tl.where(first < num_padded, before, -1)
        tl.store(ExpertIds + blocks, expert, mask=blocks < max_blocks)


@triton.jit(do_not_specialize=["numel", "P"])
def _align_scatter_kernel(Ids, Starts, Offsets, SortedIds, numel, P, CHUNK: tl.constexpr, E_P2: tl.constexpr):
    p = tl.program_id(0)
    offs = p * CHUNK + tl.arange(0, CHUNK)
    mask = offs < numel
    ids = tl.load(Ids + offs, mask=mask, other=-1)  # [CHUNK]
    offs_e = tl.arange(0, E_P2)
    onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [CHUNK, E_P2]
    rank = tl.sum(tl.cumsum(onehot, 0) * onehot, 1) - 1  # [CHUNK] earlier slots of the same expert in the chunk
    expert = tl.where(mask, ids, 0).to(tl.int64)
    base = tl.load(Starts + expert, mask=mask, other=0) + tl.load(Offsets + expert * P + p, mask=mask, other=0)
    tl.store(SortedIds + base + rank, offs, mask=mask)


@triton.jit(do_not_specialize=["numel", "max_blocks"])
def _align_small_kernel(Ids, SortedIds, ExpertIds, NumPostPadded, numel, E, max_blocks,
                        BLOCK_M: tl.constexpr, N_P2: tl.constexpr, E_P2: tl.constexpr, BLOCK_B: tl.constexpr,
                        BLOCK_FILL: tl.constexpr):
    offs = tl.arange(0, N_P2)
    mask = offs < numel
    ids = tl.load(Ids + offs, mask=mask, other=-1)  # [N_P2]
    offs_e = tl.arange(0, E_P2)
    mask_e = offs_e < E
    onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [N_P2, E_P2]
    padded = tl.cdiv(tl.sum(onehot, 0), BLOCK_M) * BLOCK_M  # [E_P2]
    ends = tl.cumsum(padded, 0)
    num_padded = tl.sum(padded, 0)
    tl.store(NumPostPadded, num_padded)
    for b0 in range(0, max_blocks, BLOCK_B):  # as _align_layout_kernel
        blocks = b0 + tl.arange(0, BLOCK_B)
        first = blocks * BLOCK_M
        before = tl.sum(((ends[None, :] <= first[:, None]) & mask_e[None, :]).to(tl.int32), 1)
        tl.store(ExpertIds + blocks, tl.where(first < num_padded, before, -1), mask=blocks < max_blocks)
    for p0 in range(0, max_blocks * BLOCK_M, BLOCK_FILL):
        fill = p0 + tl.arange(0, BLOCK_FILL)
        tl.store(SortedIds + fill, tl.zeros([BLOCK_FILL], dtype=tl.int32) + numel, mask=fill < max_blocks * BLOCK_M)
    tl.debug_barrier()  # the padding fill lands before the scatter overwrites real positions (one CTA)
    rank = tl.sum(tl.cumsum(onehot, 0) * onehot, 1) - 1  # [N_P2]
    start = tl.sum(onehot * (ends - padded)[None, :], 1)  # [N_P2] first position of each slot's expert
    tl.store(SortedIds + start + rank, offs, mask=mask)


def max_blocks_for(numel: int, num_experts: int, block_m: int) -> int:
    """Worst-case block count: at most min(E, numel) experts are hit, each padding up to BLOCK_M - 1 slots."""
    return triton.cdiv(numel + min(num_experts, numel) * (block_m - 1), block_m)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int, single_program: bool | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int32 (contiguous, values in [0, num_experts)) ->
    (sorted_ids [max_blocks * block_m], expert_ids [max_blocks], num_post_padded [1]), all int32.

    `single_program`: force (True) or forbid (False) the one-launch path; None picks by size."""
    assert topk_ids.dim() == 2 and topk_ids.dtype == torch.int32 and topk_ids.is_contiguous(), (
        f"topk_ids must be contiguous [T, k] int32, got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    assert num_experts >= 1 and block_m >= 1 and block_m & (block_m - 1) == 0, (
        f"num_experts {num_experts} >= 1, block_m {block_m} a power of 2")
    device = topk_ids.device
    numel = topk_ids.numel()
    max_blocks = max_blocks_for(numel, num_experts, block_m)
    expert_ids = torch.empty((max_blocks,), dtype=torch.int32, device=device)
    if numel == 0:
        return (torch.empty((0,), dtype=torch.int32, device=device), expert_ids,
                torch.zeros((1,), dtype=torch.int32, device=device))
    e_p2 = triton.next_power_of_2(num_experts)
    n_p2 = triton.next_power_of_2(numel)
    if single_program if single_program is not None else n_p2 * e_p2 <= 16384:
        sorted_ids = torch.empty((max_blocks * block_m,), dtype=torch.int32, device=device)
        num_post_padded = torch.empty((1,), dtype=torch.int32, device=device)
        _align_small_kernel[(1,)](topk_ids, sorted_ids, expert_ids, num_post_padded, numel, num_experts, max_blocks,
                                  BLOCK_M=block_m, N_P2=n_p2, E_P2=e_p2, BLOCK_B=max(1, min(64, 4096 // e_p2)),
                                  BLOCK_FILL=1024, num_warps=8)
        return sorted_ids, expert_ids, num_post_padded
    sorted_ids = torch.full((max_blocks * block_m,), numel, dtype=torch.int32, device=device)
    num_post_padded = torch.empty((1,), dtype=torch.int32, device=device)
    chunk = max(16, min(1024, 8192 // e_p2))  # one-hot [CHUNK, E_P2] of 8192 ints per program
    num_chunks = triton.cdiv(numel, chunk)
    counts = torch.empty((num_experts, num_chunks), dtype=torch.int32, device=device)
    offsets = torch.empty_like(counts)
    totals = torch.empty((num_experts,), dtype=torch.int32, device=device)
    starts = torch.empty_like(totals)
    _align_count_kernel[(num_chunks,)](topk_ids, counts, numel, num_experts, num_chunks,
                                       CHUNK=chunk, E_P2=e_p2, num_warps=4)
    _align_scan_kernel[(num_experts,)](counts, offsets, totals, num_chunks,
                                       BLOCK_P=min(1024, triton.next_power_of_2(num_chunks)), num_warps=1)
    _align_layout_kernel[(1,)](totals, starts, expert_ids, num_post_padded, num_experts, max_blocks,
                               BLOCK_M=block_m, E_P2=e_p2, BLOCK_B=max(1, min(64, 4096 // e_p2)), num_warps=4)
    _align_scatter_kernel[(num_chunks,)](topk_ids, starts, offsets, sorted_ids, numel, num_chunks,
                                         CHUNK=chunk, E_P2=e_p2, num_warps=4)
    return sorted_ids, expert_ids, num_post_padded


def moe_align_block_size_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same layout in plain torch (a stable sort of the flat ids), same sizes and padding values."""
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    max_blocks = max_blocks_for(numel, num_experts, block_m)
    sorted_ids = torch.full((max_blocks * block_m,), numel, dtype=torch.int32)
    expert_ids = torch.full((max_blocks,), -1, dtype=torch.int32)
    order = torch.argsort(flat.cpu(), stable=True)
    counts = torch.bincount(flat.cpu(), minlength=num_experts).tolist()
    pos = src = 0
    for expert, count in enumerate(counts):
        sorted_ids[pos:pos + count] = order[src:src + count].to(torch.int32)
        blocks = triton.cdiv(count, block_m)
        expert_ids[pos // block_m:pos // block_m + blocks] = expert
        pos += blocks * block_m
        src += count
    device = topk_ids.device
    return sorted_ids.to(device), expert_ids.to(device), torch.tensor([pos], dtype=torch.int32, device=device)
